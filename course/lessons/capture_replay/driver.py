"""What the host time of ``g.replay()`` depends on (``graphs_replay_launch``, lesson 02, section 5):
graphs of ``n`` tiny kernels in a straight line or in four branches, their first and later launches,
an explicit upload and torch's instantiation flags against the driver's (called through ctypes)."""
from __future__ import annotations

import ctypes
import time

import torch

from course.core.results import Result
from course.core.timing import time_enqueue
from course.lessons.capture_replay.bench import _fit_slope


BRANCHES = 4
COUNTS = (4, 16, 64, 256, 1024)


def driver():
    """The CUDA driver library with the graph calls this experiment uses, or None (with why) when it
    lacks one."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        return None, f"libcuda.so.1 not loadable: {e}"
    vp, i = ctypes.c_void_p, ctypes.c_int
    sig = {"cuGraphUpload": [vp, vp], "cuGraphLaunch": [vp, vp], "cuGraphExecDestroy": [vp],
           "cuGraphInstantiateWithFlags": [ctypes.POINTER(vp), vp, ctypes.c_ulonglong],
           "cuCtxGetDevice": [ctypes.POINTER(i)]}
    for name, args in sig.items():
        fn = getattr(lib, name, None)
        if fn is None:
            return None, f"the driver has no {name}"
        fn.argtypes, fn.restype = args, i
    return lib, ""


def capture(shape: str, n: int, bufs, cap_stream, keep_graph: bool):
    """A graph of ``n`` adds: ``"chain"`` on the capture stream, or ``"fork"`` over :data:`BRANCHES`
    side streams."""
    side = [torch.cuda.Stream() for _ in range(BRANCHES)]

    def work():
        if shape == "chain":
            for _ in range(n):
                bufs[0].add_(1.0)
            return
        here = torch.cuda.current_stream()
        for b, s in enumerate(side):
            s.wait_stream(here)
            with torch.cuda.stream(s):
                for _ in range(n // BRANCHES):
                    bufs[b].add_(1.0)
        for s in side:
            here.wait_stream(s)

    with torch.cuda.stream(cap_stream):
        work()  # warm-up, on the side stream the capture uses
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph(keep_graph=True) if keep_graph else torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=cap_stream):
        work()
    if keep_graph:
        g.instantiate()
    torch.cuda.synchronize()
    return g


def host_us(fn) -> float:
    """Host microseconds of one call of ``fn``, the GPU idle before it."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e6


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} returned CUresult {rc}")


def launch_row(shape: str, n: int, correct: bool, first_us: float, repeat,
               repeat_capture_stream) -> dict:
    """One ``graphs_replay_launch`` row: the first launch (us) and the later ones (Timings, default
    stream and capture stream); the driver's columns None until :func:`driver_launches` fills
    them."""
    return {"shape": shape, "nodes": n, "replay_correct": correct, "first_us": first_us,
            "repeat_us": repeat.us,
            "repeat_q1_us": repeat.q1 * 1e6, "repeat_q3_us": repeat.q3 * 1e6,
            "repeat_capture_stream_us": repeat_capture_stream.us,
            "first_after_upload_us": None, "driver_flags0_first_us": None,
            "driver_flags0_repeat_us": None}


def driver_launches(lib, g, shape: str, n: int, bufs, cap_stream, repeats: int) -> dict:
    """The driver's columns of a row: the first launch of a fresh instantiation uploaded first
    (``cuGraphUpload``), and ``g``'s graph instantiated with flags 0
    (``cuGraphInstantiateWithFlags``), launched by ``cuGraphLaunch``."""
    row = {}
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    # a fresh instantiation, uploaded before its first launch
    g2 = capture(shape, n, bufs, cap_stream, keep_graph=True)
    _check(lib.cuGraphUpload(ctypes.c_void_p(g2.raw_cuda_graph_exec()), stream), "cuGraphUpload")
    row["first_after_upload_us"] = host_us(g2.replay)
    exe = ctypes.c_void_p()
    graph = ctypes.c_void_p(g.raw_cuda_graph())
    flags0 = lib.cuGraphInstantiateWithFlags(ctypes.byref(exe), graph, 0)
    _check(flags0, "cuGraphInstantiateWithFlags")
    try:
        launch = lambda: _check(lib.cuGraphLaunch(exe, stream), "cuGraphLaunch")  # noqa: E731
        row["driver_flags0_first_us"] = host_us(launch)
        row["driver_flags0_repeat_us"] = time_enqueue(launch, warmup=3, repeats=repeats, inner=1).us
    finally:
        torch.cuda.synchronize()
        lib.cuGraphExecDestroy(exe)
    del g2
    return row


def slope(rows, column: str) -> float:
    """Least-squares microseconds per node of ``column`` against ``nodes`` (rows with a value)."""
    pts = [(r["nodes"], r[column]) for r in rows if r[column] is not None]
    return _fit_slope(*zip(*pts)) if len(pts) >= 2 else float("nan")


def launch_driver(counts):
    """``(lib, notes)`` for the experiment: the driver (:func:`driver`) or None and why not. Counts
    that are not multiples of :data:`BRANCHES` are refused (the forked graph splits them over its
    branches)."""
    if any(n % BRANCHES for n in counts):
        raise ValueError(f"counts must be multiples of {BRANCHES} (the forked graph splits them "
                         "over its branches)")
    lib, notes = driver()
    if lib is not None and not hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph_exec"):
        lib, notes = None, ("this torch has no CUDAGraph.raw_cuda_graph_exec (keep_graph): no "
                            "upload, no flags")
    return lib, notes


def ctypes_call_us(lib, repeats: int):
    """Host microseconds of one cheap driver call through ctypes (``cuCtxGetDevice``), or None
    without a driver."""
    if lib is None:
        return None
    dev = ctypes.c_int()
    return time_enqueue(lambda: lib.cuCtxGetDevice(ctypes.byref(dev)), warmup=3, repeats=repeats,
                        inner=10).us


def launch_result(rows: list, counts, repeats: int, notes: str, ctypes_us) -> Result:
    """The ``graphs_replay_launch`` table: :func:`launch_row` rows and per-node fits; ``ctypes_us``
    None means no driver was used (no driver fits, no ctypes line)."""
    res = Result("graphs_replay_launch", "Host time of one graph launch: shape, first launch, "
                                         "upload, stream, flags",
                 {"shape": "", "nodes": "count", "replay_correct": "", "first_us": "us",
                  "repeat_us": "us",
                  "repeat_q1_us": "us", "repeat_q3_us": "us", "repeat_capture_stream_us": "us",
                  "first_after_upload_us": "us", "driver_flags0_first_us": "us",
                  "driver_flags0_repeat_us": "us"},
                 rows,
                 params={"counts": list(counts), "repeats": repeats, "branches": BRANCHES,
                         "notes": notes})
    for shape in ("chain", "fork"):
        mine = [r for r in rows if r["shape"] == shape]
        res.add_summary(f"{shape}: repeat launch, per node (fit)", slope(mine, "repeat_us"), "us")
        res.add_summary(f"{shape}: first launch, per node (fit)", slope(mine, "first_us"), "us")
        if ctypes_us is not None:
            res.add_summary(f"{shape}: driver flags 0 repeat launch, per node (fit)",
                            slope(mine, "driver_flags0_repeat_us"), "us")
    if ctypes_us is not None:
        res.add_summary("ctypes call", ctypes_us, "us")
    res.add_summary("every replay ran every node", all(r["replay_correct"] for r in rows))
    return res
