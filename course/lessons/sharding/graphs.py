"""The sharded lookup captured in a CUDA graph on each GPU, replayed with new ids, eager vs replay timed.

The per-rank worker (``capture_worker``) is written in lesson 05's cell (it travels to each NCCL process as its source,
:mod:`~course.core.cell_workers`). For each world size it builds the variants below (:func:`make_step`)
over the first ``w`` ranks (a subgroup when ``w`` is smaller than the launch), warms each up on a side stream and
captures one call (lookup *and* collective) into a ``torch.cuda.CUDAGraph`` (:func:`capture_graph`), writes new ids
into the static input, replays, and checks the answer against ``F.embedding`` on the full table
(:func:`variant_row` makes its row). Timing (:data:`TIMING`): every rank times the same calls with
CUDA events, each repeat starting aligned on all ranks, and a repeat counts as its slowest rank
(:func:`course.core.timing.time_ranks`). Before, each rank timed itself alone and rank 0's events were
reported: a collective's time then included however long rank 0 waited for the other rank in each repeat
(rank skew), so the same row-wise replay read 48.7 us in one experiment and 25.7 us in the next.

Variants (:data:`VARIANTS`):

- ``dtensor_rowwise``: ``Shard(0)`` DTensor embedding + ``full_tensor()`` (one all-reduce);
- ``dtensor_colwise``: ``Shard(1)`` + ``full_tensor()`` (one all-gather);
- ``vocab_torch``: hand-written mask + ``F.embedding`` + masked fill + ``all_reduce``;
- ``vocab_numba``: the same with the course's Numba kernel launched on torch's stream.

Frozen at capture: the process group and its ranks (the mesh), each rank's shard offset and
table address, the collective, its size and its dtype, the ids' and output's addresses. The
ids' *values* and the table's *values* are read at every replay.

After the shape buckets are captured, the worker also shows (:func:`bucket_replay`) the agreement step that
data-parallel ranks need: each rank is given a different number of tokens (in a vocab-parallel layer proper
the ranks see the same ids and never disagree; here the row-wise lookup's graphs stand in for a step whose
collective spans data-parallel ranks), the ranks all-gather their bucket picks, and all replay the same
bucket's graph. Graphs are freed and the GPU synchronized before returning
(tearing down NCCL with live graphs has hung).
"""
from __future__ import annotations

import gc

import torch

import course.lessons.sharding.layouts as L
import course.lessons.sharding.vocab_parallel as V
import course.lessons.sharding.workers as W

VARIANTS = ("dtensor_rowwise", "dtensor_colwise", "vocab_torch", "vocab_numba")
TIMING = ("every rank times the same back-to-back calls, each repeat starting aligned on all ranks (a one-element "
          "all-reduce first); a repeat counts as its slowest rank (course.core.timing.time_ranks)")


def capture_graph(step, warmup: int = 3):
    """Warm ``step`` up on a side stream, capture one call; returns (graph, static output)."""
    from course.core.capture import warm_up

    warm_up(step, warmup)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def make_step(variant: str, ids: torch.Tensor, weight: torch.Tensor, rank: int, world: int, group=None, mesh=None):
    """The lookup of one variant as a no-argument function over the static ``ids``; returns the full output."""
    from torch.distributed.tensor import DTensor, Replicate

    num = weight.shape[0]
    if variant.startswith("dtensor"):
        emb = torch.nn.Embedding(num, weight.shape[1], device=weight.device)
        emb.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
        sharded = L.shard_embedding(emb, mesh, 0 if variant == "dtensor_rowwise" else 1)

        def step():
            with torch.no_grad():  # inference: no autograd graph in the captured region
                return sharded(DTensor.from_local(ids, mesh, [Replicate()], run_check=False)).full_tensor()
        return step
    if variant in ("vocab_torch", "vocab_numba"):
        shard, start = V.local_rows(weight, rank, world)
        impl = variant.split("_")[1]
        return lambda: V.vocab_parallel_embedding(ids, shard, start, num_embeddings=num, impl=impl, group=group,
                                                  check=False)
    raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")


def variant_row(variant: str, world_size: int, eager, replay, correct: bool, n_ids: int, dim: int) -> dict:
    """One row of the capture tables from the cell's two :func:`~course.core.timing.time_ranks` Timings: medians and
    quartiles in us, the speedup, whether the replay with new ids was right, and the bytes each collective moves."""
    e, eq1, eq3 = eager.median * 1e6, eager.q1 * 1e6, eager.q3 * 1e6
    r, rq1, rq3 = replay.median * 1e6, replay.q1 * 1e6, replay.q3 * 1e6
    return {"world_size": world_size, "variant": variant, "eager_us": e, "eager_q1_us": eq1, "eager_q3_us": eq3,
            "replay_us": r, "replay_q1_us": rq1, "replay_q3_us": rq3, "speedup": e / r if r else 0.0,
            "replay_correct": correct, "ids": n_ids, "dim": dim, **L.comm_bytes(n_ids, dim, world_size)}


def bucket_replay(ctx, group, w, num_embeddings: int, dim: int, buckets=(8, 16)) -> dict:
    """One graph per bucket; ranks with different token counts agree on one bucket, then all replay it."""
    dev = ctx.torch_device
    weight = W.full_table(num_embeddings, dim, dev)
    shard, start = V.local_rows(weight, ctx.rank, w)
    graphs = {}
    for b in buckets:
        ids = torch.zeros(b, dtype=torch.int64, device=dev)
        step = lambda ids=ids: V.vocab_parallel_embedding(ids, shard, start, num_embeddings=num_embeddings,
                                                          impl="torch", group=group, check=False)
        graphs[b] = (ids, *capture_graph(step))
    n_tokens = 5 + 6 * (ctx.rank % 2)  # the ranks' local counts differ (rank 0: 5 tokens, rank 1: 11)
    bucket = W.agree_bucket(n_tokens, buckets, group=group, device=dev)
    ids, graph, out = graphs[bucket]
    seq = W.same_ids((max(buckets),), num_embeddings, dev, seed=5)  # each rank fills the first n_tokens of one batch
    ids.zero_()
    ids[:n_tokens] = seq[:n_tokens]
    graph.replay()
    torch.cuda.synchronize()
    common = 5  # positions every rank filled with the same ids: there the summed output is the lookup
    correct = bool(torch.equal(out[:common], torch.nn.functional.embedding(seq[:common], weight)))
    graphs.clear()
    del graph, out
    gc.collect()
    torch.cuda.synchronize()
    return {"tokens": n_tokens, "own_bucket": W.pick_bucket(n_tokens, buckets), "bucket": bucket, "correct": correct}
