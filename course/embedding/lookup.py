"""The embedding lookup: one validated launch function, and its error flag.

:func:`embedding` validates its arguments (:func:`validate`), picks the kernel and word size
(:mod:`course.embedding.kernels`), and launches on torch's current stream. Out-of-range ids are
caught on the host (``bounds="host"``) or recorded on the device in an error flag
(``bounds="device"``: :func:`error_flag`, :func:`check_errors`, :func:`reset_errors`), so a
device-bounds call never waits for the GPU and can be captured.
"""
from __future__ import annotations

import torch

from course.core.runtime import as_numba, capturing, numba_stream, runtime
import course.embedding.lean as lean
from course.embedding.kernels import (IMPLS, BOUNDS, ID_DTYPES, WEIGHT_DTYPES, INT64_MAX, EmbeddingIndexError, as_words,
                                      element_view, fast_kernel, launch_config, naive_kernel, pick_word_bytes)


def _capturing() -> bool:
    return capturing()


LEAN = True  # launch through course.embedding.lean (False: the plain Numba launch, for comparison)

# --------------------------------------------------------------------------- the error flag
_FLAGS: dict = {}


def error_flag(device=None) -> torch.Tensor:
    """The int64[4] error flag kernels write: [bad-id count, first bad flat position, a bad value,
    table size].

    One flag per device, created on first use (outside a capture: run a lookup once
    before capturing, which warm-up does anyway).
    """
    dev = torch.device(device) if device is not None else torch.device(runtime().device)
    key = str(dev)
    flag = _FLAGS.get(key)
    if flag is None:
        if _capturing():
            raise RuntimeError("The embedding error flag does not exist yet and "
                               "cannot be created during CUDA graph capture: run "
                               "the lookup once before capturing (warm-up).")
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
        raise RuntimeError("check_errors() reads the error flag on the host (a "
                           "sync), which is not allowed during CUDA graph capture: "
                           "call it after the capture, e.g. after graph.replay().")
    flag = error_flag(device)
    count, pos, value, vocab = flag.tolist()
    if count == 0:
        return 0
    if reset:
        reset_errors(device)
    where = f"the first at flat position {pos}" if pos != INT64_MAX else "position not recorded"
    if vocab > 0:  # the kernel recorded the table size (and a bad value with it)
        what = (f"for an embedding table with {vocab} rows ({where}; one bad value: {value}). "
                f"Valid ids are 0..{vocab - 1}. Their output rows were written as zeros.")
    else:  # a kernel that only counts (lab 1's kernels): no table size, no value
        what = f"({where}; the kernel that saw them did not record the table size or a bad value)."
    raise EmbeddingIndexError(
        f"{count} id(s) were out of range {what} Fix the ids (tokenizer "
        "and vocabulary size disagree?) or mask them before the lookup.")


# --------------------------------------------------------------------------- validation

def validate(ids, weight, padding_idx=None, out=None):
    """Check the arguments of a lookup; raise TypeError/ValueError saying what to do. Returns
    padding_idx.

    ``padding_idx`` is normalised like PyTorch (a negative value counts from the end).
    Out-of-range ids are not checked here (see ``bounds=`` in :func:`embedding`).
    """
    if not isinstance(ids, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError("ids and weight must be torch tensors, got "
                        f"{type(ids).__name__} and {type(weight).__name__}: wrap them "
                        "with torch.as_tensor(..., device=course.device()).")
    if ids.dtype not in ID_DTYPES:
        raise TypeError("ids must be integer token ids (torch.int32 or torch.int64), "
                        f"got {ids.dtype}: convert them with ids.long() (or ids.int()).")
    if weight.dim() != 2:
        raise ValueError("weight must be 2-D [num_embeddings, embedding_dim], got shape "
                         f"{tuple(weight.shape)}: reshape the table to one row per token.")
    if weight.dtype not in WEIGHT_DTYPES:
        raise TypeError(f"weight must be float32, float16 or bfloat16, got {weight.dtype}: "
                        "convert it once with weight.float() (or .half() / .bfloat16()).")
    if not weight.is_contiguous():
        raise ValueError("weight must be contiguous (its strides are "
                         f"{weight.stride()}): make it contiguous once, outside the "
                         "hot loop, with weight = weight.contiguous().")
    want = torch.device(runtime().device)
    for name, t in (("ids", ids), ("weight", weight)):
        if t.device.type != want.type:
            raise ValueError(f"{name} is on {t.device}, but the course runs on {want}: "
                             "create it with device=course.device() or move it once with "
                             ".to(course.device()) (never inside a captured region).")
    if padding_idx is not None:
        if isinstance(padding_idx, bool) or not isinstance(padding_idx, int):
            raise TypeError(f"padding_idx must be an int or None, got {padding_idx!r}")
        vocab = weight.shape[0]
        if not -vocab <= padding_idx < vocab:
            raise ValueError(f"padding_idx={padding_idx} is outside the table of {vocab} "
                             f"rows: use a value in [{-vocab}, {vocab - 1}] (or None).")
        padding_idx = padding_idx + vocab if padding_idx < 0 else padding_idx
    if out is not None:
        shape = (*ids.shape, weight.shape[1])
        if (not isinstance(out, torch.Tensor) or tuple(out.shape) != shape or out.dtype != weight.dtype
                or out.device != weight.device or not out.is_contiguous()):
            got = (f"shape {tuple(out.shape)}, {out.dtype} "
                   f"on {out.device}" if isinstance(out, torch.Tensor)
                   else type(out).__name__)
            raise ValueError(f"out must be a contiguous {weight.dtype} tensor of shape "
                             f"{shape} on {weight.device}; got {got}. Allocate it with "
                             f"torch.empty({shape}, dtype=weight.dtype, device=weight.device).")
    return padding_idx


def host_bounds_check(ids: torch.Tensor, num_embeddings: int) -> None:
    """Raise :class:`EmbeddingIndexError` now if any id is outside ``[0, num_embeddings)``.

    Reads two numbers on the host: on a GPU that waits for the GPU (a sync) and cannot
    be captured.
    """
    if ids.numel() == 0:
        return
    if _capturing():
        raise RuntimeError("bounds='host' reads the ids on the host (a device-to-host "
                           "copy), which cannot be captured in a CUDA graph: use "
                           "bounds='device' and call check_errors() after replay.")
    lo, hi = torch.stack(torch.aminmax(ids.reshape(-1))).tolist()
    if lo >= 0 and hi < num_embeddings:
        return
    bad = (ids < 0) | (ids >= num_embeddings)
    first = tuple(int(i) for i in bad.nonzero()[0])
    raise EmbeddingIndexError(
        f"ids{list(first)} = {int(ids[first])} is out of range for an "
        f"embedding table with {num_embeddings} rows ({int(bad.sum())} id(s) "
        f"out of range; valid ids are 0..{num_embeddings - 1}). Fix the ids "
        "(tokenizer and vocabulary size disagree?) or mask them before the lookup.")


# --------------------------------------------------------------------------- the launch

def embedding(ids, weight, padding_idx=None, impl: str = "fast", *, bounds: str = "auto",
              out=None, word_bytes=None):
    """``F.embedding(ids, weight, padding_idx)`` (forward) computed by a Numba CUDA kernel, on
    :func:`course.numba_stream`, not waiting for the GPU unless ``bounds="host"``. ``ids``: int32/64
    of any shape; ``weight``: contiguous [V, D] float32/16 or bfloat16; ``impl``: "fast" or "naive";
    ``bounds``: "auto", "host" or "device"; ``word_bytes``: the fast kernel's word; ``out``: the
    output."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if bounds not in BOUNDS:
        raise ValueError(f"bounds must be one of {BOUNDS}, got {bounds!r}")
    validate(ids, weight, padding_idx, out)
    vocab, dim = weight.shape
    if out is None:
        out = torch.empty((*ids.shape, dim), dtype=weight.dtype, device=weight.device)
    if bounds == "host" or (bounds == "auto" and not runtime().on_gpu and not _capturing()):
        host_bounds_check(ids, vocab)
    # no copy when ids are contiguous, else a (capturable) device copy
    flat = ids.contiguous().view(-1)
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
    if LEAN:
        lean.launch(kernel, blocks, threads, flat, w, o, err)
    else:  # the plain Numba launch: every argument typed and wrapped on every call
        kernel[blocks, threads, numba_stream()](as_numba(flat), as_numba(w), as_numba(o), as_numba(err))
    return out


# --------------------------------------------------------------------------- checks

