"""The batch-1 token loop captured by hand: gpt-fast's ``decode_one_token``, with transformers.

Static token and position buffers and the decoder's static KV cache, a warm-up on a side stream, one
capture of the step and its argmax; per token: replay, clone the next token, feed it back, advance.
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
