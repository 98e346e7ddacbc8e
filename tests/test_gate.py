"""The suite's gate (course.tools.gate) and `course check` as a judge: a ✗ fails the run, not only a raised cell.

nbval-lax passed a notebook whose check printed ✗ (answer versions that failed their own checks passed the GPU
lane). These tests run the real conftest.py on tiny notebooks written into tmp_path.
"""
import json
import os
import re
import subprocess
import sys

import nbformat
import pytest

from course.core import checks
from course.tools import cli, gate, grade as G
from course.tools.catalog import ROOT
from cellrun import _fresh_checks  # noqa: F401 - autouse: every test starts and ends with no outcome

CHK = "from course.core.checks import exercise, skip\n"


def _nb(*sources):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    nb.cells = [nbformat.v4.new_code_cell(s) for s in sources]
    return nb


PASSING = CHK + 'with exercise("a"):\n    assert 1 + 1 == 2'
FAILING = CHK + 'with exercise("a", hint="add again"):\n    assert 1 + 1 == 3, "1 + 1 is not 3"'
TODO = CHK + 'with exercise("a"):\n    raise NotImplementedError("answer(): your code goes here")'
CRASHING = CHK + 'with exercise("a"):\n    [][1]'
GPU_ONLY = CHK + 'skip("b", "needs a GPU (a real capture)")'
UNREACHED = 'if False:\n    from course.core.checks import exercise\n    with exercise("c"):\n        pass'


def _write(tmp_path, folder, name, *sources):
    path = tmp_path / folder / f"{name}.ipynb"
    path.parent.mkdir(exist_ok=True)
    nbformat.write(_nb(*sources), path)
    return path


def _outcomes(tmp_path, *paths) -> dict:
    """Run the suite's own conftest.py (as a plugin: ``-p conftest``) with nbval-lax; item -> PASSED/FAILED."""
    args = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "conftest", "--nbval-lax", "-q", "-rA",
            "--rootdir", str(tmp_path)] + [str(p) for p in paths]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "")
                                                                       .split(os.pathsep) if p]))
    out = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    got = {m[2]: m[1] for m in re.finditer(r"^(PASSED|FAILED) (\S+?::(?:Cell \d+|exercises))", out.stdout, re.M)}
    return got, out.stdout + out.stderr


def test_the_gate_fails_answer_versions_that_do_not_pass_and_learner_versions_with_a_cross(tmp_path):
    paths = [_write(tmp_path, "solutions", "failing", FAILING),
             _write(tmp_path, "solutions", "passing", PASSING, GPU_ONLY),
             _write(tmp_path, "solutions", "todo", TODO),
             _write(tmp_path, "solutions", "unreached", PASSING, UNREACHED),
             _write(tmp_path, "labs", "todo", TODO, GPU_ONLY),
             _write(tmp_path, "labs", "crashing", CRASHING),
             _write(tmp_path, "notebooks", "failing", FAILING)]
    got, text = _outcomes(tmp_path, *paths)
    want = {
        "solutions/failing.ipynb::Cell 0": "FAILED", "solutions/failing.ipynb::exercises": "FAILED",
        "solutions/passing.ipynb::Cell 0": "PASSED", "solutions/passing.ipynb::exercises": "PASSED",
        "solutions/todo.ipynb::Cell 0": "FAILED", "solutions/todo.ipynb::exercises": "FAILED",
        "solutions/unreached.ipynb::Cell 1": "PASSED", "solutions/unreached.ipynb::exercises": "FAILED",
        "labs/todo.ipynb::Cell 0": "PASSED", "labs/todo.ipynb::exercises": "PASSED",
        "labs/crashing.ipynb::Cell 0": "FAILED", "labs/crashing.ipynb::exercises": "FAILED",
        "notebooks/failing.ipynb::Cell 0": "FAILED", "notebooks/failing.ipynb::exercises": "FAILED",
    }
    assert {k: got.get(k) for k in want} == want, text
    assert "1 + 1 is not 3" in text and "c: not reached" in text and "checks.skip(name, why)" in text, text
    assert "python -m course check --answers" in text, "the gate says how to see the full report"


def test_the_suite_runs_with_the_gate(request):
    assert request.config.pluginmanager.has_plugin("course.tools.gate"), "conftest.py must register the gate"
    for hook in ("pytest_collection_modifyitems", "pytest_runtest_setup", "pytest_unconfigure"):
        assert callable(getattr(gate, hook))


def test_mode_for_reads_the_folder():
    assert gate.mode_for(ROOT / "solutions" / "lab3_graph_cache.ipynb") == "answers"
    assert gate.mode_for(ROOT / "labs" / "lab3_graph_cache.ipynb") == "learner"
    assert gate.mode_for(ROOT / "notebooks" / "00_start_here.ipynb") == "learner"
    assert gate.mode_for(ROOT / "work" / "labs" / "x.py") is None and gate.mode_for("/tmp/x.ipynb") is None


def test_problems_judge_the_log(tmp_path):
    log = tmp_path / "log.jsonl"
    entries = [{"name": "a", "status": "fail", "message": "wrong"}, {"name": "a", "status": "pass", "message": ""},
               {"name": "b", "status": "todo", "message": "todo"}, {"name": "g", "status": "skip", "message": "GPU"},
               {"name": "s", "status": "skip", "message": ""}]
    log.write_text("".join(json.dumps(e) + "\n" for e in entries))
    assert gate.read_log(log) == entries and gate.read_log(tmp_path / "none.jsonl") == []
    learner = gate.problems(entries, ["a", "b", "c"], "learner")
    assert learner == ["✗ a: failed: wrong"], "a ✗ anywhere fails, even if a later run passed"
    answers = gate.problems(entries, ["a", "b", "c", "g"], "answers")
    assert answers[0] == "✗ a: failed: wrong" and any(p.startswith("… b: not done yet") for p in answers)
    assert any(p.startswith("? c: not reached") for p in answers) and any("s: skipped without a reason" in p
                                                                          for p in answers)
    assert not any(p.startswith("- g") for p in answers), "a skip with a reason passes"
    assert gate.problems([{"name": "a", "status": "pass"}], ["a"], "answers") == []
    with pytest.raises(gate.GateFailed):
        raise gate.GateFailed("x")
    assert gate.ExercisesItem.runtest.__doc__


def test_judge_and_the_raising_statuses(monkeypatch):
    rows = [{"name": "t", "status": "todo", "message": ""}, {"name": "x", "status": "timed out", "message": "loop"}]
    assert G.judge(rows) == ["⏱ x: timed out: loop"] and len(G.judge(rows, answers=True)) == 2
    monkeypatch.delenv(checks.ENV_GATE, raising=False)
    monkeypatch.delenv(checks.ENV_NBGRADER, raising=False)
    assert checks.raising_statuses() == set() and checks.raising_statuses(raise_on_fail=True) == {checks.FAIL}
    monkeypatch.setenv(checks.ENV_GATE, "learner")
    assert checks.raising_statuses() == {checks.FAIL, checks.CRASH}
    with checks.exercise("g. todo"):  # a learner version may say "not done yet"
        raise NotImplementedError("later")
    with pytest.raises(checks.ExerciseFailed, match="never ✗"):
        with checks.exercise("g. crash"):
            [][1]
    monkeypatch.setenv(checks.ENV_GATE, "answers")
    assert checks.raising_statuses() == {checks.FAIL, checks.CRASH, checks.TODO}
    with pytest.raises(checks.ExerciseFailed, match="must pass every exercise"):
        with checks.exercise("g. todo"):
            raise NotImplementedError("later")
    monkeypatch.setenv(checks.ENV_GATE, "everything")
    with pytest.raises(ValueError, match="COURSE_GATE"):
        checks.raising_statuses()


def test_lab3_declares_its_exercises_through_the_course_checks():
    assert G.course_checks()["check_key"] == ["lab 3.1 the key"]
    nb = nbformat.read(ROOT / "solutions" / "lab3_graph_cache.ipynb", as_version=4)
    names = G.exercise_names(nb)
    assert names[0] == "lab 3.1 the key" and names[-1] == "lab 3.7 enable and clear" and len(names) == 7, names
    own = _nb("def check_key(x):\n    return x", "check_key(1)")  # a notebook's own function of that name
    assert G.exercise_cells(own) == {}


def test_course_check_judges_answers_and_learner_versions(tmp_path, capsys):
    todo = _write(tmp_path, "x", "todo", PASSING, TODO.replace('"a"', '"b"'))
    assert G.check_notebook(todo, timeout=120) == 0, "a learner version may be not done yet"
    assert G.check_notebook(todo, timeout=120, answers=True) == 1, "an answer version may not"
    assert "--answers" in capsys.readouterr().out
    failing = _write(tmp_path, "x", "failing", FAILING)
    assert G.check_notebook(failing, timeout=120) == 1
    unreached = _write(tmp_path, "x", "unreached", PASSING, UNREACHED)
    assert G.check_notebook(unreached, timeout=120) == 1
    args = cli.build_parser().parse_args(["check", "--answers", str(todo)])
    assert args.answers and cli.main(["check", "--answers", str(todo)]) == 1


def test_keep_outputs_writes_what_each_cell_printed(tmp_path, monkeypatch):
    """COURSE_KEEP_OUTPUTS=DIR: the lane's executed copies, for reading what each cell printed on that machine."""
    from course.tools.gate import keep_outputs

    kept = tmp_path / "kept"
    monkeypatch.setenv("COURSE_KEEP_OUTPUTS", str(kept))
    path = _write(tmp_path, "solutions", "printing", 'print("measured 42 us")', PASSING)
    got, log = _outcomes(tmp_path, path)
    assert got.get("solutions/printing.ipynb::exercises") == "PASSED", log
    nb = nbformat.read(kept / "solutions__printing.ipynb", as_version=4)
    assert "measured 42 us" in "".join(o.get("text", "") for o in nb.cells[0].outputs)
    monkeypatch.delenv("COURSE_KEEP_OUTPUTS")
    assert keep_outputs(None) is None  # not asked for: nothing written, nothing read


def test_a_check_named_by_a_module_constant_is_declared_too():
    """``exercise(NAME)`` with ``NAME = "..."`` at its module's top declares NAME, as ``exercise("...")`` does: the
    gate then fails an answer version whose check never reported (lab 4.5 and 02.6-02.8 were unseen before)."""
    import ast

    from course.lessons.capture_replay import capture_checks
    from course.lessons.real_model import hand_check, reduce_check

    known = G.course_checks()
    assert known["check_hand_capture"] == [hand_check.HAND]
    assert known["check_reduce_overhead"] == [reduce_check.REDUCE]
    assert known["check_shared_pool"] == [capture_checks.C]
    assert G.module_constants(ast.parse('A = "x"\nB = 3\nC, D = "1", "2"\ndef f():\n    E = "in"\n')) == {"A": "x"}
    nb = nbformat.read(ROOT / "solutions" / "lab4_real_model.ipynb", as_version=4)
    assert hand_check.HAND in G.exercise_names(nb)  # lab 4.5's check, named by its module's constant
