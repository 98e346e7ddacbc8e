"""Embedding lookup in Numba CUDA: the kernels, one validated launch function, and the checks.

An embedding lookup is a gather: ``out[..., :] = weight[ids[...], :]``. It does no
arithmetic, so it is exact for any dtype when it copies bytes, and its speed is set by
memory bandwidth alone.

Two kernels:

- **naive**: one thread per output element. Simple, but every thread does an integer
  division, moves 2 or 4 bytes, and there is one thread per element.
- **fast**: rows are handled by rows of threads (a block holds one or several rows),
  each thread copies wide words (up to 16 bytes: the row is viewed as ``int64``,
  ``int32``, ... words, or as groups of four ``int32`` moved with one 16-byte load and
  store), the loop is unrolled so several loads are in flight, and a grid-stride loop
  over rows keeps a fixed number of blocks busy.

Both take ``(ids, weight, out, err)``: flat ids, the table and the output as 2-D integer
views (a gather is a byte copy, so bfloat16 travels as int16 and a row of floats can
travel as int64 words), and the **error flag** ``err`` (4 int64).

Out-of-range ids, two ways to catch them (``bounds=``):

- ``"host"``: read the ids' min and max on the host before launching. The error is
  immediate and exact, but on a GPU it is a device-to-host copy: the host waits for
  the GPU on every call, and the call cannot be captured in a CUDA graph.
- ``"device"``: the kernel never reads out of bounds; for a bad id it writes a zero row
  and records the bad id in ``err`` (count, first flat position, a value, table size).
  Nothing waits, so the call stays asynchronous and can be captured; the price is that
  you learn about the error later, when you call :func:`check_errors` (one sync, e.g.
  after a step or after a replay).
- ``"auto"`` (default): ``"host"`` on the simulator (the ids are already on the host, the
  check is free) and ``"device"`` on a GPU.

(``torch.nn.functional.embedding`` uses a device-side assert instead: it stops the
kernel, and the CUDA context is unusable afterwards.)

Everything launches on :func:`course.numba_stream` (torch's current stream) with
:func:`course.as_numba` views, so on a GPU the launch is ordered with torch's work and
is captured by ``torch.cuda.graph``. On the simulator every thread runs in Python: keep
sizes tiny there.
"""
from __future__ import annotations

import math
from functools import lru_cache

import torch
import torch.nn.functional as F

from .checks import close
from .runtime import as_numba, cuda as _numba_cuda, numba_stream, runtime

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
        raise ValueError(f"a row of {row_bytes} bytes is not a whole number of {word_bytes}-byte words")
    if t.data_ptr() % word_bytes:
        raise ValueError(f"this tensor's data is not aligned to {word_bytes} bytes")
    t = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    return t.view(torch.int32 if word_bytes == 16 else _WORD_DTYPE[word_bytes])


def element_view(t: torch.Tensor) -> torch.Tensor:
    """The same-size integer view of a float tensor (float32 -> int32, float16/bfloat16 -> int16)."""
    return t.view({4: torch.int32, 2: torch.int16, 8: torch.int64, 1: torch.uint8}[t.element_size()])


def pick_word_bytes(row_bytes: int, *tensors) -> int:
    """The widest word (16, 8, 4, 2 or 1 bytes) that divides a row and every tensor's start address."""
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
    """(blocks, threads) for a launch: ``threads`` is an int (naive) or (x, y) (fast).

    naive: one thread per element, 256 per block (32 on the simulator).
    fast: ``x`` threads along a row (enough for ``UNROLL`` words each, at most 256),
    ``y`` rows per block so a block has 256 threads (32 on the simulator), one block per
    ``y`` rows (measured fastest on an H100: capping the grid at 4-32 blocks per SM and
    looping cost 1-5 %); ``BLOCKS_PER_SM`` caps the grid, and the kernel's grid-stride
    loop then covers the remaining rows. The simulator uses at most 4 blocks.
    """
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


def _capturing() -> bool:
    return runtime().on_gpu and torch.cuda.is_current_stream_capturing()


# --------------------------------------------------------------------------- the error flag
_FLAGS: dict = {}


def error_flag(device=None) -> torch.Tensor:
    """The int64[4] error flag kernels write: [bad-id count, first bad flat position, a bad value, table size].

    One flag per device, created on first use (outside a capture: run a lookup once
    before capturing, which warm-up does anyway).
    """
    dev = torch.device(device) if device is not None else torch.device(runtime().device)
    key = str(dev)
    flag = _FLAGS.get(key)
    if flag is None:
        if _capturing():
            raise RuntimeError("The embedding error flag does not exist yet and cannot be created during "
                               "CUDA graph capture: run the lookup once before capturing (warm-up).")
        flag = _FLAGS[key] = torch.tensor([0, INT64_MAX, 0, 0], dtype=torch.int64, device=dev)
    return flag


def reset_errors(device=None) -> None:
    """Clear the error flag (queued on the current stream; no sync)."""
    flag = error_flag(device)
    flag.zero_()
    flag[1].fill_(INT64_MAX)


def check_errors(*, reset: bool = True, device=None) -> int:
    """Raise :class:`EmbeddingIndexError` if any kernel since the last check saw out-of-range ids.

    Reads the flag on the host: one sync, so call it when you can afford one (after a
    training step, after ``graph.replay()``), never inside a captured region. Returns 0
    when there was no error. ``reset`` clears the flag before raising.
    """
    if _capturing():
        raise RuntimeError("check_errors() reads the error flag on the host (a sync), which is not allowed "
                           "during CUDA graph capture: call it after the capture, e.g. after graph.replay().")
    flag = error_flag(device)
    count, pos, value, vocab = flag.tolist()
    if count == 0:
        return 0
    if reset:
        reset_errors(device)
    where = f"the first at flat position {pos}" if pos != INT64_MAX else "position not recorded"
    raise EmbeddingIndexError(
        f"{count} id(s) were out of range for an embedding table with {vocab} rows ({where}; one bad value: "
        f"{value}). Valid ids are 0..{vocab - 1}. Their output rows were written as zeros. Fix the ids "
        "(tokenizer and vocabulary size disagree?) or mask them before the lookup.")


# --------------------------------------------------------------------------- validation

def validate(ids, weight, padding_idx=None, out=None):
    """Check the arguments of a lookup; raise TypeError/ValueError saying what to do. Returns padding_idx.

    ``padding_idx`` is normalised like PyTorch (a negative value counts from the end).
    Out-of-range ids are not checked here (see ``bounds=`` in :func:`embedding`).
    """
    if not isinstance(ids, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError(f"ids and weight must be torch tensors, got {type(ids).__name__} and "
                        f"{type(weight).__name__}: wrap them with torch.as_tensor(..., device=course.device()).")
    if ids.dtype not in ID_DTYPES:
        raise TypeError(f"ids must be integer token ids (torch.int32 or torch.int64), got {ids.dtype}: "
                        "convert them with ids.long() (or ids.int()).")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [num_embeddings, embedding_dim], got shape {tuple(weight.shape)}: "
                         "reshape the table to one row per token.")
    if weight.dtype not in WEIGHT_DTYPES:
        raise TypeError(f"weight must be float32, float16 or bfloat16, got {weight.dtype}: "
                        "convert it once with weight.float() (or .half() / .bfloat16()).")
    if not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous (its strides are {weight.stride()}): make it contiguous "
                         "once, outside the hot loop, with weight = weight.contiguous().")
    want = torch.device(runtime().device)
    for name, t in (("ids", ids), ("weight", weight)):
        if t.device.type != want.type:
            raise ValueError(f"{name} is on {t.device}, but the course runs on {want}: create it with "
                             f"device=course.device() or move it once with .to(course.device()) "
                             "(never inside a captured region).")
    if padding_idx is not None:
        if isinstance(padding_idx, bool) or not isinstance(padding_idx, int):
            raise TypeError(f"padding_idx must be an int or None, got {padding_idx!r}")
        vocab = weight.shape[0]
        if not -vocab <= padding_idx < vocab:
            raise ValueError(f"padding_idx={padding_idx} is outside the table of {vocab} rows: use a value in "
                             f"[{-vocab}, {vocab - 1}] (or None).")
        padding_idx = padding_idx + vocab if padding_idx < 0 else padding_idx
    if out is not None:
        shape = (*ids.shape, weight.shape[1])
        if (not isinstance(out, torch.Tensor) or tuple(out.shape) != shape or out.dtype != weight.dtype
                or out.device != weight.device or not out.is_contiguous()):
            got = (f"shape {tuple(out.shape)}, {out.dtype} on {out.device}" if isinstance(out, torch.Tensor)
                   else type(out).__name__)
            raise ValueError(f"out must be a contiguous {weight.dtype} tensor of shape {shape} on {weight.device}; "
                             f"got {got}. Allocate it with torch.empty({shape}, dtype=weight.dtype, "
                             "device=weight.device).")
    return padding_idx


def host_bounds_check(ids: torch.Tensor, num_embeddings: int) -> None:
    """Raise :class:`EmbeddingIndexError` now if any id is outside ``[0, num_embeddings)``.

    Reads two numbers on the host: on a GPU that waits for the GPU (a sync) and cannot
    be captured.
    """
    if ids.numel() == 0:
        return
    if _capturing():
        raise RuntimeError("bounds='host' reads the ids on the host (a device-to-host copy), which cannot be "
                           "captured in a CUDA graph: use bounds='device' and call check_errors() after replay.")
    lo, hi = torch.stack(torch.aminmax(ids.reshape(-1))).tolist()
    if lo >= 0 and hi < num_embeddings:
        return
    bad = (ids < 0) | (ids >= num_embeddings)
    first = tuple(int(i) for i in bad.nonzero()[0])
    raise EmbeddingIndexError(
        f"ids{list(first)} = {int(ids[first])} is out of range for an embedding table with {num_embeddings} rows "
        f"({int(bad.sum())} id(s) out of range; valid ids are 0..{num_embeddings - 1}). Fix the ids "
        "(tokenizer and vocabulary size disagree?) or mask them before the lookup.")


# --------------------------------------------------------------------------- the launch

def embedding(ids, weight, padding_idx=None, impl: str = "fast", *, bounds: str = "auto",
              out=None, word_bytes=None):
    """``F.embedding(ids, weight, padding_idx)`` (forward) computed by a Numba CUDA kernel.

    ``ids``: int32/int64 of any shape (non-contiguous is fine); ``weight``: contiguous
    [V, D] float32/float16/bfloat16; returns ``[*ids.shape, D]`` in ``weight.dtype``
    (written into ``out`` if given). ``padding_idx`` is validated like PyTorch's; as in
    PyTorch it only matters for gradients, so the forward returns that row as stored.
    ``impl``: "fast" or "naive". ``bounds``: "auto", "host" or "device" (module docstring).
    ``word_bytes``: force the fast kernel's word size (default: the widest that fits).
    The launch goes on :func:`course.numba_stream` and does not wait for the GPU unless
    ``bounds="host"``.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if bounds not in BOUNDS:
        raise ValueError(f"bounds must be one of {BOUNDS}, got {bounds!r}")
    validate(ids, weight, padding_idx, out)
    vocab, dim = weight.shape
    if out is None:
        out = torch.empty((*ids.shape, dim), dtype=weight.dtype, device=weight.device)
    if bounds == "host" or (bounds == "auto" and not runtime().on_gpu):
        host_bounds_check(ids, vocab)
    flat = ids.contiguous().view(-1)  # no copy when ids are contiguous, else a (capturable) device copy
    n = flat.numel()
    if n == 0 or dim == 0:
        return out
    err = error_flag(weight.device)
    out2 = out.view(n, dim)
    if impl == "naive":
        w, o = element_view(weight), element_view(out2)
        blocks, threads = launch_config("naive", n, dim)
        kernel = naive_kernel()
    else:
        row_bytes = dim * weight.element_size()
        wb = word_bytes or pick_word_bytes(row_bytes, weight, out2)
        w, o = as_words(weight, wb), as_words(out2, wb)
        blocks, threads = launch_config("fast", n, w.shape[1] // (4 if wb == 16 else 1))
        kernel = fast_kernel(wb)
    kernel[blocks, threads, numba_stream()](as_numba(flat), as_numba(w), as_numba(o), as_numba(err))
    return out


# --------------------------------------------------------------------------- checks

def lookup_cases(*, padding: bool = True, seed=None) -> list:
    """Fresh random lookups covering dtypes, id dtypes, batch shapes, padding_idx and strided ids.

    Each case is a dict with ``desc``, ``ids``, ``weight`` and ``padding_idx``. Sizes are
    tiny on the simulator and moderate on a GPU.
    """
    gen = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
    dev = torch.device(runtime().device)
    big = runtime().on_gpu
    vocab = 1000 if big else 11

    def table(dim, dtype):
        return torch.randn(vocab, dim, generator=gen).to(dtype).to(dev)

    def idx(*shape, dtype=torch.int64):
        return torch.randint(0, vocab, shape, generator=gen).to(dtype).to(dev)

    d = (lambda small, large: large if big else small)
    cases = [
        dict(desc="float32 weight, int64 ids of shape [N]", ids=idx(d(6, 500)),
             weight=table(d(8, 256), torch.float32)),
        dict(desc="float16 weight, int32 ids of shape [B, T]", ids=idx(2, d(3, 77), dtype=torch.int32),
             weight=table(d(6, 96), torch.float16)),
        dict(desc="bfloat16 weight, int64 ids of shape [A, B, T]", ids=idx(2, 2, d(2, 33)),
             weight=table(d(8, 4096), torch.bfloat16)),
        dict(desc="bfloat16 weight with an odd dim (rows of 6 bytes), int32 ids",
             ids=idx(d(5, 129), dtype=torch.int32), weight=table(3, torch.bfloat16)),
        dict(desc="float32 weight, non-contiguous int64 ids (a transposed view)",
             ids=idx(d(3, 40), d(2, 17)).t(), weight=table(d(4, 100), torch.float32)),
        dict(desc="float16 weight, non-contiguous int32 ids (every other column)",
             ids=idx(2, d(6, 64), dtype=torch.int32)[:, ::2], weight=table(d(8, 64), torch.float16)),
        dict(desc="float32 weight, a single 0-d id", ids=idx(), weight=table(d(5, 33), torch.float32)),
    ]
    if padding:
        ids = idx(3, d(2, 50), dtype=torch.int32)
        ids[0, 0] = 3
        cases.append(dict(desc="float32 weight, int32 ids, padding_idx=3 (row 3 is not zero: the forward "
                               "returns it as stored)", ids=ids, weight=table(d(8, 128), torch.float32),
                          padding_idx=3))
    for c in cases:
        c.setdefault("padding_idx", None)
    return cases


def check_lookup(fn, *, padding: bool = True, seed=None) -> list:
    """Compare ``fn(ids, weight)`` with ``F.embedding`` on :func:`lookup_cases`; exact match required.

    The padding case calls ``fn(ids, weight, padding_idx=...)`` (skip it with
    ``padding=False``). Raises AssertionError naming the case that differs; returns the
    list of case descriptions that passed.
    """
    passed = []
    for c in lookup_cases(padding=padding, seed=seed):
        kw = {} if c["padding_idx"] is None else {"padding_idx": c["padding_idx"]}
        got = fn(c["ids"], c["weight"], **kw)
        assert isinstance(got, torch.Tensor), f"{c['desc']}: expected a tensor, got {type(got).__name__}"
        want = F.embedding(c["ids"], c["weight"], **kw)
        close(got, want, rtol=0, atol=0, what=f"[{c['desc']}] output")
        passed.append(c["desc"])
    return passed


def reject_cases(*, padding: bool = True) -> list:
    """Bad inputs and the exception each must raise: (desc, args, kwargs, exception type)."""
    dev = torch.device(runtime().device)
    w = torch.randn(7, 4, device=dev)
    ids = torch.tensor([1, 2, 3], device=dev)
    cases = [
        ("float ids", (ids.float(), w), {}, TypeError),
        ("1-D weight", (ids, w[0]), {}, ValueError),
        ("3-D weight", (ids, w.view(7, 2, 2)), {}, ValueError),
        ("integer weight", (ids, w.long()), {}, TypeError),
        ("an id equal to num_embeddings", (torch.tensor([0, 7, 1], device=dev), w), {}, IndexError),
        ("a negative id", (torch.tensor([[0, 1], [-1, 2]], device=dev), w), {}, IndexError),
    ]
    if runtime().on_gpu:
        cases.append(("ids on the CPU, weight on the GPU", (ids.cpu(), w), {}, ValueError))
    if padding:
        cases.append(("padding_idx outside the table", (ids, w), {"padding_idx": 7}, ValueError))
    return cases


def check_rejects(fn, *, padding: bool = True, after=None) -> list:
    """Check that ``fn`` rejects each of :func:`reject_cases` with the right exception and a message.

    ``after`` (default :func:`check_errors`) runs right after ``fn`` returns, so errors a
    kernel reports through the error flag count too. Returns "case: Error: message" lines.
    """
    after = check_errors if after is None else after
    reset_errors()
    lines = []
    for desc, args, kw, exc in reject_cases(padding=padding):
        try:
            fn(*args, **kw)
            after()
        except exc as e:
            msg = str(e)
            assert len(msg) >= 20, f"{desc}: raised {type(e).__name__} with a message too short to act on: {msg!r}"
            lines.append(f"{desc}: {type(e).__name__}: {msg}")
            continue
        except NotImplementedError:
            raise
        except Exception as e:  # noqa: BLE001 - report the wrong type
            raise AssertionError(f"{desc}: expected {exc.__name__}, got {type(e).__name__}: {e}") from None
        raise AssertionError(f"{desc}: expected {exc.__name__}, but the call returned normally")
    return lines


def fallback(fn, reference, what: str):
    """Wrap ``fn`` so that, while it still raises NotImplementedError, ``reference`` is used instead.

    Lets the cells after an unfinished exercise run: prints a note the first time.
    """
    told = []

    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except NotImplementedError:
            if not told:
                print(f"note: {what} is not done yet, so this uses the course's reference version.")
                told.append(True)
            return reference(*args, **kwargs)
    call.__name__ = getattr(fn, "__name__", "call")
    call.__doc__ = fn.__doc__
    return call
