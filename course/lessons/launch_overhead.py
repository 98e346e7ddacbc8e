"""Launch overhead: how long the CPU takes to issue a kernel vs how long the GPU runs it.

Experiments (see :mod:`course.core.reference`):

- ``launch_costs`` (GPU; its code stands in lesson 01's cell, :mod:`course.core.cells`): host cost to issue one
  tiny op, for torch and for Numba kernels, beside the GPU's own execution time of the same kernel (measured
  inside a CUDA graph, where no launch gaps remain). This module keeps its bookkeeping
  (:func:`launch_costs_result`) and kernels (:func:`tiny_kernels`).
- ``launch_sweep`` (GPU): the same three times for ``x.add_(1)`` as the tensor grows from
  64 bytes to 1 GiB: a flat launch-bound region, a bandwidth-bound slope, and the crossover. The sizes are
  measured in turns (:func:`sweep_timings`), so a passing disturbance cannot make one size an outlier;
  :func:`outliers` names any point that still stands far off its neighbours. Bookkeeping: :func:`sweep_result`.
- ``launch_timeline`` (GPU): a torch.profiler trace of 30 tiny ops: CPU launches vs GPU kernels,
  with the idle gaps between kernels. Bookkeeping: :func:`chrome_trace`, :func:`timeline_result`.
- ``cpu_dispatch`` (live everywhere): the CPU-side dispatch cost of tiny torch ops on CPU tensors,
  swept over size: the same shape of curve, measured on this machine. Bookkeeping: :func:`cpu_dispatch_result`.

All four are written in lesson 01's cells (:mod:`course.core.cells`); this module keeps what they share.
"""
from __future__ import annotations

import json
import os
import tempfile
from functools import lru_cache

from course.core.results import Result
from course.core.runtime import cuda
from course.core.timing import Timing, time_graph_replay, time_interleaved

OPS_PER_GRAPH = 50


def graph_time_per_op(op, ops: int = OPS_PER_GRAPH, repeats: int = 15):
    """GPU execution time of one ``op()``: capture ``ops`` calls in a CUDA graph, replay, divide.

    Replay issues the whole graph with one launch, so the time per op is the kernel's own
    execution time plus the GPU's tiny inter-kernel gap, with no CPU launch cost in it.
    Returns (seconds per op, the per-replay Timing).
    """
    t = time_graph_replay(op, calls=ops, warmup=3, repeats=repeats)
    return t.median / ops, t


def crossover_bytes(rows, launch_key: str = "host_enqueue_us", exec_key: str = "kernel_exec_us"):
    """Smallest tensor size (bytes) whose kernel execution time reaches the launch cost.

    The launch cost is the median host enqueue time across all sizes (it hardly depends on
    size). Returns None when no size reaches it.
    """
    import statistics

    launch = statistics.median(r[launch_key] for r in rows)
    for r in sorted(rows, key=lambda r: r["bytes"]):
        if r[exec_key] >= launch:
            return r["bytes"]
    return None


def pow2_sizes(min_exp: int, max_exp: int, step: int = 2) -> list:
    """``[2**min_exp, 2**(min_exp+step), ...]`` up to ``2**max_exp``: the element counts a sweep visits."""
    if min_exp > max_exp or step < 1:
        raise ValueError(f"a sweep needs min_exp <= max_exp and step >= 1, got {min_exp}, {max_exp}, {step}")
    return [2 ** e for e in range(min_exp, max_exp + 1, step)]


ncuda = None  # numba.cuda, bound on first use (kernels must reach it as a module global)


@lru_cache(maxsize=1)
def _kernels():
    """An empty kernel and a one-array kernel, compiled lazily."""
    global ncuda
    ncuda = cuda()

    @ncuda.jit
    def empty():
        pass

    @ncuda.jit
    def add_one(a):
        i = ncuda.grid(1)
        if i < a.size:
            a[i] += 1.0

    return empty, add_one


def tiny_kernels():
    """The two Numba kernels lesson 01 launches: ``empty()`` and ``add_one(a)`` (``a[i] += 1``), compiled once."""
    return _kernels()


def launch_costs_result(rows: list, repeats: int) -> Result:
    """The ``launch_costs`` table from the cell's measurements: one row per op.

    ``rows``: ``{"op": name, "enqueue": Timing, "gpu": Timing, "exec_s": seconds}`` per op, the first a torch op
    and the second the empty Numba kernel (the summary reads them by position).
    """
    out = [{"op": r["op"], "host_enqueue_us": r["enqueue"].us, "host_q1_us": r["enqueue"].q1 * 1e6,
            "host_q3_us": r["enqueue"].q3 * 1e6, "gpu_per_call_us": r["gpu"].us, "kernel_exec_us": r["exec_s"] * 1e6}
           for r in rows]
    res = Result("launch_costs", "Launch cost vs execution time of one tiny op",
                 {"op": "", "host_enqueue_us": "us", "host_q1_us": "us", "host_q3_us": "us",
                  "gpu_per_call_us": "us", "kernel_exec_us": "us"}, out,
                 params={"repeats": repeats})
    res.add_summary("torch_launch_us", out[0]["host_enqueue_us"], "us")
    res.add_summary("torch_kernel_exec_us", out[0]["kernel_exec_us"], "us")
    res.add_summary("numba_empty_launch_us", out[1]["host_enqueue_us"], "us")
    res.add_summary("torch_launch_over_exec", out[0]["host_enqueue_us"] / out[0]["kernel_exec_us"], "x")
    return res


def sweep_timings(ops: dict, replays: dict, repeats: int = 15, inner: int = OPS_PER_GRAPH) -> dict:
    """``{size: (enqueue, eager, replay)}`` Timings per call for every size, each clock measured in turns.

    ``ops[size]`` is one call of the op; ``replays[size]`` replays a graph of ``inner`` calls of it. Each clock
    is one :func:`~course.core.timing.time_interleaved` run over all the sizes (every repeat visits every size,
    in a rotated order), so something that disturbs the machine for a while (a clock change, another process)
    lands on a few repeats of many sizes, and the medians stay put. Measured one size after the other, the same
    disturbance would land on most repeats of one size and make it an outlier. ``replay`` is per call too
    (one replay's time divided by ``inner``).
    """
    enq = time_interleaved(ops, clock="enqueue", warmup=10, repeats=repeats, inner=inner)
    eager = time_interleaved(ops, clock="device", warmup=10, repeats=repeats, inner=inner)
    rep = time_interleaved(replays, clock="device", warmup=3, repeats=repeats, inner=1)
    per_call = {n: Timing(t.median / inner, t.q1 / inner, t.q3 / inner, t.min / inner, t.max / inner, t.repeats,
                          inner, t.clock) for n, t in rep.items()}
    return {n: (enq[n], eager[n], per_call[n]) for n in ops}


def outliers(rows, key: str = "kernel_exec_us", factor: float = 3.0) -> list:
    """Rows whose ``key`` is more than ``factor`` times both neighbours' (or less than a ``factor``-th of both),
    in order of ``bytes``: ``[(row, left neighbour, right neighbour)]``. The first and last rows have one
    neighbour each and are never called outliers."""
    if factor <= 1:
        raise ValueError(f"factor must be > 1, got {factor}")
    rows = sorted(rows, key=lambda r: r["bytes"])
    out = []
    for left, r, right in zip(rows, rows[1:], rows[2:]):
        v, a, b = r[key], left[key], right[key]
        if (v > factor * a and v > factor * b) or (factor * v < a and factor * v < b):
            out.append((r, left, right))
    return out


def sweep_result(timings: dict, facts: dict, min_exp: int, max_exp: int, repeats: int) -> Result:
    """The ``launch_sweep`` table from the cell's :func:`sweep_timings` (``{elements: (enqueue, eager, replay)}``).

    ``facts``: :func:`course.core.hardware.memory_facts` (L2 size, the hardware's peak DRAM bandwidth).
    Columns: host enqueue time per op, GPU time per op when issued back to back (eager), and kernel execution time
    per op inside a CUDA graph, each a median with its quartiles. Summary: the crossover size, and bandwidth two
    ways: the highest seen at any size (data that fits in L2 included) and DRAM bandwidth, from sizes at least 4x
    the L2 cache only, beside the hardware peak.
    """
    import statistics

    l2 = facts["l2_bytes"] or 0
    rows = []
    for n, (enq, eager, rep) in timings.items():
        nbytes = n * 4
        rows.append({"elements": n, "bytes": nbytes, "host_enqueue_us": enq.us, "host_q1_us": enq.q1 * 1e6,
                     "host_q3_us": enq.q3 * 1e6, "eager_gpu_us": eager.us, "eager_q1_us": eager.q1 * 1e6,
                     "eager_q3_us": eager.q3 * 1e6, "kernel_exec_us": rep.us, "kernel_exec_q1_us": rep.q1 * 1e6,
                     "kernel_exec_q3_us": rep.q3 * 1e6, "bandwidth_GBps": 2 * nbytes / rep.median / 1e9,
                     "fits_in_l2": bool(l2) and nbytes <= l2})
    res = Result("launch_sweep", "x.add_(1) on float32 tensors: launch cost vs kernel time (sizes measured in turns)",
                 {"elements": "", "bytes": "B", "host_enqueue_us": "us", "host_q1_us": "us", "host_q3_us": "us",
                  "eager_gpu_us": "us", "eager_q1_us": "us", "eager_q3_us": "us", "kernel_exec_us": "us",
                  "kernel_exec_q1_us": "us", "kernel_exec_q3_us": "us", "bandwidth_GBps": "GB/s",
                  "fits_in_l2": ""}, rows,
                 params={"min_exp": min_exp, "max_exp": max_exp, "repeats": repeats,
                         "method": "every repeat visits every size in a rotated order (time_interleaved)"})
    res.add_summary("launch_us", statistics.median(r["host_enqueue_us"] for r in rows), "us")
    res.add_summary("smallest_kernel_exec_us", rows[0]["kernel_exec_us"], "us")
    res.add_summary("crossover_bytes", crossover_bytes(rows), "B")
    res.add_summary("peak_bandwidth_GBps", max(r["bandwidth_GBps"] for r in rows), "GB/s")
    res.add_summary("l2_bytes", l2, "B")
    dram = [r["bandwidth_GBps"] for r in rows if l2 and r["bytes"] >= 4 * l2]
    if dram:
        res.add_summary("dram_bandwidth_GBps", max(dram), "GB/s")
    if facts["peak_dram_GBps"]:
        res.add_summary("hardware_peak_dram_GBps", facts["peak_dram_GBps"], "GB/s")
    return res


def _trace_rows(trace: dict, skip: int = 5):
    """Pull CPU launch calls and GPU kernels out of a chrome trace, times relative to the first kept kernel."""
    ev = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    kernels = sorted((e for e in ev if e.get("cat") == "kernel"), key=lambda e: e["ts"])[skip:]
    launches = sorted((e for e in ev if e.get("cat") == "cuda_runtime" and "LaunchKernel" in e.get("name", "")),
                      key=lambda e: e["ts"])[skip:]
    if not kernels:
        return []
    t0 = min(launches[0]["ts"] if launches else kernels[0]["ts"], kernels[0]["ts"])
    rows = [{"lane": "CPU: cudaLaunchKernel", "name": e["name"], "start_us": e["ts"] - t0, "dur_us": e["dur"]}
            for e in launches]
    rows += [{"lane": "GPU: kernel", "name": e["name"][:40], "start_us": e["ts"] - t0, "dur_us": e["dur"]}
             for e in kernels]
    return rows


def chrome_trace(prof) -> dict:
    """The chrome trace of a finished ``torch.profiler.profile`` as a dict (exported to a temporary file, read back)."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)


def timeline_result(trace: dict, ops: int, skip: int) -> Result:
    """The ``launch_timeline`` table from a chrome trace: CPU launches and GPU kernels after the first ``skip``
    of each, and the GPU's busy fraction, mean kernel time and mean idle gap between kernels."""
    rows = _trace_rows(trace, skip=skip)
    res = Result("launch_timeline", f"Profiler timeline of {ops} tiny ops",
                 {"lane": "", "name": "", "start_us": "us", "dur_us": "us"}, rows, params={"ops": ops})
    k = [r for r in rows if r["lane"].startswith("GPU")]
    if k:
        span = k[-1]["start_us"] + k[-1]["dur_us"] - k[0]["start_us"]
        busy = sum(r["dur_us"] for r in k)
        res.add_summary("gpu_busy_fraction", busy / span, "")
        res.add_summary("mean_kernel_us", busy / len(k), "us")
        res.add_summary("mean_gap_us", (span - busy) / max(len(k) - 1, 1), "us")
    return res


def cpu_dispatch_result(timings: dict, min_exp: int, max_exp: int, repeats: int) -> Result:
    """The ``cpu_dispatch`` table from the cell's ``{elements: Timing}`` (wall clock per op, CPU tensors).

    Summary: the per-op floor (what the CPU pays to issue any op) and the first size whose time is twice it.
    """
    import torch

    rows = [{"elements": n, "bytes": n * 4, "time_us": t.us, "q1_us": t.q1 * 1e6, "q3_us": t.q3 * 1e6}
            for n, t in timings.items()]
    res = Result("cpu_dispatch", "x.add_(1) on CPU tensors: per-op time vs size",
                 {"elements": "", "bytes": "B", "time_us": "us", "q1_us": "us", "q3_us": "us"}, rows,
                 params={"min_exp": min_exp, "max_exp": max_exp, "repeats": repeats, "threads": torch.get_num_threads()})
    floor = min(r["time_us"] for r in rows)
    res.add_summary("dispatch_floor_us", floor, "us")
    doubled = next((r["bytes"] for r in rows if r["time_us"] >= 2 * floor), None)
    res.add_summary("size_at_twice_floor_bytes", doubled, "B")
    return res


def check_crossover(fn, sweep: Result) -> None:
    """Exercise check: ``fn(rows)`` must return the crossover size (bytes) of ``sweep``'s rows."""
    got = fn(sweep.rows)
    want = sweep.value("crossover_bytes")
    assert got == want, (f"your crossover is {got!r} bytes but the data say {want!r}: take the median "
                         "host_enqueue_us as the launch cost, then the smallest 'bytes' whose kernel_exec_us reaches it")
