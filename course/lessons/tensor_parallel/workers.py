"""What each rank runs in lesson 08 (started by :func:`~course.core.launch.launch`; spawned processes
import these functions by name).

- :func:`make_decoder`: one variant of the split model on this rank (``dtensor``: ``parallelize_module``;
  ``hand``: plain tensors and explicit all-reduces; ``hand_gemv``: the same with lesson 06's Numba GEMV).
- :func:`tokens_worker`: the correctness run: TP=1 on this rank's own full model (the reference), then the split
  model, eager and captured (lesson 06's :class:`~course.lessons.real_model.handgraph.GraphedDecode`, one graph per
  rank, the all-reduces inside it): greedy tokens, teacher-forced logits, all-reduces counted in the eager step
  and in the graph, and every rank's tokens gathered so the ranks can be compared.
"""
from __future__ import annotations

import gc

import torch

VARIANTS = ("dtensor", "hand", "hand_gemv")


def make_decoder(variant: str, model, ctx, world: int | None = None, group=None, max_len: int = 128):
    """The decode step of ``variant`` over the first ``world`` ranks (default all) on this rank; ``model`` is this
    rank's full model (every rank built it from the same seed). ``dtensor`` splits ``model`` in place."""
    from course.lessons.real_model.decode import StaticDecoder
    from course.lessons.tensor_parallel.dtensor_tp import DTensorDecoder, parallelize
    from course.lessons.tensor_parallel.shard import HandShardedDecoder

    import warnings

    world = world or ctx.world_size
    warnings.filterwarnings("ignore", message="For backward hooks to be called")  # DTensor's hooks on HF's outputs
    if variant == "dtensor":
        if world == 1:
            return StaticDecoder(model, max_len)
        from course.core.launch import device_mesh
        return DTensorDecoder(parallelize(model, device_mesh(ctx, group)), world, max_len)
    if variant in ("hand", "hand_gemv"):
        return HandShardedDecoder(model, ctx.rank, world, group, max_len, "gemv" if variant == "hand_gemv" else "torch")
    raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")


def first_token(device, vocab: int, seed: int = 3):
    """The prompt's one token ``[1]``: the same on every rank (seeded)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (1,), generator=g).to(device)


def gather(ctx, obj, group=None) -> list:
    """Every rank's ``obj`` (picklable), in rank order, on every rank."""
    import torch.distributed as dist

    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def tokens_worker(ctx, variants=("hand",), size="tiny", n_tokens: int = 8, capture: bool = True,
                  max_len: int = 96) -> list:
    """:func:`variant_tokens` for each of ``variants``, in one launch; a list of their dicts."""
    return [variant_tokens(ctx, v, size, n_tokens, capture, max_len) for v in variants]


def variant_tokens(ctx, variant: str = "hand", size="tiny", n_tokens: int = 8, capture: bool = True,
                   max_len: int = 96) -> dict:
    """The correctness run of ``variant`` on this rank (see the module doc). Returns plain data: tokens of TP=1,
    eager TP and captured TP, the relative logit differences, the all-reduces counted, whether every rank agreed.
    A capture the simulator does not model (DTensor) is skipped with the reason in ``capture_skipped``."""
    from course.lessons.real_model.decode import StaticDecoder
    from course.lessons.real_model.generate import forced_logits, greedy, tolerance
    from course.lessons.real_model.handgraph import GraphedDecode
    from course.lessons.real_model.model import build_model
    from course.lessons.tensor_parallel.count import all_reduces, eager_collectives, graph_collectives

    model = build_model(size, device=ctx.torch_device)
    first = first_token(ctx.torch_device, model.config.vocab_size)
    ref = StaticDecoder(model, max_len)
    want = greedy(ref.step, first, n_tokens)  # TP=1 on this rank's own full copy: the reference
    fed = torch.cat([first.view(1, 1), want[:, :-1]], dim=1)
    want_logits = forced_logits(ref.step, fed)
    dtype = next(model.parameters()).dtype
    del ref
    dec = make_decoder(variant, model, ctx, max_len=max_len)
    eager = greedy(dec.step, first, n_tokens)
    logits = forced_logits(dec.step, fed)
    ids, pos = dec.example_args(1, 0)
    counted = eager_collectives(lambda: dec.step(ids, pos))
    scale = float(want_logits.abs().max()) or 1.0
    res = {"rank": ctx.rank, "variant": variant, "dtype": str(dtype).replace("torch.", ""),
           "tp1": want[0].tolist(), "eager": eager[0].tolist(),
           "eager_logit_diff": float((logits - want_logits).abs().max()) / scale, "tolerance": tolerance(dtype),
           "eager_collectives": counted, "eager_all_reduces": all_reduces(counted)}
    from course.core.runtime import runtime

    if capture and variant == "dtensor" and ctx.world_size > 1 and not runtime().on_gpu:
        res["capture_skipped"] = ("the simulator does not capture DTensor programs (a DTensor op becomes several "
                                  "ops on its shards, dispatched on the host); captured on GPUs only")
        capture = False
    if capture:
        dec.reset()
        graphed = GraphedDecode(dec)
        res["graph_all_reduces"] = all_reduces(graph_collectives(graphed.graph))
        dec.reset()
        res["captured"] = graphed.generate(first, n_tokens)[0].tolist()
        dec.reset()
        glogits = forced_logits(graphed.step, fed)
        res["captured_logit_diff"] = float((glogits - want_logits).abs().max()) / scale
        del graphed  # free the graph before the process group goes (NCCL teardown with live graphs has hung)
    gc.collect()
    from course.core.runtime import synchronize
    synchronize()
    every = gather(ctx, (res["eager"], res.get("captured")))
    res["ranks_agree"] = all(e == every[0] for e in every)
    return res
