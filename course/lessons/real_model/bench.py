"""Lesson 06's recordings: the bookkeeping behind its experiment cells (``course bench`` records
those cells).

``real_model_decode``, ``real_model_gemv``, ``real_model_batch_sweep``, ``matmul_rate``,
``real_model_reduce_overhead`` and ``trained_model_decode`` stand in lesson 06's cells
(:mod:`course.core.cells`): there the variants are built, timed interleaved and checked. Here: the
variants, their first calls (a failure is a row that says why), the kernel counts, and the tables
(the JSON of ``course/reference/`` keeps its format).
"""
from __future__ import annotations

import functools
import statistics
import time

import torch
from torch._dynamo.utils import counters

from course.core.capture import graph, warm_up
from course.core.compiled import torch_log_messages
from course.core.profiling import launch_counts
from course.core.provenance import package_version
from course.core.results import Result
from course.core.text import clip, condense
from course.core.timing import speedup
from course.lessons.real_model.decode import StaticDecoder, graph_cached
from course.lessons.real_model.generate import check_variants
from course.lessons.real_model.handgraph import GraphedDecode
from course.lessons.real_model.hf_path import time_per_token
from course.lessons.real_model.model import _size, bytes_per_token, size_of
from course.lessons.real_model.projections import gemv_model
from course.lessons.real_model.reduce_fixed import (ReduceOverheadStep, describe_sources,
                                                    static_input_report)
from course.lessons.real_model.roofline import floor_us, split, tokens_per_s

NAN = float("nan")
# the fastest variant: compiled, stacked projections, the Numba GEMV at batch 1
FAST = "fused + GEMV"
# lesson 07's step: five Triton kernels per layer, PDL, one sequence
TRITON = "Triton, fused per layer (07)"
HAND = "hand-captured loop"
GENERATE = "transformers generate (eager)"
BATCH1_ONLY = {TRITON: "n/a: lesson 07's Triton step decodes one sequence (its kernels are "
                       "matrix-vector products)"}
COMPILED = ("fused", FAST)  # the sweep's compiled variants: they run only at its fused_batches
RO, RO_GEMV, RO_HAND = "reduce-overhead, fixed", "reduce-overhead + GEMV, fixed", "captured by hand"
TARGET = 1.2  # the goal for the fixed reduce-overhead path: within this factor of fused + GEMV
L2_FACTOR = 4  # the GEMV's copies of each matrix fill this many times the L2 cache
IMPLS = ("cuBLAS", "Numba GEMV")  # the implementations the GEMV table compares, in its column order
_LOG_KEYS = ("skipping cudagraph", "overwritten", "recompiling", "graph break")


def _reason(e: BaseException) -> str:
    # machine paths cut by condense
    return f"FAILED: {type(e).__name__}: {clip(condense(str(e), 1), 200)}"


def _transformers_version() -> str:
    return package_version("transformers") or "not installed"


def _times(tm) -> dict:
    return {"us": tm.us if tm else NAN, "q1_us": tm.q1 * 1e6 if tm else NAN,
            "q3_us": tm.q3 * 1e6 if tm else NAN}


def first_call(fn, args) -> tuple:
    """(seconds, output) of the first call of ``fn(*args)`` (no grad), host clock, GPU synchronized
    before and after."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = fn(*args)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def _mode(fn) -> str:
    stats = fn.get_stats() if hasattr(fn, "get_stats") else None
    if not stats:
        return "eager"
    reasons = "; ".join(condense(r, 1) for r in stats["fallback_reasons"].values())
    modes = ",".join(sorted(set(stats["fusion_modes"].values())))
    return modes + (f" ({clip(reasons, 160)})" if reasons else "")


# ------------------------ the variants of a decode step
def triton_step(model, max_len: int):
    """Lesson 07's step on ``model``, captured by the GraphCache (PDL on Hopper and later GPUs):
    batch 1 only."""
    # lesson 07's room, entered on demand
    from course.lessons.last_mile.decoder import TritonDecoder, captured

    pdl = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
    return captured(TritonDecoder(model, max_len, pdl=pdl))


def variants(model, max_len: int, autotune: bool = False, hand: bool = False,
             compiled: bool = True) -> dict:
    """``{name: build()}`` of the batch-1 decode variants: eager, graph-cached, (the hand-captured
    loop,) and with ``compiled`` fused, fused + GEMV and lesson 07's Triton step (``autotune``: also
    max-autotune)."""
    # the stacked weights, only when a variant runs
    twin = functools.cache(lambda: gemv_model(model, fuse=True))

    def fast():
        return graph_cached(StaticDecoder(twin(), max_len), fusion=True)

    def tuned():
        d = StaticDecoder(model, max_len)
        return graph_cached(d, fused=torch.compile(d.step, mode="max-autotune-no-cudagraphs"))

    out = {"eager": lambda: StaticDecoder(model, max_len).step,
           "graph-cached": lambda: graph_cached(StaticDecoder(model, max_len))}
    if hand:
        out[HAND] = lambda: GraphedDecode(StaticDecoder(model, max_len)).step
    if compiled:
        out.update({"fused": lambda: graph_cached(StaticDecoder(model, max_len), fusion=True),
                    FAST: fast,
                    TRITON: lambda: triton_step(model, max_len)})
    if compiled and autotune:
        out["fused, max-autotune"] = tuned
    return out


def build_steps(builders: dict, args, log=print, tag: str = "real_model_decode") -> tuple:
    """``({name: step}, {name: row})``: each variant built and called once on ``args`` (compile and
    capture), its first call timed; one that raises is a row whose status says why."""
    steps, rows = {}, {}
    for name, build in builders.items():
        log(f"{tag}: {name}: building, first call (compile and capture for the fast ones) ...")
        try:
            fn = build()
            s, _ = first_call(fn, args)
            steps[name] = fn
            rows[name] = {"variant": name, "status": "ok", "mode": _mode(fn), "first_call_s": s}
            log(f"{tag}: {name}: first call {s:.1f} s")
        except Exception as e:  # noqa: BLE001 - a variant that breaks is a finding, not a lost run
            rows[name] = {"variant": name, "status": _reason(e), "mode": "", "first_call_s": NAN}
            log(f"{tag}: {name}: {rows[name]['status']}")
    return steps, rows


def kernel_counts(steps: dict, args) -> dict:
    """``{name: GPU kernels per call}`` of each step on ``args`` (profiler); a step the profiler
    fails on is left out."""
    out = {}
    for name, fn in steps.items():
        try:
            out[name] = launch_counts(lambda fn=fn: fn(*args), calls=3)["gpu_kernels"]
        except Exception:  # noqa: BLE001 - the kernel count is a bonus, never a lost row
            pass
    return out


def check_fast(steps: dict, model, max_len: int, n_tokens: int, first=None):
    """:func:`check_variants` of every step but eager against a fresh eager step (None if none)."""
    fast = {n: fn for n, fn in steps.items() if n != "eager"}
    if first is None:
        gen = torch.Generator().manual_seed(1)
        first = torch.randint(3, model.config.vocab_size, (1,), generator=gen).to(model.device)
    return check_variants(fast, StaticDecoder(model, max_len).step, first, n_tokens,
                          model.dtype) if fast else None


def decode_result(model, rows: dict, timings: dict, kernels: dict, check, hf_rows: dict,
                  bandwidth_GBps: float,
                  floor: float, **params) -> Result:
    """The ``real_model_decode`` table: one row per variant, then transformers' recipes
    (``hf_rows``: recipe ->
    :func:`~course.lessons.real_model.hf_path.hf_compiled_row`); the floor and the ratios."""
    checked = {r["variant"]: r for r in check.rows} if check else {}
    out = []
    for name, row in rows.items():
        c = checked.get(name, {})
        out.append({**row, "kernels_per_token": kernels.get(name, NAN), **_times(timings.get(name)),
                    "tokens_equal": c.get("tokens_equal", name == "eager"),
                    "max_logit_diff": c.get("max_logit_diff", 0.0 if name == "eager" else NAN),
                    "correct": c.get("ok", name == "eager"), "log": ""})
    for recipe, hf in hf_rows.items():
        out.append({"variant": hf["variant"], "status": hf["status"],
                    "mode": f"transformers recipe {recipe!r}",
                    "first_call_s": hf["first_call_s"], "kernels_per_token": NAN, "us": hf["us"],
                    "q1_us": hf["q1_us"], "q3_us": hf["q3_us"], "tokens_equal": hf["tokens_equal"],
                    "max_logit_diff": NAN, "correct": "n/a (tokens only)", "log": hf["log"]})
    s = size_of(model)
    res = Result("real_model_decode",
                 f"LlamaForCausalLM, {s.name} shape ({s.layers} layers, hidden {s.hidden}, "
                 f"{s.dtype}), random weights, batch 1 at position {params['position']}: time per "
                 "token (CUDA events, interleaved)",
                 {"variant": "", "status": "", "mode": "", "us": "us", "q1_us": "us", "q3_us": "us",
                  "kernels_per_token": "count", "first_call_s": "s", "tokens_equal": "",
                  "max_logit_diff": "fraction",
                  "correct": "", "log": ""}, out,
                 params={**params, "torch": torch.__version__,
                         "transformers": _transformers_version()})
    res.add_summary("copy_bandwidth_GBps", bandwidth_GBps, "GB/s")
    res.add_summary("bytes_per_token", bytes_per_token(model, 1, params["position"]), "B")
    res.add_summary("floor_us", floor, "us")
    t = timings
    for name, key in (("fused", "fused"), (FAST, "fused_gemv")):
        if "eager" in t and name in t:
            res.add_summary(f"{key}_vs_floor", t[name].us / floor, "x")
            res.add_summary(f"eager_vs_{key}", speedup("eager", t["eager"], name, t[name]).ratio,
                            "x")
            res.add_summary(f"eager vs {name}", str(speedup("eager", t["eager"], name, t[name])),
                            "")
    for a, b in (("fused", FAST), ("eager", "graph-cached")):
        if a in t and b in t:
            res.add_summary(f"{a} vs {b}", str(speedup(a, t[a], b, t[b])), "")
    if all(k in t for k in ("eager", "graph-cached", "fused")):
        for part, us in split(t["eager"].us, t["graph-cached"].us, t["fused"].us,
                              floor)["eager"].items():
            res.add_summary(f"split: {part}", us, "us")
    return res


# ------------------------ the batch sweep
def sweep_batches(batches) -> list:
    """The sweep's batch sizes, sorted and each once; a clear error for an empty list or a size
    below 1."""
    out = sorted(set(int(b) for b in batches))
    if not out or out[0] < 1:
        raise ValueError(f"batches must be positive ints, got {out}")
    return out


def sweep_variants(model, batches, fused_batches, max_len: int) -> tuple:
    """``(eager decoder, {variant: step})`` of the batch sweep, each variant on a decoder of its
    own: eager, graph-cached (a bucket per batch size), lesson 07's Triton step (batch 1 only) and,
    with ``fused_batches``, the compiled variants (:data:`COMPILED`), each ``torch.compile``-d once
    and captured per batch size."""
    eager_dec, cache_dec, fused_dec = (StaticDecoder(model, max_len) for _ in range(3))
    out = {"eager": eager_dec.step, "graph-cached": graph_cached(cache_dec, buckets=batches)}
    if fused_batches:
        fast_dec = StaticDecoder(gemv_model(model, fuse=True), max_len)
        out["fused"] = graph_cached(fused_dec, buckets=batches, fused=torch.compile(fused_dec.step))
        out[FAST] = graph_cached(fast_dec, buckets=batches, fused=torch.compile(fast_dec.step))
    try:
        out[TRITON] = triton_step(model, max_len)
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
    """One measured row of the sweep: the step's median and IQR, its tokens/s, and "ok" or how the
    cache fell back."""
    status = "ok" if _mode(fn) in ("eager", "fusion", "graph_replay") else f"fell back: {_mode(fn)}"
    return _sweep_row(batch, name, status, timing, first_call_s)


def failed_row(batch: int, name: str, error: BaseException) -> dict:
    """The row of a variant whose first call raised: its status says why, its times are NaN."""
    return _sweep_row(batch, name, _reason(error))


def na_row(batch: int, name: str, reason: str) -> dict:
    """The sweep's row of a variant that does not serve ``batch``: its status says why, its times
    are NaN."""
    return _sweep_row(batch, name, reason)


def floor_row(model, batch: int, position: int, bandwidth_GBps: float) -> dict:
    """The floor's row at ``batch``: what one step must read (weights, embedding rows, KV cache) at
    the bandwidth."""
    fl = floor_us(bytes_per_token(model, batch, position), bandwidth_GBps)
    return {"batch": batch, "variant": "floor", "status": "computed", "us": fl, "q1_us": fl,
            "q3_us": fl,
            "tokens_per_s": tokens_per_s(batch, fl), "first_call_s": 0.0}


def batch_sweep_result(rows: list, model, bandwidth_GBps: float, **params) -> Result:
    """The ``real_model_batch_sweep`` table: its rows, the copy bandwidth and the best tokens/s."""
    s = size_of(model)
    res = Result("real_model_batch_sweep",
                 f"LlamaForCausalLM, {s.name} shape ({s.dtype}), random weights: tokens/s against "
                 f"batch size at position {params.get('position')} (CUDA events, variants "
                 "interleaved per batch)",
                 {"batch": "", "variant": "", "status": "", "us": "us", "q1_us": "us",
                  "q3_us": "us",
                  "tokens_per_s": "tokens/s", "first_call_s": "s"}, rows,
                 params={**params, "torch": torch.__version__,
                         "transformers": _transformers_version()})
    res.add_summary("copy_bandwidth_GBps", bandwidth_GBps, "GB/s")
    best = max((r for r in rows if r["variant"] != "floor"
                and r["tokens_per_s"] == r["tokens_per_s"]),
               key=lambda r: r["tokens_per_s"], default=None)
    if best:
        res.add_summary("best_tokens_per_s", best["tokens_per_s"], "tokens/s")
        res.add_summary("best_at", f"{best['variant']}, batch {best['batch']}", "")
    return res


# ------------------------ the batch-1 GEMV, timed from memory
def shapes_of(size: str = "tinyllama") -> list:
    """``(N, K, layers using it, what)`` for every weight shape a batch-1 decode step of ``size``
    multiplies by: transformers' separate projections, then the stacked ones of the fused-projection
    twin."""
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
    """A CUDA graph of ``fn(x, w)`` for every ``w`` in ``weights``, in order, after a warm-up on the
    first two (GPU): its replay times the kernels without the host's cost per call."""
    warm_up(lambda: [fn(x, w) for w in weights[:2]], iters=2)
    g = torch.cuda.CUDAGraph()
    with graph(g):
        for w in weights:
            fn(x, w)
    return g


def gemv_row(n: int, k: int, layers: int, what: str, timings: dict, copies: int,
             rel_diff: float) -> dict:
    """One row of the GEMV table: ``timings`` maps each of :data:`IMPLS` to the Timing of one replay
    of ``copies`` calls; per call, the median and quartiles, and the bandwidth reached (bf16 weight
    bytes / time)."""
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
    model's separate projections (each shape's time times the layers that use it)."""
    res = Result("real_model_gemv",
                 f"batch-1 matrix-vector products of the {size} shapes (bf16): one call per "
                 f"distinct copy of the matrix ({L2_FACTOR}x the L2 in copies), captured in a CUDA "
                 "graph, CUDA events, interleaved",
                 {"shape": "", "what": "", "layers": "count", "MB": "MB", "cuBLAS us": "us",
                  "cuBLAS q1 us": "us",
                  "cuBLAS q3 us": "us", "cuBLAS GB/s": "GB/s", "Numba GEMV us": "us",
                  "Numba GEMV q1 us": "us",
                  "Numba GEMV q3 us": "us", "Numba GEMV GB/s": "GB/s", "rel_diff": "fraction"},
                 rows,
                 params={"size": size, "repeats": repeats, "l2_bytes": l2_bytes,
                         "l2_factor": L2_FACTOR,
                         "torch": torch.__version__})
    for name in IMPLS:
        per_token = sum(r[f"{name} us"] * r["layers"] for r in rows
                        if not r["what"].startswith("stacked"))
        res.add_summary(f"{name} us per token (separate projections)", per_token, "us")
    return res


# ------------------------ reduce-overhead, fixed
def ro_variants(model, max_len: int) -> dict:
    """``{name: build()}``: fused + GEMV, the fixed reduce-overhead step on the model and on its
    twin, the hand capture."""
    twin = functools.cache(lambda: gemv_model(model, fuse=True))
    return {FAST: lambda: graph_cached(StaticDecoder(twin(), max_len), fusion=True),
            RO: lambda: ReduceOverheadStep(model, max_len).step,
            RO_GEMV: lambda: ReduceOverheadStep(twin(), max_len).step,
            RO_HAND: lambda: GraphedDecode(StaticDecoder(model, max_len)).step}


def build_logged(name: str, build, args, log=print) -> tuple:
    """``(step or None, row)``: one variant built and called three times (reduce-overhead: warm-up,
    recording, first replay), with torch's log meanwhile (skips, recompiles, graph breaks, inputs
    not static)."""
    skips = counters["inductor"]["cudagraph_skips"]
    row = {"variant": name, "status": "ok", "first_call_s": NAN, "non_static": "", "log": ""}
    fn = None
    with torch_log_messages(cudagraphs=True, perf_hints=True, recompiles=True, graph_breaks=True,
                            cudagraph_static_inputs=True) as msgs:
        try:
            log(f"real_model_reduce_overhead: {name}: building, first call (compile, capture) ...")
            fn = build()
            row["first_call_s"], _ = first_call(fn, args)
            with torch.no_grad():
                for _ in range(2):
                    fn(*args)
            torch.cuda.synchronize()
            stats = fn.get_stats() if hasattr(fn, "get_stats") else {"fallback_reasons": {}}
            reasons = sorted(set(stats["fallback_reasons"].values()))
            row["status"] = f"fell back: {clip(condense(reasons[0], 1), 200)}" if reasons else "ok"
            log(f"real_model_reduce_overhead: {name}: first call {row['first_call_s']:.1f} s")
        except Exception as e:  # noqa: BLE001 - a variant that breaks is a finding, not a lost run
            row["status"] = f"FAILED: {type(e).__name__}: {clip(condense(str(e), 2), 300)}"
            log(f"real_model_reduce_overhead: {name}: {clip(row['status'], 160)}")
            fn = None
    graphs = static_input_report(msgs)
    row["non_static"] = describe_sources(graphs[-1]["non_static"]) if graphs else "(no graph)"
    row["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"] - skips
    lines = [clip(condense(m, 1), 200) for m in msgs if any(k in str(m).lower() for k in _LOG_KEYS)]
    row["log"] = clip(" | ".join(dict.fromkeys(lines)), 600)
    return fn, row


def launches(steps: dict, args, rows: dict) -> None:
    """Add CUDA graph launches, host kernel launches and GPU kernels per token (profiler) to each
    step's row."""
    for name, fn in steps.items():
        with torch.no_grad():
            try:
                counts = launch_counts(lambda fn=fn: fn(*args))
                rows[name].update(graphs_per_token=counts["graph_launches"],
                                  host_launches_per_token=counts["kernel_launches"],
                                  kernels_per_token=launch_counts(lambda fn=fn: fn(*args),
                                                                  calls=3)["gpu_kernels"])
            except Exception:  # noqa: BLE001 - the counts are a bonus, never a lost row
                pass


def reduce_result(model, rows: dict, timings: dict, check, **params) -> Result:
    """The ``real_model_reduce_overhead`` table: a row per variant against fused + GEMV; the best
    fixed path."""
    checked = {r["variant"]: r for r in check.rows} if check else {}
    t, out = timings, []
    for name, row in rows.items():
        tm, c = t.get(name), checked.get(name, {})
        out.append({"variant": name, "status": row["status"], **_times(tm),
                    "vs_fused_gemv": tm.us / t[FAST].us if tm and FAST in t else NAN,
                    **{k: row.get(k, NAN) for k in ("graphs_per_token", "host_launches_per_token",
                                                    "kernels_per_token")},
                    "first_call_s": row["first_call_s"], "cudagraph_skips": row["cudagraph_skips"],
                    "non_static": row["non_static"], "tokens_equal": c.get("tokens_equal", False),
                    "max_logit_diff": c.get("max_logit_diff", NAN), "correct": c.get("ok", False),
                    "log": row["log"]})
    s = size_of(model)
    res = Result("real_model_reduce_overhead",
                 f"LlamaForCausalLM, {s.name} shape ({s.layers} layers, hidden {s.hidden}, "
                 f"{s.dtype}), random weights, batch 1 at position {params['position']}: "
                 "torch.compile(mode='reduce-overhead') fixed, against fused + GEMV (CUDA events, "
                 "interleaved)",
                 {"variant": "", "status": "", "us": "us", "q1_us": "us", "q3_us": "us",
                  "vs_fused_gemv": "x",
                  "graphs_per_token": "count", "host_launches_per_token": "count",
                  "kernels_per_token": "count",
                  "first_call_s": "s", "cudagraph_skips": "count", "non_static": "",
                  "tokens_equal": "",
                  "max_logit_diff": "fraction", "correct": "", "log": ""}, out,
                 params={**params, "target": TARGET, "torch": torch.__version__,
                         "transformers": _transformers_version()})
    if FAST in t:
        for name in (RO, RO_GEMV, RO_HAND):
            if name in t:
                res.add_summary(f"{name} / {FAST}", t[name].us / t[FAST].us, "x")
                res.add_summary(f"{name} vs {FAST}", str(speedup(name, t[name], FAST, t[FAST])), "")
        fixed = [n for n in (RO, RO_GEMV) if n in t]
        if fixed:
            best = min(fixed, key=lambda n: t[n].us)
            ratio = t[best].us / t[FAST].us
            res.add_summary("best reduce-overhead", best, "")
            res.add_summary("best reduce-overhead / fused + GEMV", ratio, "x")
            res.add_summary(f"within {TARGET}x of fused + GEMV", "yes" if ratio <= TARGET else "no",
                            "")
    return res


# ------------------------ the trained model
def generate_us(model, prompt_len: int, repeats: int, n_short: int = 8, n_long: int = 40) -> list:
    """transformers' eager greedy ``generate`` (dynamic cache), microseconds per token, one value
    per repeat (a long minus a short one: the prefill cancels)."""
    prompt = torch.randint(3, model.config.vocab_size, (1, prompt_len),
                           generator=torch.Generator().manual_seed(0))
    return time_per_token(model, prompt.to(model.device), n_short, n_long, repeats)


def trained_result(trained, rows: dict, timings: dict, gen_us: list, kernels: dict, check,
                   floor: float,
                   bandwidth_GBps: float, **params) -> Result:
    """The ``trained_model_decode`` table: one row per variant (generate, the steps, the floor), its
    summary."""
    c = trained.model.config
    out = []
    if gen_us:
        qs = statistics.quantiles(gen_us, n=4) if len(gen_us) >= 4 else (min(gen_us), max(gen_us))
        out.append({"variant": GENERATE, "status": "ok", "mode": "dynamic cache",
                    "first_call_s": NAN,
                    "us": statistics.median(gen_us), "q1_us": qs[0], "q3_us": qs[-1],
                    "kernels_per_token": NAN,
                    "tokens_equal": "n/a", "max_logit_diff": NAN})
    checked = {r["variant"]: r for r in check.rows} if check is not None else {}
    for name, row in rows.items():
        ck = checked.get(name, {})
        out.append({**row, **_times(timings.get(name)), "kernels_per_token": kernels.get(name, NAN),
                    "tokens_equal": ck.get("tokens_equal", name == "eager"),
                    "max_logit_diff": ck.get("max_logit_diff", 0.0 if name == "eager" else NAN)})
    out.append({"variant": "floor", "status": "computed", "mode": "", "first_call_s": 0.0,
                "us": floor, "q1_us": floor,
                "q3_us": floor, "kernels_per_token": NAN, "tokens_equal": "n/a",
                "max_logit_diff": NAN})
    res = Result("trained_model_decode",
                 f"{trained.name} ({type(trained.model).__name__}, {c.num_hidden_layers} layers, "
                 f"hidden {c.hidden_size}, {str(trained.model.dtype).replace('torch.', '')}), "
                 f"trained weights, batch 1 at position {params.get('position')}: time per token "
                 "(CUDA events)",
                 {"variant": "", "status": "", "mode": "", "us": "us", "q1_us": "us", "q3_us": "us",
                  "kernels_per_token": "count", "first_call_s": "s", "tokens_equal": "",
                  "max_logit_diff": "fraction"},
                 out, params={**params, "model": trained.name, "torch": torch.__version__,
                              "transformers": _transformers_version()})
    res.add_summary("copy_bandwidth_GBps", bandwidth_GBps, "GB/s")
    res.add_summary("floor_us", floor, "us")
    gen = statistics.median(gen_us) if gen_us else None
    for name in (HAND, "graph-cached", "fused", FAST):
        if gen and name in timings:
            res.add_summary(f"generate / {name}", gen / timings[name].us, "x")
    if "eager" in timings and HAND in timings:
        ratio = speedup("eager", timings["eager"], HAND, timings[HAND])
        res.add_summary("eager vs hand-captured", str(ratio), "")
    return res
