"""Launch overhead, the idea: a tiny op's host issue time against its own run time, inside a graph
replay."""
from __future__ import annotations

import statistics
from functools import lru_cache

from course.core.runtime import cuda
from course.core.timing import Timing, time_graph_replay, time_interleaved

OPS_PER_GRAPH = 50
ncuda = None  # numba.cuda, bound on first use (kernels must reach it as a module global)


def graph_time_per_op(op, ops: int = OPS_PER_GRAPH, repeats: int = 15):
    """GPU time of one ``op()``: ``ops`` calls captured in a graph, replayed, divided; (seconds, the
    Timing)."""
    t = time_graph_replay(op, calls=ops, warmup=3, repeats=repeats)
    return t.median / ops, t


def crossover_bytes(rows, launch_key: str = "host_enqueue_us", exec_key: str = "kernel_exec_us"):
    """The smallest ``bytes`` whose kernel time reaches the median launch cost (None when none
    does)."""
    launch = statistics.median(r[launch_key] for r in rows)
    for r in sorted(rows, key=lambda r: r["bytes"]):
        if r[exec_key] >= launch:
            return r["bytes"]
    return None


def pow2_sizes(min_exp: int, max_exp: int, step: int = 2) -> list:
    """``[2**min_exp, 2**(min_exp+step), ...]`` up to ``2**max_exp``: the element counts a sweep
    visits."""
    if min_exp > max_exp or step < 1:
        raise ValueError(f"a sweep needs min_exp <= max_exp and step >= 1, got {min_exp}, "
                         f"{max_exp}, {step}")
    return [2 ** e for e in range(min_exp, max_exp + 1, step)]


@lru_cache(maxsize=1)
def tiny_kernels():
    """The two Numba kernels lesson 01 launches: ``empty()`` and ``add_one(a)`` (``a[i] += 1``),
    compiled once."""
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


def sweep_timings(ops: dict, replays: dict, repeats: int = 15, inner: int = OPS_PER_GRAPH) -> dict:
    """``{size: (enqueue, eager, replay)}`` Timings per call, each clock measured over all the sizes
    in turns.

    ``ops[size]`` is one call; ``replays[size]`` replays a graph of ``inner`` calls. A passing
    disturbance then lands on a few repeats of many sizes, and the medians stay put.
    """
    enq = time_interleaved(ops, clock="enqueue", warmup=10, repeats=repeats, inner=inner)
    eager = time_interleaved(ops, clock="device", warmup=10, repeats=repeats, inner=inner)
    rep = time_interleaved(replays, clock="device", warmup=3, repeats=repeats, inner=1)
    per_call = {n: Timing(t.median / inner, t.q1 / inner, t.q3 / inner, t.min / inner,
                          t.max / inner, t.repeats, inner, t.clock) for n, t in rep.items()}
    return {n: (enq[n], eager[n], per_call[n]) for n in ops}


def outliers(rows, key: str = "kernel_exec_us", factor: float = 3.0) -> list:
    """``[(row, left, right)]``: rows (in order of ``bytes``) over ``factor`` times both neighbours,
    or under."""
    if factor <= 1:
        raise ValueError(f"factor must be > 1, got {factor}")
    rows = sorted(rows, key=lambda r: r["bytes"])
    out = []
    for left, r, right in zip(rows, rows[1:], rows[2:]):
        v, a, b = r[key], left[key], right[key]
        if (v > factor * a and v > factor * b) or (factor * v < a and factor * v < b):
            out.append((r, left, right))
    return out
