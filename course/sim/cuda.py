"""torch.cuda's graph and stream API on the simulator path: what ``course.graphs()`` returns there.

``cg = course.graphs()`` is ``torch.cuda`` on a GPU and this module on the simulator, so the same
code captures and replays on both: ``CUDAGraph``, ``graph``, ``graph_pool_handle``,
``make_graphed_callables``, ``Stream``, ``Event``, ``stream``, ``current_stream``,
``default_stream``, ``set_stream``, ``synchronize``, ``is_current_stream_capturing``, and
``set_sync_debug_mode`` / ``get_sync_debug_mode`` (torch's sync debug mode). What the stand-in
models, and what not: :mod:`course.sim.graph`. Importing it also lets ``capturable=True`` optimizers
run on the CPU and be captured (:mod:`course.sim.optim`), and ``Tensor.record_stream`` take the
simulated streams (:mod:`course.sim.memory`).
"""
from course.sim import memory as simmemory, optim as simoptim
from course.sim.callables import make_graphed_callables
from course.sim.graph import CUDAGraph, graph, graph_pool_handle
from course.sim.patch import get_sync_debug_mode, set_sync_debug_mode
from course.sim.stream import (Event, Stream, StreamContext, current_stream, default_stream,
                                   is_current_stream_capturing, set_stream, stream, synchronize)

simoptim.install()
simmemory.install()

SIMULATED = True  # torch.cuda has no such attribute: ``getattr(cg, "SIMULATED", False)`` tells the two apart


def is_available() -> bool:
    """False: the simulator path has no CUDA device (graphs are simulated on the CPU)."""
    return False


__all__ = ["CUDAGraph", "Event", "SIMULATED", "Stream", "StreamContext", "current_stream", "default_stream",
           "get_sync_debug_mode", "graph", "graph_pool_handle", "is_available", "is_current_stream_capturing",
           "make_graphed_callables", "set_sync_debug_mode", "set_stream", "stream", "synchronize"]
