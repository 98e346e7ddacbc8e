"""The vocab-parallel lookup written by hand (Megatron's and vLLM's ``VocabParallelEmbedding``,
DTensor's row-wise).

Rank ``r`` holds rows ``[start, end)`` (:func:`shard_bounds`); ids outside are masked (a safe local
id, 0), looked up (the course's Numba kernel or ``F.embedding``), their rows zeroed, and one
``all_reduce`` (sum) adds the ranks' parts: every id was found on exactly one rank. Nothing reads
the host, so the whole lookup can be captured. :func:`check_inputs` is the eager guard: each rank
judges its input by named rules, the ranks exchange their verdicts
(:func:`course.core.agree.exchange`) and every rank raises the same error, naming the rank at fault.
Data-parallel ranks with different batches agree on one shape bucket the same way
(:func:`agree_bucket`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from course.core.agree import exchange
from course.core.harness import Rule, judge

CHECK_S = 60.0  # check_inputs: how long a rank waits for the others before it says one never came

IMPLS = ("numba", "torch")


def shard_bounds(num_embeddings: int, rank: int, world_size: int) -> tuple:
    """Rows ``[start, end)`` that ``rank`` holds; the table's rows must divide by the world size."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size} ranks")
    if num_embeddings % world_size:
        pad = -num_embeddings % world_size
        raise ValueError(f"rank {rank}: the table has {num_embeddings} rows, which do not divide "
                         f"by the world size {world_size}. Pad the vocabulary with {pad} unused "
                         f"row(s) to {num_embeddings + pad} (as Megatron and vLLM do), or use a "
                         "world size that divides it.")
    per = num_embeddings // world_size
    return rank * per, (rank + 1) * per


def local_rows(weight: torch.Tensor, rank: int, world_size: int):
    """This rank's slice of the full table (a contiguous copy) and its first global row."""
    start, end = shard_bounds(weight.shape[0], rank, world_size)
    return weight[start:end].contiguous(), start


def masked_lookup(ids: torch.Tensor, local_weight: torch.Tensor, start: int, impl: str = "numba",
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's partial output: the rows it holds, zero rows for the ids it masks."""
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


def _ids_problem(c) -> str:
    ids = c[0]
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64):
        got = getattr(ids, "dtype", type(ids).__name__)
        return f"ids must be an int32/int64 tensor, got {got}: use ids.long()"
    return ""


def _range_problem(c) -> str:
    ids, _, num = c
    if not ids.numel() or (int(ids.min()) >= 0 and int(ids.max()) < num):
        return ""
    bad = ids[(ids < 0) | (ids >= num)]
    return (f"{bad.numel()} id(s) out of range for a table of {num} rows (one is {int(bad[0])}); "
            f"valid ids are 0..{num - 1}")


INPUT_RULES = [  # each rank's own input: (ids, local_weight, num_embeddings)
    Rule("ids_dtype", "", _ids_problem), Rule("id_range", "", _range_problem),
    Rule("table_dtype", "", lambda c: not c[1].dtype.is_floating_point and (
        f"the table must be float32/float16/bfloat16, got {c[1].dtype}")),
]


def _per_rank(metas, what: str, key) -> str:
    """Each rank's ``key`` (one line each) when the ranks' keys differ, else ''."""
    if len({key(m) for m in metas}) < 2:
        return ""
    return "".join(f"\n  rank {r}: {what} {key(m)}" for r, m in enumerate(metas))


AGREE_RULES = [  # every rank's (outcome, table dtype, ids shape and table width), in rank order
    Rule("rank_input", "", lambda metas: "\n  ".join(
        f"rank {r}: {m[0].message}" for r, m in enumerate(metas) if not m[0].ok)),
    Rule("mixed_dtypes", "the ranks' tables have different dtypes (the all-reduce would mix them): "
         "convert every shard to the same dtype",
         lambda m: _per_rank(m, "table dtype", lambda x: x[1])),
    Rule("shapes", "the ranks disagree on the ids' shape or the table width, so their all-reduce "
         "sizes differ: every rank must look up the same ids",
         lambda m: _per_rank(m, "ids and width", lambda x: x[2])),
]


def check_inputs(ids: torch.Tensor, local_weight: torch.Tensor, num_embeddings: int,
                 group=None) -> None:
    """Eager guard, called by every rank: ids, the tables' dtypes and shapes agree, or every rank
    raises the same ValueError naming the rank at fault (within ``CHECK_S`` seconds, a rank that
    never comes: :class:`RankLost`). Reads the ids on the host: never inside a capture."""
    mine = judge((ids, local_weight, num_embeddings), INPUT_RULES)
    shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else None
    meta = (mine, str(local_weight.dtype), (shape, tuple(local_weight.shape[1:])))
    every = exchange(meta, group, timeout_s=CHECK_S, what="check_inputs")
    out = judge(every, AGREE_RULES)
    if not out.ok:
        raise ValueError("vocab-parallel lookup refused (seen from rank "
                         f"{dist.get_rank(group)}):\n  {out.message}")


def vocab_parallel_embedding(ids: torch.Tensor, local_weight: torch.Tensor, start: int, *,
                             num_embeddings: int, impl: str = "numba", group=None,
                             check: bool = True, out=None) -> torch.Tensor:
    """The full lookup ``weight[ids]`` from row shards: :func:`masked_lookup`, then ``all_reduce``
    (sum); ``check=True`` runs :func:`check_inputs` first (eager only: not when capturing)."""
    if check:
        check_inputs(ids, local_weight, num_embeddings, group)
    part = masked_lookup(ids, local_weight, start, impl, out=out)
    dist.all_reduce(part, group=group)
    return part


def pick_bucket(n_tokens: int, buckets) -> int:
    """The smallest bucket (captured shape) that holds ``n_tokens``; a clear error if none does."""
    fits = [b for b in sorted(buckets) if b >= n_tokens]
    if not fits:
        raise ValueError(f"{n_tokens} tokens do not fit the largest captured bucket "
                         f"{max(buckets)}: add a bigger bucket or split the batch")
    return fits[0]


def agree_bucket(n_tokens: int, buckets, group=None, device="cpu") -> int:
    """Every rank's bucket, made one: all-gather each rank's pick (one small collective), take the
    largest."""
    mine = torch.tensor([pick_bucket(n_tokens, buckets)], device=device)
    picks = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(picks, mine, group=group)
    return int(torch.stack(picks).max())


def bucket_step(x: torch.Tensor, group=None, say=None) -> None:
    """One bucket's step: an all-reduce per 8-row chunk, so a bigger bucket's graph holds more
    collectives."""
    chunks = x.split(8)
    for i, chunk in enumerate(chunks):
        if say:
            say(f"bucket {x.shape[0]}: waiting in all-reduce {i + 1} of {len(chunks)}")
        dist.all_reduce(chunk, group=group)
