"""Fused projections: one matrix-vector product where transformers' Llama runs three (q, k, v) or
two (gate, up).

At batch 1 each linear layer is a kernel that reads its weight once; a small one (k_proj and v_proj
are 1 MB each in TinyLlama's shape) spends more time starting, filling the GPU and draining than
reading. Stacking the weights that read the same input into one matrix turns seven products per
layer into four: ``[q; k; v]`` (2560 rows) and ``[gate; up]`` (11264 rows), then ``o_proj`` and
``down_proj``.

:func:`fuse_projections` switches the modules of the model given to :class:`FusedAttention` and
:class:`FusedMLP`, whose ``forward`` runs one product and splits its output; everything else is
transformers' own code (rotary embedding, KV cache, attention). The stacked weights are **new
tensors** (the five separate layers are removed from the model given): use it on a twin
(:func:`gemv_model`), so the original keeps its own modules and weights.

Why copies, not views of the original weights: re-homing a weight (``weight.data = ...``) frees the
memory it had, and a CUDA graph captured earlier still reads that address. A probe that did so on
the H100 ended in "an illegal memory access": a graph replays raw addresses, so whatever it read
must stay where it was for as long as the graph lives.
"""
from __future__ import annotations

import copy

import torch
from transformers.models.llama import modeling_llama as L

from course.lessons.real_model.gemv import GemvLinear, linear


def _stack(module, names):
    """One matrix of the named linears' weights (a new tensor, rows in ``names`` order); the linears
    are removed."""
    linears = [getattr(module, n) for n in names]
    if any(lin.bias is not None for lin in linears):
        raise ValueError("fuse_projections takes linear layers without bias (Llama's), got a bias")
    weight = torch.cat([lin.weight.detach() for lin in linears])
    stacked = torch.nn.Parameter(weight, requires_grad=False)
    for n in names:
        delattr(module, n)
    return stacked, [lin.weight.shape[0] for lin in linears]


class FusedAttention(L.LlamaAttention):
    """transformers' LlamaAttention with q, k and v from one product (``qkv_weight``)."""

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None,
                past_key_values=None, **kwargs):
        """LlamaAttention.forward, its three projections replaced by one (same order of everything
        else)."""
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q, k, v = linear(hidden_states, self.qkv_weight).split(self.qkv_sizes, dim=-1)
        query_states = q.reshape(hidden_shape).transpose(1, 2)
        key_states = k.reshape(hidden_shape).transpose(1, 2)
        value_states = v.reshape(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = L.apply_rotary_pos_emb(query_states, key_states, cos, sin)
        if past_key_values is not None:
            key_states, value_states = past_key_values.update(key_states, value_states,
                                                              self.layer_idx)
        attention = L.ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                            L.eager_attention_forward)
        out, weights = attention(self, query_states, key_states, value_states, attention_mask,
                                 dropout=0.0, scaling=self.scaling, **kwargs)
        out = out.reshape(*input_shape, -1).contiguous()
        return self.o_proj(out), weights


class FusedMLP(L.LlamaMLP):
    """transformers' LlamaMLP with gate and up from one product (``gate_up_weight``)."""

    def forward(self, x):
        """``down(act(gate(x)) * up(x))`` with gate and up from one product."""
        gate, up = linear(x, self.gate_up_weight).split(self.gate_up_sizes, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


def fuse_projections(model) -> int:
    """Stack each decoder layer's q/k/v and gate/up weights and switch its modules to the fused
    ones.

    Changes ``model`` in place (see the module doc: new stacked weights, the separate layers
    removed) and returns the number of layers fused. Raises ValueError on a model that is not
    transformers' Llama.
    """
    layers = [m for m in model.modules() if isinstance(m, L.LlamaDecoderLayer)]
    if not layers:
        raise ValueError("fuse_projections needs transformers' LlamaForCausalLM (no "
                         "LlamaDecoderLayer found)")
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        if type(attn) is L.LlamaAttention:
            attn.qkv_weight, attn.qkv_sizes = _stack(attn, ("q_proj", "k_proj", "v_proj"))
            attn.__class__ = FusedAttention
        if type(mlp) is L.LlamaMLP:
            mlp.gate_up_weight, mlp.gate_up_sizes = _stack(mlp, ("gate_proj", "up_proj"))
            mlp.__class__ = FusedMLP
    return len(layers)


def gemv_model(model, fuse: bool = True):
    """A twin of ``model`` sharing its weights and buffers, every ``nn.Linear`` a
    :class:`~.gemv.GemvLinear`.

    The twin's parameters are the original's tensors (nothing copied), so the two models compute
    with the same weights. ``fuse=True`` also stacks each layer's q/k/v and gate/up weights into one
    product each (:func:`fuse_projections`): those stacked matrices are new tensors, about 60 % of
    the weights again in memory (never re-homed: graphs of the original read them).
    """
    shared = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    twin = copy.deepcopy(model, memo=shared)
    swapped = 0
    for mod in twin.modules():
        if type(mod) is torch.nn.Linear:
            mod.__class__ = GemvLinear
            swapped += 1
    if not swapped:
        raise ValueError("gemv_model: this model has no nn.Linear layer to route through the GEMV")
    if fuse:
        fuse_projections(twin)
    return twin
