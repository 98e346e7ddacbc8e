"""Experiments whose code stands in a notebook cell (course.core.cells), and how many lesson cells stay opaque."""
import inspect
import json
import re
from pathlib import Path

import pytest

from course.core import cells, reference
from course.tools import catalog

ROOT = Path(__file__).resolve().parents[1]
RUN_CALL = re.compile(r"""\b(?:reference\.run|heavy|gpu_result|reference\.heavy)\(\s*["'](\w+)["']""")
OPAQUE_LIMIT = 8


@pytest.fixture(autouse=True)
def _registry_restored():
    """The probes these tests register leave the registry as they found it."""
    yield
    for name in [n for n in reference._REGISTRY if n.startswith("cells_probe")]:
        del reference._REGISTRY[name]


def _nb(cells_src, tags=None):
    return {"cells": [{"cell_type": "code", "metadata": {"tags": t} if t else {}, "source": s, "outputs": [],
                       "execution_count": None} for s, t in zip(cells_src, tags or [None] * len(cells_src))],
            "metadata": {}, "nbformat": 4, "nbformat_minor": 5}


def test_tagged_cells_are_read_in_order(tmp_path):
    p = tmp_path / "x.ipynb"
    p.write_text(json.dumps(_nb(["a = 1", "b = 2", "c = 3"], [["experiment"], None, ["other", "experiment"]])))
    assert cells.tagged_cells(p) == [(0, "a = 1"), (2, "c = 3")]
    assert cells.module_name(p) == "course_cells.nb_x"


def test_a_cell_registers_its_experiment_and_getsource_shows_the_cell(tmp_path):
    src = ('from course.core.reference import experiment\n\n'
           '@experiment("cells_probe_a", gpu_only=False)\n'
           'def probe(n=2):\n'
           '    """A probe."""\n'
           '    return n * 21\n')
    p = tmp_path / "probe_a.ipynb"
    p.write_text(json.dumps(_nb([src], [["experiment"]])))
    mod = cells.load(p, guard=reference.keeping_registered)
    exp = reference.get("cells_probe_a")
    assert exp.fn(2) == 42 and exp.fn.__module__ == mod.__name__
    assert "return n * 21" in inspect.getsource(exp.fn)


def test_a_definition_made_first_wins_over_the_file(tmp_path):
    @reference.experiment("cells_probe_b", gpu_only=False)
    def probe():
        """The learner's edited version."""
        return "edited"

    p = tmp_path / "probe_b.ipynb"
    p.write_text(json.dumps(_nb(['from course.core.reference import experiment\n'
                                 '@experiment("cells_probe_b", gpu_only=False)\n'
                                 'def probe():\n    return "file"\n'], [["experiment"]])))
    cells.load(p, guard=reference.keeping_registered)
    assert reference.get("cells_probe_b").fn() == "edited"


def test_keeping_registered_keeps_a_name_only_while_active():
    @reference.experiment("cells_probe_c", gpu_only=False)
    def first():
        return 1

    with reference.keeping_registered():
        @reference.experiment("cells_probe_c", gpu_only=False)
        def first():  # noqa: F811 - the same name again, kept out by the guard
            return 2
    assert reference.get("cells_probe_c").fn() == 1


def test_a_failing_cell_names_the_notebook_and_the_cell(tmp_path):
    p = tmp_path / "broken.ipynb"
    p.write_text(json.dumps(_nb(["x = 1", "import no_such_module_here"], [None, ["experiment"]])))
    with pytest.raises(RuntimeError, match=r"experiment cell 1 of broken\.ipynb failed to load: ModuleNotFoundError"):
        cells.load(p)


def test_every_answer_version_with_experiment_cells_is_in_the_map():
    listed = {Path(p).resolve() for p in catalog.experiment_notebooks()}
    for p in sorted((ROOT / "solutions").glob("*.ipynb")):
        assert bool(cells.tagged_cells(p)) == (p.resolve() in listed), (
            f"{p.name}: cells tagged 'experiment' and the course map's experiment_cells must agree")


def test_every_experiment_cell_registers_an_experiment_and_only_that():
    reg = reference.load_all()
    by_module = {}
    for name, e in reg.items():
        by_module.setdefault(e.fn.__module__, []).append(name)
    for p in catalog.experiment_notebooks():
        names = by_module.get(cells.module_name(p), [])
        assert names, f"{p.name}: its experiment cells register no experiment"


def test_the_learner_versions_carry_the_same_experiment_cells():
    for e in catalog.entries():
        if e.experiment_cells:
            assert cells.tagged_cells(ROOT / e.path) and [s for _, s in cells.tagged_cells(ROOT / e.path)] == \
                [s for _, s in cells.tagged_cells(ROOT / e.answer_version)], f"{e.path}: rebuild with build-labs"


def opaque_cells() -> list:
    """``[(notebook, cell index, experiment), ...]``: lesson cells that run an experiment whose code is not in a
    cell of the same notebook (it lives in a module), without a ``# opaque:`` comment that says why."""
    reg = reference.load_all()
    out = []
    for e in catalog.entries("lesson"):
        nb = json.loads((ROOT / e.path).read_text())
        own = cells.module_name(ROOT / e.answer_version)
        for i, c in enumerate(nb["cells"]):
            if c["cell_type"] != "code":
                continue
            src = "".join(c["source"])
            for name in RUN_CALL.findall(src):
                if name in reg and reg[name].fn.__module__ != own:
                    out.append((e.path, i, name, "# opaque:" in src))
    return out


def test_at_most_eight_opaque_experiment_cells_each_saying_why():
    found = opaque_cells()
    unexplained = [f for f in found if not f[3]]
    cells_ = {(p, i) for p, i, _, _ in found}
    assert len(cells_) <= OPAQUE_LIMIT, f"{len(cells_)} opaque experiment cells (at most {OPAQUE_LIMIT}): {found}"
    assert not unexplained, f"opaque experiment cells without an '# opaque: why' comment: {unexplained}"
