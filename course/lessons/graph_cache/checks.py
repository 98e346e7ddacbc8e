"""Lesson 04's checks (04.1, 04.2: the bucket presets and a GraphCache) and lab 3.1-3.3 (the
learner's key function and buffers); lab 3.4-3.7, on the learner's cache class, are in
:mod:`.cache_checks`.
"""
from __future__ import annotations

import torch

from course.core.checks import exercise
from course.core.harness import check, expect
from course.core.runtime import torch_device
from course.lessons.graph_cache.buckets import PRESETS, bucket_sizes, padding_report
from course.lessons.graph_cache.cache import GraphCache


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
