"""Checking a capture the learner wrote with ``cg = course.graphs()``, on either path.

A learner's capture is their own code around ``cg.graph(g)``. What a check can see of it is how the
captured function was called: :class:`Watched` wraps that function and records each call (on the
default stream or not, inside a capture or not, with the garbage collector on or not) and, from the
call inside the capture, the static inputs and the output; with ``streams=True`` it also reads which
stream waited for which (:class:`course.core.stream_order.StreamOrder`, until
:meth:`Watched.close`). :func:`assert_captured_well` then names the usual slips: no capture at all,
no warm-up, a warm-up on the default stream, a missing fork or join around the side stream's
warm-up, the collector left on during the capture (a graph it frees there breaks the capture: lesson
03). :func:`root_cause` and :func:`first_line` read the error of a failed capture.
"""
from __future__ import annotations

import gc

from course.core.runtime import graphs


def root_cause(error: BaseException) -> BaseException:
    """The first error of a chain: the one raised while capturing, not the one ending the capture
    raised after it."""
    while error.__context__ is not None and error.__context__ is not error:
        error = error.__context__
    return error


def first_line(error: BaseException) -> str:
    """``Type: first line of the message``."""
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"


class Watched:
    """``fn``, recording how each call ran: ``calls`` (dicts: default stream, capturing, collector
    on), and from the latest call inside a capture, ``static`` (its arguments) and ``output`` (what
    it returned).

    ``streams=True``: also the order of the streams (a
    :class:`~course.core.stream_order.StreamOrder` made now, so the stream current now is the one
    the data was written on); call :meth:`close` once the capture is done.
    """

    def __init__(self, fn, name: str | None = None, streams: bool = False):
        self.fn, self.calls, self.static, self.output = fn, [], None, None
        self.__name__ = name or getattr(fn, "__name__", "fn")
        self.order = None
        if streams:
            from course.core.stream_order import StreamOrder

            self.order = StreamOrder(graphs())

    def close(self) -> None:
        """Stop reading the streams' order (puts back what :class:`StreamOrder` patched); the
        verdict stays."""
        if self.order is not None:
            self.order.close()

    def stream_problem(self) -> str | None:
        """The missing fork or join the streams' order showed (``streams=True``), else None."""
        return None if self.order is None else self.order.problem

    def __call__(self, *args, **kwargs):
        cg = graphs()
        capturing = bool(cg.is_current_stream_capturing())
        if self.order is not None:
            self.order.work(capturing)
        self.calls.append({"default": cg.current_stream() == cg.default_stream(), "capturing": capturing,
                           "gc": gc.isenabled()})
        out = self.fn(*args, **kwargs)
        if capturing:
            self.static, self.output = args, out
        return out

    def captured(self) -> bool:
        """True once a call ran inside a capture."""
        return any(c["capturing"] for c in self.calls)


def assert_captured_well(watched: Watched, what: str = "fn") -> None:
    """AssertionError naming the first slip in how ``watched`` was captured (see the module doc),
    else nothing."""
    captured = [i for i, c in enumerate(watched.calls) if c["capturing"]]
    assert captured, (f"{what} never ran inside a capture: call it inside `with cg.graph(g):` "
                      "(cg = course.graphs())")
    warm = [c for c in watched.calls[:captured[0]] if not c["capturing"]]
    assert warm, (f"{what} was captured without a warm-up: run it once before "
                  "capturing (lazy initialisation, cuBLAS handles and the "
                  "allocator's first blocks must not happen inside the capture)")
    assert not any(c["default"] for c in warm), (
        "the warm-up ran on the default stream: run it on a side stream (s "
        "= cg.Stream(); s.wait_stream(cg.current_stream()); with "
        "cg.stream(s): ...), then cg.current_stream().wait_stream(s)")
    problem = watched.stream_problem()
    assert problem is None, problem
    assert not any(watched.calls[i]["gc"] for i in captured), (
        "the garbage collector was on during your capture: a graph it frees in "
        "the middle of a capture breaks that capture (lesson 03, 'A graph "
        "freed during another capture'). Capture inside collector_paused()")
