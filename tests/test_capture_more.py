"""Beyond the recipe (course.lessons.capture_more): partial graphs, two streams, capture error modes."""
import pytest
import torch

import course
from course.lessons.capture_more import (capture_modes_experiment, data_dependent_loss, graphed_callables_experiment,
                                         two_streams_experiment)

gpu = pytest.mark.skipif(not course.runtime().on_gpu, reason="needs a GPU")


def test_data_dependent_loss_keeps_rows_with_positive_sum():
    y = torch.tensor([[1.0, 1.0], [-3.0, 1.0], [2.0, 0.0]])
    assert data_dependent_loss(y).item() == pytest.approx((1 + 1 + 4 + 0) / 4)


@gpu
def test_graphed_callables_quick():
    res = graphed_callables_experiment(repeats=5)
    assert res.value("largest gradient difference vs eager") < 1e-3


@gpu
def test_two_streams_quick():
    res = two_streams_experiment(repeats=5)
    rows = {r["capture"]: r for r in res.rows}
    assert rows["one stream"]["replay_matches"] and rows["two streams, fork and join"]["replay_matches"]
    x = torch.ones(4, device="cuda")
    assert torch.equal(x + 1, torch.full((4,), 2.0, device="cuda"))  # CUDA still usable after the forgotten join


@gpu
def test_capture_modes_quick():
    res = capture_modes_experiment()
    assert [r["mode"] for r in res.rows] == ["global", "thread_local", "relaxed"]


def test_branch_and_fork_join_agree_on_this_path():
    from course.lessons.capture_more import branch, fork_join

    x, w = torch.ones(2, 3), torch.eye(3)
    assert torch.equal(branch(x, w), x)
    if course.runtime().on_gpu:
        xs, ws = x.cuda(), w.cuda()
        assert torch.equal(fork_join(xs, ws, ws, torch.cuda.Stream()).cpu(), 2 * x)


def test_run_isolated_reports_a_failure_and_a_result():
    from course.core.isolate import run_isolated

    assert run_isolated("course.core.hardware", "peak_dram_gbps", memory_clock_khz=1e6, bus_width_bits=8) == 2.0
    with pytest.raises(RuntimeError, match="failed in its own process"):
        run_isolated("course.core.hardware", "peak_dram_gbps", memory_clock_khz=0, bus_width_bits=8)


@gpu
def test_forgotten_join_is_refused():
    from course.core.isolate import run_isolated

    out = run_isolated("course.lessons.capture_more", "forgotten_join", batch=8, width=64)
    assert not out["captured"] and "unjoined" in out["error"]
