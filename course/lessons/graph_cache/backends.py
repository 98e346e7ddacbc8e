"""How a :class:`~course.lessons.graph_cache.cache.GraphCache` records and replays one key.

- :class:`CudaGraphBackend` (GPU path): warm up, capture into a ``torch.cuda.CUDAGraph`` (one
  shared memory pool per cache, or one pool per graph), replay; a failed capture is reported, with
  the line that broke it, and CUDA is left usable (:func:`course.core.capture.try_capture`).
- :class:`RecordingBackend` (simulator path): the same protocol, run eagerly. "Capture" runs the
  function once under a watch for the operations that would break a real capture (a host read
  such as ``.item()``, ``nonzero``...), so fallbacks show up on a laptop too; "replay" calls the
  function on the static inputs and writes the results into the static outputs, so inputs that
  were not copied in, or outputs overwritten by the next replay, behave exactly as on a GPU. Its
  ``memory_reserved()`` counts the bytes of the static inputs and outputs of the recordings still
  alive (a real graph's memory stays reserved while anything references the graph), so a cache that
  "clears" but keeps its recordings referenced elsewhere frees nothing here either.

Both return a :class:`Recorded` (the replay callable and the static output) or raise
:class:`CaptureFailed` with a one-line reason.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import time
import weakref

from course.core.text import complete_statement

_HERE = os.path.dirname(os.path.abspath(__file__))
_TOOL_FILES = tuple(os.path.join(_HERE, f) for f in ("backends.py", "cache.py"))

# aten ops that make the host wait for the GPU (or read device memory on the host): they break capture
HOST_READS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2")


def _refuse(what: str):
    raise RuntimeError(f"{what} during CUDA graph capture: on a GPU the host would wait for the device "
                       "(the recording backend's capture check)")


@contextlib.contextmanager
def host_read_watch():
    """Make the calls that break a real capture raise, on any device (the recording backend's 'capture').

    Tensor methods that read device memory on the host (``item``, ``tolist``, ``cpu``, ``to("cpu")``)
    and aten ops that synchronize (:data:`HOST_READS`) raise ``RuntimeError`` inside the block.
    """
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            if name in HOST_READS:
                _refuse(f"aten.{name} reads device memory on the host")
            return func(*args, **(kwargs or {}))

    def to(self, *args, **kwargs):
        dev = kwargs.get("device", args[0] if args else None)
        if isinstance(dev, (str, torch.device)) and torch.device(dev).type == "cpu":
            _refuse("a copy to the CPU (.to('cpu'))")
        return saved["to"](self, *args, **kwargs)

    saved = {k: getattr(torch.Tensor, k) for k in ("item", "tolist", "cpu", "to")}
    torch.Tensor.item = lambda self: _refuse(".item() reads a value on the host")
    torch.Tensor.tolist = lambda self: _refuse(".tolist() reads values on the host")
    torch.Tensor.cpu = lambda self, *a, **k: _refuse("a copy to the CPU (.cpu())")
    torch.Tensor.to = to
    try:
        with Watch():
            yield
    finally:
        for k, v in saved.items():
            setattr(torch.Tensor, k, v)


class CaptureFailed(RuntimeError):
    """A key could not be captured; ``reason`` is the finder-style one-line diagnosis."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclasses.dataclass
class Recorded:
    """One recorded key: ``replay()`` recomputes ``output`` from the static inputs in place."""

    replay: object
    output: object
    capture_ms: float
    memory_bytes: int  # memory the capture reserved (GPU); 0 on the recording backend
    graph: object = None  # the torch.cuda.CUDAGraph on the GPU path


def diagnose(error_type: str, message: str, frames) -> str:
    """'RuntimeError: <message> (at decoder.py:42: x.item())': the error and the user line that raised it."""
    from course.lessons.what_breaks.dynamic import is_library_file

    user = None
    for fr in reversed(list(frames)):
        path = os.path.abspath(fr[0]) if fr[0] else ""
        if path and path not in _TOOL_FILES and not is_library_file(fr[0]):
            user = fr
            break
    code = f": {user[3]}" if user and user[3] and complete_statement(user[3]) else ""  # not half a statement
    where = f" (at {os.path.basename(user[0])}:{user[1]}{code})" if user else ""
    return f"{error_type}: {message}{where}"


def tensor_bytes(obj) -> int:
    """Bytes of the tensors in ``obj`` (a tensor, or nested tuples/lists/dicts of them); other values count 0."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(tensor_bytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(tensor_bytes(o) for o in obj.values())
    return 0


def _copy_into(static, fresh) -> None:
    """Write ``fresh`` (a tensor or nested tuple/list of them) into ``static`` of the same structure."""
    import torch

    if isinstance(static, torch.Tensor):
        static.copy_(fresh)
    elif isinstance(static, (tuple, list)):
        for s, f in zip(static, fresh):
            _copy_into(s, f)
    elif isinstance(static, dict):
        for k, s in static.items():
            _copy_into(s, fresh[k])


class RecordingBackend:
    """Records and replays by calling the function eagerly (the simulator path; see the module docstring)."""

    name = "recording"

    def __init__(self, pools: str = "shared"):
        self.pools = pools
        self.watch = True  # look for host reads at capture (they would break a real capture)
        self._held: dict = {}  # recording id -> bytes it holds, while the Recorded object is alive
        self._ids = itertools.count()

    def capture(self, fn, static_args, warmup: int = 1) -> Recorded:
        """Warm up ``warmup`` times, then run ``fn(*static_args)`` once as the 'capture'; raise CaptureFailed."""
        import traceback

        t0 = time.perf_counter()
        for _ in range(warmup):
            fn(*static_args)
        try:
            if self.watch:
                with host_read_watch():
                    out = fn(*static_args)
            else:
                out = fn(*static_args)
        except Exception as e:  # noqa: BLE001 - every capture failure becomes a fallback
            frames = tuple((f.filename, f.lineno, f.name, (f.line or "").strip())
                           for f in traceback.extract_tb(e.__traceback__))
            msg = (str(e).strip().splitlines() or [repr(e)])[0]
            raise CaptureFailed(diagnose(type(e).__name__, msg, frames)) from None
        ms = (time.perf_counter() - t0) * 1e3

        def replay():
            _copy_into(out, fn(*static_args))

        rec = Recorded(replay, out, ms, 0)
        key = next(self._ids)
        self._held[key] = tensor_bytes(out) + tensor_bytes(list(static_args))
        weakref.finalize(rec, self._held.pop, key, None)  # freed with the recording (its "graph")
        return rec

    def new_pool(self):
        """No memory pools on the simulator path."""
        return None

    def memory_reserved(self) -> int:
        """Bytes of the static inputs and outputs of this backend's recordings that are still alive.

        Like a graph's memory pool, they come back only when nothing references the recording any more
        (call ``gc.collect()`` first if a reference cycle may hold one).
        """
        return sum(self._held.values())

    def reset_pool(self) -> None:
        """Nothing to forget on the simulator path."""


class CudaGraphBackend:
    """Records with ``torch.cuda.graph`` and replays with ``CUDAGraph.replay()`` (GPU path)."""

    name = "cuda-graph"

    def __init__(self, pools: str = "shared"):
        if pools not in ("shared", "separate"):
            raise ValueError(f"pools must be 'shared' or 'separate', got {pools!r}")
        self.pools = pools
        self._pool = None

    def new_pool(self):
        """The memory pool for the next capture: the cache's one shared pool, or None (a private pool)."""
        import torch

        if self.pools == "separate":
            return None
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    def memory_reserved(self) -> int:
        """Bytes the CUDA caching allocator holds (graph pools included)."""
        import torch

        return torch.cuda.memory_reserved()

    def capture(self, fn, static_args, warmup: int = 1) -> Recorded:
        """Warm up on a side stream, capture ``fn(*static_args)``; raise CaptureFailed with the line that broke it.

        ``memory_bytes`` of the result is what the capture itself reserved (measured after the warm-up);
        ``capture_ms`` includes the warm-up (the time to the first replay).
        """
        import torch

        from course.core.capture import try_capture, warm_up

        call = lambda: fn(*static_args)  # noqa: E731
        t0 = time.perf_counter()
        if warmup > 0:
            warm_up(call, warmup)  # first: the eager allocations of a warm-up are not the graph's memory
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        # torch.cuda.graph() empties the allocator's cache as it starts; do it first (untimed), or the freed
        # warm-up blocks would be subtracted from the graph's own memory ("memory held" could come out negative)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved()
        t2 = time.perf_counter()
        outcome = try_capture(call, warmup=0, pool=self.new_pool())
        torch.cuda.synchronize()
        ms = (t1 - t0 + time.perf_counter() - t2) * 1e3
        if not outcome.ok:
            raise CaptureFailed(diagnose(outcome.error_type, outcome.error, outcome.frames))
        graph = outcome.graph
        return Recorded(graph.replay, outcome.output, ms, torch.cuda.memory_reserved() - before, graph)

    def reset_pool(self) -> None:
        """Forget the shared pool (after every graph using it is freed)."""
        self._pool = None


def default_backend(pools: str = "shared"):
    """:class:`CudaGraphBackend` on the GPU path, :class:`RecordingBackend` on the simulator path."""
    from course.core.runtime import runtime

    return CudaGraphBackend(pools) if runtime().on_gpu else RecordingBackend(pools)
