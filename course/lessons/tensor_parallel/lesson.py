"""Notebook 08's helpers: the layout, what each rank runs in the correctness launches and the
launches, the prediction, the sentences and the plot (every figure computed, never typed).
"""
from __future__ import annotations

import time

import torch

import course.core.plots as plots
from course.core.launch import launch, plan
from course.core.results import Result
from course.core.timing import eager_versus
from course.lessons.last_mile.decoder import KERNELS_PER_LAYER
from course.lessons.last_mile.shapes import SHAPES
from course.lessons.real_model.model import SIZES, _size
from course.lessons.sharding.lesson import recorded  # noqa: F401 - the notebook's recordings
from course.lessons.tensor_parallel.bench import layout_bytes, scaling
from course.lessons.tensor_parallel.tp import head_plan, mlp_rows, predicted_all_reduces


def layout(size, worlds=(1, 2, 4, 8)) -> Result:
    """Rank 0's share at each world size: query heads, KV heads, MLP rows, bytes per token."""
    s = _size(size)
    rows = []
    for w in worlds:
        p, (a, b) = head_plan(s.heads, s.kv_heads, w, 0), mlp_rows(s.intermediate, w, 0)
        kv = "replicated" if p.replicated_kv else ("whole" if w == 1 else "split")
        rows.append({"world_size": w, "q_heads": p.n_q, "kv_heads": p.n_kv, "kv": kv,
                     "mlp_rows": b - a, "bytes_per_token": layout_bytes(s, w),
                     "all_reduces": predicted_all_reduces(s.layers, w)})
    cols = {"world_size": "ranks", "q_heads": "per rank", "kv_heads": "per rank", "kv": "",
            "mlp_rows": "per rank", "bytes_per_token": "B per rank", "all_reduces": "per token"}
    title = (f"{s.name} ({s.heads} query heads, {s.kv_heads} KV heads, {s.layers} layers) split by "
             "hand: rank 0's share")
    return Result("tp_layout", title, cols, rows, params={"size": s.name})


def split_tokens(ctx, variants=("hand",), size="tiny", n_tokens=8, capture=True, max_len=96):
    """On every rank, per variant: TP=1 with the whole model, then the split, eager and captured
    (one graph per rank, its all-reduces inside): tokens, logits, all-reduces; ranks compared."""
    import gc

    import torch

    from course.core.agree import exchange
    from course.core.runtime import runtime, synchronize
    from course.lessons.real_model import StaticDecoder, build_model, forced_logits, greedy
    from course.lessons.real_model.generate import tolerance
    from course.lessons.real_model.handgraph import GraphedDecode
    from course.lessons.tensor_parallel.bench import (all_reduces, eager_collectives,
                                                      graph_collectives, make_decoder)
    from course.lessons.tensor_parallel.tp import first_token

    out = []
    for variant in variants:
        model = build_model(size, device=ctx.torch_device)  # one seed: the same weights everywhere
        first = first_token(ctx.torch_device, model.config.vocab_size)
        ref = StaticDecoder(model, max_len)
        want = greedy(ref.step, first, n_tokens)  # TP=1: the whole model, the reference
        fed = torch.cat([first.view(1, 1), want[:, :-1]], dim=1)  # teacher forcing: same inputs
        want_logits = forced_logits(ref.step, fed)
        scale = float(want_logits.abs().max()) or 1.0
        dec = make_decoder(variant, model, ctx, max_len=max_len)  # this rank's share of each layer
        ids, pos = dec.example_args(1, 0)
        counted = eager_collectives(lambda: dec.step(ids, pos))
        diff = float((forced_logits(dec.step, fed) - want_logits).abs().max()) / scale
        r = {"rank": ctx.rank, "variant": variant, "dtype": str(model.dtype).replace("torch.", ""),
             "tolerance": tolerance(model.dtype), "tp1": want[0].tolist(),
             "eager": greedy(dec.step, first, n_tokens)[0].tolist(), "eager_logit_diff": diff,
             "eager_collectives": counted, "eager_all_reduces": all_reduces(counted)}
        if capture and variant == "dtensor" and ctx.world_size > 1 and not runtime().on_gpu:
            r["capture_skipped"] = ("the simulator does not capture DTensor programs (a DTensor op "
                                    "becomes several ops on its shards, dispatched on the host); "
                                    "captured on GPUs only")
        elif capture:
            dec.reset()
            graphed = GraphedDecode(dec)  # side-stream warm-up, one capture, all-reduces inside
            r["graph_all_reduces"] = all_reduces(graph_collectives(graphed.graph))
            dec.reset()
            r["captured"] = graphed.generate(first, n_tokens)[0].tolist()
            dec.reset()
            logits = forced_logits(graphed.step, fed)
            r["captured_logit_diff"] = float((logits - want_logits).abs().max()) / scale
            del graphed  # before the process group goes: NCCL's teardown with live graphs has hung
        gc.collect()
        synchronize()
        every = exchange((r["eager"], r.get("captured")), what="the tokens")
        out.append(dict(r, ranks_agree=all(e == every[0] for e in every)))
    return out


def run_tokens(worker, variants=("hand", "dtensor"), world_size=None, n_tokens: int = 64,
               timeout: float = 300.0, size=None) -> dict:
    """Launch ``worker`` (:func:`split_tokens`) on every rank: TinyLlama's shape in bf16 over NCCL
    on 2+ GPUs, the tiny model in fp32 on gloo CPU processes."""
    p = plan(world_size)
    size = size or ("tinyllama" if p.backend == "nccl" else "tiny")
    t0 = time.perf_counter()
    ranks = launch(worker, p.world_size, backend=p.backend, timeout=timeout, size=size,
                   variants=tuple(variants), n_tokens=n_tokens, max_len=n_tokens + 8)
    return {"plan": p, "size": size, "ranks": ranks, "seconds": time.perf_counter() - t0,
            "variants": variants}


def same(a, b) -> str:
    """``==`` or ``!=``."""
    return "==" if a == b else "!="


def tokens_report(run_: dict) -> str:
    """One line per variant: tokens against TP=1, logit differences, ranks agreeing, counts."""
    lines = []
    for i, v in enumerate(run_["variants"]):
        r = run_["ranks"][0][i]
        agree = all(rank[i]["ranks_agree"] for rank in run_["ranks"])
        cap = r.get("capture_skipped") or (
            f"captured tokens {same(r['captured'], r['tp1'])} TP=1, logits within "
            f"{r['captured_logit_diff']:.1e}; all-reduces in the graph: {r['graph_all_reduces']}")
        lines.append(f"{v:>8} x{run_['plan'].world_size} ({r['dtype']}): eager tokens "
                     f"{same(r['eager'], r['tp1'])} TP=1, logits within "
                     f"{r['eager_logit_diff']:.1e} (tolerance {r['tolerance']:.0e}); {cap}; every "
                     f"rank the same tokens: {agree}; collectives in one eager step: "
                     f"{r['eager_collectives']}")
    return "\n".join(lines)


def fused_tokens(ctx, size="tiny", n_tokens=16, modes=("nccl", "symm_one_shot", "symm_two_shot")):
    """On every rank: TP=1 (lesson 07's step, the whole model), then the split step per all-reduce
    that runs here: tokens, logits while the tokens agree, all-reduces per step; ranks compared."""
    import gc

    import torch

    from course.core.agree import exchange
    from course.core.runtime import runtime, synchronize
    from course.lessons.last_mile.decoder import TritonDecoder, graphed
    from course.lessons.real_model.generate import tolerance
    from course.lessons.real_model.model import build_model
    from course.lessons.tensor_parallel.allreduce import unavailable
    from course.lessons.tensor_parallel.fused import FusedShardDecoder
    from course.lessons.tensor_parallel.lesson import decode
    from course.lessons.tensor_parallel.tp import first_token

    model = build_model(size, device=ctx.torch_device)
    first = first_token(ctx.torch_device, model.config.vocab_size)
    pos0 = torch.zeros(1, dtype=torch.long, device=first.device)
    gpu = runtime().on_gpu  # GPUs: one graph per rank; a laptop: Triton's interpreter, eager
    step_of = (lambda d: graphed(d, first.view(1, 1), pos0)) if gpu else (lambda d: d.step)
    want, want_logits = decode(step_of(TritonDecoder(model, n_tokens + 8)), first, n_tokens)
    res = {"rank": ctx.rank, "dtype": str(model.dtype).replace("torch.", ""), "tp1": want,
           "tolerance": tolerance(model.dtype), "captured": gpu, "modes": {}, "skipped": {}}
    for mode in modes:
        if unavailable(mode, ctx.backend):
            res["skipped"][mode] = unavailable(mode, ctx.backend)
            continue
        dec = FusedShardDecoder(model, ctx.rank, ctx.world_size, None, mode, max_len=n_tokens + 8)
        count = dec.all_reduces_per_step(first.view(1, 1), pos0)
        dec.reset()
        got, logits = decode(step_of(dec), first, n_tokens)
        n = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), n_tokens)  # same inputs
        scale = float(want_logits[:n + 1].abs().max()) or 1.0
        diff = float((logits[:n + 1] - want_logits[:n + 1]).abs().max()) / scale
        res["modes"][mode] = {"tokens": got, "logit_diff": diff, "all_reduces": count}
        del dec
        gc.collect()
        synchronize()
    every = exchange({m: r["tokens"] for m, r in res["modes"].items()}, what="the tokens")
    return dict(res, ranks_agree=all(e == every[0] for e in every))


def decode(step, first, n_tokens: int) -> tuple:
    """Greedy tokens (a list) after ``first`` ``[1]``, and each step's logits ``[n, vocab]``."""
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


def run_fused_tokens(worker, world_size=None, n_tokens=None, size=None, timeout=420.0) -> dict:
    """One launch of ``worker`` (:func:`fused_tokens`): NCCL, TinyLlama's shape in bf16 and 64
    tokens on 2+ GPUs; gloo CPU processes, the tiny model in fp32 under Triton's interpreter and 12
    tokens (a step takes about a second there) on a laptop."""
    p = plan(world_size)
    gpu = p.backend == "nccl"
    size = size or ("tinyllama" if gpu else "tiny")
    n_tokens = n_tokens or (64 if gpu else 12)
    t0 = time.perf_counter()
    ranks = launch(worker, p.world_size, backend=p.backend, timeout=timeout, size=size,
                   n_tokens=n_tokens)
    return {"plan": p, "size": size, "n_tokens": n_tokens, "ranks": ranks,
            "seconds": time.perf_counter() - t0}


def fused_report(run_: dict) -> str:
    """One line per all-reduce: tokens against TP=1, logits, all-reduces per step; the skipped."""
    r0 = run_["ranks"][0]
    how = "captured, one graph per rank" if r0["captured"] else "eager, Triton's interpreter"
    agree = all(r["ranks_agree"] for r in run_["ranks"])
    lines = [f"{run_['plan'].describe()} | {run_['size']} ({r0['dtype']}), {run_['n_tokens']} "
             f"tokens, {how}; every rank decoded the same tokens: {agree}"]
    for mode, m in r0["modes"].items():
        lines.append(f"{mode:>14}: tokens {same(m['tokens'], r0['tp1'])} TP=1's, logits within "
                     f"{m['logit_diff']:.1e} of TP=1's (tolerance {r0['tolerance']:.0e}), "
                     f"{m['all_reduces']} all-reduces per step")
    lines += [f"{mode:>14}: not run here: {why}" for mode, why in r0["skipped"].items()]
    return "\n".join(lines)


def layer_bytes(size) -> int:
    """Bytes of one decoder layer's weights (q, k, v, o, gate, up, down, two norms)."""
    s = _size(size)
    attn = (s.heads + 2 * s.kv_heads) * s.head_dim * s.hidden + s.hidden * s.heads * s.head_dim
    mlp = 3 * s.intermediate * s.hidden
    return (2 if s.dtype == "bfloat16" else 4) * (attn + mlp + 2 * s.hidden)


def break_even(all_reduce_us: float, copy_GBps: float, world: int = 2) -> float:
    """Layer bytes above which a split over ``world`` ranks saves more reading than its two
    all-reduces per layer cost: ``2 x latency x bandwidth / (1 - 1/world)``."""
    if all_reduce_us < 0 or copy_GBps <= 0 or world < 2:
        raise ValueError("need a latency >= 0, a positive bandwidth and world >= 2; got "
                         f"{all_reduce_us}, {copy_GBps}, {world}")
    return 2 * all_reduce_us * 1e-6 * copy_GBps * 1e9 / (1 - 1 / world)


def kernel_us(waterfall_result, variant: str = "Triton + PDL, plain graph") -> float:
    """Lesson 07's fixed cost per kernel: (the step - its floor) / kernels, from its waterfall."""
    rows = {r["variant"]: r for r in waterfall_result.rows}
    if variant not in rows or "floor" not in rows:
        raise ValueError(f"the waterfall has no {variant!r} row and floor row")
    r = rows[variant]
    return (r["us"] - rows["floor"]["us"]) / r["kernels_per_token"]


def prediction(tp_decode, sizes=("tinyllama", "llama-3.1-8b"), world=2, per_kernel_us=None) -> list:
    """Per model shape: a layer's bytes, the reading a split over ``world`` ranks saves per token,
    what its all-reduces add, whether it pays; with ``per_kernel_us``, the steps predicted."""
    rows = [r for r in tp_decode.rows if r["world_size"] == world and r["variant"] == "hand"]
    if not rows:
        raise ValueError(f"the tp_decode result has no hand-split row at {world} ranks")
    ar, bw = rows[0]["all_reduce_us"], rows[0]["copy_GBps"]  # measured: an all-reduce, copy rate
    out = []
    for name in sizes:
        s = SHAPES.get(name) or SIZES[name]
        lb = layer_bytes(s)
        saved = s.layers * lb * (1 - 1 / world) / (bw * 1e9) * 1e6  # a rank reads 1/world of each
        added = 2 * s.layers * ar  # two all-reduces per layer
        row = {"shape": name, "layer_MB": lb / 1e6, "saved_us": saved, "added_us": added,
               "break_even_MB": break_even(ar, bw, world) / 1e6, "pays": saved > added,
               "all_reduce_us": ar, "copy_GBps": bw, "all_reduces": 2 * s.layers}
        if per_kernel_us is not None:  # every rank still launches every kernel: its cost stays
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
        line = (f"{r['shape']}: one layer is {r['layer_MB']:,.0f} MB; TP={world} saves "
                f"{r['saved_us']:,.0f} us of weight reading per token and adds "
                f"{r['added_us']:,.0f} us of all-reduces (break-even layer: "
                f"{r['break_even_MB']:,.0f} MB): {'pays' if r['pays'] else 'does not pay'}")
        if "tp1_us" in r:
            line += (f"; predicted step {r['tp1_us']:,.0f} us at TP=1, {r['split_us']:,.0f} us at "
                     f"TP={world} ({r['speedup']:.2f}x)")
        out.append(line)
    return out


def overlap(a: dict, b: dict, col: str = "") -> bool:
    """True when rows ``a`` and ``b``'s IQRs of ``col`` (``q1_us``...) overlap: a difference in
    noise."""
    return not (a[f"{col}q1_us"] > b[f"{col}q3_us"] or b[f"{col}q1_us"] > a[f"{col}q3_us"])


def fused_summary(res) -> str:
    """Sentences about a ``tp_fused_decode`` result: per row the time, spread, floor, speed-up over
    TP=1 (or noise), all-reduces counted, tokens; the faster all-reduce per world size."""
    lines = [res.caption()]
    one = {r["shape"]: r for r in res.rows if r["world"] == 1}
    for r in res.rows:
        base = one.get(r["shape"])
        noise = base is not None and r is not base and overlap(r, base)
        vs = "" if r["world"] == 1 else (f", {r['speedup_vs_tp1']:.2f}x TP=1"
                                         + (" (IQRs overlap: noise)" if noise else ""))
        lines.append(f"{r['shape']} TP={r['world']} {r['allreduce']}: {r['us']:,.0f} us (IQR "
                     f"{r['q1_us']:,.0f}-{r['q3_us']:,.0f}), {r['x_floor']:.2f}x its floor "
                     f"({r['weights_us']:,.0f} weights + {r['collectives_us']:,.0f} "
                     f"all-reduces){vs}; all-reduces per step {r['all_reduces']} issued, "
                     f"{r['all_reduces_graph']} in the graph; tokens equal TP=1: "
                     f"{r['tokens_equal']} (logits within {r['logit_diff']:.1e})")
    lines += [f"{k}: {v['value']}" for k, v in res.summary.items() if "fastest" in k]
    lines.append(f"how: {res.params.get('timing', 'not recorded')}")
    return "\n".join(lines)


def timing_summary(res) -> str:
    """Sentences about ``tp_decode``'s table: eager vs graph per row, counts, the floor, scaling."""
    if res is None:
        return "No multi-GPU figures on this machine yet (see above)."
    lines = [res.caption()]
    for r in res.rows:
        host = max(r["eager_us"] - r["graph_us"], 0)
        lines.append(f"{r['variant']:>9} TP={r['world_size']}: {eager_versus(r, 'graph', ',.0f')}; "
                     f"all-reduces eager/graph/predicted {r['all_reduces_eager']}/"
                     f"{r['all_reduces_graph']}/{r['all_reduces_predicted']}; floor "
                     f"{r['floor_us']:,.0f} us ({r['weights_us']:,.0f} weights + "
                     f"{r['collectives_us']:,.0f} all-reduces): the floor is "
                     f"{r['floor_us'] / r['graph_us']:.0%} of the graph's time (the graph "
                     f"{r['graph_us'] / r['floor_us']:.1f}x the floor)")
        lines.append(f"{'':>9} where the time goes: {host:,.0f} us of host work per token removed "
                     f"by the graph ({host / r['eager_us']:.0%} of eager), "
                     f"{max(r['graph_us'] - r['floor_us'], 0):,.0f} us still above the floor in "
                     "the graph")
    by = {(r["variant"], r["world_size"]): r for r in res.rows}
    for v in sorted({r["variant"] for r in res.rows}):
        for s in scaling(res, v)[1:]:
            noise = overlap(by[(v, s["world_size"])], by[(v, 1)], "graph_")
            lines.append(f"{v} graph, scaling TP=1 time / TP={s['world_size']} time: "
                         f"{s['speedup_vs_tp1']:.2f}x"
                         + (" (the IQRs overlap: noise)" if noise else "")
                         + f"; the floor predicts {s['floor_speedup']:.2f}x")
    lines += floor_reading(res)
    lines.append(f"how: {res.params.get('timing', 'not recorded')}")
    return "\n".join(lines)


def plot_scaling(res):
    """Per variant: graph time per token against world size, and the floor's prediction."""
    fig, (ax,) = plots.figure(1, width=6.0, height=3.8)
    for v in sorted({r["variant"] for r in res.rows}):
        rows = sorted((r for r in res.rows if r["variant"] == v), key=lambda r: r["world_size"])
        ax.plot([r["world_size"] for r in rows], [r["graph_us"] for r in rows], "o-",
                label=f"{v}: graph")
    rows = sorted((r for r in res.rows if r["variant"] == "hand"), key=lambda r: r["world_size"])
    ax.plot([r["world_size"] for r in rows], [r["floor_us"] for r in rows], "k--",
            label="floor (hand layout)")
    ax.set_xlabel("ranks (GPUs)")
    ax.set_ylabel("us per token (slowest rank)")
    ax.set_xticks(sorted({r["world_size"] for r in res.rows}))
    ax.legend(fontsize=8)
    plots.caption(fig, res)
    return fig


def floor_reading(res) -> list:
    """What the floor's two terms say about splitting at each world size (the hand split): the
    weight time saved against the all-reduces' latency added."""
    rows = {r["world_size"]: r for r in res.rows if r["variant"] == "hand"}
    if 1 not in rows:
        return []
    out = []
    for w, r in sorted(rows.items()):
        if w == 1:
            continue
        saved, added = rows[1]["weights_us"] - r["weights_us"], r["collectives_us"]
        verdict = "faster" if saved > added else "slower"
        out.append(f"floor at TP={w}: {saved:,.0f} us of weight reading saved per token, "
                   f"{added:,.0f} us of all-reduce latency added ({r['all_reduces_predicted']} x "
                   f"{r['all_reduce_us']:.1f} us): the floor predicts the split {verdict} than "
                   "one GPU at batch 1")
    return out
