"""Lesson 01's recordings: the tables its experiment cells make (course/reference/*.json)."""
from __future__ import annotations

import json
import os
import statistics
import tempfile

import torch

from course.core.results import Result
from course.lessons.launch_overhead.launch import crossover_bytes

_US = "us"


def launch_costs_result(rows: list, repeats: int) -> Result:
    """The ``launch_costs`` table: one row per op, ``{"op", "enqueue", "gpu", "exec_s"}`` (torch
    first, then the empty Numba kernel: the summary reads them by position)."""
    out = [{"op": r["op"], "host_enqueue_us": r["enqueue"].us, "host_q1_us": r["enqueue"].q1 * 1e6,
            "host_q3_us": r["enqueue"].q3 * 1e6, "gpu_per_call_us": r["gpu"].us,
            "kernel_exec_us": r["exec_s"] * 1e6} for r in rows]
    res = Result("launch_costs", "Launch cost vs execution time of one tiny op",
                 {"op": "", "host_enqueue_us": _US, "host_q1_us": _US, "host_q3_us": _US,
                  "gpu_per_call_us": _US, "kernel_exec_us": _US}, out, params={"repeats": repeats})
    res.add_summary("torch_launch_us", out[0]["host_enqueue_us"], _US)
    res.add_summary("torch_kernel_exec_us", out[0]["kernel_exec_us"], _US)
    res.add_summary("numba_empty_launch_us", out[1]["host_enqueue_us"], _US)
    ratio = out[0]["host_enqueue_us"] / out[0]["kernel_exec_us"]
    res.add_summary("torch_launch_over_exec", ratio, "x")
    return res


def sweep_result(timings: dict, facts: dict, min_exp: int, max_exp: int, repeats: int) -> Result:
    """The ``launch_sweep`` table from ``{elements: (enqueue, eager, replay)}`` and ``facts`` (the
    L2 size, the peak DRAM bandwidth); its summary: the crossover, and bandwidth at best and from
    DRAM (sizes >= 4x L2)."""
    l2 = facts["l2_bytes"] or 0
    rows = []
    for n, (enq, eager, rep) in timings.items():
        nbytes = n * 4
        rows.append({"elements": n, "bytes": nbytes, "host_enqueue_us": enq.us,
                     "host_q1_us": enq.q1 * 1e6, "host_q3_us": enq.q3 * 1e6,
                     "eager_gpu_us": eager.us, "eager_q1_us": eager.q1 * 1e6,
                     "eager_q3_us": eager.q3 * 1e6, "kernel_exec_us": rep.us,
                     "kernel_exec_q1_us": rep.q1 * 1e6, "kernel_exec_q3_us": rep.q3 * 1e6,
                     "bandwidth_GBps": 2 * nbytes / rep.median / 1e9,
                     "fits_in_l2": bool(l2) and nbytes <= l2})
    times = ("host_enqueue_us", "host_q1_us", "host_q3_us", "eager_gpu_us", "eager_q1_us",
             "eager_q3_us", "kernel_exec_us", "kernel_exec_q1_us", "kernel_exec_q3_us")
    columns = {"elements": "", "bytes": "B", **{k: _US for k in times}, "bandwidth_GBps": "GB/s",
               "fits_in_l2": ""}
    res = Result("launch_sweep",
                 "x.add_(1) on float32 tensors: launch cost vs kernel time (sizes measured in "
                 "turns)", columns, rows,
                 params={"min_exp": min_exp, "max_exp": max_exp, "repeats": repeats,
                         "method": "every repeat visits every size in a rotated order "
                                   "(time_interleaved)"})
    res.add_summary("launch_us", statistics.median(r["host_enqueue_us"] for r in rows), _US)
    res.add_summary("smallest_kernel_exec_us", rows[0]["kernel_exec_us"], _US)
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
    """CPU launch calls and GPU kernels of a chrome trace, times relative to the first kept one."""
    ev = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    kernels = sorted((e for e in ev if e.get("cat") == "kernel"), key=lambda e: e["ts"])[skip:]
    launches = sorted((e for e in ev if e.get("cat") == "cuda_runtime"
                       and "LaunchKernel" in e.get("name", "")), key=lambda e: e["ts"])[skip:]
    if not kernels:
        return []
    t0 = min(launches[0]["ts"] if launches else kernels[0]["ts"], kernels[0]["ts"])
    rows = [{"lane": "CPU: cudaLaunchKernel", "name": e["name"], "start_us": e["ts"] - t0,
             "dur_us": e["dur"]} for e in launches]
    rows += [{"lane": "GPU: kernel", "name": e["name"][:40], "start_us": e["ts"] - t0,
              "dur_us": e["dur"]} for e in kernels]
    return rows


def chrome_trace(prof) -> dict:
    """The chrome trace of a finished ``torch.profiler.profile``, as a dict."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)


def timeline_result(trace: dict, ops: int, skip: int) -> Result:
    """The ``launch_timeline`` table: launches and kernels after the first ``skip``; the GPU's busy
    fraction, mean kernel time and mean gap between kernels."""
    rows = _trace_rows(trace, skip=skip)
    res = Result("launch_timeline", f"Profiler timeline of {ops} tiny ops",
                 {"lane": "", "name": "", "start_us": _US, "dur_us": _US}, rows,
                 params={"ops": ops})
    k = [r for r in rows if r["lane"].startswith("GPU")]
    if k:
        span = k[-1]["start_us"] + k[-1]["dur_us"] - k[0]["start_us"]
        busy = sum(r["dur_us"] for r in k)
        res.add_summary("gpu_busy_fraction", busy / span, "")
        res.add_summary("mean_kernel_us", busy / len(k), _US)
        res.add_summary("mean_gap_us", (span - busy) / max(len(k) - 1, 1), _US)
    return res


def cpu_dispatch_result(timings: dict, min_exp: int, max_exp: int, repeats: int) -> Result:
    """The ``cpu_dispatch`` table from ``{elements: Timing}``: the per-op floor, and the size at
    twice it."""
    rows = [{"elements": n, "bytes": n * 4, "time_us": t.us, "q1_us": t.q1 * 1e6,
             "q3_us": t.q3 * 1e6} for n, t in timings.items()]
    res = Result("cpu_dispatch", "x.add_(1) on CPU tensors: per-op time vs size",
                 {"elements": "", "bytes": "B", "time_us": _US, "q1_us": _US, "q3_us": _US}, rows,
                 params={"min_exp": min_exp, "max_exp": max_exp, "repeats": repeats,
                         "threads": torch.get_num_threads()})
    floor = min(r["time_us"] for r in rows)
    res.add_summary("dispatch_floor_us", floor, _US)
    doubled = next((r["bytes"] for r in rows if r["time_us"] >= 2 * floor), None)
    res.add_summary("size_at_twice_floor_bytes", doubled, "B")
    return res
