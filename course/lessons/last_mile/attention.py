"""The attention stage of lesson 07's step: one query head over positions ``0..position`` of its KV
head, an online softmax in float32 (:func:`_attend`, shared with :mod:`.split`), the result rounded to
the model's dtype; :func:`attention_ahead` reads the past before its PDL wait (:mod:`.kernels`)."""
from __future__ import annotations

from course.core.triton_path import triton

tr = triton()
import triton.language as tl  # noqa: E402  (after the interpret decision, on purpose)


@tr.jit
def _softmax_step(k, v, q, seen, scale, m, total, acc):
    """One block of positions into the online softmax: ``(m, total, acc)`` after keys ``k`` and values ``v``
    (``[BLOCK_T, D]``, float32) of the positions ``seen``."""
    s = tl.where(seen, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=0))
    alpha = tl.exp(m - m_new)
    e = tl.exp(s - m_new)
    return m_new, total * alpha + tl.sum(e, axis=0), acc * alpha + tl.sum(e[:, None] * v, axis=0)


@tr.jit
def _attend(q, k_ptr, v_ptr, t0, end, scale, m, total, acc, D: tl.constexpr, BLOCK_T: tl.constexpr):
    """The online softmax over positions ``t0 .. end - 1`` of one KV head (``k_ptr``, ``v_ptr``: its position 0),
    blocks of ``BLOCK_T``, from the running ``(m, total, acc)``; returns them."""
    d = tl.arange(0, D)
    t0 = tl.cast(t0, tl.int32)  # a constant start too becomes a loop-carried tensor
    while t0 < end:
        t = t0 + tl.arange(0, BLOCK_T)
        seen = t < end
        k = tl.load(k_ptr + t[:, None] * D + d[None, :], mask=seen[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_ptr + t[:, None] * D + d[None, :], mask=seen[:, None], other=0.0).to(tl.float32)
        m, total, acc = _softmax_step(k, v, q, seen, scale, m, total, acc)
        t0 += BLOCK_T
    return m, total, acc


@tr.jit
def _softmax_start(D: tl.constexpr, BLOCK_T: tl.constexpr):
    """The online softmax before any position: ``(m, total, acc) = (-inf, 0, 0)`` (float32)."""
    return (tl.max(tl.full([BLOCK_T], float("-inf"), tl.float32), axis=0),
            tl.sum(tl.full([BLOCK_T], 0.0, tl.float32), axis=0), tl.full([D], 0.0, tl.float32))


@tr.jit
def attention_tile(h, q_ptr, kc_ptr, vc_ptr, pos_ptr, out_ptr, max_len, scale, NH: tl.constexpr, NKV: tl.constexpr,
                   D: tl.constexpr, BLOCK_T: tl.constexpr):
    """Query head ``h`` over positions 0..position of its KV head (online softmax, float32), the result rounded."""
    DT = q_ptr.dtype.element_ty
    d = tl.arange(0, D)
    base = (h // (NH // NKV)) * max_len * D
    p = tl.load(pos_ptr)
    q = tl.load(q_ptr + h * D + d).to(tl.float32)
    m, total, acc = _softmax_start(D, BLOCK_T)
    m, total, acc = _attend(q, kc_ptr + base, vc_ptr + base, 0, p + 1, scale, m, total, acc, D, BLOCK_T)
    tl.store(out_ptr + h * D + d, (acc / total).to(DT))


@tr.jit
def attention_ahead(h, q_ptr, kc_ptr, vc_ptr, pos_ptr, out_ptr, max_len, scale, NH: tl.constexpr,
                    NKV: tl.constexpr, D: tl.constexpr, PDL: tl.constexpr, BLOCK_T: tl.constexpr):
    """:func:`attention_tile` with the past loaded before the PDL wait: the position and the keys and values of the
    first two blocks' earlier positions (written by earlier steps), then the wait, then q and the new row only.
    The blocks are :func:`attention_tile`'s, summed in its order."""
    DT = q_ptr.dtype.element_ty
    d = tl.arange(0, D)
    base = (h // (NH // NKV)) * max_len * D
    t = tl.arange(0, BLOCK_T)
    at = base + t[:, None] * D + d[None, :]
    p = tl.load(pos_ptr)
    k0 = tl.load(kc_ptr + at, mask=(t < p)[:, None], other=0.0)
    v0 = tl.load(vc_ptr + at, mask=(t < p)[:, None], other=0.0)
    k1 = tl.load(kc_ptr + BLOCK_T * D + at, mask=(t + BLOCK_T < p)[:, None], other=0.0)
    v1 = tl.load(vc_ptr + BLOCK_T * D + at, mask=(t + BLOCK_T < p)[:, None], other=0.0)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()  # after this program's own loads: the next kernel's queue behind them
        tl.extra.cuda.gdc_wait()
    q = tl.load(q_ptr + h * D + d).to(tl.float32)
    m, total, acc = _softmax_start(D, BLOCK_T)
    new = (t == p)[:, None]
    k0 = tl.where(new, tl.load(kc_ptr + at, mask=new, other=0.0), k0).to(tl.float32)
    v0 = tl.where(new, tl.load(vc_ptr + at, mask=new, other=0.0), v0).to(tl.float32)
    m, total, acc = _softmax_step(k0, v0, q, t <= p, scale, m, total, acc)
    if BLOCK_T <= p:
        new = (t + BLOCK_T == p)[:, None]
        k = tl.where(new, tl.load(kc_ptr + BLOCK_T * D + at, mask=new, other=0.0), k1).to(tl.float32)
        v = tl.where(new, tl.load(vc_ptr + BLOCK_T * D + at, mask=new, other=0.0), v1).to(tl.float32)
        m, total, acc = _softmax_step(k, v, q, t + BLOCK_T <= p, scale, m, total, acc)
    m, total, acc = _attend(q, kc_ptr + base, vc_ptr + base, 2 * BLOCK_T, p + 1, scale, m, total, acc, D, BLOCK_T)
    tl.store(out_ptr + h * D + d, (acc / total).to(DT))
