"""What each worker process runs (started by :func:`~course.core.launch.launch`).

Every function here takes the worker's :class:`~course.core.launch.Context` first and
returns plain picklable data. They live in ``course`` (not in the notebook) because spawned
processes import them by name.

- :func:`dtensor_worker`: PyTorch's DTensor sharded-embedding test cases, both layouts, plus the ``max_norm`` error.
- :func:`lesson_worker`: notebook 05's eager part: the ownership picture, DTensor vs hand-written
  vocab-parallel lookup (Numba and ``F.embedding``), and the bad inputs refused on every rank.
- :func:`full_table`, :func:`same_ids`, and :func:`~course.core.launch.device_mesh` (re-exported): the same table,
  the same ids and a mesh on every rank (lesson 05's experiment cells build their workers from them).
- :func:`bucket_worker`: data-parallel ranks (different batches) pick a shape bucket and (optionally) agree on it
  before the collectives.
"""
from __future__ import annotations

import torch

import course.lessons.sharding.layouts as L
import course.lessons.sharding.vocab_parallel as V
from course.core.launch import device_mesh  # noqa: F401 - lesson 05's cells call it as W.device_mesh


def dtensor_worker(ctx, cases=None, max_norm: bool = True, mesh=None) -> dict:
    """Run the DTensor test's cases (default :data:`~course.lessons.sharding.layouts.DTENSOR_CASES`) on this rank."""
    mesh = mesh or device_mesh(ctx)
    out = [L.dtensor_case(mesh, d, size, n, dim, **kw) for d, size, n, dim, kw in (cases or L.DTENSOR_CASES)]
    return {"cases": out, "max_norm_error": L.max_norm_error(mesh) if max_norm else None}


def full_table(num_embeddings: int, embedding_dim: int, device, dtype=torch.float32):
    """The whole table, ``[num_embeddings, embedding_dim]`` normal values from a fixed seed: the same on every rank."""
    g = torch.Generator().manual_seed(1234)
    return torch.randn(num_embeddings, embedding_dim, generator=g).to(device=device, dtype=dtype)


def same_ids(shape, num_embeddings: int, device, seed: int = 7):
    """Token ids of ``shape`` in ``[0, num_embeddings)`` from ``seed``: every rank draws the same ids."""
    g = torch.Generator().manual_seed(seed)  # every rank draws the same ids
    return torch.randint(0, num_embeddings, shape, generator=g).to(device)


def lesson_worker(ctx, num_embeddings: int = 16, embedding_dim: int = 8, ids_shape=(2, 5),
                  dtensor: bool = True) -> dict:
    """Notebook 05's eager part on this rank (tiny sizes: the Numba kernel runs on the simulator on CPUs).

    ``dtensor=True`` also runs :func:`dtensor_worker` (the DTensor test's cases) in the same processes.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate

    dev = ctx.torch_device
    mesh = device_mesh(ctx)
    weight = full_table(num_embeddings, embedding_dim, dev)
    ids = same_ids(ids_shape, num_embeddings, dev)
    expected = torch.nn.functional.embedding(ids, weight)
    res = {"rank": ctx.rank, "ids": ids.cpu().tolist()}
    # DTensor row-wise, and what this rank holds before the all-reduce
    emb = torch.nn.Embedding(num_embeddings, embedding_dim, device=dev)
    emb.weight = torch.nn.Parameter(weight.clone())
    row = L.shard_embedding(emb, mesh, 0)
    part = row(DTensor.from_local(ids, mesh, [Replicate()], run_check=False))
    local_part = part.to_local()
    res["dtensor_local_nonzero_rows"] = int((local_part != 0).any(-1).sum())
    dt_full = part.full_tensor()
    res["dtensor_equal_local"] = bool(torch.equal(dt_full, expected))
    # the hand-written vocab-parallel lookup, with the course's Numba kernel and with F.embedding
    shard, start = V.local_rows(weight, ctx.rank, ctx.world_size)
    res["shard_rows"] = (start, start + shard.shape[0])
    partial = V.masked_lookup(ids, shard, start, "numba")
    res["masked_positions"] = int((partial == 0).all(-1).sum())
    for impl in V.IMPLS:
        got = V.vocab_parallel_embedding(ids, shard, start, num_embeddings=num_embeddings, impl=impl)
        res[f"{impl}_equal_dtensor"] = bool(torch.equal(got, dt_full))
    # bad inputs: every rank gets the same clear error naming the rank at fault, and nobody hangs
    errors = {}
    bad_ids = ids.clone()
    if ctx.rank == ctx.world_size - 1:
        bad_ids[0, 0] = num_embeddings + 3
    try:
        V.vocab_parallel_embedding(bad_ids, shard, start, num_embeddings=num_embeddings)
    except ValueError as e:
        errors["out_of_range"] = str(e)
    try:
        V.local_rows(full_table(num_embeddings + 1, embedding_dim, dev), ctx.rank, ctx.world_size)
    except ValueError as e:
        errors["rows_not_divisible"] = str(e)
    mixed = shard.double() if ctx.rank == 0 else shard
    try:
        V.vocab_parallel_embedding(ids, mixed, start, num_embeddings=num_embeddings, impl="torch")
    except ValueError as e:
        errors["mismatched_dtypes"] = str(e)
    res["errors"] = errors
    if dtensor:
        res["dtensor"] = dtensor_worker(ctx, mesh=mesh)
    dist.barrier()
    return res


def pick_bucket(n_tokens: int, buckets) -> int:
    """The smallest bucket (captured shape) that holds ``n_tokens``; a clear error if none does."""
    fits = [b for b in sorted(buckets) if b >= n_tokens]
    if not fits:
        raise ValueError(f"{n_tokens} tokens do not fit the largest captured bucket {max(buckets)}: "
                         "add a bigger bucket or split the batch")
    return fits[0]


def agree_bucket(n_tokens: int, buckets, group=None, device="cpu") -> int:
    """Every rank's bucket, made one: all-gather each rank's pick (one small collective), take the largest."""
    import torch.distributed as dist

    mine = torch.tensor([pick_bucket(n_tokens, buckets)], device=device)
    picks = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(picks, mine, group=group)
    return int(torch.stack(picks).max())


def bucket_step(x: torch.Tensor, group=None, say=None) -> None:
    """One bucket's step: an all-reduce per 8-row chunk, so a bigger bucket's graph holds more collectives."""
    import torch.distributed as dist
    chunks = x.split(8)
    for i, chunk in enumerate(chunks):
        if say:
            say(f"bucket {x.shape[0]}: waiting in all-reduce {i + 1} of {len(chunks)}")
        dist.all_reduce(chunk, group=group)


def bucket_worker(ctx, agree: bool, buckets=(8, 16), dim: int = 4, serve_s: float = 3600.0) -> dict:
    """Data-parallel ranks: each holds its own number of tokens; each bucket's step (:func:`bucket_step`) ends in
    collectives over all the ranks (as an expert-parallel layer's all-to-all would).

    ``agree=False``: each rank runs its own bucket's step, then (like a serving engine) stays up waiting
    for the next request for ``serve_s`` seconds. The rank with the bigger bucket waits in a collective
    nobody else joins: forever, until the launcher's time limit kills the run.
    ``agree=True``: the ranks all-gather their picks first (:func:`agree_bucket`) and all run the largest.
    """
    import time

    n_tokens = 5 + 6 * (ctx.rank % 2)  # even ranks: 5 tokens (bucket 8), odd ranks: 11 tokens (bucket 16)
    own = pick_bucket(n_tokens, buckets)
    bucket = agree_bucket(n_tokens, buckets, device=ctx.torch_device) if agree else own
    x = torch.ones(bucket, dim, device=ctx.torch_device)
    bucket_step(x, say=ctx.say)
    if not agree:
        ctx.say(f"finished its bucket-{bucket} step; the engine waits for the next request")
        time.sleep(serve_s)
    return {"rank": ctx.rank, "tokens": n_tokens, "own_bucket": own, "bucket": bucket, "sum": float(x[0, 0])}


def timing_worker(ctx, sleep_s: float = 0.002, repeats: int = 3, inner: int = 2) -> dict:
    """Time an all-reduce whose last rank is slower (sleeps ``sleep_s`` per call) with
    :func:`course.core.timing.time_ranks`: every rank must report the same per-call time, the slowest rank's."""
    import time

    import torch.distributed as dist

    from course.core.timing import time_ranks

    x = torch.ones(4, device=ctx.torch_device)
    slow = ctx.rank == ctx.world_size - 1

    def fn():
        if slow:
            time.sleep(sleep_s)
        dist.all_reduce(x)

    t = time_ranks(fn, warmup=1, repeats=repeats, inner=inner)
    return {"rank": ctx.rank, "median": t.median, "q1": t.q1, "clock": t.clock, "repeats": t.repeats}
