"""The roofline under a decode step, and where each variant's time above it goes.

The memory roof (the weight-read floor: bytes / the copy bandwidth), the compute roof (FLOP / the
matrix-product rate) and the ridge point where they meet; :func:`split` cuts a variant's time into
the floor, what fusion removed and what the graphs removed.
"""
from __future__ import annotations

import torch

from course.core.capture import require_gpu
from course.core.results import Result
from course.core.timing import time_device
from course.lessons.real_model.model import _size

PARTS = ("floor", "fused above floor", "removed by fusion", "removed by graphs")
_PAID = {"eager": 4, "graph-cached": 3, "fused": 2}  # how many of PARTS each variant still pays


def copy_bandwidth_GBps(nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Device memory bandwidth in GB/s: ``dst.copy_(src)`` of ``nbytes``, (read + write) / time (GPU
    only)."""
    require_gpu("measuring the copy bandwidth")
    if nbytes < 1 << 20:
        raise ValueError(f"use at least 1 MiB to measure memory bandwidth (got {nbytes} bytes): "
                         "smaller copies fit in L2 and time the launch")
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = time_device(lambda: dst.copy_(src), warmup=3, repeats=repeats, inner=5)
    del src, dst
    return 2 * nbytes / t.median / 1e9


def floor_us(nbytes: float, bandwidth_GBps: float) -> float:
    """Microseconds to read ``nbytes`` at ``bandwidth_GBps``: the lower bound on one decode step."""
    if nbytes < 0 or bandwidth_GBps <= 0:
        raise ValueError(f"need nbytes >= 0 and a positive bandwidth, got {nbytes}, "
                         f"{bandwidth_GBps}")
    return nbytes / (bandwidth_GBps * 1e9) * 1e6


def tokens_per_s(batch: int, step_us: float) -> float:
    """Tokens per second of a batch of ``batch`` sequences at ``step_us`` per step (one token per
    sequence)."""
    if step_us <= 0:
        raise ValueError(f"step time must be positive, got {step_us}")
    return batch / step_us * 1e6


def split(eager_us: float, graphed_us: float, fused_us: float, floor: float) -> dict:
    """``{variant: {part: us}}`` of eager, graph-cached and fused: the parts of :data:`PARTS` each
    still pays (a negative part kept as measured)."""
    parts = {"floor": floor, "fused above floor": fused_us - floor,
             "removed by fusion": graphed_us - fused_us,
             "removed by graphs": eager_us - graphed_us}
    return {v: {p: parts[p] for p in PARTS[:n]} for v, n in _PAID.items()}


def decode_flop(size, batch: int = 1, context: int = 0) -> float:
    """FLOP of one decode step of ``batch`` sequences of ``size``: 2 per weight of every product per
    sequence, and attention over ``context`` positions."""
    if batch < 1 or context < 0:
        raise ValueError(f"batch must be >= 1 and context >= 0, got batch={batch}, "
                         f"context={context}")
    s = _size(size)
    h, i, kv = s.hidden, s.intermediate, s.kv_heads * s.head_dim
    per_layer = h * h + 2 * h * kv + h * h + 3 * h * i  # q, k and v, o, gate, up and down
    weights = s.layers * per_layer + s.vocab * h  # and lm_head
    return 2.0 * batch * weights + 4.0 * batch * context * h * s.layers


def ridge_point(tflops: float, bandwidth_GBps: float) -> float:
    """FLOP per byte where the compute roof meets the memory roof: ``rate / bandwidth``."""
    if tflops <= 0 or bandwidth_GBps <= 0:
        raise ValueError(f"need a positive rate and bandwidth, got {tflops} TFLOP/s, "
                         f"{bandwidth_GBps} GB/s")
    return tflops * 1e12 / (bandwidth_GBps * 1e9)


def compute_floor_us(flop: float, tflops: float) -> float:
    """Microseconds to do ``flop`` at ``tflops`` TFLOP/s: the compute roof's bound on a step."""
    if flop < 0 or tflops <= 0:
        raise ValueError(f"need flop >= 0 and a positive rate, got {flop}, {tflops}")
    return flop / (tflops * 1e12) * 1e6


def roofline_rows(sweep, size="tinyllama", tflops: float | None = None) -> list:
    """Per batch of a batch sweep: the step's FLOP, bytes (from its floor rows), intensity, both
    roofs, which binds (with ``tflops``), and each variant's measured time."""
    bw = sweep.value("copy_bandwidth_GBps")
    context = sweep.params.get("position", 0)
    measured = {}
    for r in sweep.rows:
        if r["variant"] != "floor" and r["us"] == r["us"]:
            measured.setdefault(r["batch"], {})[r["variant"]] = r["us"]
    rows = []
    for r in sorted((r for r in sweep.rows if r["variant"] == "floor"), key=lambda r: r["batch"]):
        nbytes = r["us"] * bw * 1e3  # us x bytes per us
        flop = decode_flop(size, r["batch"], context)
        cfloor = compute_floor_us(flop, tflops) if tflops else None
        rows.append({"batch": r["batch"], "flop": flop, "bytes": nbytes,
                     "flop_per_byte": flop / nbytes,
                     "memory_floor_us": r["us"], "compute_floor_us": cfloor,
                     "bound": "unknown" if cfloor is None else "memory" if r["us"] >= cfloor
                     else "compute",
                     "measured_us": measured.get(r["batch"], {})})
    return rows


def matmul_rate_result(times: dict, bandwidth_GBps: float, repeats: int) -> Result:
    """The ``matmul_rate`` table: per size, the time of one product and its rate (at the median and
    quartiles); summary: the rate, the copy bandwidth, the ridge point."""
    if not times:
        raise ValueError("no sizes were timed: pass at least one size to matmul_rate")
    rows = []
    for n in sorted(times):
        t, flop = times[n], 2.0 * n ** 3
        rows.append({"n": n, "GFLOP": flop / 1e9, "us": t.us, "q1_us": t.q1 * 1e6,
                     "q3_us": t.q3 * 1e6,
                     "TFLOPs": flop / t.median / 1e12, "TFLOPs_at_q3": flop / t.q3 / 1e12,
                     "TFLOPs_at_q1": flop / t.q1 / 1e12})
    res = Result("matmul_rate",
                 "bfloat16 torch.matmul of two [n, n] matrices: time per product (CUDA events) and "
                 "rate, beside the copy bandwidth of the same run",
                 {"n": "", "GFLOP": "GFLOP", "us": "us", "q1_us": "us", "q3_us": "us",
                  "TFLOPs": "TFLOP/s",
                  "TFLOPs_at_q3": "TFLOP/s", "TFLOPs_at_q1": "TFLOP/s"}, rows,
                 params={"sizes": sorted(times), "repeats": repeats, "torch": torch.__version__})
    rate = rows[-1]["TFLOPs"]
    res.add_summary("bf16_matmul_TFLOPs", rate, "TFLOP/s")
    res.add_summary("copy_bandwidth_GBps", bandwidth_GBps, "GB/s")
    res.add_summary("ridge_FLOP_per_byte", ridge_point(rate, bandwidth_GBps), "FLOP/byte")
    return res
