"""One decode step of the Llama model, three ways: the wrapper written first, the capturable one, in
the graph cache.

- :class:`NaiveDecoder`: the position a Python int (a host-to-device copy every step) and the KV
  cache's own counter trusted (every run advances it): correct eagerly, not capturable;
- :class:`StaticDecoder`: inputs in device tensors (``ids [B, 1]``, ``position [1]``), the position
  pinned into the cache's counter, the mask and position ids built on the device: the same result
  however often it runs;
- :func:`graph_cached`: that step in lesson 04's GraphCache, with batch buckets; a batch padded to
  bucket ``b`` writes its padding rows' K/V into rows of bucket ``b``'s cache that belong to no
  sequence.
"""
from __future__ import annotations

import torch
from transformers import StaticCache

from course.core.runtime import runtime
from course.lessons.graph_cache.backends import CudaGraphBackend, RecordingBackend
from course.lessons.graph_cache.cache import GraphCache


class NaiveDecoder:
    """The first wrapper anyone writes around ``model(...)``: correct eagerly, not capturable."""

    def __init__(self, model, max_len: int = 256):
        self.model, self.max_len = model, max_len
        self.cache = StaticCache(config=model.config, max_cache_len=max_len)

    def step(self, ids, position: int):
        """Logits ``[B, vocab]`` after ``ids`` (``[B, 1]``) at ``position`` (a Python int)."""
        pos = torch.tensor([[position]], device=ids.device)  # a host-to-device copy on every step
        # the cache writes where its own counter says, and advances it
        out = self.model(input_ids=ids, position_ids=pos.expand(ids.shape[0], 1),
                         past_key_values=self.cache, use_cache=True)
        return out.logits[:, -1].float()

    def reset(self) -> None:
        """Empty the KV cache (and its length counter) before a new sequence."""
        self.cache.reset()


class StaticDecoder:
    """The capturable decode step: ``step(ids, position)`` on device tensors only, a static cache
    per batch size."""

    def __init__(self, model, max_len: int = 256):
        if max_len < 2 or max_len > model.config.max_position_embeddings:
            raise ValueError(f"max_len must be in 2..{model.config.max_position_embeddings} (the "
                             f"model's positions), got {max_len}")
        self.model, self.max_len = model, max_len
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.kv_heads = model.config.num_key_value_heads  # a split model's rank holds its share
        self.caches: dict = {}
        self._arange = torch.arange(max_len, device=self.device)

    def cache_for(self, batch: int):
        """The StaticCache of ``batch`` rows, allocated (its counter on the device) on first use."""
        if batch not in self.caches:
            c = self.model.config
            cache = StaticCache(config=c, max_cache_len=self.max_len)
            head_dim = c.hidden_size // c.num_attention_heads
            cache.early_initialization(batch, self.kv_heads, head_dim, self.dtype, self.device)
            self.caches[batch] = cache
        return self.caches[batch]

    def step(self, ids, position):
        """Logits ``[B, vocab]`` (float32) after ``ids`` (int64 ``[B, 1]``) at ``position`` (int64
        ``[1]``): writes each row's K/V at ``position`` of this batch size's cache, attends over
        ``0..position``."""
        # shapes only: no device value read
        if ids.dim() != 2 or ids.shape[1] != 1 or position.shape != (1,):
            raise ValueError(f"step takes ids [B, 1] and position [1] (device tensors), got ids "
                             f"{tuple(ids.shape)} and position {tuple(position.shape)}")
        b = ids.shape[0]
        cache = self.cache_for(b)
        # the write position comes from our buffer, not from how often we ran
        for layer in cache.layers:
            layer.cumulative_length.copy_(position[0])
        mask = (self._arange <= position).view(1, 1, 1, self.max_len).expand(b, 1, 1, self.max_len)
        out = self.model(input_ids=ids, position_ids=position.view(1, 1).expand(b, 1),
                         attention_mask=mask,
                         past_key_values=cache, use_cache=True)
        return out.logits[:, -1].float()

    def reset(self) -> None:
        """Zero every KV cache (queued on the device; no sync)."""
        for cache in self.caches.values():
            cache.reset()

    def example_args(self, batch: int, position: int = 0, seed: int = 0):
        """``(ids, position)`` device tensors for ``batch`` rows at ``position`` (ids from a seeded
        generator)."""
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        if not 0 <= position < self.max_len:
            raise ValueError(f"position must be in 0..{self.max_len - 1}, got {position}")
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(3, self.model.config.vocab_size, (batch, 1), generator=g)
        return ids.to(self.device), torch.full((1,), position, dtype=torch.long, device=self.device)


def model_backend():
    """A real CUDA-graph backend on the GPU path; the recording backend on the simulator path, whose
    capture lets transformers' same-device moves (``t.to(x.device)``) pass, as a GPU does."""
    return CudaGraphBackend() if runtime().on_gpu else RecordingBackend()


def graph_cached(decoder, buckets=None, fusion: bool = False, fused=None) -> GraphCache:
    """``decoder.step`` in a GraphCache: ``ids`` batched (padding rows: token 0, scratch rows),
    ``position`` shared. ``fusion=True`` captures the step compiled by ``torch.compile``; ``fused``
    gives that compiled step yourself."""
    if not hasattr(decoder, "cache_for"):
        raise TypeError(f"graph_cached wraps a StaticDecoder (its step takes device tensors only), "
                        f"got {type(decoder).__name__}")
    return GraphCache(decoder.step, buckets=buckets, batched=(0,), pad_value=(0, 0),
                      fusion=fusion or fused is not None,
                      fused=fused, backend=model_backend())
