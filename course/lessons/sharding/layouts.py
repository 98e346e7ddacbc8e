"""Row-wise and column-wise sharded embeddings with DTensor: PyTorch's DTensor test, and who holds
what.

PyTorch's DTensor sharded-embedding test (``test/distributed/_tensor/test_embedding_ops.py``) shards
an ``nn.Embedding`` over a device mesh, row-wise (``Shard(0)``: each rank holds some rows, i.e. some
token ids) or column-wise (``Shard(1)``: each rank holds some columns of every row), and checks
against a local copy:

- forward, backward gradients and ``F.embedding`` equal the local table's;
- ``CommDebugMode`` counts no communication in the forward or the backward;
- row-wise output is a ``_MaskPartial`` (each rank has zero rows for ids it does not hold), and
  ``full_tensor()`` adds the ranks' parts with one ``all_reduce``; column-wise output is
  ``Shard(2)`` and ``full_tensor()`` is one ``all_gather_into_tensor``;
- ``max_norm`` raises ``NotImplementedError`` (``aten.embedding_renorm_`` has no sharding strategy).

:func:`dtensor_case` runs one case inside a worker and returns plain numbers; :data:`DTENSOR_CASES`
lists the DTensor test's cases; :func:`chunk_bounds` and :func:`ownership` draw who holds which
rows, columns and ids; :func:`comm_bytes` says how many bytes each collective moves.
"""
from __future__ import annotations

import warnings

import torch

# (shard_dim, input_size, num_embeddings, embedding_dim, kwargs): the DTensor test's cases, in order
DTENSOR_CASES = (
    (1, (5, 4), 17, 12, {}), (1, (6, 7, 6), 21, 11, {}), (1, (8, 6, 5, 4), 23, 13, {}),
    (1, (8, 6, 5, 4, 7), 23, 16, {}), (1, (4,), 15, 14, {}),
    (1, (34,), 15, 14, {"padding_idx": 10}), (1, (8, 6, 5, 4), 23, 13, {"padding_idx": 12}),
    (0, (5, 12), 16, 22, {}), (0, (6, 7, 6), 13, 22, {}), (0, (34,), 15, 14, {"padding_idx": 10}),
)
MAX_NORM_CASE = (1, (8, 6, 5, 4), 23, 13, {"padding_idx": 12, "max_norm": 2.0})
LAYOUTS = {0: "row-wise Shard(0)", 1: "column-wise Shard(1)"}


def shard_embedding(module: torch.nn.Module, mesh, shard_dim: int) -> torch.nn.Module:
    """Replace every parameter of ``module`` by a DTensor sharded on ``shard_dim`` (the test's
    ``_apply_sharding``)."""
    from torch.distributed.tensor import Shard, distribute_module, distribute_tensor

    def shard_params(name, mod, device_mesh):
        for pname, param in list(mod.named_parameters(recurse=False)):
            shard = distribute_tensor(param, device_mesh, [Shard(shard_dim)])
            mod.register_parameter(pname, torch.nn.Parameter(shard))

    return distribute_module(module, mesh, shard_params)


def _counts(mode) -> dict:
    """CommDebugMode counts as {op name: count}."""
    return {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}


def dtensor_case(mesh, shard_dim: int, input_size, num_embeddings: int, embedding_dim: int,
                 **kwargs) -> dict:
    """One case of PyTorch's DTensor test on this rank; returns what it checked, as plain numbers
    and flags."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    dev = mesh.device_type
    torch.manual_seed(0)
    local = torch.nn.Embedding(num_embeddings, embedding_dim, device=dev, **kwargs)
    sharded = torch.nn.Embedding(num_embeddings, embedding_dim, device=dev, **kwargs)
    sharded.weight = torch.nn.Parameter(local.weight.clone().detach())
    sharded = shard_embedding(sharded, mesh, shard_dim)
    torch.manual_seed(10)
    inp = torch.randint(0, num_embeddings, tuple(input_size), device=dev)
    target = torch.empty(*inp.size(), embedding_dim, dtype=torch.float, device=dev).random_(0, 1)
    dist_inp = distribute_tensor(inp, mesh, [Replicate()])
    with CommDebugMode() as fwd:
        dist_out = sharded(dist_inp)
    placement = type(dist_out.placements[0]).__name__
    if placement == "Shard":
        placement = f"Shard({dist_out.placements[0].dim})"
    with CommDebugMode() as whole:
        output = dist_out.full_tensor()
    local_out = local(inp)
    loss = torch.nn.CrossEntropyLoss()
    loss(local_out, target).backward()
    emb_loss = loss(output, target)
    with CommDebugMode() as bwd, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook")  # DTensor's hooks: harmless
        emb_loss.backward()
    grad = sharded.weight.grad.full_tensor()
    f_local = torch.nn.functional.embedding(inp, local.weight, **kwargs)
    replicated = DTensor.from_local(inp, mesh, [Replicate()], run_check=False)
    f_sharded = torch.nn.functional.embedding(replicated, sharded.weight, **kwargs).full_tensor()
    pad = kwargs.get("padding_idx")
    return {
        "layout": LAYOUTS[shard_dim], "input_size": tuple(input_size),
        "num_embeddings": num_embeddings, "embedding_dim": embedding_dim, "kwargs": dict(kwargs),
        "forward_equal": bool(torch.equal(output, local_out)),
        "grad_equal": bool(torch.allclose(grad, local.weight.grad)),
        "functional_equal": bool(torch.equal(f_sharded, f_local)),
        "padding_row_grad_zero": None if pad is None else bool((grad[pad] == 0).all()),
        "forward_comms": fwd.get_total_counts(), "backward_comms": bwd.get_total_counts(),
        "full_tensor_comms": _counts(whole), "output_placement": placement,
        "local_weight_shape": tuple(sharded.weight.to_local().shape),
    }


def max_norm_error(mesh) -> str:
    """The DTensor test's ``max_norm`` case: the error DTensor raises, as text ('' if it did not
    raise)."""
    shard_dim, size, num, dim, kwargs = MAX_NORM_CASE
    try:
        dtensor_case(mesh, shard_dim, size, num, dim, **kwargs)
    except NotImplementedError as e:
        return str(e).strip().splitlines()[0]
    return ""


def chunk_bounds(n: int, world_size: int) -> list:
    """How ``Shard`` splits ``n`` rows (or columns) over ranks, like ``torch.chunk``: ``[(start,
    end), ...]``."""
    per = -(-n // world_size) if n else 0
    return [(min(r * per, n), min((r + 1) * per, n)) for r in range(world_size)]


def ownership(num_embeddings: int, embedding_dim: int, world_size: int, ids=None) -> str:
    """A text picture: which rows (row-wise) or columns (column-wise) each rank holds, and which ids
    it masks."""
    lines = [f"table {num_embeddings} rows x {embedding_dim} columns over {world_size} ranks",
             "row-wise Shard(0): each rank holds whole rows (a range of token ids)"]
    rows = chunk_bounds(num_embeddings, world_size)
    id_list = None if ids is None else [int(i) for i in torch.as_tensor(ids).reshape(-1).tolist()]
    for r, (a, b) in enumerate(rows):
        line = f"  rank {r}: rows {a:>3}..{b - 1:<3} ({b - a} rows x {embedding_dim} cols)"
        if id_list is not None:
            mine = [i for i in id_list if a <= i < b]
            line += f" | looks up {mine}, masks {len(id_list) - len(mine)} id(s) -> zero rows"
        lines.append(line)
    if id_list is not None:
        lines.append("  full_tensor(): all_reduce(sum) adds the ranks' outputs; each id is "
                     "non-zero on one rank")
    lines.append("column-wise Shard(1): each rank holds some columns of every row")
    for r, (a, b) in enumerate(chunk_bounds(embedding_dim, world_size)):
        lines.append(f"  rank {r}: cols {a:>3}..{b - 1:<3} (all {num_embeddings} rows x {b - a} "
                     "cols)"
                     + (" | looks up every id, masks none" if id_list is not None else ""))
    if id_list is not None:
        lines.append("  full_tensor(): all_gather puts the ranks' column blocks side by side")
    return "\n".join(lines)


def comm_bytes(n_ids: int, embedding_dim: int, world_size: int, element_size: int = 4) -> dict:
    """Bytes per rank: the local lookup's reads and writes, and what each collective sends (ring
    algorithms).

    Row-wise all-reduce of the full ``[n_ids, D]`` output: ``2 (W-1)/W`` of it per rank. Column-wise
    all-gather of ``[n_ids, D/W]`` blocks: ``(W-1)/W`` of the full output per rank.
    """
    out = n_ids * embedding_dim * element_size
    w = world_size
    return {
        "output_bytes": out,
        "rowwise_lookup_bytes": 2 * out,  # every position reads a row (or a zero) and writes it
        "colwise_lookup_bytes": 2 * out // w,
        "allreduce_bytes": int(2 * (w - 1) / w * out),
        "allgather_bytes": int((w - 1) / w * out),
    }
