"""course.tools.learner_versions (labs and exercise versions generated from solutions) and the notebook checker."""
import json
from pathlib import Path

import nbformat
import pytest

from course.tools import grade as G
from course.tools import learner_versions as L
from course.tools.catalog import ROOT, entries


def _nb(*cells):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    for i, (kind, src, *tags) in enumerate(cells):
        cell = nbformat.v4.new_code_cell(src) if kind == "code" else nbformat.v4.new_markdown_cell(src)
        cell["id"] = f"c{i}"
        if tags:
            cell.metadata["tags"] = list(tags)
        nb.cells.append(cell)
    return nb


SOLVED = '''def build_kernel():
    """Doc."""
    x = 1
    ### BEGIN SOLUTION
    def kernel(a):
        a[0] = x
    return kernel
    ### END SOLUTION


def other():
    ### BEGIN SOLUTION
    return 2
    ### END SOLUTION'''


def test_strip_solutions_keeps_indentation_and_names_the_function():
    lab = L.strip_solutions(SOLVED)
    assert "a[0] = x" not in lab and "return 2" not in lab
    assert "    # YOUR CODE HERE\n    raise NotImplementedError('build_kernel(): your code goes here')" in lab
    assert "raise NotImplementedError('other(): your code goes here')" in lab
    assert '    """Doc."""\n    x = 1\n' in lab
    ns = {}
    exec(lab, ns)  # the lab is valid Python and raises at call time, in Python
    with pytest.raises(NotImplementedError, match="build_kernel"):
        ns["build_kernel"]()


@pytest.mark.parametrize("bad,msg", [
    ("### END SOLUTION", "without"),
    ("### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION", "inside another"),
    ("x = 1\n### BEGIN SOLUTION\ny = 2", "never closed"),
])
def test_strip_solutions_rejects_broken_markers(bad, msg):
    with pytest.raises(L.SolutionMarkerError, match=msg):
        L.strip_solutions(bad)


def test_strip_markdown():
    assert L.strip_markdown("Answer: <!-- BEGIN SOLUTION -->42<!-- END SOLUTION -->.") == "Answer: *Your answer here.*."
    with pytest.raises(L.SolutionMarkerError):
        L.strip_markdown("<!-- BEGIN SOLUTION --> open")


def test_make_lab_drops_solution_only_cells_and_outputs():
    nb = _nb(("markdown", "# Title"), ("code", SOLVED), ("markdown", "solution notes", L.DROP_TAG))
    nb.cells[1].outputs = [nbformat.v4.new_output("stream", text="hi")]
    nb.cells[1].execution_count = 3
    lab = L.make_lab(nb)
    assert len(lab.cells) == 2 and lab.cells[1].outputs == [] and lab.cells[1].execution_count is None
    assert "NotImplementedError" in lab.cells[1].source
    assert "a[0] = x" in nb.cells[1].source  # the solution itself is untouched
    broken = _nb(("code", "### END SOLUTION"))
    with pytest.raises(L.SolutionMarkerError, match="cell 0"):
        L.make_lab(broken)


def test_a_learner_version_names_its_answer_version_in_its_first_cell():
    nb = _nb(("markdown", "# Title\n\nIntro."), ("code", SOLVED))
    lab = L.make_lab(nb, source="solutions/lab9.ipynb")
    assert lab.cells[0].source.startswith("# Title\n\nIntro.\n\n")
    assert lab.cells[0].source.endswith(L.source_note("solutions/lab9.ipynb"))
    assert "learner version of `solutions/lab9.ipynb`" in lab.cells[0].source and "goes into" in lab.cells[0].source
    assert "learner version" not in nb.cells[0].source  # the answer version is untouched
    code_first = L.make_lab(_nb(("code", SOLVED)), source="solutions/lab9.ipynb")
    assert code_first.cells[0].cell_type == "markdown" and code_first.cells[0].id == "learner-version"
    assert "learner version" not in L.make_lab(nb).cells[0].source  # no source given: no note


def test_shipped_learner_versions_name_their_answer_versions():
    root = Path(__file__).resolve().parent.parent
    for sol in sorted((root / "solutions").glob("*.ipynb")):
        learner = L.target(root, sol)
        first = nbformat.read(learner, as_version=4).cells[0].source
        assert f"learner version of `solutions/{sol.name}`" in first, learner


def test_build_labs_writes_then_checks(tmp_path, capsys):
    (tmp_path / "solutions").mkdir()
    nbformat.write(_nb(("code", SOLVED)), tmp_path / "solutions" / "lab9.ipynb")
    assert L.build_labs(check=True, root=tmp_path) == 1
    assert "labs/lab9.ipynb is missing" in capsys.readouterr().out
    assert L.build_labs(check=False, root=tmp_path) == 0
    assert L.build_labs(check=True, root=tmp_path) == 0
    lab = tmp_path / "labs" / "lab9.ipynb"
    lab.write_text(lab.read_text().replace("YOUR CODE HERE", "edited"))
    capsys.readouterr()
    assert L.build_labs(check=True, root=tmp_path) == 1
    assert "labs/lab9.ipynb is out of sync with solutions/lab9.ipynb" in capsys.readouterr().out
    L.build_labs(root=tmp_path)
    nbformat.write(_nb(("code", "x = 1")), tmp_path / "labs" / "orphan.ipynb")
    assert L.build_labs(check=True, root=tmp_path) == 1
    assert "orphan.ipynb has no source" in capsys.readouterr().out
    nbformat.write(_nb(("code", "### BEGIN SOLUTION")), tmp_path / "solutions" / "lab9.ipynb")
    assert L.build_labs(check=False, root=tmp_path) == 2


def test_shipped_labs_are_in_sync_with_their_solutions(capsys):
    assert L.build_labs(check=True) == 0, capsys.readouterr().out
    for e in entries("lab"):
        text = (ROOT / e.path).read_text()
        assert "### BEGIN SOLUTION" not in text and "raise NotImplementedError" in text
    for e in entries("solution"):
        assert "### BEGIN SOLUTION" in (ROOT / e.path).read_text()


def test_exercise_names_in_order():
    nb = _nb(("code", 'with exercise("1. first", hint="h"):\n    pass'),
             ("code", 'from course.core.checks import exercise\nwith checks.exercise("2. second"):\n    pass'),
             ("code", "this is not python ("))
    assert G.exercise_names(nb) == ["1. first", "2. second"]


CHECKS = "from course.core.checks import exercise\n"


def test_check_notebook_reports_pass_todo_fail_and_stray_errors(tmp_path, capsys):
    nb = _nb(("code", CHECKS + 'with exercise("ok") as notes:\n    notes.append("the loop wrote: hello")'),
             ("code", CHECKS + 'def todo():\n    raise NotImplementedError("x")\nwith exercise("todo", hint=["a", "b"]):\n'
                      '    todo()'),
             ("code", CHECKS + 'with exercise("wrong", hint="add one"):\n    assert 1 == 2, "one is not two"'),
             ("code", "1 / 0"),
             ("code", CHECKS + 'with exercise("after the errors"):\n    pass'))
    path = tmp_path / "learner.ipynb"
    nbformat.write(nb, path)
    assert G.check_notebook(path, timeout=60) == 1
    out = capsys.readouterr().out
    assert "✓ ok: passed - the loop wrote: hello" in out and "… todo: not done yet" in out  # a ✓'s note shows
    assert "[1/2] a" not in out  # no hint before anything was tried
    assert "✗ wrong: failed: one is not two" in out and "hint: add one" in out
    assert "cell 3 raised ZeroDivisionError" in out and "✓ after the errors" in out
    assert "2/4 passed, 1 failed, 0 crashed, 1 not done yet" in out
    assert "cell 2" not in out  # the failed check is reported once, as a check


def test_check_notebook_all_pass_and_unreadable(tmp_path, capsys):
    path = tmp_path / "done.ipynb"
    nbformat.write(_nb(("code", CHECKS + 'with exercise("only"):\n    pass')), path)
    assert G.check_notebook(path, timeout=60) == 0
    assert "1/1 passed" in capsys.readouterr().out
    assert G.check_notebook(tmp_path / "missing.ipynb") == 2
    (tmp_path / "junk.ipynb").write_text(json.dumps({"not": "a notebook"}))
    assert G.check_notebook(tmp_path / "junk.ipynb") == 2
