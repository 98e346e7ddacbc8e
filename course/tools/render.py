"""``python -m course run``: execute the lessons and labs headless (``--answers``: the answer
versions too) and write what they showed.

Writes, under ``build/`` (or ``--out``):
- ``executed/<folder>/<name>.ipynb``: each notebook with its outputs,
- ``html/<folder>/<name>.html``: the same as HTML,
- ``summary.md`` and ``summary.json``: which path each ran on, pass/fail, wall time;
- the files the notebooks link to (``CAPTURE_RULES.md``), beside both, so every link resolves there
  (in ``html/`` their links to notebooks point at the ``.html`` pages; :mod:`course.tools.links`).
Notebooks are committed without outputs; this is how executed copies are made.
"""
from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

from course.tools.catalog import CATALOG, ROOT
from course.tools.links import copy_linked


# Kernels log at ERROR level: keeps "Kernel is running over TCP without encryption" out of the
# progress bar.
KERNEL_ARGS = ["--IPKernelApp.log_level=ERROR"]
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def plain(text: str) -> str:
    """``text`` without ANSI colour codes (tracebacks from a kernel carry them)."""
    return _ANSI.sub("", text)


def prepend_env_path(name: str, entry: str) -> None:
    """Put ``entry`` first on the path-list environment variable ``name`` (once; later entries are
    kept)."""
    parts = [p for p in os.environ.get(name, "").split(os.pathsep) if p]
    if entry not in parts:
        os.environ[name] = os.pathsep.join([entry] + parts)


def nbconvert_share_dir() -> Path | None:
    """``DIR/share/jupyter`` when nbconvert's templates sit beside the package (``pip install
    --target DIR``).

    None when nbconvert is not importable or its templates are not there (a normal install keeps
    them under ``sys.prefix``, where nbconvert looks by itself).
    """
    try:
        import nbconvert
    except ImportError:
        return None
    share = Path(nbconvert.__file__).resolve().parents[1] / "share" / "jupyter"
    return share if (share / "nbconvert" / "templates").is_dir() else None


def expose_nbconvert_templates() -> Path | None:
    """Put nbconvert's templates on ``JUPYTER_PATH`` when it was installed with ``--target``;
    returns the folder.

    Without this, HTML export fails with "No template sub-directory with name 'lab' found". The test
    suite (conftest.py, for nbval's kernels) and ``course run`` (before writing HTML) both call it.
    """
    share = nbconvert_share_dir()
    if share is not None:
        prepend_env_path("JUPYTER_PATH", str(share))
    return share


def expose_course_to_kernels() -> None:
    """Let notebook kernels import this checkout's ``course`` and nbconvert find its templates,
    installed or not.

    Kernels start in a notebook's folder: with this checkout first on ``PYTHONPATH`` they import it
    even where the course is not installed (the GPU lane); see :func:`expose_nbconvert_templates`
    for the templates.
    """
    prepend_env_path("PYTHONPATH", str(ROOT))
    expose_nbconvert_templates()


def execute(path: Path, timeout: int = 900, env: dict | None = None):
    """Execute one notebook in a fresh kernel (cwd = its folder); returns (nb, error or None)."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", extra_arguments=list(KERNEL_ARGS),
                            resources={"metadata": {"path": str(path.parent)}})
    saved = dict(os.environ)
    os.environ.update(env or {})
    expose_course_to_kernels()
    # A non-interactive MPLBACKEND (Agg, set by test runners) would keep figures out of the
    # notebook.
    os.environ.pop("MPLBACKEND", None)
    try:
        client.execute()
        return nb, None
    except (CellExecutionError, CellTimeoutError, DeadKernelError) as e:
        msg = plain(str(e)).strip()
        return nb, msg.splitlines()[-1] if msg else type(e).__name__
    finally:
        os.environ.clear()
        os.environ.update(saved)


def to_html(nb) -> tuple[str | None, str | None]:
    """The notebook as HTML, or (None, reason) when nbconvert cannot export (e.g. missing
    templates)."""
    # nbconvert installed with pip --target keeps its templates beside it
    expose_nbconvert_templates()
    try:
        from nbconvert import HTMLExporter
        body, _ = HTMLExporter().from_notebook_node(nb)
        return body, None
    except Exception as e:  # noqa: BLE001 - the executed notebook is still written
        return None, f"{type(e).__name__}: {str(e).splitlines()[0]}"


def default_jobs(on_gpu: bool, cpus: int | None = None) -> int:
    """How many notebooks ``course run`` executes at once by default: 1 on the GPU path (its live
    measurements must not share the GPU), else 2 where there are 2 or more CPUs (a notebook's kernel
    often waits on worker processes, so two side by side pay on two cores), else 1."""
    cpus = os.cpu_count() if cpus is None else cpus
    return 1 if on_gpu or (cpus or 1) < 2 else 2


def thread_share(jobs: int, cpus: int | None = None) -> int:
    """Threads each of ``jobs`` side-by-side processes gets (``OMP_NUM_THREADS``): the CPUs shared
    out, at least 1. Two kernels each running torch on every core of a 2-core machine took 7x
    longer (lesson 06's notebooks: 225 s, against 30 s with one thread each)."""
    cpus = os.cpu_count() if cpus is None else cpus
    return max(1, (cpus or 1) // max(1, jobs))


def run_one(path: str, rel: str, out_dir: str, timeout: int = 900) -> dict:
    """Execute the notebook at ``path`` (catalog path ``rel``) and write its executed copy and HTML
    under ``out_dir``; its row of the summary. Runs in a worker process when ``course run`` executes
    several at once."""
    import nbformat

    out = Path(out_dir)
    t0 = time.perf_counter()
    nb, err = execute(Path(path), timeout=timeout)
    secs = time.perf_counter() - t0
    exe, html = out / "executed" / rel, out / "html" / Path(rel).with_suffix(".html")
    exe.parent.mkdir(parents=True, exist_ok=True)
    html.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, exe)
    body, html_err = to_html(nb)
    if body is not None:
        html.write_text(body, encoding="utf-8")
    return {"notebook": rel, "status": "passed" if err is None else "failed", "seconds": round(secs, 1),
            "error": err, "html": str(html.relative_to(out)) if body is not None else None, "html_error": html_err}


def _rows(todo: list, out_dir: Path, timeout: int, jobs: int, tqdm):
    """Yield the summary row of each ``(path, rel)`` in ``todo`` as it finishes (``jobs`` at once,
    in processes)."""
    if jobs <= 1 or len(todo) <= 1:
        for src, rel in todo:
            yield run_one(str(src), rel, str(out_dir), timeout)
        return
    import concurrent.futures as cf
    import multiprocessing as mp

    with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as pool:
        futures = {pool.submit(run_one, str(src), rel, str(out_dir), timeout): rel for src, rel in todo}
        for fut in cf.as_completed(futures):
            try:
                yield fut.result()
            except Exception as e:  # noqa: BLE001 - a worker that died: the notebook failed, the run goes on
                yield {"notebook": futures[fut], "status": "failed", "seconds": 0.0, "html": None,
                       "error": "its worker process failed: "
                                f"{type(e).__name__}: {e}", "html_error": None}


def main(out: str = "build", only=None, timeout: int = 900, jobs: int | None = None, answers: bool = False) -> int:
    """Run the lessons and labs (with ``answers`` the answer versions too; or those in ``only``),
    ``jobs`` at once (default :func:`default_jobs`); exit 1 if any failed. The summary lists them in
    the course's order."""
    from tqdm.auto import tqdm

    from course.core.runtime import runtime

    # decided once here; kernels (and worker processes) inherit the decision through the environment
    rt = runtime()
    out_dir = Path(out)
    if not out_dir.is_absolute():
        out_dir = ROOT / out_dir
    wanted = [e for e in CATALOG if answers or e.kind != "solution"] if only is None else \
        [e for e in CATALOG if e.path in only or Path(e.path).name in only]
    if only and not wanted:
        print(f"course run: none of {only} is in the course; "
              f"choose from {[e.path for e in CATALOG]}")
        return 2
    jobs = default_jobs(rt.on_gpu) if jobs is None else max(1, int(jobs))
    if jobs > 1:  # the kernels inherit it; a value the caller set wins
        os.environ.setdefault("OMP_NUM_THREADS", str(thread_share(jobs)))
    print(rt.describe() + (f" Executing {jobs} notebooks at once." if jobs > 1 else ""))
    results = {e.path: {"notebook": e.path, "status": "missing", "seconds": 0.0, "error": "file not found"}
               for e in wanted if not (ROOT / e.path).exists()}
    todo = [(ROOT / e.path, e.path) for e in wanted if (ROOT / e.path).exists()]
    bar = tqdm(total=len(wanted), desc="notebooks")
    bar.update(len(results))
    for row in _rows(todo, out_dir, timeout, jobs, tqdm):
        results[row["notebook"]] = row
        if row.get("html") is None and row.get("html_error"):
            tqdm.write(f"     no HTML for {row['notebook']}: "
                       f"{row['html_error']} (the executed notebook is written)")
        err = row["error"]
        tqdm.write(f"{'ok ' if err is None else 'FAIL'} {row['notebook']} ({row['seconds']:.0f} s)"
                   + (f": {err}" if err else ""))
        bar.update(1)
    bar.close()
    results = [results[e.path] for e in wanted]
    rendered = [e.path for e in wanted if (ROOT / e.path).exists()]
    copy_linked(ROOT, rendered, out_dir / "executed")
    copy_linked(ROOT, rendered, out_dir / "html", html=True)
    summary = {"path": rt.path, "device": rt.device_name, "reason": rt.reason, "jobs": jobs, "notebooks": results}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    lines = [f"# Course run: {rt.path} path ({rt.device_name})", "", rt.reason, "",
             "| notebook | status | seconds |", "| --- | --- | --- |"]
    lines += [f"| {r['notebook']} | {r['status']} | {r['seconds']} |" for r in results]
    (out_dir / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\nExecuted notebooks and HTML are in {out_dir}/ (summary: {out_dir / 'summary.md'}).")
    return 0 if all(r["status"] == "passed" for r in results) else 1
