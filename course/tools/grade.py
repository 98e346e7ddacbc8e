"""``course check NOTEBOOK`` and ``course grade DIR``: run learners' notebooks and report every
exercise.

A notebook runs in a fresh kernel (each cell under a time limit, the whole under a total one) with
``COURSE_CHECK_LOG`` set; each exercise ends ``pass``, ``fail``, ``crash``, ``todo``, ``skip``
(worth 0 of 0), ``timed out`` or ``not reached`` (with why). ``course grade`` writes ``grades.csv``
and one ``feedback/STUDENT.html`` per student (points from nbgrader's metadata, else 1). ``course
check`` shows what the notebook shows; staged hints advance from one run to the next
(``.course_hints.json``, not with ``--answers``); an answer is printed only for ``--show-answer
NAME``, never with ``COURSE_ANSWERS=off``.
"""
from __future__ import annotations

import csv
import html
import json
import os
import tempfile
import time
from pathlib import Path

import nbformat

from course.tools.exercises import course_checks, exercise_cells, exercise_names, module_constants  # noqa: F401
from course.tools.hints import load_hint_state, save_hint_state
from course.core.reaper import kernel_groups, killed_on_signal
from course.tools.render import KERNEL_ARGS, expose_course_to_kernels

STATUSES = ("pass", "fail", "crash", "todo", "skip", "timed out", "not reached")
_MARK = {"pass": "✓", "fail": "✗", "crash": "✗", "todo": "…", "skip": "-", "timed out": "⏱", "not reached": "?"}
_WORDS = {"pass": "passed", "fail": "failed", "crash": "crashed", "todo": "not done yet", "skip": "skipped",
          "timed out": "timed out", "not reached": "not reached"}


def _error(cell):
    for o in cell.get("outputs", []):
        if o.get("output_type") == "error":
            return o.get("ename", "Error"), (o.get("evalue", "") or "").splitlines()[0] if o.get("evalue") else ""
    return None


def _points(cell) -> float:
    meta = cell.get("metadata", {}).get("nbgrader", {})
    return float(meta.get("points", 1)) if meta.get("grade") else 1.0


def run_checks(path, cell_timeout: int = 600, total_timeout: int | None = None, stages: dict | None = None,
               show=()) -> dict:
    """Run the notebook at ``path`` in a fresh kernel: ``{"exercises": [rows], "stray": [(cell,
    ename, evalue)], "error", "seconds"}``. ``stages``: ✗ per exercise so far (where staged hints
    start); ``show``: exercises whose answer this run prints. Raises OSError/ValueError for an
    unreadable file."""
    from nbclient import NotebookClient
    from nbclient.exceptions import DeadKernelError

    from course.core.answers import ENV_SHOW
    from course.core.checks import ENV_LOG, ENV_STAGES, PASS
    from course.core.isolate import env_set

    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    cells = exercise_cells(nb)
    fd, log_path = tempfile.mkstemp(prefix="course-check-", suffix=".jsonl")
    os.close(fd)
    # the kernel inherits these: this run's log, and only this run's stages and answers asked for
    # (never stale ones)
    env = env_set({ENV_LOG: log_path, ENV_STAGES: json.dumps(stages) if stages else None,
                   ENV_SHOW: json.dumps(list(show)) if show else None})
    expose_course_to_kernels()  # the kernel imports this checkout's course, installed or not
    start, stopped, ran = time.monotonic(), None, set()
    deadline = start + total_timeout if total_timeout else None
    client = NotebookClient(nb, timeout=cell_timeout, allow_errors=True, interrupt_on_timeout=True,
                            kernel_name="python3", extra_arguments=list(KERNEL_ARGS),
                            resources={"metadata": {"path": str(path.parent.resolve())}})
    with env:
        try:
            client.reset_execution_trackers()
            with client.setup_kernel(cwd=str(path.parent.resolve())), \
                    killed_on_signal(lambda: kernel_groups(client), f"check {path.name}"):
                for i, cell in enumerate(nb.cells):
                    if cell.cell_type != "code":
                        continue
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 1:
                        stopped = f"the notebook's time limit ({total_timeout} s) ran out before cell {i}"
                        break
                    client.timeout = int(min(cell_timeout, left)) if left is not None else cell_timeout
                    try:
                        client.execute_cell(cell, i, execution_count=client.code_cells_executed + 1)
                    except DeadKernelError:
                        stopped = f"the kernel died in cell {i}"
                        ran.add(i)
                        break
                    ran.add(i)
        except Exception as e:  # noqa: BLE001 - a kernel that cannot start: say so
            stopped = stopped or f"the notebook could not be run: {type(e).__name__}: {e}"
        finally:
            text = Path(log_path).read_text(encoding="utf-8") if Path(log_path).exists() else ""
            Path(log_path).unlink(missing_ok=True)

    outcome = {}
    for line in text.splitlines():
        if line.strip():
            e = json.loads(line)
            outcome[e["name"]] = e  # the last outcome of each check wins (a cell re-run)
    exercises = []
    for name in list(cells) + [n for n in outcome if n not in cells]:
        i = cells.get(name)
        maxp = _points(nb.cells[i]) if i is not None else 1.0
        e = outcome.get(name)
        err = _error(nb.cells[i]) if i is not None else None
        if err and err[0] == "KeyboardInterrupt":
            row = {"status": "timed "
                             "out", "message": f"cell {i} was interrupted after its time limit "
                                                     f"({client.timeout} s): an endless loop?"}
        elif e is not None:
            row = {k: e.get(k, "") for k in ("status", "message", "hint", "where", "why", "answer")}
            row["failures"] = e.get("failures", 0)
        elif err:
            row = {"status": "not reached", "message": f"cell {i} raised {err[0]}: {err[1]} before "
                                                       "the check ran"}
        elif i is not None and i not in ran:
            row = {"status": "not reached", "message": stopped or f"cell {i} did not run"}
        else:
            row = {"status": "not reached", "message": "its cell ran but the check "
                                                       "did not (inside an if?)"}
        row = {"name": name, "hint": "", "where": "", "why": "", "answer": "", **row, "max_points": maxp}
        row.setdefault("failures", (stages or {}).get(name, 0))
        if row["status"] == "skip":
            maxp = 0.0  # cannot be done on this machine: not counted
        row["max_points"] = maxp
        row["points"] = maxp if row["status"] == PASS else 0.0
        exercises.append(row)
    # a check that re-raised its ✗
    failed = {x["name"] for x in exercises if x["status"] not in (PASS, "skip")}
    stray = []
    for i, cell in enumerate(nb.cells):
        err = _error(cell)
        if err and not (err[0] == "ExerciseFailed" and any(err[1].startswith(f"{n}:") for n in failed)) \
                and i not in cells.values():
            stray.append((i, *err))
    return {"exercises": exercises, "stray": stray, "error": stopped, "seconds": time.monotonic() - start}


def judge(exercises, answers: bool = False) -> list:
    """The exercises (dicts with name, status, message) that fail the verdict, each as one line of
    why.

    Failed, crashed, timed out and not reached always fail; with ``answers=True`` (an answer
    version) so do "not done yet" and a skip that gives no reason. Passed and skipped with a reason
    never do.
    """
    bad = {"fail", "crash", "timed out", "not reached"} | ({"todo"} if answers else set())
    out = []
    for x in exercises:
        if x["status"] in bad:
            out.append(f"{_MARK[x['status']]} {x['name']}: {_WORDS[x['status']]}"
                       + (f": {x['message']}" if x.get("message") else ""))
        elif answers and x["status"] == "skip" and not (x.get("message") or "").strip():
            out.append(f"- {x['name']}: skipped without a reason "
                       "(checks.skip(name, why) must say why)")
    return out


def check_notebook(path, timeout: int = 600, total_timeout: int | None = None, answers: bool = False,
                   show_answer=()) -> int:
    """Run the notebook at ``path`` in a fresh kernel and print each exercise's status, stray cell
    errors and a verdict (staged hints go on from the last run, except with ``answers``).
    ``show_answer``: the exercises (names or their start) whose answer to print too. Returns 1 on a
    ✗, a time-out, an exercise not reached or a cell error (with ``answers`` also "not done yet"), 0
    otherwise, 2 when the file cannot be read or ``show_answer`` names no exercise of it."""
    from course.core.answers import answers_off, match

    path = Path(path)
    try:
        nb = nbformat.read(path, as_version=4)
    except Exception as e:  # noqa: BLE001 - OSError, bad JSON, schema errors: all "cannot read"
        print(f"check: cannot read {path}: {type(e).__name__}: "
              f"{str(e).splitlines()[0] if str(e) else ''}")
        return 2
    show = []
    if show_answer and answers_off():
        print("check: answers are turned off for this course (COURSE_ANSWERS=off): the hints are "
              "all there is.")
        return 2
    for query in show_answer:
        found = match(query, exercise_names(nb))
        if len(found) != 1:
            print(f"check: --show-answer {query!r} names {'more than one' if found else 'no'} "
                  f"exercise of {path}; "
                  f"choose one of: {', '.join(found or exercise_names(nb)) or '(it has none)'}")
            return 2
        show += found
    print(f"check: running {path} in a fresh kernel (up to {timeout} s per cell) ...")
    rep = run_checks(path, cell_timeout=timeout, total_timeout=total_timeout,
                     stages=None if answers else load_hint_state(path), show=show)
    unsaved = None if answers else save_hint_state(path, rep["exercises"])
    print()
    counts = {s: 0 for s in STATUSES}
    for x in rep["exercises"]:
        counts[x["status"]] += 1
        line = f"  {_MARK[x['status']]} {x['name']}"
        if x["status"] == "pass":
            print(line + ": passed" + (f" - {x['message']}" if x.get("message") else ""))
            if x.get("answer"):
                print(f"      answer (you asked for it): {x['answer']}")
            continue
        print(line + f": {_WORDS[x['status']]}" + (f": {x['message']}" if x["message"] else ""))
        for key, label in (("where", "your line"), ("why", "why"), ("hint", "hint"),
                           ("answer", "answer (you asked for it)")):
            if x.get(key):
                print(f"      {label}: {x[key]}")
    for i, ename, evalue in rep["stray"]:
        kind = "timed out" if ename == "KeyboardInterrupt" else f"raised {ename}"
        print(f"  ✗ cell {i} {kind}: {evalue}")
    if rep["error"]:
        print(f"  ! {rep['error']}")
    if unsaved:
        print(f"  (the hints cannot advance: {unsaved})")
    total = len(rep["exercises"])
    print()
    print(f"check: {counts['pass']}/{total} passed, {counts['fail']} "
          f"failed, {counts['crash']} crashed, {counts['todo']} not done yet"
          + "".join(f", {counts[s]} "
                    f"{_WORDS[s]}" for s in ("skip", "timed out", "not reached") if counts[s])
          + (f", {len(rep['stray'])} cell error(s)" if rep["stray"] else ""))
    if total == 0:
        print("check: this notebook has no exercise checks.")
        return 0 if not rep["stray"] and not rep["error"] else 1
    bad = judge(rep["exercises"], answers=answers)
    if bad or rep["stray"]:
        print(f"check: FAIL ({len(bad)} "
              "exercise(s)" + (f", {len(rep['stray'])} cell error(s)" if rep["stray"] else "")
              + (")" if answers else "; 'not done yet' is allowed here: add --answers to require "
                                     "every exercise)"))
        return 1
    if counts["todo"]:
        print(f"check: OK, with {counts['todo']} not done yet (exit 0; --answers fails on them)")
    elif counts["skip"] and not counts["pass"]:
        print("check: every exercise was skipped on this machine (see why above); none failed.")
    elif counts["skip"]:
        print(f"check: all {counts['pass']} exercise(s) that run on this machine passed "
              f"({counts['skip']} skipped here, see why above).")
    else:
        print(f"check: all {total} exercises "
              "passed." if total > 1 else "check: the exercise passed.")
    return 0


def _student(path: Path, root: Path) -> str:
    rel = path.relative_to(root)
    return rel.parts[0] if len(rel.parts) > 1 else path.stem


def feedback_html(student: str, reports: list) -> str:
    """One student's feedback page: per notebook, each exercise's status, message, line and hint."""
    e = html.escape
    parts = [f"<!doctype html><meta charset='utf-8'><title>Feedback: {e(student)}</title>",
             "<style>body{font-family:sans-serif;max-width:60em}td,th{padding:.3em "
             ".6em;border-bottom:1px solid #ddd;"
             "vertical-align:top;text-align:left}.pass{color:#070}.fail,.crash,.timed{color:#b00}</style>",
             f"<h1>Feedback for {e(student)}</h1>"]
    for nb_name, rep in reports:
        got = sum(x["points"] for x in rep["exercises"])
        top = sum(x["max_points"] for x in rep["exercises"])
        parts.append(f"<h2>{e(nb_name)}: {got:g} / {top:g} points</h2>")
        if rep["error"]:
            parts.append(f"<p><b>Note:</b> {e(rep['error'])}</p>")
        parts.append("<table><tr><th></th><th>exercise</th><th>status</th><th>points</th><th>what "
                     "the check said</th></tr>")
        for x in rep["exercises"]:
            detail = e(x["message"] or "")
            if x.get("where"):
                detail += f"<br><code>{e(x['where'])}</code>"
            if x.get("why"):
                detail += f"<br>why: {e(x['why'])}"
            if x.get("hint"):
                detail += f"<br><i>hint: {e(x['hint'])}</i>"
            parts.append(f"<tr class='{x['status'].split()[0]}'><td>{_MARK[x['status']]}</td><td>{e(x['name'])}</td>"
                         f"<td>{_WORDS[x['status']]}</td><td>{x['points']:g}/{x['max_points']:g}</td>"
                         f"<td>{detail}</td></tr>")
        parts.append("</table>")
        for i, ename, evalue in rep["stray"]:
            parts.append(f"<p>cell {i} raised {e(ename)}: {e(evalue)}</p>")
    return "\n".join(parts) + "\n"


def grade(folder, *, out=None, cell_timeout: int = 120, total_timeout: int = 600) -> int:
    """Run every notebook under ``folder``; write ``grades.csv`` and ``feedback/STUDENT.html`` into
    ``out``.

    ``out`` defaults to ``folder/graded``. Each notebook gets ``cell_timeout`` seconds per cell
    and ``total_timeout`` seconds in all. Returns 0, or 2 when there is nothing to grade.
    """
    root = Path(folder).resolve()
    out = Path(out) if out is not None else root / "graded"
    paths = sorted(p for p in root.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts
                   and out.resolve() not in p.resolve().parents)
    if not paths:
        print(f"grade: no notebooks under {root}")
        return 2
    (out / "feedback").mkdir(parents=True, exist_ok=True)
    by_student, rows = {}, []
    for p in paths:
        student = _student(p, root)
        print(f"grade: {student}: {p.relative_to(root)} ...", flush=True)
        try:
            rep = run_checks(p, cell_timeout=cell_timeout, total_timeout=total_timeout)
        except Exception as e:  # noqa: BLE001 - an unreadable submission is graded, not fatal
            rep = {"exercises": [], "stray": [], "error": f"cannot read: {type(e).__name__}: "
                                                          f"{e}", "seconds": 0.0}
        by_student.setdefault(student, []).append((p.name, rep))
        for x in rep["exercises"]:
            rows.append({"student": student, "notebook": p.name, "exercise": x["name"], "status": x["status"],
                         "points": x["points"], "max_points": x["max_points"], "message": x["message"]})
        if rep["error"] and not rep["exercises"]:
            rows.append({"student": student, "notebook": p.name, "exercise": "", "status": "not reached",
                         "points": 0, "max_points": 0, "message": rep["error"]})
        print("grade: "
              f"{student}: " + ", ".join(f"{x['name']} {x['status']}" for x in rep["exercises"])
              + f" ({rep['seconds']:.0f} s)")
    with open(out / "grades.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=["student", "notebook", "exercise", "status", "points", "max_points",
                                          "message"])
        w.writeheader()
        w.writerows(rows)
    for student, reports in by_student.items():
        (out / "feedback" / f"{student}.html").write_text(feedback_html(student, reports), encoding="utf-8")
    print(f"grade: wrote {out / 'grades.csv'} and {len(by_student)} feedback page(s) in "
          f"{out / 'feedback'}")
    return 0
