"""What the exercise-variant tests share: apply a mutant's edits to answer cells, run cells as a notebook kernel
would, and read the check log they wrote (imported by test_capture_exercises_02, test_reduce_overhead_exercise
and test_mutants_lab3_4)."""
from __future__ import annotations

import contextlib
import io
import json
import linecache
import os
from pathlib import Path

import pytest

from course.core import checks


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
