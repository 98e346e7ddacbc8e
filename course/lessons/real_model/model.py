"""The model of lesson 06: ``LlamaForCausalLM`` with TinyLlama-1.1B's shape, or a tiny one, random.

Nothing is downloaded: the configuration is written here (:data:`SIZES`: TinyLlama's shape in
bfloat16 for a GPU, 2 layers of hidden 64 in float32 for a laptop), the weights drawn from a seed.
"""
from __future__ import annotations

import dataclasses

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import course
from course.core.runtime import runtime


@dataclasses.dataclass(frozen=True)
class Size:
    """One model size: the LlamaConfig fields that differ, and the dtype the weights are kept in."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    dtype: str  # "bfloat16" or "float32"
    max_positions: int = 2048

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden // self.heads


SIZES = {
    "tinyllama": Size("tinyllama", hidden=2048, intermediate=5632, layers=22, heads=32, kv_heads=4,
                      vocab=32000,
                      dtype="bfloat16"),
    "tiny": Size("tiny", hidden=64, intermediate=176, layers=2, heads=4, kv_heads=2, vocab=512,
                 dtype="float32",
                 max_positions=512),
}


def default_size() -> str:
    """``"tinyllama"`` on the GPU path, ``"tiny"`` on the simulator path (a laptop's CPU)."""
    return "tinyllama" if runtime().on_gpu else "tiny"


def _size(size) -> Size:
    if isinstance(size, Size):
        return size
    if size not in SIZES:
        raise KeyError(f"unknown model size {size!r}; choose one of {sorted(SIZES)}")
    return SIZES[size]


def llama_config(size="tiny"):
    """The ``transformers.LlamaConfig`` of ``size`` (a key of :data:`SIZES`): sdpa attention, untied
    embeddings."""
    s = _size(size)
    cfg = LlamaConfig(vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate,
                      num_hidden_layers=s.layers, num_attention_heads=s.heads,
                      num_key_value_heads=s.kv_heads,
                      max_position_embeddings=s.max_positions, rms_norm_eps=1e-5,
                      rope_theta=10000.0,
                      tie_word_embeddings=False, attn_implementation="sdpa", bos_token_id=1,
                      eos_token_id=2,
                      pad_token_id=0)
    cfg.dtype = s.dtype
    return cfg


def build_model(size="tiny", device=None, seed: int = 0):
    """``LlamaForCausalLM`` of ``size`` with seeded random weights, in eval mode, drawn directly on
    ``device`` (the course's)."""
    s = _size(size)
    dev = torch.device(device) if device is not None else course.device()
    torch.manual_seed(seed)
    with torch.device(dev):
        model = LlamaForCausalLM(llama_config(s))
    model = model.to(dtype=getattr(torch, s.dtype)).eval()
    model.requires_grad_(False)
    model.generation_config.pad_token_id = 0
    return model


def size_of(model) -> Size:
    """The :class:`Size` a model was built with (read back from its config)."""
    c = model.config
    for s in SIZES.values():
        if (s.hidden, s.layers, s.vocab) == (c.hidden_size, c.num_hidden_layers, c.vocab_size):
            return s
    return Size("custom", c.hidden_size, c.intermediate_size, c.num_hidden_layers,
                c.num_attention_heads,
                c.num_key_value_heads, c.vocab_size, str(model.dtype).replace("torch.", ""))


def weight_bytes(model) -> int:
    """Bytes of every parameter and buffer of the model (a tied weight counted once)."""
    # parameters() already yields a tied Parameter once; identity, not data_ptr (0 on meta)
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in seen:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


def kv_bytes_per_position(model) -> int:
    """Bytes of K and V that one sequence keeps per position, all layers together."""
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    size = next(model.parameters()).element_size()
    return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * size


def bytes_per_token(model, batch: int = 1, context: int = 0) -> int:
    """Bytes one decode step of ``batch`` sequences must read at least: every weight once (of the
    embedding only ``batch`` rows, unless the head shares it), and the K/V over ``context``
    positions."""
    if batch < 1 or context < 0:
        raise ValueError(f"batch must be >= 1 and context >= 0, got batch={batch}, "
                         f"context={context}")
    emb = model.get_input_embeddings().weight
    row = emb.shape[1] * emb.element_size()
    out = model.get_output_embeddings()
    # the output head reads the whole table anyway (SmolLM2)
    tied = out is not None and out.weight is emb
    return weight_bytes(model) - (0 if tied else emb.numel() * emb.element_size() - batch * row) \
        + batch * context * kv_bytes_per_position(model)
