"""What lab 3's checks see of a cache that calls the graph API itself: captures, replays, pools, static inputs.

The learner's ``record()`` captures with ``cg = course.graphs()`` (``cg.CUDAGraph()``, ``cg.graph(g, pool=...)``),
so no backend call marks a capture or a replay. :class:`CountingBackend` wraps the backend the cache is given and,
inside :meth:`CountingBackend.counting`, wraps ``capture_begin``, ``capture_end`` and ``replay`` of this path's
``CUDAGraph`` class (``torch.cuda``'s or the simulator's) to count them and note the pool each capture named. The
forward the check hands the cache goes through :meth:`CountingBackend.watch` (a
:class:`course.core.capturecheck.Watched`): the arguments it gets inside a capture are that graph's static inputs,
kept by weak reference; each replay records them (:meth:`CountingBackend.replayed_inputs`). ``foreign`` counts graphs
whose first replay found other tensors in their cache entry's ``entry["static"]`` (captured on the caller's tensors,
say), ``replaced`` later replays that did (new buffers put in the entry after the capture). On the simulator,
``memory_reserved()`` adds the bytes of the static inputs of the learner's graphs still alive and of their outputs
still referenced (a GPU's allocator counts them itself). :meth:`CountingBackend.pool_bytes` is what the pools the
captures named still hold: on a GPU the allocator's segments in those pools, on the simulator the bytes above.
"""
from __future__ import annotations

import contextlib
import itertools
import weakref

import torch

from course.core.capturecheck import Watched
from course.core.runtime import graphs, runtime
from course.lessons.graph_cache.backends import default_backend, tensor_bytes


class _Forward(Watched):
    """The forward under test: watched, and telling the counter what the graph under capture reads and writes."""

    def __init__(self, fn, counter):
        super().__init__(fn, getattr(fn, "__name__", "forward"))
        self.counter = counter

    def __call__(self, *args, **kwargs):
        out = super().__call__(*args, **kwargs)
        self.static = self.output = None  # kept by weak reference only: the check must not hold a graph's memory
        if self.calls[-1]["capturing"] and self.counter._capturing is not None:
            self.counter._pending = (tuple(weakref.ref(a) if isinstance(a, torch.Tensor) else None for a in args),
                                     tensor_bytes(list(args)), _tensors(out))
        return out


def _tensors(obj) -> list:
    """The tensors in ``obj`` (a tensor, or nested tuples/lists/dicts of them)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


def _pool_id(pool):
    """A pool handle or a snapshot's ``segment_pool_id`` as one comparable value."""
    return tuple(pool) if isinstance(pool, (tuple, list)) else pool


class CountingBackend:
    """Wraps a backend; counts the captures, replays and pool resets of the cache that uses it (see the module doc)."""

    def __init__(self, inner=None):
        self.inner = inner or default_backend()
        self.name = self.inner.name
        self.captures = self.replays = self.pool_resets = self.replaced = self.foreign = 0
        self.pools, self.graphs, self.forward = [], [], None
        self.reasons = []  # what capture_failed returned, in order: the reasons a cache should store
        self._cache = lambda: None  # the cache under test, by weak reference (set by :meth:`serve`)
        self._replayed, self._capturing, self._pending = (), None, None
        self._held, self._ids = {}, itertools.count()

    # ------------------------------------------------------------------ what the learner's cache calls
    def pool(self):
        """The wrapped backend's pool for the next capture."""
        return self.inner.pool()

    def capture_failed(self, error, graph=None, stream=None) -> str:
        """The wrapped backend's reason for a failed capture (CUDA left clean, its pool retired); remembered."""
        reason = self.inner.capture_failed(error, graph=graph, stream=stream)
        self.reasons.append(reason)
        return reason

    def reset_pool(self) -> None:
        """Forget the wrapped backend's shared pool (and count the call)."""
        self.pool_resets += 1
        self.inner.reset_pool()

    def memory_reserved(self) -> int:
        """The wrapped backend's reserved memory, plus (simulator) what the cache's live graphs hold."""
        return self.inner.memory_reserved() + (0 if runtime().on_gpu else sum(self._held.values()))

    def pool_bytes(self) -> int:
        """Bytes the pools the counted captures named still hold.

        On a GPU: the caching allocator's segments in those pools (``torch.cuda.memory_snapshot()``), free blocks
        included, since a segment goes back to the device only when all of it is free. On the simulator: the bytes
        of the static inputs of the graphs still alive and of the captures' outputs still referenced.
        """
        if not runtime().on_gpu:
            return sum(self._held.values())
        pools = {_pool_id(p) for p in self.pools if p is not None}
        return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
                   if _pool_id(seg.get("segment_pool_id")) in pools)

    # ------------------------------------------------------------------ what the check reads
    def serve(self, cache) -> None:
        """Note the cache under test (weakly: a cycle between it and its backend would outlive the check)."""
        self._cache = weakref.ref(cache)

    def watch(self, fn) -> _Forward:
        """``fn`` as the forward to hand the cache: its calls are recorded (``self.forward.calls``)."""
        self.forward = _Forward(fn, self)
        return self.forward

    def replayed_inputs(self) -> tuple:
        """The static inputs the latest replay read, one per argument (None: not a tensor, or freed)."""
        return tuple(r() if r is not None else None for r in self._replayed)

    def live_graphs(self) -> int:
        """How many graphs captured while counting are still alive (a reference keeps them, or a dead cycle)."""
        return sum(r() is not None for r in self.graphs)

    @contextlib.contextmanager
    def counting(self):
        """Count the graph API calls made in the block (``capture_begin``, ``capture_end``, ``replay``)."""
        cls = graphs().CUDAGraph
        names = ("capture_begin", "capture_end", "replay")
        saved = [(n, n in vars(cls), getattr(cls, n)) for n in names]
        begin, end, replay = (getattr(cls, n) for n in names)

        def capture_begin(g, *args, **kwargs):
            self.captures += 1
            self.pools.append(kwargs.get("pool", args[0] if args else None))
            self._capturing, self._pending = g, None
            return begin(g, *args, **kwargs)

        def capture_end(g):
            try:
                end(g)
            finally:
                pending, self._capturing, self._pending = self._pending, None, None
            self._ended(g, pending)

        def replayed(g):
            self.replays += 1
            self._replayed = getattr(g, "_course_inputs", ())
            entry = next((e for e in getattr(self._cache(), "entries", {}).values()
                          if isinstance(e, dict) and e.get("graph") is g), None)
            if entry is not None and self._replayed:
                static = list(entry.get("static") or ())
                other = any(r is not None and (i >= len(static) or r() is not static[i])
                            for i, r in enumerate(self._replayed))
                first = not getattr(g, "_course_replayed", False)
                g._course_replayed = True
                if first:
                    self.foreign += other  # captured on other tensors than the entry's static buffers
                else:
                    self.replaced += other  # new tensors put in the entry's static list after the capture
            return replay(g)

        for n, fn in zip(names, (capture_begin, capture_end, replayed)):
            setattr(cls, n, fn)
        try:
            yield self
        finally:
            for n, own, orig in saved:
                if own:
                    setattr(cls, n, orig)
                else:
                    delattr(cls, n)

    def _ended(self, g, pending) -> None:
        refs, nbytes, outs = pending if pending is not None else ((), 0, [])
        g._course_inputs = refs
        try:
            self.graphs.append(weakref.ref(g))
        except TypeError:  # a graph class without weak references: live_graphs() cannot see it
            return
        if not runtime().on_gpu:
            for obj, size in [(g, nbytes)] + [(t, tensor_bytes(t)) for t in outs]:
                key = next(self._ids)
                self._held[key] = size
                weakref.finalize(obj, self._held.pop, key, None)  # the inputs freed with the graph, an output with
                # the last reference to it (in the pool, as on a GPU)


@contextlib.contextmanager
def counting():
    """``counted(cls, fn, **kw)`` for the block: a cache of class ``cls`` around ``fn`` on a CountingBackend that
    counts until the block ends; ``(cache, backend)``."""
    with contextlib.ExitStack() as stack:
        def counted(cls, fn, **kw):
            backend = CountingBackend()
            cache = cls(backend.watch(fn), backend=backend, **kw)
            backend.serve(cache)
            stack.enter_context(backend.counting())
            return cache, backend
        yield counted
