"""Lesson 07's waterfall: transformers' eager step down to the weight-read floor, one change per row, one run.

:func:`waterfall_experiment` ("last_mile_waterfall") builds the TinyLlama-shaped model of lesson 06 and
times, **interleaved in one run** (CUDA events, median and IQR; :func:`~course.core.timing.time_interleaved`),
every step of the way at batch 1 (:data:`STEPS`): transformers' eager step, the same kernels captured
(graph-cached), torch.compile's fused kernels captured (fused), stacked projections with the Numba GEMV
(fused + GEMV), the course's Triton kernels, five per layer, captured (Triton), the same with
programmatic dependent launch (Triton + PDL), and that graph replayed by hand instead of through the
GraphCache (Triton + PDL, plain graph: what the cache's bookkeeping costs per token); then the last mile's
options (:data:`LAST_MILE`, :func:`~course.lessons.last_mile.decoder.config_for`), one more per row: loads of
what no earlier kernel writes moved before the PDL wait, attention reading the past before its wait, down_proj
split over K, the weights packed, attention split over positions; last, the persistent step (one launch per token,
:mod:`~course.lessons.last_mile.persistent`), captured and replayed by hand. Each row also
has its kernels per token (profiler), its first call (compile and capture included; Triton compiles
into an empty cache, so that is its real build time), its correctness against eager (greedy tokens, logits within lesson 06's bfloat16
tolerance) and its ratio to the floor. transformers' own compiled ``generate`` ("HF: auto-compile")
is timed in the same run by its own method (a long minus a short ``generate``; it cannot be interleaved).
The summary also counts the 16-byte loads in the PTX of one compiled Triton kernel, on the model's weights and
on their packed copy.
"""
from __future__ import annotations

import os
import tempfile

from course.core.capture import require_gpu
from course.core.reference import experiment
from course.core.results import Result
from course.core.timing import time_interleaved

NAN = float("nan")
STEPS = (
    ("eager", "transformers' LlamaForCausalLM, eager (lesson 06's StaticDecoder)"),
    ("graph-cached", "the same kernels captured in a CUDA graph (lesson 04's GraphCache)"),
    ("fused", "torch.compile's fused kernels, captured"),
    ("fused + GEMV", "stacked q/k/v and gate/up, the Numba GEMV (lesson 06)"),
    ("Triton", "one Triton kernel per fused group, 5 per layer, captured"),
    ("Triton + PDL", "the same kernels with programmatic dependent launch"),
    ("Triton + PDL, plain graph", "the same graph replayed by hand: inputs copied in, no cache lookup, no output copy"),
    ("+ loads before the wait", "every kernel loads what no earlier kernel writes (position, cos/sin, norm weights) "
                                "before its PDL wait, the residual with the input, x once per norm"),
    ("+ attention ahead", "attention loads the position and the past keys and values before its wait, the new row "
                          "after; the next kernel launched after those loads"),
    ("+ split-K down", "down_proj's columns split over several programs per row block (the last one adds the parts)"),
    ("+ packed weights", "every product's weights repacked: a program's rows one contiguous run of 16-byte groups"),
    ("+ split-KV attention", "attention's positions split into pieces of 256, merged by the last program per head"),
    ("persistent", "one persistent kernel per token: grid barriers between the stages, each stage's first weights "
                   "loaded before the barrier ahead of it, captured"),
)
ADDS = {"+ loads before the wait": "early", "+ attention ahead": "ahead", "+ split-K down": "split_k",
        "+ packed weights": "packed", "+ split-KV attention": "split_kv"}
LAST_MILE = {n: dict.fromkeys(list(ADDS.values())[:i + 1], True) for i, n in enumerate(ADDS)}  # each adds one option
HF = "HF: auto-compile"


def _builders(model, max_len: int, compiled: bool, args) -> dict:
    from course.lessons.last_mile.decoder import TritonDecoder, captured, config_for, graphed
    from course.lessons.real_model.decode import StaticDecoder, graph_cached
    from course.lessons.real_model.projections import gemv_model

    out = {"eager": lambda: StaticDecoder(model, max_len).step,
           "graph-cached": lambda: graph_cached(StaticDecoder(model, max_len))}
    if compiled:
        out["fused"] = lambda: graph_cached(StaticDecoder(model, max_len), fusion=True)
        out["fused + GEMV"] = lambda: graph_cached(StaticDecoder(gemv_model(model, fuse=True), max_len), fusion=True)
    out["Triton"] = lambda: captured(TritonDecoder(model, max_len))
    out["Triton + PDL"] = lambda: captured(TritonDecoder(model, max_len, pdl=True))
    out["Triton + PDL, plain graph"] = lambda: graphed(TritonDecoder(model, max_len, pdl=True), *args)
    for name, opts in LAST_MILE.items():
        out[name] = lambda opts=opts: graphed(TritonDecoder(model, max_len, pdl=True, config=config_for(model, **opts)),
                                              *args)
    from course.lessons.last_mile.persistent_decoder import PersistentDecoder

    out["persistent"] = lambda: graphed(PersistentDecoder(model, max_len), *args)
    return out


def vector_loads(model, packed: bool = False) -> tuple:
    """(16-byte loads, all global loads) in the PTX Triton compiled for the o_proj kernel of ``model`` (GPU),
    on the model's own weights or (``packed``) on their packed copy."""
    import re

    import torch

    from course.lessons.last_mile import kernels as K
    from course.lessons.last_mile.decoder import TritonDecoder, config_for

    d = TritonDecoder(model, 8, config=config_for(model, packed=packed))
    c = d.config.o
    w = d.layers[0][4]
    k = K.proj_residual.warmup(d.attn, w, d.x, d.H, d.NH * d.D, PDL=False, DEPTH=c.depth, BLOCK_N=c.rows,
                               BLOCK_K=c.block_k, VEC=d.vec, num_warps=c.warps, grid=(1,))
    ptx = k.asm["ptx"]
    torch.cuda.synchronize()
    return len(re.findall(r"ld\.global[.\w:]*\.v4", ptx)), len(re.findall(r"ld\.global", ptx))


def _first_call_fresh_cache(build, args, first_call) -> tuple:
    """(seconds, step) of building and calling a step once with Triton's disk cache empty: the real compile time."""
    saved = os.environ.get("TRITON_CACHE_DIR")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["TRITON_CACHE_DIR"] = tmp
        try:
            fn = build()
            s, _ = first_call(fn, args)
        finally:
            if saved is None:
                os.environ.pop("TRITON_CACHE_DIR", None)
            else:
                os.environ["TRITON_CACHE_DIR"] = saved
    return s, fn


@experiment("last_mile_waterfall", gpu_only=True,
            quick={"size": "tiny", "repeats": 3, "n_tokens": 8, "hf_path": False, "compiled": False})
def waterfall_experiment(size: str = "tinyllama", position: int = 32, repeats: int = 20, n_tokens: int = 64,
                         hf_path: bool = True, compiled: bool = True, max_len: int = 256, log=print) -> Result:
    """Eager to the floor, one change per row, interleaved (see the module doc); batch 1 at ``position``.

    ``compiled=False`` leaves out the two torch.compile rows (a minute of compiling); ``hf_path=False``
    leaves out transformers' own compiled ``generate``.
    """
    require_gpu("timing the waterfall of decode steps")
    import torch

    from course.lessons.real_model.decode import StaticDecoder
    from course.core.hardware import release_memory
    from course.core.profiling import launch_counts
    from course.lessons.real_model.bench import _reason, first_call
    from course.lessons.real_model.generate import check_variants
    from course.lessons.real_model.hf_path import hf_compiled_row
    from course.lessons.real_model.model import build_model, bytes_per_token, size_of
    from course.lessons.real_model.roofline import copy_bandwidth_GBps, floor_us

    torch._dynamo.reset()
    model = build_model(size)
    log(f"last_mile_waterfall: {size} built ({model.dtype}); measuring the copy bandwidth")
    bw = copy_bandwidth_GBps()
    nbytes = bytes_per_token(model, 1, position)
    floor = floor_us(nbytes, bw)
    args = StaticDecoder(model, max_len).example_args(1, position)
    steps, rows = {}, {}
    what = dict(STEPS)
    for name, build in _builders(model, max_len, compiled, args).items():
        log(f"last_mile_waterfall: {name}: building, first call (compile and capture) ...")
        try:
            if name.startswith(("Triton", "+", "persistent")):
                s, fn = _first_call_fresh_cache(build, args, first_call)
            else:
                fn = build()
                s, _ = first_call(fn, args)
            steps[name] = fn
            rows[name] = {"status": "ok", "first_call_s": s}
            log(f"last_mile_waterfall: {name}: first call {s:.1f} s")
        except Exception as e:  # noqa: BLE001 - a variant that breaks is a finding, not a lost run
            rows[name] = {"status": _reason(e), "first_call_s": NAN}
            log(f"last_mile_waterfall: {name}: {rows[name]['status']}")
    log(f"last_mile_waterfall: measuring {list(steps)} interleaved ({repeats} repeats, CUDA events)")
    with torch.no_grad():
        t = time_interleaved({n: (lambda fn=fn: fn(*args)) for n, fn in steps.items()}, clock="device",
                             warmup=3, repeats=repeats, inner=5)
    log("last_mile_waterfall: counting kernels per token (profiler)")
    kernels = {}
    for name, fn in steps.items():
        try:
            kernels[name] = launch_counts(lambda fn=fn: fn(*args), calls=3)["gpu_kernels"]
        except Exception:  # noqa: BLE001 - the count is a bonus, never a lost row
            kernels[name] = NAN
    log(f"last_mile_waterfall: checking {n_tokens} greedy tokens of every variant against eager")
    first = torch.randint(3, model.config.vocab_size, (1,), generator=torch.Generator().manual_seed(1))
    fast = {n: fn for n, fn in steps.items() if n != "eager"}
    check = check_variants(fast, StaticDecoder(model, max_len).step, first.to(args[0].device), n_tokens, model.dtype)
    checked = {r["variant"]: r for r in check.rows}
    out = []
    for name, _ in STEPS:
        if name not in rows:
            continue
        tm, c = t.get(name), checked.get(name, {})
        us = tm.us if tm else NAN
        out.append({"variant": name, "change": what[name], "status": rows[name]["status"], "us": us,
                    "q1_us": tm.q1 * 1e6 if tm else NAN, "q3_us": tm.q3 * 1e6 if tm else NAN,
                    "kernels_per_token": kernels.get(name, NAN), "x_floor": us / floor,
                    "first_call_s": rows[name]["first_call_s"], "tokens_equal": c.get("tokens_equal", name == "eager"),
                    "max_logit_diff": c.get("max_logit_diff", 0.0 if name == "eager" else NAN),
                    "correct": c.get("ok", name == "eager")})
    out.append({"variant": "floor", "change": "every weight read once at the measured copy bandwidth",
                "status": "computed", "us": floor, "q1_us": floor, "q3_us": floor, "kernels_per_token": NAN,
                "x_floor": 1.0, "first_call_s": NAN, "tokens_equal": True, "max_logit_diff": NAN, "correct": True})
    del steps
    release_memory()
    res = Result("last_mile_waterfall", "", {"variant": "", "change": "", "status": "", "us": "us", "q1_us": "us",
                                             "q3_us": "us", "kernels_per_token": "count", "x_floor": "x",
                                             "first_call_s": "s", "tokens_equal": "", "max_logit_diff": "fraction",
                                             "correct": ""}, out)
    if hf_path:
        hf = hf_compiled_row(model, "auto", log=log)
        res.add_summary("hf_auto_us", hf["us"], "us")
        res.add_summary("hf_auto_iqr_us", f"{hf['q1_us']:.0f}-{hf['q3_us']:.0f}", "us")
        res.add_summary("hf_auto_status", hf["status"], "")
        res.add_summary("hf_auto_first_call_s", hf["first_call_s"], "s")
    s = size_of(model)
    res.title = (f"LlamaForCausalLM, {s.name} shape ({s.layers} layers, hidden {s.hidden}, {s.dtype}), random "
                 f"weights, batch 1 at position {position}: time per token, every variant interleaved (CUDA events)")
    _summarize(res, t, floor, bw, nbytes)
    for packed, tag in ((False, ""), (True, "packed_")):
        try:
            v4, loads = vector_loads(model, packed)
            res.add_summary(f"o_proj_{tag}ptx_16B_loads", v4, "count")
            res.add_summary(f"o_proj_{tag}ptx_global_loads", loads, "count")
        except Exception as e:  # noqa: BLE001 - evidence, not the measurement
            res.add_summary(f"o_proj_{tag}ptx_16B_loads", _reason(e), "")
    from course.lessons.real_model.bench import _transformers_version
    from course.core.provenance import package_version

    res.params = {"size": size, "position": position, "repeats": repeats, "n_tokens": n_tokens, "max_len": max_len,
                  "compiled": compiled, "hf_path": hf_path, "torch": torch.__version__,
                  "transformers": _transformers_version(), "triton": package_version("triton") or "not installed"}
    return res


def _summarize(res: Result, t: dict, floor: float, bw: float, nbytes: int) -> None:
    """The waterfall's summary: the floor, each step's saving over the row above it, the targets' ratios."""
    from course.core.timing import speedup

    res.add_summary("copy_bandwidth_GBps", bw, "GB/s")
    import torch

    from course.lessons.last_mile.persistent_tuning import chosen

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    res.add_summary("persistent_shapes", chosen(gpu), "")
    res.add_summary("bytes_per_token", nbytes, "B")
    res.add_summary("floor_us", floor, "us")
    names = [n for n, _ in STEPS if n in t]
    for a, b in zip(names, names[1:]):
        res.add_summary(f"saving: {a} -> {b}", t[a].us - t[b].us, "us")
        res.add_summary(f"{a} vs {b}", str(speedup(a, t[a], b, t[b])), "")
    best = min(names, key=lambda n: t[n].us) if names else None
    if best:
        res.add_summary("best", best, "")
        res.add_summary("best_vs_floor", t[best].us / floor, "x")
        if "eager" in t:
            res.add_summary("eager_vs_best", t["eager"].us / t[best].us, "x")
        if "hf_auto_us" in res.summary and res.value("hf_auto_us") == res.value("hf_auto_us"):
            res.add_summary("hf_auto_vs_best", res.value("hf_auto_us") / t[best].us, "x")
