"""``tp_fused_decode``'s measurements on one rank: the split fused step captured, timed (slowest rank), counted,
checked against TP=1, beside its floor; the rows and the Result.

The experiment's loop (shapes x world sizes x all-reduces, subgroups of one launch) stands in lesson 08's cell; each
of its measurements is :func:`measure`:

1. the chosen all-reduce alone, of one token's hidden state, 20 in a row in a CUDA graph: its latency in a graph
   (:func:`all_reduce_us`);
2. the rank's :class:`~course.lessons.tensor_parallel.fused.FusedShardDecoder` (PDL on Hopper), its all-reduces
   counted as issued in an eager step, then the step captured in one graph
   (:func:`~course.lessons.last_mile.decoder.graphed`) and the all-reduce kernels of one replay counted by the
   profiler (:func:`graph_all_reduces`);
3. the replay timed on every rank of the group from aligned starts, each repeat counted as its slowest rank
   (:func:`course.core.timing.time_ranks`);
4. 64 greedy tokens and the logits fed TP=1's tokens, against lesson 07's step on the whole model (TP=1);
5. the floor: this rank's bytes (its weights and KV cache read at the position) at the measured copy rate, plus
   the all-reduces times the latency of step 1.
"""
from __future__ import annotations

import gc

from course.core.results import Result

COLUMNS = {"shape": "", "world": "ranks", "allreduce": "", "us": "us", "q1_us": "us", "q3_us": "us",
           "floor_us": "us", "weights_us": "us", "collectives_us": "us", "all_reduce_us": "us", "all_reduces": "count",
           "all_reduces_graph": "count", "x_floor": "x", "speedup_vs_tp1": "x", "tokens_equal": "",
           "logit_diff": "fraction", "kernels_per_token": "count", "bytes_per_token": "B per rank"}
TIMING = ("one CUDA graph per rank holding the whole step and its all-reduces, replayed; every repeat starts aligned on "
          "all ranks of the group and counts as its slowest rank (course.core.timing.time_ranks)")
N_TOKENS = 64


def graph_all_reduces(replay) -> int:
    """All-reduce kernels one call of ``replay`` (a graph's replay) runs on the GPU, counted by the profiler: NCCL's
    (``ncclDevKernel_AllReduce...``) and symmetric memory's (``..._all_reduce_kernel...``)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        replay()
        torch.cuda.synchronize()
    gpu = torch.autograd.DeviceType.CUDA
    return count_all_reduce_kernels([e.name for e in prof.events() if e.device_type == gpu])


def count_all_reduce_kernels(names) -> int:
    """The kernel names among ``names`` that are all-reduces (case and underscores ignored)."""
    return sum(1 for n in names if "allreduce" in n.replace("_", "").lower())


def all_reduce_us(mode: str, hidden: int, dtype, device, group, repeats: int = 15, inner: int = 5,
                  calls: int = 20) -> float:
    """One ``mode`` all-reduce of ``[hidden]`` values, in a graph of ``calls`` of them: microseconds each (slowest
    rank). Every rank of ``group`` calls it."""
    import torch

    from course.core.timing import time_ranks
    from course.lessons.tensor_parallel.allreduce import make_all_reduce, residual_buffer

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
    us = time_ranks(g.replay, group=group, warmup=3, repeats=repeats, inner=inner).median * 1e6 / calls
    del g
    gc.collect()
    torch.cuda.synchronize()
    return us


def bytes_per_token(dec, position: int) -> int:
    """Bytes one step reads on this rank: its weights and its KV cache at positions ``0..position``."""
    kv = 2 * dec.L * dec.NKV * (position + 1) * dec.D * dec.x.element_size()
    return dec.weight_bytes() + kv


def reference_tokens(model, first, max_len: int, pdl: bool):
    """TP=1: lesson 07's step on the whole model, captured: its 64 greedy tokens and the logits they give (fed)."""
    import torch

    from course.lessons.last_mile.decoder import TritonDecoder, graphed
    from course.lessons.real_model.generate import forced_logits, greedy

    dec = TritonDecoder(model, max_len, pdl=pdl)
    pos = torch.zeros(1, dtype=torch.long, device=first.device)
    step = graphed(dec, first.view(1, 1), pos)
    tokens = greedy(step, first, N_TOKENS)
    fed = torch.cat([first.view(1, 1), tokens[:, :-1]], dim=1)
    logits = forced_logits(step, fed)
    del step, dec
    gc.collect()
    return tokens, fed, logits


def measure(ctx, shape: str, model, world: int, group, mode: str, want, bw_GBps: float, position: int = 32,
            repeats: int = 15, inner: int = 10, ar_us: float = 0.0) -> dict:
    """One row of ``shape`` on every rank of ``group`` (see the module doc): ``want`` = :func:`reference_tokens`'
    result; ``ar_us``: this mode's all-reduce latency (:func:`all_reduce_us`; 0 on one rank)."""
    import torch

    from course.core.timing import time_ranks
    from course.lessons.last_mile.decoder import graphed
    from course.lessons.real_model.generate import forced_logits, greedy
    from course.lessons.tensor_parallel.experiments import floor_us
    from course.lessons.tensor_parallel.fused import FusedShardDecoder

    tokens, fed, logits = want
    pdl = torch.cuda.get_device_capability(ctx.torch_device) >= (9, 0)
    dec = FusedShardDecoder(model, ctx.rank if world > 1 else 0, world, group, mode, max_len=max(position, N_TOKENS) + 8,
                            pdl=pdl)
    ids = fed[:, :1].clone()
    pos = torch.full((1,), position, dtype=torch.long, device=ids.device)
    with torch.no_grad():
        counted = dec.all_reduces_per_step(ids, pos)  # eager: compiles the kernels, counts the calls
        torch.cuda.synchronize()
        step = graphed(dec, ids, pos)
        in_graph = graph_all_reduces(step.graph.replay)
        t = time_ranks(step.graph.replay, group=group, warmup=3, repeats=repeats, inner=inner)
        dec.reset()
        got = greedy(step, fed[:, 0], N_TOKENS)
        dec.reset()
        got_logits = forced_logits(step, fed)
    diff = float((got_logits - logits).abs().max() / logits.abs().max())
    nbytes = bytes_per_token(dec, position)
    f = floor_us(nbytes, bw_GBps, ar_us, counted)
    row = {"shape": shape, "world": world, "allreduce": mode, "us": t.median * 1e6, "q1_us": t.q1 * 1e6, "q3_us": t.q3 * 1e6,
           **f, "all_reduce_us": ar_us, "all_reduces": counted, "all_reduces_graph": in_graph,
           "x_floor": t.median * 1e6 / f["floor_us"], "tokens_equal": bool(torch.equal(got, tokens)),
           "logit_diff": diff, "kernels_per_token": dec.kernels_per_token, "bytes_per_token": nbytes}
    del step, dec
    gc.collect()
    torch.cuda.synchronize()
    return row


def fused_result(rows: list, p, params: dict) -> Result:
    """``tp_fused_decode``'s Result from rank 0's rows (each with its ``shape``); the speed-up over TP=1 filled in
    per shape; provenance "Nx <GPU>" from the launch plan ``p`` (None: this process's GPU)."""
    from course.core.provenance import provenance
    from course.lessons.sharding.experiments import run_provenance

    one = {r["shape"]: r["us"] for r in rows if r["world"] == 1}
    out = []
    for r in rows:
        r = dict(r, speedup_vs_tp1=one[r["shape"]] / r["us"] if r["shape"] in one and r["us"] else float("nan"))
        out.append({k: r[k] for k in COLUMNS})
    res = Result("tp_fused_decode", "Lesson 07's fused step split over ranks, one graph per rank with its all-reduces "
                 "(slowest rank)", COLUMNS, out, provenance=run_provenance(p) if p is not None else provenance(),
                 params={**params, "timing": TIMING})
    for shape in dict.fromkeys(r["shape"] for r in out):
        best = {}
        for r in out:
            if r["shape"] == shape and r["world"] > 1 and r["us"] == r["us"]:
                if r["world"] not in best or r["us"] < best[r["world"]]["us"]:
                    best[r["world"]] = r
        for w, r in sorted(best.items()):
            res.add_summary(f"{shape} TP={w}: fastest all-reduce", r["allreduce"])
            res.add_summary(f"{shape} TP={w}: speed-up over TP=1", r["speedup_vs_tp1"], "x")
    res.add_summary("all_reduces_as_counted", all(r["all_reduces"] == r["all_reduces_graph"] for r in out) and bool(out))
    return res
