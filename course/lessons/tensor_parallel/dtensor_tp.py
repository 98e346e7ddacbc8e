"""Lesson 06's model split with PyTorch's tensor-parallel API (``parallelize_module``), DTensors on every rank.

:func:`tp_plan` is the Megatron layout written for ``transformers``' Llama: ``ColwiseParallel`` for q/k/v and
gate/up (each rank keeps whole output rows: its heads, its slice of the MLP), ``RowwiseParallel`` for o and down
(each rank's output is a partial sum; DTensor all-reduces it when the output must be replicated). The embedding,
norms and LM head are left whole. The projections' outputs are plain local tensors (``use_local_output``), so
transformers' attention sees this rank's heads only (its ``view(..., -1, head_dim)`` counts them), and
:class:`DTensorDecoder` gives lesson 06's :class:`~course.lessons.real_model.decode.StaticDecoder` a static cache of
this rank's KV heads.

Every op on a DTensor weight goes through DTensor's dispatch (sharding propagation, on the host, per op): that is
what eager tensor parallelism costs per token, and what a captured graph removes. With more ranks than KV heads, the
``k_proj``/``v_proj`` rows cannot be split whole: :func:`tp_plan` refuses (the hand-sharded model replicates them).
"""
from __future__ import annotations

from course.lessons.real_model.decode import StaticDecoder


def tp_plan(config, world: int) -> dict:
    """``parallelize_module``'s plan for one decoder layer, keyed by submodule name; refuses what cannot split."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    for what, n in (("query heads", config.num_attention_heads), ("KV heads", config.num_key_value_heads),
                    ("MLP rows", config.intermediate_size)):
        if n % world:
            raise ValueError(f"parallelize_module's ColwiseParallel splits whole rows: {n} {what} do not split over "
                             f"{world} ranks. Use a world size that divides {n}, or the hand-sharded model "
                             "(HandShardedDecoder), which replicates KV heads when there are more ranks than them")
    col, row = ColwiseParallel(), RowwiseParallel()
    return {"self_attn.q_proj": col, "self_attn.k_proj": col, "self_attn.v_proj": col, "self_attn.o_proj": row,
            "mlp.gate_proj": col, "mlp.up_proj": col, "mlp.down_proj": row}


def parallelize(model, mesh):
    """Split every decoder layer of ``model`` over ``mesh`` (a 1-D DeviceMesh) in place; returns the model."""
    from torch.distributed.tensor.parallel import parallelize_module

    plan = tp_plan(model.config, mesh.size())
    for layer in model.model.layers:
        parallelize_module(layer, mesh, plan)
    return model


class DTensorDecoder(StaticDecoder):
    """Lesson 06's capturable step on a model split by :func:`parallelize`: the static cache holds this rank's KV
    heads (``num_key_value_heads / world``)."""

    def __init__(self, model, world: int, max_len: int = 256):
        super().__init__(model, max_len)
        self.world = world
        self.device = model.model.embed_tokens.weight.device  # a plain tensor (the split weights are DTensors)
        self._arange = self._arange.to(self.device)

    def cache_for(self, batch: int):
        """The StaticCache of ``batch`` rows with this rank's KV heads, allocated on first use."""
        if batch not in self.caches:
            from transformers import StaticCache

            c = self.model.config
            cache = StaticCache(config=c, max_cache_len=self.max_len)
            cache.early_initialization(batch, c.num_key_value_heads // self.world,
                                       c.hidden_size // c.num_attention_heads, self.dtype, self.device)
            self.caches[batch] = cache
        return self.caches[batch]
