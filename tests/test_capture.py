"""course.core.capture: trial captures that report failures and never poison later work."""
from __future__ import annotations

import pytest
import torch

import course
from course.core import capture
from course.core.capture import CaptureOutcome, capture_once, reset_rng_capture_state, try_capture
from course.core.runtime import CourseEnvironmentError, runtime, torch_device
from course.lessons.what_breaks import zoo

ON_GPU = runtime().on_gpu
gpu = pytest.mark.skipif(not ON_GPU, reason="needs a real GPU (CUDA graph capture)")


def test_outcome_prints_what_happened():
    assert str(CaptureOutcome(True)) == "captured"
    bad = CaptureOutcome(False, "RuntimeError", "boom")
    assert str(bad) == "capture failed: RuntimeError: boom" and bad.frames == ()


def test_root_cause_is_the_first_error_in_the_chain():
    try:
        try:
            raise ValueError("inner")
        except ValueError:
            raise RuntimeError("outer")
    except RuntimeError as e:
        cause = capture._root_cause(e)
    assert isinstance(cause, ValueError) and str(cause) == "inner"


def test_frames_name_the_raising_line():
    def boom():
        raise KeyError("x")  # the line the frames must point at

    try:
        boom()
    except KeyError as e:
        frames = capture.exception_frames(e)
    assert frames[-1][2] == "boom" and "raise KeyError" in frames[-1][3]


@pytest.mark.skipif(ON_GPU, reason="the CPU path's behaviour")
def test_capture_needs_a_gpu_and_says_so():
    with pytest.raises(CourseEnvironmentError, match="needs a real GPU"):
        try_capture(lambda: None)
    with pytest.raises(CourseEnvironmentError, match="reference results"):
        capture.require_gpu("this")


@gpu
def test_capture_and_replay_with_new_data():
    x = torch.arange(8.0, device="cuda")
    out = try_capture(lambda: x * 3)
    assert out.ok and out.graph is not None
    x.copy_(torch.arange(8.0, 16.0))
    out.graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.output.cpu(), torch.arange(8.0, 16.0) * 3)


@gpu
def test_warm_up_returns_the_output():
    x = torch.ones(4, device="cuda")
    assert torch.equal(capture.warm_up(lambda: x + 1, 2).cpu(), torch.full((4,), 2.0))


@gpu
@pytest.mark.parametrize("name", [e.name for e in zoo.ENTRIES if e.outcome == "error"])
def test_failed_capture_reports_and_does_not_poison(name):
    e = zoo.get(name)
    args = e.hazard_args()
    out = try_capture(lambda: e.hazard(*args))
    assert not out.ok and out.error_type and out.error
    assert any(f[0] == zoo.__file__ and f[1] in e.hazard_lines() for f in out.frames), out.frames
    assert not torch.cuda.is_current_stream_capturing()
    # the next capture works and replays correctly
    x = torch.arange(4.0, device="cuda")
    nxt = try_capture(lambda: x + 1)
    assert nxt.ok
    x.copy_(torch.tensor([10.0, 20.0, 30.0, 40.0]))
    nxt.graph.replay()
    torch.cuda.synchronize()
    assert nxt.output.cpu().tolist() == [11.0, 21.0, 31.0, 41.0]


@gpu
def test_pinned_copy_captures_and_replays_wrong():
    e = zoo.get("pinned_frozen")
    ids, weight, host_ids = e.hazard_args()
    out = try_capture(lambda: e.hazard(ids, weight, host_ids))
    assert out.ok, out
    ids.copy_(ids.roll(1))
    out.graph.replay()
    torch.cuda.synchronize()
    assert not torch.equal(out.output, weight[ids]), "replay should still use the rows picked at capture"


@gpu
def test_recover_refuses_while_capturing():
    g = torch.cuda.CUDAGraph()
    x = torch.ones(2, device="cuda")
    capture.warm_up(lambda: x + 1, 1)
    with torch.cuda.graph(g):
        with pytest.raises(RuntimeError, match="still in progress"):
            capture.recover()
        y = x + 1
    g.replay()
    torch.cuda.synchronize()
    assert y.cpu().tolist() == [2.0, 2.0]


@pytest.mark.skipif(not runtime().on_gpu, reason="needs a GPU")
def test_failed_capture_leaves_the_cuda_rng_usable():
    x = torch.randn(16, device="cuda")
    out = try_capture(lambda: x.sum().item())
    assert not out.ok
    torch.manual_seed(0)
    a = torch.randn(8, device="cuda")  # raised "Offset increment outside graph capture" before the fix
    torch.manual_seed(0)
    assert torch.equal(a, torch.randn(8, device="cuda"))
    reset_rng_capture_state()  # harmless when nothing failed
    g, s = torch.cuda.CUDAGraph(), torch.empty(4, device="cuda")
    with torch.cuda.graph(g):
        s.uniform_()
    g.replay()
    first = s.clone()
    g.replay()
    assert not torch.equal(first, s), "a captured RNG op should draw new numbers on each replay"


def test_recover_puts_the_stream_back_on_either_path():
    """A failed cg.graph leaves its capture stream current (on a GPU as on the simulator); recover() puts it back
    and, on a GPU, leaves the random generator usable."""

    cg = course.graphs()
    before, g = cg.current_stream(), cg.CUDAGraph()
    x = torch.ones(4, device=course.device())
    with pytest.raises(Exception, match="previous error during capture|not permitted"):
        with cg.graph(g):
            x * float(x.sum())
    left = not cg.current_stream() == before
    capture.recover(stream=before, graph=g)
    assert left and cg.current_stream() == before and not cg.is_current_stream_capturing()
    assert torch.randn(2, device=course.device()).shape == (2,)


def test_capture_once_captures_replays_and_leaves_the_stream_after_a_failure():
    """course.core.capture.capture_once on this machine's graphs (the simulator's, or torch.cuda's)."""

    cg = course.graphs()
    x = torch.ones(4, device=torch_device())
    g, out = capture_once(lambda t: t * 3, x)
    x.fill_(2.0)
    g.replay()
    assert torch.equal(out.cpu(), torch.full((4,), 6.0))
    before = cg.current_stream()
    with pytest.raises(Exception):
        capture_once(lambda t: t * float(t.sum()), x)  # a host read: refused by the capture
    assert cg.current_stream() == before and not cg.is_current_stream_capturing()
