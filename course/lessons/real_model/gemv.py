"""A batch-1 matrix-vector product (GEMV) in Numba CUDA, as a torch custom op and an ``nn.Linear``.

One warp per output row (coalesced), 16-byte loads (:func:`~course.embedding.kernels.load16`), four
in flight per lane, float32 sums, the warp's sum by shuffles (shared memory on the simulator).
:data:`OP` is ``torch.ops.course.gemv``: ``torch.compile`` keeps it opaque and a CUDA graph captures
it; :class:`GemvLinear` calls it for one row and cuBLAS otherwise.
"""
from __future__ import annotations

import struct

import torch

import course.embedding.lean as lean
from course.core.runtime import cuda as _numba_cuda, runtime
from course.embedding.kernels import load16

cuda = _numba_cuda()
import numba  # noqa: E402  (after the runtime decision, on purpose)

DTYPES = (torch.bfloat16, torch.float32)
ROWS_PER_BLOCK = 4  # warps (rows) per block: 128 threads
WORD_BYTES = 16  # one load16: 8 bfloat16 or 4 float32
# warp shuffles on the GPU; the simulator has none (shared memory instead)
_SHUFFLE = runtime().on_gpu


# ------------------------ bit-level float helpers
# On the GPU: libdevice's bit casts (one instruction each). On the simulator: the same bits through
# struct.

def _f32_py(v):
    return struct.unpack("<f", struct.pack("<I", int(v) & 0xFFFFFFFF))[0]


def _lo_py(v):
    return _f32_py((int(v) & 0xFFFF) << 16)


def _hi_py(v):
    return _f32_py(int(v) & 0xFFFF0000)


def _to_bf16_py(f):
    b = struct.unpack("<I", struct.pack("<f", f))[0]
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF
    return r - 0x10000 if r >= 0x8000 else r


def _make_bit_helpers():
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline=True)
    def f32(v):
        return libdevice.int_as_float(numba.int32(v))

    @cuda.jit(device=True, inline=True)
    def lo(v):  # the bfloat16 in the low half of an int32, as float32
        return libdevice.int_as_float(numba.int32(v << 16))

    @cuda.jit(device=True, inline=True)
    def hi(v):  # the bfloat16 in the high half
        return libdevice.int_as_float(numba.int32(v & -65536))

    @cuda.jit(device=True, inline=True)
    def to_bf16(f):  # float32 -> bfloat16 bits, round to nearest even
        b = numba.int64(libdevice.float_as_int(f))
        return numba.int16((b + 0x7FFF + ((b >> 16) & 1)) >> 16)

    return f32, lo, hi, to_bf16


if runtime().on_gpu:
    _f32, _lo, _hi, _to_bf16 = _make_bit_helpers()
else:
    _f32, _lo, _hi, _to_bf16 = _f32_py, _lo_py, _hi_py, _to_bf16_py


def _dot_bf16(a, b):
    """Dot product of two 16-byte words of 8 bfloat16 each (4 int32 in a tuple), in float32."""
    s = _lo(a[0]) * _lo(b[0]) + _hi(a[0]) * _hi(b[0])
    s += _lo(a[1]) * _lo(b[1]) + _hi(a[1]) * _hi(b[1])
    s += _lo(a[2]) * _lo(b[2]) + _hi(a[2]) * _hi(b[2])
    s += _lo(a[3]) * _lo(b[3]) + _hi(a[3]) * _hi(b[3])
    return s


def _dot_f32(a, b):
    """Dot product of two 16-byte words of 4 float32 each (their int32 bits in a tuple)."""
    return (_f32(a[0]) * _f32(b[0]) + _f32(a[1]) * _f32(b[1]) + _f32(a[2]) * _f32(b[2])
            + _f32(a[3]) * _f32(b[3]))


if runtime().on_gpu:
    _dot_bf16 = cuda.jit(device=True, inline=True)(_dot_bf16)
    _dot_f32 = cuda.jit(device=True, inline=True)(_dot_f32)


# ------------------------ the kernel
def _make_body(dot, store):
    def body(w, x, y):
        """``y[row] = sum_k w[row, k] * x[k]``; ``w`` int32 ``[N, words*4]``, ``x`` int32 ``[1,
        words*4]``."""
        lane = cuda.threadIdx.x
        row = cuda.blockIdx.x * cuda.blockDim.y + cuda.threadIdx.y
        acc = numba.float32(0.0)
        if row < w.shape[0]:  # no early return: every lane takes part in the warp's sum below
            words = w.shape[1] // 4
            j = lane
            while j + 96 < words:  # four 16-byte loads of W in flight before any arithmetic
                a0 = load16(w, row, j)
                a1 = load16(w, row, j + 32)
                a2 = load16(w, row, j + 64)
                a3 = load16(w, row, j + 96)
                acc += dot(a0, load16(x, 0, j)) + dot(a1, load16(x, 0, j + 32))
                acc += dot(a2, load16(x, 0, j + 64)) + dot(a3, load16(x, 0, j + 96))
                j += 128
            while j < words:
                acc += dot(load16(w, row, j), load16(x, 0, j))
                j += 32
        if _SHUFFLE:  # the GPU: the warp adds its 32 partial sums through registers
            for off in (16, 8, 4, 2, 1):
                acc += cuda.shfl_down_sync(0xFFFFFFFF, acc, off)
        else:  # the simulator has no shuffles: the same sum through shared memory
            part = cuda.shared.array((ROWS_PER_BLOCK, 32), numba.float32)
            part[cuda.threadIdx.y, lane] = acc
            cuda.syncthreads()
            if lane == 0:
                for i in range(1, 32):
                    acc += part[cuda.threadIdx.y, i]
        if lane == 0 and row < w.shape[0]:
            store(y, row, acc)
    return body


def _store_bf16(y, row, acc):
    y[row] = _to_bf16(acc)


def _store_f32(y, row, acc):
    y[row] = acc


if runtime().on_gpu:
    _store_bf16 = cuda.jit(device=True, inline=True)(_store_bf16)
    _store_f32 = cuda.jit(device=True, inline=True)(_store_f32)

_KERNELS: dict = {}


def kernel(dtype):
    """The compiled GEMV kernel for ``dtype`` (``torch.bfloat16`` or ``torch.float32``): ``(w, x,
    y)`` int views."""
    if dtype not in DTYPES:
        raise TypeError(f"the GEMV kernel takes {[str(d) for d in DTYPES]}, got {dtype}")
    if dtype not in _KERNELS:
        dot, store = (_dot_bf16, _store_bf16) if dtype == torch.bfloat16 else (_dot_f32, _store_f32)
        _KERNELS[dtype] = cuda.jit(_make_body(dot, store))
    return _KERNELS[dtype]


# ------------------------ the launch
def eligible(x, weight) -> str:
    """Why ``gemv(x, weight)`` cannot run ('' when it can), from shapes and dtypes only: one row
    ``x``, a 2-D ``weight`` of the same dtype (one of :data:`DTYPES`), rows of whole 16-byte
    words."""
    if weight.dim() != 2:
        return f"weight must be 2-D [N, K], got shape {tuple(weight.shape)}"
    k = weight.shape[1]
    if x.shape[-1] != k or x.numel() != k:
        return f"x must be one row of {k} values (batch 1), got shape {tuple(x.shape)}"
    if x.dtype != weight.dtype or weight.dtype not in DTYPES:
        return (f"x and weight must share a dtype among {[str(d) for d in DTYPES]}, got {x.dtype} "
                f"and {weight.dtype}")
    if (k * weight.element_size()) % WORD_BYTES:
        return f"a row of {k} {weight.dtype} is not a whole number of {WORD_BYTES}-byte words"
    return ""


def _words(t, cols):
    return t.view(torch.int32).view(-1, cols)


def gemv(x, weight):
    """``x @ weight.T`` for one row ``x`` (``[..., K]``) and ``weight`` ``[N, K]``, on torch's
    current stream, float32 sums; a ValueError says what to change when :func:`eligible` refuses."""
    why = eligible(x, weight)
    if why:
        raise ValueError(f"gemv: {why}. Use torch.nn.functional.linear for this call.")
    if not weight.is_contiguous() or weight.data_ptr() % WORD_BYTES:
        raise ValueError("gemv: weight must be contiguous and 16-byte aligned (a whole nn.Linear "
                         "weight, or a slice of whole rows of one): pass weight.contiguous()")
    xs = x.reshape(-1)
    if not xs.is_contiguous() or xs.data_ptr() % WORD_BYTES:
        xs = xs.clone()  # a fresh allocation is aligned
    n, k = weight.shape
    cols = k * weight.element_size() // 4
    y = torch.empty(n, dtype=weight.dtype, device=weight.device)
    yv = y.view(torch.int16) if y.dtype == torch.bfloat16 else y
    blocks = (n + ROWS_PER_BLOCK - 1) // ROWS_PER_BLOCK
    lean.launch(kernel(weight.dtype), blocks, (32, ROWS_PER_BLOCK), _words(weight, cols),
                _words(xs, cols), yv)
    return y.view(*x.shape[:-1], n)


def _register():
    if hasattr(torch.ops, "course") and hasattr(torch.ops.course, "gemv"):
        return torch.ops.course.gemv

    @torch.library.custom_op("course::gemv", mutates_args=())
    def op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return gemv(x, weight)

    @op.register_fake
    def _(x, weight):
        return x.new_empty((*x.shape[:-1], weight.shape[0]))

    return torch.ops.course.gemv


OP = _register()


def linear(x, weight, bias=None):
    """``F.linear(x, weight, bias)`` through :data:`OP` when :func:`eligible` allows it, else cuBLAS
    (decided from shapes and dtypes: fixed per shape under ``torch.compile`` and in a graph)."""
    if eligible(x, weight):
        return torch.nn.functional.linear(x, weight, bias)
    y = OP(x, weight)
    return y if bias is None else y + bias


class GemvLinear(torch.nn.Linear):
    """An ``nn.Linear`` that calls the course's GEMV (``torch.ops.course.gemv``) for a single-row
    input, else cuBLAS."""

    def forward(self, x):
        """:func:`linear` with this layer's weight and bias."""
        return linear(x, self.weight, self.bias)


def linear_shapes(model) -> list:
    """The distinct ``(N, K)`` weight shapes of the model's linear layers, with how many layers
    share each."""
    seen: dict = {}
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear):
            shape = tuple(mod.weight.shape)
            seen[shape] = seen.get(shape, 0) + 1
    return [(n, k, count) for (n, k), count in seen.items()]
