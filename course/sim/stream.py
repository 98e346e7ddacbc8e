"""Streams, events and capture state for the simulator's graphs, under torch.cuda's names.

A capturing stream refuses, with the GPU's text: a host read or wait (``operation not permitted when
stream is capturing``, which also invalidates the capture), a host-device copy (``Cannot copy
between CPU and CUDA tensors during CUDA graph capture``), Numba allocations and a new seed. The
legacy default stream cannot capture; a stream that waits on a capturing one joins the capture and
must be joined back (``capturing stream has unjoined work``). Work outside captures runs at once.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import sys
import time
import warnings

SYNC = "CUDA error: operation not permitted when stream is capturing"
INVALIDATED = "CUDA error: operation failed due to a previous error during capture"
UNJOINED = "CUDA error: capturing stream has unjoined work"
COPY = ("Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU tensor "
        "is pinned. Please use tensor.pin_memory() or allocate the tensor with pin_memory=True.")
# torch 2.11 on the H100, for torch.manual_seed inside a capture:
SEED = ("CUDAGeneratorImpl::set_current_seed can be called during stream "
        "capture only if new seed is the same as the original seed.")
NUMBA_ALLOC = ("[<CUresult.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: 900>] Call to {} results in "
               "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED")
MODES = ("global", "thread_local", "relaxed")
SYNC_DEBUG = "called a synchronizing CUDA operation"
FREED = ("a CUDAGraph was freed during the capture: its destructor "
         "calls CUDA, which a capturing stream does not permit")


class Capture:
    """One capture under way: its stream, mode, the streams forked into it and whether CUDA gave up
    on it."""

    def __init__(self, origin, mode: str, program, pool):
        self.origin, self.mode, self.program, self.pool = origin, mode, program, pool
        self.invalid = None  # why CUDA invalidated it (a refused call), or None
        # stream -> how much it has queued in this capture (a fork counts as 1)
        self.work = {origin: 0}
        # stream -> {other stream: how much of its work this stream waited for}
        self.seen = {origin: {}}
        # generators registered with the graph (register_generator_state)
        self.generators: list = []

    def note_work(self, stream) -> None:
        """``stream`` queued one more operation in this capture."""
        self.work[stream] = self.work.get(stream, 0) + 1

    def unjoined(self) -> list:
        """Forked streams whose last work the capturing stream never waited for."""
        seen = self.seen.get(self.origin, {})
        return [s for s, n in self.work.items() if s is not self.origin and n > seen.get(s, 0)]


_ACTIVE: list = []  # captures under way
OUTSIDE = [0]  # work run at once on a stream that was not capturing while a capture was under way (an empty graph's why)


class Stream:
    """A stand-in for ``torch.cuda.Stream``: a queue of work, which may be capturing or forked into
    a capture."""

    _handles = itertools.count(1)

    def __init__(self, device=None, priority: int = 0, **kwargs):
        self.device, self.priority = device, priority
        self.cuda_stream = next(Stream._handles)  # 0 is the legacy default stream
        self.capture = None

    def wait_event(self, event) -> None:
        """Make this stream's later work wait for ``event`` (inside a capture: a fork or a join)."""
        event.wait(self)

    def wait_stream(self, stream) -> None:
        """Make this stream's later work wait for everything queued on ``stream`` so far."""
        self.wait_event(stream.record_event())

    def record_event(self, event=None):
        """Record ``event`` (a new Event when None) on this stream and return it."""
        event = event if event is not None else Event()
        event.record(self)
        return event

    def query(self) -> bool:
        """True: the simulator has finished everything it was given (refused on a capturing stream).
        """
        if self.capture is not None:
            refuse_sync("Stream.query() on a capturing stream", self.capture)
        return True

    def synchronize(self) -> None:
        """Wait for this stream (refused while it captures; reported by the sync debug mode, as
        torch does)."""
        on_sync("Stream.synchronize() waits for the stream")
        if self.capture is not None:
            refuse_sync("Stream.synchronize() waits for a capturing stream", self.capture)

    def __repr__(self) -> str:
        return f"<simulated Stream cuda_stream={self.cuda_stream:#x}{' capturing' if self.capture else ''}>"


_DEFAULT = Stream()
_DEFAULT.cuda_stream = 0
_current = [_DEFAULT]


class Event:
    """A stand-in for ``torch.cuda.Event``: marks a point in a stream's work (and the host time, for
    timing)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False, **kwargs):
        self.enable_timing = enable_timing
        self._stream = self._capture = None
        self._mark, self._seen, self._time = 0, {}, None

    def record(self, stream=None) -> None:
        """Mark the work queued on ``stream`` (the current stream when None) so far."""
        stream = stream if stream is not None else current_stream()
        cap = stream.capture
        self._stream, self._capture = stream, cap
        self._mark = cap.work.get(stream, 0) if cap else 0
        self._seen = dict(cap.seen.get(stream, {})) if cap else {}
        self._time = None if cap else time.perf_counter()

    def wait(self, stream=None) -> None:
        """Make ``stream``'s later work wait for this event."""
        stream = stream if stream is not None else current_stream()
        cap = self._capture
        if cap is None or cap not in _ACTIVE or stream is self._stream:
            return
        if stream.capture is None:  # a fork: the stream joins the capture
            stream.capture = cap
            cap.work[stream] = cap.work.get(stream, 0) + 1
            cap.seen.setdefault(stream, {})
        if stream.capture is cap:  # a join: the stream now depends on the event's work and what it depended on
            seen = cap.seen.setdefault(stream, {})
            for s, n in list(self._seen.items()) + [(self._stream, self._mark)]:
                seen[s] = max(seen.get(s, 0), n)

    def query(self) -> bool:
        """True once the work before the event has run (refused for an event recorded in a capture).
        """
        if self._capture is not None:
            raise _accelerator_error("CUDA error: operation not permitted on an "
                                     "event last recorded in a capturing stream")
        return True

    def synchronize(self) -> None:
        """Wait for the event (refused for an event recorded in a capture)."""
        self.query()

    def elapsed_time(self, end) -> float:
        """Host milliseconds between this event and ``end`` (both recorded outside a capture)."""
        if self._time is None or end._time is None:
            raise RuntimeError("Both events must be recorded (outside a "
                               "capture) before calling elapsed_time().")
        return (end._time - self._time) * 1e3


# --------------------------------------------------------------------------- torch.cuda's stream
# functions

def current_stream(device=None):
    """The stream work goes to now (``torch.cuda.current_stream``)."""
    return _current[-1]


def default_stream(device=None):
    """The legacy default stream (``torch.cuda.default_stream``); it cannot capture."""
    return _DEFAULT


def set_stream(stream) -> None:
    """Make ``stream`` current (``torch.cuda.set_stream``)."""
    if stream is not None:
        _current[-1] = stream


class StreamContext:
    """``with StreamContext(s):`` runs the block with ``s`` current (``None`` changes nothing)."""

    def __init__(self, s):
        self.stream, self.before = s, None

    def __enter__(self):
        self.before = _current[-1]
        set_stream(self.stream)
        return self.stream

    def __exit__(self, *exc) -> None:
        _current[-1] = self.before


def stream(s) -> StreamContext:
    """``with stream(s):`` runs the block with ``s`` current (``torch.cuda.stream``; ``None``
    changes nothing)."""
    return StreamContext(s)


def is_current_stream_capturing() -> bool:
    """True while the current stream records into a capture
    (``torch.cuda.is_current_stream_capturing``)."""
    return capturing() is not None


def capturing():
    """The capture the current stream records into, or None."""
    cap = _current[-1].capture
    return cap if cap is not None and cap in _ACTIVE else None


def synchronize(device=None) -> None:
    """Wait for all work (``torch.cuda.synchronize``): refused while any capture is under way."""
    if _ACTIVE:
        refuse_sync("synchronize() waits for the whole device", *_ACTIVE)


# --------------------------------------------------------------------------- torch's sync debug
# mode

# [mode: 0 default, 1 warn, 2 error; depth of calls inside a sync already reported]
_sync_debug = [0, 0]
_HERE = os.path.dirname(os.path.abspath(__file__))


def sync_debug_mode() -> int:
    """The sync debug mode in force: 0 ("default"), 1 ("warn") or 2 ("error")."""
    return _sync_debug[0]


def set_sync_debug_level(mode: int) -> None:
    """Put sync debug mode ``mode`` (0, 1 or 2) in force
    (:func:`course.sim.patch.set_sync_debug_mode`)."""
    _sync_debug[0] = mode


def _user_stacklevel() -> int:
    import torch

    skip = (_HERE + os.sep, os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)
    level, frame = 1, sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(skip):
        frame, level = frame.f_back, level + 1
    return level


def on_sync(what: str) -> None:
    """A synchronizing call: under the sync debug mode, torch's warning ("warn") or RuntimeError
    ("error").

    Once per call: what the call does inside (``repr`` reads values with ``.item()``) is not
    reported again.
    """
    mode = _sync_debug[0]
    if not mode or _sync_debug[1]:
        return
    if mode == 2:
        raise RuntimeError(f"{SYNC_DEBUG} ({what})")
    warnings.warn(f"{SYNC_DEBUG} ({what})", UserWarning, stacklevel=_user_stacklevel())


@contextlib.contextmanager
def sync_reported():
    """The block is one synchronizing call already reported by :func:`on_sync`."""
    _sync_debug[1] += 1
    try:
        yield
    finally:
        _sync_debug[1] -= 1


# --------------------------------------------------------------------------- refusals

def _accelerator_error(msg: str):
    import torch

    return getattr(torch, "AcceleratorError", RuntimeError)(msg)


def refuse_sync(what: str, *captures) -> None:
    """Raise the error a GPU gives for a host wait during capture, and invalidate the capture(s)."""
    for cap in captures or [c for c in (capturing(),) if c is not None]:
        cap.invalid = cap.invalid or what
    raise _accelerator_error(f"{SYNC} ({what})")


def graph_freed() -> None:
    """A captured graph was destroyed: a capture under way in "global" or "thread_local" mode is
    invalidated."""
    cap = strict_capture()
    if cap is not None:
        cap.invalid = cap.invalid or FREED


def refuse_copy(what: str) -> None:
    """Raise torch's error for a copy between host and device during capture (the capture stays
    valid)."""
    raise RuntimeError(f"{COPY} ({what})")


def refuse_numba(call: str, what: str) -> None:
    """Raise Numba's CudaAPIError for a driver call CUDA refuses during capture, and invalidate the
    captures."""
    for cap in _ACTIVE:
        if cap.mode != "relaxed":
            cap.invalid = cap.invalid or what
    driver = sys.modules.get("numba.cuda.simulator.cudadrv.driver")
    raise getattr(driver, "CudaAPIError", RuntimeError)(f"{NUMBA_ALLOC.format(call)} ({what})")


def strict_capture():
    """The capture under way in "global" or "thread_local" mode (the ones that refuse allocations),
    or None."""
    return next((c for c in _ACTIVE if c.mode != "relaxed"), None)


# --------------------------------------------------------------------------- Numba streams

_NUMBA: dict = {}  # id(stand-in stream) -> (stand-in stream, numba.cuda module, its Numba stream)


def numba_stream_for(stream, nc):
    """The Numba simulator stream that stands for ``stream`` (made once per stream by the ``nc``
    module)."""
    entry = _NUMBA.get(id(stream))
    if entry is None or entry[0] is not stream or entry[1] is not nc:
        # plain numba: stream() only
        make = nc.default_stream if hasattr(nc, "default_stream") else nc.stream
        entry = _NUMBA[id(stream)] = (stream, nc, make())
    return entry[2]


def stream_of_numba(numba_stream):
    """The stand-in stream a Numba stream stands for (None: Numba's own default stream, never
    captured)."""
    for s, _, ns in _NUMBA.values():
        if ns is numba_stream:
            return s
    return None
