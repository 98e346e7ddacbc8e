"""Lesson 06's batch sweep and GEMV table: their variants, rows and results (the decode's and
reduce-overhead's are in :mod:`.bench`)."""
from __future__ import annotations

import torch

from course.core.capture import graph, warm_up
from course.core.results import Result
from course.lessons.real_model.bench import (FAST, NAN, TIMES, TRITON, _columns, _mode, _reason, _result,
                                             _times)
from course.lessons.real_model.decode import StaticDecoder, graph_cached
from course.lessons.real_model.model import _size, bytes_per_token, size_of
from course.lessons.real_model.projections import gemv_model
from course.lessons.real_model.roofline import floor_us, tokens_per_s

BATCH1_ONLY = {TRITON: "n/a: lesson 07's Triton step decodes one sequence (its kernels are "
                       "matrix-vector products)"}
COMPILED = ("fused", FAST)  # the sweep's compiled variants: they run only at its fused_batches
L2_FACTOR = 4  # the GEMV's copies of each matrix fill this many times the L2 cache
IMPLS = ("cuBLAS", "Numba GEMV")  # the implementations the GEMV table compares, in column order

SWEEP_COLUMNS = _columns(("", "batch variant status"), ("us", "us q1_us q3_us"),
                         ("tokens/s", "tokens_per_s"), ("s", "first_call_s"))
GEMV_COLUMNS = {"shape": "", "what": "", "layers": "count", "MB": "MB",
                **{f"{i} {k}": u for i in IMPLS for k, u in (("us", "us"), ("q1 us", "us"),
                                                             ("q3 us", "us"), ("GB/s", "GB/s"))},
                "rel_diff": "fraction"}


# ------------------------ the batch sweep
def sweep_batches(batches) -> list:
    """The sweep's batch sizes, sorted and each once; an error for none or a size below 1."""
    out = sorted(set(int(b) for b in batches))
    if not out or out[0] < 1:
        raise ValueError(f"batches must be positive ints, got {out}")
    return out


def sweep_variants(model, batches, fused_batches, max_len: int, triton=None) -> tuple:
    """``(eager decoder, {variant: step})`` of the sweep, each on a decoder of its own: eager,
    graph-cached (a bucket per batch), lesson 07's step (``triton()``, batch 1 only) and, with
    ``fused_batches``, the compiled variants (compiled once, captured per batch size)."""
    eager_dec, cache_dec, fused_dec = (StaticDecoder(model, max_len) for _ in range(3))
    out = {"eager": eager_dec.step, "graph-cached": graph_cached(cache_dec, buckets=batches)}
    if fused_batches:
        fast_dec = StaticDecoder(gemv_model(model, fuse=True), max_len)
        out["fused"] = graph_cached(fused_dec, buckets=batches, fused=torch.compile(fused_dec.step))
        out[FAST] = graph_cached(fast_dec, buckets=batches, fused=torch.compile(fast_dec.step))
    try:
        out.update({TRITON: triton()} if triton is not None else {})
    except Exception as e:  # noqa: BLE001 - no Triton here: the row says why at its first call
        def broken(*args, e=e):
            raise e
        out[TRITON] = broken
    return eager_dec, out


def _sweep_row(batch: int, name: str, status: str, timing=None, first_call_s: float = NAN) -> dict:
    times = _times(timing)
    return {"batch": batch, "variant": name, "status": status, **times,
            "tokens_per_s": tokens_per_s(batch, times["us"]) if timing else NAN,
            "first_call_s": first_call_s}


def sweep_row(batch: int, name: str, fn, first_call_s: float, timing) -> dict:
    """A measured row of the sweep: the step's median and IQR, tokens/s, "ok" or its fallback."""
    status = "ok" if _mode(fn) in ("eager", "fusion", "graph_replay") else f"fell back: {_mode(fn)}"
    return _sweep_row(batch, name, status, timing, first_call_s)


def failed_row(batch: int, name: str, error: BaseException) -> dict:
    """The row of a variant whose first call raised: its status says why, its times are NaN."""
    return _sweep_row(batch, name, _reason(error))


def na_row(batch: int, name: str, reason: str) -> dict:
    """The row of a variant that does not serve ``batch``: its status says why, its times NaN."""
    return _sweep_row(batch, name, reason)


def floor_row(model, batch: int, position: int, bandwidth_GBps: float) -> dict:
    """The floor's row at ``batch``: what one step must read (weights, embedding rows, KV cache)."""
    fl = floor_us(bytes_per_token(model, batch, position), bandwidth_GBps)
    return {"batch": batch, "variant": "floor", "status": "computed", **dict.fromkeys(TIMES, fl),
            "tokens_per_s": tokens_per_s(batch, fl), "first_call_s": 0.0}


def batch_sweep_result(rows: list, model, bandwidth_GBps: float, **params) -> Result:
    """The ``real_model_batch_sweep`` table: its rows, the copy bandwidth and the best tokens/s."""
    s = size_of(model)
    res = _result("real_model_batch_sweep", f"LlamaForCausalLM, {s.name} shape ({s.dtype}), random "
                  f"weights: tokens/s against batch size at position {params.get('position')} "
                  "(CUDA events, variants interleaved per batch)", SWEEP_COLUMNS, rows, **params)
    res.add_summary("copy_bandwidth_GBps", bandwidth_GBps, "GB/s")
    measured = [r for r in rows if r["variant"] != "floor" and r["tokens_per_s"] > 0]
    if measured:
        best = max(measured, key=lambda r: r["tokens_per_s"])
        res.add_summary("best_tokens_per_s", best["tokens_per_s"], "tokens/s")
        res.add_summary("best_at", f"{best['variant']}, batch {best['batch']}", "")
    return res


# ------------------------ the batch-1 GEMV, timed from memory
def shapes_of(size: str = "tinyllama") -> list:
    """``(N, K, layers using it, what)`` of every weight shape a batch-1 step of ``size`` multiplies
    by: transformers' separate projections, then the stacked ones of the twin."""
    s = _size(size)
    kv = s.kv_heads * s.head_dim
    return [(s.hidden, s.hidden, 2 * s.layers, "q_proj, o_proj"),
            (kv, s.hidden, 2 * s.layers, "k_proj, v_proj"),
            (s.intermediate, s.hidden, 2 * s.layers, "gate_proj, up_proj"),
            (s.hidden, s.intermediate, s.layers, "down_proj"), (s.vocab, s.hidden, 1, "lm_head"),
            (s.hidden + 2 * kv, s.hidden, s.layers, "stacked q/k/v"),
            (2 * s.intermediate, s.hidden, s.layers, "stacked gate/up")]


def copies_for_l2(nbytes: int, l2_bytes: int, factor: int = L2_FACTOR) -> int:
    """How many distinct copies of an ``nbytes`` matrix fill ``factor`` times an L2 of ``l2_bytes``
    (at least 2): one call per copy, so every call reads from memory, as in the model."""
    if nbytes <= 0 or l2_bytes <= 0:
        raise ValueError(f"need a positive matrix size and L2 size, got {nbytes} and {l2_bytes} "
                         "bytes")
    return max(2, -(-factor * l2_bytes // nbytes))


def graph_of_calls(fn, x, weights):
    """A CUDA graph of ``fn(x, w)`` for every ``w`` of ``weights`` in order, after a warm-up (GPU):
    its replay times the kernels without the host's cost per call."""
    warm_up(lambda: [fn(x, w) for w in weights[:2]], iters=2)
    g = torch.cuda.CUDAGraph()
    with graph(g):
        for w in weights:
            fn(x, w)
    return g


def gemv_row(n: int, k: int, layers: int, what: str, timings: dict, copies: int,
             rel_diff: float) -> dict:
    """A row of the GEMV table: per call (one replay of ``copies`` calls, per implementation) the
    median and quartiles, and the bandwidth reached (bf16 weight bytes / time)."""
    missing = [name for name in IMPLS if name not in timings]
    if missing or copies < 1:
        raise ValueError(f"need a timing for each of {IMPLS} and copies >= 1; missing {missing}, "
                         f"copies={copies}")
    nbytes = n * k * 2
    row = {"shape": f"[{n}, {k}]", "what": what, "layers": layers, "MB": nbytes / 1e6,
           "rel_diff": rel_diff}
    for name in IMPLS:
        tm = timings[name]
        row[f"{name} us"] = us = tm.us / copies
        row[f"{name} q1 us"], row[f"{name} q3 us"] = tm.q1 * 1e6 / copies, tm.q3 * 1e6 / copies
        row[f"{name} GB/s"] = nbytes / us / 1e3
    return row


def gemv_result(rows: list, size: str, repeats: int, l2_bytes: int) -> Result:
    """The ``real_model_gemv`` table; summary: each implementation's microseconds per token for the
    separate projections (each shape's time times the layers that use it)."""
    res = _result("real_model_gemv", f"batch-1 matrix-vector products of the {size} shapes (bf16): "
                  f"one call per distinct copy of the matrix ({L2_FACTOR}x the L2 in copies), "
                  "captured in a CUDA graph, CUDA events, interleaved", GEMV_COLUMNS, rows,
                  size=size, repeats=repeats, l2_bytes=l2_bytes, l2_factor=L2_FACTOR)
    for name in IMPLS:
        per_token = sum(r[f"{name} us"] * r["layers"] for r in rows if "stacked" not in r["what"])
        res.add_summary(f"{name} us per token (separate projections)", per_token, "us")
    return res


# ------------------------ reduce-overhead, fixed
