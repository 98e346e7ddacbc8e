"""torch.compile's state, read and reset (lessons 02, 03, 04 and 06): :func:`torch_log_messages`
collects what torch logged, :func:`reset_compile` makes the next compile start cold,
:func:`compile_counters` reads cudagraph skips, graph breaks and graphs compiled.
"""
from __future__ import annotations

import contextlib
import inspect
import logging


class _Grab(logging.Handler):
    """A logging handler that keeps each message's text."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        try:
            self.messages.append(record.getMessage())
        except Exception:  # noqa: BLE001 - never let logging break an experiment
            pass


@contextlib.contextmanager
def torch_log_messages(**artifacts):
    """Collect every message of the torch logging artifacts turned on (unknown ones ignored),
    printing
    none; torch's handlers and artifacts are put back on exit::

        with torch_log_messages(cudagraphs=True, recompiles=True) as msgs:
            compiled(x)
    """
    import torch._logging

    known = set(inspect.signature(torch._logging.set_logs).parameters)
    torch._logging.set_logs(**{k: v for k, v in artifacts.items() if k in known})
    names = {"torch", "torch._inductor", "torch._dynamo", "torch._inductor.cudagraph_trees"}
    try:
        from torch._logging._internal import log_registry
        names |= set(log_registry.get_log_qnames())
    except Exception:  # noqa: BLE001 - private API; the fixed names above cover the common cases
        pass
    grab = _Grab()
    loggers = [logging.getLogger(n) for n in sorted(names)]
    saved = {lg.name: list(lg.handlers) for lg in loggers}
    for lg in loggers:
        lg.handlers = [grab]  # collect instead of printing (torch's own handlers write to stderr)
    try:
        yield grab.messages
    finally:
        for lg in loggers:
            lg.handlers = saved[lg.name]
        torch._logging.set_logs()


def reset_compile() -> None:
    """Forget every ``torch.compile`` result and torch's dynamo counters: the next compile starts
    cold.

    Runs anywhere (no GPU needed). Call it before each compiled variant of an experiment, so one
    variant's compiled code and counts never leak into the next one's.
    """
    import torch
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()


def compile_counters() -> dict:
    """``{"cudagraph_skips", "graph_breaks", "unique_graphs"}``: what torch counted since
    :func:`reset_compile`.

    ``cudagraph_skips``: times inductor declined to use CUDA graphs; ``graph_breaks``: where dynamo
    split the function; ``unique_graphs``: graphs dynamo compiled. Compare two readings to see what
    one call did.
    """
    from torch._dynamo.utils import counters

    return {"cudagraph_skips": counters["inductor"]["cudagraph_skips"],
            "graph_breaks": sum(counters["graph_break"].values()),
            "unique_graphs": counters["stats"]["unique_graphs"]}
