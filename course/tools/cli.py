"""The course's command line: ``python -m course COMMAND`` (or ``capture-replay COMMAND``).

  doctor            check the environment, say which path the course takes and how to fix problems
  run               execute the lessons and labs headless into build/ (notebooks + HTML + summary;
                    --answers: the answer versions too)
  bench             run the GPU experiments on a real GPU and write reference data
  build-labs        regenerate the learner versions (labs/, the lessons in notebooks/) from solutions/
  check NOTEBOOK    run a notebook in a fresh kernel and report each check; exit 1 on a ✗ or an
                    exercise not reached (--answers: also on "not done yet"; --show-answer EXERCISE:
                    that exercise's answer too)
  grade DIR         run every notebook under DIR; write grades.csv and feedback/STUDENT.html
  verify-embedding  the embedding capture report (--impl cpu-copy|device)
  workspace         copy the lessons and labs into work/ (yours to edit); --lab opens JupyterLab there
"""
from __future__ import annotations

import argparse
import sys


def _doctor(args) -> int:
    from course.tools.doctor import main as doctor_main
    return doctor_main(json_out=args.json)


def _run(args) -> int:
    from course.tools.render import main as render_main
    return render_main(out=args.out, only=args.only, timeout=args.timeout, jobs=args.jobs, answers=args.answers)


def _bench(args) -> int:
    from course.core.reference import bench
    from course.core.runtime import CourseEnvironmentError
    try:
        bench(args.names or None, out_dir=args.out, quick=args.quick)
    except (RuntimeError, CourseEnvironmentError) as e:
        print(f"course bench: {e}", file=sys.stderr)
        return 2
    return 0


def _build_labs(args) -> int:
    from course.tools.learner_versions import build_labs
    return build_labs(check=args.check)


def _check(args) -> int:
    from course.tools.grade import check_notebook
    return check_notebook(args.notebook, timeout=args.timeout, total_timeout=args.total_timeout, answers=args.answers,
                          show_answer=args.show_answer)


def _grade(args) -> int:
    from course.tools.grade import grade
    return grade(args.folder, out=args.out, cell_timeout=args.cell_timeout, total_timeout=args.total_timeout)


def _verify(args) -> int:
    from course.embedding.verify import main as verify_main
    return verify_main(impl=args.impl)


def _workspace(args) -> int:
    from course.tools.workspace import main as workspace_main
    return workspace_main(lab=args.lab, reset=args.reset, port=args.port, ip=args.ip, dest=args.dir)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for tests)."""
    p = argparse.ArgumentParser(prog="python -m course", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("doctor", help="check the environment")
    d.add_argument("--json", action="store_true", help="print the report as JSON")
    d.set_defaults(func=_doctor)
    r = sub.add_parser("run", help="execute the lessons and labs into build/")
    r.add_argument("--out", default="build", help="output folder (default: build)")
    r.add_argument("--only", nargs="*", default=None, help="notebook paths to run "
                                                           "(default: the lessons and labs)")
    r.add_argument("--answers", action="store_true", help="the answer versions (solutions/) too")
    r.add_argument("--timeout", type=int, default=900, help="per-cell timeout in seconds")
    r.add_argument("--jobs", type=int, default=None,
                   help="notebooks executed at once (default: 2 on "
                        "the simulator path with 2+ CPUs, 1 on a GPU)")
    r.set_defaults(func=_run)
    b = sub.add_parser("bench", help="write reference data (GPU only)")
    b.add_argument("names", nargs="*", help="experiments to run (default: on 1 GPU the single-GPU "
                   "experiments, on 2+ GPUs the multi-GPU ones)")
    b.add_argument("--out", default=None, help="folder to write to (default: course/reference)")
    b.add_argument("--quick", action="store_true", help="small sizes (smoke test; "
                                                        "not for committing)")
    b.set_defaults(func=_bench)
    bl = sub.add_parser("build-labs", help="regenerate the learner versions "
                                           "(labs/, notebooks/NN_*) from solutions/")
    bl.add_argument("--check", action="store_true", help="only check that labs/ is "
                                                         "in sync; exit 1 if not")
    bl.set_defaults(func=_build_labs)
    c = sub.add_parser("check", help="run a notebook and report its checks")
    c.add_argument("notebook")
    c.add_argument("--timeout", type=int, default=600, help="per-cell timeout in seconds")
    c.add_argument("--total-timeout", type=int, default=None, help="limit for the whole notebook in seconds")
    c.add_argument("--answers", action="store_true", help="judge an answer version: 'not done yet' "
                   "fails too (every exercise must pass, or be skipped with a reason)")
    c.add_argument("--show-answer", action="append", default=[], metavar="EXERCISE",
                   help="also print this exercise's answer (its name or the start of it, e.g. "
                        "02.3; repeatable). The hints teach; the answer comes only when asked for")
    c.set_defaults(func=_check)
    g = sub.add_parser("grade", help="run every submitted notebook in "
                                     "DIR; write a CSV and feedback pages")
    g.add_argument("folder")
    g.add_argument("--out", default=None, help="output folder (default: DIR/graded)")
    g.add_argument("--cell-timeout", type=int, default=120, help="per-cell limit in seconds (default 120)")
    g.add_argument("--total-timeout", type=int, default=600, help="per-notebook limit in seconds (default 600)")
    g.set_defaults(func=_grade)
    v = sub.add_parser("verify-embedding", help="embedding capture report")
    v.add_argument("--impl", choices=["cpu-copy", "device"], required=True)
    v.set_defaults(func=_verify)
    w = sub.add_parser("workspace", help="your copies of the lessons and labs, in work/")
    w.add_argument("--lab", action="store_true", help="then start JupyterLab there "
                                                      "(headless; prints the URL)")
    w.add_argument("--reset", nargs="*", default=[], metavar="NAME", help="replace these copies with fresh ones")
    w.add_argument("--port", type=int, default=8888, help="JupyterLab's port (default 8888)")
    w.add_argument("--ip", default="127.0.0.1", help="JupyterLab's address (default 127.0.0.1)")
    w.add_argument("--dir", default=None, help="where the workspace lives (default: "
                                               "work/ in the course's folder)")
    w.set_defaults(func=_workspace)
    return p


def main(argv=None) -> int:
    """Entry point; returns the exit code."""
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
