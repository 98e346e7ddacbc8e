"""Lesson 04's performance experiments (GPU): one decode step, and the whole comparison on a request trace.

- the batch-1 decode step (``graph_cache_step``) and the FAQ's experiments stand in lesson 04's cells
  (:mod:`course.core.cells`); their parts are in :mod:`~course.lessons.graph_cache.step` and
  :mod:`~course.lessons.graph_cache.faq`.
- :func:`trace_experiment`: the same decoder on a trace of a few hundred decode steps with varying
  batch sizes: eager, exact-shape cache, each bucket preset, fusion, reduce-overhead (default and
  ``dynamic=False``): step latency p50/p99, recordings, time to make the first 8 sizes fast, memory
  held, padding waste, graph launches per steady step; all in one run. It stays here, not in a cell: each
  variant runs in a fresh process (:func:`trace_variant`), which imports its code from this module.

Launches are counted by :func:`course.core.profiling.launch_counts`, compiles reset by
:func:`course.core.compiled.reset_compile`, memory released by :func:`course.core.hardware.release_memory`.
"""
from __future__ import annotations

import statistics
import time

from course.core.capture import require_gpu
from course.core.compiled import torch_log_messages
from course.core.hardware import release_memory
import course.core.isolate as isolate
from course.core.profiling import launch_counts
from course.core.reference import experiment
from course.core.results import Result
from course.core.text import condense
from course.lessons.graph_cache.buckets import bucket_sizes, decode_trace
from course.lessons.graph_cache.cache import GraphCache
from course.lessons.graph_cache.decoder import DecoderConfig, TinyDecoder


def say(msg: str) -> None:
    """Print a progress line now (flushed), so a long live run shows which variant runs and what it does."""
    print(msg, flush=True)


def _close(a, b, atol: float = 2e-3) -> bool:
    import torch

    return bool(torch.allclose(a.float(), b.float(), atol=atol, rtol=1e-3))


def _trace_args(model, trace):
    """Device arguments for every step of ``trace`` (made before any timing)."""
    import torch

    g = torch.Generator().manual_seed(0)
    out = []
    for i, b in enumerate(trace):
        ids = torch.randint(0, model.cfg.vocab, (b,), generator=g).to(model.tok.device)
        pos = torch.full((b,), i % model.cfg.max_seq, dtype=torch.long, device=ids.device)
        out.append((ids, pos, torch.arange(b, device=ids.device)))
    return out


def _variants(model, presets, max_batch, compile_variants):
    """(label, kind, builder) for every way of running the trace; builder() -> callable."""
    import torch

    pad = model.pad_values()
    out = [("eager", "eager", lambda: model.step),
           ("cache, exact shapes", "cache", lambda: GraphCache(model.step, pad_value=pad))]
    for p in presets:
        out.append((f"cache, {p} buckets", "cache",
                    lambda p=p: GraphCache(model.step, buckets=bucket_sizes(p, max_batch), pad_value=pad)))
    if compile_variants:
        first = presets[0]
        out += [(f"cache, {first} buckets, fusion", "cache",
                 lambda: GraphCache(model.step, buckets=bucket_sizes(first, max_batch), pad_value=pad, fusion=True)),
                ("reduce-overhead", "compile", lambda: torch.compile(model, mode="reduce-overhead")),
                ("reduce-overhead, dynamic=False", "compile",
                 lambda: torch.compile(model, mode="reduce-overhead", dynamic=False))]
    return out


def time_to_fast(trace, cold, steady, sizes, factor: float = 1.5) -> float:
    """Seconds the cold pass spent on each of ``sizes`` until its first fast step (<= factor x its steady median).

    A size's calls are summed in order up to and including the first one that is fast: a capture or a compile,
    then any warm-up or recording calls, then the first replay. Sizes never fast in the cold pass count in full.
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
    import torch
    import torch._inductor.config as inductor_config

    release_memory()
    before = torch.cuda.memory_reserved()
    with torch.no_grad(), inductor_config.patch(fx_graph_cache=False), \
            torch_log_messages(recompiles=True, cudagraphs=True, perf_hints=True) as msgs:
        fn = build()
        passes = []
        for _ in range(2):  # pass 1, cold: records / compiles as new shapes arrive; pass 2: steady state
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
    release_memory()  # cached free blocks released: what stays reserved is held by the graphs (and compiled code) alive
    held = torch.cuda.memory_reserved() - before
    cold, steady = passes
    stats = fn.get_stats() if kind == "cache" else {}
    flags = ("recompile_limit", "cache_size_limit", "distinct input size", "skipping cudagraphs")
    notes = list(dict.fromkeys(condense(m, 1, 200) for m in msgs if any(f in m for f in flags)))
    return {"variant": label, "p50_us": _percentile(steady, 0.5) * 1e6, "p99_us": _percentile(steady, 0.99) * 1e6,
            "mean_us": statistics.fmean(steady) * 1e6,
            "recordings": stats.get("recordings", sum("Recording function" in m for m in msgs)),
            "first_8_sizes_s": time_to_fast(trace, cold, steady, list(dict.fromkeys(trace))[:8]),
            "cold_pass_s": sum(cold), "steady_pass_s": sum(steady), "memory_MB": held / 2**20,
            "padding_waste": stats.get("padding_waste", 0.0),
            "eager_calls": stats.get("eager_calls", len(trace) if kind == "eager" else 0),
            "graph_launches_last5": launches["graph_launches"], "note": " | ".join(notes[:2])}


def trace_variant(label: str, steps: int, max_batch: int, presets, compile_variants: bool, layers: int,
                  seed: int) -> dict:
    """One row of :func:`trace_experiment`, meant for a fresh process: the process is warmed up first (CUDA, cuBLAS,
    one eager step), so the row's setup times and memory are the variant's own."""
    import torch

    trace = decode_trace(steps, max_batch, seed=seed)
    model = TinyDecoder(DecoderConfig(layers=layers, slots=max_batch))
    all_args = _trace_args(model, trace)
    with torch.no_grad():
        model.step(*all_args[0])
    torch.cuda.synchronize()
    found = {lab: (kind, build) for lab, kind, build in _variants(model, list(presets), max_batch, compile_variants)}
    if label not in found:
        raise KeyError(f"no trace variant {label!r}; known: {sorted(found)}")
    kind, build = found[label]
    return _trace_row(label, kind, build, trace, all_args)


def _percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


@experiment("graph_cache_trace", gpu_only=True,
            quick={"steps": 24, "presets": ("vllm",), "compile_variants": False})
def trace_experiment(steps: int = 300, max_batch: int = 64, presets=("vllm", "sglang", "trtllm", "pow2"),
                     compile_variants: bool = True, layers: int = 2, seed: int = 0) -> Result:
    """Every way of running the tiny decoder on one decode trace, same run: latency, recordings, setup, memory."""
    require_gpu("the graph-cache trace benchmark")
    import torch

    trace = decode_trace(steps, max_batch, seed=seed)
    model = TinyDecoder(DecoderConfig(layers=layers, slots=max_batch))
    labels = [(label, kind) for label, kind, _ in _variants(model, list(presets), max_batch, compile_variants)]
    del model
    rows = []
    for i, (label, kind) in enumerate(labels, 1):
        heavy = kind == "compile" or label.endswith("fusion")
        say(f"graph_cache_trace [{i}/{len(labels)}] {label}: a fresh process (start-up, "
            + ("compiles, " if heavy else "") + f"a cold and a steady pass over {steps} steps) ...")
        t0 = time.perf_counter()
        try:  # each variant in a fresh process: no compile cache, memory pool or warm allocator carried over
            rows.append(isolate.run_isolated("course.lessons.graph_cache.experiments", "trace_variant", label=label,
                                             steps=steps, max_batch=max_batch, presets=list(presets),
                                             compile_variants=compile_variants, layers=layers, seed=seed))
        except Exception as e:  # noqa: BLE001 - a torch.compile variant that breaks is a finding, not a lost run
            if kind != "compile" and not label.endswith("fusion"):
                raise
            nan = float("nan")
            rows.append({"variant": label, "p50_us": nan, "p99_us": nan, "mean_us": nan, "recordings": 0,
                         "first_8_sizes_s": nan, "cold_pass_s": nan, "steady_pass_s": nan, "memory_MB": nan,
                         "padding_waste": nan, "eager_calls": 0, "graph_launches_last5": nan,
                         "note": f"FAILED: {type(e).__name__}: {condense((str(e).splitlines() or [''])[-1], 1, 200)}"})
        say(f"graph_cache_trace [{i}/{len(labels)}] {label}: done in {time.perf_counter() - t0:.1f} s")
    res = Result("graph_cache_trace", f"Tiny decoder on a decode trace of {steps} steps (batch 1..{max(trace)}, "
                 f"{len(set(trace))} distinct sizes): every way of running it, same run; step latency is "
                 "host-synchronized per step in the second (steady) pass; each variant in its own process",
                 {"variant": "", "p50_us": "us", "p99_us": "us", "mean_us": "us", "recordings": "count",
                  "first_8_sizes_s": "s", "cold_pass_s": "s", "steady_pass_s": "s", "memory_MB": "MiB",
                  "padding_waste": "fraction", "eager_calls": "count", "graph_launches_last5": "count", "note": ""},
                 rows,
                 params={"steps": steps, "max_batch": max_batch, "presets": list(presets), "layers": layers,
                         "seed": seed, "compile_variants": compile_variants, "torch": torch.__version__,
                         "trace": trace})
    by = {r["variant"]: r for r in rows}
    res.add_summary("eager p50 / exact-cache p50", by["eager"]["p50_us"] / by["cache, exact shapes"]["p50_us"], "x")
    if compile_variants:
        ro = by["reduce-overhead"]
        fused = by[f"cache, {presets[0]} buckets, fusion"]
        res.add_summary("fusion cache mean / reduce-overhead mean", fused["mean_us"] / ro["mean_us"], "x")
        res.add_summary(f"{presets[0]} cache (graph_replay) mean / reduce-overhead mean",
                        by[f"cache, {presets[0]} buckets"]["mean_us"] / ro["mean_us"], "x")
        res.add_summary("first 8 sizes: exact cache / reduce-overhead",
                        by["cache, exact shapes"]["first_8_sizes_s"] / ro["first_8_sizes_s"], "x")
    return res
