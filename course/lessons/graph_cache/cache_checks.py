"""Lab 3.4-3.7: the learner's cache class, run on a :class:`~.counting.CountingBackend`.

The learner's cache captures with the graph API itself (``cg = course.graphs()``) and uses a backend
for its pool, its memory and the reason of a failed capture; the checks judge the traced calls by
the shared capture rules and the counts by named rules, whose ✗ names the classic mistake.
"""
from __future__ import annotations

import gc

import torch

from course.core.capture import recover
from course.core.checks import exercise
from course.core.harness import Defect, capture_rules, check, expect, first_line, root_cause
from course.core.runtime import graphs, torch_device
from course.core.text import clip
from course.lessons.graph_cache.counting import FORWARD, counting
from course.lessons.graph_cache.decoder import DecoderConfig, TinyDecoder
from course.lessons.graph_cache.memory_ledger import MiB, by_stream_pool


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
