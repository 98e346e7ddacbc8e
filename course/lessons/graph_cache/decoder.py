"""A tiny TinyLlama-shaped decoder to drive the graph cache: random weights, no downloads.

Token embedding through the course's own Numba kernel (:func:`course.embedding.embedding`, with
``bounds="device"`` so it never waits for the GPU and can be captured), then ``layers`` blocks of
RMSNorm, rotary attention with grouped KV heads over a static KV cache, and a SwiGLU MLP.

:meth:`TinyDecoder.step` decodes one token for each of a batch of sequences. Everything that
changes from step to step is a device tensor argument: the token ids, their positions and the KV
cache slot of each sequence; the KV cache is a module buffer of fixed size, updated in place. So
the shapes of a step depend only on the batch size, and one captured graph serves every step of
that size. The last cache slot (:attr:`TinyDecoder.scratch_slot`) belongs to no sequence: padding
rows write there. :meth:`TinyDecoder.reference_logits` recomputes a whole sequence without any
cache (and with ``F.embedding``): the check that the cached decode step is right.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from course import embedding as E
from course.core.runtime import torch_device


@torch.library.custom_op("course::numba_embedding", mutates_args=())
def numba_embedding(ids: torch.Tensor, weight: torch.Tensor,
                    bounds: str = "device") -> torch.Tensor:
    """The course's Numba gather as a torch operator (so ``torch.compile`` keeps it as one opaque
    call)."""
    return E.embedding(ids, weight, bounds=bounds)


@numba_embedding.register_fake
def _(ids, weight, bounds="device"):
    return ids.new_empty((*ids.shape, weight.shape[1]), dtype=weight.dtype)


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Sizes of the tiny decoder (TinyLlama's shape, scaled down)."""

    vocab: int = 512
    dim: int = 64
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 176
    layers: int = 2
    max_seq: int = 64
    slots: int = 64  # sequences the KV cache holds (one more, the scratch slot, takes padding rows)
    rope_base: float = 10000.0
    eps: float = 1e-5


def rms_norm(x, w, eps):
    """RMSNorm of ``x`` over its last dim, scaled by ``w``."""
    if hasattr(F, "rms_norm"):  # one op (torch >= 2.4)
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def kv_groups(kv, heads):
    """Repeat each KV head for its group of query heads along dim -2 (an expand: no sync, any
    shape)."""
    *lead, kvh, hd = kv.shape
    return kv.unsqueeze(-2).expand(*lead, kvh, heads // kvh, hd).reshape(*lead, heads, hd)


def rope(x, cos, sin):
    """Rotate pairs (x1, x2) of the last dim by the angles in cos/sin ([..., head_dim // 2])."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class DecoderWeights(torch.nn.Module):
    """The tiny decoder's weights, rotary tables and static KV cache, its uncached reference and its
    example inputs: everything of :class:`TinyDecoder` but its decode step."""

    def __init__(self, cfg: DecoderConfig | None = None, device=None, seed: int = 0,
                 bounds: str = "device"):
        super().__init__()
        if bounds not in ("device", "host"):
            raise ValueError("bounds must be 'device' (capturable) or 'host' (capture fails), got "
                             f"{bounds!r}")
        self.bounds = bounds

        cfg = cfg or DecoderConfig()
        if cfg.dim % cfg.heads or cfg.heads % cfg.kv_heads or (cfg.dim // cfg.heads) % 2:
            raise ValueError("dim must split into heads of even size, and heads into kv_heads "
                             "groups")
        self.cfg = cfg
        device = torch.device(device) if device is not None else torch_device()
        g = torch.Generator().manual_seed(seed)
        hd = cfg.dim // cfg.heads

        def rand(*shape, scale):
            return (torch.randn(*shape, generator=g) * scale).to(device)

        self.tok = torch.nn.Parameter(rand(cfg.vocab, cfg.dim, scale=1.0), requires_grad=False)
        for i in range(cfg.layers):
            blk = {"wqkv": rand(cfg.dim, (cfg.heads + 2 * cfg.kv_heads) * hd,
                                scale=cfg.dim ** -0.5),
                   "wo": rand(cfg.dim, cfg.dim, scale=cfg.dim ** -0.5),
                   "w_gate_up": rand(cfg.dim, 2 * cfg.ffn, scale=cfg.dim ** -0.5),
                   "w_down": rand(cfg.ffn, cfg.dim, scale=cfg.ffn ** -0.5),
                   "n1": 1 + rand(cfg.dim, scale=0.1), "n2": 1 + rand(cfg.dim, scale=0.1)}
            for k, v in blk.items():
                self.register_buffer(f"b{i}_{k}", v)
        self.register_buffer("norm", 1 + rand(cfg.dim, scale=0.1))
        self.register_buffer("lm_head", rand(cfg.vocab, cfg.dim, scale=cfg.dim ** -0.5))
        inv = 1.0 / (cfg.rope_base ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        ang = torch.outer(torch.arange(cfg.max_seq, dtype=torch.float32), inv)
        self.register_buffer("cos", ang.cos().to(device))
        self.register_buffer("sin", ang.sin().to(device))
        shape = (cfg.layers, cfg.slots + 1, cfg.max_seq, cfg.kv_heads, hd)
        self.register_buffer("k_cache", torch.zeros(shape, device=device))
        self.register_buffer("v_cache", torch.zeros(shape, device=device))

    @property
    def scratch_slot(self) -> int:
        """The KV-cache slot no sequence owns: padding rows of a bucketed batch write there."""
        return self.cfg.slots

    def _w(self, i, name):
        return getattr(self, f"b{i}_{name}")

    def reference_logits(self, tokens) -> torch.Tensor:
        """Logits at every position of one sequence, recomputed from scratch: no KV cache,
        ``F.embedding``."""
        cfg, hd = self.cfg, self.cfg.dim // self.cfg.heads
        t = tokens.shape[0]
        h = F.embedding(tokens, self.tok)
        cos, sin = self.cos[:t][:, None, :], self.sin[:t][:, None, :]
        causal = torch.ones(t, t, dtype=torch.bool, device=tokens.device).triu(1)
        for i in range(cfg.layers):
            x = rms_norm(h, self._w(i, "n1"), cfg.eps)
            # separate products: an independent check of the split
            w, kvd = self._w(i, "wqkv"), cfg.kv_heads * hd
            q = rope((x @ w[:, :cfg.dim]).view(t, cfg.heads, hd), cos, sin)
            k = rope((x @ w[:, cfg.dim:cfg.dim + kvd]).view(t, cfg.kv_heads, hd), cos, sin)
            v = (x @ w[:, cfg.dim + kvd:]).view(t, cfg.kv_heads, hd)
            k, v = kv_groups(k, cfg.heads), kv_groups(v, cfg.heads)
            scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
            att = scores.masked_fill(causal, float("-inf")).softmax(-1)
            h = h + torch.einsum("hqk,khd->qhd", att, v).reshape(t, cfg.dim) @ self._w(i, "wo")
            x, w = rms_norm(h, self._w(i, "n2"), cfg.eps), self._w(i, "w_gate_up")
            h = h + (F.silu(x @ w[:, :cfg.ffn]) * (x @ w[:, cfg.ffn:])) @ self._w(i, "w_down")
        return rms_norm(h, self.norm, cfg.eps) @ self.lm_head.t()

    def reset_cache(self) -> None:
        """Zero the KV cache (queued on the device; no sync)."""
        self.k_cache.zero_()
        self.v_cache.zero_()

    def example_args(self, batch: int, step: int = 0):
        """(ids, pos, slots) for ``batch`` sequences in slots 0..batch-1 at position ``step``
        (device tensors)."""
        if not 1 <= batch <= self.cfg.slots:
            raise ValueError(f"batch must be in 1..{self.cfg.slots} (the KV cache's slots), got "
                             f"{batch}")
        if not 0 <= step < self.cfg.max_seq:
            raise ValueError(f"step must be in 0..{self.cfg.max_seq - 1}, got {step}")
        dev = self.tok.device
        g = torch.Generator().manual_seed(1000 + step)
        ids = torch.randint(0, self.cfg.vocab, (batch,), generator=g).to(dev)
        pos = torch.full((batch,), step, dtype=torch.long, device=dev)
        return ids, pos, torch.arange(batch, device=dev)

    def pad_values(self) -> tuple:
        """GraphCache's ``pad_value`` for (ids, pos, slots): padding rows read token 0 at position
        0, scratch slot."""
        return (0, 0, self.scratch_slot)


class TinyDecoder(DecoderWeights):
    """The tiny decoder; ``step(ids, pos, slots)`` is the decode step a graph cache wraps."""

    def step(self, ids, pos, slots, k_cache=None, v_cache=None):
        """Decode one token per row: ids, pos, slots: int64 device tensors [B]; logits [B, vocab].

        Writes each row's K/V at (slot, pos) of the cache, then attends over positions 0..pos of
        its slot. ``k_cache``/``v_cache`` default to the module's buffers (pass them to update
        caches given as inputs instead).
        """
        cfg = self.cfg
        kc = self.k_cache if k_cache is None else k_cache
        vc = self.v_cache if v_cache is None else v_cache
        b, hd = ids.shape[0], cfg.dim // cfg.heads
        if torch.compiler.is_compiling():
            h = numba_embedding(ids, self.tok, self.bounds)  # an opaque operator for the compiler
        else:
            h = E.embedding(ids, self.tok, bounds=self.bounds)  # eager: no operator overhead
        cos, sin = self.cos[pos][:, None, :], self.sin[pos][:, None, :]
        future = torch.arange(cfg.max_seq, device=ids.device)[None, :] > pos[:, None]  # [B, S]
        for i in range(cfg.layers):
            x = rms_norm(h, self._w(i, "n1"), cfg.eps)
            kvd = cfg.kv_heads * hd
            q, k, v = (x @ self._w(i, "wqkv")).split([cfg.dim, kvd, kvd], dim=-1)
            q = rope(q.reshape(b, cfg.heads, hd), cos, sin)
            k = rope(k.reshape(b, cfg.kv_heads, hd), cos, sin)
            v = v.reshape(b, cfg.kv_heads, hd)
            kc[i].index_put_((slots, pos), k)
            vc[i].index_put_((slots, pos), v)
            keys = kv_groups(kc[i][slots], cfg.heads)  # [B, S, H, hd]
            vals = kv_groups(vc[i][slots], cfg.heads)
            scores = torch.einsum("bhd,bshd->bhs", q, keys) / math.sqrt(hd)
            scores = scores.masked_fill(future[:, None, :], float("-inf"))
            att = torch.einsum("bhs,bshd->bhd", scores.softmax(-1), vals).reshape(b, cfg.dim)
            h = h + att @ self._w(i, "wo")
            x = rms_norm(h, self._w(i, "n2"), cfg.eps)
            gate, up = (x @ self._w(i, "w_gate_up")).chunk(2, dim=-1)
            h = h + (F.silu(gate) * up) @ self._w(i, "w_down")
        return rms_norm(h, self.norm, cfg.eps) @ self.lm_head.t()

    def forward(self, ids, pos, slots):
        """Same as :meth:`step` (so ``torch.compile(model)`` compiles the decode step)."""
        return self.step(ids, pos, slots)
