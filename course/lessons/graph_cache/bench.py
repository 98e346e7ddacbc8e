"""Lesson 04's recordings: the tables its experiment cells make (course/reference/*.json), and the
experiments' parts: the FAQ's (memory per pool, fallbacks, a timing recipe against a correct one),
the batch-1 step's variants (``graph_cache_step``: every variant timed in ONE interleaved
measurement, the profiler last), and the trace (``graph_cache_trace``: each variant in a fresh
process, which imports :func:`trace_variant` from here, so it stays out of the cells).
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
from course.core.text import clip, condense, tidy
from course.core.timing import Timing, speedup
from course.lessons.graph_cache.buckets import bucket_sizes, decode_trace
from course.lessons.graph_cache.cache import GraphCache
from course.lessons.graph_cache.decoder import DecoderConfig, TinyDecoder


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


# (row label, short name used in the ratios, kind): "compile" variants live in torch.compile's
# caches, which torch._dynamo.reset() empties; "eager" and "cache" variants survive a reset (a
# captured graph's replays never enter torch.compile again).
VARIANTS = (
    ("eager", "eager", "eager"),
    ("cache: graph_replay (eager kernels captured)", "cache graph_replay", "cache"),
    ("cache: fusion (compiled kernels captured)", "cache fusion", "cache"),
    ("torch.compile default (no graphs)", "torch.compile default", "compile"),
    ("reduce-overhead, KV cache as module buffers", "reduce-overhead (buffers)", "compile"),
    ("reduce-overhead, KV cache passed in", "reduce-overhead (passed in)", "compile"),
)
SHORT = {label: short for label, short, _ in VARIANTS}
KIND = {label: kind for label, _, kind in VARIANTS}
PAIRS = (("eager", "cache graph_replay"), ("eager", "cache fusion"),
         ("cache fusion", "reduce-overhead (buffers)"),
         ("cache graph_replay", "reduce-overhead (buffers)"))
METHOD = ("one interleaved measurement of every variant (CUDA events, 10 back-to-back steps per "
          "repeat, variants taking turns); the table and every ratio come from it; profiler counts "
          "taken after all timing")


def step_builders(model, compile_variants: bool) -> dict:
    """``{label: build}``, in :data:`VARIANTS` order: ``build()`` makes one way of running
    ``model``'s decode step (eager and the cache's ``graph_replay`` always; the cache's ``fusion``
    and the torch.compile ones with ``compile_variants``). The "KV cache passed in" variant takes
    the KV cache as two more arguments."""
    labels = [label for label, _, _ in VARIANTS]
    builds = [lambda: model.step, lambda: GraphCache(model.step),
              lambda: GraphCache(model.step, fusion=True), lambda: torch.compile(model.step),
              lambda: torch.compile(model, mode="reduce-overhead"),
              lambda: torch.compile(lambda i, p, s, k, v: model.step(i, p, s, k, v),
                                    mode="reduce-overhead")]
    return dict(list(zip(labels, builds))[:None if compile_variants else 2])


def _first_calls(build, call_args, want):
    """Build one way of running the step and call it 3 times (compile / record / first replays):
    (fn, facts)."""
    import torch._inductor.config as inductor_config  # here: importing inductor takes seconds

    # fx_graph_cache off: torch._dynamo.reset() does not empty inductor's graph cache, so without
    # this the second variant compiling the same step (torch.compile default after fusion) would
    # read a warm cache, not compile
    with torch.no_grad(), inductor_config.patch(fx_graph_cache=False), \
            torch_log_messages(perf_hints=True, cudagraphs=True) as msgs:
        fn = build()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            out = fn(*call_args)
        torch.cuda.synchronize()
        first_s = time.perf_counter() - t0
        ok = _close(out, want)
    skips = [condense(m, 1, 200) for m in msgs if "skipping cudagraphs" in m]
    return fn, {"first_3_calls_s": first_s, "matches_eager": ok,
                "skip_reason": skips[0] if skips else ""}


def _failed(e: Exception) -> dict:
    return {"first_3_calls_s": float("nan"), "matches_eager": False,
            "skip_reason": f"FAILED: {type(e).__name__}: {condense(str(e), 1, 200)}"}


def cold_calls(label: str, build, call_args, want, progress: str = "") -> tuple:
    """``(fn, facts)``: build the variant ``label`` cold and time its first 3 calls (host clock:
    compile or capture, then the first replays); ``facts`` has ``first_3_calls_s``,
    ``matches_eager`` (against ``want``) and ``skip_reason`` (torch's "skipping cudagraphs" line, if
    any).

    A torch.compile or fusion variant that raises is a finding, not a lost run: ``fn`` is ``None``
    and the reason says ``FAILED: ...``. Eager or the cache replaying eager kernels raising is a
    bug: it propagates.
    """
    kind = KIND[label]
    doing = ("compiling (cold) + first 3 calls" if kind == "compile" or "fusion" in label
             else "capture + first 3 calls" if kind == "cache" else "first 3 calls")
    say(f"graph_cache_step {progress} {label}: {doing}".replace("  ", " "))
    try:
        return _first_calls(build, call_args, want)
    except Exception as e:  # noqa: BLE001 - a compile variant that breaks is a finding
        if kind == "eager" or label.startswith("cache: graph_replay"):
            raise
        return None, _failed(e)


def compiled_again(builders: dict, call: dict, facts: dict) -> dict:
    """``{label: fn}``: every torch.compile variant that built in the cold pass, compiled once more
    and called 3 times, so that they all live side by side for the interleaved timing (a reset
    between them would drop the earlier ones). A variant that fails now gets a ``FAILED`` row in
    ``facts`` and is left out."""
    live = {}
    with torch.no_grad():
        for label in [lab for lab in builders if KIND[lab] == "compile" and lab in facts
                      and not facts[lab]["skip_reason"].startswith("FAILED")]:
            say(f"graph_cache_step: {label}: compiling again to time it beside the others")
            try:
                fn = builders[label]()
                for _ in range(3):
                    fn(*call[label])
                live[label] = fn
            except Exception as e:  # noqa: BLE001 - the row says so
                facts[label] = _failed(e)
    return live


def step_rows(order, facts: dict, timings: dict, launches: dict) -> list:
    """The table's rows, in ``order``: times from ``timings`` (one interleaved measurement), the
    rest from ``facts`` and ``launches``; a variant missing from ``timings`` (it failed) gets NaN
    times."""
    nan = float("nan")
    rows = []
    for label in order:
        t = timings.get(label)
        n = launches.get(label, {})
        rows.append({"variant": label, "us": t.us if t else nan, "q1_us": t.q1 * 1e6 if t else nan,
                     "q3_us": t.q3 * 1e6 if t else nan,
                     "first_3_calls_s": facts[label]["first_3_calls_s"],
                     "graph_launches": n.get("graph_launches", nan),
                     "kernel_launches": n.get("kernel_launches", nan),
                     "matches_eager": facts[label]["matches_eager"],
                     "skip_reason": facts[label]["skip_reason"]})
    return rows


def step_ratios(rows, pairs=PAIRS) -> dict:
    """``{"slow / fast": (ratio, "slow A us (IQR ..) vs fast B us (IQR ..): Nx or noise")}`` from
    the table's rows.

    ``pairs`` name variants by their short names (:data:`SHORT`); the ratio is the two rows'
    medians, so a ratio and the table it sits under can never disagree. Pairs whose rows are missing
    or not timed are left out.
    """
    by = {SHORT.get(r["variant"], r["variant"]): r for r in rows}
    out = {}
    for slow, fast in pairs:
        a, b = by.get(slow), by.get(fast)
        if not a or not b or not (a["us"] > 0 and b["us"] > 0):  # NaN: a variant that failed
            continue
        ta, tb = (Timing(r["us"] * 1e-6, r["q1_us"] * 1e-6, r["q3_us"] * 1e-6, r["q1_us"] * 1e-6,
                         r["q3_us"] * 1e-6, 0, 10, "cuda-events") for r in (a, b))
        sp = speedup(slow, ta, fast, tb)
        out[f"{slow} / {fast}"] = (sp.ratio, str(sp))
    return out


def step_result(order, facts: dict, timings: dict, launches: dict, batch: int, repeats: int,
                layers: int) -> Result:
    """The ``graph_cache_step`` table (:func:`step_rows`, in ``order``) and its summary ratios
    (:func:`step_ratios`, from the table's own rows: the ratios and the table can never
    disagree)."""
    rows = step_rows(order, facts, timings, launches)
    res = Result("graph_cache_step",
                 f"Tiny decoder, one decode step at batch {batch}: time per step ({METHOD}) and "
                 "API calls per step in a profiler trace",
                 {"variant": "", "us": "us", "q1_us": "us", "q3_us": "us", "first_3_calls_s": "s",
                  "graph_launches": "per step", "kernel_launches": "per step", "matches_eager": "",
                  "skip_reason": ""}, rows,
                 params={"batch": batch, "repeats": repeats, "layers": layers,
                         "torch": torch.__version__, "timing": METHOD})
    for key, (ratio, text) in step_ratios(rows).items():
        res.add_summary(key, ratio, "x")
        res.add_summary(key.replace(" / ", " vs "), text, "")
    return res


OLD_METHOD = ("recorded before the one-measurement method: each row timed on its own right after "
              "it was built, with a profiler session between one row and the next; the ratios "
              "printed here are computed from these rows")


def step_lines(res) -> str:
    """The step table as sentences: each row's median and IQR, its ratio to eager from the same
    rows, graph launches, then how the times were measured and where they come from (the result's
    caption)."""
    by = {r["variant"]: r for r in res.rows}
    eager = by.get("eager")
    lines = []
    for r in res.rows:
        vs = (f"{eager['us'] / r['us']:5.1f}x eager" if eager and r["us"] > 0 else "  (not timed)")
        lines.append(f"{r['variant']:46s} {r['us']:8.1f} us (IQR "
                     f"{r['q1_us']:.1f}-{r['q3_us']:.1f})  {vs}   graph launches/step "
                     f"{r['graph_launches']:.0f}")
    for r in res.rows:
        if r["skip_reason"]:
            lines.append(f"{r['variant']}: torch logged '{clip(tidy(r['skip_reason']), 150)}'")
    lines.append(f"how: {res.params.get('timing', OLD_METHOD)}")
    lines.append(f"[{res.name}] {res.caption()}")
    return "\n".join(lines)


def say(msg: str) -> None:
    """Print a progress line now (flushed), so a long live run shows which variant runs and what it
    does."""
    print(msg, flush=True)


def _close(a, b, atol: float = 2e-3) -> bool:
    return bool(torch.allclose(a.float(), b.float(), atol=atol, rtol=1e-3))


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
