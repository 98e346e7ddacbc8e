"""Does a call make the host wait for the GPU? The robust test, and the misleading one.

The robust test queues a long GPU sleep (``torch.cuda._sleep``) first, then calls the
function and reads the host clock when it returns. An asynchronous call returns long
before the sleep ends; a call that synchronizes (``.item()``, a device-to-host copy,
``torch.cuda.synchronize()``) returns only after it.

The misleading test ("the event recorded after the call is already complete, so the
call synchronized") mistakes a slow launch for a sync: when the host takes longer to
launch a kernel than the GPU takes to run it, the event is complete either way.
"""
from __future__ import annotations

import dataclasses
import time
from functools import lru_cache

from course.core.runtime import runtime


@dataclasses.dataclass(frozen=True)
class BlockingReport:
    """Result of :func:`host_blocking`. Times in milliseconds."""

    host_return_ms: float | None  # host time from just before the sleep to the call's return
    gpu_busy_ms: float | None  # host time from just before the sleep until the GPU finished
    blocked: bool | None  # True: the call waited for the GPU; None: not measurable here
    note: str = ""


@lru_cache(maxsize=1)
def sleep_cycles_per_ms() -> float:
    """Calibrate ``torch.cuda._sleep``: GPU clock cycles per millisecond (measured with events)."""
    import torch

    cycles = 10_000_000
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    rates = []
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.cuda._sleep(cycles)
        b.record()
        b.synchronize()
        rates.append(cycles / a.elapsed_time(b))
    return sorted(rates)[1]


def gpu_sleep(ms: float) -> None:
    """Queue a GPU kernel that spins for about ``ms`` milliseconds (GPU path only)."""
    import torch

    torch.cuda._sleep(int(ms * sleep_cycles_per_ms()))


def host_blocking(fn, *, sleep_ms: float = 50.0, warmup: int = 1) -> BlockingReport:
    """Queue ``sleep_ms`` of GPU work, call ``fn``, and measure whether it returned first.

    ``blocked`` is True when ``fn`` returned only after at least 80 % of the sleep had
    elapsed: it waited for the GPU. Needs the GPU path; on the simulator every call is
    synchronous by construction, so the report says ``blocked=None``.
    """
    if not runtime().on_gpu:
        return BlockingReport(None, None, None, "needs a real GPU: the simulator "
                                                "runs kernels synchronously")
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    cycles = int(sleep_ms * sleep_cycles_per_ms())
    t0 = time.perf_counter()
    torch.cuda._sleep(cycles)
    fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    host_ms, busy_ms = (t1 - t0) * 1e3, (t2 - t0) * 1e3
    blocked = host_ms >= 0.8 * min(sleep_ms, busy_ms)
    return BlockingReport(host_ms, busy_ms, blocked,
                          "returned after the GPU "
                          "finished" if blocked else "returned while the GPU was still busy")


def event_complete_right_after(fn, *, warmup: int = 1) -> bool | None:
    """The misleading test: is an event recorded right after ``fn`` already complete?

    Shown in the course to explain why it is *not* evidence of a sync. None on the simulator.
    """
    if not runtime().on_gpu:
        return None
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    fn()
    ev = torch.cuda.Event()
    ev.record()
    return bool(ev.query())
