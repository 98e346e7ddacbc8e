"""Parity programs about torch's sync debug mode and a graph freed during a capture (see
:mod:`course.parity.programs`, which lists them with the verdicts a GPU gives).

The sync debug verdicts follow what torch 2.11 reported on an H100 for the course's hazard zoo
(``course/reference/hazards_finder.json``, column ``sync_debug_lines``): host reads, copies to the
host, a tensor built from host data and ``Stream.synchronize()`` warn; a device-wide
``synchronize()`` and device-only work do not.
"""
from __future__ import annotations

import gc
import warnings

import torch
import torch.nn.functional as F

from course.parity.tools import capture, capture_error, phrase, x8


def _calls(cg, dev):
    x, ids, table = x8(dev), torch.tensor([1, 2, 3], device=dev), torch.randn(5, 3, device=dev)
    return (("item", lambda: x.sum().item()), ("if", lambda: bool(x.sum() > 0)), ("mask", lambda: x[x > 0]),
            ("cpu", lambda: x.cpu()), ("tolist", lambda: x.tolist()),
            ("tensor(device=)", lambda: torch.tensor([1.0], device=dev)),
            ("stream "
             "sync", lambda: cg.current_stream().synchronize()), ("synchronize", cg.synchronize),
            ("embedding", lambda: F.embedding(ids, table)), ("matmul", lambda: table @ table.T))


def sync_debug_warns(cg, dev):
    """Under set_sync_debug_mode("warn"): which calls warn "called a synchronizing CUDA operation".
    """
    calls = _calls(cg, dev)
    # lazy initialisation (cuBLAS, allocations) is not what this program asks about
    for _, call in calls:
        call()
    warned = []
    prev = cg.get_sync_debug_mode()
    try:
        for name, call in calls:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                cg.set_sync_debug_mode("warn")
                try:
                    call()
                finally:
                    cg.set_sync_debug_mode(0)
            if any("called a synchronizing CUDA operation" in str(w.message) for w in caught):
                warned.append(name)
    finally:
        cg.set_sync_debug_mode(prev)
    quiet = [n for n, _ in calls if n not in warned]
    return f"warn: {', '.join(warned)}; quiet: {', '.join(quiet)}"


def sync_debug_error(cg, dev):
    """Under set_sync_debug_mode("error"): .item() raises; the mode is back to 0 after "default"."""
    x = x8(dev)
    cg.set_sync_debug_mode("error")
    try:
        x.sum().item()
        verdict = "no error"
    except RuntimeError as e:
        verdict = "called a synchronizing CUDA operation" if "synchronizing" in str(e) else phrase(e)
    finally:
        cg.set_sync_debug_mode("default")
    return f"{verdict}; mode after 'default': {cg.get_sync_debug_mode()}"


def graph_freed_during_capture(cg, dev):
    """A captured graph left in a dead reference cycle, collected in the middle of another capture:
    that capture fails (the graph's destructor calls CUDA)."""
    x = x8(dev)
    g, _ = capture(cg, lambda: x + 1)
    cycle = {"graph": g}
    cycle["self"] = cycle  # only the garbage collector can free it now
    del g, cycle

    def body():
        y = x * 2
        gc.collect()  # what the collector does when it comes due: never in a capture
        y + 1
    return capture_error(cg, body)
