"""Two kernels of lesson 07 that split one output's work over several programs, and sum the parts in one of them.

- :func:`proj_residual_split`: ``x += W @ a`` (down_proj) with the columns of ``W`` split ``SPLIT`` ways: a grid
  of (row blocks) x (splits), so a long row (down_proj's 5632 columns) is read by ``SPLIT`` programs at once.
- :func:`attention_split`: one query head's attention with its positions split into pieces of ``CHUNK``
  (flash-decoding): at long positions a head's keys and values are read by many programs at once, not one.

**Who adds the parts.** Each program writes its part (float32) to a scratch buffer, then takes a ticket:
``tl.atomic_add`` on a counter of its output (one per row block, or per head), with acquire-release order,
after a barrier so every thread's part is written first. The program that draws the last ticket
(``SPLIT - 1``) reads every part, in a fixed order (so the sum does not depend on which program came last),
finishes the output and sets the counter back to 0 for the next call (or the next layer: the counters and
the scratch are shared by all layers, which run one after another). It reads the parts with
``cache_modifier=".cg"`` (from L2, never from a stale L1 line). No program ever waits for another, so there
is no deadlock, whatever order the programs run in; under Triton's interpreter they run one by one.

Rounding as in :mod:`.kernels`: the product is rounded to the model's dtype once, after the parts are
summed in float32, then added to the residual stream and rounded again, as transformers does.
"""
from __future__ import annotations

from course.core.triton_path import triton
from course.lessons.last_mile.attention import _attend, _softmax_start
from course.lessons.last_mile.kernels import _gemv, _prefetch

tr = triton()
import triton.language as tl  # noqa: E402  (after the interpret decision, on purpose)


@tr.jit
def _last(count_ptr, n: tl.constexpr):
    """Take a ticket on ``count_ptr`` after every thread's writes; True for the ``n``-th (last) program."""
    tl.debug_barrier()
    return tl.atomic_add(count_ptr, 1, sem="acq_rel") == n - 1


@tr.jit
def proj_residual_split(a_ptr, w_ptr, x_ptr, part_ptr, count_ptr, N, K: tl.constexpr, PDL: tl.constexpr,
                        DEPTH: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr,
                        SPLIT: tl.constexpr):
    """``x[rows] += (W @ a)[rows]`` with K split ``SPLIT`` ways: program (row block, split) sums its chunks.

    ``part_ptr``: float32 ``[SPLIT, N]``; ``count_ptr``: int32, one per row block, zero between calls.
    Packed (VEC > 0): ``w_ptr`` as in :func:`~.kernels.proj_residual` (each row block's ``[K / VEC, BLOCK_N, VEC]``).
    """
    DT = x_ptr.dtype.element_ty
    blk = tl.program_id(0)
    s = tl.program_id(1)
    NCH: tl.constexpr = ((K + BLOCK_K - 1) // BLOCK_K + SPLIT - 1) // SPLIT  # chunks per split
    rows = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = rows < N
    if VEC != 0:
        w_ptr = w_ptr + blk * (K * BLOCK_N)
    i0 = s * NCH
    lim = tl.minimum((s + 1) * NCH * BLOCK_K, K)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    wa, wb = _prefetch(w_ptr, rows, ok, K, DEPTH, BLOCK_K, VEC, BLOCK_N, i0, lim)
    if PDL:
        tl.extra.cuda.gdc_wait()
    y = _gemv(w_ptr, rows, ok, a_ptr, a_ptr, 1.0, K, wa, wb, False, DEPTH, BLOCK_N, BLOCK_K, VEC, i0, NCH, lim)
    tl.store(part_ptr + s * N + rows, y, mask=ok)
    if _last(count_ptr + blk, SPLIT):
        tot = tl.full([BLOCK_N], 0.0, tl.float32)
        for j in range(0, SPLIT):
            tot += tl.load(part_ptr + j * N + rows, mask=ok, other=0.0, cache_modifier=".cg")
        r = tl.load(x_ptr + rows, mask=ok, other=0.0).to(tl.float32)
        tl.store(x_ptr + rows, (r + tot.to(DT).to(tl.float32)).to(DT), mask=ok)
        tl.store(count_ptr + blk, 0)


@tr.jit
def attention_split(q_ptr, kc_ptr, vc_ptr, pos_ptr, out_ptr, part_ptr, count_ptr, max_len, scale,
                    NH: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, PDL: tl.constexpr, BLOCK_T: tl.constexpr,
                    CHUNK: tl.constexpr, SPLITS: tl.constexpr):
    """Program (head, piece): positions ``piece * CHUNK ..`` up to the position (online softmax, float32).

    ``part_ptr``: float32 ``[NH, SPLITS, D + 2]`` (the piece's unnormalized sum, its running max, its total);
    ``count_ptr``: int32 ``[NH]``, zero between calls. ``SPLITS * CHUNK`` covers ``max_len``; a piece past the
    position reads nothing and adds nothing. The last program of a head merges the pieces.
    """
    DT = q_ptr.dtype.element_ty
    h = tl.program_id(0)
    piece = tl.program_id(1)
    g = h // (NH // NKV)
    d = tl.arange(0, D)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if PDL:
        tl.extra.cuda.gdc_wait()
    p = tl.load(pos_ptr)
    q = tl.load(q_ptr + h * D + d).to(tl.float32)
    base = g * max_len * D
    m, total, acc = _softmax_start(D, BLOCK_T)
    t0 = piece * CHUNK
    m, total, acc = _attend(q, kc_ptr + base, vc_ptr + base, t0, tl.minimum(p + 1, t0 + CHUNK), scale, m, total,
                            acc, D, BLOCK_T)
    mine = part_ptr + (h * SPLITS + piece) * (D + 2)
    tl.store(mine + d, acc)
    tl.store(mine + D, m)
    tl.store(mine + D + 1, total)
    if _last(count_ptr + h, SPLITS):
        first = part_ptr + h * SPLITS * (D + 2)
        big = tl.load(first + D, cache_modifier=".cg")  # piece 0 always holds position 0: a finite max
        for j in range(1, SPLITS):
            big = tl.maximum(big, tl.load(first + j * (D + 2) + D, cache_modifier=".cg"))
        out = tl.full([D], 0.0, tl.float32)
        denom = tl.sum(tl.full([BLOCK_T], 0.0, tl.float32), axis=0)
        for j in range(0, SPLITS):
            w = tl.exp(tl.load(first + j * (D + 2) + D, cache_modifier=".cg") - big)  # 0 for an empty piece
            out += w * tl.load(first + j * (D + 2) + d, cache_modifier=".cg")
            denom += w * tl.load(first + j * (D + 2) + D + 1, cache_modifier=".cg")
        tl.store(out_ptr + h * D + d, (out / denom).to(DT))
        tl.store(count_ptr + h, 0)
