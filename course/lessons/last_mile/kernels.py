"""The decode step of lesson 06's Llama as five Triton kernels per layer (plus one before the layers, one after).

Each kernel does everything one pass over one weight matrix can do, so the step reads each weight once
and each activation only where it must cross from one kernel to the next:

1. :func:`norm_qkv_rope`: RMSNorm of the residual stream, the q, k and v products (one program: a slice
   of rows of one head, and the rows RoPE pairs with them), RoPE on q and k, k and v written into the
   KV cache at the step's position;
2. :func:`attention`: one program per query head, over positions ``0..position`` of its KV head
   (:mod:`.attention`), nothing past the position read;
3. :func:`proj_residual`: the output product, added to the residual stream in place;
4. :func:`norm_gate_up`: RMSNorm, the gate and up products (a program: the same rows of both),
   ``silu(gate) * up``;
5. :func:`proj_residual` again: the down product, added to the residual stream in place.

Before the layers :func:`embed` copies the token's row of the embedding table into the residual stream;
after them :func:`norm_lm_head` normalizes and computes the logits (float32).

**Every matrix-vector product** is the same loop: a program owns ``BLOCK_N`` rows, walks the row in
chunks of ``BLOCK_K`` columns, multiplies in float32 and sums at the end. The next chunk of weights is
loaded before the current one is used (two chunks in flight per program), and the first chunk is
loaded before the program waits for the kernel before it (below).

**Packed weights** (``VEC`` > 0, VEC values = 16 bytes): a product's weights repacked by the decoder
(:func:`~course.lessons.last_mile.decoder.pack`) so that each program's rows are one contiguous block
``[K / VEC, BLOCK_N, VEC]``, loaded as ``[BLOCK_N, BLOCK_K / VEC, VEC]`` tiles; ``VEC`` 0 reads the model's own
row-major matrices. Every kernel takes ``VEC``.

**Rounding as transformers rounds**: every value transformers keeps in the model's dtype (a
projection's output, a normalized vector, the residual stream, RoPE's two products and their sum) is
rounded to that dtype here too (``.to(DT)``), and everything else is float32. In float32 the
roundings do nothing.

**Programmatic dependent launch (PDL)**: with ``PDL=True`` every kernel calls
``gdc_launch_dependents()`` as it starts (the next kernel may be scheduled onto free SMs at once) and
``gdc_wait()`` (returns when the kernel before has finished and its writes are visible) before it
reads anything a previous kernel wrote or writes anything a previous kernel reads. What it does
before the wait (its addresses, its first chunk of weights) overlaps the previous kernel's tail.
Launched without PDL both calls are no-ops; under Triton's interpreter they do not exist, so
``PDL=False`` there. With ``EARLY`` a kernel also loads before its wait what no kernel writes (the
position, cos and sin, the norm's weights) and reads x once per norm; :func:`attention_ahead` loads the position and
the past keys and values (earlier steps wrote them) before its wait, and lets the next kernel launch only then. Under
the interpreter the logits are the same, bit for bit; compiled for an H100 they differ at rounding level (the compiler
schedules the arithmetic anew), within lesson 06's tolerance of eager, as every other option's.

Row widths (``K``) are compile-time constants (one compiled kernel per width: the loops have fixed
trip counts). Triton's interpreter keeps a scalar as a one-element array, which newer NumPy refuses to
turn into a Python ``int``: so no ``range`` here takes a bound that is not a constant, and the attention
loop, whose bound is the position read from memory, is a ``while``.
"""
from __future__ import annotations

from course.core.triton_path import triton

tr = triton()
import triton.language as tl  # noqa: E402  (after the interpret decision, on purpose)


from course.lessons.last_mile.attention import attention_ahead, attention_tile  # noqa: E402
from course.lessons.last_mile.chunks import (_dot, _gemv, _norm_w, _prefetch, _row_normed,  # noqa: E402,F401
                                             _rstd)  # (split.py takes _gemv from here)


# ---------------------------------------------------------------- the stages, one tile at a time
# Each stage is a pair of device functions over one tile ``t`` (a block of output rows, a head): ``*_pre`` loads the
# tile's first weights (nothing any stage writes), ``*_run`` waits for nothing and does the rest. The kernels below
# run tile ``program_id`` with the PDL wait between the two; the persistent step (:mod:`.persistent`) loops each
# program over its tiles with a grid barrier between stages, its next stage's ``*_pre`` issued before the barrier.
@tr.jit
def embed_tile(t, ids_ptr, emb_ptr, x_ptr, K, BLOCK: tl.constexpr):
    """Block ``t`` of ``x = emb[ids[0]]``."""
    c = t * BLOCK + tl.arange(0, BLOCK)
    tok = tl.load(ids_ptr)
    v = tl.load(emb_ptr + tok * K + c, mask=c < K, other=0.0)
    tl.store(x_ptr + c, v, mask=c < K)


@tr.jit
def _qkv_where(t, wq_ptr, wk_ptr, wv_ptr, K: tl.constexpr, NH: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr,
               R: tl.constexpr, VEC: tl.constexpr):
    """Tile ``t`` of the q/k/v stage: (head, j, lo weights, hi weights, lo rows, hi rows, rows that exist)."""
    HALF: tl.constexpr = D // 2
    per_head: tl.constexpr = HALF // R
    head = t // per_head
    j = (t % per_head) * R + tl.arange(0, R)
    if VEC == 0:
        if head < NH:
            w_ptr = wq_ptr + head * D * K
        elif head < NH + NKV:
            w_ptr = wk_ptr + (head - NH) * D * K
        else:
            w_ptr = wv_ptr + (head - NH - NKV) * D * K
        lo_ptr = w_ptr
        hi_ptr = w_ptr
        lo_rows = j
        hi_rows = j + HALF
    else:
        lo_ptr = wq_ptr + t * (K * R)
        hi_ptr = wk_ptr + t * (K * R)
        lo_rows = j
        hi_rows = j
    ok = (j < HALF) & (head + 0 * j < NH + 2 * NKV)  # a block on both sides (the interpreter needs it)
    return head, j, lo_ptr, hi_ptr, lo_rows, hi_rows, ok


@tr.jit
def qkv_pre(t, wq_ptr, wk_ptr, wv_ptr, K: tl.constexpr, NH: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr,
            R: tl.constexpr, DEPTH: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr):
    """The first ``DEPTH`` chunks of tile ``t``'s two row sets (``lo_a, lo_b, hi_a, hi_b``): weights only."""
    _, _, lo_ptr, hi_ptr, lo_rows, hi_rows, ok = _qkv_where(t, wq_ptr, wk_ptr, wv_ptr, K, NH, NKV, D, R, VEC)
    lo_a, lo_b = _prefetch(lo_ptr, lo_rows, ok, K, DEPTH, BLOCK_K, VEC, R, 0, K)
    hi_a, hi_b = _prefetch(hi_ptr, hi_rows, ok, K, DEPTH, BLOCK_K, VEC, R, 0, K)
    return lo_a, lo_b, hi_a, hi_b


@tr.jit
def _rope_at(cos_ptr, sin_ptr, p, j, D: tl.constexpr):
    """cos and sin of position ``p`` at columns ``j`` and ``j + D / 2`` (float32): tables no kernel writes."""
    HALF: tl.constexpr = D // 2
    return (tl.load(cos_ptr + p * D + j).to(tl.float32), tl.load(sin_ptr + p * D + j).to(tl.float32),
            tl.load(cos_ptr + p * D + HALF + j).to(tl.float32), tl.load(sin_ptr + p * D + HALF + j).to(tl.float32))


@tr.jit
def qkv_run(t, lo_a, lo_b, hi_a, hi_b, x_ptr, nw_ptr, wq_ptr, wk_ptr, wv_ptr, cos_ptr, sin_ptr, pos_ptr, q_ptr,
            kc_ptr, vc_ptr, K: tl.constexpr, eps, max_len, NH: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr,
            R: tl.constexpr, DEPTH: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr,
            EARLY: tl.constexpr = False, WAIT: tl.constexpr = False):
    """Tile ``t`` of :func:`norm_qkv_rope` after its prefetch: RMSNorm, the products, RoPE, the stores.

    ``EARLY``: the position, cos/sin and the norm's weights first, then the PDL wait (if ``WAIT``), x read once.
    """
    DT = x_ptr.dtype.element_ty
    HALF: tl.constexpr = D // 2
    ONE: tl.constexpr = K <= BLOCK_K
    head, j, lo_ptr, hi_ptr, lo_rows, hi_rows, ok = _qkv_where(t, wq_ptr, wk_ptr, wv_ptr, K, NH, NKV, D, R, VEC)
    if EARLY:
        p = tl.load(pos_ptr)
        cos_lo, sin_lo, cos_hi, sin_hi = _rope_at(cos_ptr, sin_ptr, p, j, D)
        if ONE:
            w = _norm_w(nw_ptr, K, BLOCK_K, VEC)
        if WAIT:
            tl.extra.cuda.gdc_wait()
    if EARLY and ONE:
        xn = _row_normed(x_ptr, w, K, eps, BLOCK_K, VEC)
        lo = _dot(lo_a, xn, VEC).to(DT).to(tl.float32)
        hi = _dot(hi_a, xn, VEC).to(DT).to(tl.float32)
    else:
        rstd = _rstd(x_ptr, K, eps, BLOCK_K)
        lo = _gemv(lo_ptr, lo_rows, ok, x_ptr, nw_ptr, rstd, K, lo_a, lo_b, True, DEPTH, R, BLOCK_K, VEC, 0, 0,
                   K).to(DT).to(tl.float32)
        hi = _gemv(hi_ptr, hi_rows, ok, x_ptr, nw_ptr, rstd, K, hi_a, hi_b, True, DEPTH, R, BLOCK_K, VEC, 0, 0,
                   K).to(DT).to(tl.float32)
    if not EARLY:
        p = tl.load(pos_ptr)
    if head < NH + NKV:  # RoPE: (q * cos) + (rotate_half(q) * sin), rounded as transformers rounds
        if not EARLY:
            cos_lo, sin_lo, cos_hi, sin_hi = _rope_at(cos_ptr, sin_ptr, p, j, D)
        new_lo = (lo * cos_lo).to(DT).to(tl.float32) + (-hi * sin_lo).to(DT).to(tl.float32)
        new_hi = (hi * cos_hi).to(DT).to(tl.float32) + (lo * sin_hi).to(DT).to(tl.float32)
        lo, hi = new_lo, new_hi
    if head < NH:
        tl.store(q_ptr + head * D + j, lo.to(DT))
        tl.store(q_ptr + head * D + HALF + j, hi.to(DT))
    elif head < NH + NKV:
        slot = kc_ptr + ((head - NH) * max_len + p) * D
        tl.store(slot + j, lo.to(DT))
        tl.store(slot + HALF + j, hi.to(DT))
    else:
        slot = vc_ptr + ((head - NH - NKV) * max_len + p) * D
        tl.store(slot + j, lo.to(DT))
        tl.store(slot + HALF + j, hi.to(DT))


@tr.jit
def _rows(t, N, BLOCK_N: tl.constexpr):
    """Tile ``t``'s rows ``t * BLOCK_N ..`` and which of them exist (< N)."""
    rows = t * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows, rows < N


@tr.jit
def _block(t, w_ptr, K: tl.constexpr, BLOCK_N: tl.constexpr, VEC: tl.constexpr):
    """Where tile ``t``'s weights start: the matrix itself (VEC 0), or its own packed block of ``K * BLOCK_N``."""
    if VEC == 0:
        return w_ptr
    else:
        return w_ptr + t * (K * BLOCK_N)


@tr.jit
def rows_pre(t, w_ptr, N, K: tl.constexpr, DEPTH: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             VEC: tl.constexpr):
    """The first ``DEPTH`` chunks of tile ``t``'s rows of ``W`` (any product over rows: o, down, lm_head)."""
    rows, ok = _rows(t, N, BLOCK_N)
    return _prefetch(_block(t, w_ptr, K, BLOCK_N, VEC), rows, ok, K, DEPTH, BLOCK_K, VEC, BLOCK_N, 0, K)


@tr.jit
def proj_run(t, wa, wb, a_ptr, w_ptr, x_ptr, N, K: tl.constexpr, DEPTH: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr, VEC: tl.constexpr, RESIDUAL: tl.constexpr = True, EARLY: tl.constexpr = False):
    """Tile ``t`` of :func:`proj_residual` after its prefetch: ``x[rows] += (W @ a)[rows]`` (``RESIDUAL=False``:
    ``x[rows] = (W @ a)[rows]``, x not read). ``EARLY``: the residual loaded with ``a``, not after the product."""
    DT = x_ptr.dtype.element_ty
    rows, ok = _rows(t, N, BLOCK_N)
    if EARLY and RESIDUAL:
        r = tl.load(x_ptr + rows, mask=ok, other=0.0).to(tl.float32)
    y = _gemv(_block(t, w_ptr, K, BLOCK_N, VEC), rows, ok, a_ptr, a_ptr, 1.0, K, wa, wb, False, DEPTH, BLOCK_N,
              BLOCK_K, VEC, 0, 0, K).to(DT).to(tl.float32)
    if RESIDUAL:
        if not EARLY:
            r = tl.load(x_ptr + rows, mask=ok, other=0.0).to(tl.float32)
        tl.store(x_ptr + rows, (r + y).to(DT), mask=ok)
    else:
        tl.store(x_ptr + rows, y.to(DT), mask=ok)


@tr.jit
def gate_up_pre(t, wg_ptr, wu_ptr, N, K: tl.constexpr, DEPTH: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, VEC: tl.constexpr):
    """The first ``DEPTH`` chunks of tile ``t``'s rows of gate and of up (``ga, gb, ua, ub``)."""
    ga, gb = rows_pre(t, wg_ptr, N, K, DEPTH, BLOCK_N, BLOCK_K, VEC)
    ua, ub = rows_pre(t, wu_ptr, N, K, DEPTH, BLOCK_N, BLOCK_K, VEC)
    return ga, gb, ua, ub


@tr.jit
def gate_up_run(t, ga, gb, ua, ub, x_ptr, nw_ptr, wg_ptr, wu_ptr, act_ptr, N, K: tl.constexpr, eps,
                DEPTH: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr,
                EARLY: tl.constexpr = False, WAIT: tl.constexpr = False):
    """Tile ``t`` of :func:`norm_gate_up` after its prefetch: ``act[rows] = silu(gate(n)) * up(n)``.

    ``EARLY`` (a row in one chunk): the norm's weights first, then the PDL wait (if ``WAIT``), x read once.
    """
    DT = x_ptr.dtype.element_ty
    rows, ok = _rows(t, N, BLOCK_N)
    if EARLY and K <= BLOCK_K:
        w = _norm_w(nw_ptr, K, BLOCK_K, VEC)
        if WAIT:
            tl.extra.cuda.gdc_wait()
        xn = _row_normed(x_ptr, w, K, eps, BLOCK_K, VEC)
        g = _dot(ga, xn, VEC).to(DT).to(tl.float32)
        u = _dot(ua, xn, VEC).to(DT).to(tl.float32)
    else:
        if WAIT:
            tl.extra.cuda.gdc_wait()
        rstd = _rstd(x_ptr, K, eps, BLOCK_K)
        g = _gemv(_block(t, wg_ptr, K, BLOCK_N, VEC), rows, ok, x_ptr, nw_ptr, rstd, K, ga, gb, True, DEPTH, BLOCK_N,
                  BLOCK_K, VEC, 0, 0, K).to(DT).to(tl.float32)
        u = _gemv(_block(t, wu_ptr, K, BLOCK_N, VEC), rows, ok, x_ptr, nw_ptr, rstd, K, ua, ub, True, DEPTH, BLOCK_N,
                  BLOCK_K, VEC, 0, 0, K).to(DT).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(DT).to(tl.float32) * u
    tl.store(act_ptr + rows, act.to(DT), mask=ok)


@tr.jit
def lm_head_run(t, wa, wb, x_ptr, nw_ptr, w_ptr, out_ptr, N, K: tl.constexpr, eps, DEPTH: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr, EARLY: tl.constexpr = False,
                WAIT: tl.constexpr = False):
    """Tile ``t`` of :func:`norm_lm_head` after its prefetch: the logits of its rows (``EARLY``: as
    :func:`gate_up_run`)."""
    DT = x_ptr.dtype.element_ty
    rows, ok = _rows(t, N, BLOCK_N)
    if EARLY and K <= BLOCK_K:
        w = _norm_w(nw_ptr, K, BLOCK_K, VEC)
        if WAIT:
            tl.extra.cuda.gdc_wait()
        y = _dot(wa, _row_normed(x_ptr, w, K, eps, BLOCK_K, VEC), VEC)
    else:
        if WAIT:
            tl.extra.cuda.gdc_wait()
        rstd = _rstd(x_ptr, K, eps, BLOCK_K)
        y = _gemv(_block(t, w_ptr, K, BLOCK_N, VEC), rows, ok, x_ptr, nw_ptr, rstd, K, wa, wb, True, DEPTH, BLOCK_N,
                  BLOCK_K, VEC, 0, 0, K)
    tl.store(out_ptr + rows, y.to(DT).to(tl.float32), mask=ok)


# ---------------------------------------------------------------- the kernels: one tile per program
@tr.jit
def embed(ids_ptr, emb_ptr, x_ptr, K, PDL: tl.constexpr, BLOCK: tl.constexpr):
    """``x = emb[ids[0]]``: the token's row of the embedding table into the residual stream."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if PDL:
        tl.extra.cuda.gdc_wait()
    embed_tile(tl.program_id(0), ids_ptr, emb_ptr, x_ptr, K, BLOCK)


@tr.jit
def norm_qkv_rope(x_ptr, nw_ptr, wq_ptr, wk_ptr, wv_ptr, cos_ptr, sin_ptr, pos_ptr, q_ptr, kc_ptr, vc_ptr,
                  K: tl.constexpr, eps, max_len, NH: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
                  PDL: tl.constexpr, DEPTH: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr,
                  EARLY: tl.constexpr = False):
    """RMSNorm, q/k/v products, RoPE, the KV-cache write. Program: rows ``j..j+R`` and ``j+D/2..`` of one head.

    Heads ``0..NH-1`` are q's (result to ``q_ptr``), then NKV of k, NKV of v (to the caches at ``position``).
    Packed (VEC > 0): ``wq_ptr`` holds every program's first rows and ``wk_ptr`` their RoPE partners, each
    program's block ``[K / VEC, R, VEC]`` (``pack_qkv`` in the decoder); ``wv_ptr`` is unused.
    """
    pid = tl.program_id(0)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    lo_a, lo_b, hi_a, hi_b = qkv_pre(pid, wq_ptr, wk_ptr, wv_ptr, K, NH, NKV, D, R, DEPTH, BLOCK_K, VEC)
    if PDL and not EARLY:
        tl.extra.cuda.gdc_wait()
    qkv_run(pid, lo_a, lo_b, hi_a, hi_b, x_ptr, nw_ptr, wq_ptr, wk_ptr, wv_ptr, cos_ptr, sin_ptr, pos_ptr, q_ptr,
            kc_ptr, vc_ptr, K, eps, max_len, NH, NKV, D, R, DEPTH, BLOCK_K, VEC, EARLY, PDL and EARLY)


@tr.jit
def attention(q_ptr, kc_ptr, vc_ptr, pos_ptr, out_ptr, max_len, scale, NH: tl.constexpr, NKV: tl.constexpr,
              D: tl.constexpr, PDL: tl.constexpr, BLOCK_T: tl.constexpr, AHEAD: tl.constexpr = False):
    """One query head over positions 0..position of its KV head: online softmax in float32, the result rounded.

    ``AHEAD``: the past read before the PDL wait (:func:`attention_ahead`)."""
    if AHEAD:
        attention_ahead(tl.program_id(0), q_ptr, kc_ptr, vc_ptr, pos_ptr, out_ptr, max_len, scale, NH, NKV, D, PDL,
                        BLOCK_T)
        return
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if PDL:
        tl.extra.cuda.gdc_wait()
    attention_tile(tl.program_id(0), q_ptr, kc_ptr, vc_ptr, pos_ptr, out_ptr, max_len, scale, NH, NKV, D, BLOCK_T)


@tr.jit
def proj_residual(a_ptr, w_ptr, x_ptr, N, K: tl.constexpr, PDL: tl.constexpr, DEPTH: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr, RESIDUAL: tl.constexpr = True,
                  EARLY: tl.constexpr = False):
    """``x[rows] = x[rows] + (W @ a)[rows]``: a product added to the residual stream in place (o_proj, down_proj).

    ``RESIDUAL=False``: ``x[rows] = (W @ a)[rows]``, the product alone (x is not read): a rank's partial sum in
    lesson 08's split step, where the residual is added on one rank only, before the all-reduce.
    """
    pid = tl.program_id(0)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    wa, wb = rows_pre(pid, w_ptr, N, K, DEPTH, BLOCK_N, BLOCK_K, VEC)
    if PDL:
        tl.extra.cuda.gdc_wait()
    proj_run(pid, wa, wb, a_ptr, w_ptr, x_ptr, N, K, DEPTH, BLOCK_N, BLOCK_K, VEC, RESIDUAL, EARLY)


@tr.jit
def norm_gate_up(x_ptr, nw_ptr, wg_ptr, wu_ptr, act_ptr, N, K: tl.constexpr, eps, PDL: tl.constexpr,
                 DEPTH: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr,
                 EARLY: tl.constexpr = False):
    """``act[rows] = silu(gate(n)) * up(n)`` with ``n = RMSNorm(x)``: the same rows of both matrices per program."""
    pid = tl.program_id(0)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    ga, gb, ua, ub = gate_up_pre(pid, wg_ptr, wu_ptr, N, K, DEPTH, BLOCK_N, BLOCK_K, VEC)
    if PDL and not EARLY:
        tl.extra.cuda.gdc_wait()
    gate_up_run(pid, ga, gb, ua, ub, x_ptr, nw_ptr, wg_ptr, wu_ptr, act_ptr, N, K, eps, DEPTH, BLOCK_N, BLOCK_K, VEC,
                EARLY, PDL and EARLY)


@tr.jit
def norm_lm_head(x_ptr, nw_ptr, w_ptr, out_ptr, N, K: tl.constexpr, eps, PDL: tl.constexpr, DEPTH: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr, EARLY: tl.constexpr = False):
    """Logits (float32, rounded through the model's dtype, as transformers' lm_head output is): RMSNorm, lm_head."""
    pid = tl.program_id(0)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    wa, wb = rows_pre(pid, w_ptr, N, K, DEPTH, BLOCK_N, BLOCK_K, VEC)
    if PDL and not EARLY:
        tl.extra.cuda.gdc_wait()
    lm_head_run(pid, wa, wb, x_ptr, nw_ptr, w_ptr, out_ptr, N, K, eps, DEPTH, BLOCK_N, BLOCK_K, VEC, EARLY,
                PDL and EARLY)
