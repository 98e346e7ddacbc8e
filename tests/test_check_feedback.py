"""`python -m course check` shows what the notebook shows, and its staged hints advance from run to run."""
import json

from pathlib import Path

import nbformat
import pytest

import course
from course.core import answers, checks
from course.tools import grade as G
from course.tools import hints
from course.tools.cli import build_parser
from cellrun import _fresh_checks  # noqa: F401 - autouse: every test starts and ends with no outcome

ROOT = Path(__file__).resolve().parent.parent

WRONG = 'with exercise("t.1 wrong", hint=["nudge", "idea", "line"]):\n    assert 1 == 2, "one is not two"'
CRASH = 'def f(xs):\n    return xs[5]\nwith exercise("t.2 crash", hint=["look at the index", "len is 3"]):\n    f([1, 2, 3])'
FINE = 'with exercise("t.3 ok"):\n    pass'


def _notebook(path, *sources):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell("from course.core.checks import exercise")]
    nb.cells += [nbformat.v4.new_code_cell(s) for s in sources]
    nbformat.write(nb, path)
    return path


def test_in_session_hints_start_at_the_first_stage_and_advance(capsys, monkeypatch):
    monkeypatch.delenv(checks.ENV_STAGES, raising=False)
    for _ in range(4):
        with checks.exercise("s", hint=["a", "b", "c"]):
            assert False, "no"
    out = capsys.readouterr().out
    assert [l.strip() for l in out.splitlines() if "hint:" in l] == [
        "hint: [1/3] a (run the check again after a change for the next hint)",
        "hint: [2/3] b (run the check again after a change for the next hint)", "hint: [3/3] c", "hint: [3/3] c"]
    assert checks.failures("s") == 4


def test_carried_failures_start_the_hint_further_on(capsys, monkeypatch, tmp_path):
    log = tmp_path / "log.jsonl"
    monkeypatch.setenv(checks.ENV_LOG, str(log))
    monkeypatch.setenv(checks.ENV_STAGES, json.dumps({"s": 1}))
    checks.reset()
    assert checks.carried_failures("s") == 1 and checks.carried_failures("other") == 0
    with checks.exercise("s", hint=["a", "b", "c"]):
        assert False, "no"
    with checks.exercise("other", hint=["x", "y"]):
        raise KeyError("k")
    out = capsys.readouterr().out
    assert "hint: [2/3] b" in out and "hint: [1/2] x" in out and "[1/3]" not in out
    assert [json.loads(l)["failures"] for l in log.read_text().splitlines()] == [2, 1]
    checks.reset()
    for bad in ("not json", "[1, 2]", '{"s": "two"}', '{"s": -3}'):  # a bad value never breaks the notebook
        monkeypatch.setenv(checks.ENV_STAGES, bad)
        assert checks.carried_failures("s") == 0


def test_hint_state_is_kept_per_notebook_and_reset_on_pass(tmp_path):
    a, b = tmp_path / "a.ipynb", tmp_path / "b.ipynb"
    assert hints.load_hint_state(a) == {} and hints.hint_state_path(a) == tmp_path / hints.HINT_STATE
    assert hints.save_hint_state(a, [{"name": "x", "status": "fail", "failures": 2},
                                     {"name": "y", "status": "todo", "failures": 0}]) is None
    assert hints.save_hint_state(b, [{"name": "x", "status": "crash", "failures": 1}]) is None
    assert hints.load_hint_state(a) == {"x": 2} and hints.load_hint_state(b) == {"x": 1}
    hints.save_hint_state(a, [{"name": "x", "status": "pass", "failures": 2}])
    assert hints.load_hint_state(a) == {} and hints.load_hint_state(b) == {"x": 1}
    hints.save_hint_state(b, [{"name": "x", "status": "pass", "failures": 1}])
    assert not hints.hint_state_path(a).exists(), "nothing left to remember: the file goes"
    hints.hint_state_path(a).write_text("{broken")
    assert hints.load_hint_state(a) == {}
    assert hints.save_hint_state(a, [{"name": "x", "status": "fail", "failures": 1}]) is None
    assert hints.load_hint_state(a) == {"x": 1}


def test_unwritable_hint_state_is_reported_not_fatal(tmp_path):
    folder = tmp_path / "ro"
    (folder / hints.HINT_STATE).mkdir(parents=True)  # a folder where the file should be: cannot be written
    why = hints.save_hint_state(folder / "n.ipynb", [{"name": "x", "status": "fail", "failures": 1}])
    assert why and "Error" in why


def test_course_check_shows_why_and_advances_hints(tmp_path, capsys):
    path = _notebook(tmp_path / "t.ipynb", WRONG, CRASH, FINE)
    assert G.check_notebook(path, timeout=60) == 1
    out = capsys.readouterr().out
    assert "✗ t.1 wrong: failed: one is not two" in out
    assert "hint: [1/3] nudge (run the check again after a change for the next hint)" in out
    assert "✗ t.2 crash: crashed: IndexError: list index out of range" in out
    assert "your line: f(), line 2 of its cell: return xs[5]" in out
    assert "why: an index went outside an array" in out and "hint: [1/2] look at the index" in out
    assert "✓ t.3 ok: passed" in out
    assert G.check_notebook(path, timeout=60) == 1
    out = capsys.readouterr().out
    assert "hint: [2/3] idea" in out and "hint: [2/2] len is 3" in out and "[1/3]" not in out
    assert hints.load_hint_state(path) == {"t.1 wrong": 2, "t.2 crash": 2}
    # --answers judges an answer version: it neither reads nor writes the learner's hint progress
    assert G.check_notebook(path, timeout=60, answers=True) == 1
    assert "hint: [1/3] nudge" in capsys.readouterr().out
    assert hints.load_hint_state(path) == {"t.1 wrong": 2, "t.2 crash": 2}
    _notebook(path, WRONG.replace("1 == 2", "2 == 2"), CRASH.replace("xs[5]", "xs[2]"), FINE)
    assert G.check_notebook(path, timeout=60) == 0
    out = capsys.readouterr().out
    assert "check: all 3 exercises passed." in out and "FAIL" not in out
    assert hints.load_hint_state(path) == {} and not hints.hint_state_path(path).exists()
    _notebook(path, WRONG)  # passed once: a new mistake starts at the first stage again
    G.check_notebook(path, timeout=60)
    assert "hint: [1/3] nudge" in capsys.readouterr().out


def test_course_grade_ignores_the_learners_hint_progress(tmp_path):
    path = _notebook(tmp_path / "t.ipynb", WRONG)
    hints.save_hint_state(path, [{"name": "t.1 wrong", "status": "fail", "failures": 2}])
    rep = G.run_checks(path, cell_timeout=60)
    (row,) = rep["exercises"]
    assert row["hint"].startswith("[1/3] nudge") and row["failures"] == 1
    assert hints.load_hint_state(path) == {"t.1 wrong": 2}
    html = G.feedback_html("s", [("t.ipynb", rep)])
    assert "hint: [1/3] nudge" in html


@pytest.mark.parametrize("statuses,line", [(["pass"], "check: the exercise passed."),
                                           (["pass", "skip"], "that run on this machine passed (1 skipped here"),
                                           (["skip"], "every exercise was skipped on this machine")])
def test_all_pass_says_so(tmp_path, capsys, monkeypatch, statuses, line):
    rows = [{"name": f"e{i}", "status": s, "message": "needs a GPU" if s == "skip" else "", "hint": "", "where": "",
             "why": "", "failures": 0, "points": 0, "max_points": 1} for i, s in enumerate(statuses)]
    monkeypatch.setattr(G, "run_checks", lambda *a, **k: {"exercises": rows, "stray": [], "error": None,
                                                           "seconds": 0.0})
    path = _notebook(tmp_path / "t.ipynb")
    assert G.check_notebook(path) == 0
    assert line in capsys.readouterr().out


# ----------------------------------------------------------------------------- the answer comes only when asked for
ANSWER = "return 42"
STAGED = ('with exercise("t.4 staged", hint=["the rule", "where in your code", "a smaller example"], '
          f'answer={ANSWER!r}):\n    assert 1 == 2, "one is not two"')


def test_three_wrong_tries_teach_and_never_tell(tmp_path, capsys, monkeypatch):
    """A learner's three wrong tries climb the hints to the last one, which offers the answer but does not give it;
    the answer comes with --show-answer, and not at all when the teacher turned answers off."""
    monkeypatch.delenv(answers.ENV_ANSWERS, raising=False)
    path = _notebook(tmp_path / "t.ipynb", STAGED)
    seen = []
    for _ in range(3):
        assert G.check_notebook(path, timeout=60) == 1
        seen.append(capsys.readouterr().out)
    assert all(ANSWER not in out for out in seen), "a wrong try printed the answer"
    assert "hint: [1/3] the rule" in seen[0] and "hint: [2/3] where in your code" in seen[1]
    assert "hint: [3/3] a smaller example (that was the last hint" in seen[2]
    assert '--show-answer "t.4 staged"' in seen[2] and "course.show_answer('t.4 staged')" in seen[2]
    assert G.check_notebook(path, timeout=60, show_answer=["t.4"]) == 1  # the start of its name is enough
    out = capsys.readouterr().out
    assert f"answer (you asked for it): {ANSWER}" in out
    assert G.check_notebook(path, timeout=60, show_answer=["t.9"]) == 2
    assert "names no exercise" in capsys.readouterr().out
    monkeypatch.setenv(answers.ENV_ANSWERS, "off")
    assert G.check_notebook(path, timeout=60, show_answer=["t.4"]) == 2
    assert "turned off" in capsys.readouterr().out
    assert G.check_notebook(path, timeout=60) == 1
    out = capsys.readouterr().out
    assert "hint: [3/3] a smaller example" in out and ANSWER not in out and "show-answer" not in out
    assert build_parser().parse_args(["check", "n.ipynb", "--show-answer", "02.3", "--show-answer", "02.4"]
                                     ).show_answer == ["02.3", "02.4"]


def test_show_answer_in_the_notebook(capsys, monkeypatch):
    monkeypatch.delenv(answers.ENV_ANSWERS, raising=False)
    monkeypatch.delenv(answers.ENV_SHOW, raising=False)
    assert answers.show_answer("z.1") is None and "run an exercise's check cell first" in capsys.readouterr().out
    for _ in range(2):
        with checks.exercise("z.1 one", hint="the rule", answer="x = 1"):
            assert False
        with checks.exercise("z.10 ten", answer="x = 10"):
            pass
    out = capsys.readouterr().out
    assert "x = 1" not in out and "course.show_answer('z.1 one')" in out
    assert answers.show_answer("z.1") is None and "more than one" in capsys.readouterr().out
    assert answers.show_answer("z.1 one") == "x = 1" and course.show_answer("z.10") == "x = 10"
    assert answers.match("z.1", ["z.1 one", "z.10 ten"]) == ["z.1 one", "z.10 ten"]
    monkeypatch.setenv(answers.ENV_SHOW, json.dumps(["z.1 one"]))
    assert answers.requested("z.1 one") and not answers.requested("z.10 ten")
    with checks.exercise("z.1 one", hint="the rule", answer="x = 1"):
        assert False
    assert "answer (you asked for it): x = 1" in capsys.readouterr().out
    monkeypatch.setenv(answers.ENV_ANSWERS, "off")
    assert answers.answers_off() and not answers.requested("z.1 one") and answers.offer("z.1 one") == ""
    assert answers.show_answer("z.1 one") is None and "turned off" in capsys.readouterr().out
    monkeypatch.setenv(answers.ENV_SHOW, "not json")
    monkeypatch.delenv(answers.ENV_ANSWERS)
    assert not answers.requested("z.1 one")
    answers.remember("z.2", "")  # no answer: nothing to offer
    assert answers.offer("z.2") == ""


def _staged_hints():
    """(where, exercise name or expression, hint stages, answer node or None) for every staged hint in the course."""
    import ast

    sources = [(str(p.relative_to(ROOT)), p.read_text()) for p in sorted((ROOT / "course").rglob("*.py"))]
    for p in sorted((ROOT / "solutions").glob("*.ipynb")):
        for i, c in enumerate(nbformat.read(p, as_version=4).cells):
            if c.cell_type == "code" and "exercise(" in c.source:
                sources.append((f"{p.relative_to(ROOT)} cell {i}", c.source))
    for where, src in sources:
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "exercise":
                kw = {k.arg: k.value for k in node.keywords}
                if isinstance(kw.get("hint"), ast.List) and len(kw["hint"].elts) >= 2:
                    yield where, ast.unparse(node.args[0]), [ast.literal_eval(e) for e in kw["hint"].elts], \
                        kw.get("answer")


def test_every_staged_hint_teaches_and_keeps_its_answer_apart():
    """Every staged hint of the course has at least three stages of explanation and its answer in answer=, which
    no stage repeats."""
    import ast

    found = list(_staged_hints())
    assert len(found) >= 30, len(found)
    for where, name, stages, answer in found:
        assert answer is not None, f"{where}: {name}'s staged hint needs its answer in answer=, not as a stage"
        assert len(stages) >= 3, f"{where}: {name}: the rule, where in the code, a smaller example"
        if isinstance(answer, ast.Constant):
            assert all(answer.value not in s for s in stages), f"{where}: {name}: a stage gives the answer away"


def test_reset_forgets_the_sessions_answers(capsys):
    with checks.exercise("z.2 two", answer="y = 2"):
        pass
    assert answers.show_answer("z.2") == "y = 2"
    checks.reset()
    assert answers.show_answer("z.2") is None and "run an exercise's check cell first" in capsys.readouterr().out
