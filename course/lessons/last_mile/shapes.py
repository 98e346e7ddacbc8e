"""Llama shapes lesson 07's kernels are run on, beyond lesson 06's two: random weights, nothing
downloaded.

:data:`SHAPES` adds, as :class:`~course.lessons.real_model.model.Size` objects with their own config
fields (:data:`EXTRA`: tied embeddings, RoPE base, positions):

- ``"smollm2-135m"``: SmolLM2-135M-Instruct's shape (30 layers, hidden 576, 9 query and 3 KV heads
  of 64, MLP 1536, vocabulary 49152, tied embeddings): a hidden size that is no power of two;
- ``"llama-3.2-1b"``: Llama-3.2-1B's shape (16 layers, hidden 2048, MLP 8192, 32/8 heads of 64,
  vocabulary 128256, tied embeddings, RoPE base 500000);
- ``"llama-3.1-8b"``: Llama-3.1-8B's shape (32 layers, hidden 4096, MLP 14336, 32/8 heads of 128,
  vocabulary 128256, RoPE base 500000): 16 GB of weights in bfloat16 (lesson 08 splits it);
- ``"tiny-tied"``: the same peculiarities at laptop size (hidden 48, 3 query heads of 16 and 1 KV
  head, tied embeddings, float32), for Triton's interpreter;

and ``"tinyllama"`` with room for 4096 positions. The real Llama-3.2's RoPE scaling is left out: it
changes the values of cos and sin, not what a step reads.
"""
from __future__ import annotations

import dataclasses

import torch

import course
from course.lessons.real_model.model import SIZES, Size, llama_config

SHAPES = {
    "tinyllama": dataclasses.replace(SIZES["tinyllama"], max_positions=4096),
    "smollm2-135m": Size("smollm2-135m", hidden=576, intermediate=1536, layers=30, heads=9,
                         kv_heads=3, vocab=49152, dtype="bfloat16", max_positions=8192),
    "llama-3.2-1b": Size("llama-3.2-1b", hidden=2048, intermediate=8192, layers=16, heads=32,
                         kv_heads=8, vocab=128256, dtype="bfloat16", max_positions=8192),
    "llama-3.1-8b": Size("llama-3.1-8b", hidden=4096, intermediate=14336, layers=32, heads=32,
                         kv_heads=8, vocab=128256, dtype="bfloat16", max_positions=8192),
    "tiny-tied": Size("tiny-tied", hidden=48, intermediate=96, layers=2, heads=3, kv_heads=1,
                      vocab=320, dtype="float32", max_positions=256),
}
EXTRA = {"smollm2-135m": {"tie_word_embeddings": True, "rope_theta": 100000.0},
         "llama-3.2-1b": {"tie_word_embeddings": True, "rope_theta": 500000.0},
         "llama-3.1-8b": {"rope_theta": 500000.0},
         "tiny-tied": {"tie_word_embeddings": True, "head_dim": 16}}


def build_shape(name: str, device=None, seed: int = 0):
    """``LlamaForCausalLM`` of the shape ``name`` (a key of :data:`SHAPES`), seeded random weights,
    eval mode."""
    from transformers import LlamaForCausalLM  # it imports Triton: after the interpreter decision

    if name not in SHAPES:
        raise KeyError(f"unknown shape {name!r}; choose one of {sorted(SHAPES)}")
    s = SHAPES[name]
    cfg = llama_config(s)
    for k, v in EXTRA.get(name, {}).items():
        setattr(cfg, k, v)
    theta = EXTRA.get(name, {}).get("rope_theta")
    if theta is not None and isinstance(getattr(cfg, "rope_parameters", None), dict):
        cfg.rope_parameters["rope_theta"] = theta  # transformers 5 reads RoPE's base from here
    dev = torch.device(device) if device is not None else course.device()
    torch.manual_seed(seed)
    with torch.device(dev):
        model = LlamaForCausalLM(cfg)
    model = model.to(dtype=getattr(torch, s.dtype)).eval()
    model.requires_grad_(False)
    model.generation_config.pad_token_id = 0
    if cfg.tie_word_embeddings and model.lm_head.weight is not model.model.embed_tokens.weight:
        model.lm_head.weight = model.model.embed_tokens.weight  # tied, as the real checkpoint is
    return model
