"""Capture hazards that Numba users hit, each with its fix (lesson 03's ``hazards_numba``).

1. a kernel launched on Numba's default stream instead of torch's (capturing) stream;
2. ``cuda.device_array`` inside the captured function (Numba allocates with cuMemAlloc);
3. ``cuda.to_device`` inside the captured function (an allocation and a host-to-device copy);
4. a kernel compiled for the first time inside the capture (a kernel defined inside the function).

Every function computes ``2 * x + 1`` into a new tensor; hazard lines carry ``# hazard`` as in
:mod:`.zoo`.
"""
from __future__ import annotations

import numpy as np
import torch

from course.core import numba_kernels
from course.core.runtime import as_numba, cuda, numba_stream

_K: dict = {}  # the Numba kernels, compiled once (:func:`kernels`)
ncuda = None  # numba.cuda, set by kernels(): a module global, which the simulator swaps in kernels

def kernels():
    """``(affine, scale_by, copy)``: 2 * x + 1 (:func:`course.core.numba_kernels.affine`),
    x * w + 1, and a copy (module-level kernels, compiled once)."""
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


def blocks(x) -> int:
    """Blocks of 32 threads that cover ``x``."""
    return (x.numel() + 31) // 32


# --- Numba 1. its default stream ------------------------------------------------
def default_stream_hazard(x):
    """2x+1 with a Numba kernel launched without a stream argument."""
    affine = kernels()[0]
    out = torch.empty_like(x)
    affine[blocks(x), 32](as_numba(x), as_numba(out))  # hazard: Numba's default stream, not torch's
    return out


def default_stream_fixed(x):
    """2x+1 launched on torch's current stream."""
    affine = kernels()[0]
    out = torch.empty_like(x)
    affine[blocks(x), 32, numba_stream()](as_numba(x), as_numba(out))
    return out


# --- Numba 2. cuda.device_array ------------------------------------------------------
def device_array_hazard(x):
    """2x+1 through a scratch buffer that Numba allocates on every call."""
    affine, _, copy = kernels()
    tmp = cuda().device_array(x.numel(), dtype=np.float32)  # hazard: cuMemAlloc while capturing
    out = torch.empty_like(x)
    affine[blocks(x), 32, numba_stream()](as_numba(x), tmp)
    copy[blocks(x), 32, numba_stream()](tmp, as_numba(out))
    return out


def device_array_fixed(x):
    """The same, with the scratch buffer from torch's (capture-aware) allocator."""
    affine, _, copy = kernels()
    tmp = torch.empty_like(x)
    out = torch.empty_like(x)
    affine[blocks(x), 32, numba_stream()](as_numba(x), as_numba(tmp))
    copy[blocks(x), 32, numba_stream()](as_numba(tmp), as_numba(out))
    return out


# --- Numba 3. cuda.to_device ----------------------------------------------------------
def to_device_hazard(x):
    """x * 2 + 1 with the factors copied from a NumPy array on every call."""
    scale_by = kernels()[1]
    w = cuda().to_device(np.full(x.numel(), 2.0, dtype=np.float32))  # hazard: alloc + host copy
    out = torch.empty_like(x)
    scale_by[blocks(x), 32, numba_stream()](as_numba(x), w, as_numba(out))
    return out


def to_device_fixed(x, w):
    """The same, with the factors in a device tensor made once, before capture."""
    scale_by = kernels()[1]
    out = torch.empty_like(x)
    scale_by[blocks(x), 32, numba_stream()](as_numba(x), as_numba(w), as_numba(out))
    return out


# --- Numba 4. the first compile inside the capture -----------------------------------
def first_compile_hazard(x):
    """2x+1 with a kernel defined (and so compiled) inside the function."""
    kernels()  # sets ncuda

    @ncuda.jit
    def fresh(a, out):  # hazard: a new kernel object every call: compiled while capturing
        i = ncuda.grid(1)
        if i < a.size:
            out[i] = 2.0 * a[i] + 1.0

    out = torch.empty_like(x)
    fresh[blocks(x), 32, numba_stream()](as_numba(x), as_numba(out))
    return out


def first_compile_fixed(x):
    """The same with the module-level kernel, compiled once by the warm-up before capture."""
    return default_stream_fixed(x)


ENTRIES = (  # (name, title, hazard, fix)
    ("default_stream", "kernel launched on Numba's default stream", default_stream_hazard,
     default_stream_fixed),
    ("device_array", "cuda.device_array inside the capture", device_array_hazard,
     device_array_fixed),
    ("to_device", "cuda.to_device inside the capture", to_device_hazard, to_device_fixed),
    ("first_compile", "a kernel's first compile inside the capture", first_compile_hazard,
     first_compile_fixed),
)


def entry_args(name: str, fixed: bool, x):
    """The arguments of a Numba entry's hazard or fix for input ``x`` (to_device's fix: the factors
    too)."""
    if name == "to_device" and fixed:
        return (x, torch.full_like(x, 2.0))
    return (x,)
