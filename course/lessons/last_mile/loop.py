"""Dependent decode steps on the device: each step's token is the argmax of the step before, ``n`` steps per graph.

:func:`argmax_token` (a Triton kernel, launched like the step's) writes the greedy token of the logits into the next
step's ids: program ``i`` reduces block ``i`` of the logits, the last program to finish (a ticket, as in
:mod:`.split`) picks the best block, the first of equal maxima as ``torch.argmax`` does. It never lets the next
kernel start early, so each step begins after the one before has finished (the attention of :func:`~.kernels.
attention_ahead` reads the past before its wait).

:class:`TokenLoop` captures ``n`` steps of a :class:`~.decoder.TritonDecoder`, each followed by the argmax, in one CUDA
graph: the ``n`` positions live in a device buffer that the graph moves on by ``n`` at its end, and the last token
becomes the next replay's first. One replay decodes ``n`` tokens; nothing is read back. Under Triton's interpreter
the same calls run without a graph.
"""
from __future__ import annotations

import torch

from course.core.triton_path import triton
from course.lessons.last_mile.split import _last

tr = triton()
import triton.language as tl  # noqa: E402  (after the interpret decision, on purpose)

BLOCK = 4096  # logits per argmax program


@tr.jit
def argmax_token(logits_ptr, val_ptr, idx_ptr, count_ptr, ids_ptr, V, PDL: tl.constexpr, BLOCK: tl.constexpr,
                 G: tl.constexpr, GP: tl.constexpr):
    """``ids[0] = argmax(logits[:V])`` over ``G`` programs (``GP``: a power of two >= G); ``val``, ``idx``: ``[G]``
    scratch, ``count``: a ticket counter, zero between calls."""
    pid = tl.program_id(0)
    if PDL:
        tl.extra.cuda.gdc_wait()  # no early launch of the next step: it starts once this kernel has finished
    c = pid * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(logits_ptr + c, mask=c < V, other=float("-inf"))
    tl.store(val_ptr + pid, tl.max(x, axis=0))
    tl.store(idx_ptr + pid, pid * BLOCK + tl.argmax(x, axis=0, tie_break_left=True))
    if _last(count_ptr, G):
        b = tl.arange(0, GP)
        v = tl.load(val_ptr + b, mask=b < G, other=float("-inf"), cache_modifier=".cg")
        best = tl.argmax(v, axis=0, tie_break_left=True)
        tl.store(ids_ptr, tl.load(idx_ptr + best, cache_modifier=".cg").to(tl.int64))
        tl.store(count_ptr, 0)


class TokenLoop:
    """``n`` dependent greedy steps of ``decoder`` per call of :meth:`replay` (one CUDA graph on the GPU)."""

    def __init__(self, decoder, n: int, graph: bool | None = None):
        from course.core.triton_path import interpreting

        dev = decoder.device
        self.dec, self.n = decoder, n
        self.ids = torch.zeros(n + 1, 1, dtype=torch.int64, device=dev)  # ids[k]: step k's token
        self.pos = torch.zeros(n, dtype=torch.int64, device=dev)  # the positions of this replay's steps
        self.groups = -(-decoder.V // BLOCK)
        self.val = torch.zeros(self.groups, dtype=torch.float32, device=dev)
        self.idx = torch.zeros(self.groups, dtype=torch.int32, device=dev)
        self.count = torch.zeros(1, dtype=torch.int32, device=dev)
        self.graph = None
        if (not interpreting()) if graph is None else graph:
            from course.core.capture import graph as capture_graph, warm_up

            warm_up(self._steps, 2)
            self.graph = torch.cuda.CUDAGraph()
            with capture_graph(self.graph):
                self._steps()

    @property
    def kernels_per_token(self) -> int:
        """The step's kernels and the argmax."""
        return self.dec.kernels_per_token + 1

    def _steps(self) -> None:
        p2 = 1 << max(0, (self.groups - 1).bit_length())
        for k in range(self.n):
            self.dec.step(self.ids[k:k + 1], self.pos[k:k + 1])
            self.dec._go(argmax_token, self.groups, self.dec.logits, self.val, self.idx, self.count,
                         self.ids[k + 1], self.dec.V, BLOCK=BLOCK, G=self.groups, GP=p2)
        self.ids[0].copy_(self.ids[self.n])
        self.pos.add_(self.n)

    def start(self, token: int, position: int) -> None:
        """The next replay's first token and first position."""
        self.ids[0].fill_(token)
        torch.arange(position, position + self.n, out=self.pos)

    def replay(self) -> None:
        """``n`` steps: tokens into ``ids[1:]``, positions moved on by ``n``."""
        if self.graph is None:
            self._steps()
        else:
            self.graph.replay()

    def run(self, token: int, position: int, steps: int) -> torch.Tensor:
        """The ``steps`` greedy tokens after ``token`` at ``position`` (``steps`` a multiple of ``n``)."""
        if steps % self.n:
            raise ValueError(f"steps ({steps}) must be a multiple of the steps per replay ({self.n})")
        self.start(token, position)
        out = []
        for _ in range(steps // self.n):
            self.replay()
            out.append(self.ids[1:, 0].clone())
        return torch.cat(out)
