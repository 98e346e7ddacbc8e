"""The FAQ of InfiniLM's fused inference engine, answered by experiment (GPU), plus the CPU-live trace replay.

- :func:`memory_experiment`: memory per graph, one shared pool vs a pool per graph, largest-first vs
  smallest-first capture, and what ``clear_cache()`` gives back (the FAQ's Q3, "memory grows").
- :func:`fallback_experiment`: a hazard in the forward (a host bounds check) makes every key fall back;
  the stats say so and why (Q1, "fusion_fallbacks is high").
- :func:`recipe_timing_experiment`: the FAQ's Q4 recipe (``time.time()`` around 100 calls right after
  ``clear_cache()``, no synchronize) against a correct measurement; :func:`recipe_rows` and
  :func:`recipe_speedup` read its result.
- :func:`replay_trace`: run a cache over a decode trace and return its stats (Q2, "every call misses", live on
  any machine).
"""
from __future__ import annotations

import time

from course.core.capture import require_gpu
from course.core.compiled import reset_compile
from course.core.hardware import release_memory
from course.core.reference import experiment
from course.core.results import Result
from course.core.timing import time_device
from course.lessons.graph_cache.backends import CudaGraphBackend
from course.lessons.graph_cache.buckets import bucket_sizes, decode_trace
from course.lessons.graph_cache.cache import GraphCache
from course.lessons.graph_cache.decoder import DecoderConfig, TinyDecoder


def replay_trace(cache, model, trace) -> dict:
    """Call ``cache`` once per step of ``trace`` (batch sizes) with the model's example arguments; its stats."""
    for i, b in enumerate(trace):
        cache(*model.example_args(b, i % model.cfg.max_seq))
    return cache.get_stats()


BIG = dict(vocab=32000, dim=512, heads=8, kv_heads=4, ffn=1408, layers=2, max_seq=128, slots=64)


@experiment("graph_cache_memory", gpu_only=True, quick={"max_batch": 8})
def memory_experiment(max_batch: int = 64, preset: str = "vllm") -> Result:
    """Graph memory per captured size: shared pool vs separate pools, largest-first vs smallest-first."""
    require_gpu("measuring CUDA graph memory")
    import torch

    sizes = bucket_sizes(preset, max_batch)
    model = TinyDecoder(DecoderConfig(**{**BIG, "slots": max_batch}))
    rows, freed = [], {}
    for pools in ("shared", "separate"):
        for order in ("largest_first", "smallest_first"):
            release_memory()
            cache = GraphCache(model.step, buckets=sizes, pad_value=model.pad_values(), backend=CudaGraphBackend(pools))
            total = 0
            for i, d in enumerate(cache.warmup(sizes, model.example_args, order=order)):
                total += d["memory_bytes"]
                rows.append({"pools": pools, "order": order, "graph": i + 1, "size": d["size"],
                             "memory_MB": d["memory_bytes"] / 2**20, "cumulative_MB": total / 2**20,
                             "capture_ms": d["capture_ms"]})
            out = cache.clear_cache()
            freed[(pools, order)] = (total, out["freed_bytes"])
            del cache
    res = Result("graph_cache_memory", f"Memory the CUDA graphs reserve, {len(sizes)} {preset} sizes up to "
                 f"{max_batch} (decoder vocab {BIG['vocab']}, dim {BIG['dim']})",
                 {"pools": "", "order": "", "graph": "count", "size": "count", "memory_MB": "MiB",
                  "cumulative_MB": "MiB", "capture_ms": "ms"}, rows,
                 params={"max_batch": max_batch, "preset": preset, "decoder": BIG, "torch": torch.__version__})
    for (pools, order), (total, gone) in freed.items():
        res.add_summary(f"{pools} pool(s), {order}: held", total / 2**20, "MiB")
        res.add_summary(f"{pools} pool(s), {order}: freed by clear_cache()", gone / 2**20, "MiB")
    return res


@experiment("graph_cache_fallback", gpu_only=True, quick={"steps": 6, "repeats": 3})
def fallback_experiment(steps: int = 40, repeats: int = 10) -> Result:
    """The FAQ's Q1 on a GPU: a forward with a host read falls back on every key; stats, reason and step time."""
    require_gpu("capturing the decoder")
    import torch

    trace = decode_trace(steps, 16, seed=1)
    rows = []
    for bounds in ("device", "host"):
        for fusion in (False, True):
            reset_compile()
            model = TinyDecoder(DecoderConfig(slots=16), bounds=bounds)
            cache = GraphCache(model.step, buckets=bucket_sizes("vllm", 16), pad_value=model.pad_values(),
                               fusion=fusion)
            with torch.no_grad():
                s = replay_trace(cache, model, trace)
                args = model.example_args(4, 3)
                t = time_device(lambda: cache(*args), warmup=2, repeats=repeats, inner=5)
            reasons = sorted(set(s["fallback_reasons"].values()))
            rows.append({"embedding_bounds": bounds, "fusion": fusion, "cache_size": s["cache_size"],
                         "cache_hits": s["cache_hits"], "cache_misses": s["cache_misses"],
                         "recordings": s["recordings"], "fusion_attempts": s["fusion_attempts"],
                         "fusion_successes": s["fusion_successes"], "fusion_fallbacks": s["fusion_fallbacks"],
                         "eager_calls": s["eager_calls"], "step_us": t.us, "reason": reasons[0] if reasons else ""})
            del cache, model
            release_memory()
    reset_compile()
    res = Result("graph_cache_fallback", "A host read in the forward (embedding bounds='host'): what the cache's "
                 f"stats say over {steps} decode steps, and a batch-4 step's time (CUDA events)",
                 {"embedding_bounds": "", "fusion": "", "cache_size": "count", "cache_hits": "count",
                  "cache_misses": "count", "recordings": "count", "fusion_attempts": "count",
                  "fusion_successes": "count", "fusion_fallbacks": "count", "eager_calls": "count",
                  "step_us": "us", "reason": ""}, rows,
                 params={"steps": steps, "repeats": repeats, "trace": trace, "torch": torch.__version__})
    return res


@experiment("graph_cache_seed_timing", gpu_only=True, quick={"calls": 10, "repeats": 3})
def recipe_timing_experiment(calls: int = 100, batch: int = 64, repeats: int = 15) -> Result:
    """The FAQ's Q4 recipe (time.time() around ``calls`` calls after clear_cache(), no sync) vs a correct timing."""
    require_gpu("timing the decoder")
    import torch

    model = TinyDecoder(DecoderConfig(**{**BIG, "slots": batch}))
    args = model.example_args(batch, 3)
    cache = GraphCache(model.step, pad_value=model.pad_values())
    rows = []
    with torch.no_grad():
        for label, enabled in (("cache disabled (eager)", False), ("cache enabled (replay)", True)):
            cache.set_enabled(enabled)
            cache.clear_cache()
            torch.cuda.synchronize()
            start = time.time()  # the FAQ's recipe, as written
            for _ in range(calls):
                cache(*args)
            recipe_s = time.time() - start
            t0 = time.perf_counter()
            torch.cuda.synchronize()
            pending_s = time.perf_counter() - t0
            start = time.time()  # the recipe again, now warm (no recording inside)
            for _ in range(calls):
                cache(*args)
            warm_s = time.time() - start
            torch.cuda.synchronize()
            t = time_device(lambda: cache(*args), warmup=3, repeats=repeats, inner=10)
            rows.append({"mode": label, "recipe_ms": recipe_s * 1e3, "gpu_still_busy_ms": pending_s * 1e3,
                         "recipe_warm_ms": warm_s * 1e3, "correct_ms": t.median * calls * 1e3,
                         "correct_q1_ms": t.q1 * calls * 1e3, "correct_q3_ms": t.q3 * calls * 1e3})
    cache.clear_cache()
    res = Result("graph_cache_seed_timing", f"{calls} decode steps at batch {batch}: the timing recipe of InfiniLM's "
                 "FAQ (time.time(), no synchronize, first call records) vs CUDA events after warm-up",
                 {"mode": "", "recipe_ms": "ms", "gpu_still_busy_ms": "ms", "recipe_warm_ms": "ms",
                  "correct_ms": "ms", "correct_q1_ms": "ms", "correct_q3_ms": "ms"}, rows,
                 params={"calls": calls, "batch": batch, "repeats": repeats, "decoder": BIG,
                         "torch": torch.__version__})
    eager, replay = rows
    res.add_summary(RECIPE_SPEEDUP, eager["recipe_ms"] / replay["recipe_ms"], "x")
    res.add_summary("speedup, measured correctly", eager["correct_ms"] / replay["correct_ms"], "x")
    return res


RECIPE_SPEEDUP = "speedup by the FAQ's recipe"
# the names a recording made before these were renamed carries: read it all the same
_OLD_NAMES = {"seed_method_ms": "recipe_ms", "seed_method_warm_ms": "recipe_warm_ms",
              "speedup by the seed's method": RECIPE_SPEEDUP}


def recipe_rows(res: Result) -> list:
    """The rows of a ``graph_cache_seed_timing`` result with the recipe's columns named ``recipe_ms`` and
    ``recipe_warm_ms``, whichever names the recording used."""
    return [{_OLD_NAMES.get(k, k): v for k, v in r.items()} for r in res.rows]


def recipe_speedup(res: Result) -> tuple:
    """``(speedup by the FAQ's recipe, speedup measured correctly)`` of a ``graph_cache_seed_timing`` result."""
    summary = {_OLD_NAMES.get(k, k): v["value"] for k, v in res.summary.items()}
    return summary[RECIPE_SPEEDUP], summary["speedup, measured correctly"]
