"""The staged-hint rule, for every exercise of the course: hints follow a ✗ (never "not done yet"), in at least two
stages (the rule, where, a smaller example) none of which quotes the answer's code; the answer is registered apart
and shown only on request: ``course check --show-answer NAME`` on the learner's version names every exercise.

Exercises are found in the source (:mod:`course.tools.exercises`): every ``exercise(...)`` call in ``course/`` and in
the answer versions' cells, and, per answer version, the ``### BEGIN SOLUTION`` lines each check judges. A check
whose notebook has no answer block for it (one that checks the lesson's own measurements) has nothing to hint at.
"""
import ast
import contextlib
import io
from pathlib import Path

import nbformat
import pytest

from course.core import answers, checks
from course.tools import cli, grade
from course.tools.catalog import CATALOG
from course.tools.exercises import (COMPUTED, answer_lines, exercise_calls, exercise_names, module_constants,
                                    quoted_lines, registered_hints)

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "solutions").glob("*.ipynb"))
REGISTERED = registered_hints(ROOT)
EXERCISES = [(nb.name, name, lines) for nb in NOTEBOOKS
             for name, lines in answer_lines(nbformat.read(nb, as_version=4)).items()]
LEARNER = {e.answer_version: e.path for e in CATALOG if e.kind != "solution"}  # answer version -> learner's
DECLARED = [(LEARNER[f"solutions/{nb.name}"], name) for nb in NOTEBOOKS
            for name in exercise_names(nbformat.read(nb, as_version=4))]


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    for env in (checks.ENV_LOG, checks.ENV_STAGES, checks.ENV_GATE, checks.ENV_NBGRADER, answers.ENV_SHOW,
                answers.ENV_ANSWERS):
        monkeypatch.delenv(env, raising=False)
    checks.reset()
    yield
    checks.reset()


def test_the_walk_finds_the_exercises_of_every_kind():
    names = {name for _, name, _ in EXERCISES}
    # a literal name, a module constant (NAME), a parameter default (name=...), a notebook's own check function
    assert {"lab 3.1 the key", "lab 4.5 the token loop, captured by hand", "07.1 a fused RMSNorm + GEMV",
            "04.1 choose a preset", "06.4 the reduce-overhead step", "02.6 capture a forward by hand"} <= names
    assert len(EXERCISES) >= 40


@pytest.mark.parametrize("notebook, name, lines", EXERCISES, ids=[f"{n}: {e}" for n, e, _ in EXERCISES])
def test_every_exercise_has_staged_hints_that_do_not_quote_its_answer(notebook, name, lines):
    entry = REGISTERED.get(name)
    assert entry is not None, f"{notebook}: no exercise({name!r}, ...) call whose name the source gives"
    hint, where = entry["hint"], entry["where"]
    assert isinstance(hint, list) and len(hint) >= 2, (
        f"{name} ({where}): the hint must be staged, a list of at least two stages (the rule, where, a smaller "
        f"example), got {type(hint).__name__}")
    assert all(isinstance(s, str) and s.strip() for s in hint), f"{name} ({where}): an empty stage"
    assert entry["answer"], f"{name} ({where}): no answer= (shown on request only, apart from the hints)"
    for i, stage in enumerate(hint, 1):
        quoted = quoted_lines(stage, lines)
        assert len(quoted) < 2, f"{name} ({where}): hint stage {i} quotes the answer's code: {quoted}"


def _unnamed(tree) -> list:
    """The lines of ``exercise(...)`` calls in ``tree`` whose exercise the source does not name, in any scope."""
    consts = module_constants(tree)
    scopes = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)] + [tree]
    named = {id(call) for scope in scopes for name, call in exercise_calls(scope, consts) if name}
    return [call.lineno for _, call in exercise_calls(tree) if id(call) not in named]


def test_every_exercise_call_names_its_exercise_in_the_source():
    """What ``course check`` cannot read it cannot name (``--show-answer``, the gate): every ``exercise(...)`` call
    in ``course/`` and in the answer versions gives its name as a literal, a constant or a parameter's default."""
    where = [f"{p.relative_to(ROOT)}:{line}" for p in sorted((ROOT / "course").rglob("*.py"))
             for line in _unnamed(ast.parse(p.read_text(encoding="utf-8")))]
    for nb in NOTEBOOKS:
        for i, cell in enumerate(nbformat.read(nb, as_version=4).cells):
            if cell.cell_type == "code" and "exercise(" in cell.source:
                where += [f"{nb.name} cell {i}:{line}" for line in _unnamed(ast.parse(cell.source))]
    assert not where, f"exercise(...) calls whose name the source does not give: {where}"


def test_every_exercise_of_the_course_is_declared_by_its_notebook():
    """An ``exercise(...)`` the source reading misses (a name given as a parameter's default that is a constant) is
    an exercise ``--show-answer`` cannot name: every registered exercise is declared by an answer version."""
    missed = sorted(set(REGISTERED) - {name for _, name in DECLARED})
    assert not missed, f"exercises no notebook declares (course check --show-answer refuses them): {missed}"


@pytest.mark.parametrize("learner, name", DECLARED, ids=[f"{n}: {e}" for n, e in DECLARED])
def test_show_answer_on_the_learner_version_names_every_exercise(monkeypatch, capsys, learner, name):
    """``python -m course check --show-answer NAME`` on the learner's notebook, as a learner types it (the kernel's
    run stood in for: the answer goes to that run only for ``NAME``)."""
    asked = []

    def run(path, show=(), **_):
        asked.append(list(show))
        return {"exercises": [], "stray": [], "error": None, "seconds": 0.0}

    monkeypatch.setattr(grade, "run_checks", run)
    monkeypatch.setattr(grade, "save_hint_state", lambda *a: None)
    code = cli.main(["check", "--show-answer", name, str(ROOT / learner)])
    out = capsys.readouterr().out
    assert code == 0 and asked == [[name]], f"--show-answer {name!r} is refused in {learner}:\n{out}"


@pytest.mark.parametrize("name", sorted(REGISTERED), ids=sorted(REGISTERED))
def test_not_done_yet_shows_no_hint_and_no_answer(name):
    entry = REGISTERED[name]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        with checks.exercise(name, hint=entry["hint"] or "", answer=entry["answer"] or ""):
            raise NotImplementedError("your code goes here")
    text = out.getvalue()
    assert "not done yet" in text and "hint" not in text, text
    stages = entry["hint"] if isinstance(entry["hint"], list) else [entry["hint"] or ""]
    assert not any(s and s in text for s in stages), text
    if entry["answer"] and entry["answer"] != COMPUTED:
        assert entry["answer"] not in text, text


def test_after_a_failure_the_first_stage_then_the_next_and_the_answer_only_on_request(capsys):
    name = "lab 4.5 the token loop, captured by hand"
    entry = REGISTERED[name]
    for i in range(len(entry["hint"])):
        with checks.exercise(name, hint=entry["hint"], answer=entry["answer"]):
            raise AssertionError("wrong")
        out = capsys.readouterr().out
        assert entry["hint"][i] in out and entry["answer"] not in out
    assert "course.show_answer('lab 4.5 the token loop, captured by hand')" in out
    assert answers.show_answer("lab 4.5") == entry["answer"]


def test_quoted_lines_catches_an_answer_given_as_a_stage():
    lines = ["self.next = self.one_token()  # static output", "self.graph.replay()", "out.append(self.next.clone())",
             "self.ids.copy_(self.next)  # fed back"]
    answer_as_stage = ("with cg.graph(self.graph): self.next = self.one_token()  ...  for each token: "
                       "self.graph.replay(); out.append(self.next.clone()); self.ids.copy_(self.next)")
    assert quoted_lines(answer_as_stage, lines) == ["self.next = self.one_token()", "out.append(self.next.clone())",
                                                    "self.ids.copy_(self.next)"]
    assert quoted_lines("replay, clone the next token, copy it into ids", lines) == []
    assert quoted_lines("call self.graph.replay() per token", lines) == []  # an idiom shorter than MIN_QUOTE


def test_names_come_from_constants_defaults_and_the_cells_that_run_the_checks():
    from course.tools.exercises import check_cells

    src = 'NAME = "x.1 first"\nHINT = ["a", "b"]\ndef check_a(fn):\n    with exercise(NAME, hint=HINT):\n        pass\n'
    assert module_constants(ast.parse(src)) == {"NAME": "x.1 first"}
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell('def check_b(fn, name="x.2 second"):\n    with exercise(name, hint=["a", "b"]):\n'
                                  '        fn()'),
        nbformat.v4.new_code_cell("def mine():\n    ### BEGIN SOLUTION\n    return 42\n    ### END SOLUTION"),
        nbformat.v4.new_code_cell("check_b(mine)"),
        nbformat.v4.new_code_cell('with exercise("x.3 third", hint=["a", "b"]):\n    pass')])
    assert check_cells(nb) == {"x.2 second": 2, "x.3 third": 3}  # the call, not the definition
    assert answer_lines(nb) == {"x.2 second": ["return 42"]}  # x.3 judges no answer block
