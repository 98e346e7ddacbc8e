"""The staged-hint rule, for every exercise of the course: hints follow a ✗ (never "not done yet"), in at least two
stages (the rule, where, a smaller example) none of which quotes the answer's code; the answer is registered apart
and shown only on request, by a name ``course check --show-answer`` and ``course.show_answer`` accept.

Exercises are found in the source (:mod:`course.tools.exercises`): every ``exercise(...)`` call in ``course/`` and in
the answer versions' cells, and, per answer version, the ``### BEGIN SOLUTION`` lines each check judges. A check
whose notebook has no answer block for it (one that checks the lesson's own measurements) has nothing to hint at.
"""
import contextlib
import io
from pathlib import Path

import nbformat
import pytest

from course.core import answers, checks
from course.tools.exercises import COMPUTED, answer_lines, exercise_names, quoted_lines, registered_hints

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "solutions").glob("*.ipynb"))
REGISTERED = registered_hints(ROOT)
EXERCISES = [(nb.name, name, lines) for nb in NOTEBOOKS
             for name, lines in answer_lines(nbformat.read(nb, as_version=4)).items()]


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


@pytest.mark.parametrize("notebook, name, lines", EXERCISES, ids=[f"{n}: {e}" for n, e, _ in EXERCISES])
def test_show_answer_names_every_exercise(notebook, name, lines):
    names = exercise_names(nbformat.read(ROOT / "solutions" / notebook, as_version=4))
    assert answers.match(name, names) == [name], f"--show-answer {name!r} is refused in {notebook}: it knows {names}"


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
    import ast

    from course.tools.exercises import check_cells, module_constants

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
