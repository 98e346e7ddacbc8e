"""Lesson 06's GPU experiments: the TinyLlama-shaped model's decode step, every way of running it.

- :func:`decode_experiment` ("real_model_decode"): batch 1, eager (:class:`StaticDecoder`), graph-cached
  (its eager kernels captured by the GraphCache), fused (``torch.compile`` default mode, captured by the
  GraphCache), fused + GEMV (the same, on the twin whose q/k/v and gate/up products are stacked and whose
  batch-1 products run the course's Numba GEMV: :mod:`~course.lessons.real_model.gemv`), lesson 07's Triton step
  (:data:`TRITON`) and transformers' own compiled ``generate`` path: time per token (median and IQR, CUDA
  events, interleaved), kernels per token (profiler), time to the first token (compile and capture
  included), tokens and logits against eager, and the weight-read floor from a measured copy bandwidth.
- "real_model_batch_sweep": tokens/s for batch 1..64, eager vs graph-cached vs fused vs fused + GEMV (above
  batch 1 its stacked products run on cuBLAS) vs the floor. Its code stands in lesson 06's cell
  (:mod:`course.core.cells`); this module keeps its bookkeeping: :func:`sweep_batches`, :func:`sweep_variants`,
  :func:`sweep_row`, :func:`failed_row`, :func:`floor_row`, :func:`batch_sweep_result`.

Every compiled or captured variant is guarded: a failure becomes a row with ``status`` "FAILED: ..."
and the run goes on. Progress is printed as it runs (which variant, compiling or measuring).
"""
from __future__ import annotations

import time

from course.core.capture import require_gpu
from course.core.compiled import reset_compile
from course.core.hardware import release_memory
from course.core.profiling import launch_counts
from course.core.reference import experiment
from course.core.results import Result
from course.core.text import clip, condense
from course.core.timing import speedup, time_interleaved
from course.lessons.real_model.decode import StaticDecoder, graph_cached
from course.lessons.real_model.generate import check_variants
from course.lessons.real_model.hf_path import hf_compiled_row
from course.lessons.real_model.model import build_model, bytes_per_token, size_of
from course.lessons.real_model.roofline import copy_bandwidth_GBps, floor_us, split, tokens_per_s

NAN = float("nan")


def _reason(e: BaseException) -> str:
    return f"FAILED: {type(e).__name__}: {clip(condense(str(e), 1), 200)}"  # machine paths cut by condense


def first_call(fn, args) -> tuple:
    """(seconds, output) of the first call of ``fn(*args)`` (no grad), host clock, GPU synchronized before and after."""
    import torch

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
    modes = set(stats["fusion_modes"].values())
    reasons = "; ".join(condense(r, 1) for r in stats["fallback_reasons"].values())
    return ",".join(sorted(modes)) + (f" ({clip(reasons, 160)})" if reasons else "")


FAST = "fused + GEMV"  # the fastest variant: compiled, stacked projections, the Numba GEMV at batch 1
TRITON = "Triton, fused per layer (07)"  # lesson 07's step: five Triton kernels per layer, PDL, one sequence
BATCH1_ONLY = {TRITON: "n/a: lesson 07's Triton step decodes one sequence (its kernels are matrix-vector products)"}


def triton_step(model, max_len: int):
    """Lesson 07's step on ``model``, captured by the GraphCache (PDL on Hopper and later GPUs): batch 1 only."""
    import torch

    from course.lessons.last_mile.decoder import TritonDecoder, captured

    pdl = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
    return captured(TritonDecoder(model, max_len, pdl=pdl))


def na_row(batch: int, name: str, reason: str) -> dict:
    """The sweep's row of a variant that does not serve ``batch``: its status says why, its times are NaN."""
    return {"batch": batch, "variant": name, "status": reason, "us": NAN, "q1_us": NAN, "q3_us": NAN,
            "tokens_per_s": NAN, "first_call_s": NAN}


def _builders(model, max_len: int, autotune: bool):
    import torch

    from course.lessons.real_model.projections import gemv_model

    twin = []  # built on first use: the stacked weights take memory only when that variant runs

    def fast():
        if not twin:
            twin.append(gemv_model(model, fuse=True))
        return graph_cached(StaticDecoder(twin[0], max_len), fusion=True)

    out = {"eager": lambda: StaticDecoder(model, max_len).step,
           "graph-cached": lambda: graph_cached(StaticDecoder(model, max_len)),
           "fused": lambda: graph_cached(StaticDecoder(model, max_len), fusion=True),
           FAST: fast, TRITON: lambda: triton_step(model, max_len)}
    if autotune:
        def tuned():
            d = StaticDecoder(model, max_len)
            return graph_cached(d, fused=torch.compile(d.step, mode="max-autotune-no-cudagraphs"))
        out["fused, max-autotune"] = tuned
    return out


@experiment("real_model_decode", gpu_only=True,
            quick={"size": "tiny", "repeats": 5, "n_tokens": 8, "hf_path": False})
def decode_experiment(size: str = "tinyllama", position: int = 32, repeats: int = 20, n_tokens: int = 32,
                      hf_path: bool = True, hf_recipes=("forward", "auto"), autotune: bool = False, max_len: int = 256,
                      log=print) -> Result:
    """Batch-1 decode of the TinyLlama-shaped model: eager, graph-cached, fused, transformers' compiled recipes.

    ``hf_path=False`` leaves transformers' recipes out; ``hf_recipes`` picks them (keys of
    :data:`~course.lessons.real_model.hf_path.RECIPES`); ``autotune=True`` adds a fused variant compiled with
    ``mode="max-autotune-no-cudagraphs"`` (minutes more).
    """
    require_gpu("timing the real model's decode step")
    import torch

    reset_compile()
    model = build_model(size)
    log(f"real_model_decode: {size} built ({model.dtype}); measuring the copy bandwidth")
    bw = copy_bandwidth_GBps()
    nbytes = bytes_per_token(model, 1, position)
    floor = floor_us(nbytes, bw)
    steps, rows = {}, {}
    args = StaticDecoder(model, max_len).example_args(1, position)
    for name, build in _builders(model, max_len, autotune).items():
        log(f"real_model_decode: {name}: building, first call (compile and capture for the fast variants) ...")
        try:
            fn = build()
            s, _ = first_call(fn, args)
            log(f"real_model_decode: {name}: first call {s:.1f} s")
            steps[name] = fn
            rows[name] = {"variant": name, "status": "ok", "mode": _mode(fn), "first_call_s": s,
                          "kernels_per_token": NAN}
        except Exception as e:  # noqa: BLE001 - a variant that breaks is a finding, not a lost run
            rows[name] = {"variant": name, "status": _reason(e), "mode": "", "first_call_s": NAN,
                          "kernels_per_token": NAN}
            log(f"real_model_decode: {name}: {rows[name]['status']}")
    log(f"real_model_decode: measuring {list(steps)} interleaved ({repeats} repeats, CUDA events)")
    with torch.no_grad():
        t = time_interleaved({n: (lambda fn=fn: fn(*args)) for n, fn in steps.items()}, clock="device",
                             warmup=3, repeats=repeats, inner=5)
    log("real_model_decode: counting kernels per token (profiler, after all timing: it slows later launches)")
    for name, fn in steps.items():
        try:
            rows[name]["kernels_per_token"] = launch_counts(lambda fn=fn: fn(*args), calls=3)["gpu_kernels"]
        except Exception:  # noqa: BLE001 - the kernel count is a bonus, never a lost row
            pass
    log(f"real_model_decode: checking {n_tokens} greedy tokens of every variant against eager")
    first = torch.randint(3, model.config.vocab_size, (1,), generator=torch.Generator().manual_seed(1)).to(args[0].device)
    fast = {n: fn for n, fn in steps.items() if n != "eager"}
    check = check_variants(fast, StaticDecoder(model, max_len).step, first, n_tokens, model.dtype) if fast else None
    checked = {r["variant"]: r for r in check.rows} if check else {}
    out = []
    for name, row in rows.items():
        tm = t.get(name)
        c = checked.get(name, {})
        out.append({**row, "us": tm.us if tm else NAN, "q1_us": tm.q1 * 1e6 if tm else NAN,
                    "q3_us": tm.q3 * 1e6 if tm else NAN, "tokens_equal": c.get("tokens_equal", name == "eager"),
                    "max_logit_diff": c.get("max_logit_diff", 0.0 if name == "eager" else NAN),
                    "correct": c.get("ok", name == "eager"), "log": ""})
    del steps
    release_memory()
    for recipe in (hf_recipes if hf_path else ()):
        hf = hf_compiled_row(model, recipe, log=log)
        out.append({"variant": hf["variant"], "status": hf["status"], "mode": f"transformers recipe {recipe!r}",
                    "first_call_s": hf["first_call_s"], "kernels_per_token": NAN, "us": hf["us"],
                    "q1_us": hf["q1_us"], "q3_us": hf["q3_us"], "tokens_equal": hf["tokens_equal"],
                    "max_logit_diff": NAN, "correct": "n/a (tokens only)", "log": hf["log"]})
    s = size_of(model)
    res = Result("real_model_decode",
                 f"LlamaForCausalLM, {s.name} shape ({s.layers} layers, hidden {s.hidden}, {s.dtype}), random "
                 f"weights, batch 1 at position {position}: time per token (CUDA events, interleaved)",
                 {"variant": "", "status": "", "mode": "", "us": "us", "q1_us": "us", "q3_us": "us",
                  "kernels_per_token": "count", "first_call_s": "s", "tokens_equal": "", "max_logit_diff": "fraction",
                  "correct": "", "log": ""}, out,
                 params={"size": size, "position": position, "repeats": repeats, "n_tokens": n_tokens,
                         "max_len": max_len, "autotune": autotune, "hf_recipes": list(hf_recipes) if hf_path else [],
                         "torch": torch.__version__,
                         "transformers": _transformers_version()})
    res.add_summary("copy_bandwidth_GBps", bw, "GB/s")
    res.add_summary("bytes_per_token", nbytes, "B")
    res.add_summary("floor_us", floor, "us")
    if "eager" in t and "fused" in t:
        res.add_summary("fused_vs_floor", t["fused"].us / floor, "x")
        res.add_summary("eager_vs_fused", speedup("eager", t["eager"], "fused", t["fused"]).ratio, "x")
        res.add_summary("eager vs fused", str(speedup("eager", t["eager"], "fused", t["fused"])), "")
    if "eager" in t and FAST in t:
        res.add_summary("fused_gemv_vs_floor", t[FAST].us / floor, "x")
        res.add_summary("eager_vs_fused_gemv", speedup("eager", t["eager"], FAST, t[FAST]).ratio, "x")
        res.add_summary("eager vs fused + GEMV", str(speedup("eager", t["eager"], FAST, t[FAST])), "")
    if "fused" in t and FAST in t:
        res.add_summary("fused vs fused + GEMV", str(speedup("fused", t["fused"], FAST, t[FAST])), "")
    if "eager" in t and "graph-cached" in t:
        res.add_summary("eager vs graph-cached", str(speedup("eager", t["eager"], "graph-cached", t["graph-cached"])),
                        "")
    if all(k in t for k in ("eager", "graph-cached", "fused")):
        parts = split(t["eager"].us, t["graph-cached"].us, t["fused"].us, floor)["eager"]
        for part, us in parts.items():
            res.add_summary(f"split: {part}", us, "us")
    return res


def _transformers_version() -> str:
    from course.core.provenance import package_version

    return package_version("transformers") or "not installed"


COMPILED = ("fused", FAST)  # the sweep's compiled variants: they run only at its fused_batches


def sweep_batches(batches) -> list:
    """The sweep's batch sizes, sorted and each once; a clear error for an empty list or a size below 1."""
    out = sorted(set(int(b) for b in batches))
    if not out or out[0] < 1:
        raise ValueError(f"batches must be positive ints, got {out}")
    return out


def sweep_variants(model, batches, fused_batches, max_len: int) -> tuple:
    """``(eager decoder, {variant: step})`` of the batch sweep, each variant on a decoder of its own.

    Eager, graph-cached (one GraphCache bucket per batch size) and lesson 07's Triton step (:data:`TRITON`, batch 1
    only: :data:`BATCH1_ONLY`) always; the compiled variants (:data:`COMPILED`:
    fused, and fused + GEMV on the twin with stacked projections) only when ``fused_batches`` is not empty, each
    ``torch.compile``-d once and captured per batch size.
    """
    import torch

    eager_dec, cache_dec, fused_dec = (StaticDecoder(model, max_len) for _ in range(3))
    variants = {"eager": eager_dec.step, "graph-cached": graph_cached(cache_dec, buckets=batches)}
    if fused_batches:
        from course.lessons.real_model.projections import gemv_model

        fast_dec = StaticDecoder(gemv_model(model, fuse=True), max_len)
        variants["fused"] = graph_cached(fused_dec, buckets=batches, fused=torch.compile(fused_dec.step))
        variants[FAST] = graph_cached(fast_dec, buckets=batches, fused=torch.compile(fast_dec.step))
    try:
        variants[TRITON] = triton_step(model, max_len)
    except Exception as e:  # noqa: BLE001 - no Triton here: the row says why at its first call
        def broken(*args, e=e):
            raise e
        variants[TRITON] = broken
    return eager_dec, variants


def sweep_row(batch: int, name: str, fn, first_call_s: float, timing) -> dict:
    """One measured row of the sweep: the step's median and IQR, its tokens/s, and "ok" or how the cache fell back."""
    status = "ok" if _mode(fn) in ("eager", "fusion", "graph_replay") else f"fell back: {_mode(fn)}"
    return {"batch": batch, "variant": name, "status": status, "us": timing.us, "q1_us": timing.q1 * 1e6,
            "q3_us": timing.q3 * 1e6, "tokens_per_s": tokens_per_s(batch, timing.us), "first_call_s": first_call_s}


def failed_row(batch: int, name: str, error: BaseException) -> dict:
    """The row of a variant whose first call raised: its status says why, its times are NaN."""
    return {"batch": batch, "variant": name, "status": _reason(error), "us": NAN, "q1_us": NAN, "q3_us": NAN,
            "tokens_per_s": NAN, "first_call_s": NAN}


def floor_row(model, batch: int, position: int, bandwidth_GBps: float) -> dict:
    """The floor's row at ``batch``: what one step must read (weights, embedding rows, KV cache) at the bandwidth."""
    fl = floor_us(bytes_per_token(model, batch, position), bandwidth_GBps)
    return {"batch": batch, "variant": "floor", "status": "computed", "us": fl, "q1_us": fl, "q3_us": fl,
            "tokens_per_s": tokens_per_s(batch, fl), "first_call_s": 0.0}


def batch_sweep_result(rows: list, model, bandwidth_GBps: float, **params) -> Result:
    """The ``real_model_batch_sweep`` table from lesson 06's cell: its rows, the copy bandwidth and the best tokens/s.

    ``params`` are the run's parameters (``position`` among them, for the title); torch's and transformers'
    versions are added.
    """
    import torch

    s = size_of(model)
    res = Result("real_model_batch_sweep",
                 f"LlamaForCausalLM, {s.name} shape ({s.dtype}), random weights: tokens/s against batch size at "
                 f"position {params.get('position')} (CUDA events, variants interleaved per batch)",
                 {"batch": "", "variant": "", "status": "", "us": "us", "q1_us": "us", "q3_us": "us",
                  "tokens_per_s": "tokens/s", "first_call_s": "s"}, rows,
                 params={**params, "torch": torch.__version__, "transformers": _transformers_version()})
    res.add_summary("copy_bandwidth_GBps", bandwidth_GBps, "GB/s")
    best = max((r for r in rows if r["variant"] != "floor" and r["tokens_per_s"] == r["tokens_per_s"]),
               key=lambda r: r["tokens_per_s"], default=None)
    if best:
        res.add_summary("best_tokens_per_s", best["tokens_per_s"], "tokens/s")
        res.add_summary("best_at", f"{best['variant']}, batch {best['batch']}", "")
    return res
