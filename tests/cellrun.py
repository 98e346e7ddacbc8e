"""What tests share: apply a mutant's edits to answer cells, run cells as a notebook kernel would, and read the
check log they wrote (the exercise-variant tests); a fresh check session per test; wait for a JupyterLab to answer."""
from __future__ import annotations

import contextlib
import io
import json
import linecache
import os
import re
import subprocess
import time
import urllib.request
from functools import lru_cache
from pathlib import Path

import nbformat
import pytest

from course.core import checks
from course.core.runtime import runtime
from course.tools.grade import exercise_cells


def apply_edits(sources: list, edits, where: str) -> list:
    """``sources`` with each ``(find, replace)`` applied; a find must occur exactly once in all of them together
    (else the test fails: the mutant table no longer follows the answer)."""
    for find, replace in edits:
        hits = sum(s.count(find) for s in sources)
        if hits != 1:
            pytest.fail(f"a mutation's find-string occurs {hits} times in {where} (it must occur once): "
                        f"update the mutant table to the answer\n{find}")
        sources = [s.replace(find, replace) for s in sources]
    return sources


def run_cells(cells: list, log_dir, label: str, until: str = "") -> list:
    """Run ``cells`` in one fresh namespace, as a kernel would (output muted, each cell's source in linecache so
    ``inspect`` reads it), with the check log in ``log_dir`` and no gate; the logged entries, in order.

    ``until``: stop once that check has reported.
    """
    log = Path(log_dir) / "checks.jsonl"
    if log.exists():
        log.unlink()
    ns = {"__name__": "__lab__"}
    old = {k: os.environ.get(k) for k in (checks.ENV_LOG, checks.ENV_GATE, checks.ENV_NBGRADER)}
    os.environ[checks.ENV_LOG] = str(log)
    os.environ.pop(checks.ENV_GATE, None)
    os.environ.pop(checks.ENV_NBGRADER, None)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            for i, src in enumerate(cells):
                name = f"<{label} cell {i}>"
                linecache.cache[name] = (len(src), None, src.splitlines(True), name)
                exec(compile(src, name, "exec"), ns)  # noqa: S102 - the course's own notebook
                if until and checks.status(until) is not None:
                    break
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()] if log.exists() else []


ROOT = Path(__file__).resolve().parent.parent
ON_GPU = runtime().on_gpu


def _code_cells(notebook: str) -> list:
    nb = json.loads((ROOT / "solutions" / notebook).read_text(encoding="utf-8"))
    return [c for c in nb["cells"] if c["cell_type"] == "code"]


def _source(cell) -> str:
    return "".join(cell["source"])


@lru_cache(maxsize=None)
def _checks_by_cell(notebook: str) -> dict:
    """Code-cell index -> the exercise its check reports (``course check``'s own reading of the notebook)."""
    nb = nbformat.read(ROOT / "solutions" / notebook, as_version=4)
    code = {j: k for k, j in enumerate(j for j, c in enumerate(nb.cells) if c.cell_type == "code")}
    return {code[i]: name for name, i in exercise_cells(nb).items()}


def _runs(i: int, cell, target, cells) -> bool:
    """Whether code cell ``i`` runs in a mutant's notebook: every answer cell; a check cell unless it comes before the
    expected check's own cell ``target`` (all run when that cell reads another check's outcome, or with no target)."""
    src = _source(cell)
    if "### BEGIN SOLUTION" in src:
        return True
    if "check" not in cell.get("metadata", {}).get("tags", []):
        return False
    return target is None or i >= target or bool(re.search(r"checks\.(passed|status)\(", _source(cells[target])))


def run_notebook_checks(notebook: str, edits=(), log_dir=None, until: str = "", every: bool = False) -> dict:
    """Run a solution notebook's setup, answer and check cells with ``edits`` applied; check name -> outcome entry.

    ``edits``: (find, replace) pairs, each find occurring exactly once in the answer and check cells (else
    the test fails: the table no longer follows the answer). Setup cells are the code cells before the first
    answer cell (imports, the model); answer cells hold ``### BEGIN SOLUTION``; check cells are tagged
    ``check``; other cells (measurements, summaries) are skipped. ``until``: stop once that check has run, having run
    only the check cells from its own on (see :func:`_runs`), or every check cell before it too with ``every``.
    """
    cells = _code_cells(notebook)
    first = next(i for i, c in enumerate(cells) if "### BEGIN SOLUTION" in _source(c))
    setup = [_source(c) for c in cells[:first]]
    target = next((i for i, name in _checks_by_cell(notebook).items() if name == until), None) \
        if until and not every else None
    steps = [_source(c) for i, c in enumerate(cells) if i >= first and _runs(i, c, target, cells)]
    steps = apply_edits(steps, edits, f"{notebook}'s answer and check cells")
    checks.reset()
    out = {}
    for entry in run_cells(setup + steps, log_dir, notebook, until=until):
        out[entry["name"]] = entry
    return out


def expect_caught(notebook, edits, check, words, tmp_path) -> dict:
    """Run the mutant; assert ``check`` failed (or crashed) with a message containing every one of ``words``."""
    got = run_notebook_checks(notebook, edits, tmp_path, until=check)
    entry = got.get(check)
    assert entry is not None, f"{check} never ran: {sorted(got)}"
    assert entry["status"] in ("fail", "crash"), f"{check} passed the mutant; outcomes: " + \
        "; ".join(f"{k}: {v['status']} {v['message']}" for k, v in got.items())
    missing = [w for w in words if w.lower() not in entry["message"].lower()]
    assert not missing, f"{check}'s ✗ does not say {missing}: {entry['message']!r}"
    return entry


def run_mutant(notebook, mutant, tmp_path) -> None:
    """One row of a mutant table: skipped on a path it names as blind, else :func:`expect_caught`."""
    name, edits, check, words, *only = mutant
    here = "gpu" if ON_GPU else "simulator"
    if only and only[0] != here:
        pytest.skip(f"{name}: only the {only[0]} path can see this defect")
    expect_caught(notebook, edits, check, words, tmp_path)


@pytest.fixture(autouse=True)
def _fresh_checks():
    """Every test starts and ends with no outcome remembered (autouse where imported)."""
    checks.reset()
    yield
    checks.reset()


def one(find, replace):
    return [(find, replace)]


@contextlib.contextmanager
def jupyter_lab(cmd, env, cwd, log_path, base: str, token: str, limit: float = 120):
    """Start JupyterLab (``cmd``, its output in ``log_path``), wait until it answers at ``base`` (fail with its log if
    it ends first or ``limit`` seconds pass), and stop it after the block."""
    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        try:
            deadline = time.time() + limit
            while True:
                try:
                    urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=5).close()
                    break
                except Exception:  # noqa: BLE001 - not up yet
                    if server.poll() is not None or time.time() > deadline:
                        pytest.fail(f"JupyterLab did not start: {Path(log_path).read_text()[-2000:]}")
                    time.sleep(0.3)
            yield server
        finally:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
