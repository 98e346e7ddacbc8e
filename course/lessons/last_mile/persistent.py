"""Past the graph: the whole decode step as **one persistent Triton kernel**, the five stages of
every layer separated by grid-wide barriers (:mod:`.persistent_decoder` launches it).

The kernel runs as many programs as stay resident on the GPU at once (a program per SM); each walks
the tiles of every stage (``t = pid, pid + nprog, ...``) with the stage code of :mod:`.kernels`
(the ``*_pre`` / ``*_run`` device functions the five kernels run one tile of): the same arithmetic,
rounding and reads as the five-kernel step.

**The grid barrier** (:func:`grid_sync`): three int32 words in global memory, an arrival count, a
generation and an error flag. A program reads the generation, then arrives (``atomic_add(count,
1)``, its writes visible before its arrival); the last of the ``nprog`` arrivals sets the count back
to 0 and moves the generation on; the others spin until they see the new generation (acquire: then
they see every write made before the arrivals). The count is 0 again after every barrier and the
generation only grows, so the same words serve every barrier of every layer and every replay, with
no reset launch. The grid must be co-resident, or the first barrier waits forever: so the spin has
a limit (``spin``), past which a program sets the error flag and waits at no barrier any more.

**Loading across the barrier**, what makes persistence pay: before a program waits it issues the
loads of its first tile of the next stage that reads weights (weights never change during a step),
so memory stays busy while the barrier opens. What a stage *writes* (the residual stream, q, the KV
cache, attention's output, the MLP's activation) is loaded only after the wait.

The layers' weights stay the model's own tensors: a base pointer and a table of each layer's nine
tensors as offsets from it (int64 elements; ``ALIGN``: whole 16-byte groups, so loads stay wide).
Under Triton's interpreter a spinning barrier cannot open (programs run one after another): there
the kernel runs under :mod:`.coop`, whose programs co-operate as threads.
"""
from __future__ import annotations

from course.core.triton_path import triton
from course.lessons.last_mile.attention import attention_tile
from course.lessons.last_mile.kernels import (embed_tile, gate_up_pre, gate_up_run, lm_head_run, proj_run,
                                              qkv_pre, qkv_run, rows_pre)

tr = triton()
import triton.language as tl  # noqa: E402  (after the interpret decision, on purpose)

N_WEIGHTS = 9  # per layer, in the offsets table: n1, wq, wk, wv, wo, n2, wg, wu, wd


@tr.jit
def grid_sync(bar_ptr, nprog, limit):
    """Wait until all ``nprog`` programs have arrived; returns the spin limit for the next barrier
    (0 once this one timed out: the error flag ``bar_ptr[2]`` is set, the program waits no more)."""
    tl.debug_barrier()  # every thread of the program has issued its stores
    gen = tl.atomic_add(bar_ptr + 1, 0, sem="acquire", scope="gpu")
    arrived = tl.atomic_add(bar_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == nprog - 1:  # the last one in opens the barrier
        tl.atomic_xchg(bar_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_add(bar_ptr + 1, 1, sem="release", scope="gpu")
    else:
        spins = 0
        while ((tl.atomic_add(bar_ptr + 1, 0, sem="acquire", scope="gpu") == gen)
               & (spins < limit)):
            spins += 1
        if spins >= limit:
            tl.atomic_xchg(bar_ptr + 2, 1, sem="relaxed", scope="gpu")
            limit = 0
    tl.debug_barrier()
    return limit


@tr.jit
def _w(base_ptr, off_ptr, layer, j: tl.constexpr, ALIGN: tl.constexpr):
    """Weight ``j`` of ``layer``: the base pointer plus its offset from the table."""
    return base_ptr + tl.multiple_of(tl.load(off_ptr + layer * 9 + j), ALIGN)


@tr.jit
def _proj_tiles(pid, nprog, wa, wb, a_ptr, w_ptr, x_ptr, N: tl.constexpr, K: tl.constexpr,
                DEPTH: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """``x += W @ a``, tiles ``pid, pid + nprog, ...``: the first tile's loads ``wa, wb`` issued
    before the barrier, each next tile's before the current one is stored."""
    t = pid
    while t < (N + BN - 1) // BN:
        proj_run(t, wa, wb, a_ptr, w_ptr, x_ptr, N, K, DEPTH, BN, BK, 0)
        t += nprog
        wa, wb = rows_pre(t, w_ptr, N, K, DEPTH, BN, BK, 0)


@tr.jit
def persistent_step(ids_ptr, pos_ptr, emb_ptr, x_ptr, q_ptr, attn_ptr, act_ptr, out_ptr, cos_ptr,
                    sin_ptr, kc_ptr, vc_ptr, fnorm_ptr, lm_ptr, base_ptr, off_ptr, bar_ptr, spin,
                    eps, max_len, scale, H: tl.constexpr, I: tl.constexpr, V: tl.constexpr,
                    NH: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, L: tl.constexpr,
                    ALIGN: tl.constexpr, EBLOCK: tl.constexpr, BLOCK_T: tl.constexpr,
                    QR: tl.constexpr, QBK: tl.constexpr, QDEPTH: tl.constexpr,
                    OBN: tl.constexpr, OBK: tl.constexpr, ODEPTH: tl.constexpr,
                    GBN: tl.constexpr, GBK: tl.constexpr, GDEPTH: tl.constexpr,
                    DBN: tl.constexpr, DBK: tl.constexpr, DDEPTH: tl.constexpr,
                    LBN: tl.constexpr, LBK: tl.constexpr, LDEPTH: tl.constexpr,
                    AHEAD: tl.constexpr = True):
    """One decode step (embedding, ``L`` layers of five stages, lm_head) in one launch.

    Launch constants per stage as :class:`~.decoder.Launch` has them (rows, columns per chunk,
    depth): q/k/v (``QR`` rows per RoPE half), o (``O*``), gate/up (``G*``), down (``D*``),
    lm_head (``L*``). ``AHEAD=False`` issues each stage's first loads after the barrier instead of
    before it (the naive persistent kernel, for comparison).
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    KO: tl.constexpr = NH * D
    TQ: tl.constexpr = (NH + 2 * NKV) * (D // 2 // QR)
    TG: tl.constexpr = (I + GBN - 1) // GBN
    TL: tl.constexpr = (V + LBN - 1) // LBN
    NONE: tl.constexpr = 1 << 24  # a tile index past every stage's tiles: its loads are masked off
    limit = spin
    t = pid
    while t < (H + EBLOCK - 1) // EBLOCK:
        embed_tile(t, ids_ptr, emb_ptr, x_ptr, H, EBLOCK)
        t += nprog
    la, lb = rows_pre(NONE, lm_ptr, V, H, LDEPTH, LBN, LBK, 0)
    if not AHEAD:
        limit = grid_sync(bar_ptr, nprog, limit)
    qa, qb, qc, qd = qkv_pre(pid, _w(base_ptr, off_ptr, 0, 1, ALIGN),
                             _w(base_ptr, off_ptr, 0, 2, ALIGN), _w(base_ptr, off_ptr, 0, 3, ALIGN),
                             H, NH, NKV, D, QR, QDEPTH, QBK, 0)
    if AHEAD:
        limit = grid_sync(bar_ptr, nprog, limit)
    for layer in range(0, L):
        n1 = _w(base_ptr, off_ptr, layer, 0, ALIGN)
        wq = _w(base_ptr, off_ptr, layer, 1, ALIGN)
        wk = _w(base_ptr, off_ptr, layer, 2, ALIGN)
        wv = _w(base_ptr, off_ptr, layer, 3, ALIGN)
        wo = _w(base_ptr, off_ptr, layer, 4, ALIGN)
        n2 = _w(base_ptr, off_ptr, layer, 5, ALIGN)
        wg = _w(base_ptr, off_ptr, layer, 6, ALIGN)
        wu = _w(base_ptr, off_ptr, layer, 7, ALIGN)
        wd = _w(base_ptr, off_ptr, layer, 8, ALIGN)
        kc = kc_ptr + layer * (NKV * max_len * D)
        vc = vc_ptr + layer * (NKV * max_len * D)
        # 1. RMSNorm, q/k/v, RoPE, the KV write (its first tile's weights loaded before the barrier)
        t = pid
        while t < TQ:
            qkv_run(t, qa, qb, qc, qd, x_ptr, n1, wq, wk, wv, cos_ptr, sin_ptr, pos_ptr, q_ptr, kc,
                    vc, H, eps, max_len, NH, NKV, D, QR, QDEPTH, QBK, 0)
            t += nprog
            qa, qb, qc, qd = qkv_pre(t, wq, wk, wv, H, NH, NKV, D, QR, QDEPTH, QBK, 0)
        if not AHEAD:
            limit = grid_sync(bar_ptr, nprog, limit)
        oa, ob = rows_pre(pid, wo, H, KO, ODEPTH, OBN, OBK, 0)  # o_proj's weights, two stages ahead
        if AHEAD:
            limit = grid_sync(bar_ptr, nprog, limit)
        # 2. attention, one head per tile
        t = pid
        while t < NH:
            attention_tile(t, q_ptr, kc, vc, pos_ptr, attn_ptr, max_len, scale, NH, NKV, D, BLOCK_T)
            t += nprog
        limit = grid_sync(bar_ptr, nprog, limit)
        # 3. o_proj + residual
        _proj_tiles(pid, nprog, oa, ob, attn_ptr, wo, x_ptr, H, KO, ODEPTH, OBN, OBK)
        if not AHEAD:
            limit = grid_sync(bar_ptr, nprog, limit)
        ga, gb, ua, ub = gate_up_pre(pid, wg, wu, I, H, GDEPTH, GBN, GBK, 0)
        if AHEAD:
            limit = grid_sync(bar_ptr, nprog, limit)
        # 4. RMSNorm, gate/up, SiLU
        t = pid
        while t < TG:
            gate_up_run(t, ga, gb, ua, ub, x_ptr, n2, wg, wu, act_ptr, I, H, eps, GDEPTH, GBN, GBK,
                        0)
            t += nprog
            ga, gb, ua, ub = gate_up_pre(t, wg, wu, I, H, GDEPTH, GBN, GBK, 0)
        if not AHEAD:
            limit = grid_sync(bar_ptr, nprog, limit)
        da, db = rows_pre(pid, wd, H, I, DDEPTH, DBN, DBK, 0)
        if AHEAD:
            limit = grid_sync(bar_ptr, nprog, limit)
        # 5. down_proj + residual
        _proj_tiles(pid, nprog, da, db, act_ptr, wd, x_ptr, H, I, DDEPTH, DBN, DBK)
        # before the barrier: the next layer's first q/k/v tile, or after the last layer lm_head's
        if not AHEAD:
            limit = grid_sync(bar_ptr, nprog, limit)
        last = layer == L - 1
        nxt = tl.minimum(layer + 1, L - 1)
        qa, qb, qc, qd = qkv_pre(tl.where(last, NONE, pid), _w(base_ptr, off_ptr, nxt, 1, ALIGN),
                                 _w(base_ptr, off_ptr, nxt, 2, ALIGN),
                                 _w(base_ptr, off_ptr, nxt, 3, ALIGN), H, NH, NKV, D, QR, QDEPTH,
                                 QBK, 0)
        la, lb = rows_pre(tl.where(last, pid, NONE), lm_ptr, V, H, LDEPTH, LBN, LBK, 0)
        if AHEAD:
            limit = grid_sync(bar_ptr, nprog, limit)
    # final RMSNorm and lm_head
    t = pid
    while t < TL:
        lm_head_run(t, la, lb, x_ptr, fnorm_ptr, lm_ptr, out_ptr, V, H, eps, LDEPTH, LBN, LBK, 0)
        t += nprog
        la, lb = rows_pre(t, lm_ptr, V, H, LDEPTH, LBN, LBK, 0)
