"""course.core.stream_order: which stream waited for which, from the calls that order streams (both paths).

Each case queues "work" (what a watched model call reports) on streams of ``cg = course.graphs()`` (torch.cuda on
a GPU, the simulator's streams otherwise) and asks what is missing: the fork, the join, or nothing.
"""
import pytest

import course
from course.core.stream_order import FORK, JOIN, StreamOrder


def _warm(order, side) -> None:
    cg = order.cg
    with cg.stream(side):
        order.work(False)


def _case(name):
    cg = course.graphs()
    order = StreamOrder(cg)
    try:
        a, b, capturing = cg.Stream(), cg.Stream(), cg.Stream()
        if name == "fork and join":
            a.wait_stream(cg.current_stream())
            _warm(order, a)
            cg.current_stream().wait_stream(a)
        elif name == "no fork":
            _warm(order, a)
            cg.current_stream().wait_stream(a)
        elif name == "no join":
            a.wait_stream(cg.current_stream())
            _warm(order, a)
        elif name == "fork through another stream, join by an event's synchronize":
            a.wait_stream(cg.current_stream())
            b.wait_stream(a)
            _warm(order, b)
            b.record_event().synchronize()
        elif name == "synchronize() as fork and join":
            cg.synchronize()
            _warm(order, a)
            cg.synchronize()
        elif name == "join recorded before the last warm-up":
            a.wait_stream(cg.current_stream())
            _warm(order, a)
            done = a.record_event()
            _warm(order, a)
            cg.current_stream().wait_event(done)
        elif name == "captured on the warm-up's own stream":
            a.wait_stream(cg.current_stream())
            _warm(order, a)
            with cg.stream(a):
                order.work(True)
            return order.problem
        with cg.stream(capturing):  # the capture: on a stream of its own, as cg.graph's
            order.work(True)
        return order.problem
    finally:
        order.close()


@pytest.mark.parametrize("name,want", [
    ("fork and join", None), ("no fork", FORK), ("no join", JOIN),
    ("fork through another stream, join by an event's synchronize", None),
    ("synchronize() as fork and join", None), ("join recorded before the last warm-up", JOIN),
    ("captured on the warm-up's own stream", None)])
def test_stream_order_names_the_missing_fork_or_join(name, want):
    assert _case(name) == want


def test_close_puts_back_what_it_watched():
    cg = course.graphs()
    before = (cg.Event.record, cg.Event.wait, cg.Stream.synchronize, cg.synchronize)
    StreamOrder(cg).close()
    assert (cg.Event.record, cg.Event.wait, cg.Stream.synchronize, cg.synchronize) == before
