"""See the memory access of an embedding kernel: which addresses each thread of a warp touches.

On the simulator every array access is a Python call, so :func:`trace` records each thread's
addresses. A warp's k-th accesses form one request, served in 32-byte sectors; an array's coalescing
score is bytes requested / bytes used (1.0: all used; ~8: one column of 32 rows, as
:func:`uncoalesced_kernel` reads). :func:`draw` shows it; the experiment ``embedding_coalescing``
measures both course kernels' bandwidth on a GPU beside their scores from the simulator.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections import defaultdict
from functools import lru_cache

import torch

from course.core.reference import experiment
from course.core.results import Result
from course.core.runtime import as_numba, cuda as _numba_cuda, numba_stream, runtime
from course.embedding.kernels import element_view
from course.embedding.lookup import error_flag

cuda = _numba_cuda()
SECTOR = 32  # bytes: the unit in which global memory serves a warp's request
WARP = 32
GOOD, BAD = 1.5, 2.0  # scores at or under GOOD are coalesced; over BAD, uncoalesced


def _uncoalesced_body(ids, weight, out, err):
    i = cuda.grid(1)
    n_rows = out.shape[0]
    if i < n_rows * weight.shape[1]:
        d = i // n_rows  # neighbouring threads: the same column of neighbouring output rows
        n = i - d * n_rows
        idx = ids[n]
        if idx >= 0 and idx < weight.shape[0]:
            out[n, d] = weight[idx, d]
        else:
            out[n, d] = 0
            if d == 0:
                cuda.atomic.add(err, 0, 1)


@lru_cache(maxsize=None)
def uncoalesced_kernel():
    """A correct one-thread-per-element kernel whose warps read one column of 32 different rows."""
    return cuda.jit(_uncoalesced_body)


def launch_elementwise(kernel, ids, weight, threads=None):
    """Launch an ``(ids, weight, out, err)`` kernel with one thread per output element; return
    ``out``."""
    flat = ids.contiguous().view(-1)
    out = torch.empty(*ids.shape, weight.shape[1], dtype=weight.dtype, device=weight.device)
    w, o = element_view(weight), element_view(out.view(-1, weight.shape[1]))
    threads = threads or (256 if runtime().on_gpu else WARP)
    blocks = (o.numel() + threads - 1) // threads
    kernel[blocks, threads, numba_stream()](as_numba(flat), as_numba(w), as_numba(o), as_numba(error_flag()))
    return out


class AccessTrace:
    """The accesses of one traced launch: ``records`` of (block, thread, k, array, offset, nbytes,
    write)."""

    def __init__(self, records: list, arrays: dict):
        self.records = records
        self.arrays = arrays  # name -> (start address, nbytes)

    def requests(self, array: str | None = None) -> dict:
        """(block, warp, k, array, write) -> list of (lane, byte offset, nbytes): one entry per warp
        request."""
        out = defaultdict(list)
        for b, t, k, name, off, nbytes, write in self.records:
            if array is None or name == array:
                out[(b, t // WARP, k, name, write)].append((t % WARP, off, nbytes))
        return out

    def score(self) -> Result:
        """Per array and direction: requests, bytes used, bytes requested (32-byte sectors), their
        ratio."""
        agg = defaultdict(lambda: [0, 0, 0])
        for (b, w, k, name, write), acc in self.requests().items():
            used = {off + j for _, off, nb in acc for j in range(nb)}
            sectors = {x // SECTOR for x in used}
            a = agg[(name, "write" if write else "read")]
            a[0] += 1
            a[1] += len(used)
            a[2] += SECTOR * len(sectors)
        rows = [{"array": n, "access": rw, "requests": a[0], "bytes_used": a[1], "bytes_requested": a[2],
                 "requested_per_used": a[2] / a[1]} for (n, rw), a in sorted(agg.items())]
        res = Result("embedding_access", "Memory access per warp request (simulator trace)",
                     {"array": "", "access": "", "requests": "", "bytes_used": "B", "bytes_requested": "B",
                      "requested_per_used": "x"}, rows)
        big = [r for r in rows if r["array"] in ("weight", "out")] or rows
        used, req = sum(r["bytes_used"] for r in big), sum(r["bytes_requested"] for r in big)
        res.add_summary("score", req / used if used else float("nan"), "x")
        return res

    def verdict(self) -> str:
        """One sentence: coalesced or not, and what it costs on a GPU."""
        s = self.score().value("score")
        if s <= GOOD:
            return f"coalesced: each warp request uses {1 / s:.0%} of the bytes it fetches (score {s:.2f}x)."
        worst = max(self.score().rows, key=lambda r: r["requested_per_used"])
        tail = (f"a warp fetches {s:.1f}x the bytes it uses (worst: {worst['array']} "
                f"{worst['access']}s, {worst['requested_per_used']:.1f}x): neighbouring "
                "threads touch addresses in different 32-byte sectors. Correct, but on a "
                f"GPU expect roughly 1/{s:.0f} of the bandwidth of a coalesced kernel; "
                "give neighbouring threads neighbouring columns (d = i - n * D).")
        return ("UNCOALESCED: " if s > BAD else "partly coalesced: ") + tail


def _thread_info():
    from numba.cuda.simulator.kernel import BlockThread

    t = threading.current_thread()
    if not isinstance(t, BlockThread):
        return None
    gx, gy, _ = t._manager._grid_dim
    block = t.blockIdx.x + gx * (t.blockIdx.y + gy * t.blockIdx.z)
    k = getattr(t, "_course_k", 0)
    t._course_k = k + 1
    return block, t.thread_id, k


def _address(ary, idx):
    if not isinstance(idx, tuple):
        idx = (idx,)
    if len(idx) != ary.ndim or not all(isinstance(i, (int,)) or hasattr(i, "__index__") for i in idx):
        return None
    off = 0
    for i, n, st in zip(idx, ary.shape, ary.strides):
        i = int(i)
        off += (i + n if i < 0 else i) * st
    return ary.__array_interface__["data"][0] + off


def trace(launch, *args, **kwargs) -> AccessTrace:
    """Run ``launch(*args, **kwargs)`` on the simulator and record every element access of its
    kernels.

    Arrays are named by the kernel's parameter names (``ids``, ``weight``, ``out``, ``err``).
    Simulator only: on a GPU, run it in a process started with ``COURSE_PATH=sim``.
    """
    if runtime().on_gpu:
        raise RuntimeError("trace() needs the Numba CUDA simulator (it records each "
                           "thread's accesses in Python): start a process with "
                           "COURSE_PATH=sim, or use the GPU experiment embedding_coalescing")
    import inspect

    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray, FakeWithinKernelCUDAArray
    from numba.cuda.simulator.kernel import FakeCUDAKernel

    from numba.cuda.simulator.kernel import BlockThread

    records, arrays, pending, lock = [], {}, [], threading.Lock()
    orig_call, orig_get, orig_set, orig_init = FakeCUDAKernel.__call__, FakeWithinKernelCUDAArray.__getitem__, \
        FakeWithinKernelCUDAArray.__setitem__, FakeWithinKernelCUDAArray.__init__

    def note(self, idx, write, width=None):
        ary = self._item._ary
        addr = _address(ary, idx)
        info = _thread_info() if addr is not None else None
        if info is None:
            return
        for name, (start, nbytes) in arrays.items():
            if start <= addr < start + nbytes:
                with lock:
                    records.append((*info, name, addr - start, width or ary.itemsize, write))
                return

    def load16(ary, row, col):  # the course's 16-byte load: ONE access of 16 bytes, as on the GPU
        note(ary, (row, 4 * col), False, 16)
        return tuple(orig_get(ary, (row, 4 * col + q)) for q in range(4))

    def store16(ary, row, col, val):
        note(ary, (row, 4 * col), True, 16)
        for q in range(4):
            orig_set(ary, (row, 4 * col + q), val[q])

    def call(self, *a):
        if not self._device and not isinstance(threading.current_thread(), BlockThread):
            names = list(inspect.signature(self.fn).parameters)
            pending[:] = [name for name, arg in zip(names, a) if isinstance(arg, FakeCUDAArray)
                          or (hasattr(arg, "__array_interface__") and getattr(arg, "ndim", 0) > 0)]
        return orig_call(self, *a)

    # the simulator wraps each array argument, in order, on the launching thread
    def init(self, item):
        orig_init(self, item)
        if pending and not isinstance(threading.current_thread(), BlockThread):
            arr = item._ary
            arrays[pending.pop(0)] = (arr.__array_interface__["data"][0], arr.nbytes)

    def get(self, idx):
        note(self, idx, False)
        return orig_get(self, idx)

    def put(self, idx, val):
        note(self, idx, True)
        return orig_set(self, idx, val)

    import course.embedding.kernels as _k

    K, W = FakeCUDAKernel, FakeWithinKernelCUDAArray
    saved16 = _k.load16, _k.store16
    K.__call__, W.__getitem__, W.__setitem__, W.__init__ = call, get, put, init
    _k.load16, _k.store16 = load16, store16
    try:
        launch(*args, **kwargs)
    finally:
        K.__call__, W.__getitem__, W.__setitem__, W.__init__ = orig_call, orig_get, orig_set, orig_init
        _k.load16, _k.store16 = saved16
    return AccessTrace(records, arrays)


def demo_inputs(n_ids: int = 32, dim: int = 32, vocab: int = 64, seed: int = 0):
    """Small ids and a float32 table for a trace: 32 x 32 outputs, so a warp can read 32 different
    rows."""
    g = torch.Generator().manual_seed(seed)
    dev = runtime().device
    return (torch.randint(0, vocab, (n_ids,), generator=g).to(dev), torch.randn(vocab, dim, generator=g).to(dev))


def draw(ax, tr: AccessTrace, array: str = "weight", block: int = 0, warp: int = 0, max_requests: int = 8):
    """Threads (x) against byte offsets in ``array`` (y), one colour per warp request of one warp.
    """
    reqs = sorted((k, acc) for (b, w, k, name, _), acc in tr.requests(array).items() if b == block and w == warp)
    if not reqs:
        ax.text(0.5, 0.5, f"no accesses to {array} by warp {warp} of block {block}", ha="center",
                transform=ax.transAxes)
        return
    for n, (k, acc) in enumerate(reqs[:max_requests]):
        lanes, offs = [a[0] for a in acc], [a[1] for a in acc]
        sectors = len({o // SECTOR for o in offs})
        ax.scatter(lanes, offs, s=14, label=f"request {k}: {sectors} "
                                            f"sector{'s' if sectors > 1 else ''}")
    ax.set_xlabel("thread (lane) in the warp")
    ax.set_ylabel(f"byte offset in {array}")
    ax.set_title(f"{array}: warp {warp} of block {block}", fontsize=10)
    ax.legend(fontsize=7, loc="best")


def check_coalescing(launch, ids=None, weight=None) -> AccessTrace:
    """Trace ``launch(ids, weight)`` (default: :func:`demo_inputs`), print its scores and verdict,
    return the trace."""
    if ids is None or weight is None:
        ids, weight = demo_inputs()
    tr = trace(launch, ids, weight)
    error_flag().zero_()
    print(tr.verdict())
    return tr


def _sim_scores() -> dict:
    """Scores of the course's naive and uncoalesced kernels on the simulator (run in a
    COURSE_PATH=sim child)."""
    from course.embedding.kernels import naive_kernel

    ids, w = demo_inputs()
    return {name: trace(lambda i, t: launch_elementwise(k(), i, t), ids, w).score().value("score")
            for name, k in (("naive", naive_kernel), ("uncoalesced", uncoalesced_kernel))}


@experiment("embedding_coalescing", gpu_only=True, quick=dict(n_ids=1024, dim=256, repeats=3))
def embedding_coalescing(n_ids: int = 16384, dim: int = 1024, vocab: int = 32000, repeats: int = 10) -> Result:
    """Bandwidth on the GPU of the coalesced naive kernel and the uncoalesced one, beside their
    simulator scores."""
    from course.core.timing import graph_time
    from course.embedding.kernels import naive_kernel

    env = {**os.environ, "COURSE_PATH": "sim", "NUMBA_ENABLE_CUDASIM": "1"}
    child = subprocess.run([sys.executable, "-c", "import json, course.embedding.access as A; "
                            "print(json.dumps(A._sim_scores()))"], env=env, capture_output=True, text=True,
                           timeout=600)
    if child.returncode:
        raise RuntimeError(f"the simulator child failed: {child.stderr[-2000:]}")
    scores = json.loads(child.stdout.strip().splitlines()[-1])
    dev = runtime().device
    w = torch.randn(vocab, dim, device=dev)
    ids = torch.randint(0, vocab, (n_ids,), device=dev)
    moved = 2 * n_ids * dim * 4 + n_ids * 8
    rows = []
    for name, k in (("naive", naive_kernel), ("uncoalesced", uncoalesced_kernel)):
        kern = k()
        assert torch.equal(launch_elementwise(kern, ids, w), torch.nn.functional.embedding(ids, w))
        t = graph_time(lambda: launch_elementwise(kern, ids, w), repeats=repeats)
        rows.append({"kernel": name, "score": scores[name], "us": t.us, "us_q1": t.q1 * 1e6, "us_q3": t.q3 * 1e6,
                     "GB_per_s": moved / t.median / 1e9})
    res = Result("embedding_coalescing", "Coalescing score (simulator) vs bandwidth (GPU)",
                 {"kernel": "", "score": "x", "us": "us", "us_q1": "us", "us_q3": "us", "GB_per_s": "GB/s"}, rows,
                 params=dict(n_ids=n_ids, dim=dim, vocab=vocab, repeats=repeats))
    res.add_summary("bandwidth ratio naive / "
                    "uncoalesced", rows[0]["GB_per_s"] / rows[1]["GB_per_s"], "x")
    res.add_summary("score ratio uncoalesced / naive", scores["uncoalesced"] / scores["naive"], "x")
    return res
