"""The FAQ of InfiniLM's fused inference engine, answered by experiment (GPU), plus the CPU-live trace replay.

The three GPU experiments' code stands in lesson 04's cells (:mod:`course.core.cells`); this module keeps their
bookkeeping:

- ``graph_cache_memory``: memory per graph, one shared pool vs a pool per graph, largest-first vs smallest-first
  capture, and what ``clear_cache()`` gives back (the FAQ's Q3, "memory grows"); :func:`memory_result`.
- ``graph_cache_fallback``: a hazard in the forward (a host bounds check) makes every key fall back; the stats say
  so and why (Q1, "fusion_fallbacks is high"); :func:`fallback_row`, :func:`fallback_result`.
- ``graph_cache_seed_timing``: the FAQ's Q4 recipe (``time.time()`` around 100 calls right after
  ``clear_cache()``, no synchronize) against a correct measurement; :func:`recipe_result`, and
  :func:`recipe_rows` and :func:`recipe_speedup` read its result.
- :func:`replay_trace`: run a cache over a decode trace and return its stats (Q2, "every call misses", live on
  any machine); :data:`BIG`: the larger decoder the memory and timing experiments use.
"""
from __future__ import annotations

from course.core.results import Result


def replay_trace(cache, model, trace) -> dict:
    """Call ``cache`` once per step of ``trace`` (batch sizes) with the model's example arguments; its stats."""
    for i, b in enumerate(trace):
        cache(*model.example_args(b, i % model.cfg.max_seq))
    return cache.get_stats()


BIG = dict(vocab=32000, dim=512, heads=8, kv_heads=4, ffn=1408, layers=2, max_seq=128, slots=64)


def memory_result(rows: list, freed: dict, max_batch: int, preset: str, n_sizes: int) -> Result:
    """The ``graph_cache_memory`` table from the cell's captures: one row per graph captured, and per way of
    capturing (``freed[(pools, order)] = (bytes held, bytes clear_cache() freed)``) two summary lines."""
    import torch

    res = Result("graph_cache_memory", f"Memory the CUDA graphs reserve, {n_sizes} {preset} sizes up to "
                 f"{max_batch} (decoder vocab {BIG['vocab']}, dim {BIG['dim']})",
                 {"pools": "", "order": "", "graph": "count", "size": "count", "memory_MB": "MiB",
                  "cumulative_MB": "MiB", "capture_ms": "ms"}, rows,
                 params={"max_batch": max_batch, "preset": preset, "decoder": BIG, "torch": torch.__version__})
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
            "fusion_successes": stats["fusion_successes"], "fusion_fallbacks": stats["fusion_fallbacks"],
            "eager_calls": stats["eager_calls"], "step_us": timing.us, "reason": reasons[0] if reasons else ""}


def fallback_result(rows: list, steps: int, repeats: int, trace) -> Result:
    """The ``graph_cache_fallback`` table from the cell's rows (:func:`fallback_row`)."""
    import torch

    return Result("graph_cache_fallback", "A host read in the forward (embedding bounds='host'): what the cache's "
                  f"stats say over {steps} decode steps, and a batch-4 step's time (CUDA events)",
                  {"embedding_bounds": "", "fusion": "", "cache_size": "count", "cache_hits": "count",
                   "cache_misses": "count", "recordings": "count", "fusion_attempts": "count",
                   "fusion_successes": "count", "fusion_fallbacks": "count", "eager_calls": "count",
                   "step_us": "us", "reason": ""}, rows,
                  params={"steps": steps, "repeats": repeats, "trace": list(trace), "torch": torch.__version__})


def recipe_result(rows: list, calls: int, batch: int, repeats: int) -> Result:
    """The ``graph_cache_seed_timing`` table from the cell's measurements, eager first, then replay.

    ``rows``: ``{"mode", "recipe_s", "pending_s", "warm_s", "correct": Timing of one call}`` per mode; the correct
    time of ``calls`` calls is the median (and quartiles) of one call times ``calls``.
    """
    import torch

    out = [{"mode": r["mode"], "recipe_ms": r["recipe_s"] * 1e3, "gpu_still_busy_ms": r["pending_s"] * 1e3,
            "recipe_warm_ms": r["warm_s"] * 1e3, "correct_ms": r["correct"].median * calls * 1e3,
            "correct_q1_ms": r["correct"].q1 * calls * 1e3, "correct_q3_ms": r["correct"].q3 * calls * 1e3}
           for r in rows]
    res = Result("graph_cache_seed_timing", f"{calls} decode steps at batch {batch}: the timing recipe of InfiniLM's "
                 "FAQ (time.time(), no synchronize, first call records) vs CUDA events after warm-up",
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
    """The rows of a ``graph_cache_seed_timing`` result with the recipe's columns named ``recipe_ms`` and
    ``recipe_warm_ms``, whichever names the recording used."""
    return [{_OLD_NAMES.get(k, k): v for k, v in r.items()} for r in res.rows]


def recipe_speedup(res: Result) -> tuple:
    """``(speedup by the FAQ's recipe, speedup measured correctly)`` of a ``graph_cache_seed_timing`` result."""
    summary = {_OLD_NAMES.get(k, k): v["value"] for k, v in res.summary.items()}
    return summary[RECIPE_SPEEDUP], summary["speedup, measured correctly"]
