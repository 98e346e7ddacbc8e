"""Lesson 04's decode-step experiment (GPU): a batch-1 decode step, every way of running it, in ONE measurement.

One method per quantity, so that two cells never show two numbers for the same step:

- ``us``, ``q1_us``, ``q3_us`` (the table) and every summary ratio (:func:`step_ratios`) come from **one**
  interleaved measurement of all the variants that built (:func:`course.core.timing.time_interleaved`: CUDA
  events around 10 back-to-back steps per repeat, the variants taking turns in a rotated order). Before, the
  table timed each variant on its own right after building it and the ratios came from a second, interleaved
  measurement of fewer variants later in the run: the same eager step then read 2180 us in the table and
  3562 us in the ratios on an H100.
- ``first_3_calls_s``: host clock around the first 3 calls of a freshly built variant (compile, record, first
  replays); each compiled variant is built after ``torch._dynamo.reset()`` with inductor's graph cache off, so it
  starts cold (before, "torch.compile default" read the graph that "fusion" had just compiled: 0.3 s vs 5.7 s).
- ``graph_launches``, ``kernel_launches``: a profiler trace of steady-state calls, taken **after** all timing: a
  ``torch.profiler`` session with CUDA activities can leave CUPTI attached to the process (Kineto tears it down
  only when told to), and CUPTI's callbacks then slow every later launch; before, the profiler ran between one
  variant's timing and the next one's.

:func:`~course.lessons.graph_cache.experiments.say` prints what runs now (which variant, compile or measure), so a learner sees progress.
"""
from __future__ import annotations

import time

from course.core.capture import require_gpu
from course.core.compiled import reset_compile, torch_log_messages
from course.core.hardware import release_memory
from course.core.profiling import launch_counts
from course.core.reference import experiment
from course.core.results import Result
from course.core.text import clip, condense, tidy
from course.core.timing import Timing, speedup, time_interleaved
from course.lessons.graph_cache.cache import GraphCache
from course.lessons.graph_cache.decoder import DecoderConfig, TinyDecoder
from course.lessons.graph_cache.experiments import _close, say

# (row label, short name used in the ratios, kind): kind "compile" variants live in torch.compile's caches,
# which torch._dynamo.reset() empties; "eager" and "cache" variants survive a reset (a captured graph's replays
# never enter torch.compile again).
VARIANTS = (
    ("eager", "eager", "eager"),
    ("cache: graph_replay (eager kernels captured)", "cache graph_replay", "cache"),
    ("cache: fusion (compiled kernels captured)", "cache fusion", "cache"),
    ("torch.compile default (no graphs)", "torch.compile default", "compile"),
    ("reduce-overhead, KV cache as module buffers", "reduce-overhead (buffers)", "compile"),
    ("reduce-overhead, KV cache passed in", "reduce-overhead (passed in)", "compile"),
)
SHORT = {label: short for label, short, _ in VARIANTS}
PAIRS = (("eager", "cache graph_replay"), ("eager", "cache fusion"),
         ("cache fusion", "reduce-overhead (buffers)"), ("cache graph_replay", "reduce-overhead (buffers)"))
METHOD = ("one interleaved measurement of every variant (CUDA events, 10 back-to-back steps per repeat, variants "
          "taking turns); the table and every ratio come from it; profiler counts taken after all timing")


def _builders(model, compile_variants: bool) -> dict:
    import torch

    out = {"eager": lambda: model.step,
           "cache: graph_replay (eager kernels captured)": lambda: GraphCache(model.step)}
    if compile_variants:
        out.update({
            "cache: fusion (compiled kernels captured)": lambda: GraphCache(model.step, fusion=True),
            "torch.compile default (no graphs)": lambda: torch.compile(model.step),
            "reduce-overhead, KV cache as module buffers": lambda: torch.compile(model, mode="reduce-overhead"),
            "reduce-overhead, KV cache passed in": lambda: torch.compile(
                lambda i, p, s, k, v: model.step(i, p, s, k, v), mode="reduce-overhead"),
        })
    return out


def _first_calls(build, call_args, want):
    """Build one way of running the step and call it 3 times (compile / record / first replays): (fn, facts)."""
    import torch

    import torch._inductor.config as inductor_config

    # fx_graph_cache off: torch._dynamo.reset() does not empty inductor's graph cache, so without this the second
    # variant compiling the same step (torch.compile default after fusion) would read a warm cache, not compile
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
    return fn, {"first_3_calls_s": first_s, "matches_eager": ok, "skip_reason": skips[0] if skips else ""}


def _failed(e: Exception) -> dict:
    return {"first_3_calls_s": float("nan"), "matches_eager": False,
            "skip_reason": f"FAILED: {type(e).__name__}: {condense(str(e), 1, 200)}"}


def step_rows(order, facts: dict, timings: dict, launches: dict) -> list:
    """The table's rows, in ``order``: times from ``timings`` (one interleaved measurement), the rest from ``facts``
    and ``launches``; a variant missing from ``timings`` (it failed) gets NaN times."""
    nan = float("nan")
    rows = []
    for label in order:
        t = timings.get(label)
        n = launches.get(label, {})
        rows.append({"variant": label, "us": t.us if t else nan, "q1_us": t.q1 * 1e6 if t else nan,
                     "q3_us": t.q3 * 1e6 if t else nan, "first_3_calls_s": facts[label]["first_3_calls_s"],
                     "graph_launches": n.get("graph_launches", nan), "kernel_launches": n.get("kernel_launches", nan),
                     "matches_eager": facts[label]["matches_eager"], "skip_reason": facts[label]["skip_reason"]})
    return rows


def step_ratios(rows, pairs=PAIRS) -> dict:
    """``{"slow / fast": (ratio, "slow A us (IQR ..) vs fast B us (IQR ..): Nx or noise")}`` from the table's rows.

    ``pairs`` name variants by their short names (:data:`SHORT`); the ratio is the two rows' medians, so a ratio
    and the table it sits under can never disagree. Pairs whose rows are missing or not timed are left out.
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


@experiment("graph_cache_step", gpu_only=True, quick={"repeats": 5, "compile_variants": False})
def step_experiment(batch: int = 1, repeats: int = 25, compile_variants: bool = True, layers: int = 2) -> Result:
    """One decode step of the tiny decoder, each way of running it: time per step (one interleaved measurement)
    and whether graphs were really replayed."""
    require_gpu("timing the decode step")
    import torch

    reset_compile()
    model = TinyDecoder(DecoderConfig(layers=layers))
    args = model.example_args(batch, 5)
    want = model.step(*args)
    kc, vc = model.k_cache.clone(), model.v_cache.clone()
    builders = _builders(model, compile_variants)
    call = {label: ((*args, kc, vc) if label.endswith("passed in") else args) for label in builders}
    kinds = {label: kind for label, _, kind in VARIANTS}
    facts, live = {}, {}
    for i, (label, build) in enumerate(builders.items(), 1):  # 1. cold: first calls, correctness, skip reasons
        doing = ("compiling (cold) + first 3 calls" if kinds[label] == "compile" or "fusion" in label
                 else "capture + first 3 calls" if kinds[label] == "cache" else "first 3 calls")
        say(f"graph_cache_step [{i}/{len(builders)}] {label}: {doing}")
        reset_compile()
        try:
            fn, facts[label] = _first_calls(build, call[label], want)
        except Exception as e:  # noqa: BLE001 - a torch.compile variant that breaks is a finding, not a lost run
            if kinds[label] == "eager" or label.startswith("cache: graph_replay"):
                raise
            facts[label] = _failed(e)
            continue
        if kinds[label] != "compile":
            live[label] = fn  # survives the resets below
        del fn
        release_memory()
    reset_compile()  # 2. the compiled variants once more, side by side (a reset would drop the earlier ones)
    with torch.no_grad():
        for label in [lab for lab in builders if kinds[lab] == "compile" and lab in facts
                      and not facts[lab]["skip_reason"].startswith("FAILED")]:
            say(f"graph_cache_step: {label}: compiling again to time it beside the others")
            try:
                fn = builders[label]()
                for _ in range(3):
                    fn(*call[label])
                live[label] = fn
            except Exception as e:  # noqa: BLE001 - the row says so
                facts[label] = _failed(e)
        say(f"graph_cache_step: timing {len(live)} variants interleaved ({repeats} repeats x 10 steps each)")
        fns = {label: (lambda fn=fn, a=call[label]: fn(*a)) for label, fn in live.items()}
        timings = time_interleaved(fns, clock="device", warmup=3, repeats=repeats, inner=10)
        say("graph_cache_step: counting graph and kernel launches per step (profiler, after all timing)")
        launches = {label: launch_counts(f, calls=5) for label, f in fns.items()}  # 3. profiler last
    rows = step_rows(list(builders), facts, timings, launches)
    del live, fns
    release_memory()
    reset_compile()
    res = Result("graph_cache_step", f"Tiny decoder, one decode step at batch {batch}: time per step ({METHOD}) and "
                 "API calls per step in a profiler trace",
                 {"variant": "", "us": "us", "q1_us": "us", "q3_us": "us", "first_3_calls_s": "s",
                  "graph_launches": "per step", "kernel_launches": "per step", "matches_eager": "",
                  "skip_reason": ""}, rows,
                 params={"batch": batch, "repeats": repeats, "layers": layers, "torch": torch.__version__,
                         "timing": METHOD})
    for key, (ratio, text) in step_ratios(rows).items():
        res.add_summary(key, ratio, "x")
        res.add_summary(key.replace(" / ", " vs "), text, "")
    return res


OLD_METHOD = ("recorded before the one-measurement method: each row timed on its own right after it was built, "
              "with a profiler session between one row and the next; the ratios printed here are computed from "
              "these rows")


def step_lines(res) -> str:
    """The step table as sentences: each row's median and IQR, its ratio to eager from the same rows, graph launches,
    then how the times were measured and where they come from (the result's caption)."""
    by = {r["variant"]: r for r in res.rows}
    eager = by.get("eager")
    lines = []
    for r in res.rows:
        vs = (f"{eager['us'] / r['us']:5.1f}x eager" if eager and r["us"] > 0 else "  (not timed)")
        lines.append(f"{r['variant']:46s} {r['us']:8.1f} us (IQR {r['q1_us']:.1f}-{r['q3_us']:.1f})  {vs}   "
                     f"graph launches/step {r['graph_launches']:.0f}")
    for r in res.rows:
        if r["skip_reason"]:
            lines.append(f"{r['variant']}: torch logged '{clip(tidy(r['skip_reason']), 150)}'")
    lines.append(f"how: {res.params.get('timing', OLD_METHOD)}")
    lines.append(f"[{res.name}] {res.caption()}")
    return "\n".join(lines)
