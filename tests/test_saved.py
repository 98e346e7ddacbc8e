"""The idea in the cell: every ``#@save`` cell of every notebook is held equal to its module."""
import json
from pathlib import Path

import pytest

from course.tools import saved

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted(p for d in ("notebooks", "labs", "solutions") for p in (ROOT / d).glob("*.ipynb"))


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_saved_cells_equal_their_modules(notebook):
    assert saved.differences(notebook) == []


def _notebook(tmp_path, cells) -> Path:
    nb = {"cells": [{"cell_type": "code", "source": s, "metadata": {}, "outputs": [],
                     "execution_count": None} for s in cells], "metadata": {}, "nbformat": 4,
          "nbformat_minor": 5}
    path = tmp_path / "nb.ipynb"
    path.write_text(json.dumps(nb))
    return path


def test_a_drifted_or_missing_definition_is_named(tmp_path):
    same = "#@save course.tools.saved\n" + 'MARK = "#@save"\n'
    drift = "#@save course.tools.saved\n" + "def saved_cells(notebook) -> list:\n    return []\n"
    missing = "#@save course.tools.saved\n" + "def nowhere():\n    pass\n"
    nb = _notebook(tmp_path, [same, "x = 1", drift, missing, "#@save course.no_such\nY = 2\n"])
    assert [c[:2] for c in saved.saved_cells(nb)] == [(0, "course.tools.saved"), (2, "course.tools.saved"),
                                                     (3, "course.tools.saved"), (4, "course.no_such")]
    assert saved.differences(nb) == ["nb.ipynb cell 2: course.tools.saved holds another version of saved_cells",
                                     "nb.ipynb cell 3: course.tools.saved lacks nowhere",
                                     "nb.ipynb cell 4: no module course.no_such"]


def test_definitions_keep_decorators_and_skip_other_statements():
    src = "import os\n@staticmethod\ndef f(x):\n    return x\nA: int = 3\nprint(A)\nclass C:\n    pass\n"
    assert saved.definitions(src) == {"f": "@staticmethod\ndef f(x):\n    return x", "A": "A: int = 3",
                                      "C": "class C:\n    pass"}
