"""Lab 3's checks: each runs the learner's own code (a key function, static buffers, outputs, a cache class).

The learner's cache captures with the graph API itself (``cg = course.graphs()``: ``torch.cuda`` on the GPU path,
the simulator's graphs otherwise) and uses the machine's default backend for its pool, its memory and the reason of
a failed capture. The checks hand it a :class:`~course.lessons.graph_cache.counting.CountingBackend` and count, while
they run, the graph API calls it makes: captures, replays, the pool each capture named, the static inputs each
replay read, pool resets, and the graphs still alive. The messages diagnose the classic wrong caches: keys (or
lookups) that ignore the dtype, a capture without a warm-up on a side stream or with the collector on, graphs not in
the cache's pool, inputs not copied into the static buffers, outputs overwritten by the next replay, padding rows
that hold anything but ``pad_value``, eager keys counted as hits, a failed capture that escapes or leaves its stream
current, a clear that keeps the graphs (or leaves them to the garbage collector). Hints are staged: the rule, where,
a smaller example; the answer on request.
"""
from __future__ import annotations

import gc

import torch

from course.core.capture import recover
from course.core.capturecheck import assert_captured_well, first_line, root_cause
from course.core.checks import exercise
from course.core.runtime import graphs, torch_device
from course.core.text import clip
from course.lessons.graph_cache.counting import counting
from course.lessons.graph_cache.decoder import DecoderConfig, TinyDecoder


def _dev():
    return torch_device()


def check_key(cache_key) -> None:
    """Step 1: ``cache_key(args, bucket)`` tells apart dtypes, shapes and values, and merges rows padded alike."""
    with exercise("lab 3.1 the key", hint=[
                "a graph is valid only for the shapes and dtypes it was captured with, and for the values that "
                "steered it: which parts of each argument must the key hold, and which must it leave out?",
                "in cache_key: one entry per argument: ('tensor', shape with dim 0 replaced by the bucket, dtype, "
                "device) for a tensor, ('value', v) otherwise; all of it in tuples, so the key can be a dict key",
                "a smaller example: {(('tensor', (4, 2), 'torch.int64', 'cpu'), ('value', 3)): graph} — a list inside"
                " the key would raise TypeError: unhashable type"],
            answer="key.append(('tensor', (bucket, *a.shape[1:]), str(a.dtype), str(a.device))) for a tensor, "
                   "key.append(('value', a)) otherwise; return tuple(key)"):
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
        assert k != cache_key((torch.zeros(3, 2, dtype=torch.int64, device="meta"), 5), 4), \
            "your key ignores the device: a graph recorded for one device's memory cannot serve another's tensors"
        assert k != cache_key((torch.zeros(3, 5, dtype=torch.int64, device=d), 5), 4), \
            "your key ignores the shape after the batch dimension"
        assert k != cache_key((ids64, 6), 4), \
            "your key ignores the non-tensor arguments (their values change the graph)"
        assert k == cache_key((torch.zeros(4, 2, dtype=torch.int64, device=d), 5), 4), \
            "batches padded to the same bucket must share a key: use the bucket, not the batch size, for dim 0"
        assert k != cache_key((ids64, 5), 8), "different buckets need different keys"


def check_static(make_static, copy_in) -> None:
    """Step 2: static buffers of the bucket's size, written in place, padding rows refilled on every call."""
    with exercise("lab 3.2 static inputs", hint=[
                "a replay reads the same memory every time: whose memory is it, how many rows does it need, and what "
                "must every row hold before the replay?",
                "make_static: a new buffer of the bucket's rows per tensor (its dtype, its device); copy_in: rows "
                "[:n] from the caller, in place, rows [n:] the argument's own pad, on every call",
                "a smaller example: s = torch.empty(4, 2); s[:3].copy_(x3); s[3:].fill_(0) — a batch of 3 in a bucket"
                " of 4"],
            answer="torch.empty((bucket, *a.shape[1:]), dtype=a.dtype, device=a.device); in copy_in: s[:n].copy_(a) and "
                   "s[n:].fill_(pad)"):
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
        other = make_static((torch.empty(3, 4, device="meta"), ids, "tag"), 4)[0]
        assert other.device == torch.device("meta"), (f"a buffer for an input on device 'meta' was made on "
                                                      f"{other.device}: static buffers keep each input's device")
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
    with exercise("lab 3.3 outputs", hint=[
                "the next replay writes into the same static output: what must the caller get instead of it, and how "
                "many rows?",
                "in copy_out: rows [:n] of every tensor whose dim 0 is the bucket, cloned (views only when "
                "copy=False); a tuple or list of outputs stays one, handled element by element",
                "a smaller example: y = static_y[:3].clone() keeps a batch of 3 out of a bucket of 4, safe from the "
                "next replay"],
            answer="out = out[:n] if out.dim() and out.shape[0] == bucket else out; return out.clone() if copy else out "
                   "(and type(out)(copy_out(o, n, bucket, copy) for o in out) for a tuple)"):
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


_SHARED_POOL = ("your captures did not all go into the cache's pool: capture with "
                "cg.graph(g, pool=self.backend.pool()) so that the graphs of one cache share one memory pool "
                "(notebook 04: what sharing saves)")


def check_miss_and_hit(cls) -> None:
    """Step 4: a miss records through the backend, a hit replays with the new inputs; the stats count both."""
    with exercise("lab 3.4 capture on miss, replay on hit", hint=[
                "a new key is recorded once, a known key reuses its recording: either way the call ends in a replay "
                "of the graph, on the caller's inputs, and a different dtype is a different key",
                "in __call__ and record: look the entry up by cache_key(args, bucket); miss: make_static, copy_in, "
                "warm self.fn up on a side stream, capture it with collector_paused() and cg.graph(g, "
                "pool=self.backend.pool()), count a recording; hit: copy_in into that entry's static buffers; then "
                "replay and copy_out",
                "a smaller example: cache = {}; def f(k): if k not in cache: cache[k] = record(k) (a miss); return "
                "run(cache[k]) (every call, hit or miss)"],
            answer="entry = self.entries.get(key); if entry is None: entry = self.entries[key] = self.record(...); else:"
                   " copy_in(entry['static'], ...); entry['graph'].replay(); return copy_out(entry['output'], n, bucket)"), \
            counting() as _counted:
        d = _dev()
        w = torch.randn(8, 8, generator=torch.Generator().manual_seed(0)).to(d)
        fn = lambda x: torch.relu(x @ w) + 1  # noqa: E731
        cache, backend = _counted(cls, fn)
        xs = [torch.randn(4, 8, device=d), torch.randn(4, 8, device=d), torch.randn(2, 8, device=d),
              torch.randn(4, 8, device=d)]
        outs, seen = [], set()
        for i, x in enumerate(xs):
            replays = backend.replays
            outs.append(cache(x))
            first = tuple(x.shape) not in seen
            seen.add(tuple(x.shape))
            assert backend.replays == replays + 1, (
                f"call {i}, the first of its shape, returned without a replay: a capture only records (on a GPU its "
                "output holds nothing yet), so replay the new recording before returning" if first else
                f"call {i} (a hit) ended in {backend.replays - replays} replays, expected 1: does a hit call the "
                "forward eagerly?")
        assert backend.captures == 2, f"2 shapes should be recorded once each; your cache captured {backend.captures}x"
        assert_captured_well(backend.forward, "the forward")
        assert None not in backend.pools and len(set(backend.pools)) == 1, _SHARED_POOL
        assert not backend.foreign, (
            "your graph was captured on other tensors than the entry's static buffers (the caller's?): a hit copies "
            "the new inputs into the static buffers, which the graph never reads, so it returns the same as the "
            "previous call. Capture self.fn(*static)")
        assert not backend.replaced, (
            "after the capture, your cache put new tensors into the static input list it was captured with: the "
            "graph reads the buffers it was captured on, whatever the list holds now. Write into them with copy_()")
        for i, (x, o) in enumerate(zip(xs, outs)):
            assert torch.allclose(o, fn(x), atol=1e-5), (
                f"call {i} returned a wrong result" + (" (the same as the previous call: were the new inputs copied "
                                                       "into the static buffers before the replay?)"
                                                       if i and torch.allclose(o, fn(xs[i - 1]), atol=1e-5) else "")
                + (" (it was overwritten by a later replay: return a copy)" if i == 0 and
                   torch.allclose(o, fn(xs[3]), atol=1e-5) else ""))
        s = cache.stats
        assert (s["cache_misses"], s["cache_hits"], s["recordings"]) == (2, 2, 2), \
            f"stats: misses {s['cache_misses']}, hits {s['cache_hits']}, recordings {s['recordings']}; expected 2, 2, 2"
        _check_dtypes(cls, d, _counted)


def _check_dtypes(cls, d, counted) -> None:
    """One shape in two dtypes: two keys, two recordings, each call answered in its own dtype."""
    cache, backend = counted(cls, lambda x: x * 2 + 1)
    calls = [torch.randn(4, 8, device=d), torch.randn(4, 8, device=d).half(), torch.randn(4, 8, device=d)]
    for i, x in enumerate(calls):
        got = cache(x)
        other = calls[1 - min(i, 1)].dtype  # the dtype of the other key
        assert got.dtype == x.dtype, (
            f"a {_dt(x.dtype)} call with the same shape as an earlier {_dt(other)} call returned {_dt(got.dtype)}: "
            f"your cache found the {_dt(other)} entry for it. Look entries up by cache_key(args, bucket), which "
            "tells the dtypes apart: each dtype needs its own recording")
        assert torch.allclose(got.float(), (x * 2 + 1).float(), atol=1e-2), \
            f"call {i} ({_dt(x.dtype)}, after a call of the other dtype with the same shape) returned a wrong result"
    assert backend.captures == 2, (f"one shape in float32 and float16 should be recorded once per dtype (2 "
                                   f"captures); your cache captured {backend.captures}x")


def _dt(dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_buckets(cls) -> None:
    """Step 5: buckets and padding on the tiny decoder: results equal eager, padding never leaks, stats add up."""
    with exercise("lab 3.5 buckets and padding", hint=[
                "a batch runs in its bucket's graph, so its padding rows run through the model too: what they hold "
                "decides which KV slot they write and which ids the embedding sees",
                "in __call__: bucket = next_bucket(n, self.sizes) (None, above the largest: run self.fn eagerly, an "
                "eager call); copy_in fills rows [n:] of argument i with its own pad_value[i] on every call; "
                "padded_rows += bucket - n",
                "a smaller example: buckets [2, 4, 8] and a batch of 3: bucket 4, one padding row; a batch of 9: no "
                "bucket, one eager call"],
            answer="if not self.enabled or bucket is None: self.stats['eager_calls'] += 1; return self.fn(*args); "
                   "copy_in(static, args, n, self.pads(args)); self.stats['padded_rows'] += bucket - n"), \
            counting() as _counted:
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
            want, replays = eager.step(*args), backend.replays
            try:
                got = cache(*args)
            except Exception as e:  # noqa: BLE001 - above the largest bucket, a crash is this step's defect
                if b <= 8:
                    raise
                raise AssertionError(f"call {i} (batch {b}, above the largest bucket 8) raised {type(e).__name__}: "
                                     f"{(str(e).splitlines() or [''])[0][:120]}. Such a batch has no graph: when "
                                     "next_bucket returns None, run self.fn eagerly and count an eager call") from e
            if backend.replays > replays:
                _check_padding(i, b, backend.replayed_inputs(), cached.pad_values())
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
        assert None not in backend.pools and len(set(backend.pools)) == 1, _SHARED_POOL


def _check_padding(i: int, b: int, static, pads) -> None:
    """The padding rows of the static inputs the replay read hold exactly each argument's pad_value."""
    bad, bucket = [], b
    for name, s, pad in zip(("ids", "pos", "slots"), static, pads):
        if isinstance(s, torch.Tensor) and s.dim() and s.shape[0] > b:
            rows, bucket = s[b:], s.shape[0]
            if not bool((rows == pad).all()):
                held = sorted({int(v) for v in rows.flatten().tolist()})
                bad.append(f"{name} holds {held[:4]} where its pad_value is {pad}")
    assert not bad, (
        f"call {i} (batch {b}, bucket {bucket}) replayed with padding rows that are not pad_value: " + "; ".join(bad)
        + ". Fill rows [n:] of every argument with its own pad_value, on every call: other values make padding rows "
        "write into a real sequence's KV slot, or count bad ids the caller never passed")


def _hazard(x):
    return x / x.abs().max().item()  # a host read: cannot be captured


def check_fallback(cls) -> None:
    """Step 6: a key whose capture fails runs eager from then on, with its reason; other keys still capture."""
    with exercise("lab 3.6 fallback", hint=[
                "a key that cannot be captured must not be an outage, nor a capture attempted on every call: remember"
                " what happened to it, and why",
                "in record: catch the capture's error; reason = self.backend.capture_failed(e, graph=g, "
                "stream=before) (the stream put back, the pool retired); store an eager entry with the reason and put"
                " it in stats['fallbacks'][key]; every call of that key runs self.fn and counts an eager call, never "
                "a hit",
                "a smaller example: failed = {}; if key in failed: return slow(x); try: fast(x) except Exception as "
                "e: failed[key] = str(e) — the second call of that key never tries again"],
            answer="except Exception as e: reason = self.backend.capture_failed(e, graph=g, stream=before); "
                   "self.stats['fallbacks'][key] = reason; return {'eager': True, 'reason': reason}; and count "
                   "cache_hits only for an entry that is not eager"), counting() as _counted:
        d = _dev()
        fn = lambda x, hazard: _hazard(x) if hazard else x * 2  # noqa: E731
        cache, backend = _counted(cls, fn)
        x = torch.randn(4, 3, device=d)
        cg = graphs()
        before = cg.current_stream()
        for _ in range(2):
            try:
                got = cache(x, True)
            except (AssertionError, NotImplementedError):
                raise
            except Exception as e:  # noqa: BLE001 - the capture's error, escaped from the learner's cache
                if not cg.current_stream() == before:
                    recover(stream=before)
                why = clip(first_line(root_cause(e)), 120)
                raise AssertionError(f"your cache let the capture's error escape ({why}): "
                                     "catch it around the capture, take the reason from self.backend.capture_failed("
                                     "e, graph=g, stream=before), and run that key eagerly") from None
            if not cg.current_stream() == before:
                recover(stream=before)
                raise AssertionError(
                    "after the failed capture, the capture stream is still current (a failed cg.graph leaves it so): "
                    "every later op would run on it. In your except: reason = self.backend.capture_failed(e, "
                    "graph=g, stream=before), which puts your stream back and retires the pool")
            assert torch.allclose(got, _hazard(x)), "a key that cannot be captured must still return the right answer"
        assert backend.captures == 1, (f"the failing key was captured {backend.captures} times: remember that it "
                                       "runs eager instead of trying again on every call")
        hits, misses = cache.stats["cache_hits"], cache.stats["cache_misses"]
        assert (hits, misses) == (0, 1), (
            f"two calls of a key that fell back to eager counted {hits} cache_hits and {misses} cache_misses; "
            "expected 0 and 1: the first call is a miss, the next ones are eager_calls, never hits (a hit replays "
            "a recorded graph)")
        assert torch.allclose(cache(x, False), x * 2) and backend.captures == 2 and backend.replays >= 1, \
            "after a failed capture, other keys must still be recorded and replayed"
        reasons = list(cache.stats["fallbacks"].values())
        assert len(reasons) == 1 and reasons[0] in backend.reasons, (
            f"stats['fallbacks'] should map the failing key to its reason, the string self.backend.capture_failed("
            f"e, graph=g, stream=before) returned ({backend.reasons or 'it was never called'}); got {reasons}")
        assert cache.stats["eager_calls"] == 2, f"eager_calls: {cache.stats['eager_calls']}, expected 2"


from course.lessons.graph_cache.lab_clear import check_enable_clear, reserved_now  # noqa: E402,F401  (step 7)
