"""Measurement, the one way every lesson times things.

Rules: warm up first; repeat; report the median with the spread (quartiles, min,
max); time GPU work with CUDA events (GPU clock) or synchronize before reading a
host clock. Each function returns a :class:`Timing` in seconds.
"""
from __future__ import annotations

import dataclasses
import statistics
import time

from course.core.runtime import runtime, synchronize


@dataclasses.dataclass(frozen=True)
class Timing:
    """Per-call time statistics, in seconds."""

    median: float
    q1: float
    q3: float
    min: float
    max: float
    repeats: int
    inner: int  # calls per repeat; every statistic is per call
    clock: str  # "cuda-events", "host-synchronized" or "host-enqueue"

    @property
    def us(self) -> float:
        """Median in microseconds."""
        return self.median * 1e6

    @property
    def ms(self) -> float:
        """Median in milliseconds."""
        return self.median * 1e3

    def spread_us(self) -> tuple:
        """(q1, q3) in microseconds."""
        return self.q1 * 1e6, self.q3 * 1e6

    def __str__(self) -> str:
        return (f"{self.us:.2f} us per call (median of {self.repeats}x{self.inner}, "
                f"IQR {self.q1*1e6:.2f}-{self.q3*1e6:.2f} us, {self.clock})")


def _stats(samples: list, inner: int, clock: str) -> Timing:
    per = sorted(s / inner for s in samples)
    if len(per) >= 4:
        q1, _, q3 = statistics.quantiles(per, n=4)
    else:
        q1, q3 = per[0], per[-1]
    return Timing(statistics.median(per), q1, q3, per[0], per[-1], len(per), inner, clock)


def _check(repeats: int, inner: int, warmup: int) -> None:
    if repeats < 1 or inner < 1 or warmup < 0:
        raise ValueError("repeats and inner must be >= 1 and warmup "
                         f">= 0 (got {repeats}, {inner}, {warmup}).")


def time_device(fn, *, warmup: int = 5, repeats: int = 25, inner: int = 10) -> Timing:
    """Time ``fn`` as the GPU sees it: CUDA events around ``inner`` back-to-back calls.

    This is what the GPU spends per call including any idle gaps waiting for the CPU,
    so for tiny kernels it equals the launch cost. On the simulator path it falls back
    to :func:`time_wall`.
    """
    _check(repeats, inner, warmup)
    if not runtime().on_gpu:
        return time_wall(fn, warmup=warmup, repeats=repeats, inner=inner)
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = [one_sample(fn, inner, "device") for _ in range(repeats)]
    return _stats(samples, inner, "cuda-events")


def time_wall(fn, *, warmup: int = 5, repeats: int = 25, inner: int = 10) -> Timing:
    """Host clock around ``inner`` calls, synchronizing the GPU before and after each repeat."""
    _check(repeats, inner, warmup)
    for _ in range(warmup):
        fn()
    synchronize()
    samples = [one_sample(fn, inner, "wall") for _ in range(repeats)]
    return _stats(samples, inner, "host-synchronized")


def time_enqueue(fn, *, warmup: int = 5, repeats: int = 25, inner: int = 10) -> Timing:
    """Host time to *issue* ``inner`` calls, without waiting for the GPU to run them.

    This is the CPU-side launch cost. The GPU is synchronized before each repeat (so
    the launch queue starts empty) but not inside the timed region. Keep ``inner``
    small enough that the launch queue (about a thousand entries) never fills.
    """
    _check(repeats, inner, warmup)
    for _ in range(warmup):
        fn()
    samples = [one_sample(fn, inner, "enqueue") for _ in range(repeats)]
    synchronize()
    return _stats(samples, inner, "host-enqueue")


def time_graph_replay(fn, *, calls: int, warmup: int = 3, repeats: int = 15) -> Timing:
    """Capture ``calls`` back-to-back calls of ``fn`` into one CUDA graph and time its replays with
    events.

    The returned Timing is per *replay* (clock "cuda-events"); divide by ``calls`` for the GPU's own
    time per call, with no CPU launch cost in it. GPU only.
    """
    graph = capture_calls(fn, calls)
    t = time_device(graph.replay, warmup=warmup, repeats=repeats, inner=1)
    del graph
    return t


def capture_calls(fn, calls: int):
    """A ``torch.cuda.CUDAGraph`` of ``calls`` back-to-back calls of ``fn``, warmed up first (GPU
    only).

    Replay it and time the replays to get the GPU's own time per call (:func:`time_graph_replay`
    does both).
    """
    if calls < 1:
        raise ValueError(f"calls must be >= 1, got {calls}")
    import torch

    from course.core.capture import graph as capture_graph, require_gpu, warm_up

    require_gpu("capturing calls into a CUDA graph")

    def body():
        for _ in range(calls):
            fn()

    warm_up(body, 2)
    graph = torch.cuda.CUDAGraph()
    with capture_graph(graph):  # torch.cuda.graph that leaves CUDA clean if the capture fails
        body()
    return graph


def graph_time(fn, *, calls: int = 10, repeats: int = 10) -> Timing:
    """Device time per call of ``fn``: ``calls`` calls captured into one CUDA graph, replays timed
    with events.

    GPU only. The returned :class:`Timing` is per call (replay time / ``calls``), clock
    "cuda-graph-replay".
    """
    t = time_graph_replay(fn, calls=calls, warmup=2, repeats=repeats)
    return Timing(t.median / calls, t.q1 / calls, t.q3 / calls, t.min / calls, t.max / calls, t.repeats, calls,
                  "cuda-graph-replay")


def time_ranks(fn, *, group=None, warmup: int = 3, repeats: int = 15, inner: int = 10) -> Timing:
    """Time a step holding a collective on every rank of ``group`` (call it on each): every repeat
    starts aligned by a one-element all-reduce (no rank skew), and counts as its slowest rank's
    time. Every rank returns the same :class:`Timing`."""
    _check(repeats, inner, warmup)
    import torch
    import torch.distributed as dist

    gpu = dist.get_backend(group) == "nccl"
    token = torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device()) if gpu else "cpu")
    for _ in range(warmup):
        fn()
    synchronize()
    samples = []
    for _ in range(repeats):
        dist.all_reduce(token, group=group)  # the aligned start
        # NCCL ranks: on the GPU path
        samples.append(one_sample(fn, inner, "device" if gpu else "wall"))
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, samples, group=group)
    return _stats([max(col) for col in zip(*every)], inner,
                  "cuda-events, slowest rank" if gpu else "host-synchronized, slowest rank")


# =====================================================================================
# Comparing variants: interleaved, and a speedup that names both sides
# =====================================================================================
_CLOCKS = {"device": "cuda-events", "wall": "host-synchronized", "enqueue": "host-enqueue"}


def one_sample(fn, inner: int, clock: str) -> float:
    """Seconds for ``inner`` back-to-back calls of ``fn``, one repeat: ``clock`` "device" (CUDA
    events; the synchronized host clock on the simulator), "wall" (synchronized host clock) or
    "enqueue" (host issue time)."""
    if clock == "device" and runtime().on_gpu:
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e-3
    synchronize()
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    if clock != "enqueue":
        synchronize()
    return time.perf_counter() - t0


def time_interleaved(variants: dict, *, clock: str = "device", warmup: int = 5, repeats: int = 25,
                     inner: int = 10) -> dict:
    """Time variants of the same work interleaved (each repeat runs every variant once, in a rotated
    order, so a drift lands on all alike). ``clock``: "device", "wall" or "enqueue". ``{name:
    Timing}``."""
    _check(repeats, inner, warmup)
    if clock not in _CLOCKS:
        raise ValueError(f"clock must be one of {sorted(_CLOCKS)}, not {clock!r}")
    if not variants:
        raise ValueError("time_interleaved needs at least one variant")
    names = list(variants)
    for name in names:
        for _ in range(warmup):
            variants[name]()
    synchronize()
    samples = {n: [] for n in names}
    for r in range(repeats):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            samples[name].append(one_sample(variants[name], inner, clock))
    used = _CLOCKS[clock] if (clock != "device" or runtime().on_gpu) else "host-synchronized"
    return {n: _stats(s, inner, used) for n, s in samples.items()}


@dataclasses.dataclass(frozen=True)
class Speedup:
    """``slow`` vs ``fast``: the ratio of medians, and whether the difference is inside the spread.
    """

    slow_name: str
    slow: Timing
    fast_name: str
    fast: Timing

    @property
    def ratio(self) -> float:
        """Median of ``slow`` divided by median of ``fast``."""
        return self.slow.median / self.fast.median

    @property
    def noise(self) -> bool:
        """True when the two interquartile ranges overlap: the difference is inside the spread."""
        return not (self.slow.q1 > self.fast.q3 or self.fast.q1 > self.slow.q3)

    def __str__(self) -> str:
        def side(name, t):
            return f"{name} {t.us:.2f} us (IQR {t.q1 * 1e6:.2f}-{t.q3 * 1e6:.2f})"
        verdict = ("the difference is inside the spread: noise" if self.noise
                   else f"{self.ratio:.1f}x")
        return f"{side(self.slow_name, self.slow)} vs {side(self.fast_name, self.fast)}: {verdict}"


def speedup(slow_name: str, slow: Timing, fast_name: str, fast: Timing) -> Speedup:
    """A :class:`Speedup` of ``fast`` over ``slow``; print it to name both medians and IQRs."""
    return Speedup(slow_name, slow, fast_name, fast)


def eager_versus(row: dict, other: str, fmt: str = ".1f") -> str:
    """``eager X us (IQR a-b) -> <other> Y us (IQR c-d): <verdict>`` from a result row's
    ``eager_us``, ``eager_q1_us``, ``eager_q3_us``, ``<other>_us``, ``<other>_q1_us``,
    ``<other>_q3_us`` and ``speedup`` (numbers formatted with ``fmt``). The verdict is "inside the
    spread, noise" when ``other``'s upper quartile reaches eager's lower one, else "<speedup>x
    faster"."""
    def side(name):
        return (f"{name} {row[f'{name}_us']:{fmt}} us (IQR {row[f'{name}_q1_us']:{fmt}}-"
                f"{row[f'{name}_q3_us']:{fmt}})")

    noise = row[f"{other}_q3_us"] >= row["eager_q1_us"]
    return (f"{side('eager')} -> {side(other)}: "
            + ("inside the spread, noise" if noise else f"{row['speedup']:.1f}x faster"))
