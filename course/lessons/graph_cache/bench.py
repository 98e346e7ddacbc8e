"""Lesson 04's recordings: the tables its experiment cells make (course/reference/*.json) and the
experiments' parts: the FAQ's (memory per pool, fallbacks, a timing recipe against a correct one)
and the trace (``graph_cache_trace``: each variant in a fresh process, which imports
:func:`trace_variant` from here, so it stays out of the cells); the decode step's are in
:mod:`.step`.
"""
from __future__ import annotations

import statistics
import time

import torch

from course.core.capture import require_gpu
from course.core.compiled import torch_log_messages
from course.core.hardware import release_memory
from course.core.isolate import run_isolated
from course.core.profiling import launch_counts
from course.core.reference import experiment
from course.core.results import Result
from course.core.text import condense
from course.lessons.graph_cache.buckets import bucket_sizes, decode_trace
from course.lessons.graph_cache.cache import GraphCache
from course.lessons.graph_cache.decoder import DecoderConfig, TinyDecoder
from course.lessons.graph_cache.step import say


def replay_trace(cache, model, trace) -> dict:
    """Call ``cache`` once per step of ``trace`` (batch sizes) with the model's example arguments;
    its stats."""
    for i, b in enumerate(trace):
        cache(*model.example_args(b, i % model.cfg.max_seq))
    return cache.get_stats()


BIG = dict(vocab=32000, dim=512, heads=8, kv_heads=4, ffn=1408, layers=2, max_seq=128, slots=64)


def memory_result(rows: list, freed: dict, max_batch: int, preset: str, n_sizes: int) -> Result:
    """The ``graph_cache_memory`` table from the cell's captures: one row per graph captured, and
    per way of capturing (``freed[(pools, order)] = (bytes held, bytes clear_cache() freed)``) two
    summary lines."""
    res = Result("graph_cache_memory", f"Memory the CUDA graphs reserve, {n_sizes} {preset} sizes "
                 f"up to {max_batch} (decoder vocab {BIG['vocab']}, dim {BIG['dim']})",
                 {"pools": "", "order": "", "graph": "count", "size": "count", "memory_MB": "MiB",
                  "cumulative_MB": "MiB", "capture_ms": "ms"}, rows,
                 params={"max_batch": max_batch, "preset": preset, "decoder": BIG,
                         "torch": torch.__version__})
    for (pools, order), (total, gone) in freed.items():
        res.add_summary(f"{pools} pool(s), {order}: held", total / 2**20, "MiB")
        res.add_summary(f"{pools} pool(s), {order}: freed by clear_cache()", gone / 2**20, "MiB")
    return res


def fallback_row(bounds: str, fusion: bool, stats: dict, timing) -> dict:
    """One row of ``graph_cache_fallback``: the cache's ``get_stats()`` after the trace, the step's
    :class:`~course.core.timing.Timing`, and the first of its fallback reasons (sorted)."""
    reasons = sorted(set(stats["fallback_reasons"].values()))
    return {"embedding_bounds": bounds, "fusion": fusion, "cache_size": stats["cache_size"],
            "cache_hits": stats["cache_hits"], "cache_misses": stats["cache_misses"],
            "recordings": stats["recordings"], "fusion_attempts": stats["fusion_attempts"],
            "fusion_successes": stats["fusion_successes"],
            "fusion_fallbacks": stats["fusion_fallbacks"],
            "eager_calls": stats["eager_calls"], "step_us": timing.us,
            "reason": reasons[0] if reasons else ""}


def fallback_result(rows: list, steps: int, repeats: int, trace) -> Result:
    """The ``graph_cache_fallback`` table from the cell's rows (:func:`fallback_row`)."""
    counts = ("cache_size", "cache_hits", "cache_misses", "recordings", "fusion_attempts",
              "fusion_successes", "fusion_fallbacks", "eager_calls")
    return Result("graph_cache_fallback",
                  "A host read in the forward (embedding bounds='host'): what the cache's stats "
                  f"say over {steps} decode steps, and a batch-4 step's time (CUDA events)",
                  {"embedding_bounds": "", "fusion": "", **{c: "count" for c in counts},
                   "step_us": "us", "reason": ""}, rows,
                  params={"steps": steps, "repeats": repeats, "trace": list(trace),
                          "torch": torch.__version__})


def recipe_result(rows: list, calls: int, batch: int, repeats: int) -> Result:
    """The ``graph_cache_seed_timing`` table from the cell's measurements, eager first, then replay.

    ``rows``: ``{"mode", "recipe_s", "pending_s", "warm_s", "correct": Timing of one call}`` per
    mode; the correct time of ``calls`` calls is the median (and quartiles) of one call times
    ``calls``.
    """
    out = [{"mode": r["mode"], "recipe_ms": r["recipe_s"] * 1e3,
            "gpu_still_busy_ms": r["pending_s"] * 1e3, "recipe_warm_ms": r["warm_s"] * 1e3,
            "correct_ms": r["correct"].median * calls * 1e3,
            "correct_q1_ms": r["correct"].q1 * calls * 1e3,
            "correct_q3_ms": r["correct"].q3 * calls * 1e3} for r in rows]
    res = Result("graph_cache_seed_timing",
                 f"{calls} decode steps at batch {batch}: the timing recipe of InfiniLM's FAQ "
                 "(time.time(), no synchronize, first call records) vs CUDA events after warm-up",
                 {"mode": "", "recipe_ms": "ms", "gpu_still_busy_ms": "ms", "recipe_warm_ms": "ms",
                  "correct_ms": "ms", "correct_q1_ms": "ms", "correct_q3_ms": "ms"}, out,
                 params={"calls": calls, "batch": batch, "repeats": repeats, "decoder": BIG,
                         "torch": torch.__version__})
    eager, replay = out
    res.add_summary(RECIPE_SPEEDUP, eager["recipe_ms"] / replay["recipe_ms"], "x")
    res.add_summary("speedup, measured correctly", eager["correct_ms"] / replay["correct_ms"], "x")
    return res


RECIPE_SPEEDUP = "speedup by the FAQ's recipe"


# the names a recording made before these were renamed carries: read it all the same
_OLD_NAMES = {"seed_method_ms": "recipe_ms", "seed_method_warm_ms": "recipe_warm_ms",
              "speedup by the seed's method": RECIPE_SPEEDUP}


def recipe_rows(res: Result) -> list:
    """The rows of a ``graph_cache_seed_timing`` result with the recipe's columns named
    ``recipe_ms`` and ``recipe_warm_ms``, whichever names the recording used."""
    return [{_OLD_NAMES.get(k, k): v for k, v in r.items()} for r in res.rows]


def recipe_speedup(res: Result) -> tuple:
    """``(speedup by the FAQ's recipe, speedup measured correctly)`` of a
    ``graph_cache_seed_timing`` result."""
    summary = {_OLD_NAMES.get(k, k): v["value"] for k, v in res.summary.items()}
    return summary[RECIPE_SPEEDUP], summary["speedup, measured correctly"]


def _trace_args(model, trace):
    """Device arguments for every step of ``trace`` (made before any timing)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i, b in enumerate(trace):
        ids = torch.randint(0, model.cfg.vocab, (b,), generator=g).to(model.tok.device)
        pos = torch.full((b,), i % model.cfg.max_seq, dtype=torch.long, device=ids.device)
        out.append((ids, pos, torch.arange(b, device=ids.device)))
    return out


def _variants(model, presets, max_batch, compile_variants):
    """(label, kind, builder) for every way of running the trace; builder() -> callable."""
    pad = model.pad_values()
    out = [("eager", "eager", lambda: model.step),
           ("cache, exact shapes", "cache", lambda: GraphCache(model.step, pad_value=pad))]
    for p in presets:
        out.append((f"cache, {p} buckets", "cache",
                    lambda p=p: GraphCache(model.step, buckets=bucket_sizes(p, max_batch),
                                           pad_value=pad)))
    if compile_variants:
        first = presets[0]
        out += [(f"cache, {first} buckets, fusion", "cache",
                 lambda: GraphCache(model.step, buckets=bucket_sizes(first, max_batch),
                                    pad_value=pad, fusion=True)),
                ("reduce-overhead", "compile",
                 lambda: torch.compile(model, mode="reduce-overhead")),
                ("reduce-overhead, dynamic=False", "compile",
                 lambda: torch.compile(model, mode="reduce-overhead", dynamic=False))]
    return out


def time_to_fast(trace, cold, steady, sizes, factor: float = 1.5) -> float:
    """Seconds the cold pass spent on each of ``sizes`` until its first fast step (<= factor x its
    steady median).

    A size's calls are summed in order up to and including the first one that is fast: a capture or
    a compile, then any warm-up or recording calls, then the first replay. Sizes never fast in the
    cold pass count in full.
    """
    total = 0.0
    for size in sizes:
        med = statistics.median(t for b, t in zip(trace, steady) if b == size)
        for b, t in zip(trace, cold):
            if b == size:
                total += t
                if t <= factor * med:
                    break
    return total


def _trace_row(label, kind, build, trace, all_args) -> dict:
    """Run one way of executing the decoder over the trace twice (cold, steady) and measure it."""
    import torch._inductor.config as inductor_config  # here: importing inductor takes seconds

    release_memory()
    before = torch.cuda.memory_reserved()
    with torch.no_grad(), inductor_config.patch(fx_graph_cache=False), \
            torch_log_messages(recompiles=True, cudagraphs=True, perf_hints=True) as msgs:
        fn = build()
        passes = []
        for _ in range(2):  # pass 1, cold: records, compiles as new shapes arrive; pass 2: steady
            times = []
            for a in all_args:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn(*a)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            passes.append(times)
        tail = all_args[-5:]
        launches = launch_counts(lambda: [fn(*a) for a in tail])  # the last 5 steps, once
    release_memory()  # cached free blocks released: what stays is held by the graphs (and code)
    held = torch.cuda.memory_reserved() - before
    cold, steady = passes
    stats = fn.get_stats() if kind == "cache" else {}
    flags = ("recompile_limit", "cache_size_limit", "distinct input size", "skipping cudagraphs")
    notes = list(dict.fromkeys(condense(m, 1, 200) for m in msgs if any(f in m for f in flags)))
    return {"variant": label, "p50_us": _percentile(steady, 0.5) * 1e6,
            "p99_us": _percentile(steady, 0.99) * 1e6,
            "mean_us": statistics.fmean(steady) * 1e6,
            "recordings": stats.get("recordings", sum("Recording function" in m for m in msgs)),
            "first_8_sizes_s": time_to_fast(trace, cold, steady, list(dict.fromkeys(trace))[:8]),
            "cold_pass_s": sum(cold), "steady_pass_s": sum(steady), "memory_MB": held / 2**20,
            "padding_waste": stats.get("padding_waste", 0.0),
            "eager_calls": stats.get("eager_calls", len(trace) if kind == "eager" else 0),
            "graph_launches_last5": launches["graph_launches"], "note": " | ".join(notes[:2])}


def trace_variant(label: str, steps: int, max_batch: int, presets, compile_variants: bool,
                  layers: int, seed: int) -> dict:
    """One row of :func:`trace_experiment`, meant for a fresh process: the process is warmed up
    first (CUDA, cuBLAS, one eager step), so the row's setup times and memory are the variant's
    own."""
    trace = decode_trace(steps, max_batch, seed=seed)
    model = TinyDecoder(DecoderConfig(layers=layers, slots=max_batch))
    all_args = _trace_args(model, trace)
    with torch.no_grad():
        model.step(*all_args[0])
    torch.cuda.synchronize()
    variants = _variants(model, list(presets), max_batch, compile_variants)
    found = {lab: (kind, build) for lab, kind, build in variants}
    if label not in found:
        raise KeyError(f"no trace variant {label!r}; known: {sorted(found)}")
    kind, build = found[label]
    return _trace_row(label, kind, build, trace, all_args)


TRACE_COLUMNS = {"variant": "", "p50_us": "us", "p99_us": "us", "mean_us": "us",
                 "recordings": "count", "first_8_sizes_s": "s", "cold_pass_s": "s",
                 "steady_pass_s": "s", "memory_MB": "MiB", "padding_waste": "fraction",
                 "eager_calls": "count", "graph_launches_last5": "count", "note": ""}


def _percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


@experiment("graph_cache_trace", gpu_only=True,
            quick={"steps": 24, "presets": ("vllm",), "compile_variants": False})
def trace_experiment(steps: int = 300, max_batch: int = 64,
                     presets=("vllm", "sglang", "trtllm", "pow2"),
                     compile_variants: bool = True, layers: int = 2, seed: int = 0) -> Result:
    """Every way of running the tiny decoder on one decode trace, same run: latency, recordings,
    setup, memory."""
    require_gpu("the graph-cache trace benchmark")
    trace = decode_trace(steps, max_batch, seed=seed)
    model = TinyDecoder(DecoderConfig(layers=layers, slots=max_batch))
    variants = _variants(model, list(presets), max_batch, compile_variants)
    labels = [(label, kind) for label, kind, _ in variants]
    del model
    rows = []
    for i, (label, kind) in enumerate(labels, 1):
        heavy = kind == "compile" or label.endswith("fusion")
        say(f"graph_cache_trace [{i}/{len(labels)}] {label}: a fresh process (start-up, "
            + ("compiles, " if heavy else "") + f"a cold and a steady pass over {steps} steps) ...")
        t0 = time.perf_counter()
        try:  # each variant in a fresh process: no compile cache, pool or warm allocator
            rows.append(run_isolated("course.lessons.graph_cache.bench", "trace_variant",
                                     label=label, steps=steps, max_batch=max_batch,
                                     presets=list(presets),
                                     compile_variants=compile_variants, layers=layers, seed=seed))
        except Exception as e:  # noqa: BLE001 - a compile variant that breaks is a finding
            if kind != "compile" and not label.endswith("fusion"):
                raise
            why = condense((str(e).splitlines() or [""])[-1], 1, 200)
            rows.append({**{c: float("nan") for c in TRACE_COLUMNS}, "variant": label,
                         "recordings": 0, "eager_calls": 0,
                         "note": f"FAILED: {type(e).__name__}: {why}"})
        took = time.perf_counter() - t0
        say(f"graph_cache_trace [{i}/{len(labels)}] {label}: done in {took:.1f} s")
    res = Result("graph_cache_trace", f"Tiny decoder on a decode trace of {steps} steps (batch "
                 f"1..{max(trace)}, {len(set(trace))} distinct sizes): every way of running it, "
                 "same run; step latency is host-synchronized per step in the second (steady) "
                 "pass; each variant in its own process", dict(TRACE_COLUMNS), rows,
                 params={"steps": steps, "max_batch": max_batch, "presets": list(presets),
                         "layers": layers, "seed": seed, "compile_variants": compile_variants,
                         "torch": torch.__version__, "trace": trace})
    by = {r["variant"]: r for r in rows}
    res.add_summary("eager p50 / exact-cache p50",
                    by["eager"]["p50_us"] / by["cache, exact shapes"]["p50_us"], "x")
    if compile_variants:
        ro = by["reduce-overhead"]
        fused = by[f"cache, {presets[0]} buckets, fusion"]
        res.add_summary("fusion cache mean / reduce-overhead mean",
                        fused["mean_us"] / ro["mean_us"], "x")
        res.add_summary(f"{presets[0]} cache (graph_replay) mean / reduce-overhead mean",
                        by[f"cache, {presets[0]} buckets"]["mean_us"] / ro["mean_us"], "x")
        res.add_summary("first 8 sizes: exact cache / reduce-overhead",
                        by["cache, exact shapes"]["first_8_sizes_s"] / ro["first_8_sizes_s"], "x")
    return res
