"""How a :class:`~course.lessons.graph_cache.cache.GraphCache` records and replays one key.

- :class:`CudaGraphBackend` (GPU path): warm up, capture into a ``torch.cuda.CUDAGraph`` (one shared
  memory pool per cache, or one per graph), replay; a failed capture is reported, with the line that
  broke it, and CUDA is left usable (:func:`course.core.capture.try_capture`).
- :class:`RecordingBackend` (simulator path): the same on the simulator's graphs, which record
  without running and refuse what a GPU refuses, so fallbacks, frozen host values and overwritten
  outputs show on a laptop too; its ``memory_reserved()`` counts the static inputs and outputs of
  the recordings still alive.

Both return a :class:`Recorded` or raise :class:`CaptureFailed` with a one-line reason. A cache that
captures with the graph API itself (lab 3's) uses a backend for the rest: ``pool()``,
``capture_failed(error, graph, stream)``, ``reset_pool()`` and ``memory_reserved()``.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import time
import warnings
import weakref

import torch

from course.core import hardware
from course.core.capture import collector_paused, exception_frames, recover, try_capture, warm_up
from course.core.harness import root_cause
from course.core.runtime import runtime
from course.core.text import complete_statement
from course.lessons.what_breaks.dynamic import is_library_file
from course.sim.patch import host_reads_refused

_HERE = os.path.dirname(os.path.abspath(__file__))
_TOOL_FILES = tuple(os.path.join(_HERE, f) for f in ("backends.py", "cache.py"))


def host_read_watch():
    """Make the calls that break a real capture raise, with the GPU's errors, outside any capture.

    Tensor methods that read device memory on the host (``item``, ``tolist``, ``cpu``,
    ``to("cpu")``, printing) and aten ops that synchronize (``nonzero``, ``masked_select``,
    ``unique``...) raise ``RuntimeError`` inside the block
    (:func:`course.sim.patch.host_reads_refused`).
    """
    return host_reads_refused()


class CaptureFailed(RuntimeError):
    """A key could not be captured; ``reason`` is the finder-style one-line diagnosis."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclasses.dataclass
class Recorded:
    """One recorded key: ``replay()`` recomputes ``output`` from the static inputs in place (until
    then it holds nothing computed: NaN on the recording backend, whatever the pool memory held on a
    GPU)."""

    replay: object
    output: object
    capture_ms: float
    memory_bytes: int  # memory the capture reserved (GPU); 0 on the recording backend
    # the CUDAGraph: torch.cuda's on the GPU path, the simulator's on the recording backend
    graph: object = None


def diagnose(error_type: str, message: str, frames) -> str:
    """'RuntimeError: <message> (at decoder.py:42: x.item())': the error and the user line that
    raised it."""
    user = None
    for fr in reversed(list(frames)):
        path = os.path.abspath(fr[0]) if fr[0] else ""
        if path and path not in _TOOL_FILES and not is_library_file(fr[0]):
            user = fr
            break
    # not half a statement
    code = f": {user[3]}" if user and user[3] and complete_statement(user[3]) else ""
    where = f" (at {os.path.basename(user[0])}:{user[1]}{code})" if user else ""
    return f"{error_type}: {message}{where}"


def failure_reason(backend, error, graph=None, stream=None) -> str:
    """After a capture into ``backend``'s pool failed with ``error``: CUDA left clean, the pool
    retired, the reason.

    ``stream`` (the stream current before the capture) is made current again and, on a GPU,
    ``graph`` kept alive, the device allocator's recording into the pool ended, the queue drained
    and the random generators reset (:func:`course.core.capture.recover`). The shared pool is never
    captured into again (a failed capture can leave it claimed): the next ``pool()`` is a fresh one.
    Returns ``diagnose``'s one line: the first error of the chain and the user line that raised it.
    """
    pool, backend._pool = backend._pool, None
    recover(stream=stream, graph=graph, pool=pool)
    cause = root_cause(error)
    msg = (str(cause).strip().splitlines() or [repr(cause)])[0]
    return diagnose(type(cause).__name__, msg, exception_frames(cause))


def tensor_bytes(obj) -> int:
    """Bytes of the tensors in ``obj`` (a tensor, or nested tuples, lists, dicts of them)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(tensor_bytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(tensor_bytes(o) for o in obj.values())
    return 0


class _Backend:
    """What both backends share: the one pool a cache's captures go into, and a failed capture's
    reason (:func:`failure_reason`)."""

    name = ""

    def __init__(self, pools: str = "shared"):
        if pools not in ("shared", "separate"):
            raise ValueError(f"pools must be 'shared' or 'separate', got {pools!r}")
        self.pools = pools
        self._pool = None

    def new_pool(self):
        """The pool for the next capture: the cache's one shared pool, or None (a private pool)."""
        if self.pools == "separate":
            return None
        if self._pool is None:
            self._pool = self._pool_handle()
        return self._pool

    def pool(self):
        """The pool the next capture goes into (the shared one; None: a private pool per graph)."""
        return self.new_pool()

    def capture_failed(self, error, graph=None, stream=None) -> str:
        """A capture into :meth:`pool` failed: the reason, CUDA left clean, the pool retired."""
        return failure_reason(self, error, graph, stream)

    def reset_pool(self) -> None:
        """Forget the shared pool (after every graph using it is freed)."""
        self._pool = None


class RecordingBackend(_Backend):
    """Records and replays with the simulator's CUDA graphs (the simulator path; see the module
    doc).

    On CUDA tensors it records aten ops only: a real Numba kernel launched inside runs at capture
    and is not replayed (only the simulator's launches are recorded), so use
    :class:`CudaGraphBackend` on the GPU path.
    """

    name = "recording"

    def __init__(self, pools: str = "shared"):
        super().__init__(pools)
        self._held: dict = {}  # recording id -> bytes it holds, while the Recorded object is alive
        self._ids = itertools.count()

    def capture(self, fn, static_args, warmup: int = 1) -> Recorded:
        """Warm up ``warmup`` times eagerly, then capture ``fn(*static_args)`` into a simulated
        graph.

        Raises CaptureFailed with the root cause and the user line that caused it; the capture
        stream is left and a pool the failed capture claimed is not used again (as
        :func:`course.core.capture.graph` does).
        """
        from course.sim import cuda as cg  # the simulator's graphs: this backend's path only

        t0 = time.perf_counter()
        for _ in range(warmup):
            fn(*static_args)
        g, before = cg.CUDAGraph(), cg.current_stream()
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with collector_paused(), cg.graph(g, pool=self.new_pool()):
                    out = fn(*static_args)
        except Exception as e:  # noqa: BLE001 - every failure becomes a fallback (warnings: noise)
            cause = root_cause(e)
            msg = (str(cause).strip().splitlines() or [repr(cause)])[0]
            frames = exception_frames(cause)
            cg.set_stream(before)
            self._pool = None  # a failed capture leaves its pool claimed: later ones take a new one
            raise CaptureFailed(diagnose(type(cause).__name__, msg, frames)) from None
        # a capture that succeeded keeps its warnings ("the CUDA Graph is empty": wrong stream?)
        for w in caught:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        ms = (time.perf_counter() - t0) * 1e3
        rec = Recorded(g.replay, out, ms, 0, g)
        key = next(self._ids)
        self._held[key] = tensor_bytes(out) + tensor_bytes(list(static_args))
        weakref.finalize(rec, self._held.pop, key, None)  # freed with the recording (its "graph")
        return rec

    def _pool_handle(self):
        from course.sim import cuda as cg  # the simulator's graphs: this backend's path only

        return cg.graph_pool_handle()

    def memory_reserved(self) -> int:
        """Bytes of the static inputs and outputs of this backend's recordings that are still alive.

        Like a graph's memory pool, they come back only when nothing references the recording any
        more (call ``gc.collect()`` first if a reference cycle may hold one).
        """
        return sum(self._held.values())

class CudaGraphBackend(_Backend):
    """Records with ``torch.cuda.graph`` and replays with ``CUDAGraph.replay()`` (GPU path)."""

    name = "cuda-graph"

    def new_pool(self):
        """The pool for the next capture, after dropping torch's cuBLAS workspaces
        (:func:`course.core.hardware.release_blas_workspaces`), as torch's CUDA-graph trees do
        before each recording: the capture then allocates its workspace in its own pool, freed with
        it, and the warm-up streams' workspaces are given back."""
        hardware.release_blas_workspaces()  # torch._C._cuda_clearCublasWorkspaces(), GPU path only
        return super().new_pool()

    def _pool_handle(self):
        return torch.cuda.graph_pool_handle()

    def memory_reserved(self) -> int:
        """Bytes the CUDA caching allocator holds (graph pools included)."""
        return torch.cuda.memory_reserved()

    def capture(self, fn, static_args, warmup: int = 1) -> Recorded:
        """Warm up on a side stream, capture ``fn(*static_args)``; raise CaptureFailed with the line
        that broke it.

        ``memory_bytes`` of the result is what the capture itself reserved (measured after the
        warm-up); ``capture_ms`` includes the warm-up (the time to the first replay).
        """
        call = lambda: fn(*static_args)  # noqa: E731
        t0 = time.perf_counter()
        if warmup > 0:
            warm_up(call, warmup)  # first: a warm-up's eager allocations are not the graph's memory
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        pool = self.new_pool()  # first: it gives back the warm-up stream's cuBLAS workspace
        # torch.cuda.graph() empties the allocator's cache as it starts; do it first (untimed), or
        # the freed warm-up blocks would be subtracted from the graph's own memory (which could
        # then come out negative)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved()
        t2 = time.perf_counter()
        outcome = try_capture(call, warmup=0, pool=pool)
        torch.cuda.synchronize()
        ms = (t1 - t0 + time.perf_counter() - t2) * 1e3
        if not outcome.ok:
            raise CaptureFailed(diagnose(outcome.error_type, outcome.error, outcome.frames))
        graph = outcome.graph
        return Recorded(graph.replay, outcome.output, ms, torch.cuda.memory_reserved() - before,
                        graph)

    def reset_pool(self) -> None:
        """Forget the shared pool and drop torch's cuBLAS workspaces: the one the last capture
        allocated in its pool would keep that pool reserved after its graphs are gone."""
        super().reset_pool()
        hardware.release_blas_workspaces()  # torch._C._cuda_clearCublasWorkspaces()


def default_backend(pools: str = "shared"):
    """:class:`CudaGraphBackend` on the GPU path, :class:`RecordingBackend` on the simulator's."""
    return CudaGraphBackend(pools) if runtime().on_gpu else RecordingBackend(pools)
