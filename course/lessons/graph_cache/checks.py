"""Lesson 04's and lab 3's checks: 04.1 and 04.2 on the bucket presets and a GraphCache; lab 3.1-3.7
on the learner's own key function, buffers and cache class.

The learner's cache captures with the graph API itself (``cg = course.graphs()``) and uses a backend
for its pool, its memory and the reason of a failed capture. Lab 3's checks hand it a
:class:`CountingBackend`, which traces the forward's calls (one
:class:`~course.core.harness.Tracer`: where each ran, the collector, the streams' order, judged by
the shared capture rules) and counts the graph API calls (captures, replays, the pool each capture
named, the static inputs each replay read, pool resets, the graphs still alive). Every rule is
named; its ✗ names the classic mistake.
"""
from __future__ import annotations

import contextlib
import gc
import itertools
import weakref

import torch

from course.core.capture import recover
from course.core.checks import exercise
from course.core.harness import (Defect, Tracer, capture_rules, check, expect, first_line,
                                 root_cause)
from course.core.runtime import graphs, runtime, torch_device
from course.core.text import clip
from course.lessons.graph_cache.backends import default_backend, tensor_bytes
from course.lessons.graph_cache.buckets import PRESETS, bucket_sizes, padding_report
from course.lessons.graph_cache.cache import GraphCache
from course.lessons.graph_cache.decoder import DecoderConfig, TinyDecoder
from course.lessons.graph_cache.memory_probe import MiB, by_stream_pool

FORWARD = "forward"


# ------------------------------------------------------------------------------- 04.1, 04.2
def _preset_for(trace) -> str | None:
    """The preset with the fewest graphs on ``trace`` among those wasting at most 10 % of the
    rows."""
    reports = {n: padding_report(trace, bucket_sizes(n, 64)) for n in PRESETS}
    fits = {n: r for n, r in reports.items() if r["waste"] <= 0.10}
    return min(fits, key=lambda n: (fits[n]["graphs"], fits[n]["waste"])) if fits else None


def check_choice(fn, traces) -> str | None:
    """04.1: ``fn(trace)`` picks the preset :func:`_preset_for` picks, on each of ``traces``;
    returns the course's choice for the first."""
    with exercise("04.1 choose a preset", hint=[
                "among the presets that waste at most 10 % of the computed rows, the one with the "
                "fewest graphs; a tie goes to the smaller waste",
                "in choose_preset: padding_report(trace, bucket_sizes(name, 64)) gives a preset's "
                "graphs and waste; keep the presets whose waste is <= 0.10, then take the least by "
                "(graphs, waste)",
                "a smaller example: of {'a': (3, 0.2), 'b': (2, 0.05), 'c': (2, 0.01)} as (graphs, "
                "waste), min by that pair picks 'c': two graphs, and the smaller waste"],
            answer="reports = {n: padding_report(trace, bucket_sizes(n, 64)) for n in PRESETS}; "
                   "fits = {n: r for n, r in reports.items() if r['waste'] <= 0.10}; return "
                   "min(fits, key=lambda n: (fits[n]['graphs'], fits[n]['waste'])) if fits else "
                   "None"):
        for tr in traces:
            want = _preset_for(tr)
            check(fn(tr), [expect("preset", lambda got: got == want, lambda got: (
                f"you chose {got!r}; the fewest graphs within 10 % waste is {want!r}"))])
    return _preset_for(traces[0])


def check_stats(predict) -> None:
    """04.2: ``predict()`` gives the counts a GraphCache with buckets [2, 4, 8] makes of the batches
    [1, 3, 3, 4, 8, 9, 2, 7] (replayed here, live)."""
    with exercise("04.2 predict the statistics", hint=[
                "each batch pads up to the smallest bucket that holds it; a bucket's first call "
                "records its graph (a miss), every later one replays it (a hit); a batch above the "
                "largest bucket runs eagerly",
                "in my_stats: go through [1, 3, 3, 4, 8, 9, 2, 7] with buckets [2, 4, 8], writing "
                "each batch's bucket (or eager); then count first uses, repeats, eager calls, and "
                "bucket - batch for every padded call",
                "a smaller example: buckets [2, 4], batches [1, 4, 3, 5]: 1 -> 2 (a miss, 1 padded "
                "row), 4 -> 4 (a miss), 3 -> 4 (a hit, 1 padded row), 5 eager: 2 misses, 1 hit, 1 "
                "eager call, 2 padded rows"],
            answer='return {"cache_misses": 3, "cache_hits": 4, "eager_calls": 1, "padded_rows": '
                   '4}'):
        guess = predict()
        c = GraphCache(lambda x: x * 2, buckets=[2, 4, 8])
        for b in [1, 3, 3, 4, 8, 9, 2, 7]:
            c(torch.ones(b, device=torch_device()))
        s = c.get_stats()
        check(guess, [expect(k, lambda g, k=k: g.get(k) == s[k], lambda g, k=k: (
            f"{k}: you said {g.get(k)}, the cache counted {s[k]}"))
            for k in ("cache_misses", "cache_hits", "eager_calls", "padded_rows")])


# ------------------------------------------------------------------------------- lab 3's tracer
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


# ------------------------------------------------------------------------------- lab 3.1-3.3
def check_key(cache_key) -> None:
    """3.1: ``cache_key(args, bucket)`` tells dtypes, devices, shapes and values apart, and merges
    batches padded to one bucket."""
    with exercise("lab 3.1 the key", hint=[
                "a graph is valid only for the shapes and dtypes it was captured with, and for the "
                "values that steered it: which parts of each argument must the key hold, and which "
                "must it leave out?",
                "in cache_key: one entry per argument: ('tensor', shape with dim 0 replaced by the "
                "bucket, dtype, device) for a tensor, ('value', v) otherwise; all of it in tuples, "
                "so the key can be a dict key",
                "a smaller example: {(('tensor', (4, 2), 'torch.int64', 'cpu'), ('value', 3)): "
                "graph} — a list inside the key would raise TypeError: unhashable type"],
            answer="key.append(('tensor', (bucket, *a.shape[1:]), str(a.dtype), str(a.device))) "
                   "for a tensor, key.append(('value', a)) otherwise; return tuple(key)"):
        d = torch_device()

        def ids(*shape, dtype=torch.int64, device=d, fill=0):
            return torch.full(shape, fill, dtype=dtype, device=device)

        k = cache_key((ids(3, 2), 5), 4)

        def hashable(k) -> bool:
            try:
                hash(k)
                return True
            except TypeError:
                return False

        check(k, [
            expect("hashable", hashable, "the key is not hashable: build it from tuples, not lists "
                                         "or tensors"),
            expect("values", lambda k: k == cache_key((ids(3, 2, fill=1), 5), 4), (
                "the same shapes and dtypes gave different keys: key on shapes and dtypes, never "
                "on tensor values")),
            expect("dtype", lambda k: k != cache_key((ids(3, 2, dtype=torch.int32), 5), 4), (
                "your key ignores the dtype: int32 and int64 ids would share one graph, whose "
                "kernels and buffers were made for one of them")),
            expect("device", lambda k: k != cache_key((ids(3, 2, device="meta"), 5), 4), (
                "your key ignores the device: a graph recorded for one device's memory cannot "
                "serve another's tensors")),
            expect("shape", lambda k: k != cache_key((ids(3, 5), 5), 4),
                   "your key ignores the shape after the batch dimension"),
            expect("value", lambda k: k != cache_key((ids(3, 2), 6), 4),
                   "your key ignores the non-tensor arguments (their values change the graph)"),
            expect("bucket", lambda k: k == cache_key((ids(4, 2), 5), 4), (
                "batches padded to the same bucket must share a key: use the bucket, not the batch "
                "size, for dim 0")),
            expect("buckets_apart", lambda k: k != cache_key((ids(3, 2), 5), 8),
                   "different buckets need different keys")])


def check_static(make_static, copy_in) -> None:
    """3.2: static buffers of the bucket's size, written in place, padding rows refilled every
    call."""
    with exercise("lab 3.2 static inputs", hint=[
                "a replay reads the same memory every time: whose memory is it, how many rows does "
                "it need, and what must every row hold before the replay?",
                "make_static: a new buffer of the bucket's rows per tensor (its dtype, its "
                "device); copy_in: rows [:n] from the caller, in place, rows [n:] the argument's "
                "own pad, on every call",
                "a smaller example: s = torch.empty(4, 2); s[:3].copy_(x3); s[3:].fill_(0) — a "
                "batch of 3 in a bucket of 4"],
            answer="torch.empty((bucket, *a.shape[1:]), dtype=a.dtype, device=a.device); in "
                   "copy_in: s[:n].copy_(a) and s[n:].fill_(pad)"):
        d = torch_device()
        x, ids = torch.randn(3, 4, device=d), torch.tensor([7, 8, 9], device=d)
        static = make_static((x, ids, "tag"), 4)
        check(static, [
            expect("kept", lambda s: len(s) == 3 and s[2] == "tag",
                   "keep non-tensor arguments as they are, in their place"),
            expect("callers_tensor", lambda s: s[0].data_ptr() != x.data_ptr(), (
                "the static input is the caller's tensor itself: the graph would read this "
                "tensor's memory on every replay, whatever the next caller passes. Allocate a "
                "buffer of your own")),
            expect("rows", lambda s: tuple(s[0].shape) == (4, 4) and tuple(s[1].shape) == (4,),
                   lambda s: f"static buffers need the bucket's rows: got shapes "
                             f"{tuple(s[0].shape)}, {tuple(s[1].shape)}"),
            expect("dtype", lambda s: s[0].dtype == x.dtype and s[1].dtype == ids.dtype,
                   "static buffers keep each input's dtype")])
        other = make_static((torch.empty(3, 4, device="meta"), ids, "tag"), 4)[0]
        check(other, [expect("device", lambda o: o.device == torch.device("meta"), lambda o: (
            f"a buffer for an input on device 'meta' was made on {o.device}: static buffers keep "
            "each input's device"))])
        ptrs = [s.data_ptr() for s in static[:2]]
        copy_in(static, (x, ids, "tag"), 3, (0.0, -1, None))
        check(static, [
            expect("in_place", lambda s: [t.data_ptr() for t in s[:2]] == ptrs, (
                "copy_in replaced a static buffer: write into it with copy_() (the graph reads "
                "that memory)")),
            expect("copied", lambda s: torch.equal(s[0][:3], x) and torch.equal(s[1][:3], ids),
                   "rows [:n] must hold the inputs"),
            expect("padding", lambda s: float(s[0][3].abs().sum()) == 0 and int(s[1][3]) == -1,
                   "padding rows must hold pad_value (one per argument)")])
        y, ids2 = torch.randn(2, 4, device=d), torch.tensor([1, 2], device=d)
        copy_in(static, (y, ids2, "tag"), 2, (0.0, -1, None))
        check(static, [
            expect("copied", lambda s: torch.equal(s[0][:2], y),
                   "the inputs were not copied in on the second call"),
            expect("stale_rows", lambda s: int(s[1][2]) == -1, (
                "row 2 still holds the previous call's input: padding rows must be refilled on "
                "every call, or stale rows leak (a real KV slot, a real token)"))])


def check_copy_out(copy_out) -> None:
    """3.3: outputs sliced back to the batch, cloned by default, views when ``copy=False``."""
    with exercise("lab 3.3 outputs", hint=[
                "the next replay writes into the same static output: what must the caller get "
                "instead of it, and how many rows?",
                "in copy_out: rows [:n] of every tensor whose dim 0 is the bucket, cloned (views "
                "only when copy=False); a tuple or list of outputs stays one, handled element by "
                "element",
                "a smaller example: y = static_y[:3].clone() keeps a batch of 3 out of a bucket of "
                "4, safe from the next replay"],
            answer="out = out[:n] if out.dim() and out.shape[0] == bucket else out; return "
                   "out.clone() if copy else out (and type(out)(copy_out(o, n, bucket, copy) for o "
                   "in out) for a tuple)"):
        d = torch_device()
        out = torch.arange(8.0, device=d).view(4, 2)
        other = torch.ones(3, device=d)
        got = copy_out((out, other), 3, 4)
        check(got, [
            expect("structure", lambda g: isinstance(g, tuple) and len(g) == 2,
                   "keep the output's structure (here a tuple of two tensors)"),
            expect("sliced", lambda g: tuple(g[0].shape) == (3, 2), lambda g: (
                f"slice the padded output back to the batch: got {tuple(g[0].shape)}")),
            expect("whole", lambda g: torch.equal(g[1], other),
                   "outputs whose dim 0 is not the bucket are returned whole")])
        out.fill_(-1.0)  # what the next replay does to the static output
        check(got, [expect("cloned", lambda g: float(g[0].min()) >= 0, (
            "the output changed when the static output was overwritten: the next replay would "
            "change results you already returned. Clone them"))])
        view = copy_out(out, 3, 4, copy=False)
        out.fill_(5.0)
        check(view, [expect("views", lambda v: float(v.min()) == 5.0,
                            "copy=False returns views of the static output (zero-copy)")])


# ------------------------------------------------------------------------------- lab 3.4
_SHARED_POOL = ("your captures did not all go into the cache's pool: capture with "
                "cg.graph(g, pool=self.backend.pool()) so that the graphs of one cache share one "
                "memory pool (notebook 04: what sharing saves)")


def _one_pool(backend) -> list:
    return [expect("pool", lambda b: None not in b.pools and len(set(b.pools)) == 1, _SHARED_POOL)]


def check_miss_and_hit(cls) -> None:
    """3.4: a miss records through the backend, a hit replays with the new inputs; stats count
    both."""
    with exercise("lab 3.4 capture on miss, replay on hit", hint=[
                "a new key is recorded once, a known key reuses its recording: either way the call "
                "ends in a replay of the graph, on the caller's inputs, and a different dtype is a "
                "different key",
                "in __call__ and record: look the entry up by cache_key(args, bucket); miss: "
                "make_static, copy_in, warm self.fn up on a side stream, capture it with "
                "collector_paused() and cg.graph(g, pool=self.backend.pool()), count a recording; "
                "hit: copy_in into that entry's static buffers; then replay and copy_out",
                "a smaller example: cache = {}; def f(k): if k not in cache: cache[k] = record(k) "
                "(a miss); return run(cache[k]) (every call, hit or miss)"],
            answer="entry = self.entries.get(key); if entry is None: entry = self.entries[key] = "
                   "self.record(...); else: copy_in(entry['static'], ...); "
                   "entry['graph'].replay(); return copy_out(entry['output'], n, "
                   "bucket)"), counting() as counted:
        d = torch_device()
        w = torch.randn(8, 8, generator=torch.Generator().manual_seed(0)).to(d)
        fn = lambda x: torch.relu(x @ w) + 1  # noqa: E731
        cache, backend = counted(cls, fn)
        xs = [torch.randn(4, 8, device=d), torch.randn(4, 8, device=d), torch.randn(2, 8, device=d),
              torch.randn(4, 8, device=d)]
        outs, seen = [], set()
        for i, x in enumerate(xs):
            replays = backend.replays
            outs.append(cache(x))
            first = tuple(x.shape) not in seen
            seen.add(tuple(x.shape))
            ran = backend.replays - replays
            said = (f"call {i}, the first of its shape, returned without a replay: a capture only "
                    "records (on a GPU its output holds nothing yet), so replay the new recording "
                    "before returning" if first else
                    f"call {i} (a hit) ended in {ran} replays, expected 1: does a hit call the "
                    "forward eagerly?")
            check(ran, [expect("replay", lambda r: r == 1, said)])
        check(backend, [expect("captures", lambda b: b.captures == 2, lambda b: (
            f"2 shapes should be recorded once each; your cache captured {b.captures}x"))])
        check(backend.tracer, capture_rules(FORWARD, "the forward"))
        check(backend, _one_pool(backend) + [
            expect("foreign", lambda b: not b.foreign, (
                "your graph was captured on other tensors than the entry's static buffers (the "
                "caller's?): a hit copies the new inputs into the static buffers, which the graph "
                "never reads, so it returns the same as the previous call. Capture "
                "self.fn(*static)")),
            expect("replaced", lambda b: not b.replaced, (
                "after the capture, your cache put new tensors into the static input list it was "
                "captured with: the graph reads the buffers it was captured on, whatever the list "
                "holds now. Write into them with copy_()"))])

        def wrong(i, o) -> str:
            def same(y) -> bool:
                return o.shape == y.shape and torch.allclose(o, fn(y), atol=1e-5)

            return (f"call {i} returned a wrong result"
                    + (" (the same as the previous call: were the new inputs copied into the "
                       "static buffers before the replay?)" if i and same(xs[i - 1]) else "")
                    + (" (it was overwritten by a later replay: return a copy)"
                       if i == 0 and same(xs[3]) else ""))

        for i, (x, o) in enumerate(zip(xs, outs)):
            check(o, [expect("result", lambda o: torch.allclose(o, fn(x), atol=1e-5),
                             lambda o, i=i: wrong(i, o))])
        s = cache.stats
        got = (s["cache_misses"], s["cache_hits"], s["recordings"])
        check(got, [expect("stats", lambda g: g == (2, 2, 2), (
            f"stats: misses {got[0]}, hits {got[1]}, recordings {got[2]}; expected 2, 2, 2"))])
        _check_dtypes(cls, d, counted)


def _dt(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _check_dtypes(cls, d, counted) -> None:
    """One shape in two dtypes: two keys, two recordings, each call answered in its own dtype."""
    cache, backend = counted(cls, lambda x: x * 2 + 1)
    calls = [torch.randn(4, 8, device=d), torch.randn(4, 8, device=d).half(),
             torch.randn(4, 8, device=d)]
    for i, x in enumerate(calls):
        got = cache(x)
        other = calls[1 - min(i, 1)].dtype  # the dtype of the other key
        check(got, [
            expect("lookup_dtype", lambda g: g.dtype == x.dtype, lambda g: (
                f"a {_dt(x.dtype)} call with the same shape as an earlier {_dt(other)} call "
                f"returned {_dt(g.dtype)}: your cache found the {_dt(other)} entry for it. Look "
                "entries up by "
                "cache_key(args, bucket), which tells the dtypes apart: each dtype needs its own "
                "recording")),
            expect("result", lambda g: torch.allclose(g.float(), (x * 2 + 1).float(), atol=1e-2), (
                f"call {i} ({_dt(x.dtype)}, after a call of the other dtype with the same shape) "
                "returned a wrong result"))])
    check(backend, [expect("captures", lambda b: b.captures == 2, lambda b: (
        "one shape in float32 and float16 should be recorded once per dtype (2 captures); your "
        f"cache captured {b.captures}x"))])


# ------------------------------------------------------------------------------- lab 3.5
def check_buckets(cls) -> None:
    """3.5: buckets and padding on the tiny decoder: results equal eager, padding never leaks, stats
    add up."""
    with exercise("lab 3.5 buckets and padding", hint=[
                "a batch runs in its bucket's graph, so its padding rows run through the model "
                "too: what they hold decides which KV slot they write and which ids the embedding "
                "sees",
                "in __call__: bucket = next_bucket(n, self.sizes) (None, above the largest: run "
                "self.fn eagerly, an eager call); copy_in fills rows [n:] of argument i with its "
                "own pad_value[i] on every call; padded_rows += bucket - n",
                "a smaller example: buckets [2, 4, 8] and a batch of 3: bucket 4, one padding row; "
                "a batch of 9: no bucket, one eager call"],
            answer="if not self.enabled or bucket is None: self.stats['eager_calls'] += 1; return "
                   "self.fn(*args); copy_in(static, args, n, self.pads(args)); "
                   "self.stats['padded_rows'] += bucket - n"), counting() as counted:
        cfg = DecoderConfig(layers=1, max_seq=8, slots=10)
        eager, cached = TinyDecoder(cfg), TinyDecoder(cfg)
        cache, backend = counted(cls, cached.step, buckets=[2, 4, 8], pad_value=cached.pad_values())
        # (batch, position): at (8, 0) new requests take slots 0..7; a stale row 3 left in bucket
        # 4's buffer by (4, 0) would overwrite slot 3's new entry at position 0; (4, 1) reads it
        steps = [(4, 0), (8, 0), (3, 1), (4, 1), (1, 2), (9, 2), (2, 3)]
        for i, (b, pos) in enumerate(steps):
            g = torch.Generator().manual_seed(i)
            ids = torch.randint(0, cfg.vocab, (b,), generator=g).to(eager.tok.device)
            args = (ids, torch.full((b,), pos, dtype=torch.long, device=ids.device),
                    torch.arange(b, device=ids.device))
            want, replays = eager.step(*args), backend.replays
            try:
                got = cache(*args)
            except Exception as e:  # noqa: BLE001 - above the largest bucket, a crash is the defect
                if b <= 8:
                    raise
                raise Defect("above_largest", f"call {i} (batch {b}, above the largest bucket 8) "
                             f"raised {type(e).__name__}: "
                             f"{(str(e).splitlines() or [''])[0][:120]}. "
                             "Such a batch has no graph: when next_bucket returns None, run "
                             "self.fn eagerly and count an eager call") from e
            if backend.replays > replays:
                _check_padding(i, b, backend.replayed_inputs(), cached.pad_values())
            check(got, [
                expect("sliced", lambda g: tuple(g.shape) == tuple(want.shape), lambda g: (
                    f"call {i} (batch {b}): output shape {tuple(g.shape)}, expected "
                    f"{tuple(want.shape)}: slice it back")),
                expect("result", lambda g: torch.allclose(g, want, atol=1e-4), (
                    f"call {i} (batch {b}) differs from the eager decoder: padding rows leaked "
                    "into real sequences (were the padding rows refilled with pad_value, the "
                    "scratch slot, on every call?)"))])
        want = {"cache_misses": 3, "cache_hits": 3, "eager_calls": 1, "padded_rows": 2}
        got = {k: cache.stats.get(k) for k in want}
        check(got, [expect("stats", lambda g: g == want, (
            f"stats {got}, expected {want} (batch 9 is above the largest bucket: eager)"))])
        check(backend, [expect("captures", lambda b: b.captures == 3, lambda b: (
            f"buckets 4, 8 and 2 should be captured once each, not {b.captures} times"))]
            + _one_pool(backend))


def _check_padding(i: int, b: int, static, pads) -> None:
    """The padding rows of the static inputs the replay read hold exactly each argument's pad."""
    bad, bucket = [], b
    for name, s, pad in zip(("ids", "pos", "slots"), static, pads):
        if isinstance(s, torch.Tensor) and s.dim() and s.shape[0] > b:
            rows, bucket = s[b:], s.shape[0]
            if not bool((rows == pad).all()):
                held = sorted({int(v) for v in rows.flatten().tolist()})
                bad.append(f"{name} holds {held[:4]} where its pad_value is {pad}")
    check(bad, [expect("padding", lambda bad: not bad, (
        f"call {i} (batch {b}, bucket {bucket}) replayed with padding rows that are not pad_value: "
        + "; ".join(bad) + ". Fill rows [n:] of every argument with its own pad_value, on every "
        "call: other values make padding rows write into a real sequence's KV slot, or count bad "
        "ids the caller never passed"))])


# ------------------------------------------------------------------------------- lab 3.6
def _hazard(x):
    return x / x.abs().max().item()  # a host read: cannot be captured


def check_fallback(cls) -> None:
    """3.6: a key whose capture fails runs eager from then on, with its reason; other keys
    capture."""
    with exercise("lab 3.6 fallback", hint=[
                "a key that cannot be captured must not be an outage, nor a capture attempted on "
                "every call: remember what happened to it, and why",
                "in record: catch the capture's error; reason = self.backend.capture_failed(e, "
                "graph=g, stream=before) (the stream put back, the pool retired); store an eager "
                "entry with the reason and put it in stats['fallbacks'][key]; every call of that "
                "key runs self.fn and counts an eager call, never a hit",
                "a smaller example: failed = {}; if key in failed: return slow(x); try: fast(x) "
                "except Exception as e: failed[key] = str(e) — the second call of that key never "
                "tries again"],
            answer="except Exception as e: reason = self.backend.capture_failed(e, graph=g, "
                   "stream=before); self.stats['fallbacks'][key] = reason; return {'eager': True, "
                   "'reason': reason}; and count cache_hits only for an entry that is not eager"), \
            counting() as counted:
        d = torch_device()
        fn = lambda x, hazard: _hazard(x) if hazard else x * 2  # noqa: E731
        cache, backend = counted(cls, fn)
        x = torch.randn(4, 3, device=d)
        cg = graphs()
        before = cg.current_stream()
        for _ in range(2):
            try:
                got = cache(x, True)
            except (AssertionError, NotImplementedError):
                raise
            except Exception as e:  # noqa: BLE001 - the capture's error, escaped from the cache
                if not cg.current_stream() == before:
                    recover(stream=before)
                why = clip(first_line(root_cause(e)), 120)
                raise Defect("escaped", f"your cache let the capture's error escape ({why}): catch "
                             "it around the capture, take the reason from "
                             "self.backend.capture_failed(e, graph=g, stream=before), and run that "
                             "key eagerly") from None
            left = not cg.current_stream() == before
            if left:
                recover(stream=before)
            check(got, [
                expect("stream_left", lambda g: not left, (
                    "after the failed capture, the capture stream is still current (a failed "
                    "cg.graph leaves it so): every later op would run on it. In your except: "
                    "reason = self.backend.capture_failed(e, graph=g, stream=before), which puts "
                    "your stream back and retires the pool")),
                expect("result", lambda g: torch.allclose(g, _hazard(x)),
                       "a key that cannot be captured must still return the right answer")])
        hits, misses = cache.stats["cache_hits"], cache.stats["cache_misses"]
        check(backend, [
            expect("memo", lambda b: b.captures == 1, lambda b: (
                f"the failing key was captured {b.captures} times: remember that it runs eager "
                "instead of trying again on every call")),
            expect("eager_not_hits", lambda b: (hits, misses) == (0, 1), (
                f"two calls of a key that fell back to eager counted {hits} cache_hits and "
                f"{misses} cache_misses; expected 0 and 1: the first call is a miss, the next ones "
                "are eager_calls, never hits (a hit replays a recorded graph)"))])
        right = torch.allclose(cache(x, False), x * 2)
        reasons = list(cache.stats["fallbacks"].values())
        check(backend, [
            expect("others", lambda b: right and b.captures == 2 and b.replays >= 1,
                   "after a failed capture, other keys must still be recorded and replayed"),
            expect("reason", lambda b: len(reasons) == 1 and reasons[0] in b.reasons, lambda b: (
                "stats['fallbacks'] should map the failing key to its reason, the string "
                "self.backend.capture_failed(e, graph=g, stream=before) returned "
                f"({b.reasons or 'it was never called'}); got {reasons}")),
            expect("eager_calls", lambda b: cache.stats["eager_calls"] == 2,
                   f"eager_calls: {cache.stats['eager_calls']}, expected 2")])


# ------------------------------------------------------------------------------- lab 3.7
def reserved_now(backend) -> int:
    """The backend's reserved memory once garbage is collected (and, on a GPU, the allocator's cache
    emptied): before and after ``clear_cache()``, the difference is what clearing gave back."""
    gc.collect()
    if backend.name != "recording":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return backend.memory_reserved()


def what_stays(freed: int, held: int, snapshot, streams=None) -> str:
    """One sentence after a clear: the bytes it gave back against what the captures' pool held, and
    what stays reserved, by stream and pool (``snapshot``: ``torch.cuda.memory_snapshot()`` after
    it; ``streams``: stream handle -> name)."""
    where = by_stream_pool(snapshot, streams or {})
    left = sum(where.values())
    pools = sum(v for k, v in where.items() if not k.endswith("/ordinary"))
    parts = ", ".join(f"{v / MiB:.1f} MiB on "
                      f"{k.split('/')[0]}" for k, v in where.items()) or "nothing"
    return (f"clear_cache() gave back {freed / MiB:.1f} MiB (the captures' pool held "
            f"{held / MiB:.1f} MiB); {left / MiB:.1f} MiB stay reserved ({parts}), "
            f"{pools / MiB:.1f} MiB of it in a "
            "graph pool: outside the captures' pool, what stays is the caller's (the tensors it "
            "still holds) and torch's (a cuBLAS workspace per stream that ran a matrix product "
            "since the clear)")


def check_enable_clear(cls) -> None:
    """3.7: set_enabled(False) runs eager, graphs kept; clear_cache() empties the captures' pool and
    reserved memory falls by at least what it held."""
    with exercise("lab 3.7 enable and clear", hint=[
                "disabled: the cache is bypassed but keeps its graphs; cleared: nothing of the old "
                "graphs is left, in the cache or in the backend's pool",
                "set_enabled stores the flag and __call__ runs self.fn eagerly while it is off; "
                "clear_cache empties self.entries, keeps no other reference to them, and calls "
                "self.backend.reset_pool()",
                "a smaller example: d.clear() while another name still holds one of d's graphs "
                "keeps it alive"],
            answer="self.enabled = bool(enabled); clear_cache: self.entries.clear(); "
                   "self.backend.reset_pool()"), counting() as counted:
        d = torch_device()
        w = torch.randn(8, 8, generator=torch.Generator().manual_seed(7)).to(d)
        forward = lambda x: x @ w + 1  # noqa: E731
        cache, backend = counted(cls, forward)
        x = torch.ones(2, 8, device=d)
        cache(x)
        cache.set_enabled(False)
        right = torch.allclose(cache(x), forward(x), atol=1e-5)
        check(backend, [
            expect("disabled", lambda b: right and b.replays == 1, "disabled: run it eagerly"),
            expect("eager_calls", lambda b: cache.stats["eager_calls"] == 1,
                   "count the disabled call as an eager call")])
        cache.set_enabled(True)
        cache(x)
        check(backend, [expect("enabled", lambda b: b.replays == 2 and b.captures == 1,
                               "enabled again: the recorded graph is replayed")])
        before, held = reserved_now(backend), backend.pool_bytes()
        cache.clear_cache()
        live = backend.live_graphs()
        gc.collect()
        check(backend, [
            expect("entries", lambda b: not cache.entries,
                   "clear_cache() must drop every entry (their graphs and static buffers)"),
            expect("reset_pool", lambda b: b.pool_resets >= 1, (
                "clear_cache() never called self.backend.reset_pool(): the backend keeps the "
                "dropped graphs' pool and would put the next captures into it. Call it after "
                "emptying self.entries, so they start a fresh pool")),
            expect("cycle", lambda b: b.live_graphs() == live, lambda b: (
                f"clear_cache() dropped the entries, but {live - b.live_graphs()} graph(s) lived "
                "on until the garbage collector ran: a reference cycle held them. The collector "
                "may run in the middle of a later capture, and a graph freed there breaks it "
                "(lesson 03): keep no cycle (nothing that refers back to the cache or the entry) "
                "around your entries, so that clearing frees the graphs at once"))])
        after, left = reserved_now(backend), backend.pool_bytes()
        check(backend, [
            expect("referenced", lambda b: not b.live_graphs(), (
                "clear_cache() emptied self.entries, but the memory the graphs held did not come "
                f"back ({before} bytes reserved before, {after} after): something still references "
                "the old entries or their recordings. Keep no copy of them (no second dict or "
                "list, no saved entry): a graph's memory is freed only when nothing references "
                "it")),
            expect("pool_held", lambda b: not left, (
                f"the graphs are freed, but {left} of the {held} bytes their memory pool held "
                "stayed reserved: something still references a tensor the capture made (a graph's "
                "static output, entry['output'], or a view of it), and its memory keeps the "
                "pool's. Return copies (copy_out) and keep no reference to a static output outside "
                "its entry")),
            expect("freed", lambda b: before - after >= held, (
                "clear_cache() freed the graphs and their pool, but reserved memory fell by only "
                f"{before - after} bytes ({before} before, {after} after), less than the {held} "
                "bytes the pool held"))])
        if backend.name != "recording":
            print(what_stays(before - after, held, torch.cuda.memory_snapshot(),
                             {torch.cuda.default_stream().cuda_stream: "the default stream"}))
        cache(x)
        check(backend, [expect("records_again", lambda b: b.captures == 2
                               and cache.stats["cache_misses"] == 2,
                               "after clear_cache() the next call records")])
