"""Trying a CUDA graph capture safely: warm-up on a side stream, capture, report, recover.

A failed capture must never poison later work: :func:`graph` is ``torch.cuda.graph`` with that
guarantee, and :func:`try_capture` catches the error (its root cause and the frames it came from)
and checks that a fresh op still runs. On a GPU (H100, torch 2.11) a failed ``capture_end`` leaves
the allocators recording into the capture's pool (every later capture into it fails with
``beginAllocateToPool: already recording to mempool_id``), the capture stream current and the
generators in capture mode: :func:`graph` puts the stream and generators back, releases the device
pool (:func:`release_pool`) and never captures into that pool again. A graph freed by the garbage
collector during another capture breaks it, so :func:`graph` captures with the collector paused
(:func:`collector_paused`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
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
    # (filename, lineno, function, source line) of the root cause, outermost first
    frames: tuple = ()

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
        raise CourseEnvironmentError(f"{what} needs a real GPU; this notebook runs on the "
                                     f"simulator ({rt.reason}) so the course shows "
                                     "reference results recorded on a GPU instead.")


def recover(stream=None, graph=None, pool=None) -> None:
    """Leave CUDA usable after a failed capture written with ``cg.graph``, on either path: in its
    ``except``, ``recover(stream=before, graph=g, pool=pool)`` makes ``stream`` current again, keeps
    ``graph`` alive, ends the device allocator's recording into ``pool`` (on a GPU; never capture
    into it again), drains the queue, takes the generators out of capture mode and runs a fresh op.
    """
    from course.core.runtime import graphs

    cg = graphs()
    if stream is not None:
        cg.set_stream(stream)
    if cg.is_current_stream_capturing():
        raise RuntimeError("a CUDA graph capture is still in progress on the current stream; end "
                           "it (leave the `with torch.cuda.graph(...)` block) before recovering.")
    if not runtime().on_gpu:
        return
    import torch

    if graph is not None:
        _FAILED.append(graph)
        # a capture that ended owns its pool: releasing it would
        if pool is not None and not _ended(graph):
            release_pool(pool)                      # free memory the pool's other graphs still use
    try:
        torch.cuda.synchronize()
    except RuntimeError:
        pass
    torch.cuda.synchronize()
    reset_rng_capture_state()
    probe = torch.ones(4, device="cuda") * 2
    assert float(probe.sum()) == 8.0, "CUDA did not recover after the failed capture"
    torch.randn(1, device="cuda")  # the RNG works again (see reset_rng_capture_state)


def _ended(graph) -> bool:
    """True when ``graph``'s capture ended (it then holds its pool, and releases it itself)."""
    try:
        graph.pool()
    except RuntimeError:  # "without a preceding successful capture"
        return False
    return True


def reset_rng_capture_state() -> None:
    """Take torch's CUDA generators out of capture mode after a failed capture (torch 2.11 leaves
    them flagged, and every later random op raises): each is swapped for a clone of its state, seed
    and offset kept."""
    import torch

    for gen in torch.cuda.default_generators:
        gen.graphsafe_set_state(gen.clone_state())


def warm_up(fn, iters: int = 3):
    """Run ``fn`` ``iters`` times on a side stream (lazy init, allocator, cuBLAS handles), then
    join."""
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


# pool handle a failed capture used -> the pool that captures naming it use instead
_REPLACED: dict = {}
_FAILED: list = []  # invalidated captures: kept alive, since torch's allocators still hold callbacks into them


def pool_in_use(pool):
    """The pool a capture naming ``pool`` records into: ``pool`` itself, or its replacement after a
    failure."""
    while pool in _REPLACED:
        pool = _REPLACED[pool]
    return pool


def release_pool(pool) -> None:
    """End the device allocator's recording into ``pool`` and drop the failed capture's hold on it.

    ``CUDAGraph.capture_end`` does both when a capture succeeds; when CUDA refuses to end an
    invalidated capture it raises first. (The pinned-host allocator's recording cannot be ended from
    Python: that is why :func:`graph` never captures into the pool again.)
    """
    import torch

    dev = torch.cuda.current_device()
    for step in (torch._C._cuda_endAllocateToPool, torch._C._cuda_releasePool):
        try:
            step(dev, pool)
        except RuntimeError:  # nothing to end or release (the capture never began recording)
            pass


@contextlib.contextmanager
def collector_paused():
    """Keep the garbage collector off until the block ends (its state comes back however it ends),
    so a graph in a dead cycle is never freed during a capture. An explicit ``gc.collect()`` still
    runs."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


@contextlib.contextmanager
def graph(cuda_graph, pool=None, stream=None, capture_error_mode: str = "global"):
    """``torch.cuda.graph`` that leaves CUDA clean when the capture fails (the module docstring says
    how), with the garbage collector paused during the capture. A retired ``pool`` named later
    records into a fresh pool (:func:`pool_in_use`)."""
    import torch

    named = pool
    pool = torch.cuda.graph_pool_handle() if pool is None else pool_in_use(pool)
    stream = stream if stream is not None else _capture_stream()
    torch.cuda.synchronize()
    body_error = end_error = None
    # the previous stream is current again however it ends
    with collector_paused(), torch.cuda.stream(stream):
        torch.cuda.empty_cache()  # what torch.cuda.graph does as it starts
        try:
            cuda_graph.capture_begin(pool, capture_error_mode=capture_error_mode)
        except BaseException:
            _FAILED.append(cuda_graph)
            _retire(named, pool)
            _after_failure()
            raise
        try:
            yield cuda_graph
        except BaseException as e:  # noqa: BLE001 - re-raised below, once the capture is ended
            body_error = e
        try:
            with warnings.catch_warnings():
                # a capture cut short is often empty: that warning is noise here
                if body_error is not None:
                    warnings.simplefilter("ignore")
                cuda_graph.capture_end()
        except BaseException as e:  # noqa: BLE001 - CUDA refused to end the (invalidated) capture
            end_error = e
            _FAILED.append(cuda_graph)  # the allocators' callbacks point at it: it must outlive them
            release_pool(pool)
    if body_error is None and end_error is None:
        return
    _retire(named, pool)
    _after_failure()
    # raised outside any handler: no stale context
    raise body_error if body_error is not None else end_error


def _retire(named, pool) -> None:
    """Captures naming ``named`` (or ``pool``) record into a fresh pool from now on."""
    import torch

    if named is None:
        return
    fresh = torch.cuda.graph_pool_handle()
    _REPLACED[named] = _REPLACED[pool] = fresh


def _after_failure() -> None:
    """Drain the queue (errors of the failed capture are dropped) and take the generators out of
    capture mode."""
    import torch

    try:
        torch.cuda.synchronize()
    except RuntimeError:
        pass
    reset_rng_capture_state()


def _capture_stream():
    """The side stream captures run on (torch.cuda.graph's own default capture stream)."""
    import torch

    if torch.cuda.graph.default_capture_stream is None:
        torch.cuda.graph.default_capture_stream = torch.cuda.Stream()
    return torch.cuda.graph.default_capture_stream


def try_capture(fn, *, warmup: int = 3, pool=None, mode: str = "global") -> CaptureOutcome:
    """Warm ``fn`` up, capture one call into a CUDA graph (``mode``: "global", "thread_local" or
    "relaxed") and report: a failed capture never raises (the outcome keeps its root cause and
    frames) and the next capture works; an error in the warm-up is raised as is."""
    require_gpu("capturing a CUDA graph")
    import torch

    warm_up(fn, warmup)
    cuda_graph = torch.cuda.CUDAGraph()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with graph(cuda_graph, pool=pool, capture_error_mode=mode):
                out = fn()
    except Exception as e:  # noqa: BLE001 - we report every capture failure
        cause = _root_cause(e)
        frames = exception_frames(cause)
        msg = str(cause).strip().splitlines()[0] if str(cause).strip() else repr(cause)
        etype = type(cause).__name__
        del e, cause  # drop references to tensors from the failed capture before recovering
        recover()
        # warnings from the aborted capture are dropped
        return CaptureOutcome(False, etype, msg, frames=frames)
    for w in caught:  # a successful capture keeps its warnings (e.g. "the CUDA Graph is empty": wrong stream?)
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return CaptureOutcome(True, graph=cuda_graph, output=out)


def capture_once(fn, *static):
    """Warm ``fn`` up once on a side stream, then capture ``fn(*static)``: ``(graph, output)``, on
    ``course.graphs()``, the collector paused; a failed capture raises after :func:`recover`."""
    from course.core.runtime import graphs

    cg = graphs()
    side = cg.Stream()
    side.wait_stream(cg.current_stream())
    with cg.stream(side):
        fn(*static)
    cg.current_stream().wait_stream(side)
    g, before = cg.CUDAGraph(), cg.current_stream()
    try:
        with collector_paused(), cg.graph(g):
            out = fn(*static)
    except Exception:
        recover(stream=before, graph=g)
        raise
    return g, out
