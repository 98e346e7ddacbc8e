"""Lab 3's checks: each runs the learner's own code (a key function, static buffers, outputs, a cache class).

Every check uses the default backend of this machine (a real CUDA graph on the GPU path, the
recording backend on the simulator path), wrapped in :class:`CountingBackend` so it can tell whether
the learner's cache really records and replays. The messages diagnose the classic wrong caches:
keys that ignore the dtype, inputs not copied into the static buffers, outputs overwritten by the
next replay, padding rows that leak into results.
"""
from __future__ import annotations

import torch

from course.core.checks import exercise
from course.core.runtime import torch_device
from course.lessons.graph_cache.backends import Recorded, default_backend
from course.lessons.graph_cache.decoder import DecoderConfig, TinyDecoder


class CountingBackend:
    """Wraps a backend and counts captures and replays (so a check sees what the cache under test did)."""

    def __init__(self, inner=None):
        self.inner = inner or default_backend()
        self.name = self.inner.name
        self.captures = self.replays = 0

    def capture(self, fn, static_args, warmup: int = 1) -> Recorded:
        """Capture through the wrapped backend and count it (failed attempts count too)."""
        self.captures += 1
        rec = self.inner.capture(fn, static_args, warmup=warmup)
        inner_replay = rec.replay

        def replay():
            self.replays += 1
            inner_replay()
        rec.replay = replay
        return rec

    def memory_reserved(self) -> int:
        """The wrapped backend's reserved memory (what its live recordings hold, on either path)."""
        return self.inner.memory_reserved()

    def reset_pool(self) -> None:
        """Forget the wrapped backend's shared pool."""
        self.inner.reset_pool()


def _dev():
    return torch_device()


def check_key(cache_key) -> None:
    """Step 1: ``cache_key(args, bucket)`` tells apart dtypes, shapes and values, and merges rows padded alike."""
    with exercise("lab 3.1 the key", hint="one entry per argument: ('tensor', shape with dim 0 = bucket, dtype, "
                                         "device) or ('value', v); a tuple, so it can be a dict key"):
        d = _dev()
        ids64, ids32 = torch.zeros(3, 2, dtype=torch.int64, device=d), torch.zeros(3, 2, dtype=torch.int32, device=d)
        k = cache_key((ids64, 5), 4)
        try:
            hash(k)
        except TypeError:
            raise AssertionError("the key is not hashable: build it from tuples, not lists or tensors") from None
        assert k == cache_key((torch.ones(3, 2, dtype=torch.int64, device=d), 5), 4), \
            "the same shapes and dtypes gave different keys: key on shapes and dtypes, never on tensor values"
        assert k != cache_key((ids32, 5), 4), ("your key ignores the dtype: int32 and int64 ids would share one "
                                              "graph, whose kernels and buffers were made for one of them")
        assert k != cache_key((torch.zeros(3, 5, dtype=torch.int64, device=d), 5), 4), \
            "your key ignores the shape after the batch dimension"
        assert k != cache_key((ids64, 6), 4), \
            "your key ignores the non-tensor arguments (their values change the graph)"
        assert k == cache_key((torch.zeros(4, 2, dtype=torch.int64, device=d), 5), 4), \
            "batches padded to the same bucket must share a key: use the bucket, not the batch size, for dim 0"
        assert k != cache_key((ids64, 5), 8), "different buckets need different keys"


def check_static(make_static, copy_in) -> None:
    """Step 2: static buffers of the bucket's size, written in place, padding rows refilled on every call."""
    with exercise("lab 3.2 static inputs", hint="torch.empty((bucket, *a.shape[1:])) per tensor; then "
                                               "static[:n].copy_(a) and static[n:].fill_(pad)"):
        d = _dev()
        x, ids = torch.randn(3, 4, device=d), torch.tensor([7, 8, 9], device=d)
        static = make_static((x, ids, "tag"), 4)
        assert len(static) == 3 and static[2] == "tag", "keep non-tensor arguments as they are, in their place"
        assert static[0].data_ptr() != x.data_ptr(), ("the static input is the caller's tensor itself: the graph "
                                                     "would read this tensor's memory on every replay, whatever "
                                                     "the next caller passes. Allocate a buffer of your own")
        assert tuple(static[0].shape) == (4, 4) and tuple(static[1].shape) == (4,), \
            f"static buffers need the bucket's rows: got shapes {tuple(static[0].shape)}, {tuple(static[1].shape)}"
        assert static[0].dtype == x.dtype and static[1].dtype == ids.dtype, "static buffers keep each input's dtype"
        ptrs = [s.data_ptr() for s in static[:2]]
        copy_in(static, (x, ids, "tag"), 3, (0.0, -1, None))
        assert [s.data_ptr() for s in static[:2]] == ptrs, ("copy_in replaced a static buffer: write into it "
                                                             "with copy_() (the graph reads that memory)")
        assert torch.equal(static[0][:3], x) and torch.equal(static[1][:3], ids), "rows [:n] must hold the inputs"
        assert float(static[0][3].abs().sum()) == 0 and int(static[1][3]) == -1, \
            "padding rows must hold pad_value (one per argument)"
        y, ids2 = torch.randn(2, 4, device=d), torch.tensor([1, 2], device=d)
        copy_in(static, (y, ids2, "tag"), 2, (0.0, -1, None))
        assert torch.equal(static[0][:2], y), "the inputs were not copied in on the second call"
        assert int(static[1][2]) == -1, ("row 2 still holds the previous call's input: padding rows must be refilled "
                                         "on every call, or stale rows leak (a real KV slot, a real token)")


def check_copy_out(copy_out) -> None:
    """Step 3: outputs sliced back to the batch, cloned by default, views when copy=False."""
    with exercise("lab 3.3 outputs", hint="t[:n].clone() for every tensor whose dim 0 is the bucket; keep the "
                                         "structure (a tuple stays a tuple)"):
        d = _dev()
        out = torch.arange(8.0, device=d).view(4, 2)
        other = torch.ones(3, device=d)
        got = copy_out((out, other), 3, 4)
        assert isinstance(got, tuple) and len(got) == 2, "keep the output's structure (here a tuple of two tensors)"
        assert tuple(got[0].shape) == (3, 2), f"slice the padded output back to the batch: got {tuple(got[0].shape)}"
        assert torch.equal(got[1], other), "outputs whose dim 0 is not the bucket are returned whole"
        out.fill_(-1.0)  # what the next replay does to the static output
        assert float(got[0].min()) >= 0, ("the output changed when the static output was overwritten: the next "
                                          "replay would change results you already returned. Clone them")
        view = copy_out(out, 3, 4, copy=False)
        out.fill_(5.0)
        assert float(view.min()) == 5.0, "copy=False returns views of the static output (zero-copy)"


def _counted(cls, fn, **kw):
    backend = CountingBackend()
    return cls(fn, backend=backend, **kw), backend


def check_miss_and_hit(cls) -> None:
    """Step 4: a miss records through the backend, a hit replays with the new inputs; the stats count both."""
    with exercise("lab 3.4 capture on miss, replay on hit",
                  hint="miss: record (static buffers, copy in, backend.capture); hit: copy in, replay, copy out"):
        d = _dev()
        w = torch.randn(8, 8, generator=torch.Generator().manual_seed(0)).to(d)
        fn = lambda x: torch.relu(x @ w) + 1  # noqa: E731
        cache, backend = _counted(cls, fn)
        xs = [torch.randn(4, 8, device=d), torch.randn(4, 8, device=d), torch.randn(2, 8, device=d),
              torch.randn(4, 8, device=d)]
        outs = [cache(x) for x in xs]
        for i, (x, o) in enumerate(zip(xs, outs)):
            assert torch.allclose(o, fn(x), atol=1e-5), (
                f"call {i} returned a wrong result" + (" (the same as the previous call: were the new inputs copied "
                                                       "into the static buffers before the replay?)"
                                                       if i and torch.allclose(o, fn(xs[i - 1]), atol=1e-5) else "")
                + (" (it was overwritten by a later replay: return a copy)" if i == 0 and
                   torch.allclose(o, fn(xs[3]), atol=1e-5) else ""))
        assert backend.captures == 2, f"2 shapes should be recorded once each; the backend captured {backend.captures}x"
        assert backend.replays == 4, (f"every call should end in a replay (the first call of a shape too); the backend "
                                      f"replayed {backend.replays}x: does a hit call the forward eagerly?")
        s = cache.stats
        assert (s["cache_misses"], s["cache_hits"], s["recordings"]) == (2, 2, 2), \
            f"stats: misses {s['cache_misses']}, hits {s['cache_hits']}, recordings {s['recordings']}; expected 2, 2, 2"


def check_buckets(cls) -> None:
    """Step 5: buckets and padding on the tiny decoder: results equal eager, padding never leaks, stats add up."""
    with exercise("lab 3.5 buckets and padding", hint="bucket = next_bucket(n, self.sizes); None: run eager; "
                                                     "padded_rows += bucket - n"):
        cfg = DecoderConfig(layers=1, max_seq=8, slots=10)
        eager, cached = TinyDecoder(cfg), TinyDecoder(cfg)
        cache, backend = _counted(cls, cached.step, buckets=[2, 4, 8], pad_value=cached.pad_values())
        # (batch, position): at (8, 0) new requests take slots 0..7; a stale row 3 left in bucket 4's buffer by
        # (4, 0) would then overwrite slot 3's new entry at position 0, and (4, 1) reads it
        steps = [(4, 0), (8, 0), (3, 1), (4, 1), (1, 2), (9, 2), (2, 3)]
        for i, (b, pos) in enumerate(steps):
            g = torch.Generator().manual_seed(i)
            ids = torch.randint(0, cfg.vocab, (b,), generator=g).to(eager.tok.device)
            args = (ids, torch.full((b,), pos, dtype=torch.long, device=ids.device), torch.arange(b, device=ids.device))
            want, got = eager.step(*args), cache(*args)
            assert tuple(got.shape) == tuple(want.shape), \
                f"call {i} (batch {b}): output shape {tuple(got.shape)}, expected {tuple(want.shape)}: slice it back"
            assert torch.allclose(got, want, atol=1e-4), (
                f"call {i} (batch {b}) differs from the eager decoder: padding rows leaked into real sequences "
                "(were the padding rows refilled with pad_value, the scratch slot, on every call?)")
        s = cache.stats
        want = {"cache_misses": 3, "cache_hits": 3, "eager_calls": 1, "padded_rows": 2}
        got = {k: s.get(k) for k in want}
        assert got == want, f"stats {got}, expected {want} (batch 9 is above the largest bucket: eager)"
        assert backend.captures == 3, f"buckets 4, 8 and 2 should be captured once each, not {backend.captures} times"


def _hazard(x):
    return x / x.abs().max().item()  # a host read: cannot be captured


def check_fallback(cls) -> None:
    """Step 6: a key whose capture fails runs eager from then on, with its reason; other keys still capture."""
    with exercise("lab 3.6 fallback", hint="try: backend.capture(...) except CaptureFailed as e: remember the key "
                                          "as eager, with e.reason"):
        d = _dev()
        fn = lambda x, hazard: _hazard(x) if hazard else x * 2  # noqa: E731
        cache, backend = _counted(cls, fn)
        x = torch.randn(4, 3, device=d)
        for _ in range(2):
            got = cache(x, True)
            assert torch.allclose(got, _hazard(x)), "a key that cannot be captured must still return the right answer"
        assert backend.captures == 1, (f"the failing key was captured {backend.captures} times: remember that it "
                                       "runs eager instead of trying again on every call")
        assert torch.allclose(cache(x, False), x * 2) and backend.captures == 2 and backend.replays >= 1, \
            "after a failed capture, other keys must still be recorded and replayed"
        reasons = list(cache.stats["fallbacks"].values())
        assert len(reasons) == 1 and "item" in reasons[0], \
            f"stats['fallbacks'] should map the failing key to its reason (CaptureFailed.reason); got {reasons}"
        assert cache.stats["eager_calls"] == 2, f"eager_calls: {cache.stats['eager_calls']}, expected 2"


def reserved_now(backend) -> int:
    """The backend's reserved memory once garbage is collected (and, on a GPU, the allocator's cache emptied).

    What a cache's recordings hold shows up here only while something references them, so the difference
    before and after ``clear_cache()`` is the memory that clearing gave back.
    """
    import gc

    gc.collect()
    if backend.name != "recording":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return backend.memory_reserved()


def check_enable_clear(cls) -> None:
    """Step 7: set_enabled(False) runs eager without touching the graphs; clear_cache() gives their memory back."""
    with exercise("lab 3.7 enable and clear", hint="disabled: call self.fn directly; clear: empty self.entries "
                                                  "(and backend.reset_pool()), and keep no other reference to them"):
        d = _dev()
        cache, backend = _counted(cls, lambda x: x + 1)
        x = torch.ones(2, device=d)
        cache(x)
        cache.set_enabled(False)
        assert torch.equal(cache(x), x + 1) and backend.replays == 1, "disabled: run the forward eagerly, no replay"
        assert cache.stats["eager_calls"] == 1, "count the disabled call as an eager call"
        cache.set_enabled(True)
        cache(x)
        assert backend.replays == 2 and backend.captures == 1, "enabled again: the recorded graph is replayed"
        before = reserved_now(backend)
        cache.clear_cache()
        assert not cache.entries, "clear_cache() must drop every entry (their graphs and static buffers)"
        after = reserved_now(backend)
        assert after < before, (
            f"clear_cache() emptied self.entries, but the memory the graphs held did not come back ({before} bytes "
            f"reserved before, {after} after): something still references the old entries or their recordings. "
            "Keep no copy of them (no second dict or list, no saved entry): a graph's memory is freed only when "
            "nothing references it")
        cache(x)
        assert backend.captures == 2 and cache.stats["cache_misses"] == 2, "after clear_cache() the next call records"
