"""Parity programs about grad modes and the generator's seed inside a capture (see
:mod:`course.parity.programs`, which lists them with the verdicts a GPU gives).

Under ``torch.inference_mode()`` autograd no longer splits composite ops (``to``, ``linear``,
``matmul``...) before a dispatch mode sees them; the simulator's recorder splits them itself
(:mod:`course.sim.dispatch`), so a capture under inference mode replays what a GPU replays.
"""
from __future__ import annotations

import torch

from course.parity.tools import capture, close


def inference_mode_replay(cg, dev):
    """A forward with a dtype cast (``.to``), a linear layer and a matmul, warmed up and captured
    under ``inference_mode``: a replay follows the data copied in, as under ``no_grad``."""
    x, w = torch.randn(2, 8, device=dev), torch.randn(8, 8, device=dev)

    def forward():
        h = torch.nn.functional.linear(x, w).to(torch.float64)
        return torch.matmul(h, w.double()).float().argmax(-1, keepdim=True), h

    verdicts = []
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            g, (top, h) = capture(cg, forward)
            x.copy_(torch.randn(2, 8, device=dev))
            g.replay()
            want_top, want_h = forward()
        verdicts.append(bool(torch.equal(top, want_top) and close(h, want_h)))
    return f"replay follows the input: no_grad {verdicts[0]}, inference_mode {verdicts[1]}"
