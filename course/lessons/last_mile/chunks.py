"""The matrix-vector product every stage of lesson 07's step is made of (:mod:`.kernels`, :mod:`.split`,
:mod:`.persistent`): a tile owns ``BLOCK_N`` rows, walks them in chunks of ``BLOCK_K`` columns, multiplies in float32
and sums at the end, ``DEPTH`` chunks of weights in flight (the first ones loaded by :func:`_prefetch` before the
tile waits for anything), the input normalized on the fly (RMSNorm) where the stage asks for it. Packed weights
(``VEC`` > 0) and the rounding rules are described in :mod:`.kernels`.
"""
from __future__ import annotations

from course.core.triton_path import triton

tr = triton()
import triton.language as tl  # noqa: E402  (after the interpret decision, on purpose)


@tr.jit
def _rstd(x_ptr, K: tl.constexpr, eps, BLOCK_K: tl.constexpr):
    """1 / sqrt(mean(x^2) + eps) over the ``K`` values at ``x_ptr``, in float32."""
    acc = tl.full([BLOCK_K], 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        c = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(x_ptr + c, mask=c < K, other=0.0).to(tl.float32)
        acc += v * v
    return 1.0 / tl.sqrt(tl.sum(acc, axis=0) / K + eps)


@tr.jit
def _normed(x_ptr, nw_ptr, c, K, rstd, NORM: tl.constexpr):
    """The values ``c`` (any shape) of x, normalized as transformers' LlamaRMSNorm does (``w * (x * rstd).to(dtype)``)
    if NORM."""
    DT = x_ptr.dtype.element_ty
    v = tl.load(x_ptr + c, mask=c < K, other=0.0).to(tl.float32)
    if NORM:
        w = tl.load(nw_ptr + c, mask=c < K, other=0.0).to(tl.float32)
        v = (w * (v * rstd).to(DT).to(tl.float32)).to(DT).to(tl.float32)
    return v


@tr.jit
def _cols(i, BLOCK_K: tl.constexpr, VEC: tl.constexpr):
    """The columns of chunk ``i``: ``[BLOCK_K]`` (VEC 0), or ``[BLOCK_K / VEC, VEC]`` (packed: VEC per 16 bytes)."""
    if VEC == 0:
        return i * BLOCK_K + tl.arange(0, BLOCK_K)
    else:
        G: tl.constexpr = BLOCK_K // VEC
        return (i * G + tl.arange(0, G))[:, None] * VEC + tl.arange(0, VEC)[None, :]


@tr.jit
def _chunk(w_ptr, rows, rmask, K: tl.constexpr, i, lim, BLOCK_K: tl.constexpr, VEC: tl.constexpr,
           BLOCK_N: tl.constexpr):
    """Chunk ``i`` of the weights, nothing read at or past column ``lim`` (a multiple of VEC).

    VEC 0: ``w_ptr`` is the matrix ``[N, K]`` and ``rows`` the program's rows: ``[BLOCK_N, BLOCK_K]``.
    Packed: ``w_ptr`` is the program's own block ``[K / VEC, BLOCK_N, VEC]`` (one contiguous run of memory, VEC
    values = 16 bytes per row and group): ``[BLOCK_N, BLOCK_K / VEC, VEC]``.
    """
    if VEC == 0:
        c = i * BLOCK_K + tl.arange(0, BLOCK_K)
        return tl.load(w_ptr + rows[:, None] * K + c[None, :], mask=rmask[:, None] & (c[None, :] < lim), other=0.0)
    else:
        G: tl.constexpr = BLOCK_K // VEC
        g = i * G + tl.arange(0, G)  # 16-byte groups
        r = tl.arange(0, BLOCK_N)
        e = tl.arange(0, VEC)
        return tl.load(w_ptr + g[None, :, None] * (BLOCK_N * VEC) + r[:, None, None] * VEC + e[None, None, :],
                       mask=(g * VEC < lim)[None, :, None], other=0.0)


@tr.jit
def _gemv(w_ptr, rows, rmask, x_ptr, nw_ptr, rstd, K: tl.constexpr, wa, wb, NORM: tl.constexpr, DEPTH: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr, i0, NCH: tl.constexpr, lim):
    """``sum_k w[rows, k] * x[k]`` in float32 (x normalized if NORM), ``DEPTH`` chunks of weights in flight.

    ``wa`` (and with DEPTH 2 ``wb``) are the first chunks, already loaded (before the PDL wait). Chunks
    ``i0 .. i0 + NCH`` (NCH 0: all of the row), columns below ``lim`` (a split of K, :mod:`.split`).
    """
    N_CH: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K if NCH == 0 else NCH
    if VEC == 0:
        acc = tl.full([BLOCK_N, BLOCK_K], 0.0, tl.float32)
    else:
        acc = tl.full([BLOCK_N, BLOCK_K // VEC, VEC], 0.0, tl.float32)
    for i in range(0, N_CH):
        w_new = _chunk(w_ptr, rows, rmask, K, i0 + i + DEPTH, lim, BLOCK_K, VEC, BLOCK_N)
        x = _normed(x_ptr, nw_ptr, _cols(i0 + i, BLOCK_K, VEC), lim, rstd, NORM)
        acc += wa.to(tl.float32) * tl.expand_dims(x, 0)
        if DEPTH == 2:
            wa = wb
            wb = w_new
        else:
            wa = w_new
    return _rowsum(acc, VEC)


@tr.jit
def _rowsum(acc, VEC: tl.constexpr):
    """Each row's sum of a ``[BLOCK_N, BLOCK_K]`` (or packed ``[BLOCK_N, BLOCK_K / VEC, VEC]``) tile."""
    if VEC == 0:
        return tl.sum(acc, axis=1)
    else:
        return tl.sum(tl.sum(acc, axis=2), axis=1)


@tr.jit
def _norm_w(nw_ptr, K: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr):
    """The RMSNorm weights of a row that fits one chunk, in the chunk's layout (float32): no kernel writes them."""
    c = _cols(0, BLOCK_K, VEC)
    return tl.load(nw_ptr + c, mask=c < K, other=0.0).to(tl.float32)


@tr.jit
def _row_normed(x_ptr, w, K: tl.constexpr, eps, BLOCK_K: tl.constexpr, VEC: tl.constexpr):
    """x normalized with the weights ``w`` (:func:`_norm_w`), as :func:`_normed` rounds, x read in one round trip."""
    DT = x_ptr.dtype.element_ty
    c = _cols(0, BLOCK_K, VEC)
    v = tl.load(x_ptr + c, mask=c < K, other=0.0).to(tl.float32)
    rstd = _rstd(x_ptr, K, eps, BLOCK_K)
    return (w * (v * rstd).to(DT).to(tl.float32)).to(DT).to(tl.float32)


@tr.jit
def _dot(wa, x, VEC: tl.constexpr):
    """``sum_k wa[rows, k] * x[k]`` (float32) of one chunk of weights already in registers."""
    return _rowsum(wa.to(tl.float32) * tl.expand_dims(x, 0), VEC)


@tr.jit
def _prefetch(w_ptr, rows, rmask, K: tl.constexpr, DEPTH: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr,
              BLOCK_N: tl.constexpr, i0, lim):
    """The first ``DEPTH`` chunks (from chunk ``i0``) of ``rows`` (the second is the first again when DEPTH is 1)."""
    wa = _chunk(w_ptr, rows, rmask, K, i0, lim, BLOCK_K, VEC, BLOCK_N)
    if DEPTH == 2:
        wb = _chunk(w_ptr, rows, rmask, K, i0 + 1, lim, BLOCK_K, VEC, BLOCK_N)
    else:
        wb = wa
    return wa, wb
