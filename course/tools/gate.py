"""The test suite's gate (a pytest plugin, registered by ``conftest.py``): a notebook whose
exercises say ✗ fails the run, which nbval alone would pass.

It reuses nbval's run: the kernel gets ``COURSE_GATE`` (``answers`` in ``solutions/``: every ✗ and
"not done yet" raises; ``learner`` in ``notebooks/`` and ``labs/``: every ✗ raises) and
``COURSE_CHECK_LOG``; one more item after the last cell, ``<notebook>::exercises``, reads the log
and fails an answer version whose declared exercise never reported.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from course.core.checks import CRASH, ENV_GATE, ENV_LOG, FAIL

ENV_KEEP = "COURSE_KEEP_OUTPUTS"  # a folder: write each notebook as nbval ran it, outputs included

MODES = {"solutions": "answers", "labs": "learner", "notebooks": "learner"}
ITEM_NAME = "exercises"


def mode_for(path) -> str | None:
    """The gate for a notebook at ``path``: "answers" in solutions/, "learner" in notebooks/ and
    labs/, else None."""
    p = Path(str(path))
    return MODES.get(p.parent.name) if p.suffix == ".ipynb" else None


def read_log(path) -> list:
    """The outcomes a check log holds (one dict per ``record``), in order; [] when there is no log.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def problems(entries: list, declared: list, mode: str) -> list:
    """What fails the gate, one line each: every ✗ the log holds; for "answers" also what did not
    pass.

    ``entries`` are the logged outcomes (the last one of an exercise counts, but a ✗ anywhere
    fails); ``declared`` the exercise names the notebook declares (an answer version must report
    each one).
    """
    from course.tools.grade import judge

    last, crossed = {}, {}
    for e in entries:
        last[e["name"]] = e
        if e["status"] in (FAIL, CRASH):
            crossed[e["name"]] = e
    rows = [{"name": n, "status": e["status"], "message": e.get("message", "")} for n, e in crossed.items()]
    if mode == "answers":
        for name in list(declared) + [n for n in last if n not in declared]:
            if name in crossed:
                continue
            e = last.get(name)
            rows.append({"name": name, "status": e["status"], "message": e.get("message", "")} if e else
                        {"name": name, "status": "not reached",
                         "message": "its check never reported (its cell did not run, "
                                    "raised before the check, or the check is in a "
                                    "branch that did not run: on the simulator, a "
                                    "GPU-only exercise must call checks.skip(name, why))"})
    return judge(rows, answers=mode == "answers")


class GateFailed(Exception):
    """A notebook's exercises failed the gate; the message lists each, and what to run to see more.
    """


class ExercisesItem(pytest.Item):
    """The test item after a notebook's last cell: its exercises, judged from the check log of
    nbval's run."""

    def runtest(self):
        """Fail with every problem :func:`problems` finds in the notebook's check log."""
        keep_outputs(self.parent)
        gate = self.parent._course_gate
        bad = problems(read_log(gate["log"]), gate["declared"], gate["mode"])
        if bad:
            rule = ("an answer version must pass every "
                    "exercise (or skip it with a reason)" if gate["mode"] == "answers"
                    else "a learner version may say 'not done yet', never ✗")
            flag = " --answers" if gate["mode"] == "answers" else ""
            raise GateFailed(f"{self.parent.path.name}: "
                             f"{rule}; here:\n" + "\n".join(f"  {b}" for b in bad)
                             + "\nSee the failing cells above, or run: python "
                               f"-m course check{flag} {self.parent.path}")

    def repr_failure(self, excinfo, style=None):
        """The gate's own message, without a traceback of this plugin."""
        if isinstance(excinfo.value, GateFailed):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self):
        """Where pytest reports this item: the notebook."""
        return self.path, None, f"{self.parent.path.name}::{self.name}"


def keep_outputs(notebook_item) -> Path | None:
    """With ``COURSE_KEEP_OUTPUTS=DIR``, write the notebook as nbval just ran it (outputs included)
    into DIR.

    The GPU lane's executed copies, for reading what each cell printed on that machine; nothing is
    written otherwise. Returns the file written, or None.
    """
    folder = os.environ.get(ENV_KEEP)
    if not folder:
        return None
    import nbformat

    nb = nbformat.from_dict(notebook_item.nb)
    cells = [c for c in nb.cells if c.cell_type == "code"]
    for item in notebook_item.session.items:
        if item.parent is notebook_item and type(item).__name__ == "IPyNbCell" and item.test_outputs is not None:
            cell = cells[item.cell_num] if 0 <= getattr(item, "cell_num", -1) < len(cells) else None
            if cell is not None:
                cell.outputs = [nbformat.from_dict(dict(o)) for o in item.test_outputs]
    out = Path(folder) / f"{Path(notebook_item.path).parent.name}__{Path(notebook_item.path).name}"
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        nbformat.write(nb, str(out))
    except Exception:  # noqa: BLE001 - a copy for reading; never fails the gate
        return None
    return out


def _is_notebook_file(node) -> bool:
    return node is not None and type(node).__name__ == "IPyNbFile" and hasattr(node, "nb")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    """After each gated notebook's cells (all of them selected), add its :class:`ExercisesItem`."""
    from course.tools.grade import exercise_names

    out, i = [], 0
    while i < len(items):
        parent = items[i].parent
        j = i
        while j < len(items) and items[j].parent is parent:
            j += 1
        out += items[i:j]
        mode = mode_for(getattr(parent, "path", "")) if _is_notebook_file(parent) else None
        cells = sum(c.cell_type == "code" for c in parent.nb.cells) if mode else 0
        if mode and j - i == cells:  # a run of a few cells (-k) is not judged
            if not hasattr(config, "_course_gate_dir"):
                config._course_gate_dir = tempfile.mkdtemp(prefix="course-gate-")
            log = os.path.join(config._course_gate_dir, f"{len(out)}-{parent.path.stem}.jsonl")
            parent._course_gate = {"mode": mode, "log": log, "declared": exercise_names(parent.nb)}
            out.append(ExercisesItem.from_parent(parent, name=ITEM_NAME))
        i = j
    items[:] = out


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    """Start a gated notebook's kernel with ``COURSE_GATE`` and ``COURSE_CHECK_LOG`` set (only that
    kernel)."""
    gate = getattr(item.parent, "_course_gate", None)
    if gate is None or getattr(item.parent, "kernel", None) is not None:
        yield
        return
    from course.core.isolate import env_set

    with env_set({ENV_GATE: gate["mode"], ENV_LOG: gate["log"]}):
        yield  # the notebook's kernel starts here (nbval's setup), with these two variables


def pytest_unconfigure(config):
    """Remove the check logs."""
    folder = getattr(config, "_course_gate_dir", None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
