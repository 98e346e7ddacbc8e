"""Lesson 07's fused Triton step on one rank's share, an all-reduce after each partial sum (exercise
08.2).

A rank keeps :mod:`.tp`'s split and runs lesson 07's five kernels per layer on it. ``o_proj`` and
``down_proj`` write this rank's partial sum: one rank's kernel adds the residual (``x = x +
partial``), the others' write the partial alone (``RESIDUAL=False``), and one all-reduce of ``x``
(:mod:`.allreduce`) sums them before the next kernel reads ``x`` whole. Captured, one CUDA graph per
rank holds the kernels and the all-reduces.
"""
from __future__ import annotations

import copy
import types

import torch

from course.lessons.last_mile.decoder import TritonDecoder
from course.lessons.tensor_parallel.allreduce import MODES, make_all_reduce, residual_buffer
from course.lessons.tensor_parallel.tp import head_plan, mlp_rows


def fused_layer(k, layer: int, position) -> None:
    """One layer on one rank: the kernels, the residual added once (rank 0), an all-reduce after
    each partial sum."""
    k.qkv(layer, position)
    k.attend(layer, position)
    k.o_proj(layer, residual=k.rank == 0)  # this rank's partial sum; rank 0 adds the residual too
    k.all_reduce()  # x = residual + every rank's partial, on every rank
    k.gate_up(layer)
    k.down(layer, residual=k.rank == 0)
    k.all_reduce()


def rank_model(model, rank: int, world: int):
    """What :class:`TritonDecoder` reads of ``model``, for ``rank``'s share: copies of its rows and
    columns; the embedding, final norm, LM head and rotary embedding are the model's own (whole on
    every rank)."""
    c = model.config
    d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    plan = head_plan(c.num_attention_heads, c.num_key_value_heads, world, rank)
    r0, r1 = mlp_rows(c.intermediate_size, world, rank)
    (q0, q1), (k0, k1) = plan.q, plan.kv
    cfg = copy.deepcopy(c)
    cfg.num_attention_heads, cfg.num_key_value_heads = plan.n_q, plan.n_kv
    cfg.intermediate_size, cfg.head_dim = r1 - r0, d
    ns = types.SimpleNamespace
    w = lambda t: ns(weight=t.detach().contiguous())  # noqa: E731
    layers = []
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        layers.append(ns(
            input_layernorm=ns(weight=layer.input_layernorm.weight),
            post_attention_layernorm=ns(weight=layer.post_attention_layernorm.weight),
            self_attn=ns(q_proj=w(a.q_proj.weight[q0 * d:q1 * d]),
                         k_proj=w(a.k_proj.weight[k0 * d:k1 * d]),
                         v_proj=w(a.v_proj.weight[k0 * d:k1 * d]),
                         o_proj=w(a.o_proj.weight[:, q0 * d:q1 * d])),
            mlp=ns(gate_proj=w(m.gate_proj.weight[r0:r1]), up_proj=w(m.up_proj.weight[r0:r1]),
                   down_proj=w(m.down_proj.weight[:, r0:r1]))))
    m = model.model
    inner = ns(embed_tokens=m.embed_tokens, norm=m.norm, rotary_emb=m.rotary_emb, layers=layers)
    return ns(config=cfg, model=inner, lm_head=model.lm_head, plan=plan,
              parameters=lambda: iter([m.embed_tokens.weight]))


class FusedShardDecoder(TritonDecoder):
    """Lesson 07's step on ``rank``'s share of ``model`` among ``world`` ranks (see the module doc).

    ``all_reduce``: one of :data:`~.allreduce.MODES`, or ``"none"`` on one rank; ``layer(decoder,
    index, position)`` runs one layer (default :func:`fused_layer`). Every rank constructs it (symm
    modes rendezvous).
    """

    def __init__(self, model, rank: int = 0, world: int = 1, group=None, all_reduce: str = "nccl",
                 max_len: int = 256, pdl: bool = False, config=None, layer=None):
        if all_reduce not in MODES + ("none",):
            raise ValueError(f"all_reduce must be one of {MODES + ('none',)}, got {all_reduce!r}")
        if all_reduce == "none" and world > 1:
            raise ValueError(f"all_reduce='none' leaves {world} ranks with partial sums: choose "
                             f"one of {MODES}")
        if not 0 <= rank < world:
            raise ValueError(f"rank must be in 0..{world - 1}, got {rank}")
        if config is not None and config.down_split > 1:
            raise ValueError("the split step takes down_proj whole per rank (down_split=1): "
                             "split-K's kernel always adds the residual")
        share = model if world == 1 else rank_model(model, rank, world)
        super().__init__(share, max_len, pdl, config)
        self.rank, self.world, self.group, self.mode = rank, world, group, all_reduce
        self.layer_fn = layer or fused_layer
        self.all_reduces_issued = 0  # counted as they are issued: per step, in an eager call
        if all_reduce != "none":
            self.x = residual_buffer(all_reduce, self.H, self.dtype, self.device, group)
            self._reduce = make_all_reduce(all_reduce, self.x, group)

    def _partial(self, c, a, w, k: int, residual: bool) -> None:
        """This rank's partial product ``a @ w.T`` into x: added to x (``residual``), or as x."""
        self._go(self._kernels.proj_residual, -(-self.H // c.rows), a, w, self.x, self.H, k,
                 BLOCK_N=c.rows, BLOCK_K=c.block_k, warps=c.warps, DEPTH=c.depth, VEC=self.vec,
                 RESIDUAL=bool(residual))

    def o_proj(self, layer: int, residual: bool = True) -> None:
        """Kernel 3 of ``layer``: o_proj of this rank's heads into x (:meth:`_partial`)."""
        self._partial(self.config.o, self.attn, self.layers[layer][4], self.NH * self.D, residual)

    def down(self, layer: int, residual: bool = True) -> None:
        """Kernel 5 of ``layer``: down_proj of this rank's MLP rows into x (:meth:`_partial`)."""
        self._partial(self.config.down, self.act, self.layers[layer][8], self.I, residual)

    def all_reduce(self) -> None:
        """Sum x over the ranks in place (with ``"none"``: nothing, not counted)."""
        if self.mode != "none":
            self.all_reduces_issued += 1
            self._reduce()

    def step(self, ids, position):
        """Logits ``[1, vocab]`` (float32, the decoder's buffer), the same on every rank."""
        if ids.dim() != 2 or ids.shape != (1, 1) or position.shape != (1,):
            raise ValueError("the split Triton step decodes one sequence: ids [1, 1] and "
                             f"position [1] (device tensors), got ids {tuple(ids.shape)} and "
                             f"position {tuple(position.shape)}")
        self.embed(ids)
        for layer in range(self.L):
            self.layer_fn(self, layer, position)
        self.head()
        return self.logits

    def all_reduces_per_step(self, ids, position) -> int:
        """All-reduces one eager step issues (the calls a capture records; 0 with "none")."""
        before = self.all_reduces_issued
        self.step(ids, position)
        return self.all_reduces_issued - before

    def weight_bytes(self) -> int:
        """Bytes of weights one step reads on this rank: its shares, norms, LM head, one row."""
        shares = {id(t): t for ws in self.layers for t in ws}.values()  # a tensor counted once
        row = self.emb.shape[1] * self.emb.element_size()
        return row + sum(t.numel() * t.element_size() for t in [self.final_norm, self.lm, *shares])


def emulate(decoders: list, ids, position):
    """Every rank's split step in one process, the all-reduce a sum of the ranks' x (``decoders``:
    :func:`emulated`'s); each rank's logits (copies)."""
    xs = [d.x for d in decoders]
    for d in decoders:
        d.embed(ids)
    for layer in range(decoders[0].L):
        for half in ("attn", "mlp"):
            for d in decoders:
                if half == "attn":
                    d.qkv(layer, position)
                    d.attend(layer, position)
                    d.o_proj(layer, residual=d.rank == 0)
                else:
                    d.gate_up(layer)
                    d.down(layer, residual=d.rank == 0)
            total = torch.stack(xs).sum(0).to(xs[0].dtype)
            for x in xs:
                x.copy_(total)
    out = []
    for d in decoders:
        d.head()
        out.append(d.logits.clone())
    return out


def emulated(model, world: int, max_len: int = 64, config=None) -> list:
    """Every rank's :class:`FusedShardDecoder` of ``model`` in this process, for :func:`emulate`."""
    decs = []
    for r in range(world):
        d = FusedShardDecoder.__new__(FusedShardDecoder)
        share = model if world == 1 else rank_model(model, r, world)
        TritonDecoder.__init__(d, share, max_len, False, config)
        d.rank, d.world, d.group, d.mode, d.layer_fn = r, world, None, "none", fused_layer
        d.all_reduces_issued = 0
        decs.append(d)
    return decs
