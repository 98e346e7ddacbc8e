"""Lesson 08's fused section: the correctness launch, the prediction from recorded facts, the timing sentences.

- :func:`fused_tokens_worker`, :func:`run_fused_tokens`, :func:`fused_report`: on every rank, lesson 07's step
  on the whole model (TP=1) and split (one per all-reduce that runs here), greedy tokens and their logits compared;
  captured in one graph per rank on GPUs, eager under Triton's interpreter on a laptop.
- :func:`layer_bytes`, :func:`break_even`, :func:`prediction`: when splitting pays at batch 1. Per token a split
  saves reading ``(1 - 1/world)`` of every layer's weights and adds two all-reduces per layer; the kernels' fixed
  costs (a start and a tail each) stay, the same count on every rank. So TP=2 pays when a layer's weights take
  longer to read than four all-reduces take to run: ``layer bytes / bandwidth > 4 x all-reduce latency``.
- :func:`fused_summary`: sentences about a ``tp_fused_decode`` result (never typed numbers).
"""
from __future__ import annotations

import time

from course.core.launch import launch, plan


def fused_tokens_worker(ctx, size: str = "tiny", n_tokens: int = 16, modes=("nccl", "symm_one_shot",
                                                                              "symm_two_shot")) -> dict:
    """On every rank: TP=1 (lesson 07's step, whole model) and the split step per mode that runs here; tokens,
    relative logit differences while the tokens agree, all-reduces per step, every rank's tokens gathered."""
    import gc

    import torch

    from course.core.runtime import runtime, synchronize
    from course.lessons.last_mile.decoder import TritonDecoder, graphed
    from course.lessons.real_model.generate import tolerance
    from course.lessons.real_model.model import build_model
    from course.lessons.tensor_parallel.allreduce import unavailable
    from course.lessons.tensor_parallel.fused import FusedShardDecoder
    from course.lessons.tensor_parallel.workers import first_token, gather

    model = build_model(size, device=ctx.torch_device)
    first = first_token(ctx.torch_device, model.config.vocab_size)
    gpu = runtime().on_gpu
    pos0 = torch.zeros(1, dtype=torch.long, device=first.device)
    step_of = (lambda d: graphed(d, first.view(1, 1), pos0)) if gpu else (lambda d: d.step)
    want, want_logits = decode(step_of(TritonDecoder(model, n_tokens + 8)), first, n_tokens)
    res = {"rank": ctx.rank, "dtype": str(model.dtype).replace("torch.", ""), "tolerance": tolerance(model.dtype),
           "tp1": want, "captured": gpu, "modes": {}, "skipped": {}}
    for mode in modes:
        why = unavailable(mode, ctx.backend)
        if why:
            res["skipped"][mode] = why
            continue
        dec = FusedShardDecoder(model, ctx.rank, ctx.world_size, None, mode, max_len=n_tokens + 8)
        ids = first.view(1, 1)
        count = dec.all_reduces_per_step(ids, pos0)
        dec.reset()
        got, logits = decode(step_of(dec), first, n_tokens)
        n = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), n_tokens)  # steps fed the same tokens
        scale = float(want_logits[:n + 1].abs().max()) or 1.0
        diff = float((logits[:n + 1] - want_logits[:n + 1]).abs().max()) / scale
        res["modes"][mode] = {"tokens": got, "logit_diff": diff, "all_reduces": count}
        del dec
        gc.collect()
        synchronize()
    every = gather(ctx, {m: r["tokens"] for m, r in res["modes"].items()})
    res["ranks_agree"] = all(e == every[0] for e in every)
    return res


def decode(step, first, n_tokens: int) -> tuple:
    """Greedy tokens (a list) and the logits of each step ``[n, vocab]`` (float32 copies) after ``first`` ``[1]``."""
    import torch

    ids, pos = first.view(1, 1), torch.zeros(1, dtype=torch.long, device=first.device)
    tokens, logits = [], []
    with torch.no_grad():
        for _ in range(n_tokens):
            out = step(ids, pos)
            logits.append(out[0].float().clone())
            ids = out.argmax(-1, keepdim=True)
            tokens.append(ids)
            pos = pos + 1
    return [int(t) for t in torch.cat(tokens, dim=1)[0].tolist()], torch.stack(logits)


def run_fused_tokens(world_size: int | None = None, n_tokens: int | None = None, size: str | None = None,
                     timeout: float = 420.0) -> dict:
    """One launch of :func:`fused_tokens_worker`: NCCL with TinyLlama's shape (bf16) and 64 tokens on 2+ GPUs; gloo
    CPU processes with the tiny model (fp32) under Triton's interpreter, 12 tokens (each step takes about a
    second there), on a laptop."""
    p = plan(world_size)
    gpu = p.backend == "nccl"
    size = size or ("tinyllama" if gpu else "tiny")
    n_tokens = n_tokens or (64 if gpu else 12)
    t0 = time.perf_counter()
    ranks = launch(fused_tokens_worker, p.world_size, backend=p.backend, timeout=timeout, size=size,
                   n_tokens=n_tokens)
    return {"plan": p, "size": size, "n_tokens": n_tokens, "ranks": ranks, "seconds": time.perf_counter() - t0}


def fused_report(run_: dict) -> str:
    """One line per all-reduce: tokens against TP=1, logits, all-reduces per step, ranks agreeing; the skipped."""
    r0 = run_["ranks"][0]
    how = "captured, one graph per rank" if r0["captured"] else "eager, Triton's interpreter"
    lines = [f"{run_['plan'].describe()} | {run_['size']} ({r0['dtype']}), {run_['n_tokens']} tokens, {how}; "
             f"every rank decoded the same tokens: {all(r['ranks_agree'] for r in run_['ranks'])}"]
    for mode, m in r0["modes"].items():
        lines.append(f"{mode:>14}: tokens {'==' if m['tokens'] == r0['tp1'] else '!='} TP=1's, logits within "
                     f"{m['logit_diff']:.1e} of TP=1's (tolerance {r0['tolerance']:.0e}), {m['all_reduces']} "
                     "all-reduces per step")
    for mode, why in r0["skipped"].items():
        lines.append(f"{mode:>14}: not run here: {why}")
    return "\n".join(lines)


def layer_bytes(size) -> int:
    """Bytes of one decoder layer's weights (q, k, v, o, gate, up, down, two norms) of a model size."""
    from course.lessons.real_model.model import _size

    s = _size(size)
    el = 2 if s.dtype == "bfloat16" else 4
    d = s.head_dim
    return el * ((s.heads + 2 * s.kv_heads) * d * s.hidden + s.hidden * s.heads * d + 3 * s.intermediate * s.hidden
                 + 2 * s.hidden)


def break_even(all_reduce_us: float, copy_GBps: float, world: int = 2) -> float:
    """Layer bytes above which a split over ``world`` ranks saves more reading than its two all-reduces per layer
    cost: ``2 x latency x bandwidth / (1 - 1/world)``."""
    if all_reduce_us < 0 or copy_GBps <= 0 or world < 2:
        raise ValueError(f"need a latency >= 0, a positive bandwidth and world >= 2; got {all_reduce_us}, "
                         f"{copy_GBps}, {world}")
    return 2 * all_reduce_us * 1e-6 * copy_GBps * 1e9 / (1 - 1 / world)


def kernel_us(waterfall_result, variant: str = "Triton + PDL, plain graph") -> float:
    """Lesson 07's fixed cost per kernel, from a ``last_mile_waterfall`` result: (the step - its floor) / kernels."""
    rows = {r["variant"]: r for r in waterfall_result.rows}
    if variant not in rows or "floor" not in rows:
        raise ValueError(f"the waterfall has no {variant!r} row and floor row")
    r = rows[variant]
    return (r["us"] - rows["floor"]["us"]) / r["kernels_per_token"]


def prediction(tp_decode_result, sizes=("tinyllama", "llama-3.1-8b"), world: int = 2, per_kernel_us=None) -> list:
    """Per model size: a layer's bytes, the time saved per token by the split, the time its all-reduces add, and
    whether TP=``world`` pays, from a ``tp_decode`` result's measured copy rate and captured all-reduce latency.
    With ``per_kernel_us`` (:func:`kernel_us`) also the predicted step at TP=1 and TP=``world`` (weights at the copy
    rate + the kernels' fixed cost + the all-reduces) and their ratio."""
    from course.lessons.last_mile.decoder import KERNELS_PER_LAYER
    from course.lessons.last_mile.shapes import SHAPES
    from course.lessons.real_model.model import SIZES
    from course.lessons.tensor_parallel.experiments import layout_bytes

    rows = [r for r in tp_decode_result.rows if r["world_size"] == world and r["variant"] == "hand"]
    if not rows:
        raise ValueError(f"the tp_decode result has no hand-split row at {world} ranks")
    ar, bw = rows[0]["all_reduce_us"], rows[0]["copy_GBps"]
    out = []
    for name in sizes:
        s = SHAPES.get(name) or SIZES[name]
        lb = layer_bytes(s)
        saved = s.layers * lb * (1 - 1 / world) / (bw * 1e9) * 1e6
        added = 2 * s.layers * ar
        row = {"shape": name, "layer_MB": lb / 1e6, "break_even_MB": break_even(ar, bw, world) / 1e6,
               "saved_us": saved, "added_us": added, "pays": saved > added, "all_reduce_us": ar, "copy_GBps": bw,
               "all_reduces": 2 * s.layers}
        if per_kernel_us is not None:
            fixed = (2 + KERNELS_PER_LAYER * s.layers) * per_kernel_us
            one = layout_bytes(s, 1) / (bw * 1e3) + fixed
            split = layout_bytes(s, world) / (bw * 1e3) + fixed + added
            row.update(kernel_us=per_kernel_us, tp1_us=one, split_us=split, speedup=one / split)
        out.append(row)
    return out


def prediction_lines(rows: list, world: int = 2) -> list:
    """Sentences for :func:`prediction`'s rows."""
    out = []
    for r in rows:
        line = (f"{r['shape']}: one layer is {r['layer_MB']:,.0f} MB; TP={world} saves {r['saved_us']:,.0f} us of "
                f"weight reading per token and adds {r['added_us']:,.0f} us of all-reduces "
                f"(break-even layer: {r['break_even_MB']:,.0f} MB): {'pays' if r['pays'] else 'does not pay'}")
        if "tp1_us" in r:
            line += (f"; predicted step {r['tp1_us']:,.0f} us at TP=1, {r['split_us']:,.0f} us at TP={world} "
                     f"({r['speedup']:.2f}x)")
        out.append(line)
    return out


def fused_summary(res) -> str:
    """Sentences about a ``tp_fused_decode`` result, computed from it: per row the time, spread, x floor, speed-up
    over TP=1 (or noise), all-reduces counted, tokens; the faster all-reduce per world size, by measurement."""
    lines = [res.caption()]
    one = {r["shape"]: r for r in res.rows if r["world"] == 1}
    for r in res.rows:
        base = one.get(r["shape"])
        apart = base is None or r is base or r["q3_us"] < base["q1_us"] or r["q1_us"] > base["q3_us"]
        vs = "" if r["world"] == 1 else (f", {r['speedup_vs_tp1']:.2f}x TP=1" + ("" if apart else " (IQRs overlap: "
                                                                                                  "noise)"))
        lines.append(f"{r['shape']} TP={r['world']} {r['allreduce']}: {r['us']:,.0f} us (IQR {r['q1_us']:,.0f}-"
                     f"{r['q3_us']:,.0f}), {r['x_floor']:.2f}x its floor ({r['weights_us']:,.0f} weights + "
                     f"{r['collectives_us']:,.0f} all-reduces){vs}; all-reduces per step {r['all_reduces']} issued, "
                     f"{r['all_reduces_graph']} in the graph; tokens equal TP=1: {r['tokens_equal']} (logits within "
                     f"{r['logit_diff']:.1e})")
    for k, v in res.summary.items():
        if "fastest" in k:
            lines.append(f"{k}: {v['value']}")
    lines.append(f"how: {res.params.get('timing', 'not recorded')}")
    return "\n".join(lines)
