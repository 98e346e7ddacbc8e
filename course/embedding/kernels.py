"""The embedding lookup in Numba CUDA: the naive and the fast gather kernels, their word views and
launch shapes (the launch function is :mod:`~course.embedding.lookup`, the checks
:mod:`~course.embedding.cases`).

A lookup is a gather, ``out[..., :] = weight[ids[...], :]``: a byte copy, so its speed is memory
bandwidth. **naive**: one thread per output element. **fast**: a row of threads per row, wide words
(up to 16 bytes), 4 loads in flight per thread, a grid-stride loop over rows. Both take ``(ids,
weight, out, err)``: flat ids, 2-D integer views of the table and the output, and the error flag
``err``.

Out-of-range ids (``bounds=``): ``"host"`` reads min and max on the host (exact, but a sync on a GPU
and not capturable); ``"device"`` writes a zero row and records the bad id in ``err``, read later by
:func:`check_errors` (asynchronous, capturable); ``"auto"``: host on the simulator outside a
capture, device on a GPU. Launches go on :func:`course.numba_stream` (torch's current stream), so a
GPU capture records them; on the simulator every thread runs in Python: keep sizes tiny.
"""
from __future__ import annotations

import math
from functools import lru_cache

import torch

from course.core.runtime import cuda as _numba_cuda, runtime

cuda = _numba_cuda()  # numba.cuda in the mode the runtime chose (simulator or GPU)
import numba  # noqa: E402  (after the runtime decision, on purpose)

# Small lookups launch small grids on purpose; Numba's low-occupancy warning is noise here.
try:
    from numba.cuda.core import config as _numba_cuda_config
except ImportError:  # pragma: no cover - older layouts
    _numba_cuda_config = numba.config
_numba_cuda_config.CUDA_LOW_OCCUPANCY_WARNINGS = 0

IMPLS = ("fast", "naive")
BOUNDS = ("auto", "host", "device")
ID_DTYPES = (torch.int32, torch.int64)
WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
WORD_BYTES = (16, 8, 4, 2, 1)
INT64_MAX = 2**63 - 1
UNROLL = 4  # words per thread in flight in the fast kernel
BLOCKS_PER_SM = None  # optional grid cap of the fast kernel (None: a block for every group of rows)

_WORD_DTYPE = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


class EmbeddingIndexError(IndexError):
    """Some ids were outside ``[0, num_embeddings)``; the message says which and what to do."""


# --------------------------------------------------------------------------- 16-byte words
# Numba has no 16-byte vector loads for array elements, and it tells LLVM only that an
# element is aligned to its own size, so four neighbouring int32 loads stay four loads.
# These two tiny intrinsics load/store four int32 as ONE 16-byte access
# (ld.global.v4.u32 / st.global.v4.u32). The caller guarantees 16-byte alignment.
# On the simulator they are plain Python.

def _load16_py(ary, row, col):
    c = 4 * col
    return (ary[row, c], ary[row, c + 1], ary[row, c + 2], ary[row, c + 3])


def _store16_py(ary, row, col, val):
    c = 4 * col
    ary[row, c] = val[0]
    ary[row, c + 1] = val[1]
    ary[row, c + 2] = val[2]
    ary[row, c + 3] = val[3]


def _make_intrinsics():
    from llvmlite import ir
    from numba.core import cgutils, types
    from numba.core.extending import intrinsic

    vec = ir.VectorType(ir.IntType(32), 4)
    quad = types.UniTuple(types.int32, 4)

    def _check(ary):
        if not (isinstance(ary, types.Array) and ary.ndim == 2 and ary.dtype == types.int32):
            raise numba.core.errors.TypingError("load16/store16 need a 2-D int32 array")

    def _pointer(context, builder, sig, args):
        aryty, rowty, colty = sig.args[:3]
        ary, row, col = args[:3]
        arr = context.make_array(aryty)(context, builder, ary)
        row = context.cast(builder, row, rowty, types.intp)
        col = builder.mul(context.cast(builder, col, colty, types.intp), ir.Constant(row.type, 4))
        ptr = cgutils.get_item_pointer(context, builder, aryty, arr, [row, col], wraparound=False)
        return builder.bitcast(ptr, vec.as_pointer())

    @intrinsic
    def load16(typingctx, ary, row, col):
        _check(ary)

        def codegen(context, builder, sig, args):
            v = builder.load(_pointer(context, builder, sig, args), align=16)
            items = [builder.extract_element(v, ir.Constant(ir.IntType(32), i)) for i in range(4)]
            return context.make_tuple(builder, quad, items)
        return quad(ary, row, col), codegen

    @intrinsic
    def store16(typingctx, ary, row, col, val):
        _check(ary)

        def codegen(context, builder, sig, args):
            v = ir.Constant(vec, ir.Undefined)
            for i in range(4):
                v = builder.insert_element(v, builder.extract_value(args[3], i), ir.Constant(ir.IntType(32), i))
            builder.store(v, _pointer(context, builder, sig, args), align=16)
            return context.get_dummy_value()
        return types.void(ary, row, col, quad), codegen

    return load16, store16


if runtime().on_gpu:
    load16, store16 = _make_intrinsics()
else:
    load16, store16 = _load16_py, _store16_py


# --------------------------------------------------------------------------- kernel bodies
# Plain Python functions; compiled with cuda.jit on first use (see naive_kernel / fast_kernel).

def _naive_body(ids, weight, out, err):
    """One thread per output element: out[n, d] = weight[ids[n], d]."""
    i = cuda.grid(1)
    dim = weight.shape[1]
    if i < out.shape[0] * dim:
        n = i // dim
        d = i - n * dim
        idx = ids[n]
        if idx >= 0 and idx < weight.shape[0]:
            out[n, d] = weight[idx, d]
        else:
            out[n, d] = 0
            if d == 0:  # one report per bad id
                cuda.atomic.add(err, 0, 1)
                cuda.atomic.min(err, 1, numba.int64(n))
                err[2] = idx
                err[3] = weight.shape[0]


def _fast_body(ids, weight, out, err):
    """Rows of threads copy rows of words; 4 loads in flight per thread; grid-stride over rows."""
    n_rows = out.shape[0]
    vocab = weight.shape[0]
    words = weight.shape[1]
    tx = cuda.threadIdx.x
    bx = cuda.blockDim.x
    row = numba.int64(cuda.blockIdx.x) * cuda.blockDim.y + cuda.threadIdx.y
    step = numba.int64(cuda.gridDim.x) * cuda.blockDim.y
    while row < n_rows:
        idx = ids[row]
        if idx >= 0 and idx < vocab:
            j = tx
            while j + 3 * bx < words:
                a = weight[idx, j]
                b = weight[idx, j + bx]
                c = weight[idx, j + 2 * bx]
                d = weight[idx, j + 3 * bx]
                out[row, j] = a
                out[row, j + bx] = b
                out[row, j + 2 * bx] = c
                out[row, j + 3 * bx] = d
                j += 4 * bx
            while j < words:
                out[row, j] = weight[idx, j]
                j += bx
        else:
            if tx == 0:
                cuda.atomic.add(err, 0, 1)
                cuda.atomic.min(err, 1, row)
                err[2] = idx
                err[3] = vocab
            j = tx
            while j < words:
                out[row, j] = 0
                j += bx
        row += step


def _fast16_body(ids, weight, out, err):
    """As _fast_body, but each word is 16 bytes (4 int32 moved by one load16/store16)."""
    n_rows = out.shape[0]
    vocab = weight.shape[0]
    words = weight.shape[1] // 4
    tx = cuda.threadIdx.x
    bx = cuda.blockDim.x
    row = numba.int64(cuda.blockIdx.x) * cuda.blockDim.y + cuda.threadIdx.y
    step = numba.int64(cuda.gridDim.x) * cuda.blockDim.y
    while row < n_rows:
        idx = ids[row]
        if idx >= 0 and idx < vocab:
            j = tx
            while j + 3 * bx < words:
                a = load16(weight, idx, j)
                b = load16(weight, idx, j + bx)
                c = load16(weight, idx, j + 2 * bx)
                d = load16(weight, idx, j + 3 * bx)
                store16(out, row, j, a)
                store16(out, row, j + bx, b)
                store16(out, row, j + 2 * bx, c)
                store16(out, row, j + 3 * bx, d)
                j += 4 * bx
            while j < words:
                store16(out, row, j, load16(weight, idx, j))
                j += bx
        else:
            if tx == 0:
                cuda.atomic.add(err, 0, 1)
                cuda.atomic.min(err, 1, row)
                err[2] = idx
                err[3] = vocab
            j = tx
            while j < out.shape[1]:
                out[row, j] = 0
                j += bx
        row += step


@lru_cache(maxsize=None)
def naive_kernel():
    """The compiled naive kernel ``(ids, weight, out, err)``: one thread per output element.

    ``ids``: 1-D int32/int64; ``weight`` [V, D] and ``out`` [N, D]: same-size integer views
    (a gather is a byte copy); ``err``: the int64[4] error flag (see :func:`error_flag`).
    """
    return cuda.jit(_naive_body)


@lru_cache(maxsize=None)
def fast_kernel(word_bytes: int = 8):
    """The compiled fast kernel ``(ids, weight, out, err)`` for words of ``word_bytes``.

    ``weight`` and ``out`` are 2-D views in words (:func:`as_words`); for 16-byte words
    they are int32 views moved four at a time with one 16-byte load and store.
    """
    if word_bytes not in WORD_BYTES:
        raise ValueError(f"word_bytes must be one of {WORD_BYTES}, got {word_bytes!r}")
    return cuda.jit(_fast16_body if word_bytes == 16 else _fast_body)


# --------------------------------------------------------------------------- host helpers

def as_words(t: torch.Tensor, word_bytes: int) -> torch.Tensor:
    """View a contiguous 2-D tensor as rows of ``word_bytes``-byte integer words (no copy).

    16-byte words are returned as an int32 view (four int32 per word), which is what the
    16-byte kernel expects. Raises ValueError when a row is not a whole number of words.
    """
    if t.dim() != 2 or not t.is_contiguous():
        raise ValueError(f"as_words needs a contiguous 2-D tensor, got shape {tuple(t.shape)}, "
                         f"strides {t.stride()}")
    row_bytes = t.shape[1] * t.element_size()
    if word_bytes not in WORD_BYTES or row_bytes % word_bytes:
        raise ValueError(f"a row of {row_bytes} bytes is not a "
                         f"whole number of {word_bytes}-byte words")
    if t.data_ptr() % word_bytes:
        raise ValueError(f"this tensor's data is not aligned to {word_bytes} bytes")
    t = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    return t.view(torch.int32 if word_bytes == 16 else _WORD_DTYPE[word_bytes])


def element_view(t: torch.Tensor) -> torch.Tensor:
    """The same-size integer view of a float tensor (float32 -> int32, float16/bfloat16 -> int16).
    """
    return t.view({4: torch.int32, 2: torch.int16, 8: torch.int64, 1: torch.uint8}[t.element_size()])


def pick_word_bytes(row_bytes: int, *tensors) -> int:
    """The widest word (16, 8, 4, 2 or 1 bytes) that divides a row and every tensor's start address.
    """
    for wb in WORD_BYTES:
        if row_bytes % wb == 0 and all(t.data_ptr() % wb == 0 for t in tensors):
            return wb
    return 1


@lru_cache(maxsize=1)
def _sm_count() -> int:
    if runtime().on_gpu:
        return torch.cuda.get_device_properties(0).multi_processor_count
    return 1


def launch_config(impl: str, n_rows: int, words: int) -> tuple:
    """(blocks, threads) for a launch: naive, one thread per element, 256 a block (32 on the
    simulator); fast, (x, y) with ``x`` threads along a row (``UNROLL`` words each) and ``y`` rows a
    block, a block per ``y`` rows (fastest on an H100), capped by ``BLOCKS_PER_SM`` (and at 4 blocks
    on the simulator)."""
    per_block = 256 if runtime().on_gpu else 32
    if impl == "naive":
        total = n_rows * words
        return max(1, math.ceil(total / per_block)), per_block
    if impl != "fast":
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    x = 1
    while x < per_block and x * UNROLL < words:
        x *= 2
    y = per_block // x
    cap = (BLOCKS_PER_SM * _sm_count() if BLOCKS_PER_SM else 2**31 - 1) if runtime().on_gpu else 4
    blocks = max(1, min(math.ceil(n_rows / y), cap))
    return blocks, (x, y)


