"""Staged hints that advance between ``python -m course check`` runs.

Each ``course check`` runs the notebook in a fresh kernel, where every staged hint would start at
its first stage. So ``course check`` keeps, per notebook and exercise, how many times the check
failed or crashed, in ``.course_hints.json`` in the notebook's folder (git-ignored), and hands the
counts to the kernel (``COURSE_HINT_STAGES``, read by :mod:`course.core.checks`). An exercise that
passes starts again at the first stage. Delete the file to see every hint from its first stage.
"""
from __future__ import annotations

import json
from pathlib import Path

HINT_STATE = ".course_hints.json"  # beside the learner's notebook: {notebook file: {exercise: ✗ so far}}


def hint_state_path(notebook) -> Path:
    """Where ``course check`` keeps the staged-hint progress of ``notebook``: a file in the
    notebook's folder."""
    return Path(notebook).resolve().parent / HINT_STATE


def load_hint_state(notebook) -> dict:
    """Exercise name -> ✗ so far for ``notebook`` (from :func:`hint_state_path`); {} when there is
    none."""
    try:
        data = json.loads(hint_state_path(notebook).read_text(encoding="utf-8"))
        mine = data.get(Path(notebook).name, {})
        return {k: v for k, v in mine.items() if isinstance(k, str) and isinstance(v, int) and v > 0}
    # none yet, or unreadable: start at the first stage
    except (OSError, ValueError, AttributeError):
        return {}


def save_hint_state(notebook, exercises) -> str | None:
    """Store each exercise's ✗ so far for ``notebook``; a passed exercise starts again at the first
    stage.

    ``exercises`` are :func:`course.tools.grade.run_checks` rows (``failures`` is the count after
    this run). Returns None, or why the file could not be written (the hints then do not advance;
    the check itself is unaffected).
    """
    path = hint_state_path(notebook)
    try:
        data = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
        data = data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        data = {}
    mine = data.get(Path(notebook).name)
    mine = dict(mine) if isinstance(mine, dict) else {}
    for x in exercises:
        if x["status"] == "pass":
            mine.pop(x["name"], None)
        elif x.get("failures"):
            mine[x["name"]] = x["failures"]
    if mine:
        data[Path(notebook).name] = mine
    else:
        data.pop(Path(notebook).name, None)
    try:
        if data:
            path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        elif path.exists():
            path.unlink()
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    return None
