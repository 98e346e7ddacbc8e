"""After a failed capture, does the next one work? Each kind of failure the course teaches, raw and guarded.

A graph cache captures many keys into one shared memory pool; one key that cannot be captured
must cost that key only. :func:`after_failure` makes one capture of a failing step fail, then
captures a good step into the same pool and replays it on new data:

- ``torch.cuda.graph`` (raw), followed by :func:`course.core.capture.recover` (the random generator
  reset, the queue drained): measured on an H100 with torch 2.11, an *invalidated* capture (a host
  read, a Numba allocation, a random op followed by a host read, a side stream never joined) leaves
  the allocators recording into the pool, so the next capture into it fails ("already recording to
  mempool_id"); a device-to-host copy that torch refuses before CUDA sees it leaves no trace;
- :func:`course.core.capture.graph` (guarded): the same failures, then the same good capture.

Each case runs in a fresh process (:mod:`course.core.isolate`), since a raw failure poisons the
process it happens in; a last row makes every kind fail in turn in one process, guarded, with a
good capture after each.
"""
from __future__ import annotations

from course.core.capture import _root_cause, recover, require_gpu
from course.core.isolate import run_isolated
from course.core.reference import experiment
from course.core.results import Result
from course.core.text import condense

KINDS = ("host_read", "d2h_copy", "numba_alloc", "rng", "unjoined_stream")


def failing_step(kind: str, x, side):
    """A step that breaks capture in the way ``kind`` names (``side``: a stream for the unjoined fork)."""
    import torch

    if kind == "host_read":  # .item() in disguise: the host waits for the device
        return x * float(x.abs().max() > -1)
    if kind == "d2h_copy":  # refused by torch before any CUDA call
        return x.to("cpu").to(x.device) * 2
    if kind == "numba_alloc":  # cuMemAlloc is not permitted while capturing
        from numba import cuda
        cuda.device_array(16)
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
    import torch

    return torch.relu(x @ (x.T @ x)[:, :8]) + 0 * torch.randn(x.shape[0], 8, device=x.device)


def _capture(guarded: bool, fn, pool):
    import torch

    from course.core.capture import graph

    g = torch.cuda.CUDAGraph()
    ctx = graph(g, pool=pool) if guarded else torch.cuda.graph(g, pool=pool)
    with ctx:
        out = fn()
    return g, out


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {condense(str(e), 1, 240)}"


def after_failure(kind: str, guarded: bool, rows: int = 64) -> dict:
    """In this process: a failing capture of ``kind``, then a good capture into the same pool, replayed on new data.

    Returns the failure's first line, whether the good capture worked, and whether its replay matched eager.
    """
    import torch

    from course.core.capture import warm_up

    require_gpu("capture recovery")
    pool, side = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
    x = torch.randn(rows, 32, device="cuda")
    if kind != "numba_alloc":  # (a Numba allocation runs fine eagerly; warm the others the same way)
        warm_up(lambda: failing_step(kind, x, side), 1)
    failure = ""
    try:
        _capture(guarded, lambda: failing_step(kind, x, side), pool)
        failure = "(captured: no failure)"
    except Exception as e:  # noqa: BLE001 - the failure is the point
        failure = _first_line(_root_cause(e))
    finally:
        torch.cuda.set_stream(torch.cuda.default_stream())  # raw torch.cuda.graph leaves its capture stream current
    row = {"kind": kind, "capture": "course graph()" if guarded else "torch.cuda.graph", "failure": failure,
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
    """Every kind fails in turn in this process (guarded), each followed by a good capture into one shared pool."""
    rows = [after_failure(k, True) for k in kinds]
    ok = all(r["next_capture_ok"] and r["replay_right"] for r in rows)
    errors = "; ".join(f"{r['kind']}: {r['next_error']}" for r in rows if r["next_error"])
    return {"kind": "all five in a row", "capture": "course graph()", "failure": f"{len(rows)} failures",
            "next_capture_ok": all(r["next_capture_ok"] for r in rows), "replay_right": ok, "next_error": errors}


@experiment("capture_recovery", gpu_only=True, quick={"kinds": ("host_read", "d2h_copy")})
def recovery_experiment(kinds=KINDS, timeout: float = 120.0) -> Result:
    """Per kind of failed capture: does the next capture into the same pool work, raw and guarded?"""
    require_gpu("capture recovery")
    from concurrent.futures import ThreadPoolExecutor

    jobs = [("after_failure", {"kind": k, "guarded": g}) for k in kinds for g in (False, True)]
    jobs.append(("all_in_a_row", {"kinds": list(kinds)}))
    with ThreadPoolExecutor(max_workers=4) as pool:  # independent processes: four at a time on one GPU
        rows = list(pool.map(lambda job: run_isolated(__name__, job[0], timeout=timeout, **job[1]), jobs))
    res = Result("capture_recovery", "After each kind of failed capture: the next capture into the same pool",
                 {"kind": "", "capture": "", "failure": "", "next_capture_ok": "", "replay_right": "",
                  "next_error": ""}, rows, params={"kinds": list(kinds)})
    guarded = [r for r in rows if r["capture"] == "course graph()"]
    raw = [r for r in rows if r["capture"] == "torch.cuda.graph"]
    res.add_summary("captures_after_failure_ok", all(r["next_capture_ok"] and r["replay_right"] for r in guarded))
    res.add_summary("raw torch.cuda.graph: kinds that poisoned the next capture",
                    sum(not (r["next_capture_ok"] and r["replay_right"]) for r in raw))
    return res
