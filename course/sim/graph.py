"""``CUDAGraph``, ``graph`` and ``graph_pool_handle`` on the simulator path, as torch.cuda's.

``course.graphs()`` is ``torch.cuda`` on a GPU, :mod:`course.sim.cuda` here: one program for both::

    g = cg.CUDAGraph()
    with cg.graph(g):            # records; computes nothing (new tensors hold NaN until a replay)
        y = model(static_x)
    static_x.copy_(new_x)
    g.replay()                   # runs what was recorded, not Python: y now holds model(new_x)

Modelled as on a GPU: a capture records aten ops and Numba launches (:mod:`course.sim.record`) and
freezes Python; a replay reads the captured tensors and rewrites the same outputs; host reads and
copies, ``synchronize()``, a new seed and Numba allocations are refused with the GPU's error
(:mod:`course.sim.patch`), and an error invalidates the capture and claims its pool; streams fork
into a capture and must be joined; random ops draw anew at every replay; pools are shared; backward,
capturable and fused optimizers and ``GradScaler`` record (:mod:`course.sim.optim`); a generator
state set back replays the same draws (:mod:`course.sim.rng`); a capture past the device's memory
raises ``OutOfMemoryError`` (:mod:`course.sim.memory`); a graph freed during another capture breaks
it. Not modelled: timing; ordering between streams outside a capture (the checks name a missing fork
or join from the learner's calls, :mod:`course.core.stream_order`); lazy initialisation; host
tensors the simulator cannot tell from device ones; block splitting; threads; memory statistics;
cuDNN. PyTorch's own graph tests it mirrors, and those it leaves out:
``tests/test_torch_graph_behaviours.py``.
"""
from __future__ import annotations

import warnings
import weakref

import course.sim.dispatch as sd
import course.sim.patch as sp
import course.sim.record as sr
import course.sim.stream as ss

ALREADY = "This CUDAGraph instance already owns a captured graph. To capture a new graph, create a new instance."
DEFAULT = ("CUDA graphs must be captured on a non-default stream. (However, "
           "after capture, it's ok to replay them on the default stream.)")
EMPTY = ("The CUDA Graph is empty. This usually means that the graph was attempted to be captured on wrong device "
         "or stream.")  # torch's words: said when work ran during the capture on a stream that was not capturing
NOTHING = ("The CUDA Graph is empty: no GPU work ran between capture_begin "
           "and capture_end, so a replay does nothing (the captured block "
           "launched no kernel: did a branch or an early return skip the work?)")
# A capture ended by an error (``with cg.graph(g):`` left by an exception) gives no empty-graph
# warning here: the error says what happened. torch warns there too, and the course's helpers drop
# warnings of a failed capture.
_ENDED_BY_ERROR = [False]


def _destroyed(held) -> None:
    """A captured graph is gone (freed, or reset): its memory is released, and a strict capture
    under way breaks."""
    sr.release(held)
    ss.graph_freed()


def graph_pool_handle():
    """An opaque token naming a graph memory pool, for captures that may share memory."""
    return sr.new_handle(user=True)


class CUDAGraph:
    """A recorded capture on the simulator: ``capture_begin`` / ``capture_end``, then ``replay()``.
    """

    def __init__(self, keep_graph: bool = False):
        self._capture = self._steps = self._handle = self._pool = self._release = None
        self._generators: list = []

    def capture_begin(self, pool=None, capture_error_mode: str = "global", check_input_liveness: bool = False):
        """Start recording the current stream's work (see the module doc for what is recorded)."""
        if self._steps is not None or self._capture is not None:
            raise RuntimeError(ALREADY)
        if capture_error_mode not in ss.MODES:
            raise RuntimeError("Unknown capture error mode. Expected `global`, "
                               f"`thread_local`, or `relaxed`, got {capture_error_mode}")
        stream = ss.current_stream()
        if stream is ss.default_stream():
            raise RuntimeError(DEFAULT)
        if stream.capture is not None:
            ss.refuse_sync("capture_begin on a stream that is already capturing", stream.capture)
        handle = pool if pool is not None else sr.new_handle(user=False)
        mem = sr.pool_for(handle)
        if mem.recording:
            raise RuntimeError("beginAllocateToPool: already recording to "
                               f"mempool_id {handle} (a failed capture into this "
                               "pool never ended its recording; use a new pool)")
        mem.recording = True
        cap = ss.Capture(stream, capture_error_mode, sr.Program(mem), mem)
        cap.generators = self._generators
        stream.capture = cap
        ss._ACTIVE.append(cap)
        sp.install()
        sd.begin()
        self._capture, self._handle, self._pool = cap, handle, mem
        self._outside = ss.OUTSIDE[0]

    def capture_end(self) -> None:
        """End the capture; raise what CUDA raises if it was invalidated or left a forked stream
        unjoined."""
        cap = self._capture
        if cap is None:
            raise ss._accelerator_error("CUDA error: capture was not initiated in this stream")
        if ss.current_stream() is not cap.origin:
            raise RuntimeError("Capture must end on the same stream it began on.")
        self._capture = None
        ss._ACTIVE.remove(cap)
        for s in cap.work:
            if s.capture is cap:
                s.capture = None
        sp.uninstall()
        sd.end()
        if cap.invalid:
            raise ss._accelerator_error(ss.INVALIDATED)
        if cap.unjoined():
            raise ss._accelerator_error(ss.UNJOINED)
        cap.pool.recording = False
        self._steps, held = cap.program.finish()
        self._release = weakref.finalize(self, _destroyed, held)
        if not self._steps and not _ENDED_BY_ERROR[0]:
            warnings.warn(EMPTY if ss.OUTSIDE[0] > getattr(self, "_outside", 0) else NOTHING, UserWarning, stacklevel=2)

    def instantiate(self) -> None:
        """Nothing to do on the simulator (torch instantiates in capture_end)."""
        if self._steps is None:
            raise RuntimeError("capture_end() must have been called before calling instantiate")

    def replay(self) -> None:
        """Run the recorded work: no Python of the captured function runs."""
        if self._steps is None:
            raise RuntimeError("Called CUDAGraph::replay without a preceding successful capture.")
        sr.run(self._steps, sp.launch_kernel)

    def reset(self) -> None:
        """Delete the recorded work; the instance can capture again."""
        self._steps = None
        if self._release is not None:
            self._release()
            self._release = None

    def pool(self):
        """The id of this graph's memory pool, for another capture that may share it."""
        if self._steps is None:
            raise RuntimeError("Called CUDAGraph::pool() without a preceding successful capture.")
        return self._handle

    def register_generator_state(self, generator) -> None:
        """Let the capture draw from ``generator`` (torch registers only the default generator
        itself)."""
        if ss.capturing() is not None:
            raise RuntimeError("Cannot register the state during capturing stage. "
                               "during CUDA graph capture. If you need this call "
                               "to be captured, please file an issue. Current "
                               "cudaStreamCaptureStatus: cudaStreamCaptureStatusActive")
        self._generators.append(generator)

    def enable_debug_mode(self) -> None:
        """Accepted for compatibility; see :meth:`recorded_ops` for what the simulator recorded."""

    def recorded_ops(self) -> list:
        """Names of the recorded steps in replay order (simulator only: a GPU graph has kernels, not
        aten ops)."""
        if self._steps is None:
            return []
        return [s[1].__name__ if s[0] == "kernel" and hasattr(s[1], "__name__") else str(s[1]) for s in self._steps]


class graph:
    """``with graph(g):`` captures the block into ``g`` on a side stream (torch.cuda.graph's rules).
    """

    default_capture_stream = None

    def __init__(self, cuda_graph, pool=None, stream=None, capture_error_mode: str = "global", **kwargs):
        if stream is None and graph.default_capture_stream is None:
            graph.default_capture_stream = ss.Stream()
        self.pool = () if pool is None else (pool,)
        self.capture_stream = stream if stream is not None else graph.default_capture_stream
        self.stream_ctx = ss.stream(self.capture_stream)
        self.cuda_graph = cuda_graph
        self.capture_error_mode = capture_error_mode

    def __enter__(self) -> None:
        # what torch.cuda.graph does first: inside another capture, the error a GPU gives
        ss.synchronize()
        self.stream_ctx.__enter__()
        self.cuda_graph.capture_begin(*self.pool, capture_error_mode=self.capture_error_mode)

    def __exit__(self, *exc) -> None:
        _ENDED_BY_ERROR[0] = exc[0] is not None  # an error ended the capture: it, not "empty", says why
        try:
            # as torch: if this raises, the capture stream stays current
            self.cuda_graph.capture_end()
        finally:
            _ENDED_BY_ERROR[0] = False
        self.stream_ctx.__exit__(*exc)


def end_all_captures() -> None:
    """End every capture under way, keeping nothing (after a test, or a cell stopped between
    capture_begin and capture_end); the current stream becomes the default stream again."""
    for cap in list(ss._ACTIVE):
        ss._ACTIVE.remove(cap)
        cap.pool.recording = False
        for s in cap.work:
            if s.capture is cap:
                s.capture = None
        sp.uninstall()
        sd.end()
    ss.set_stream(ss.default_stream())
