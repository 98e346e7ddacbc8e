"""After a failed capture, does the next one work? Each kind of failure the course teaches, raw and
guarded, each case in a fresh process (``capture_recovery`` in :mod:`.bench` runs them).

:func:`after_failure` makes one capture of a failing step fail, then captures a good step into the
same pool and replays it on new data: with ``torch.cuda.graph`` (raw; an *invalidated* capture
leaves the allocators recording into the pool, measured on an H100 with torch 2.11) or through
:func:`course.core.capture.graph` (guarded). :func:`freed_during_capture`: a graph left in a dead
reference cycle, freed by the garbage collector in the middle of another capture
(:func:`freed_graph_hazard`), and the same code with the collector off (:func:`freed_graph_fixed`).
"""
from __future__ import annotations

import gc

import torch

from course.core.capture import graph, recover, require_gpu, warm_up
from course.core.harness import root_cause
from course.core.runtime import cuda
from course.core.text import condense

KINDS = ("host_read", "d2h_copy", "numba_alloc", "rng", "unjoined_stream")


def failing_step(kind: str, x, side):
    """A step that breaks capture in the way ``kind`` names (``side``: a stream for the unjoined
    fork)."""
    if kind == "host_read":  # .item() in disguise: the host waits for the device
        return x * float(x.abs().max() > -1)
    if kind == "d2h_copy":  # refused by torch before any CUDA call
        return x.to("cpu").to(x.device) * 2
    if kind == "numba_alloc":  # cuMemAlloc is not permitted while capturing
        cuda().device_array(16)
        return x * 2
    if kind == "rng":  # a random op is recorded (the generator enters capture), then a host read
        y = x + torch.randn_like(x)
        return y * float(y.abs().max() > -1)
    if kind == "unjoined_stream":  # work forked to a side stream and never joined back
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            x.mul(3)
        return x * 2
    raise ValueError(f"unknown failure kind {kind!r}: choose from {KINDS}")


def good_step(x):
    """A capturable step that allocates new memory in the pool and uses the random generator."""
    return torch.relu(x @ (x.T @ x)[:, :8]) + 0 * torch.randn(x.shape[0], 8, device=x.device)


def _capture(guarded: bool, fn, pool):
    g = torch.cuda.CUDAGraph()
    ctx = graph(g, pool=pool) if guarded else torch.cuda.graph(g, pool=pool)
    with ctx:
        out = fn()
    return g, out


def abandoned_graph_cycle(x):
    """Capture and replay a small graph, then drop it inside a reference cycle: only the collector
    frees it.

    This is what a cache that "clears" by dropping entries that point back at the cache leaves
    behind.
    """
    old = torch.cuda.CUDAGraph()
    with torch.cuda.graph(old):
        y = x * 2
    old.replay()
    cycle = {"graph": old, "output": y}
    cycle["self"] = cycle  # a reference cycle: refcounting alone never frees it


def capture_with_collection(capture, x, by_hand: bool, allocations: int = 2000):
    """Capture ``good_step(x)`` with ``capture`` while the body makes Python garbage (the collector
    comes due).

    ``by_hand``: call ``gc.collect()`` inside the capture instead, so the collection lands there
    every time.
    """
    g = torch.cuda.CUDAGraph()
    with capture(g):
        out = good_step(x)
        if by_hand:
            gc.collect()  # what the collector does whenever it is due: here, every time
        junk = [[i] for i in range(allocations)]  # container allocations: the collector comes due
        out = out + 0
        del junk
    return g, out


def freed_graph_hazard(x, by_hand: bool = False):
    """The hazard: a graph left in a reference cycle, then ``torch.cuda.graph`` with the collector
    on."""
    abandoned_graph_cycle(x)  # hazard: a graph only the garbage collector will free
    return capture_with_collection(torch.cuda.graph, x, by_hand)  # hazard: gc runs mid-capture


def freed_graph_fixed(x, by_hand: bool = False):
    """The fix: the same abandoned graph, captured through :func:`course.core.capture.graph`
    (collector off)."""
    abandoned_graph_cycle(x)
    return capture_with_collection(graph, x, by_hand)


def freed_during_capture(guarded: bool, by_hand: bool = False, threshold: int = 500,
                         rows: int = 64) -> dict:
    """In this process: a graph abandoned in a reference cycle, then a capture while the collector
    comes due.

    The cycle is made with the collector off, then the collector goes on with a first-generation
    ``threshold`` that the capture's body crosses (the few allocations before the capture begins do
    not): the collection lands inside the capture, as it did by chance after lab 3's caches.
    ``by_hand``: the body calls ``gc.collect()`` itself. Returns whether the capture worked and its
    first error line.
    """
    require_gpu("the freed-graph hazard")
    x = torch.randn(rows, 32, device="cuda")
    warm_up(lambda: good_step(x), 2)
    saved, was_on = gc.get_threshold(), gc.isenabled()
    row = {"kind": "graph freed during capture" + (" (gc.collect() by hand)" if by_hand else ""),
           "capture": "course graph()" if guarded else "torch.cuda.graph",
           "failure": "", "next_capture_ok": False, "replay_right": False, "next_error": ""}
    try:
        gc.collect()
        gc.disable()
        try:
            gc.set_threshold(threshold)
            fn = freed_graph_fixed if guarded else freed_graph_hazard
            gc.enable()
            g, out = fn(x, by_hand)
            row["next_capture_ok"] = True
        finally:
            gc.set_threshold(*saved)
            (gc.enable if was_on else gc.disable)()
        x.copy_(torch.randn(rows, 32, device="cuda"))
        g.replay()
        torch.cuda.synchronize()
        row["replay_right"] = bool(torch.allclose(out, good_step(x), atol=1e-3))
    except Exception as e:  # noqa: BLE001 - the failure is the point
        row["failure"] = _first_line(root_cause(e))
        torch.cuda.set_stream(torch.cuda.default_stream())
        try:
            recover()
        except Exception as e2:  # noqa: BLE001 - a poisoned process is a result
            row["next_error"] = _first_line(e2)
    return row


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {condense(str(e), 1, 240)}"


def after_failure(kind: str, guarded: bool, rows: int = 64) -> dict:
    """In this process: a failing capture of ``kind``, then a good capture into the same pool,
    replayed on new data.

    Returns the failure's first line, whether the good capture worked, and whether its replay
    matched eager.
    """
    require_gpu("capture recovery")
    pool, side = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
    x = torch.randn(rows, 32, device="cuda")
    if kind != "numba_alloc":  # (a Numba allocation runs fine eagerly; warm the others up)
        warm_up(lambda: failing_step(kind, x, side), 1)
    failure = ""
    try:
        _capture(guarded, lambda: failing_step(kind, x, side), pool)
        failure = "(captured: no failure)"
    except Exception as e:  # noqa: BLE001 - the failure is the point
        failure = _first_line(root_cause(e))
    finally:
        torch.cuda.set_stream(torch.cuda.default_stream())  # a raw failure leaves its own current
    row = {"kind": kind, "capture": "course graph()" if guarded else "torch.cuda.graph",
           "failure": failure,
           "next_capture_ok": False, "replay_right": False, "next_error": ""}
    try:
        recover()  # both ways: the stream drained, the random generator out of capture mode
        y = torch.randn(rows, 32, device="cuda")
        warm_up(lambda: good_step(y), 2)
        g, out = _capture(guarded, lambda: good_step(y), pool)
        row["next_capture_ok"] = True
        y.copy_(torch.randn(rows, 32, device="cuda"))
        g.replay()
        torch.cuda.synchronize()
        row["replay_right"] = bool(torch.allclose(out, good_step(y), atol=1e-3))
    except Exception as e:  # noqa: BLE001 - a poisoned process is a result
        row["next_error"] = _first_line(e)
    return row


def all_in_a_row(kinds=KINDS) -> dict:
    """Every kind fails in turn in this process (guarded), each followed by a good capture into one
    shared pool."""
    rows = [after_failure(k, True) for k in kinds]
    ok = all(r["next_capture_ok"] and r["replay_right"] for r in rows)
    errors = "; ".join(f"{r['kind']}: {r['next_error']}" for r in rows if r["next_error"])
    return {"kind": "all five in a row", "capture": "course graph()",
            "failure": f"{len(rows)} failures",
            "next_capture_ok": all(r["next_capture_ok"] for r in rows), "replay_right": ok,
            "next_error": errors}
