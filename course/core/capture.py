"""Trying a CUDA graph capture safely: warm-up on a side stream, capture, report, recover.

A failed capture must never poison later work: :func:`try_capture` catches the
error, makes sure no stream is left capturing, synchronizes, and checks that a
fresh op still runs, so the next cell (or test) starts clean. The outcome keeps
the root-cause error *and* the Python frames it came from, so a tool (the hazard
finder in :mod:`course.lessons.what_breaks`) can point at the line that broke the capture.
"""
from __future__ import annotations

import dataclasses
import traceback
import warnings

from course.core.runtime import CourseEnvironmentError, runtime


@dataclasses.dataclass
class CaptureOutcome:
    """What happened when ``fn`` was captured."""

    ok: bool
    error_type: str | None = None
    error: str | None = None  # first line of the root-cause message
    graph: object = None  # the torch.cuda.CUDAGraph when ok
    output: object = None  # what fn returned during capture (static output tensors)
    frames: tuple = ()  # (filename, lineno, function, source line) of the root cause, outermost first

    def __str__(self) -> str:
        return "captured" if self.ok else f"capture failed: {self.error_type}: {self.error}"


def _root_cause(exc: BaseException) -> BaseException:
    """The first error in the chain: what ``fn`` raised, not what ending the capture raised."""
    seen = exc
    while seen.__context__ is not None and seen.__context__ is not seen:
        seen = seen.__context__
    return seen


def exception_frames(exc: BaseException) -> tuple:
    """The traceback of ``exc`` as plain tuples (no frame objects, so no tensors are kept alive)."""
    return tuple((f.filename, f.lineno, f.name, (f.line or "").strip())
                 for f in traceback.extract_tb(exc.__traceback__))


def require_gpu(what: str) -> None:
    """Raise a clear error when ``what`` needs the GPU path."""
    rt = runtime()
    if not rt.on_gpu:
        raise CourseEnvironmentError(f"{what} needs a real GPU; this notebook runs on the simulator ({rt.reason}) "
                                     "so the course shows reference results recorded on a GPU instead.")


def recover() -> None:
    """Leave CUDA usable after a failed capture: no capture in progress, queue drained, ops run."""
    import torch

    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("a CUDA graph capture is still in progress on the current stream; "
                           "end it (leave the `with torch.cuda.graph(...)` block) before recovering.")
    try:
        torch.cuda.synchronize()
    except RuntimeError:
        pass
    torch.cuda.synchronize()
    reset_rng_capture_state()
    probe = torch.ones(4, device="cuda") * 2
    assert float(probe.sum()) == 8.0, "CUDA did not recover after the failed capture"
    torch.randn(1, device="cuda")  # the RNG works again (see reset_rng_capture_state)


def reset_rng_capture_state() -> None:
    """Take torch's CUDA random generators out of capture mode after a failed capture.

    Measured on torch 2.11 (H100): when a capture fails, the default CUDA generator is
    left flagged as "capturing", and every later ``torch.randn(..., device="cuda")`` raises
    ``Offset increment outside graph capture encountered unexpectedly`` (``torch.manual_seed``
    does not clear it). Swapping in a clone of each generator's state clears the flag and
    keeps the seed and offset, so random streams continue exactly where they were.
    """
    import torch

    for gen in torch.cuda.default_generators:
        gen.graphsafe_set_state(gen.clone_state())


def warm_up(fn, iters: int = 3):
    """Run ``fn`` ``iters`` times on a side stream (lazy init, allocator, cuBLAS handles), then join."""
    import torch

    out = None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(iters):
            out = fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    return out


def try_capture(fn, *, warmup: int = 3, pool=None, mode: str = "global") -> CaptureOutcome:
    """Warm ``fn`` up, capture one call of it into a CUDA graph, and report.

    ``mode`` is ``torch.cuda.graph``'s ``capture_error_mode``: "global" (torch's default), "thread_local" or
    "relaxed" (CUDA then allows calls, such as allocating memory, that are unsafe during capture).
    Never raises for a capture failure: the outcome carries the root-cause error
    and its traceback frames. Errors during warm-up (the function is broken even
    eagerly) are raised as is.
    """
    require_gpu("capturing a CUDA graph")
    import torch

    warm_up(fn, warmup)
    graph = torch.cuda.CUDAGraph()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.cuda.graph(graph, pool=pool, capture_error_mode=mode):
                out = fn()
    except Exception as e:  # noqa: BLE001 - we report every capture failure
        cause = _root_cause(e)
        frames = exception_frames(cause)
        msg = str(cause).strip().splitlines()[0] if str(cause).strip() else repr(cause)
        etype = type(cause).__name__
        del e, cause, graph  # drop references to tensors from the failed capture before recovering
        recover()
        return CaptureOutcome(False, etype, msg, frames=frames)  # warnings from the aborted capture are dropped
    for w in caught:  # a successful capture keeps its warnings (e.g. "the CUDA Graph is empty": wrong stream?)
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return CaptureOutcome(True, graph=graph, output=out)
