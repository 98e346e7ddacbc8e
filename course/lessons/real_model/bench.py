"""Lesson 06's recordings: the bookkeeping behind its experiment cells (``course bench`` runs them).

The cells (``real_model_decode``, ``real_model_gemv``, ``real_model_batch_sweep``, ``matmul_rate``,
``real_model_reduce_overhead``, ``trained_model_decode``) build, time and check; here are the
variants, their first calls (a failure is a row that says why), the kernel counts and the tables.
"""
from __future__ import annotations

import functools
import statistics
import time

import torch
from torch._dynamo.utils import counters

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
from course.lessons.real_model.model import bytes_per_token, size_of
from course.lessons.real_model.projections import gemv_model
from course.lessons.real_model.reduce_fixed import (ReduceOverheadStep, describe_sources,
                                                    static_input_report)
from course.lessons.real_model.roofline import split

NAN = float("nan")
FAST = "fused + GEMV"  # compiled, stacked projections, the Numba GEMV at batch 1: the fastest
TRITON = "Triton, fused per layer (07)"  # lesson 07's step: five Triton kernels per layer
HAND = "hand-captured loop"
GENERATE = "transformers generate (eager)"
RO, RO_GEMV, RO_HAND = "reduce-overhead, fixed", "reduce-overhead + GEMV, fixed", "captured by hand"
TARGET = 1.2  # the goal for the fixed reduce-overhead path: within this factor of fused + GEMV
_LOG_KEYS = ("skipping cudagraph", "overwritten", "recompiling", "graph break")


def _columns(*groups) -> dict:
    """Column -> unit, from ``(unit, "name name ...")`` groups, in order."""
    return {name: unit for unit, names in groups for name in names.split()}


TIMES = _columns(("us", "us q1_us q3_us"))
DECODE_COLUMNS = _columns(("", "variant status mode"), ("us", "us q1_us q3_us"),
                          ("count", "kernels_per_token"), ("s", "first_call_s"),
                          ("", "tokens_equal"), ("fraction", "max_logit_diff"), ("", "correct log"))
TRAINED_COLUMNS = {k: u for k, u in DECODE_COLUMNS.items() if k not in ("correct", "log")}
REDUCE_COLUMNS = _columns(("", "variant status"), ("us", "us q1_us q3_us"), ("x", "vs_fused_gemv"),
                          ("count", "graphs_per_token host_launches_per_token kernels_per_token"),
                          ("s", "first_call_s"), ("count", "cudagraph_skips"),
                          ("", "non_static tokens_equal"), ("fraction", "max_logit_diff"),
                          ("", "correct log"))


def _reason(e: BaseException) -> str:
    return f"FAILED: {type(e).__name__}: {clip(condense(str(e), 1), 200)}"  # paths cut by condense


def _transformers_version() -> str:
    return package_version("transformers") or "not installed"


def _result(name: str, title: str, columns: dict, rows: list, **params) -> Result:
    return Result(name, title, columns, rows, params={**params, "torch": torch.__version__,
                                                      "transformers": _transformers_version()})


def _times(tm) -> dict:
    if tm is None:
        return dict.fromkeys(TIMES, NAN)
    return {"us": tm.us, "q1_us": tm.q1 * 1e6, "q3_us": tm.q3 * 1e6}


def first_call(fn, args) -> tuple:
    """(seconds, output) of the first call of ``fn(*args)`` (no grad), host clock, the GPU
    synchronized before and after."""
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
def hopper() -> bool:
    """True on a Hopper or later GPU, where lesson 07's Triton step launches with PDL."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def variants(model, max_len: int, autotune: bool = False, hand: bool = False,
             compiled: bool = True, triton=None) -> dict:
    """``{name: build()}`` of the batch-1 decode variants: eager, graph-cached, (the hand-captured
    loop,) and with ``compiled`` fused, fused + GEMV, lesson 07's step (``triton``, the cell's
    builder) and with ``autotune`` max-autotune."""
    twin = functools.cache(lambda: gemv_model(model, fuse=True))  # the stacked weights, on demand

    def tuned():
        d = StaticDecoder(model, max_len)
        return graph_cached(d, fused=torch.compile(d.step, mode="max-autotune-no-cudagraphs"))

    out = {"eager": lambda: StaticDecoder(model, max_len).step,
           "graph-cached": lambda: graph_cached(StaticDecoder(model, max_len))}
    if hand:
        out[HAND] = lambda: GraphedDecode(StaticDecoder(model, max_len)).step
    if compiled:
        out["fused"] = lambda: graph_cached(StaticDecoder(model, max_len), fusion=True)
        out[FAST] = lambda: graph_cached(StaticDecoder(twin(), max_len), fusion=True)
        out.update({TRITON: triton} if triton is not None else {})
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
    """``{name: GPU kernels per call}`` of each step (profiler); one it fails on is left out."""
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
    if not fast:
        return None
    if first is None:
        gen = torch.Generator().manual_seed(1)
        first = torch.randint(3, model.config.vocab_size, (1,), generator=gen).to(model.device)
    return check_variants(fast, StaticDecoder(model, max_len).step, first, n_tokens, model.dtype)


def _checked(check) -> dict:
    return {r["variant"]: r for r in check.rows} if check is not None else {}


def decode_result(model, rows: dict, timings: dict, kernels: dict, check, hf_rows: dict,
                  bandwidth_GBps: float, floor: float, **params) -> Result:
    """The ``real_model_decode`` table: a row per variant, then transformers' recipes (``hf_rows``:
    recipe -> :func:`~.hf_path.hf_compiled_row`); the floor and the ratios."""
    out = []
    for name, row in rows.items():
        c, eager = _checked(check).get(name, {}), name == "eager"
        out.append({**row, "kernels_per_token": kernels.get(name, NAN), **_times(timings.get(name)),
                    "tokens_equal": c.get("tokens_equal", eager),
                    "max_logit_diff": c.get("max_logit_diff", 0.0 if eager else NAN),
                    "correct": c.get("ok", eager), "log": ""})
    for recipe, hf in hf_rows.items():
        out.append({**{k: hf[k] for k in ("variant", "status", "first_call_s", *TIMES, "log")},
                    "mode": f"transformers recipe {recipe!r}", "kernels_per_token": NAN,
                    "tokens_equal": hf["tokens_equal"], "max_logit_diff": NAN,
                    "correct": "n/a (tokens only)"})
    s = size_of(model)
    res = _result("real_model_decode", f"LlamaForCausalLM, {s.name} shape ({s.layers} layers, "
                  f"hidden {s.hidden}, {s.dtype}), random weights, batch 1 at position "
                  f"{params['position']}: time per token (CUDA events, interleaved)",
                  DECODE_COLUMNS, out, **params)
    res.add_summary("copy_bandwidth_GBps", bandwidth_GBps, "GB/s")
    res.add_summary("bytes_per_token", bytes_per_token(model, 1, params["position"]), "B")
    res.add_summary("floor_us", floor, "us")
    t = timings
    for name, key in (("fused", "fused"), (FAST, "fused_gemv")):
        if "eager" in t and name in t:
            ratio = speedup("eager", t["eager"], name, t[name])
            res.add_summary(f"{key}_vs_floor", t[name].us / floor, "x")
            res.add_summary(f"eager_vs_{key}", ratio.ratio, "x")
            res.add_summary(f"eager vs {name}", str(ratio), "")
    for a, b in (("fused", FAST), ("eager", "graph-cached")):
        if a in t and b in t:
            res.add_summary(f"{a} vs {b}", str(speedup(a, t[a], b, t[b])), "")
    if all(k in t for k in ("eager", "graph-cached", "fused")):
        parts = split(t["eager"].us, t["graph-cached"].us, t["fused"].us, floor)["eager"]
        for part, us in parts.items():
            res.add_summary(f"split: {part}", us, "us")
    return res


def ro_variants(model, max_len: int) -> dict:
    """``{name: build()}``: fused + GEMV, the fixed reduce-overhead step on the model and on its
    twin, the hand capture."""
    twin = functools.cache(lambda: gemv_model(model, fuse=True))
    return {FAST: lambda: graph_cached(StaticDecoder(twin(), max_len), fusion=True),
            RO: lambda: ReduceOverheadStep(model, max_len).step,
            RO_GEMV: lambda: ReduceOverheadStep(twin(), max_len).step,
            RO_HAND: lambda: GraphedDecode(StaticDecoder(model, max_len)).step}


def build_logged(name: str, build, args, log=print) -> tuple:
    """``(step or None, row)``: one variant built and called three times (warm-up, recording, first
    replay), torch's log kept meanwhile (skips, recompiles, graph breaks, inputs not static)."""
    tag = f"real_model_reduce_overhead: {name}"
    skips = counters["inductor"]["cudagraph_skips"]
    row = {"variant": name, "status": "ok", "first_call_s": NAN, "non_static": "", "log": ""}
    fn = None
    with torch_log_messages(cudagraphs=True, perf_hints=True, recompiles=True, graph_breaks=True,
                            cudagraph_static_inputs=True) as msgs:
        try:
            log(f"{tag}: building, first call (compile, capture) ...")
            fn = build()
            row["first_call_s"], _ = first_call(fn, args)
            with torch.no_grad():
                for _ in range(2):
                    fn(*args)
            torch.cuda.synchronize()
            stats = fn.get_stats() if hasattr(fn, "get_stats") else {"fallback_reasons": {}}
            reasons = sorted(set(stats["fallback_reasons"].values()))
            row["status"] = f"fell back: {clip(condense(reasons[0], 1), 200)}" if reasons else "ok"
            log(f"{tag}: first call {row['first_call_s']:.1f} s")
        except Exception as e:  # noqa: BLE001 - a variant that breaks is a finding, not a lost run
            row["status"] = f"FAILED: {type(e).__name__}: {clip(condense(str(e), 2), 300)}"
            log(f"{tag}: {clip(row['status'], 160)}")
            fn = None
    graphs = static_input_report(msgs)
    row["non_static"] = describe_sources(graphs[-1]["non_static"]) if graphs else "(no graph)"
    row["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"] - skips
    lines = [clip(condense(m, 1), 200) for m in msgs if any(k in str(m).lower() for k in _LOG_KEYS)]
    row["log"] = clip(" | ".join(dict.fromkeys(lines)), 600)
    return fn, row


def launches(steps: dict, args, rows: dict) -> None:
    """Add each step's CUDA graph launches, host kernel launches and GPU kernels per token
    (profiler) to its row."""
    for name, fn in steps.items():
        with torch.no_grad():
            try:
                counts = launch_counts(lambda fn=fn: fn(*args))
                kernels = launch_counts(lambda fn=fn: fn(*args), calls=3)["gpu_kernels"]
                rows[name].update(graphs_per_token=counts["graph_launches"],
                                  host_launches_per_token=counts["kernel_launches"],
                                  kernels_per_token=kernels)
            except Exception:  # noqa: BLE001 - the counts are a bonus, never a lost row
                pass


def reduce_result(model, rows: dict, timings: dict, check, **params) -> Result:
    """The ``real_model_reduce_overhead`` table: a row per variant against fused + GEMV; the best
    fixed path and whether it is within :data:`TARGET`."""
    t, out = timings, []
    for name, row in rows.items():
        tm, c = t.get(name), _checked(check).get(name, {})
        counts = ("graphs_per_token", "host_launches_per_token", "kernels_per_token")
        out.append({"variant": name, "status": row["status"], **_times(tm),
                    "vs_fused_gemv": tm.us / t[FAST].us if tm and FAST in t else NAN,
                    **{k: row.get(k, NAN) for k in counts},
                    **{k: row[k] for k in ("first_call_s", "cudagraph_skips", "non_static")},
                    "tokens_equal": c.get("tokens_equal", False),
                    "max_logit_diff": c.get("max_logit_diff", NAN), "correct": c.get("ok", False),
                    "log": row["log"]})
    s = size_of(model)
    res = _result("real_model_reduce_overhead", f"LlamaForCausalLM, {s.name} shape ({s.layers} "
                  f"layers, hidden {s.hidden}, {s.dtype}), random weights, batch 1 at position "
                  f"{params['position']}: torch.compile(mode='reduce-overhead') fixed, against "
                  "fused + GEMV (CUDA events, interleaved)", REDUCE_COLUMNS, out, **params,
                  target=TARGET)
    if FAST not in t:
        return res
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
        res.add_summary(f"within {TARGET}x of fused + GEMV", "yes" if ratio <= TARGET else "no", "")
    return res


# ------------------------ the trained model
def generate_us(model, prompt_len: int, repeats: int, n_short: int = 8, n_long: int = 40) -> list:
    """transformers' eager greedy ``generate`` (dynamic cache), microseconds per token, one value
    per repeat (a long minus a short one: the prefill cancels)."""
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, model.config.vocab_size, (1, prompt_len), generator=gen)
    return time_per_token(model, prompt.to(model.device), n_short, n_long, repeats)


def trained_result(trained, rows: dict, timings: dict, gen_us: list, kernels: dict, check,
                   floor: float, bandwidth_GBps: float, **params) -> Result:
    """The ``trained_model_decode`` table: a row per variant (generate, the steps, the floor)."""
    c = trained.model.config
    out = []
    if gen_us:
        qs = statistics.quantiles(gen_us, n=4) if len(gen_us) >= 4 else (min(gen_us), max(gen_us))
        out.append({"variant": GENERATE, "status": "ok", "mode": "dynamic cache",
                    "first_call_s": NAN, "us": statistics.median(gen_us), "q1_us": qs[0],
                    "q3_us": qs[-1], "kernels_per_token": NAN, "tokens_equal": "n/a",
                    "max_logit_diff": NAN})
    for name, row in rows.items():
        ck, eager = _checked(check).get(name, {}), name == "eager"
        out.append({**row, **_times(timings.get(name)), "kernels_per_token": kernels.get(name, NAN),
                    "tokens_equal": ck.get("tokens_equal", eager),
                    "max_logit_diff": ck.get("max_logit_diff", 0.0 if eager else NAN)})
    out.append({"variant": "floor", "status": "computed", "mode": "", "first_call_s": 0.0,
                **dict.fromkeys(TIMES, floor), "kernels_per_token": NAN, "tokens_equal": "n/a",
                "max_logit_diff": NAN})
    dtype = str(trained.model.dtype).replace("torch.", "")
    res = _result("trained_model_decode", f"{trained.name} ({type(trained.model).__name__}, "
                  f"{c.num_hidden_layers} layers, hidden {c.hidden_size}, {dtype}), trained "
                  f"weights, batch 1 at position {params.get('position')}: time per token (CUDA "
                  "events)",
                  TRAINED_COLUMNS, out, **params, model=trained.name)
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
