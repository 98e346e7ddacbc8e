"""Beyond the recipe (lesson 02, section 8): partial graphs, two streams, capture error modes."""
import pytest
import torch

import course
from course.core import reference
from course.core.isolate import run_isolated
from course.core.timing import Timing
from course.lessons.capture_replay import bench as capture_more
from course.lessons.capture_replay.replay import branch, data_dependent_loss, fork_join

gpu = pytest.mark.skipif(not course.runtime().on_gpu, reason="needs a GPU")


def test_data_dependent_loss_keeps_rows_with_positive_sum():
    y = torch.tensor([[1.0, 1.0], [-3.0, 1.0], [2.0, 0.0]])
    assert data_dependent_loss(y).item() == pytest.approx((1 + 1 + 4 + 0) / 4)


@gpu
def test_graphed_callables_quick():
    res = reference.get("graphs_make_graphed_callables").fn(repeats=5)
    assert res.value("largest gradient difference vs eager") < 1e-3


@gpu
def test_two_streams_quick():
    res = reference.get("graphs_two_streams").fn(repeats=5)
    rows = {r["capture"]: r for r in res.rows}
    assert rows["one stream"]["replay_matches"] and rows["two streams, fork and join"]["replay_matches"]
    x = torch.ones(4, device="cuda")
    assert torch.equal(x + 1, torch.full((4,), 2.0, device="cuda"))  # CUDA still usable after the forgotten join


@gpu
def test_capture_modes_quick():
    res = reference.get("graphs_capture_modes").fn()
    assert [r["mode"] for r in res.rows] == ["global", "thread_local", "relaxed"]


def test_branch_and_fork_join_agree_on_this_path():
    x, w = torch.ones(2, 3), torch.eye(3)
    assert torch.equal(branch(x, w), x)
    if course.runtime().on_gpu:
        xs, ws = x.cuda(), w.cuda()
        assert torch.equal(fork_join(xs, ws, ws, torch.cuda.Stream()).cpu(), 2 * x)


def test_run_isolated_reports_a_failure_and_a_result():
    assert run_isolated("course.core.hardware", "peak_dram_gbps", memory_clock_khz=1e6, bus_width_bits=8) == 2.0
    with pytest.raises(RuntimeError, match="failed in its own process"):
        run_isolated("course.core.hardware", "peak_dram_gbps", memory_clock_khz=0, bus_width_bits=8)


@gpu
def test_forgotten_join_is_refused():
    out = run_isolated("course.lessons.capture_replay.replay", "forgotten_join", batch=8, width=64)
    assert not out["captured"] and "unjoined" in out["error"]


# ----------------------------------------------------------------------------- the cells' bookkeeping, on recordings
def _t(us, q1=None, q3=None):
    q1, q3 = (us if q1 is None else q1), (us if q3 is None else q3)
    return Timing(us * 1e-6, q1 * 1e-6, q3 * 1e-6, q1 * 1e-6, q3 * 1e-6, 15, 10, "cuda-events")


def _same(got, want):
    assert got.name == want.name and got.title == want.title and list(got.columns) == list(want.columns)
    assert {k: v["value"] for k, v in got.summary.items()} == pytest.approx({k: v["value"] for k, v in want.summary.items()})
    assert got.rows == [{k: (pytest.approx(v) if isinstance(v, float) else v) for k, v in r.items()} for r in want.rows]


def test_graphed_callables_result_gives_the_recording_back():
    want = reference.load_reference("graphs_make_graphed_callables")
    times = {r["step"]: _t(r["us"], r["q1_us"], r["q3_us"]) for r in want.rows}
    got = capture_more.graphed_callables_result(times, want.value("largest gradient difference vs eager"), 64, 1024,
                                                4, 15)
    _same(got, want)


def test_two_streams_result_gives_the_recording_back():
    want = reference.load_reference("graphs_two_streams")
    rows = [capture_more.stream_row(r["capture"], r["captured"], r["error"], r["replay_matches"]) for r in want.rows]
    assert all(r["replay_us"] is None for r in rows)
    times = {r["capture"]: _t(r["replay_us"], r["q1_us"], r["q3_us"]) for r in want.rows if r["replay_us"]}
    times["eager, one stream"] = _t(want.value("eager, one stream"))
    _same(capture_more.two_streams_result(rows, times, 64, 2048, 15), want)


def test_two_streams_result_compares_nothing_when_a_capture_failed():
    rows = [capture_more.stream_row("one stream", True, "", True),
            capture_more.stream_row("two streams, fork and join", False, "RuntimeError: x", False)]
    res = capture_more.two_streams_result(rows, {"one stream": _t(80.0), "eager, one stream": _t(90.0)}, 8, 64, 3)
    assert list(res.summary) == ["eager, one stream"] and res.rows[1]["replay_us"] is None
    assert res.rows[0]["replay_us"] == pytest.approx(80.0)


def test_capture_modes_result_gives_the_recording_back():
    want = reference.load_reference("graphs_capture_modes")
    _same(capture_more.capture_modes_result([dict(r) for r in want.rows]), want)
