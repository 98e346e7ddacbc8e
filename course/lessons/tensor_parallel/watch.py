"""Exercise 08.1's trace: the step and graph API a rank's ``tp_generate`` gets, each call an event.

:class:`Watch` notes every step call (eager or captured, where it ran, the streams' order), every
capture's end and every replay (the inputs the graph reads, before and after; the graph's token)
on one :class:`~course.core.harness.Tracer`; :func:`run_generate` runs the learner's function once
and ends its events with what it returned or raised. ``torch.cuda.synchronize()`` is taken on the
simulator as a GPU takes it (:func:`gpu_synchronize`).
"""
from __future__ import annotations

import contextlib
import gc
import sys
import traceback
import warnings

import torch

from course.core.capture import recover
from course.core.harness import Tracer, capture_error, first_line
from course.core.runtime import graphs, runtime, synchronize


class Graph:
    """A learner's graph: its capture and its replays are events of the :class:`Watch`."""

    def __init__(self, graph, watch):
        self.graph, self.watch, self.steps, self.failed = graph, watch, 0, False

    def capture_begin(self, *args, **kwargs):
        """Begin a capture (its step calls are counted)."""
        out = self.graph.capture_begin(*args, **kwargs)
        self.watch.begin(self)
        return out

    def capture_end(self):
        """End the capture."""
        try:
            out = self.graph.capture_end()
        except BaseException:
            self.watch.open, self.failed = None, True
            raise
        self.watch.end(self)
        return out

    def replay(self):
        """Replay, the static inputs read before and after."""
        event = self.watch.before_replay(self, sys._getframe(1))
        out = self.graph.replay()
        self.watch.after_replay(event)
        return out

    def __getattr__(self, name):
        return getattr(self.graph, name)


class Watch:
    """The step and graph API one rank's ``tp_generate`` gets: each call an event of a Tracer."""

    def __init__(self, cg, step, ids, position):
        self.cg, self._step, self.given, self.t = cg, step, (ids, position), Tracer(cg)
        self.made, self.open = [], None  # the graphs made; the one whose capture is under way
        self.static = self.code = None  # the first captured call's (ids, position, logits), caller
        self.names, self.alive = (), {t.data_ptr() for t in (ids, position)}
        self.captures = self.calls = self.replays = 0
        self.rebound = ""

    def step(self, ids, position):
        """The rank's step, each call an event (eager or captured)."""
        e = self.t.note("step", line=sys._getframe(1).f_lineno)
        e["what"] = "capture" if e["where"] == "capture" else "eager"
        if e["what"] == "capture":
            if self.open is None:
                self.begin(None)  # a capture begun outside the watched API
            self.calls += 1
            e.update(graph=self.captures, call=self.calls, order=self.t.order.problem or "")
        out = self._step(ids, position)
        if e["what"] == "capture" and self.static is None:
            frame = sys._getframe(1)
            self.static, self.code = (ids, position, out), frame.f_code
            self.names = tuple(k for k, v in frame.f_locals.items() if v is ids or v is position)
            e["fresh"] = [t.data_ptr() not in self.alive for t in (ids, position)]  # made in it
        return out

    def CUDAGraph(self, *args, **kwargs):  # noqa: N802 - torch.cuda's name
        """A watched graph."""
        g = Graph(self.cg.CUDAGraph(*args, **kwargs), self)
        self.made.append(g)
        return g

    @contextlib.contextmanager
    def graph(self, g, *args, **kwargs):
        """``cg.graph(g)``, the capture's step calls counted."""
        try:
            with self.cg.graph(g.graph if isinstance(g, Graph) else g, *args, **kwargs):
                self.begin(g)
                yield
        except BaseException:
            self.open = None
            if isinstance(g, Graph):
                g.failed = True
            raise
        self.end(g)

    def begin(self, g) -> None:
        """A capture began: the tensors the learner holds now are not made inside it."""
        self.open, self.calls = g or True, 0
        self.captures += 1
        frame = sys._getframe(1)
        while frame.f_code.co_filename in (__file__, contextlib.__file__):
            frame = frame.f_back
        self.alive |= {v.data_ptr() for v in frame.f_locals.values() if isinstance(v, torch.Tensor)}

    def end(self, g) -> None:
        """A capture ended: its step calls, the static inputs' values."""
        if isinstance(g, Graph):
            g.steps = self.calls
        self.open = None
        self.t.events.append({"what": "end", "graph": self.captures, "steps": self.calls,
                              **self.values()})

    def values(self) -> dict:
        """The values of the inputs the graph reads (the first captured call's), read now."""
        ids, pos = self.static[:2] if self.static else self.given
        return {"ids": ids.reshape(-1).tolist(), "position": pos.reshape(-1).tolist()}

    def before_replay(self, g, frame) -> dict:
        """A replay is next: its number, its graph's step calls, the inputs; a name rebound."""
        self.replays += 1
        if self.static and not self.rebound and frame.f_code is self.code:
            now = frame.f_locals
            self.rebound = next((n for n in self.names if now.get(n) is not None
                                 and not any(now[n] is a for a in self.static[:2])), "")
        e = {"what": "replay", "n": self.replays, "steps": g.steps, "rebound": self.rebound,
             **self.values()}
        self.t.events.append(e)
        return e

    def after_replay(self, e) -> None:
        """The replay ran: the inputs now, and the graph's token."""
        after = self.values()
        token = self.static[2].argmax(-1).reshape(-1).tolist() if self.static else None
        e.update(ids_after=after["ids"], position_after=after["position"], token=token)

    def __getattr__(self, name):
        return getattr(self.cg, name)

    def close(self, stream) -> None:
        """No capture left under way, the stream back, failed graphs kept, the device usable."""
        self.t.close()
        gpu = runtime().on_gpu
        if isinstance(self.open, Graph):  # capture_begin, then the learner's code raised
            self.open.failed = True
            if gpu:
                with contextlib.suppress(Exception):
                    self.open.graph.capture_end()
        if not gpu:
            from course.sim.graph import end_all_captures  # the simulator's: on its path only
            end_all_captures()
        self.cg.set_stream(stream)
        if gpu:
            for g in (g for g in self.made if g.failed):  # kept: torch may still call into it
                recover(graph=g.graph)
            recover()
        self.made.clear()
        gc.collect()
        synchronize()


@contextlib.contextmanager
def gpu_synchronize(cg):
    """``torch.cuda.synchronize()`` taken as a GPU takes it, on the simulator too."""
    if runtime().on_gpu:
        yield
        return
    saved, torch.cuda.synchronize = torch.cuda.synchronize, cg.synchronize
    try:
        yield
    finally:
        torch.cuda.synchronize = saved


def finished(out, n: int) -> dict:
    """The event of ``tp_generate`` returning ``out``: its tokens, or why their shape is wrong."""
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (1, n):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        return {"what": "done", "tokens": None,
                "shape": f"tp_generate must return the {n} tokens as a tensor [1, {n}], got {got}"}
    return {"what": "done", "tokens": [int(t) for t in out.reshape(-1).tolist()], "shape": ""}


def crashed(e: BaseException, code) -> dict:
    """The event of ``tp_generate`` raising ``e``: the rule it breaks, and what it says."""
    if isinstance(e, NotImplementedError):
        return {"what": "crash", "rule": "not_done", "message": str(e)}
    rule, why = capture_error(e)
    if rule:
        return {"what": "crash", "rule": {"host_read": "host_sync"}.get(rule, rule), "message": why}
    tb = traceback.extract_tb(e.__traceback__)
    lines = [f.lineno for f in tb if f.filename == code.co_filename]
    where = f" (line {lines[-1]} of {code.co_name})" if lines else ""
    return {"what": "crash", "rule": "crash", "message": first_line(e)[:300] + where}


def run_generate(ctx, fn, step, first, n_tokens: int) -> list:
    """``fn`` run once on this rank with ``step``: its events, the last ``done`` or ``crash``."""
    cg = graphs()
    ids, position = first.view(1, 1).clone(), torch.zeros(1, dtype=torch.long, device=first.device)
    stream, watch = cg.current_stream(), Watch(cg, step, ids, position)
    try:
        with torch.no_grad(), warnings.catch_warnings(), gpu_synchronize(cg):
            warnings.filterwarnings("ignore", message=".*CUDA Graph is empty.*")
            event = finished(fn(ctx, watch.step, ids, position, n_tokens, watch), n_tokens)
    except Exception as e:  # noqa: BLE001 - the learner's error becomes the trace's last event
        event = crashed(e, fn.__code__)
    finally:
        watch.close(stream)
    return watch.t.events + [dict(event, replays=watch.replays)]
