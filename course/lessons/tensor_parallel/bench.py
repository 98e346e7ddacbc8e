"""Lesson 08's recordings (``tp_decode``, ``tp_fused_decode``, written in its cells): what each rank
measures, and their Results.

All-reduces counted (in an eager step under ``CommDebugMode``; in a graph, the NCCL kernels of one
profiled replay, or on the simulator the collectives the capture recorded), the floor per rank
(weight bytes at the measured copy rate plus the all-reduces at their measured latency), one timed
row per world size, variant and all-reduce, the Results ``course bench`` records ("Nx <GPU>").
"""
from __future__ import annotations

import gc
import warnings

import torch

from course.core.launch import device_mesh
from course.core.provenance import provenance
from course.core.results import Result
from course.core.runtime import runtime
from course.core.timing import time_ranks
from course.lessons.last_mile.decoder import TritonDecoder, graphed
from course.lessons.real_model.decode import StaticDecoder
from course.lessons.real_model.generate import forced_logits, greedy
from course.lessons.real_model.model import _size
from course.lessons.sharding.bench import run_provenance
from course.lessons.tensor_parallel.allreduce import make_all_reduce, residual_buffer
from course.lessons.tensor_parallel.fused import FusedShardDecoder
from course.lessons.tensor_parallel.tp import (DTensorDecoder, HandShardedDecoder, head_plan,
                                               mlp_rows, parallelize, predicted_all_reduces)

VARIANTS = ("dtensor", "hand", "hand_gemv")
TIMING = ("every rank times the same back-to-back calls, each repeat starting aligned on all ranks "
          "(a one-element all-reduce first); a repeat counts as its slowest rank "
          "(course.core.timing.time_ranks)")
FUSED_TIMING = ("one CUDA graph per rank holding the whole step and its all-reduces, replayed; "
                "every repeat starts aligned on all ranks of the group and counts as its slowest "
                "rank (course.core.timing.time_ranks)")
N_TOKENS = 64


# ---------------------------------------------------------------- the split step, its all-reduces
def make_decoder(variant: str, model, ctx, world=None, group=None, max_len: int = 128):
    """``variant``'s step over the first ``world`` ranks, on this rank (``dtensor`` splits
    ``model`` in place)."""
    world = world or ctx.world_size
    warnings.filterwarnings("ignore", message="For backward hooks to be called")  # DTensor's hooks
    if variant == "dtensor":
        return StaticDecoder(model, max_len) if world == 1 else DTensorDecoder(
            parallelize(model, device_mesh(ctx, group)), world, max_len)
    if variant in ("hand", "hand_gemv"):
        linear = "gemv" if variant == "hand_gemv" else "torch"
        return HandShardedDecoder(model, ctx.rank, world, group, max_len, linear)
    raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")


def eager_collectives(fn) -> dict:
    """``{name: count}`` of the collectives one call of ``fn`` issues (``CommDebugMode``'s)."""
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as mode:
        fn()
    out = {}
    for op, n in mode.get_comm_counts().items():
        name = str(op).split(".")[-1].rstrip("_")  # c10d.allreduce_ -> allreduce
        out[name] = out.get(name, 0) + n
    return out


def all_reduces(counts: dict) -> int:
    """The all-reduces in a count: a graph's NCCL kernels when it has them, else those named so."""
    if "nccl_kernels" in counts:
        return counts["nccl_kernels"]
    return sum(n for name, n in counts.items()
               if name.replace("_", "").lower().startswith("allreduce"))


def count_kernels_named(events, word: str = "allreduce") -> int:
    """GPU activities among ``(name, on_gpu)`` pairs named for NCCL and ``word`` (case and
    underscores ignored)."""
    key = word.replace("_", "").lower()
    return sum(1 for name, on_gpu in events
               if on_gpu and "nccl" in name.lower() and key in name.replace("_", "").lower())


def profiled_kernels(fn) -> list:
    """``(name, on_gpu)`` of every event one profiled call of ``fn`` runs."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [(e.name, e.device_type == torch.autograd.DeviceType.CUDA) for e in prof.events()]


def graph_collectives(graph, replay=None) -> dict:
    """``{"all_reduce": n, "nccl_kernels": k}`` of one replay of ``graph`` (GPU: profiled;
    simulator: the ops its capture recorded)."""
    if not runtime().on_gpu:
        ops = [str(o) for o in graph.recorded_ops()]
        return {"all_reduce": sum(o.startswith("c10d.allreduce") for o in ops),
                "nccl_kernels": sum(o.startswith("c10d.") for o in ops)}
    events = profiled_kernels(replay or graph.replay)
    return {"all_reduce": count_kernels_named(events),
            "nccl_kernels": count_kernels_named(events, "")}


def count_all_reduce_kernels(names) -> int:
    """The kernel names among ``names`` that are all-reduces: NCCL's and symmetric memory's."""
    return sum(1 for n in names if "allreduce" in n.replace("_", "").lower())


def graph_all_reduces(replay) -> int:
    """All-reduce kernels one call of ``replay`` runs on the GPU, counted by the profiler."""
    return count_all_reduce_kernels([n for n, on_gpu in profiled_kernels(replay) if on_gpu])


# ---------------------------------------------------------------- the floor; tp_decode's rows
def layout_bytes(size, world: int, rank: int = 0) -> int:
    """Bytes one batch-1 step reads on ``rank`` of ``world`` (hand split, replicated KV heads)."""
    s = _size(size)
    plan = head_plan(s.heads, s.kv_heads, world, rank)
    a, b = mlp_rows(s.intermediate, world, rank)
    attn = (plan.n_q + 2 * plan.n_kv) * s.head_dim * s.hidden + s.hidden * plan.n_q * s.head_dim
    per_layer = attn + 3 * (b - a) * s.hidden + 2 * s.hidden
    whole = s.hidden + s.vocab * s.hidden + s.hidden  # final norm, LM head, one embedding row
    return (2 if s.dtype == "bfloat16" else 4) * (s.layers * per_layer + whole)


def floor_us(weight_bytes: float, copy_GBps: float, all_reduce_us: float, all_reduces: int) -> dict:
    """The floor of one step per rank: ``weights_us`` (bytes at the copy rate) plus
    ``collectives_us`` (the count times one all-reduce)."""
    if copy_GBps <= 0 or weight_bytes < 0 or all_reduce_us < 0 or all_reduces < 0:
        raise ValueError("need a positive copy rate and non-negative bytes, latency and count; "
                         f"got {copy_GBps}, {weight_bytes}, {all_reduce_us}, {all_reduces}")
    w, c = weight_bytes / (copy_GBps * 1e9) * 1e6, all_reduce_us * all_reduces
    return {"weights_us": w, "collectives_us": c, "floor_us": w + c}


def timing_row(world: int, variant: str, eager, replay, eager_count: int, graph_count: int,
               layers: int, weight_bytes: int, copy_GBps: float, all_reduce_us: float,
               logit_diff: float) -> dict:
    """One ``tp_decode`` row: eager and replay (slowest rank) in us, all-reduces counted, floor."""
    predicted = predicted_all_reduces(layers, world)
    us = {f"{name}{q}_us": getattr(t, key) * 1e6
          for name, t in (("eager", eager), ("graph", replay))
          for q, key in (("", "median"), ("_q1", "q1"), ("_q3", "q3"))}
    return {"world_size": world, "variant": variant, **us,
            "speedup": eager.median / replay.median if replay.median else 0.0,
            "all_reduces_eager": eager_count, "all_reduces_graph": graph_count,
            "all_reduces_predicted": predicted, "weight_bytes": weight_bytes,
            "copy_GBps": copy_GBps, "all_reduce_us": all_reduce_us,
            **floor_us(weight_bytes, copy_GBps, all_reduce_us, predicted), "logit_diff": logit_diff}


COLUMNS = {"world_size": "ranks", "variant": "", "eager_us": "us", "eager_q1_us": "us",
           "eager_q3_us": "us", "graph_us": "us", "graph_q1_us": "us", "graph_q3_us": "us",
           "speedup": "x", "all_reduces_eager": "count", "all_reduces_graph": "count",
           "all_reduces_predicted": "count", "weight_bytes": "B", "copy_GBps": "GB/s",
           "all_reduce_us": "us", "weights_us": "us", "collectives_us": "us", "floor_us": "us",
           "logit_diff": "fraction"}


def tp_result(rows: list, p, params: dict) -> Result:
    """``tp_decode``'s Result from rank 0's rows; provenance "Nx <GPU>" from the plan ``p``."""
    res = Result("tp_decode", "Batch-1 decode split over ranks: eager vs one captured graph per "
                              "rank (slowest "
                              "rank)", COLUMNS, [{k: r[k] for k in COLUMNS} for r in rows],
                 provenance=run_provenance(p), params={**params, "timing": TIMING})
    counted = [r["all_reduces_eager"] == r["all_reduces_graph"] == r["all_reduces_predicted"]
               for r in rows if r["variant"] != "dtensor"]
    res.add_summary("all_reduces_as_predicted", all(counted) and bool(rows))
    return res


def scaling(res, variant: str) -> list:
    """Per world size of ``variant``: graph time, speedup over TP=1's, the floor's prediction."""
    rows = {r["world_size"]: r for r in res.rows if r["variant"] == variant}
    if 1 not in rows:
        return []
    one = rows[1]
    return [{"world_size": w, "graph_us": r["graph_us"], "speedup_vs_tp1": one["graph_us"] /
             r["graph_us"], "floor_speedup": one["floor_us"] / r["floor_us"],
             "of_floor": r["floor_us"] / r["graph_us"]} for w, r in sorted(rows.items())]


# ---------------------------------------------------------------- tp_fused_decode's rows
FUSED_COLUMNS = {"shape": "", "world": "ranks", "allreduce": "", "us": "us", "q1_us": "us",
                 "q3_us": "us", "floor_us": "us", "weights_us": "us", "collectives_us": "us",
                 "all_reduce_us": "us", "all_reduces": "count", "all_reduces_graph": "count",
                 "x_floor": "x", "speedup_vs_tp1": "x", "tokens_equal": "",
                 "logit_diff": "fraction", "kernels_per_token": "count",
                 "bytes_per_token": "B per rank"}


def all_reduce_us(mode: str, hidden: int, dtype, device, group, repeats: int = 15, inner: int = 5,
                  calls: int = 20) -> float:
    """One ``mode`` all-reduce of ``[hidden]`` values, 20 in a graph: us each (slowest rank)."""
    x = residual_buffer(mode, hidden, dtype, device, group)
    x.fill_(1)
    reduce = make_all_reduce(mode, x, group)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # NCCL's communicator made here, not inside the capture
            reduce()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            reduce()
    t = time_ranks(g.replay, group=group, warmup=3, repeats=repeats, inner=inner)
    del g
    gc.collect()
    torch.cuda.synchronize()
    return t.median * 1e6 / calls


def bytes_per_token(dec, position: int) -> int:
    """Bytes one step reads on this rank: its weights, and its KV cache up to ``position``."""
    return dec.weight_bytes() + 2 * dec.L * dec.NKV * (position + 1) * dec.D * dec.x.element_size()


def reference_tokens(model, first, max_len: int, pdl: bool):
    """TP=1, lesson 07's step on the whole model, captured: its greedy tokens, the tokens fed, and
    the logits they give."""
    dec = TritonDecoder(model, max_len, pdl=pdl)
    step = graphed(dec, first.view(1, 1), torch.zeros(1, dtype=torch.long, device=first.device))
    tokens = greedy(step, first, N_TOKENS)
    fed = torch.cat([first.view(1, 1), tokens[:, :-1]], dim=1)
    logits = forced_logits(step, fed)
    del step, dec
    gc.collect()
    return tokens, fed, logits


def measure(ctx, shape: str, model, world: int, group, mode: str, want, bw_GBps: float,
            position: int = 32, repeats: int = 15, inner: int = 10, ar_us: float = 0.0) -> dict:
    """One ``tp_fused_decode`` row on every rank of ``group``: the split step captured, counted,
    timed, checked against ``want`` (:func:`reference_tokens`), beside its floor."""
    tokens, fed, logits = want
    pdl = torch.cuda.get_device_capability(ctx.torch_device) >= (9, 0)
    dec = FusedShardDecoder(model, ctx.rank if world > 1 else 0, world, group, mode,
                            max_len=max(position, N_TOKENS) + 8, pdl=pdl)
    ids, pos = fed[:, :1].clone(), torch.full((1,), position, dtype=torch.long, device=fed.device)
    with torch.no_grad():
        counted = dec.all_reduces_per_step(ids, pos)  # eager: compiles the kernels, counts calls
        torch.cuda.synchronize()
        step = graphed(dec, ids, pos)
        in_graph = graph_all_reduces(step.graph.replay)
        t = time_ranks(step.graph.replay, group=group, warmup=3, repeats=repeats, inner=inner)
        dec.reset()
        got = greedy(step, fed[:, 0], N_TOKENS)
        dec.reset()
        got_logits = forced_logits(step, fed)
    nbytes = bytes_per_token(dec, position)
    f = floor_us(nbytes, bw_GBps, ar_us, counted)
    row = {"shape": shape, "world": world, "allreduce": mode, "us": t.median * 1e6,
           "q1_us": t.q1 * 1e6, "q3_us": t.q3 * 1e6, **f, "all_reduce_us": ar_us,
           "all_reduces": counted, "all_reduces_graph": in_graph,
           "x_floor": t.median * 1e6 / f["floor_us"], "tokens_equal": torch.equal(got, tokens),
           "logit_diff": float((got_logits - logits).abs().max() / logits.abs().max()),
           "kernels_per_token": dec.kernels_per_token, "bytes_per_token": nbytes}
    del step, dec
    gc.collect()
    torch.cuda.synchronize()
    return row


def fused_result(rows: list, p, params: dict) -> Result:
    """``tp_fused_decode``'s Result from rank 0's rows: the speed-up over TP=1 per shape, the
    fastest all-reduce per world size; provenance "Nx <GPU>" from the plan ``p`` (None: this GPU).
    """
    one = {r["shape"]: r["us"] for r in rows if r["world"] == 1}
    nan = float("nan")
    out = [{k: r[k] for k in FUSED_COLUMNS} for r in (
        dict(r, speedup_vs_tp1=one[r["shape"]] / r["us"] if r["shape"] in one and r["us"] else nan)
        for r in rows)]
    res = Result("tp_fused_decode", "Lesson 07's fused step split over ranks, one graph per rank "
                                    "with its all-reduces (slowest rank)", FUSED_COLUMNS, out,
                 provenance=run_provenance(p) if p is not None else provenance(),
                 params={**params, "timing": FUSED_TIMING})
    for shape in dict.fromkeys(r["shape"] for r in out):
        best = {}
        for r in out:
            if r["shape"] == shape and r["world"] > 1 and r["us"] == r["us"]:
                if r["world"] not in best or r["us"] < best[r["world"]]["us"]:
                    best[r["world"]] = r
        for w, r in sorted(best.items()):
            res.add_summary(f"{shape} TP={w}: fastest all-reduce", r["allreduce"])
            res.add_summary(f"{shape} TP={w}: speed-up over TP=1", r["speedup_vs_tp1"], "x")
    counted = all(r["all_reduces"] == r["all_reduces_graph"] for r in out)
    res.add_summary("all_reduces_as_counted", counted and bool(out))
    return res
