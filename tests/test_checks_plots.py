import json

import matplotlib

matplotlib.use("Agg")
import pytest
import torch

from course.core import checks, plots
from course.core.results import Result
from cellrun import _fresh_checks  # noqa: F401 - autouse: every test starts and ends with no outcome


def test_exercise_pass_todo_fail(capsys, tmp_path, monkeypatch):
    log = tmp_path / "log.jsonl"
    monkeypatch.setenv(checks.ENV_LOG, str(log))
    with checks.exercise("a"):
        pass
    with checks.exercise("b", hint="write it"):
        raise NotImplementedError("todo")
    with checks.exercise("c", hint="look again"):  # a ✗ does not stop the notebook
        assert 1 == 2, "wrong"
    with pytest.raises(checks.ExerciseFailed, match="hint: look again"):
        with checks.exercise("c", hint="look again", raise_on_fail=True):
            assert 1 == 2, "wrong"
    out = capsys.readouterr().out
    assert "✓ a: passed" in out and "b: not done yet" in out and "✗ c: FAILED (wrong" in out
    entries = [json.loads(l) for l in log.read_text().splitlines()]
    assert [e["status"] for e in entries] == ["pass", "todo", "fail", "fail"]


def test_close_reports_first_difference():
    checks.close(torch.ones(3), torch.ones(3))
    with pytest.raises(AssertionError, match=r"index \(1,\)"):
        checks.close(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 3.0]))
    with pytest.raises(AssertionError, match="shape"):
        checks.close(torch.ones(2), torch.ones(3))
    with pytest.raises(AssertionError, match="dtype"):
        checks.close(torch.ones(2), torch.ones(2, dtype=torch.float64))


def test_record_rejects_unknown_status():
    with pytest.raises(ValueError):
        checks.record("x", "maybe")


def test_plots_carry_captions():
    r = Result("p", "P", {"x": "B", "y": "us", "g": ""},
               [{"x": 1, "y": 2.0, "g": "a"}, {"x": 2, "y": 3.0, "g": "a"}, {"x": 1, "y": 1.0, "g": "b"}])
    fig, axes = plots.figure(ncols=2)
    plots.lines(axes[0], r, "x", "y", by="g")
    assert len(axes[0].lines) == 2 and axes[0].get_xlabel() == "x [B]"
    plots.bars(axes[1], ["a", "b"], [1.0, 2.0], "us", title="t")
    text = plots.caption(fig, r, r, extra="note")
    assert text.count("measured here on") == 1 and "note" in text
    assert any("measured here on" in t.get_text() for t in fig.texts)
    fig2, (ax,) = plots.figure()
    plots.timeline(ax, [{"lane": "CPU", "name": "a", "start_us": 0, "dur_us": 1},
                        {"lane": "GPU", "name": "k", "start_us": 1, "dur_us": 2}])
    assert [t.get_text() for t in ax.get_yticklabels()] == ["CPU", "GPU"]


def test_human_bytes():
    assert plots.human_bytes(64) == "64 B"
    assert plots.human_bytes(65536) == "64 KiB"
    assert plots.human_bytes(3 * 2**20 // 2) == "1.5 MiB"
    assert plots.human_bytes(None) == "none"


def test_number_never_uses_exponents_for_bar_labels():
    assert plots.number(2430.4) == "2430" and plots.number(3.14159) == "3.14"
    assert plots.number(12.34) == "12.3" and plots.number(0.01234) == "0.0123" and plots.number(0) == "0"


def test_timeline_highlights_a_tiny_kernel_beside_a_long_sleep():
    rows = [{"lane": "GPU", "start_us": 0.0, "dur_us": 50_000.0, "name": "sleep"},
            {"lane": "GPU", "start_us": 50_000.0, "dur_us": 1.6, "name": "numba_lookup"}]
    fig, (ax,) = plots.figure()
    plots.timeline(ax, rows, highlight=lambda r: r["name"].startswith("numba"))
    bars = ax.collections
    red = [b for b in bars if tuple(round(c, 2) for c in b.get_facecolor()[0][:3]) == (0.84, 0.15, 0.16)]
    assert len(red) == 1 and red[0].get_paths()[0].get_extents().width >= 0.005 * 50_001.6 - 1e-6
