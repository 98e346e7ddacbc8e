"""`python -m course check` shows what the notebook shows, and its staged hints advance from run to run."""
import json

import nbformat
import pytest

from course.core import checks
from course.tools import grade as G
from course.tools import hints

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
    checks.reset()
    for _ in range(4):
        with checks.exercise("s", hint=["a", "b", "c"]):
            assert False, "no"
    out = capsys.readouterr().out
    assert [l.strip() for l in out.splitlines() if "hint:" in l] == [
        "hint: [1/3] a (run the check again after a change for the next hint)",
        "hint: [2/3] b (run the check again after a change for the next hint)", "hint: [3/3] c", "hint: [3/3] c"]
    assert checks.failures("s") == 4
    checks.reset()


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
    checks.reset()


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
