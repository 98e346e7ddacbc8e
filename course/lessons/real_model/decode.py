"""One decode step of the Llama model, three ways: naive, capturable, and wrapped in the graph cache.

- :class:`NaiveDecoder`: the wrapper you write first. It takes the position as a Python int and builds
  ``torch.tensor([position], device=...)`` every step (a host-to-device copy: it cannot be captured), and
  it trusts the KV cache's own length counter, which every run of the step advances (so a warm-up or a
  capture run shifts every later step). The hazard finder points at its lines.
- :class:`StaticDecoder`: the fixed step. Its inputs are device tensors: ``ids`` ``[B, 1]`` and
  ``position`` ``[1]``. It writes the position into the cache's counter, builds the attention mask and
  position ids from it on the device, and runs the model with a ``transformers.StaticCache`` (one per
  batch size, allocated once). The same inputs give the same result however often it runs, and nothing
  in it reads the device from the host: one CUDA graph per batch size serves every step.
- :func:`graph_cached`: :class:`StaticDecoder.step` in lesson 04's
  :class:`~course.lessons.graph_cache.cache.GraphCache`, with batch buckets. A batch of ``n`` rows padded
  to bucket ``b`` runs on bucket ``b``'s KV cache, whose rows ``n..b-1`` belong to no sequence: the
  padding rows (token 0) write their K/V there, a scratch area.

All rows of a batch decode in lockstep (one position for the batch), as in a batched ``generate``.
"""
from __future__ import annotations

import torch

from course.lessons.graph_cache.backends import CudaGraphBackend, RecordingBackend
from course.lessons.graph_cache.cache import GraphCache

class NaiveDecoder:
    """The first wrapper anyone writes around ``model(...)``: correct eagerly, not capturable (see the module doc)."""

    def __init__(self, model, max_len: int = 256):
        from transformers import StaticCache

        self.model, self.max_len = model, max_len
        self.cache = StaticCache(config=model.config, max_cache_len=max_len)

    def step(self, ids, position: int):
        """Logits ``[B, vocab]`` of the next token after ``ids`` (``[B, 1]``) at ``position`` (a Python int)."""
        pos = torch.tensor([[position]], device=ids.device)  # a host-to-device copy on every step
        out = self.model(input_ids=ids, position_ids=pos.expand(ids.shape[0], 1), past_key_values=self.cache,
                         use_cache=True)  # the cache writes where its own counter says, and advances it
        return out.logits[:, -1].float()

    def reset(self) -> None:
        """Empty the KV cache (and its length counter) before a new sequence."""
        self.cache.reset()


class StaticDecoder:
    """The capturable decode step (see the module doc): ``step(ids, position)`` on device tensors only."""

    def __init__(self, model, max_len: int = 256):
        if max_len < 2 or max_len > model.config.max_position_embeddings:
            raise ValueError(f"max_len must be in 2..{model.config.max_position_embeddings} (the model's positions), "
                             f"got {max_len}")
        self.model, self.max_len = model, max_len
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.caches: dict = {}
        self._arange = torch.arange(max_len, device=self.device)

    def cache_for(self, batch: int):
        """The StaticCache of ``batch`` rows, allocated (and its counter moved to the device) on first use."""
        if batch not in self.caches:
            from transformers import StaticCache

            c = self.model.config
            cache = StaticCache(config=c, max_cache_len=self.max_len)
            cache.early_initialization(batch, c.num_key_value_heads, c.hidden_size // c.num_attention_heads,
                                       self.dtype, self.device)
            self.caches[batch] = cache
        return self.caches[batch]

    def step(self, ids, position):
        """Logits ``[B, vocab]`` (float32) after ``ids`` (int64 ``[B, 1]``) at ``position`` (int64 ``[1]``), on the device.

        Writes each row's K/V at ``position`` of this batch size's cache, attends over 0..position.
        """
        if ids.dim() != 2 or ids.shape[1] != 1 or position.shape != (1,):  # shapes only: no device value is read
            raise ValueError(f"step takes ids [B, 1] and position [1] (device tensors), got ids "
                             f"{tuple(ids.shape)} and position {tuple(position.shape)}")
        b = ids.shape[0]
        cache = self.cache_for(b)
        for layer in cache.layers:  # the write position comes from our buffer, not from how often we ran
            layer.cumulative_length.copy_(position[0])
        mask = (self._arange <= position).view(1, 1, 1, self.max_len).expand(b, 1, 1, self.max_len)
        out = self.model(input_ids=ids, position_ids=position.view(1, 1).expand(b, 1), attention_mask=mask,
                         past_key_values=cache, use_cache=True)
        return out.logits[:, -1].float()

    def reset(self) -> None:
        """Zero every KV cache (queued on the device; no sync)."""
        for cache in self.caches.values():
            cache.reset()

    def example_args(self, batch: int, position: int = 0, seed: int = 0):
        """``(ids, position)`` device tensors for ``batch`` rows at ``position`` (ids drawn from a seeded generator)."""
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        if not 0 <= position < self.max_len:
            raise ValueError(f"position must be in 0..{self.max_len - 1}, got {position}")
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(3, self.model.config.vocab_size, (batch, 1), generator=g)
        return ids.to(self.device), torch.full((1,), position, dtype=torch.long, device=self.device)


class ModelRecordingBackend(RecordingBackend):
    """The recording backend for a transformers model (simulator path).

    transformers moves tensors to the device they are already on (``t.to(x.device)``): a no-op on every
    machine, and the simulated capture lets such same-device moves pass, as a GPU does. A ``.to("cpu")``
    written as a string, ``.item()``, ``.tolist()`` and the other host reads are refused with the GPU's errors
    (:mod:`course.sim.patch`).
    """


def model_backend():
    """A real CUDA-graph backend on the GPU path, :class:`ModelRecordingBackend` on the simulator path."""
    from course.core.runtime import runtime

    return CudaGraphBackend() if runtime().on_gpu else ModelRecordingBackend()


def graph_cached(decoder: StaticDecoder, buckets=None, fusion: bool = False, fused=None) -> GraphCache:
    """``decoder.step`` in a GraphCache: ``ids`` batched (padding rows: token 0, scratch rows), ``position`` not.

    ``buckets``: batch sizes to capture (None: one graph per exact batch size); ``fusion=True`` captures
    the step compiled by ``torch.compile`` (default mode) instead of its eager kernels; ``fused`` gives
    that compiled step yourself (e.g. compiled with ``mode="max-autotune-no-cudagraphs"``).
    """
    if not isinstance(decoder, StaticDecoder):
        raise TypeError(f"graph_cached wraps a StaticDecoder (its step takes device tensors only), "
                        f"got {type(decoder).__name__}")
    return GraphCache(decoder.step, buckets=buckets, batched=(0,), pad_value=(0, 0), fusion=fusion or fused is not None,
                      fused=fused, backend=model_backend())
