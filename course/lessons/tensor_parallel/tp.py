"""Lesson 06's model split over ranks (Megatron's layout): by hand, and with PyTorch's
``parallelize_module``.

Each rank keeps its query heads and the KV heads they read (replicated when ranks outnumber KV
heads), its rows of gate/up and the matching columns of o_proj and down_proj (row-parallel: partial
sums, one all-reduce after each); the embedding, norms and LM head stay whole. A step issues ``2 x
layers`` all-reduces and reads nothing on the host, so one CUDA graph per rank holds it, all-reduces
included.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course.lessons.real_model.decode import StaticDecoder


def first_token(device, vocab: int, seed: int = 3):
    """The prompt's one token ``[1]``: the same on every rank (seeded)."""
    return torch.randint(3, vocab, (1,), generator=torch.Generator().manual_seed(seed)).to(device)


def predicted_all_reduces(layers: int, world: int) -> int:
    """All-reduces per step: one after o_proj and one after down_proj per layer (none on 1 rank)."""
    return 0 if world == 1 else 2 * layers


@dataclasses.dataclass(frozen=True)
class HeadPlan:
    """The heads one rank holds: query heads ``q`` and KV heads ``kv``, each ``(start, end)``."""

    q: tuple
    kv: tuple
    replicated_kv: bool  # more ranks than KV heads: other ranks hold this rank's KV heads too

    @property
    def n_q(self) -> int:
        """Query heads on this rank."""
        return self.q[1] - self.q[0]

    @property
    def n_kv(self) -> int:
        """KV heads on this rank."""
        return self.kv[1] - self.kv[0]


def head_plan(heads: int, kv_heads: int, world: int, rank: int) -> HeadPlan:
    """``rank``'s block of query heads and the KV heads they read (replicated past ``kv_heads``
    ranks)."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"need world >= 1 and 0 <= rank < world, got rank {rank} of {world}")
    if heads % world:
        raise ValueError(f"{heads} query heads do not split over {world} ranks: use a world size "
                         f"that divides {heads}")
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a whole number of groups of {kv_heads} KV "
                         "heads")
    if world <= kv_heads and kv_heads % world:
        raise ValueError(f"{kv_heads} KV heads do not split over {world} ranks: use a world size "
                         f"that divides {kv_heads}, or one that {heads} query heads split into "
                         "groups within one KV head")
    group, q_per = heads // kv_heads, heads // world
    if world > kv_heads and group % q_per:
        raise ValueError(f"with {world} ranks each holds {q_per} query heads, which do not divide "
                         f"a KV group of {group}")
    q0 = rank * q_per
    kv = (q0 // group, (q0 + q_per - 1) // group + 1)
    return HeadPlan((q0, q0 + q_per), kv, world > kv_heads)


def mlp_rows(intermediate: int, world: int, rank: int) -> tuple:
    """``(start, end)``: the rows of gate/up (and columns of down) that ``rank`` keeps."""
    if intermediate % world:
        raise ValueError(f"the MLP's {intermediate} rows do not split over {world} ranks")
    n = intermediate // world
    return rank * n, (rank + 1) * n


def shard_layer(layer, plan: HeadPlan, rows: tuple, head_dim: int) -> dict:
    """One decoder layer's weights for one rank, as contiguous copies (the model can be freed)."""
    a, m, d = layer.self_attn, layer.mlp, head_dim
    (q0, q1), (k0, k1), (r0, r1) = plan.q, plan.kv, rows
    qkv = torch.cat([a.q_proj.weight[q0 * d:q1 * d], a.k_proj.weight[k0 * d:k1 * d],
                     a.v_proj.weight[k0 * d:k1 * d]])
    own = {"ln1": layer.input_layernorm.weight, "qkv": qkv, "o": a.o_proj.weight[:, q0 * d:q1 * d],
           "ln2": layer.post_attention_layernorm.weight,
           "gate_up": torch.cat([m.gate_proj.weight[r0:r1], m.up_proj.weight[r0:r1]]),
           "down": m.down_proj.weight[:, r0:r1]}
    return {k: w.detach().clone(memory_format=torch.contiguous_format) for k, w in own.items()}


def rms(x, w, eps: float):
    """RMS norm of ``x`` scaled by ``w`` (Llama's, in float32)."""
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate_half(x):
    """The rotary embedding's half swap."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RankShare:
    """One rank's share of ``model`` among ``world`` (see the module doc), its static KV cache, its
    bytes."""

    def __init__(self, model, rank: int = 0, world: int = 1, group=None, max_len: int = 256,
                 linear: str = "torch"):
        if linear not in ("torch", "gemv"):
            raise ValueError("linear must be 'torch' (cuBLAS) or 'gemv' (lesson 06's Numba "
                             f"GEMV), got {linear!r}")
        c = model.config
        if max_len < 2 or max_len > c.max_position_embeddings:
            raise ValueError(f"max_len must be in 2..{c.max_position_embeddings}, got {max_len}")
        self.rank, self.world, self.group, self.max_len = rank, world, group, max_len
        self.linear = linear
        self.head_dim, self.eps = c.hidden_size // c.num_attention_heads, c.rms_norm_eps
        self.plan = head_plan(c.num_attention_heads, c.num_key_value_heads, world, rank)
        rows = mlp_rows(c.intermediate_size, world, rank)
        self.inter = rows[1] - rows[0]
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        m = model.model
        self.layers = [shard_layer(layer, self.plan, rows, self.head_dim) for layer in m.layers]
        self.embed, self.norm, self.head = (t.weight.detach().clone()
                                            for t in (m.embed_tokens, m.norm, model.lm_head))
        inv_freq = m.rotary_emb.inv_freq.to(device=self.device, dtype=torch.float32)
        steps = torch.arange(max_len, device=self.device, dtype=torch.float32)
        freqs = steps[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)
        self._arange = torch.arange(max_len, device=self.device)
        self.caches: dict = {}

    def cache_for(self, batch: int):
        """This rank's KV cache of ``batch`` rows: per layer ``(k, v)``, ``[B, KV heads, L, d]``."""
        if batch not in self.caches:
            shape = (batch, self.plan.n_kv, self.max_len, self.head_dim)
            self.caches[batch] = [tuple(torch.zeros(shape, device=self.device, dtype=self.dtype)
                                        for _ in "kv") for _ in self.layers]
        return self.caches[batch]

    def reset(self) -> None:
        """Zero every KV cache (queued on the device; no sync)."""
        for cache in self.caches.values():
            for k, v in cache:
                k.zero_()
                v.zero_()

    def tensors(self) -> list:
        """Every weight tensor this rank keeps."""
        return [self.embed, self.norm, self.head] + [t for w in self.layers for t in w.values()]

    def bytes_per_token(self) -> int:
        """Bytes one batch-1 step reads on this rank: its weights, one row of the embedding."""
        total = sum(t.numel() * t.element_size() for t in self.tensors())
        return total - (self.embed.shape[0] - 1) * self.embed.shape[1] * self.embed.element_size()

    def matmul(self, x, w):
        """``x @ w.T``: cuBLAS, or lesson 06's Numba GEMV (imported on use: Numba's path)."""
        if self.linear == "gemv":
            from course.lessons.real_model.gemv import linear
            return linear(x, w)
        return F.linear(x, w)

    def all_reduce(self, x):
        """The ranks' partial sums of ``x``, added in place (nothing on one rank)."""
        if self.world > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def example_args(self, batch: int = 1, position: int = 0, seed: int = 0):
        """``(ids, position)`` device tensors for ``batch`` rows at ``position``, the same on every
        rank."""
        if not 0 <= position < self.max_len:
            raise ValueError(f"position must be in 0..{self.max_len - 1}, got {position}")
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(3, self.embed.shape[0], (batch, 1), generator=g)
        return ids.to(self.device), torch.full((1,), position, dtype=torch.long, device=self.device)


class HandShardedDecoder(RankShare):
    """Lesson 06's step on a rank's share: q/k/v, gate/up column-parallel; o, down row-parallel."""

    def step(self, ids, position):
        """Logits ``[B, vocab]`` (float32) of ``ids`` ``[B, 1]`` at ``position`` ``[1]``, on every
        rank."""
        if ids.dim() != 2 or ids.shape[1] != 1 or position.shape != (1,):
            raise ValueError(f"step takes ids [B, 1] and position [1] (device tensors), got ids "
                             f"{tuple(ids.shape)} and position {tuple(position.shape)}")
        b, d, nq, nkv = ids.shape[0], self.head_dim, self.plan.n_q, self.plan.n_kv
        x = F.embedding(ids, self.embed)  # [B, 1, hidden], whole on every rank
        cos = self.cos.index_select(0, position).view(1, 1, 1, d)
        sin = self.sin.index_select(0, position).view(1, 1, 1, d)
        mask = (self._arange <= position).view(1, 1, 1, self.max_len)
        for w, (kc, vc) in zip(self.layers, self.cache_for(b)):
            qkv = self.matmul(rms(x, w["ln1"], self.eps), w["qkv"])
            q, k, v = (t.view(b, 1, -1, d).transpose(1, 2)  # this rank's heads only
                       for t in qkv.split([nq * d, nkv * d, nkv * d], -1))
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
            kc.index_copy_(2, position, k)  # this rank's KV heads, at the step's position
            vc.index_copy_(2, position, v)
            keys, values = kc, vc
            if nq != nkv:  # more query heads than KV heads here: each KV head serves its group
                keys, values = (c.repeat_interleave(nq // nkv, 1) for c in (kc, vc))
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=d ** -0.5)
            o = o.transpose(1, 2).reshape(b, 1, nq * d)
            x = x + self.all_reduce(self.matmul(o, w["o"]))  # each rank's partial sum, all-reduced
            g, u = self.matmul(rms(x, w["ln2"], self.eps), w["gate_up"]).split(self.inter, -1)
            x = x + self.all_reduce(self.matmul(F.silu(g) * u, w["down"]))
        return F.linear(rms(x, self.norm, self.eps), self.head)[:, -1].float()


def tp_plan(config, world: int) -> dict:
    """``parallelize_module``'s plan for one decoder layer: Megatron's split, refused where heads do
    not split."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    c = config
    for what, n in (("query heads", c.num_attention_heads), ("KV heads", c.num_key_value_heads),
                    ("MLP rows", c.intermediate_size)):
        if n % world:
            raise ValueError(f"parallelize_module's ColwiseParallel splits whole rows: {n} {what} "
                             f"do not split over {world} ranks. Use a world size that divides "
                             f"{n}, or the hand-sharded model (HandShardedDecoder), which "
                             "replicates KV heads when there are more ranks than them")
    col, row = ColwiseParallel(), RowwiseParallel()  # whole output rows; input columns: partials
    return {"self_attn.q_proj": col, "self_attn.k_proj": col, "self_attn.v_proj": col,
            "self_attn.o_proj": row, "mlp.gate_proj": col, "mlp.up_proj": col, "mlp.down_proj": row}


def parallelize(model, mesh):
    """Split every decoder layer of ``model`` over ``mesh`` in place; its config then counts this
    rank's KV heads."""
    from torch.distributed.tensor.parallel import parallelize_module

    plan = tp_plan(model.config, mesh.size())
    for layer in model.model.layers:
        parallelize_module(layer, mesh, plan)
    model.config.num_key_value_heads //= mesh.size()  # what this rank's static KV cache holds
    return model


class DTensorDecoder(StaticDecoder):
    """Lesson 06's capturable step on a model split by :func:`parallelize` (DTensor weights)."""

    def __init__(self, model, world: int, max_len: int = 256):
        super().__init__(model, max_len)
        self.world = world
        self.device = model.model.embed_tokens.weight.device  # plain (the split weights: DTensors)
        self._arange = self._arange.to(self.device)
