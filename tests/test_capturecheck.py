"""course.core.capturecheck (superseded by course.core.harness; kept until its last user is ported):
Watched sees each slip of a capture and assert_captured_well names it."""
import pytest
import torch

import course
from course.core import capturecheck
from course.core.capture import collector_paused
from course.core.stream_order import FORK, JOIN


def test_watched_sees_each_slip_of_a_capture():
    cg = course.graphs()
    x = torch.ones(3, device=course.device())
    w = capturecheck.Watched(lambda t: t * 2)
    with pytest.raises(AssertionError, match="never ran inside a capture"):
        capturecheck.assert_captured_well(w)
    g = cg.CUDAGraph()
    with cg.graph(g):
        out = w(x)
    assert w.captured() and w.static == (x,) and w.output is out
    with pytest.raises(AssertionError, match="without a warm-up"):
        capturecheck.assert_captured_well(w)
    w.calls.insert(0, {"default": True, "capturing": False, "gc": True})
    with pytest.raises(AssertionError, match="default stream"):
        capturecheck.assert_captured_well(w)
    w.calls[0]["default"] = False
    with pytest.raises(AssertionError, match="garbage collector"):
        capturecheck.assert_captured_well(w)
    w.calls[-1]["gc"] = False
    capturecheck.assert_captured_well(w)


def test_watched_with_streams_names_a_missing_fork_or_join_and_puts_the_events_back():
    cg = course.graphs()
    record = cg.Event.record
    for fork, join, want in ((True, True, None), (False, True, FORK), (True, False, JOIN)):
        x = torch.ones(3, device=course.device())
        w = capturecheck.Watched(lambda t: t * 2, streams=True)
        try:
            side = cg.Stream()
            if fork:
                side.wait_stream(cg.current_stream())
            with cg.stream(side):
                w(x)
            if join:
                cg.current_stream().wait_stream(side)
            g = cg.CUDAGraph()
            with collector_paused(), cg.graph(g):
                w(x)
        finally:
            w.close()
        assert w.stream_problem() == want and cg.Event.record is record
        if want is None:
            capturecheck.assert_captured_well(w)
        else:
            with pytest.raises(AssertionError, match=want.split(":")[0][:40]):
                capturecheck.assert_captured_well(w)
    assert capturecheck.Watched(lambda t: t).stream_problem() is None
    try:
        try:
            raise ValueError("first")
        except ValueError:
            raise RuntimeError("second")  # noqa: B904 - a chain, as capture_end makes one
    except RuntimeError as e:
        assert str(capturecheck.root_cause(e)) == "first"
