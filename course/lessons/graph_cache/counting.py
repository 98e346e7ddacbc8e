"""Lab 3's tracer: :class:`CountingBackend` hands the learner's cache a backend that traces the
forward's calls (one :class:`~course.core.harness.Tracer`: where each ran, the collector, the
streams' order) and counts the graph API calls (captures, replays, the pool each capture named,
the static inputs each replay read, pool resets, the graphs still alive).
"""
from __future__ import annotations

import contextlib
import itertools
import weakref

import torch

from course.core.harness import Tracer
from course.core.runtime import graphs, runtime
from course.lessons.graph_cache.backends import default_backend, tensor_bytes

FORWARD = "forward"


def _tensors(obj) -> list:
    """The tensors in ``obj`` (a tensor, or nested tuples, lists, dicts of them)."""
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
    """A backend for the learner's cache that traces its forward and counts its graph API calls
    (:meth:`counting`); the rest it asks the wrapped backend."""

    def __init__(self, inner=None):
        self.inner = inner or default_backend()
        self.name = self.inner.name
        self.tracer = Tracer()  # the stream current now is the one the data is written on
        self.captures = self.replays = self.pool_resets = self.replaced = self.foreign = 0
        self.pools, self.graphs = [], []
        self.reasons = []  # what capture_failed returned, in order: the reasons to store
        self._cache = lambda: None  # the cache under test, by weak reference (:meth:`serve`)
        self._replayed, self._capturing, self._pending = (), None, None
        self._held, self._ids = {}, itertools.count()

    # ------------------------------------------------------------- what the learner's cache calls
    def pool(self):
        """The wrapped backend's pool for the next capture."""
        return self.inner.pool()

    def capture_failed(self, error, graph=None, stream=None) -> str:
        """The wrapped backend's reason for a failed capture (CUDA left clean, its pool retired)."""
        reason = self.inner.capture_failed(error, graph=graph, stream=stream)
        self.reasons.append(reason)
        return reason

    def reset_pool(self) -> None:
        """Forget the wrapped backend's shared pool (and count the call)."""
        self.pool_resets += 1
        self.inner.reset_pool()

    def memory_reserved(self) -> int:
        """The wrapped backend's reserved memory, plus (simulator) what the cache's graphs hold."""
        return self.inner.memory_reserved() + (0 if runtime().on_gpu else sum(self._held.values()))

    def pool_bytes(self) -> int:
        """Bytes the pools the counted captures named still hold: on a GPU the allocator's segments
        in them (free blocks included); on the simulator the static inputs of the graphs alive and
        the captures' outputs still referenced."""
        if not runtime().on_gpu:
            return sum(self._held.values())
        pools = {_pool_id(p) for p in self.pools if p is not None}
        return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
                   if _pool_id(seg.get("segment_pool_id")) in pools)

    # ------------------------------------------------------------- what the check reads
    def serve(self, cache) -> None:
        """Note the cache under test (weakly: a cycle with its backend would outlive the check)."""
        self._cache = weakref.ref(cache)

    def watch(self, fn):
        """``fn`` as the forward to hand the cache: each call traced; inside a capture its static
        inputs and outputs noted by weak reference (the check must hold no graph's memory)."""
        def forward(*args, **kwargs):
            event = self.tracer.note(FORWARD)
            out = fn(*args, **kwargs)
            if event["where"] == "capture" and self._capturing is not None:
                refs = tuple(weakref.ref(a) if isinstance(a, torch.Tensor) else None for a in args)
                self._pending = (refs, tensor_bytes(list(args)), _tensors(out))
            return out

        forward.__name__ = getattr(fn, "__name__", FORWARD)
        return forward

    def replayed_inputs(self) -> tuple:
        """The static inputs the latest replay read, one per argument (None: not a tensor, or
        freed)."""
        return tuple(r() if r is not None else None for r in self._replayed)

    def live_graphs(self) -> int:
        """How many graphs captured while counting are still alive."""
        return sum(r() is not None for r in self.graphs)

    @contextlib.contextmanager
    def counting(self):
        """Count the graph API calls made in the block (``capture_begin``, ``capture_end``,
        ``replay``); the tracer stops watching at its end."""
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
            self._note_static(g)
            return replay(g)

        for n, fn in zip(names, (capture_begin, capture_end, replayed)):
            setattr(cls, n, fn)
        try:
            yield self
        finally:
            self.tracer.close()
            for n, own, orig in saved:
                if own:
                    setattr(cls, n, orig)
                else:
                    delattr(cls, n)

    def _note_static(self, g) -> None:
        """Whether the entry of replayed graph ``g`` holds the tensors it was captured on:
        ``foreign`` (its first replay: captured on other tensors), ``replaced`` (later: new ones put
        in)."""
        entry = next((e for e in getattr(self._cache(), "entries", {}).values()
                      if isinstance(e, dict) and e.get("graph") is g), None)
        if entry is None or not self._replayed:
            return
        static = list(entry.get("static") or ())
        other = any(r is not None and (i >= len(static) or r() is not static[i])
                    for i, r in enumerate(self._replayed))
        first = not getattr(g, "_course_replayed", False)
        g._course_replayed = True
        if first:
            self.foreign += other
        else:
            self.replaced += other

    def _ended(self, g, pending) -> None:
        refs, nbytes, outs = pending if pending is not None else ((), 0, [])
        g._course_inputs = refs
        try:
            self.graphs.append(weakref.ref(g))
        except TypeError:  # a graph class without weak references: live_graphs() cannot see it
            return
        if not runtime().on_gpu:  # inputs freed with the graph, an output with its last reference
            for obj, size in [(g, nbytes)] + [(t, tensor_bytes(t)) for t in outs]:
                key = next(self._ids)
                self._held[key] = size
                weakref.finalize(obj, self._held.pop, key, None)


@contextlib.contextmanager
def counting():
    """``counted(cls, fn, **kw)`` for the block: ``(cache, backend)``, a cache of class ``cls``
    around ``fn`` on a :class:`CountingBackend` that counts until the block ends."""
    with contextlib.ExitStack() as stack:
        def counted(cls, fn, **kw):
            backend = CountingBackend()
            stack.enter_context(backend.counting())
            cache = cls(backend.watch(fn), backend=backend, **kw)
            backend.serve(cache)
            return cache, backend
        yield counted
