"""The step and graph API exercise 08.1 hands to ``tp_generate``: the learner's calls, told to the referee first.

:class:`WatchedStep` wraps the rank's split step, :class:`WatchedGraphs` the graph API (``course.graphs()``: torch.cuda
on GPUs, the simulator on a laptop) with :class:`WatchedGraph` graphs. Each call tells the
:class:`~.referee.Referee` what is about to happen (a step call, eager or captured; the end of a capture; a replay)
and runs only when every rank agreed; otherwise every rank raises the same named ✗ before the call.
"""
from __future__ import annotations

import sys


def _site(depth: int = 2) -> tuple:
    f = sys._getframe(depth)
    return (f.f_code.co_filename, f.f_lineno)


class WatchedStep:
    """``step(ids, position)`` with every call told to the referee first (see the module doc)."""

    def __init__(self, step, referee):
        self.step, self.referee = step, referee

    def __call__(self, ids, position):
        self.referee.on_step((ids, position), _site())
        out = self.step(ids, position)
        cap = self.referee.capture
        if cap is not None and cap["graph"] == 1 and cap["calls"] == 1:
            self.referee.keep_static((ids, position), out, sys._getframe(1))
        return out


class WatchedGraph:
    """A graph whose capture and replays go through the referee."""

    def __init__(self, graph, referee):
        self.graph, self.referee, self.steps, self.stream = graph, referee, None, None
        self.failed = False  # its capture failed or was abandoned: kept alive until recovered (GPU)

    def capture_begin(self, *args, **kwargs):
        """Begin a capture (the step calls inside it are counted and exchanged)."""
        out = self.graph.capture_begin(*args, **kwargs)
        self.stream = self.referee.cg.current_stream()
        self.referee.begin(self)
        return out

    def capture_end(self):
        """End the capture; every rank's graph must hold the same step calls."""
        out = self.graph.capture_end()
        self.stream = None
        self.steps = (self.referee.capture or {}).get("calls", 0)
        self.referee.end()
        return out

    def replay(self):
        """Check with every rank, then replay."""
        self.referee.before_replay(self.steps or 0, sys._getframe(1))
        out = self.graph.replay()
        self.referee.after_replay()
        return out

    def abandon(self) -> None:
        """End a capture left under way (a verdict raised between capture_begin and capture_end), keeping nothing."""
        if self.stream is None:
            return
        cg, stream, self.stream, self.failed = self.referee.cg, self.stream, None, True
        try:
            with cg.stream(stream):
                self.graph.capture_end()
        except Exception:  # noqa: BLE001 - the capture was already broken; what matters is that it ended
            pass

    def __getattr__(self, name):
        return getattr(self.graph, name)


class WatchedGraphs:
    """The graph API with :class:`WatchedGraph` graphs; ``cg.graph(g)`` captures through the referee."""

    def __init__(self, cg, referee):
        self._cg, self._referee = cg, referee
        self.made: list = []

    def CUDAGraph(self, *args, **kwargs):  # noqa: N802 - torch.cuda's name
        """A watched graph."""
        g = WatchedGraph(self._cg.CUDAGraph(*args, **kwargs), self._referee)
        self.made.append(g)
        return g

    def graph(self, g, *args, **kwargs):
        """``cg.graph(g)`` on the inner graph, its step calls counted and exchanged."""
        return _Capture(self._cg, g, self._referee, args, kwargs)

    def __getattr__(self, name):
        return getattr(self._cg, name)


class _Capture:
    def __init__(self, cg, g, referee, args, kwargs):
        self.g, self.referee = g, referee
        self.inner = cg.graph(g.graph if isinstance(g, WatchedGraph) else g, *args, **kwargs)
        self.before = None

    def __enter__(self):
        self.before = self.referee.cg.current_stream()
        out = self.inner.__enter__()
        self.referee.begin(self.g)
        return out

    def __exit__(self, *exc):
        steps = (self.referee.capture or {}).get("calls", 0)
        try:
            out = self.inner.__exit__(*exc)
        except Exception:
            self.referee.capture = None
            if isinstance(self.g, WatchedGraph):
                self.g.failed = True
            self.referee.cg.set_stream(self.before)  # a failed capture leaves its own stream current
            if exc[1] is not None:
                raise exc[1]  # the error inside the capture (a host read) says more than "a previous error"
            raise
        if isinstance(self.g, WatchedGraph):
            self.g.steps = steps
        if exc[0] is None:
            self.referee.end()
        else:
            self.referee.capture = None
        return out
