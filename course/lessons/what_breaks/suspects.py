"""Three functions with hidden capture hazards: lesson 03's debugging exercises, on code the learner
did not write. Each runs eagerly without a complaint; :data:`SUSPECTS` gives each one's inputs, the
GPU's verdict and the line that causes it (the simulator gives the same verdicts). The source
carries no hint: the learner reads it.
"""
from __future__ import annotations

import dataclasses
import inspect
import math

import torch

from course.core.runtime import torch_device


# --- 1 --------------------------------------------------------------------------------------------
def _temperature(logits):
    """A softmax temperature that grows with the spread of the logits."""
    spread = logits.std().item()
    return 1.0 + 0.1 * spread


def sharpened(logits):
    """Softmax of the logits, at a temperature chosen from their spread."""
    return torch.softmax(logits / _temperature(logits), dim=-1)


# --- 2 --------------------------------------------------------------------------------------------
def active_rows_mean(x):
    """The mean of the rows of x that are not all zero (padding rows are all zero)."""
    active = x[x.abs().sum(dim=1) > 0]
    return active.mean(dim=0)


# --- 3 --------------------------------------------------------------------------------------------
def rotated(x, step):
    """The pairs (x[:, 0], x[:, 1]) rotated by the angle of decode step ``step`` (an int)."""
    angle = 0.1 * step
    c, s = math.cos(angle), math.sin(angle)
    return torch.stack((c * x[:, 0] - s * x[:, 1], s * x[:, 0] + c * x[:, 1]), dim=1)


# --- the registry ---------------------------------------------------------------------------------
def _logits(g, dev):
    return (torch.randn(4, 10, generator=g).to(dev),)


def _padded(g, dev):
    x = torch.randn(6, 4, generator=g)
    x[torch.randperm(6, generator=g)[:2]] = 0  # two padding rows, in other places for other seeds
    return (x.to(dev),)


def _pairs(g, dev):
    return (torch.randn(5, 2, generator=g).to(dev), int(torch.randint(1, 50, (), generator=g)))


@dataclasses.dataclass(frozen=True)
class Suspect:
    """A function under suspicion: its inputs, what capture does to it, the line that causes it."""

    fn: object
    make: object  # make(generator, device) -> args
    where: object  # the function holding the line that causes it (a helper, for sharpened)
    code: str  # that line's code
    verdict: str  # "fails" or "replays wrong": capture fn on args(0), replay it on args(1)
    error: str  # the key phrase of the capture's error ("" when it captures)

    @property
    def name(self) -> str:
        """The function's name."""
        return self.fn.__name__

    def args(self, seed: int = 0, device=None) -> tuple:
        """Fresh inputs from ``seed`` on ``device`` (default course.device())."""
        g = torch.Generator().manual_seed(seed)
        return self.make(g, torch.device(device) if device is not None else torch_device())

    def hazard_line(self) -> tuple:
        """(function name, absolute line number) of the line that causes the verdict."""
        src, start = inspect.getsourcelines(self.where)
        (line,) = [start + i for i, text in enumerate(src) if text.strip() == self.code]
        return self.where.__name__, line


_REFUSED = "operation not permitted when stream is capturing"
SUSPECTS = (
    Suspect(sharpened, _logits, _temperature, "spread = logits.std().item()", "fails",
            _REFUSED),  # a host read
    Suspect(active_rows_mean, _padded, active_rows_mean, "active = x[x.abs().sum(dim=1) > 0]",
            "fails", _REFUSED),  # a data-dependent shape
    Suspect(rotated, _pairs, rotated, "angle = 0.1 * step", "replays wrong", ""),  # a frozen number
)


def get(name: str) -> Suspect:
    """The suspect called ``name``."""
    for s in SUSPECTS:
        if s.name == name:
            return s
    raise KeyError(f"no suspect {name!r}; known: {[s.name for s in SUSPECTS]}")
