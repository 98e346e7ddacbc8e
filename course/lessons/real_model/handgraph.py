"""The batch-1 decode step and its token loop, captured by hand: gpt-fast's ``decode_one_token``,
with transformers.

gpt-fast (PyTorch's "accelerating generative AI" example) decodes one token per call of
``decode_one_token``: the model's forward at ``input_pos`` and the next token, sampled on the
device, with the KV cache in static buffers; ``torch.compile(mode="reduce-overhead")`` records that
call into a CUDA graph. :class:`GraphedDecode` does the same recording by hand, on transformers'
Llama and its ``StaticCache`` (through a
:class:`~course.lessons.real_model.decode.StaticDecoder`), written once against ``cg =
course.graphs()`` so it runs on the GPU and on the simulator:

- **static inputs**: the current token ``ids`` ``[1, 1]`` and its ``pos`` ``[1]``, device tensors
  made once; each token is copied into them (``copy_``), never rebound (a replay reads the tensors
  the capture saw);
- **a static KV cache**: the decoder's ``StaticCache`` for batch 1, allocated before the capture;
  every step writes position ``pos`` (the step pins the cache's own counter to ``pos``) before
  attending over ``0..pos``;
- **warm-up on a side stream** (lazy initialisation must not happen inside a capture), then
  ``cg.graph(g)`` around one step: the logits and the next token (``argmax`` on the device: no host
  read inside the capture) are the graph's static outputs;
- **the loop**: copy the token and the position in, ``replay()``, clone the next token (the next
  replay overwrites it), feed it back, advance the position. No Python of the step runs after the
  capture.
"""
from __future__ import annotations

import torch

import course


class GraphedDecode:
    """One replay per token at batch 1: ``decoder.step`` and its argmax captured once (see the
    module doc)."""

    def __init__(self, decoder, warmup: int = 2):
        cg = course.graphs()
        self.decoder = decoder
        dev = decoder.device
        # static input: the current token
        self.ids = torch.zeros((1, 1), dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)  # static input: its position
        self.cache = decoder.cache_for(1)  # the static KV cache, allocated before the capture
        side = cg.Stream()
        side.wait_stream(cg.current_stream())
        with torch.no_grad(), cg.stream(side):
            for _ in range(warmup):  # lazy initialisation happens here, not inside the capture
                self.one_token()
        cg.current_stream().wait_stream(side)
        self.graph = cg.CUDAGraph()
        with torch.no_grad(), cg.graph(self.graph):
            self.next = self.one_token()  # static output: written by every replay (self.logits too)

    def one_token(self):
        """gpt-fast's ``decode_one_token``: the next token ``[1, 1]`` at ``pos``, on the device;
        logits kept."""
        self.logits = self.decoder.step(self.ids, self.pos)
        return self.logits.argmax(-1, keepdim=True)

    def step(self, ids, position):
        """A decode step like ``StaticDecoder.step`` (logits ``[1, vocab]``), by one replay: for
        timing and checks."""
        self.ids.copy_(ids)
        self.pos.copy_(position)
        self.graph.replay()
        return self.logits.clone()  # the next replay overwrites self.logits

    def generate(self, first_ids, n_tokens: int, start: int = 0):
        """``n_tokens`` greedy tokens after ``first_ids`` (int64 ``[1]``) at position ``start`` (0,
        or after a prompt prefilled into the cache): int64 ``[1, n_tokens]``."""
        if n_tokens < 1 or start < 0 or start + n_tokens > self.decoder.max_len:
            raise ValueError(f"start + n_tokens must be in 1..{self.decoder.max_len} (the cache's "
                             f"positions), got {start} + {n_tokens}")
        self.ids.copy_(first_ids.view(1, 1))
        self.pos.fill_(start)
        out = []
        for _ in range(n_tokens):
            self.graph.replay()
            out.append(self.next.clone())  # copied before the next replay overwrites it
            self.ids.copy_(self.next)  # fed back into the buffer the graph reads
            self.pos.add_(1)
        return torch.cat(out, dim=1)
