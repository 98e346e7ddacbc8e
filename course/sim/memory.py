"""The device's memory as the simulator models it: a limit on what captures allocate, and
``record_stream``.

:func:`check` refuses a capture's pool allocation past :data:`LIMIT` bytes (an H100's 80 GiB; lower
it for a smaller card) with torch's ``OutOfMemoryError``; memory allocated outside captures is the
laptop's. :func:`install` makes ``Tensor.record_stream`` accept the simulator's streams.
"""
from __future__ import annotations

LIMIT = 80 << 30  # bytes the simulated device holds (an H100's 80 GiB)
_installed = [False]


def format_size(nbytes: int) -> str:
    """A byte count the way CUDA's caching allocator writes it in its messages (``20.00 MiB``,
    ``4096.00 GiB``)."""
    for unit, size in (("bytes", 1 << 10), ("KiB", 1 << 20), ("MiB", 1 << 30)):
        if nbytes <= size:
            return f"{nbytes} bytes" if unit == "bytes" else f"{nbytes / (size >> 10):.2f} {unit}"
    return f"{nbytes / (1 << 30):.2f} GiB"


def check(nbytes: int, in_use: int) -> None:
    """Raise torch's out-of-memory error when ``nbytes`` more would take the pools (``in_use``
    bytes) past LIMIT."""
    if nbytes + in_use <= LIMIT:
        return
    import torch

    error = getattr(torch, "OutOfMemoryError", RuntimeError)
    raise error(f"CUDA out of memory. Tried to allocate {format_size(nbytes)}. GPU "
                f"0 has a total capacity of {format_size(LIMIT)} of which "
                f"{format_size(max(LIMIT - in_use, 0))} is free (the simulator's "
                f"device: course.sim.memory.LIMIT; graph pools hold {format_size(in_use)}).")


def install() -> None:
    """Let ``Tensor.record_stream`` take the simulator's streams (once per process; see the module
    doc)."""
    if _installed[0]:
        return
    import torch

    import course.sim.stream as ss

    original = torch.Tensor.record_stream

    def record_stream(self, stream):
        if isinstance(stream, ss.Stream):
            return None  # the simulator runs the stream's work at once: its memory may be reused afterwards
        return original(self, stream)

    record_stream.__doc__ = original.__doc__
    torch.Tensor.record_stream = record_stream
    _installed[0] = True
