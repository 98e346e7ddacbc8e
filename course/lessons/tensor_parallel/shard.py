"""Lesson 06's model split by hand over ``world`` ranks: plain tensors, two explicit all-reduces per layer.

What serving engines do (Megatron's layout): each rank keeps

- its **query heads** (``heads / world`` of them) and the **KV heads** they read, in one stacked q/k/v weight
  (column-parallel: whole rows of the projections); with more ranks than KV heads, each KV head is *replicated* on
  the ranks whose query heads read it (TinyLlama has 4 KV heads: at 8 ranks, two ranks hold each);
- its slice of the **MLP** (``intermediate / world`` rows of gate and up, stacked; the same columns of down);
- the columns of ``o_proj`` and ``down_proj`` that match its heads and its MLP slice (row-parallel): each rank's
  output is a *partial sum*, and one ``dist.all_reduce`` after each makes it whole;
- the embedding, the norms and the LM head whole (replicated): no collective in the head.

So a decode step issues ``2 x layers`` all-reduces (:func:`predicted_all_reduces`), and reads ``1 / world`` of the
layers' weights per rank plus the replicated parts (:meth:`HandShardedDecoder.bytes_per_token`). The step takes the
same device tensors as lesson 06's :class:`~course.lessons.real_model.decode.StaticDecoder` (``ids [B, 1]``,
``position [1]``), keeps a static KV cache holding this rank's KV heads only, and reads nothing on the host: one
CUDA graph per rank holds it, all-reduces included. ``linear="gemv"`` runs the batch-1 products through lesson 06's
Numba GEMV (``torch.ops.course.gemv``) on each shard.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F


def predicted_all_reduces(layers: int, world: int) -> int:
    """All-reduces per decode step of the hand-sharded model: one after ``o_proj`` and one after ``down_proj`` per
    layer; none in the head (the LM head is replicated); none at all on one rank."""
    return 0 if world == 1 else 2 * layers


@dataclasses.dataclass(frozen=True)
class HeadPlan:
    """Which heads one rank holds: query heads ``q`` = ``(start, end)``, KV heads ``kv`` = ``(start, end)``."""

    q: tuple
    kv: tuple
    replicated_kv: bool  # True when more ranks than KV heads: this rank's KV heads are held by other ranks too

    @property
    def n_q(self) -> int:
        """Query heads on this rank."""
        return self.q[1] - self.q[0]

    @property
    def n_kv(self) -> int:
        """KV heads on this rank."""
        return self.kv[1] - self.kv[0]


def head_plan(heads: int, kv_heads: int, world: int, rank: int) -> HeadPlan:
    """The heads of ``rank`` among ``world``: a contiguous block of query heads and the KV heads they read.

    Needs ``heads % world == 0``. With ``world <= kv_heads`` (and ``kv_heads % world == 0``) the KV heads split
    evenly; with more ranks than KV heads, each rank keeps the one KV head its query heads share (replicated).
    """
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"need world >= 1 and 0 <= rank < world, got rank {rank} of {world}")
    if heads % world:
        raise ValueError(f"{heads} query heads do not split over {world} ranks: use a world size that divides {heads}")
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a whole number of groups of {kv_heads} KV heads")
    if world <= kv_heads and kv_heads % world:
        raise ValueError(f"{kv_heads} KV heads do not split over {world} ranks: use a world size that divides "
                         f"{kv_heads}, or one that {heads} query heads split into groups within one KV head")
    group = heads // kv_heads  # query heads per KV head
    q_per = heads // world
    if world > kv_heads and group % q_per:
        raise ValueError(f"with {world} ranks each holds {q_per} query heads, which do not divide a KV group of {group}")
    q0 = rank * q_per
    kv0, kv1 = q0 // group, (q0 + q_per - 1) // group + 1
    return HeadPlan((q0, q0 + q_per), (kv0, kv1), world > kv_heads)


def mlp_rows(intermediate: int, world: int, rank: int) -> tuple:
    """``(start, end)``: the rows of gate/up (and columns of down) that ``rank`` keeps."""
    if intermediate % world:
        raise ValueError(f"the MLP's {intermediate} rows do not split over {world} ranks")
    n = intermediate // world
    return rank * n, (rank + 1) * n


def shard_layer(layer, plan: HeadPlan, rows: tuple, head_dim: int) -> dict:
    """One decoder layer's weights for one rank, as plain contiguous tensors (copies; the model can be freed)."""
    a, m = layer.self_attn, layer.mlp
    (q0, q1), (k0, k1) = plan.q, plan.kv
    d = head_dim
    qkv = torch.cat([a.q_proj.weight[q0 * d:q1 * d], a.k_proj.weight[k0 * d:k1 * d], a.v_proj.weight[k0 * d:k1 * d]])
    return {"ln1": layer.input_layernorm.weight.detach().clone(), "qkv": qkv.detach().contiguous(),
            "o": a.o_proj.weight[:, q0 * d:q1 * d].detach().contiguous(),
            "ln2": layer.post_attention_layernorm.weight.detach().clone(),
            "gate_up": torch.cat([m.gate_proj.weight[rows[0]:rows[1]], m.up_proj.weight[rows[0]:rows[1]]]).detach()
            .contiguous(),
            "down": m.down_proj.weight[:, rows[0]:rows[1]].detach().contiguous()}


def _rms(x, w, eps: float):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class HandShardedDecoder:
    """The decode step of lesson 06's model on one rank of ``world`` (see the module doc); ``group``: the process
    group of the ranks that share the model (None: the default group)."""

    def __init__(self, model, rank: int = 0, world: int = 1, group=None, max_len: int = 256, linear: str = "torch"):
        if linear not in ("torch", "gemv"):
            raise ValueError(f"linear must be 'torch' (cuBLAS) or 'gemv' (lesson 06's Numba GEMV), got {linear!r}")
        c = model.config
        if max_len < 2 or max_len > c.max_position_embeddings:
            raise ValueError(f"max_len must be in 2..{c.max_position_embeddings}, got {max_len}")
        self.rank, self.world, self.group, self.max_len, self.linear = rank, world, group, max_len, linear
        self.layers_n = c.num_hidden_layers
        self.head_dim = c.hidden_size // c.num_attention_heads
        self.eps = c.rms_norm_eps
        self.plan = head_plan(c.num_attention_heads, c.num_key_value_heads, world, rank)
        rows = mlp_rows(c.intermediate_size, world, rank)
        self.inter = rows[1] - rows[0]
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.layers = [shard_layer(layer, self.plan, rows, self.head_dim) for layer in model.model.layers]
        self.embed = model.model.embed_tokens.weight.detach().clone()
        self.norm = model.model.norm.weight.detach().clone()
        self.head = model.lm_head.weight.detach().clone()
        inv_freq = model.model.rotary_emb.inv_freq.to(device=self.device, dtype=torch.float32)
        freqs = torch.arange(max_len, device=self.device, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)
        self._arange = torch.arange(max_len, device=self.device)
        self.caches: dict = {}

    # ------------------------------------------------------------------ bookkeeping
    def cache_for(self, batch: int):
        """This rank's static KV cache for ``batch`` rows: per layer ``(k, v)``, each ``[B, kv_heads_here, L, d]``."""
        if batch not in self.caches:
            shape = (batch, self.plan.n_kv, self.max_len, self.head_dim)
            self.caches[batch] = [(torch.zeros(shape, device=self.device, dtype=self.dtype),
                                   torch.zeros(shape, device=self.device, dtype=self.dtype)) for _ in self.layers]
        return self.caches[batch]

    def reset(self) -> None:
        """Zero every KV cache (queued on the device; no sync)."""
        for cache in self.caches.values():
            for k, v in cache:
                k.zero_()
                v.zero_()

    def tensors(self) -> list:
        """Every weight tensor this rank keeps."""
        return [self.embed, self.norm, self.head] + [t for layer in self.layers for t in layer.values()]

    def bytes_per_token(self) -> int:
        """Bytes one batch-1 step must read on this rank: its weights, the embedding table but for the one row."""
        row = self.embed.shape[1] * self.embed.element_size()
        total = sum(t.numel() * t.element_size() for t in self.tensors())
        return total - self.embed.numel() * self.embed.element_size() + row

    def _linear(self, x, w):
        if self.linear == "gemv":
            from course.lessons.real_model.gemv import linear
            return linear(x, w)
        return F.linear(x, w)

    def _all_reduce(self, x):
        if self.world > 1:
            import torch.distributed as dist
            dist.all_reduce(x, group=self.group)  # the partial sums of every rank, added in place
        return x

    # ------------------------------------------------------------------ the step
    def step(self, ids, position):
        """Logits ``[B, vocab]`` (float32) after ``ids`` (int64 ``[B, 1]``) at ``position`` (int64 ``[1]``).

        The same on every rank (the LM head is replicated and its input is whole after the all-reduces).
        """
        if ids.dim() != 2 or ids.shape[1] != 1 or position.shape != (1,):
            raise ValueError(f"step takes ids [B, 1] and position [1] (device tensors), got ids "
                             f"{tuple(ids.shape)} and position {tuple(position.shape)}")
        b, d, nq, nkv = ids.shape[0], self.head_dim, self.plan.n_q, self.plan.n_kv
        cache = self.cache_for(b)
        x = F.embedding(ids, self.embed)  # [B, 1, hidden]
        cos = self.cos.index_select(0, position).view(1, 1, 1, d)
        sin = self.sin.index_select(0, position).view(1, 1, 1, d)
        mask = (self._arange <= position).view(1, 1, 1, self.max_len)
        for w, (kc, vc) in zip(self.layers, cache):
            h = _rms(x, w["ln1"], self.eps)
            qkv = self._linear(h, w["qkv"])
            q, k, v = qkv.split([nq * d, nkv * d, nkv * d], dim=-1)
            q = q.view(b, 1, nq, d).transpose(1, 2)
            k = k.view(b, 1, nkv, d).transpose(1, 2)
            v = v.view(b, 1, nkv, d).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            kc.index_copy_(2, position, k)  # this rank's KV heads, at the step's position
            vc.index_copy_(2, position, v)
            keys, values = kc, vc
            if nq != nkv:
                keys, values = kc.repeat_interleave(nq // nkv, dim=1), vc.repeat_interleave(nq // nkv, dim=1)
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=d ** -0.5)
            o = o.transpose(1, 2).reshape(b, 1, nq * d)
            x = x + self._all_reduce(self._linear(o, w["o"]))  # row-parallel: partial sums, added on every rank
            h = _rms(x, w["ln2"], self.eps)
            g, u = self._linear(h, w["gate_up"]).split([self.inter, self.inter], dim=-1)
            x = x + self._all_reduce(self._linear(F.silu(g) * u, w["down"]))
        x = _rms(x, self.norm, self.eps)
        return F.linear(x, self.head)[:, -1].float()

    def example_args(self, batch: int = 1, position: int = 0, seed: int = 0):
        """``(ids, position)`` device tensors for ``batch`` rows at ``position``: the same on every rank (seeded)."""
        if not 0 <= position < self.max_len:
            raise ValueError(f"position must be in 0..{self.max_len - 1}, got {position}")
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(3, self.embed.shape[0], (batch, 1), generator=g)
        return ids.to(self.device), torch.full((1,), position, dtype=torch.long, device=self.device)
