"""The vocab-parallel lookup written by hand: mask, look up locally, zero the masked rows, all-reduce.

This is what Megatron's and vLLM's ``VocabParallelEmbedding`` do, and what DTensor's row-wise
``Shard(0)`` embedding does under the hood (its output is a ``_MaskPartial``):

1. rank ``r`` holds rows ``[start, end)`` of the table (:func:`shard_bounds`);
2. ids outside that range are *masked*: replaced by a safe local id (0) before the lookup;
3. the local lookup runs (the course's Numba kernel, :func:`course.embedding.embedding`, or
   ``F.embedding``), and the masked positions' rows are set to zero;
4. an ``all_reduce`` (sum) adds the ranks' partial outputs: every id was found on exactly one rank,
   so the sum is the full lookup.

Every step is asynchronous (no host reads), so the whole thing can be captured in a CUDA graph.
:func:`check_inputs` is the eager-only guard: it agrees across ranks (one small all-gather) and
raises the same clear error on every rank, naming the rank whose input is bad, instead of letting
one rank leave the collective and the others wait forever.
"""
from __future__ import annotations

import torch

from course.core.agree import exchange

CHECK_S = 60.0  # check_inputs: how long a rank waits for the others before it says one never came

IMPLS = ("numba", "torch")


def shard_bounds(num_embeddings: int, rank: int, world_size: int) -> tuple:
    """Rows ``[start, end)`` that ``rank`` holds; the table's rows must divide by the world size."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size} ranks")
    if num_embeddings % world_size:
        pad = -num_embeddings % world_size
        raise ValueError(f"rank {rank}: the table has {num_embeddings} rows, which do not divide by the world size "
                         f"{world_size}. Pad the vocabulary with {pad} unused row(s) to {num_embeddings + pad} "
                         "(as Megatron and vLLM do), or use a world size that divides it.")
    per = num_embeddings // world_size
    return rank * per, (rank + 1) * per


def local_rows(weight: torch.Tensor, rank: int, world_size: int):
    """This rank's slice of the full table (a contiguous copy) and its first global row."""
    start, end = shard_bounds(weight.shape[0], rank, world_size)
    return weight[start:end].contiguous(), start


def masked_lookup(ids: torch.Tensor, local_weight: torch.Tensor, start: int, impl: str = "numba",
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's partial output: rows it holds, zero rows for ids it does not hold (masked ids)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    end = start + local_weight.shape[0]
    mask = (ids < start) | (ids >= end)
    local = (ids - start).masked_fill_(mask, 0)
    if impl == "numba":
        from course import embedding as E  # the lab 1 kernel (imported late: it imports numba)
        out = E.embedding(local, local_weight, out=out)
    else:
        out = torch.nn.functional.embedding(local, local_weight)
    return out.masked_fill_(mask.unsqueeze(-1), 0)


def check_inputs(ids: torch.Tensor, local_weight: torch.Tensor, num_embeddings: int, group=None) -> None:
    """Eager guard, called by every rank: dtypes, id range and table shape agree, or all ranks raise.

    Each rank checks its own input, then the ranks exchange their verdicts (and dtypes) with
    one ``all_gather_object`` over a gloo group with a time limit of ``CHECK_S`` seconds
    (:func:`course.core.agree.exchange`): if any rank is wrong, every rank raises the same ValueError that
    names it, and a rank that never comes makes the others raise :class:`~course.core.agree.RankLost` in seconds.
    Reads the ids on the host, so never call it inside a captured region.
    """
    import torch.distributed as dist

    rank = dist.get_rank(group)
    problem = None
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64):
        problem = f"ids must be an int32/int64 tensor, got {getattr(ids, 'dtype', type(ids).__name__)}: use ids.long()"
    elif ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_embeddings):
        bad = ids[(ids < 0) | (ids >= num_embeddings)]
        problem = (f"{bad.numel()} id(s) out of range for a table of {num_embeddings} rows (one is {int(bad[0])}); "
                   f"valid ids are 0..{num_embeddings - 1}")
    elif not local_weight.dtype.is_floating_point:
        problem = f"the table must be float32/float16/bfloat16, got {local_weight.dtype}"
    meta = (problem, str(local_weight.dtype), tuple(local_weight.shape[1:]), tuple(ids.shape)
            if isinstance(ids, torch.Tensor) else None)
    metas = exchange(meta, group, timeout_s=CHECK_S, what="check_inputs")  # a rank that never comes: seconds
    lines = [f"rank {r}: {m[0]}" for r, m in enumerate(metas) if m[0]]
    dtypes = {m[1] for m in metas}
    if not lines and len(dtypes) > 1:
        lines = [f"rank {r}: table dtype {m[1]}" for r, m in enumerate(metas)]
        lines.insert(0, "the ranks' tables have different dtypes (the all-reduce would mix them): convert every "
                        "shard to the same dtype")
    if not lines and len({(m[2], m[3]) for m in metas}) > 1:
        lines = ["the ranks disagree on the ids' shape or the table width, so their all-reduce sizes differ: "
                 "every rank must look up the same ids"] + [f"rank {r}: ids {m[3]}, width {m[2]}"
                                                             for r, m in enumerate(metas)]
    if lines:
        raise ValueError(f"vocab-parallel lookup refused (seen from rank {rank}):\n  " + "\n  ".join(lines))


def vocab_parallel_embedding(ids: torch.Tensor, local_weight: torch.Tensor, start: int, *, num_embeddings: int,
                             impl: str = "numba", group=None, check: bool = True, out=None) -> torch.Tensor:
    """The full lookup ``weight[ids]`` from row shards: :func:`masked_lookup` then ``all_reduce`` (sum).

    ``check=True`` runs :func:`check_inputs` first (eager only; pass ``check=False`` when capturing).
    """
    import torch.distributed as dist

    if check:
        check_inputs(ids, local_weight, num_embeddings, group)
    part = masked_lookup(ids, local_weight, start, impl, out=out)
    dist.all_reduce(part, group=group)
    return part
