"""Issue 8: checks never lie, every exercise teaches (regression tests for the observations).

Observation 1: a false pass after a fallback rebinds the learner's name; 2: passes forgotten when a
check cell re-runs; 3: a crash is no ✗ and stops Run All; 4: feedback that does not point at the
cause; 5: solutions one cell below every lesson exercise; 7: wide text tables, stray caption output.
"""
import ast
import copy
import json
import re

import matplotlib

matplotlib.use("Agg")
import nbformat
import pytest
import torch
import torch.nn.functional as F

import course
from course import embedding as E
from course.core import checks, plots
from course.tools import catalog, grade as G, learner_versions as L
from course.tools.catalog import ROOT
from cellrun import _fresh_checks  # noqa: F401 - autouse: every test starts and ends with no outcome

# The notebook-level tests run whole labs: on the simulator (CI). On a GPU, nbval runs the same notebooks, and an
# out-of-bounds read does not raise there (that is why the simulator's IndexError is worth a clear ✗).
on_simulator = pytest.mark.skipif(course.runtime().on_gpu, reason="runs labs on the simulator path (nbval covers the GPU)")
LAB1, LAB2 = ROOT / "labs" / "lab1_embedding_kernel.ipynb", ROOT / "labs" / "lab2_embedding_swap.ipynb"
SOL1 = ROOT / "solutions" / "lab1_embedding_kernel.ipynb"


def _text(cell) -> str:
    out = []
    for o in cell.get("outputs", []):
        if o.get("output_type") == "stream":
            out.append(o["text"])
        elif o.get("output_type") == "error":
            out.append("\n".join(o.get("traceback", [])) + f"{o['ename']}: {o['evalue']}")
        elif "data" in o:
            out.append(o["data"].get("text/plain", ""))
    return "".join(out)


def _index(nb, text: str) -> int:
    return next(i for i, c in enumerate(nb.cells) if text in c.source)


def _run(nb, *reruns, timeout=300):
    """Run All in one kernel, then re-run the cells at ``reruns``; return (nb, outputs of each re-run)."""
    from nbclient import NotebookClient

    client = NotebookClient(nb, timeout=timeout, allow_errors=True, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT)}})
    again = []
    with client.setup_kernel():
        for i, cell in enumerate(nb.cells):
            client.execute_cell(cell, i)
        for i in reruns:
            cell = copy.deepcopy(nb.cells[i])
            client.execute_cell(cell, i)
            again.append(_text(cell))
    return nb, again


def _solution_with(nb, old: str, new: str):
    nb = copy.deepcopy(nb)
    i = _index(nb, old)
    nb.cells[i].source = nb.cells[i].source.replace(old, new)
    return nb


# ----------------------------------------------------------------------- observation 1: no false pass

@on_simulator
def test_obs1_rerun_check_after_fallback_is_not_a_pass():
    nb = nbformat.read(LAB2, as_version=4)
    check3 = _index(nb, 'with exercise("3. swap"')
    _, (again,) = _run(nb, check3)
    assert "3. swap: not done yet" in again and "passed" not in again, again


@on_simulator
def test_obs1_course_check_tests_the_learners_swap_in_any_cell_order(tmp_path, capsys):
    nb = nbformat.read(LAB2, as_version=4)
    check3 = _index(nb, 'with exercise("3. swap"')
    # the learner rebinds the name to a fallback *before* the check runs
    nb.cells.insert(check3, nbformat.v4.new_code_cell('swap = E.fallback(swap, S.swap, "swap()")'))
    path = tmp_path / "lab2.ipynb"
    nbformat.write(nb, path)
    assert G.check_notebook(path, timeout=300, answers=True) == 1  # judged as an answer: not done yet fails
    out = capsys.readouterr().out
    assert "… 3. swap: not done yet" in out and "✓ 3. swap" not in out, out


def test_fallback_uses_the_reference_until_the_exercise_passes(capsys):

    def mine(x):
        return x + 100  # wrong, but does not raise

    f = E.fallback(mine, lambda x: x + 1, "mine()", exercise="t. fallback")
    assert f(1) == 2 and "has not passed exercise 't. fallback'" in capsys.readouterr().out
    assert checks.own(f) is mine and checks.own(mine) is mine
    with checks.exercise("t. fallback"):
        pass
    assert f(1) == 101


# ----------------------------------------------------------------------- observation 2: passes remembered

@on_simulator
def test_obs2_rerunning_one_check_keeps_the_other_passes():
    nb = nbformat.read(SOL1, as_version=4)
    check1 = _index(nb, 'with exercise("1. naive kernel"')
    measured = _index(nb, 'for name in ("1. naive kernel"')
    _, (first, summary) = _run(nb, check1, measured)
    assert "✓ 1. naive kernel: passed" in first
    for name in ("1. naive kernel", "2. clear errors", "3. fast kernel"):
        assert f"Exercise {name}: passed its check" in summary, summary
    assert "not done yet" not in summary


def test_session_progress_and_describe(capsys):
    assert checks.status("p") is None and "not checked yet" in checks.describe("p")
    with checks.exercise("p"):
        pass
    with checks.exercise("q"):
        raise NotImplementedError
    with checks.exercise("p"):
        pass
    checks.skip("r", "needs a GPU")
    assert checks.progress() == {"p": "pass", "q": "todo", "r": "skip"} and checks.passed("p")
    assert "skipped" in checks.describe("r")


# ----------------------------------------------------------------------- observation 3: a crash is a ✗

OFF_BY_ONE = ("if i < out.shape[0] * dim:", "if i <= out.shape[0] * dim:")


@on_simulator
def test_obs3_crash_is_one_cross_with_the_learners_line_and_run_all_goes_on():
    nb = _solution_with(nbformat.read(SOL1, as_version=4), *OFF_BY_ONE)
    nb, _ = _run(nb)
    out = _text(nb.cells[_index(nb, 'with exercise("1. naive kernel"')])
    assert "✗ 1. naive kernel: CRASHED (IndexError" in out, out
    assert "your line: naive(), line" in out and "idx = ids[n]" in out, out
    assert "hint: [1/3]" in out and "why: an index went outside an array" in out
    assert "Traceback" not in out and "threading" not in out and "simulator" not in out.split("why:")[0]
    assert not any(o.get("output_type") == "error" for c in nb.cells for o in c.get("outputs", []))
    last = _text(nb.cells[-1])
    assert "Exercise 1. naive kernel: checked, CRASHED" in last and "Exercise 3. fast kernel: passed" in last


@on_simulator
def test_obs3_course_check_says_crashed_not_not_reached(tmp_path, capsys):
    nb = _solution_with(nbformat.read(SOL1, as_version=4), *OFF_BY_ONE)
    path = tmp_path / "lab1.ipynb"
    nbformat.write(nb, path)
    assert G.check_notebook(path, timeout=300) == 1
    out = capsys.readouterr().out
    assert "✗ 1. naive kernel: crashed: IndexError" in out and "not reached" not in out, out
    assert "your line: naive()" in out
    assert "✓ 2. clear errors" in out and "✓ 3. fast kernel" in out
    assert "1 crashed" in out


def test_crash_summary_hides_library_frames(capsys):

    def learner():
        return torch.zeros(3)[5]  # an IndexError raised inside torch

    with checks.exercise("c", hint=["first", "second"]):
        learner()
    with checks.exercise("c", hint=["first", "second"]):
        learner()
    out = capsys.readouterr().out
    assert out.count("✗ c: CRASHED (IndexError: index 5 is out of bounds") == 2
    assert "your line: learner(), line" in out and "torch.zeros(3)[5]" in out
    assert "hint: [1/2] first" in out and "hint: [2/2] second" in out and "Traceback" not in out
    try:
        learner()
    except IndexError as e:
        assert checks.learner_frame(e)[2] == "learner"
    with pytest.raises(checks.ExerciseFailed, match="wrong"):
        with checks.exercise("d", raise_on_fail=True):
            assert False, "wrong"


def test_crash_inside_the_course_never_says_look_at_your_line():
    """A crash with no learner frame (the course's own code raised) names no line and never asks for one."""
    try:
        raise RuntimeError("refused")
    except RuntimeError as e:
        e.__traceback__ = None  # no frame of the learner's: as when the check's own code raised
        info = checks.crash_summary(e)
    assert info["where"] == "" and "your line" not in info["why"] and "course's code" in info["why"], info
    try:
        raise RuntimeError("refused")
    except RuntimeError as e:
        assert "look at your line" in checks.crash_summary(e)["why"]  # here the test is the learner's code


def test_under_nbgrader_every_cross_and_todo_raises(monkeypatch, capsys):
    monkeypatch.setenv(checks.ENV_NBGRADER, "autograde")
    for body in (NotImplementedError, ZeroDivisionError, AssertionError):
        with pytest.raises(checks.ExerciseFailed):
            with checks.exercise("n"):
                raise body("x")
    with checks.exercise("n"):
        pass


# ----------------------------------------------------------------------- observation 4: diagnosing feedback

def test_obs4_wrong_row_is_named():
    def wrong_row(ids, w, padding_idx=None):
        return F.embedding((ids.long() + 1) % w.shape[0], w)

    with pytest.raises(AssertionError, match=r"row \d+ was read where row \d+ was expected") as e:
        E.check_lookup(wrong_row, seed=0)
    assert "differs at" not in str(e.value)


def test_obs4_unwritten_column_and_uncounted_ids_are_named():
    def no_col(ids, w, padding_idx=None):
        out = F.embedding(ids, w).clone()
        out[..., 1] = 0
        return out

    with pytest.raises(AssertionError, match="column 1 was never written"):
        E.check_lookup(no_col, seed=0)
    with pytest.raises(AssertionError, match="ids 5, 9 and -1 were not counted"):
        E.check_bad_ids(lambda i, w: F.embedding(i.clamp(0, 4), w) * (((i >= 0) & (i < 5)).view(-1, 1)))
    E.check_bad_ids(lambda i, w: E.embedding(i, w, bounds="device"))  # the course's kernel passes
    t = E.named_table(3, 4, torch.bfloat16)
    assert t.dtype == torch.bfloat16 and t[2, 3].item() == 12
    assert E.named_table(100, 100, torch.bfloat16).dtype == torch.float32  # too large for bf16: exact float32
    assert E.diagnose(lambda i, w: F.embedding(i, w), torch.tensor([1, 0]), torch.randn(3, 2)) == ""


# ----------------------------------------------------------------------- observation 5: answers not in lessons

def _functions(source: str):
    """(qualified name, node) of every function in a cell: ``Class.method`` inside a class."""
    tree = ast.parse(source)
    owner = {f: f"{c.name}." for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for f in c.body}
    return [(owner.get(n, "") + n.name, n) for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]


def _solution_functions(nb) -> set:
    return {name for c in nb.cells if c.cell_type == "code" and L.BEGIN in c.source
            for name, n in _functions(c.source) if L.BEGIN in ast.get_source_segment(c.source, n)}


@pytest.mark.parametrize("sol", sorted((ROOT / "solutions").glob("*.ipynb")), ids=lambda p: p.name)
def test_obs5_learner_versions_hold_no_answers(sol):
    learner = L.target(ROOT, sol)
    names = _solution_functions(nbformat.read(sol, as_version=4))
    assert names, f"{sol.name} has no solution regions"
    nb = nbformat.read(learner, as_version=4)
    assert not any(re.fullmatch(r"\s*(One solution|Solution):?\s*", c.source) for c in nb.cells)
    for c in nb.cells:
        if c.cell_type != "code":
            continue
        for name, node in _functions(c.source):
            if name in names:
                raises = [n for n in ast.walk(node) if isinstance(n, ast.Raise)
                          and "NotImplementedError" in ast.unparse(n)]
                assert raises, f"{learner.name}: {name}() is answered in the learner version"


def test_obs5_a_method_is_judged_by_its_class():
    cell = "class A:\n    def __init__(self):\n        pass\nclass B:\n    def __init__(self):\n        pass\n"
    assert [n for n, _ in _functions(cell)] == ["A.__init__", "B.__init__"]


def test_lessons_and_labs_are_generated_in_sync(capsys):
    assert L.build_labs(check=True) == 0, capsys.readouterr().out
    sols = {e.path for e in catalog.entries("solution")}
    for name in ("01_launch_overhead", "02_capture_and_replay", "03_what_breaks_capture"):
        assert f"solutions/{name}.ipynb" in sols
        assert L.target(ROOT, f"solutions/{name}.ipynb") == ROOT / "notebooks" / f"{name}.ipynb"


# ----------------------------------------------------------------------- observation 7: HTML tables, no stray caption

def test_obs7_results_are_html_tables_and_captions_are_not_echoed():
    from IPython.core.formatters import DisplayFormatter

    from course.core.results import Html, Result

    r = Result("t", "T", {"op": "", "us": "us"}, [{"op": "a<b", "us": 1.5}])
    data, _ = DisplayFormatter().format(r)
    assert isinstance(r.html(), Html) and DisplayFormatter().format(r.html())[0]["text/html"] == str(r.html())
    assert "<table>" in data["text/html"] and "us [us]" in data["text/html"] and "a&lt;b" in data["text/html"]
    assert "<th>op</th>" in str(r.html(columns=["op"])) and "us [us]" not in str(r.html(columns=["op"]))
    with pytest.raises(KeyError):
        r.html(columns=["nope"])
    fig, (ax,) = plots.figure()
    cap = plots.caption(fig, r)
    assert isinstance(cap, plots.Caption) and "measured here on" in cap
    assert DisplayFormatter().format(cap) == ({}, {})  # no Out[n]


@pytest.mark.parametrize("path", catalog.all_notebooks_on_disk(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_obs7_notebooks_show_results_as_html_not_text_tables(path):
    nb = nbformat.read(path, as_version=4)
    for i, c in enumerate(nb.cells):
        if c.cell_type == "code":
            assert not re.search(r"print\(\w+\.table\(\)\)", c.source), f"{path.name} cell {i}: show the result itself"
            assert ".ljust(width" not in c.source, f"{path.name} cell {i}: a hand-made text table; use Result.html"


# ----------------------------------------------------------------------- nbgrader metadata, validated by nbgrader

@pytest.mark.parametrize("path", [p for p in catalog.all_notebooks_on_disk()
                                  if p.parent.name in ("labs", "solutions") or (ROOT / "solutions" / p.name).exists()],
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_nbgrader_metadata_is_valid(path):
    nbgrader = pytest.importorskip("nbgrader.nbgraderformat")
    from nbgrader import utils

    nb = nbformat.read(path, as_version=4)
    nbgrader.MetadataValidator().validate_nb(nb)
    grade_cells = [c for c in nb.cells if utils.is_grade(c)]
    assert grade_cells and all(c.metadata.nbgrader["points"] > 0 and utils.is_locked(c) for c in grade_cells)
    assert any(utils.is_solution(c) for c in nb.cells)
    for c in grade_cells:
        assert L.is_check_cell(c)


def test_with_nbgrader_marks_solution_and_check_cells():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("def f():\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION"),
                nbformat.v4.new_code_cell('with exercise("f"):\n    assert f() == 1'),
                nbformat.v4.new_code_cell("x = 1")]
    out = L.with_nbgrader(nb)
    assert out.cells[0].metadata.nbgrader["solution"] and out.cells[1].metadata.nbgrader["grade"]
    assert out.cells[1].metadata.nbgrader["points"] == 1 and "nbgrader" not in out.cells[2].metadata


# ----------------------------------------------------------------------- course grade

CHK = "from course.core.checks import exercise\n"


def _submission(body: str):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    nb.cells = [nbformat.v4.new_code_cell(f"def answer():\n{body}"),
                nbformat.v4.new_code_cell(CHK + 'with exercise("1. answer", hint="return 42"):\n'
                                          '    assert answer() == 42, f"got {answer()}"'),
                nbformat.v4.new_code_cell(CHK + 'with exercise("2. after"):\n    pass')]
    return nb


def test_grade_a_folder_of_five(tmp_path):
    subs = {"blank": "    raise NotImplementedError('answer()')", "correct": "    return 42",
            "wrong": "    return 41", "crashing": "    return [][1]", "endless": "    while True:\n        pass"}
    for student, body in subs.items():
        (tmp_path / student).mkdir()
        nbformat.write(_submission(body), tmp_path / student / "lab.ipynb")
    assert G.grade(tmp_path, cell_timeout=8, total_timeout=60) == 0
    import csv

    rows = list(csv.DictReader(open(tmp_path / "graded" / "grades.csv", encoding="utf-8")))
    got = {(r["student"], r["exercise"]): (r["status"], float(r["points"])) for r in rows}
    assert got[("blank", "1. answer")] == ("todo", 0) and got[("correct", "1. answer")] == ("pass", 1)
    assert got[("wrong", "1. answer")] == ("fail", 0) and got[("crashing", "1. answer")] == ("crash", 0)
    assert got[("endless", "1. answer")][0] == "timed out"
    assert all(got[(s, "2. after")] == ("pass", 1) for s in subs)  # the notebook went on after each
    page = (tmp_path / "graded" / "feedback" / "crashing.html").read_text()
    assert "IndexError" in page and "return [][1]" in page and "1 / 2 points" in page
    assert G.grade(tmp_path / "graded" / "feedback") == 2  # nothing to grade there


def test_not_reached_names_its_cause(tmp_path, capsys):
    nb = _submission("    return 42")
    nb.cells[1].source = "undefined_name\n" + nb.cells[1].source
    path = tmp_path / "n.ipynb"
    nbformat.write(nb, path)
    rep = G.run_checks(path, cell_timeout=30)
    first = rep["exercises"][0]
    assert first["status"] == "not reached" and "NameError" in first["message"]
    assert G.exercise_cells(nb) == {"1. answer": 1, "2. after": 2}
    assert "Feedback for x" in G.feedback_html("x", [("n.ipynb", rep)])
