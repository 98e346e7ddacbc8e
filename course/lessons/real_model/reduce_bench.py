"""GPU experiment ``real_model_reduce_overhead``: the fixed reduce-overhead step against the fastest step, one run.

Four ways of running the batch-1 decode step of the TinyLlama-shaped model, built in turn, then timed interleaved
(:func:`course.core.timing.time_interleaved`, CUDA events, median and IQR), so their ratios come from one run:

- "fused + GEMV": the course's fastest (``real_model_decode``'s row): compiled with ``torch.compile`` (default
  mode) on the twin with stacked projections and the Numba GEMV, captured by the GraphCache;
- "reduce-overhead, fixed": :class:`~course.lessons.real_model.reduce_fixed.ReduceOverheadStep` on the model
  itself: torch.compile records the graph (CUDA graph trees);
- "reduce-overhead + GEMV, fixed": the same on the twin, so the two compiled paths run the same kernels;
- "captured by hand": :class:`~course.lessons.real_model.handgraph.GraphedDecode`, eager kernels in one graph.

Per variant: torch's log while it was built and first called ("skipping cudagraphs" lines, recompiles, graph
breaks, inputs that are not static), the ``cudagraph_skips`` counter, CUDA graph launches and host kernel launches
per token (profiler: ``cudaGraphLaunch``, ``cudaLaunchKernel``), GPU kernels per token, time to the first call,
and tokens and logits against eager (:func:`~course.lessons.real_model.generate.check_variants`). A variant that
fails is a row that says why.
"""
from __future__ import annotations

import gc

from course.core.capture import require_gpu
from course.core.reference import experiment
from course.core.results import Result
from course.core.text import clip, condense
from course.core.timing import speedup, time_interleaved
from course.lessons.real_model.decode import StaticDecoder, graph_cached
from course.lessons.real_model.generate import check_variants
from course.lessons.real_model.model import build_model, size_of

FAST = "fused + GEMV"
RO, RO_GEMV, HAND = "reduce-overhead, fixed", "reduce-overhead + GEMV, fixed", "captured by hand"
TARGET = 1.2  # the goal for the fixed reduce-overhead path: within this factor of fused + GEMV
NAN = float("nan")
_LOG_KEYS = ("skipping cudagraph", "overwritten", "recompiling", "graph break")


def _builders(model, max_len: int) -> dict:
    from course.lessons.real_model.handgraph import GraphedDecode
    from course.lessons.real_model.projections import gemv_model
    from course.lessons.real_model.reduce_fixed import ReduceOverheadStep

    twin = []

    def the_twin():
        if not twin:
            twin.append(gemv_model(model, fuse=True))
        return twin[0]

    return {FAST: lambda: graph_cached(StaticDecoder(the_twin(), max_len), fusion=True),
            RO: lambda: ReduceOverheadStep(model, max_len).step,
            RO_GEMV: lambda: ReduceOverheadStep(the_twin(), max_len).step,
            HAND: lambda: GraphedDecode(StaticDecoder(model, max_len)).step}


def _status(fn) -> str:
    stats = fn.get_stats() if hasattr(fn, "get_stats") else None
    reasons = sorted(set(stats["fallback_reasons"].values())) if stats else []
    return f"fell back: {clip(condense(reasons[0], 1), 200)}" if reasons else "ok"


def _build(name, build, args, log) -> tuple:
    """Build one variant and call it three times (reduce-overhead: warm-up, recording, first replay), logging."""
    import torch
    from torch._dynamo.utils import counters

    from course.lessons.real_model.experiments import first_call
    from course.lessons.real_model.reduce_fixed import describe_sources, static_input_report
    from course.core.compiled import torch_log_messages

    skips = counters["inductor"]["cudagraph_skips"]
    row = {"variant": name, "status": "ok", "first_call_s": NAN, "non_static": "", "log": ""}
    fn = None
    with torch_log_messages(cudagraphs=True, perf_hints=True, recompiles=True, graph_breaks=True,
                            cudagraph_static_inputs=True) as msgs:
        try:
            log(f"real_model_reduce_overhead: {name}: building, first call (compile, capture) ...")
            fn = build()
            row["first_call_s"], _ = first_call(fn, args)
            with torch.no_grad():
                for _ in range(2):
                    fn(*args)
            torch.cuda.synchronize()
            row["status"] = _status(fn)
            log(f"real_model_reduce_overhead: {name}: first call {row['first_call_s']:.1f} s")
        except Exception as e:  # noqa: BLE001 - a variant that breaks is a finding, not a lost run
            row["status"] = f"FAILED: {type(e).__name__}: {clip(condense(str(e), 2), 300)}"
            log(f"real_model_reduce_overhead: {name}: {clip(row['status'], 160)}")
            fn = None
    graphs = static_input_report(msgs)
    row["non_static"] = describe_sources(graphs[-1]["non_static"]) if graphs else "(no compiled graph)"
    row["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"] - skips
    lines = [clip(condense(m, 1), 200) for m in msgs if any(k in str(m).lower() for k in _LOG_KEYS)]
    row["log"] = clip(" | ".join(dict.fromkeys(lines)), 600)
    return fn, row


@experiment("real_model_reduce_overhead", gpu_only=True, quick={"size": "tiny", "repeats": 5, "n_tokens": 8})
def reduce_overhead_experiment(size: str = "tinyllama", position: int = 32, repeats: int = 20, n_tokens: int = 32,
                               max_len: int = 256, log=print) -> Result:
    """The fixed ``mode="reduce-overhead"`` step (with and without the GEMV twin) and the hand capture, against fused
    + GEMV: time per token interleaved in one run, graph launches per token, torch's cudagraph log, tokens."""
    require_gpu("torch.compile's CUDA graphs on the real model")
    import torch

    from course.core.profiling import launch_counts

    torch._dynamo.reset()
    model = build_model(size)
    args = StaticDecoder(model, max_len).example_args(1, position)
    steps, rows = {}, {}
    for name, build in _builders(model, max_len).items():
        fn, rows[name] = _build(name, build, args, log)
        if fn is not None:
            steps[name] = fn
    log(f"real_model_reduce_overhead: measuring {list(steps)} interleaved ({repeats} repeats, CUDA events)")
    with torch.no_grad():
        t = time_interleaved({n: (lambda fn=fn: fn(*args)) for n, fn in steps.items()}, clock="device",
                             warmup=3, repeats=repeats, inner=5)
    log("real_model_reduce_overhead: counting launches and kernels per token (profiler, after the timing)")
    for name, fn in steps.items():
        with torch.no_grad():
            try:
                counts = launch_counts(lambda fn=fn: fn(*args))
                rows[name].update(graphs_per_token=counts["graph_launches"],
                                  host_launches_per_token=counts["kernel_launches"],
                                  kernels_per_token=launch_counts(lambda fn=fn: fn(*args), calls=3)["gpu_kernels"])
            except Exception:  # noqa: BLE001 - the counts are a bonus, never a lost row
                pass
    log(f"real_model_reduce_overhead: checking {n_tokens} greedy tokens of every variant against eager")
    gen = torch.Generator().manual_seed(1)
    first = torch.randint(3, model.config.vocab_size, (1,), generator=gen).to(args[0].device)
    check = check_variants(steps, StaticDecoder(model, max_len).step, first, n_tokens, model.dtype) if steps else None
    checked = {r["variant"]: r for r in check.rows} if check else {}
    out = []
    for name, row in rows.items():
        tm, c = t.get(name), checked.get(name, {})
        out.append({"variant": name, "status": row["status"], "us": tm.us if tm else NAN,
                    "q1_us": tm.q1 * 1e6 if tm else NAN, "q3_us": tm.q3 * 1e6 if tm else NAN,
                    "vs_fused_gemv": tm.us / t[FAST].us if tm and FAST in t else NAN,
                    "graphs_per_token": row.get("graphs_per_token", NAN),
                    "host_launches_per_token": row.get("host_launches_per_token", NAN),
                    "kernels_per_token": row.get("kernels_per_token", NAN), "first_call_s": row["first_call_s"],
                    "cudagraph_skips": row["cudagraph_skips"], "non_static": row["non_static"],
                    "tokens_equal": c.get("tokens_equal", False), "max_logit_diff": c.get("max_logit_diff", NAN),
                    "correct": c.get("ok", False), "log": row["log"]})
    del steps
    gc.collect()
    torch.cuda.empty_cache()
    s = size_of(model)
    res = Result("real_model_reduce_overhead",
                 f"LlamaForCausalLM, {s.name} shape ({s.layers} layers, hidden {s.hidden}, {s.dtype}), random weights, "
                 f"batch 1 at position {position}: torch.compile(mode='reduce-overhead') fixed, against fused + GEMV "
                 "(CUDA events, interleaved)",
                 {"variant": "", "status": "", "us": "us", "q1_us": "us", "q3_us": "us", "vs_fused_gemv": "x",
                  "graphs_per_token": "count", "host_launches_per_token": "count", "kernels_per_token": "count",
                  "first_call_s": "s", "cudagraph_skips": "count", "non_static": "", "tokens_equal": "",
                  "max_logit_diff": "fraction", "correct": "", "log": ""}, out,
                 params={"size": size, "position": position, "repeats": repeats, "n_tokens": n_tokens,
                         "max_len": max_len, "target": TARGET, "torch": torch.__version__,
                         "transformers": _transformers_version()})
    _summaries(res, t)
    return res


def _summaries(res: Result, t: dict) -> None:
    if FAST not in t:
        return
    for name in (RO, RO_GEMV, HAND):
        if name in t:
            res.add_summary(f"{name} / {FAST}", t[name].us / t[FAST].us, "x")
            res.add_summary(f"{name} vs {FAST}", str(speedup(name, t[name], FAST, t[FAST])), "")
    ro = [n for n in (RO, RO_GEMV) if n in t]
    if ro:
        best = min(ro, key=lambda n: t[n].us)
        ratio = t[best].us / t[FAST].us
        res.add_summary("best reduce-overhead", best, "")
        res.add_summary("best reduce-overhead / fused + GEMV", ratio, "x")
        res.add_summary(f"within {TARGET}x of fused + GEMV", "yes" if ratio <= TARGET else "no", "")


def _transformers_version() -> str:
    from course.core.provenance import package_version

    return package_version("transformers") or "not installed"
