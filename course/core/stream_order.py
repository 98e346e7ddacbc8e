"""Which stream waited for which, as the learner's calls ordered them: a missing fork or join, named
on both paths.

A warm-up on a side stream must start after the work already queued on the stream the data was
written on (the fork, ``side.wait_stream(cg.current_stream())``), and the capture must start after
the warm-up (the join, ``cg.current_stream().wait_stream(side)``). Without them a GPU runs the
streams side by side: a race that no error reports and that a laptop, where every op runs at once,
cannot show. So the check watches the calls that order streams, the same on both paths:
``Event.record`` and ``Event.wait`` (``wait_stream`` and ``wait_event`` go through them), and the
learner's ``synchronize()`` (device-wide, a stream's or an event's: the host waits, so everything
queued before is done). :class:`StreamOrder` keeps, per stream, how much of every stream's work it
waited for (a vector clock) and the first missing fork or join.
"""
from __future__ import annotations

import os
import sys

FORK = ("the warm-up on a side stream did not wait for the stream your data was "
        "written on (the fork): on a GPU the side stream may then read your static "
        "inputs and the weights before they are written, a race no error reports. "
        "Before `with cg.stream(side):` call side.wait_stream(cg.current_stream())")
JOIN = ("the capture began before the stream it began on waited for the "
        "warm-up's side stream (the join): on a GPU the work queued after the "
        "warm-up may then run while the warm-up still runs, a race no error "
        "reports. After the warm-up call cg.current_stream().wait_stream(side)")


def _library_caller(depth: int = 2) -> bool:
    """True when the call comes from torch or the course's simulator (``cg.graph`` synchronizes by
    itself)."""
    import torch

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # course/
    lib = (os.path.dirname(os.path.abspath(torch.__file__)) + os.sep, os.path.join(here, "sim") + os.sep)
    return os.path.abspath(sys._getframe(depth).f_code.co_filename).startswith(lib)


class StreamOrder:
    """Watches ``cg``'s events and synchronizations until :meth:`close`; :meth:`work` is told each
    watched call."""

    def __init__(self, cg):
        self.cg, self.origin = cg, cg.current_stream()
        # stream -> work queued on it (the origin: the data, written before)
        self.count = {self.origin: 1}
        self.clock: dict = {}  # stream -> {stream: how much of its work this stream waited for}
        # work the host waited for (synchronize): every later op comes after it
        self.floor: dict = {}
        # id(event) -> (event, what its stream had waited for, its own count)
        self.events: dict = {}
        self.problem = None
        self._saved = []
        self._patch()

    # ------------------------------------------------------------------ the vector clock
    def _seen(self, stream) -> dict:
        seen = dict(self.floor)
        for s, n in self.clock.get(stream, {}).items():
            seen[s] = max(seen.get(s, 0), n)
        seen[stream] = self.count.get(stream, 0)
        return seen

    def work(self, capturing: bool) -> None:
        """One watched call (a model's forward) on the current stream: a fork or join missing before
        it is noted."""
        stream = self.cg.current_stream()
        # the warm-ups must be done: the origin joined them, or the capture runs on their stream
        if capturing:
            seen, here = self._seen(self.origin), self._seen(stream)
            if self.problem is None and any(n > max(seen.get(s, 0), here.get(s, 0))
                                            for s, n in self.count.items() if s != self.origin):
                self.problem = JOIN
            return
        if stream != self.origin and self.problem is None and self._seen(stream).get(self.origin, 0) < 1:
            self.problem = FORK
        self.count[stream] = self.count.get(stream, 0) + 1

    def _recorded(self, event, stream) -> None:
        self.events[id(event)] = (event, self._seen(stream))

    def _waited(self, event, stream) -> None:
        _, snap = self.events.get(id(event), (None, {}))
        mine = self.clock.setdefault(stream, {})
        for s, n in snap.items():
            mine[s] = max(mine.get(s, 0), n)

    def _host_waited(self, seen: dict) -> None:
        for s, n in seen.items():
            self.floor[s] = max(self.floor.get(s, 0), n)

    # ------------------------------------------------------------------ the calls watched
    def _patch(self) -> None:
        cg, order = self.cg, self
        ev, st = cg.Event, cg.Stream
        record, wait, ev_sync, st_sync, sync = ev.record, ev.wait, ev.synchronize, st.synchronize, cg.synchronize

        def record_(event, stream=None):
            order._recorded(event, stream if stream is not None else cg.current_stream())
            return record(event, stream) if stream is not None else record(event)

        def wait_(event, stream=None):
            order._waited(event, stream if stream is not None else cg.current_stream())
            return wait(event, stream) if stream is not None else wait(event)

        def event_sync(event):
            order._host_waited(order.events.get(id(event), (None, {}))[1])
            return ev_sync(event)

        def stream_sync(stream):
            order._host_waited({stream: order.count.get(stream, 0)})
            return st_sync(stream)

        def device_sync(*a, **k):
            if not _library_caller():
                order._host_waited(dict(order.count))
            return sync(*a, **k)

        for owner, name, repl in ((ev, "record", record_), (ev, "wait", wait_), (ev, "synchronize", event_sync),
                                  (st, "synchronize", stream_sync), (cg, "synchronize", device_sync)):
            self._saved.append((owner, name, name in vars(owner), getattr(owner, name)))
            setattr(owner, name, repl)

    def close(self) -> None:
        """Put back what :meth:`_patch` replaced."""
        while self._saved:
            owner, name, own, orig = self._saved.pop()
            if own:
                setattr(owner, name, orig)
            else:
                delattr(owner, name)
