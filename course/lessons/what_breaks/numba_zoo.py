"""Capture hazards that Numba users hit, each with its fix (lesson 03; ``hazards_numba``, whose code stands in
lesson 03's cell, captures each with :func:`capture_and_replay` and tabulates them with :func:`numba_result`).

1. a kernel launched on Numba's default stream instead of torch's (capturing) stream;
2. ``cuda.device_array`` inside the captured function (Numba allocates with cuMemAlloc);
3. ``cuda.to_device`` inside the captured function (an allocation and a pageable host-to-device copy);
4. a kernel compiled for the first time inside the capture (a kernel defined inside the function).

Every function computes ``2 * x + 1`` into a new tensor, so hazards and fixes can be compared with eager on new
inputs after a replay. Hazard lines carry ``# hazard`` like the main zoo.
"""
from __future__ import annotations

import warnings

import numpy as np
import torch

from course.core import numba_kernels
from course.core.results import Result
from course.core.text import clip
from course.core.runtime import as_numba, cuda, numba_stream, runtime

_K: dict = {}
ncuda = None  # numba.cuda, set by kernels(); a module global, so the simulator can swap it inside kernels


def kernels():
    """``(affine, scale_by, copy)``: 2 * x + 1 (:func:`course.core.numba_kernels.affine`), x * w + 1, and a copy
    (module-level kernels, compiled once)."""
    global ncuda
    if not _K:
        ncuda = cuda()

        @ncuda.jit
        def scale_by(x, w, out):
            i = ncuda.grid(1)
            if i < x.size:
                out[i] = x[i] * w[i] + 1.0

        @ncuda.jit
        def copy(a, out):
            i = ncuda.grid(1)
            if i < a.size:
                out[i] = a[i]

        _K.update(affine=numba_kernels.affine(), scale_by=scale_by, copy=copy)
    return _K["affine"], _K["scale_by"], _K["copy"]


def _grid(x) -> int:
    return (x.numel() + 31) // 32


# --- 1. Numba's default stream -------------------------------------------------
def default_stream_hazard(x):
    """2x+1 with a Numba kernel launched without a stream argument."""
    affine = kernels()[0]
    out = torch.empty_like(x)
    affine[_grid(x), 32](as_numba(x), as_numba(out))  # hazard: Numba's default stream, not torch's
    return out


def default_stream_fixed(x):
    """2x+1 launched on torch's current stream."""
    affine = kernels()[0]
    out = torch.empty_like(x)
    affine[_grid(x), 32, numba_stream()](as_numba(x), as_numba(out))
    return out


# --- 2. cuda.device_array ----------------------------------------------------------
def device_array_hazard(x):
    """2x+1 through a scratch buffer that Numba allocates on every call."""
    affine, _, copy = kernels()
    tmp = cuda().device_array(x.numel(), dtype=np.float32)  # hazard: cuMemAlloc while capturing
    out = torch.empty_like(x)
    affine[_grid(x), 32, numba_stream()](as_numba(x), tmp)
    copy[_grid(x), 32, numba_stream()](tmp, as_numba(out))
    return out


def device_array_fixed(x):
    """The same, with the scratch buffer from torch's (capture-aware) allocator."""
    affine, _, copy = kernels()
    tmp = torch.empty_like(x)
    out = torch.empty_like(x)
    affine[_grid(x), 32, numba_stream()](as_numba(x), as_numba(tmp))
    copy[_grid(x), 32, numba_stream()](as_numba(tmp), as_numba(out))
    return out


# --- 3. cuda.to_device --------------------------------------------------------------
def to_device_hazard(x):
    """x * 2 + 1 with the factors copied from a NumPy array on every call."""
    scale_by = kernels()[1]
    w = cuda().to_device(np.full(x.numel(), 2.0, dtype=np.float32))  # hazard: allocation + pageable copy
    out = torch.empty_like(x)
    scale_by[_grid(x), 32, numba_stream()](as_numba(x), w, as_numba(out))
    return out


def to_device_fixed(x, w):
    """The same, with the factors in a device tensor made once, before capture."""
    scale_by = kernels()[1]
    out = torch.empty_like(x)
    scale_by[_grid(x), 32, numba_stream()](as_numba(x), as_numba(w), as_numba(out))
    return out


# --- 4. the first compile inside the capture -----------------------------------------
def first_compile_hazard(x):
    """2x+1 with a kernel defined (and so compiled) inside the function."""
    kernels()  # sets ncuda

    @ncuda.jit
    def fresh(a, out):  # hazard: a new kernel object every call: compiled and loaded while capturing
        i = ncuda.grid(1)
        if i < a.size:
            out[i] = 2.0 * a[i] + 1.0

    out = torch.empty_like(x)
    fresh[_grid(x), 32, numba_stream()](as_numba(x), as_numba(out))
    return out


def first_compile_fixed(x):
    """The same with the module-level kernel, compiled once by the warm-up before capture."""
    return default_stream_fixed(x)


ENTRIES = (
    ("default_stream", "kernel launched on Numba's default stream", default_stream_hazard, default_stream_fixed),
    ("device_array", "cuda.device_array inside the capture", device_array_hazard, device_array_fixed),
    ("to_device", "cuda.to_device inside the capture", to_device_hazard, to_device_fixed),
    ("first_compile", "a kernel's first compile inside the capture", first_compile_hazard, first_compile_fixed),
)


def entry_args(name: str, fixed: bool, x):
    """The arguments of an entry's hazard or fix for input ``x`` (the to_device fix takes its factors)."""
    if name == "to_device" and fixed:
        return (x, torch.full_like(x, 2.0))
    return (x,)


def capture_and_replay(fn, args, x, mode: str = "global") -> dict:
    """Capture ``fn(*args)``, replay it with new values in ``x``, compare with eager: what happened, in words."""
    from course.core.capture import try_capture

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = try_capture(lambda: fn(*args), warmup=1, mode=mode)
    empty = any("empty" in str(w.message).lower() for w in caught)
    row = {"captured": out.ok, "error": "" if out.ok else clip(f"{out.error_type}: {out.error}", 240),
           "empty_graph_warning": empty, "replay_matches_eager": None}
    if out.ok:
        x.copy_(torch.randn_like(x))
        out.graph.replay()
        torch.cuda.synchronize()
        row["replay_matches_eager"] = bool(torch.allclose(out.output, 2.0 * x + 1.0))
    out.graph = out.output = None
    torch.cuda.synchronize()
    return row


def numba_result(rows: list, n: int) -> Result:
    """The ``hazards_numba`` table from the cell's rows (one per hazard and per fix, each a
    :func:`capture_and_replay` verdict with the entry's names and static rules), with how many fixes replayed right
    and how many hazards failed to capture or replayed wrong."""
    res = Result("hazards_numba", "Numba inside a CUDA graph capture: four hazards and their fixes",
                 {"entry": "", "title": "", "kind": "", "function": "", "static_rules": "", "captured": "",
                  "error": "", "empty_graph_warning": "", "replay_matches_eager": ""}, rows, params={"n": n})
    fixes_ok = sum(1 for r in rows if r["kind"] == "fix" and r["replay_matches_eager"])
    broken = sum(1 for r in rows if r["kind"] == "hazard" and not r["replay_matches_eager"])
    res.add_summary("fixes that capture and replay right", fixes_ok, f"of {len(ENTRIES)}")
    res.add_summary("hazards that fail to capture or replay wrong", broken, f"of {len(ENTRIES)}")
    return res


def run_eagerly(name: str, kind: str = "hazard"):
    """Run one entry eagerly on this path (simulator or GPU) and return its output (for tests and notebooks)."""
    entry = {e[0]: e for e in ENTRIES}[name]
    fn = entry[2] if kind == "hazard" else entry[3]
    x = torch.arange(8, dtype=torch.float32, device=runtime().device)
    return fn(*entry_args(name, kind == "fix", x)), x
