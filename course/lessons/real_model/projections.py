"""Stacked projections: one product where transformers' Llama runs three (q, k, v) or two (gate,
up).

:func:`gemv_model` builds a twin of the model sharing its weights, its linears on the GEMV and its
attention and MLP switched to :class:`FusedAttention` and :class:`FusedMLP`. The stacked weights are
new tensors: re-homing the originals would free memory that earlier graphs still read.
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
    """Stack each layer's q/k/v and gate/up weights (new tensors; the separate linears removed) and
    switch its modules to the fused ones, in place; the number of layers fused."""
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
    """A twin of ``model`` sharing its weights, every ``nn.Linear`` a :class:`~.gemv.GemvLinear`,
    its projections stacked with ``fuse``."""
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
