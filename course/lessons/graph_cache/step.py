"""Lesson 04's batch-1 decode step (``graph_cache_step``): its variants (eager, the cache's two
backends, torch.compile's), their first calls, and the table, every variant timed in ONE
interleaved measurement (the profiler last).
"""
from __future__ import annotations

import time

import torch

from course.core.compiled import torch_log_messages
from course.core.results import Result
from course.core.text import clip, condense, tidy
from course.core.timing import Timing, speedup
from course.lessons.graph_cache.cache import GraphCache


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
