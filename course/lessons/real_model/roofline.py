"""The floor under a decode step, and where each variant's time above it goes.

At batch 1 a decode step must read every weight once: it cannot beat ``bytes / bandwidth``, the
**weight-read floor**. The bandwidth is measured (:func:`copy_bandwidth_GBps`: a large device-to-device
copy timed with CUDA events, bytes read plus bytes written), the bytes come from the model
(:func:`~course.lessons.real_model.model.bytes_per_token`).

:func:`split` cuts each variant's time per token into what removed it: launch overhead (eager minus
graph-replayed), small-kernel execution (graph-replayed minus fused: many small kernels, each reading
and writing its activations, become fewer), what the fused step still spends above the floor, and the
floor itself.
"""
from __future__ import annotations

PARTS = ("floor", "fused above floor", "removed by fusion", "removed by graphs")
_PAID = {"eager": 4, "graph-cached": 3, "fused": 2}  # how many of PARTS each variant still pays


def copy_bandwidth_GBps(nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Device memory bandwidth in GB/s: ``dst.copy_(src)`` of ``nbytes``, (read + write) / time (GPU only)."""
    from course.core.capture import require_gpu
    from course.core.timing import time_device

    require_gpu("measuring the copy bandwidth")
    import torch

    if nbytes < 1 << 20:
        raise ValueError(f"use at least 1 MiB to measure memory bandwidth (got {nbytes} bytes): smaller copies "
                         "fit in L2 and time the launch")
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = time_device(lambda: dst.copy_(src), warmup=3, repeats=repeats, inner=5)
    del src, dst
    return 2 * nbytes / t.median / 1e9


def floor_us(nbytes: float, bandwidth_GBps: float) -> float:
    """Microseconds to read ``nbytes`` at ``bandwidth_GBps``: the lower bound on one decode step."""
    if nbytes < 0 or bandwidth_GBps <= 0:
        raise ValueError(f"need nbytes >= 0 and a positive bandwidth, got {nbytes}, {bandwidth_GBps}")
    return nbytes / (bandwidth_GBps * 1e9) * 1e6


def tokens_per_s(batch: int, step_us: float) -> float:
    """Tokens per second of a batch of ``batch`` sequences at ``step_us`` per step (one token per sequence)."""
    if step_us <= 0:
        raise ValueError(f"step time must be positive, got {step_us}")
    return batch / step_us * 1e6


def split(eager_us: float, graphed_us: float, fused_us: float, floor: float) -> dict:
    """``{variant: {part: us}}`` for eager, graph-cached and fused: the parts of :data:`PARTS` each still pays.

    A part that came out negative (a variant slower than the one it should improve on) is kept as
    measured: the caller sees it instead of a bar that hides it.
    """
    parts = {"floor": floor, "fused above floor": fused_us - floor, "removed by fusion": graphed_us - fused_us,
             "removed by graphs": eager_us - graphed_us}
    return {v: {p: parts[p] for p in PARTS[:n]} for v, n in _PAID.items()}
