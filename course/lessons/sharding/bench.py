"""Lesson 05's recordings and what their ranks run: captures on GPUs, sweeps, DTensor's test.

``sharding_dtensor_test`` is registered here; ``sharding_cost``, ``sharding_world_sizes``,
``sharding_capture`` and ``sharding_capture_world_sizes`` are written in lesson 05's cells (their
workers travel to the ranks as source) and keep their bookkeeping here. Timing (:data:`TIMING`):
every rank times the same calls, each repeat starting aligned on all ranks, and a repeat counts as
its slowest rank (:func:`course.core.timing.time_ranks`). A capture freezes the process group, each
rank's shard offset, the table's address and every collective's size; the ids' and the table's
values are read at every replay.
"""
from __future__ import annotations

import gc

import torch

from course.core.capture import warm_up
from course.core.launch import device_mesh, launch, plan
from course.core.provenance import provenance
from course.core.reference import experiment
from course.core.results import Result
from course.lessons.sharding.layouts import (DTENSOR_CASES, comm_bytes, dtensor_case,
                                             max_norm_error, shard_embedding)
from course.lessons.sharding.vocab_parallel import (agree_bucket, local_rows, pick_bucket,
                                                    vocab_parallel_embedding)

VARIANTS = ("dtensor_rowwise", "dtensor_colwise", "vocab_torch", "vocab_numba")
TIMING = ("every rank times the same back-to-back calls, each repeat starting aligned on all ranks "
          "(a one-element all-reduce first); a repeat counts as its slowest rank "
          "(course.core.timing.time_ranks)")


def full_table(num_embeddings: int, embedding_dim: int, device, dtype=torch.float32):
    """The whole table, normal values from a fixed seed: the same on every rank."""
    g = torch.Generator().manual_seed(1234)
    return torch.randn(num_embeddings, embedding_dim, generator=g).to(device=device, dtype=dtype)


def same_ids(shape, num_embeddings: int, device, seed: int = 7):
    """Token ids of ``shape`` in ``[0, num_embeddings)`` from ``seed``: the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, num_embeddings, shape, generator=g).to(device)


def capture_graph(step, warmup: int = 3):
    """Warm ``step`` up on a side stream, capture one call; returns (graph, static output)."""
    warm_up(step, warmup)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def make_step(variant: str, ids: torch.Tensor, weight: torch.Tensor, rank: int, world: int,
              group=None, mesh=None):
    """The lookup of one variant, a function of no argument over the static ``ids``: the output."""
    from torch.distributed.tensor import DTensor, Replicate  # on use: it slows a rank's start

    num = weight.shape[0]
    if variant.startswith("dtensor"):
        emb = torch.nn.Embedding(num, weight.shape[1], device=weight.device)
        emb.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
        sharded = shard_embedding(emb, mesh, 0 if variant == "dtensor_rowwise" else 1)

        def step():
            with torch.no_grad():  # inference: no autograd graph in the captured region
                replicated = DTensor.from_local(ids, mesh, [Replicate()], run_check=False)
                return sharded(replicated).full_tensor()
        return step
    if variant in ("vocab_torch", "vocab_numba"):
        shard, start = local_rows(weight, rank, world)
        impl = variant.split("_")[1]
        return lambda: vocab_parallel_embedding(ids, shard, start, num_embeddings=num, impl=impl,
                                                group=group, check=False)
    raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")


def variant_row(variant: str, world_size: int, eager, replay, correct: bool, n_ids: int,
                dim: int) -> dict:
    """One row of the capture tables from two Timings: medians, quartiles (us), speedup, bytes."""
    e, r = eager.median * 1e6, replay.median * 1e6
    return {"world_size": world_size, "variant": variant, "eager_us": e,
            "eager_q1_us": eager.q1 * 1e6, "eager_q3_us": eager.q3 * 1e6, "replay_us": r,
            "replay_q1_us": replay.q1 * 1e6, "replay_q3_us": replay.q3 * 1e6,
            "speedup": e / r if r else 0.0, "replay_correct": correct, "ids": n_ids, "dim": dim,
            **comm_bytes(n_ids, dim, world_size)}


def bucket_replay(ctx, group, w, num_embeddings: int, dim: int, buckets=(8, 16)) -> dict:
    """One graph per bucket; ranks with different token counts agree on one, then all replay it."""
    dev = ctx.torch_device
    weight = full_table(num_embeddings, dim, dev)
    shard, start = local_rows(weight, ctx.rank, w)
    graphs = {}
    for b in buckets:
        ids = torch.zeros(b, dtype=torch.int64, device=dev)
        graphs[b] = (ids, *capture_graph(lambda ids=ids: vocab_parallel_embedding(
            ids, shard, start, num_embeddings=num_embeddings, impl="torch", group=group,
            check=False)))
    n_tokens = 5 + 6 * (ctx.rank % 2)  # the ranks' counts differ (rank 0: 5 tokens, rank 1: 11)
    bucket = agree_bucket(n_tokens, buckets, group=group, device=dev)
    ids, graph, out = graphs[bucket]
    seq = same_ids((max(buckets),), num_embeddings, dev, seed=5)  # each rank fills its first ids
    ids.zero_()
    ids[:n_tokens] = seq[:n_tokens]
    graph.replay()
    torch.cuda.synchronize()
    common = 5  # positions every rank filled with the same ids: their sum is the lookup
    correct = bool(torch.equal(out[:common], torch.nn.functional.embedding(seq[:common], weight)))
    graphs.clear()
    del graph, out
    gc.collect()
    torch.cuda.synchronize()
    return {"tokens": n_tokens, "own_bucket": pick_bucket(n_tokens, buckets), "bucket": bucket,
            "correct": correct}


# ---------------------------------------------------------------- the Results
def run_provenance(p) -> dict:
    """Provenance of a multi-process run: "2x <GPU>" (NCCL), "N CPU processes (gloo) on <CPU>"."""
    prov = provenance(gpus=p.gpus)
    if p.backend == "gloo":
        prov["device"] = f"{p.world_size} CPU processes (gloo) on {prov['cpu']}"
        prov["driver"] = None
    return prov


def dtensor_worker(ctx, cases=None, max_norm: bool = True, mesh=None) -> dict:
    """The DTensor test's cases (default :data:`~.layouts.DTENSOR_CASES`) on this rank, and its
    max_norm error."""
    mesh = mesh or device_mesh(ctx)
    out = [dtensor_case(mesh, *case[:4], **case[4]) for case in cases or DTENSOR_CASES]
    return {"cases": out, "max_norm_error": max_norm_error(mesh) if max_norm else None}


def _checks(case: dict) -> dict:
    return {k: v for k, v in case.items() if k != "local_weight_shape"}


def dtensor_result(per_rank: list, p) -> Result:
    """The DTensor test's cases as a Result from every rank's :func:`dtensor_worker` (agreeing)."""
    first = per_rank[0]
    if any(list(map(_checks, o["cases"])) != list(map(_checks, first["cases"])) for o in per_rank):
        raise AssertionError(f"the ranks disagree on the DTensor test's checks: "
                             f"{[o['cases'] for o in per_rank]!r}")
    rows = []
    for i, c in enumerate(first["cases"]):
        shards = " | ".join("x".join(map(str, o["cases"][i]["local_weight_shape"]))
                            for o in per_rank)
        rows.append({"case": i, "layout": c["layout"], "ids": "x".join(map(str, c["input_size"])),
                     "table": f"{c['num_embeddings']}x{c['embedding_dim']}",
                     "kwargs": ",".join(f"{k}={v}" for k, v in c["kwargs"].items()) or "-",
                     "forward_ok": c["forward_equal"], "grad_ok": c["grad_equal"],
                     "F.embedding_ok": c["functional_equal"], "fwd_comms": c["forward_comms"],
                     "bwd_comms": c["backward_comms"], "output": c["output_placement"],
                     "full_tensor": " ".join(f"{k}x{v}" for k, v in c["full_tensor_comms"].items()),
                     "shard_per_rank": shards})
    cols = {"case": "", "layout": "", "ids": "", "table": "rows x cols", "kwargs": "",
            "forward_ok": "", "grad_ok": "", "F.embedding_ok": "", "fwd_comms": "count",
            "bwd_comms": "count", "output": "", "full_tensor": "collective x count",
            "shard_per_rank": "rows x cols"}
    title = f"PyTorch's DTensor sharded-embedding test, {p.backend} with {p.world_size} processes"
    res = Result("sharding_dtensor_test", title, cols, rows, provenance=run_provenance(p),
                 params={"backend": p.backend, "world_size": p.world_size})
    res.add_summary("cases_all_equal",
                    all(r["forward_ok"] and r["grad_ok"] and r["F.embedding_ok"] for r in rows))
    res.add_summary("max_norm_error", first["max_norm_error"] or "")
    return res


@experiment("sharding_dtensor_test", gpu_only=False)
def dtensor_experiment(world_size: int | None = None, timeout: float = 120.0) -> Result:
    """PyTorch's DTensor test, live: every case on every rank; rank 0's view (the ranks agree)."""
    p = plan(world_size)
    out = launch(dtensor_worker, p.world_size, backend=p.backend, timeout=timeout)
    return dtensor_result(out, p)


def sweep_result(name: str, title: str, rows: list, p, params: dict) -> Result:
    """A lookup sweep's Result (``sharding_cost``, ``sharding_world_sizes``): rank 0's rows."""
    cols = {"world_size": "ranks", "ids": "ids/step", "dim": "columns", "eager_us": "us",
            "eager_q1_us": "us", "eager_q3_us": "us", "correct": "", "output_bytes": "B",
            "rowwise_lookup_bytes": "B", "colwise_lookup_bytes": "B", "allreduce_bytes": "B",
            "allgather_bytes": "B"}
    res = Result(name, title, cols, rows, provenance=run_provenance(p),
                 params={"backend": p.backend, "processes": p.world_size, "timing": TIMING,
                         **params})
    res.add_summary("all_correct", all(r["correct"] for r in rows))
    return res


def capture_result(name: str, title: str, out: list, p, params: dict,
                   buckets: bool = True) -> Result:
    """A capture experiment's Result from every rank's output: rank 0's rows, every rank's bucket
    agreement (``buckets``); ``sharding_capture``'s summary also holds its row-wise replay."""
    cols = {"world_size": "ranks", "variant": "", "eager_us": "us", "eager_q1_us": "us",
            "eager_q3_us": "us", "replay_us": "us", "replay_q1_us": "us", "replay_q3_us": "us",
            "speedup": "x", "replay_correct": "", "ids": "ids/step", "dim": "columns",
            "output_bytes": "B", "allreduce_bytes": "B", "allgather_bytes": "B"}
    rows = [{k: r[k] for k in cols} for r in out[0]["rows"]]
    res = Result(name, title, cols, rows, provenance=run_provenance(p),
                 params={**params, "timing": TIMING})
    res.add_summary("all_replays_correct", all(r["replay_correct"] for r in rows))
    if buckets:
        agreement = [a for o in out for a in o["agreement"]]
        res.add_summary("bucket_agreement_ok",
                        all(a["correct"] for a in agreement) and bool(agreement))
        res.add_summary("bucket_agreement", agreement)
    rep = {r["variant"]: r for r in res.rows}
    if name == "sharding_capture":
        res.add_summary("rowwise_replay_us", rep["dtensor_rowwise"]["replay_us"], "us")
        res.add_summary("rowwise_speedup", rep["dtensor_rowwise"]["speedup"], "x")
        res.add_summary("numba_over_torch_replay",
                        rep["vocab_numba"]["replay_us"] / rep["vocab_torch"]["replay_us"], "x")
    return res
