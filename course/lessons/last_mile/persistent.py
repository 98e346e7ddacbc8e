"""Past the graph: the whole decode step as **one persistent Triton kernel**, the five stages of every layer
separated by grid-wide barriers (:mod:`~course.lessons.last_mile.persistent_decoder` launches it).

The kernel runs as many programs as stay resident on the GPU at once (a program per SM), and each program
walks the tiles of every stage (``t = pid, pid + nprog, ...``) with the stage code of :mod:`.kernels` (the same
``*_pre`` / ``*_run`` device functions the five-kernel step runs one tile of): the step's arithmetic, its rounding
and its reads of the weights and the KV cache are the five-kernel step's.

**The grid barrier** (:func:`grid_sync`): a stage may read what any program wrote in the stage before, so between
two stages every program must have finished writing. Three int32 words in global memory: an arrival count, a
generation, an error flag. A program reads the generation, then arrives (``atomic_add(count, 1)``, release: its
writes are visible before its arrival); the last of the ``nprog`` arrivals sets the count back to 0 and moves the
generation on (release); every other program spins on the generation (``atomic_add(gen, 0)``, acquire: once it
sees the new generation it sees every write made before the arrivals). The count returns to 0 at every barrier
and the generation only grows, so the same three words serve every barrier of every layer and every replay of a
graph, with no reset launch. A barrier can only open when all ``nprog`` programs run at once: the grid must be
co-resident (never more programs than SMs x the programs an SM holds), or the first barrier waits forever.
So the spin has a limit (``spin`` turns): a program that reaches it sets the error flag and stops waiting
(from then on it waits at no barrier), the step's output is garbage and the decoder raises with the reason.

**Loading across the barrier**: what makes persistence pay. Before a program waits at a barrier it issues the
loads of its first tile of the *next* weight-reading stage (its weights never change during a step), so memory
stays busy while the slowest program finishes and the barrier opens: o_proj's weights are loaded before the
barrier ahead of attention (two stages ahead: attention reads no weights), gate/up's before the barrier ahead of
their stage, down_proj's, the next layer's q/k/v, lm_head's. Loads of anything a stage *writes* (the residual
stream, q, the KV cache at the position, attention's output, the MLP's activation) may only come after the wait.

The layers' weights stay the model's own tensors: the kernel gets one of them as a base pointer and a table of
each layer's nine tensors as offsets from it (int64, in elements; ``ALIGN`` tells the compiler they are whole
16-byte groups, so its loads stay 16 bytes wide).

Under Triton's interpreter (a laptop) programs run one after another, so a spinning barrier cannot open: there the
kernel runs under :mod:`.coop`, which runs the programs as co-operating threads switching at every atomic.
"""
from __future__ import annotations

from course.core.triton_path import triton
from course.lessons.last_mile.kernels import (attention_tile, embed_tile, gate_up_pre, gate_up_run, lm_head_run,
                                              proj_run, qkv_pre, qkv_run, rows_pre)

tr = triton()
import triton.language as tl  # noqa: E402  (after the interpret decision, on purpose)

N_WEIGHTS = 9  # per layer, in the offsets table: n1, wq, wk, wv, wo, n2, wg, wu, wd


@tr.jit
def grid_sync(bar_ptr, nprog, limit):
    """Wait until all ``nprog`` programs have arrived (see the module doc); returns the spin limit for the next
    barrier (0 once this one timed out: the error flag ``bar_ptr[2]`` is set, the program waits no more)."""
    tl.debug_barrier()  # every thread of the program has issued its stores
    gen = tl.atomic_add(bar_ptr + 1, 0, sem="acquire", scope="gpu")
    arrived = tl.atomic_add(bar_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == nprog - 1:  # the last one in opens the barrier
        tl.atomic_xchg(bar_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_add(bar_ptr + 1, 1, sem="release", scope="gpu")
    else:
        spins = 0
        while (tl.atomic_add(bar_ptr + 1, 0, sem="acquire", scope="gpu") == gen) & (spins < limit):
            spins += 1
        if spins >= limit:
            tl.atomic_xchg(bar_ptr + 2, 1, sem="relaxed", scope="gpu")
            limit = 0
    tl.debug_barrier()
    return limit


@tr.jit
def _w(base_ptr, off_ptr, layer, j: tl.constexpr, ALIGN: tl.constexpr):
    """Weight ``j`` of ``layer``: the base pointer plus its offset from the table (whole 16-byte groups)."""
    return base_ptr + tl.multiple_of(tl.load(off_ptr + layer * 9 + j), ALIGN)


@tr.jit
def persistent_step(ids_ptr, pos_ptr, emb_ptr, x_ptr, q_ptr, attn_ptr, act_ptr, out_ptr, cos_ptr, sin_ptr,
                    kc_ptr, vc_ptr, fnorm_ptr, lm_ptr, base_ptr, off_ptr, bar_ptr, spin, eps, max_len, scale,
                    H: tl.constexpr, I: tl.constexpr, V: tl.constexpr, NH: tl.constexpr, NKV: tl.constexpr,
                    D: tl.constexpr, L: tl.constexpr, ALIGN: tl.constexpr, EBLOCK: tl.constexpr, BLOCK_T: tl.constexpr,
                    QR: tl.constexpr, QBK: tl.constexpr, QDEPTH: tl.constexpr,
                    OBN: tl.constexpr, OBK: tl.constexpr, ODEPTH: tl.constexpr,
                    GBN: tl.constexpr, GBK: tl.constexpr, GDEPTH: tl.constexpr,
                    DBN: tl.constexpr, DBK: tl.constexpr, DDEPTH: tl.constexpr,
                    LBN: tl.constexpr, LBK: tl.constexpr, LDEPTH: tl.constexpr, AHEAD: tl.constexpr = True):
    """One decode step (embedding, ``L`` layers of five stages, lm_head) in one launch; see the module doc.

    Launch constants per stage as :class:`~course.lessons.last_mile.decoder.Launch` has them: q/k/v (``QR`` rows
    per RoPE half), o (``O*``), gate/up (``G*``), down (``D*``), lm_head (``L*``): rows, columns per chunk, depth.
    ``AHEAD=False`` issues each stage's first loads after the barrier instead of before it (the naive persistent
    kernel, for comparison).
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    KO: tl.constexpr = NH * D
    TQ: tl.constexpr = (NH + 2 * NKV) * (D // 2 // QR)
    TO: tl.constexpr = (H + OBN - 1) // OBN
    TG: tl.constexpr = (I + GBN - 1) // GBN
    TD: tl.constexpr = (H + DBN - 1) // DBN
    TL: tl.constexpr = (V + LBN - 1) // LBN
    NONE: tl.constexpr = 1 << 24  # a tile index past every stage's tiles: its loads are all masked off
    limit = spin
    t = pid
    while t < (H + EBLOCK - 1) // EBLOCK:
        embed_tile(t, ids_ptr, emb_ptr, x_ptr, H, EBLOCK)
        t += nprog
    la, lb = rows_pre(NONE, lm_ptr, V, H, LDEPTH, LBN, LBK, 0)
    if not AHEAD:
        limit = grid_sync(bar_ptr, nprog, limit)
    qa, qb, qc, qd = qkv_pre(pid, _w(base_ptr, off_ptr, 0, 1, ALIGN), _w(base_ptr, off_ptr, 0, 2, ALIGN),
                             _w(base_ptr, off_ptr, 0, 3, ALIGN), H, NH, NKV, D, QR, QDEPTH, QBK, 0)
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
        # 1. RMSNorm, q/k/v, RoPE, the KV write (its first tile's weights were loaded before the last barrier)
        t = pid
        while t < TQ:
            qkv_run(t, qa, qb, qc, qd, x_ptr, n1, wq, wk, wv, cos_ptr, sin_ptr, pos_ptr, q_ptr, kc, vc, H, eps,
                    max_len, NH, NKV, D, QR, QDEPTH, QBK, 0)
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
        t = pid
        while t < TO:
            proj_run(t, oa, ob, attn_ptr, wo, x_ptr, H, KO, ODEPTH, OBN, OBK, 0)
            t += nprog
            oa, ob = rows_pre(t, wo, H, KO, ODEPTH, OBN, OBK, 0)
        if not AHEAD:
            limit = grid_sync(bar_ptr, nprog, limit)
        ga, gb, ua, ub = gate_up_pre(pid, wg, wu, I, H, GDEPTH, GBN, GBK, 0)
        if AHEAD:
            limit = grid_sync(bar_ptr, nprog, limit)
        # 4. RMSNorm, gate/up, SiLU
        t = pid
        while t < TG:
            gate_up_run(t, ga, gb, ua, ub, x_ptr, n2, wg, wu, act_ptr, I, H, eps, GDEPTH, GBN, GBK, 0)
            t += nprog
            ga, gb, ua, ub = gate_up_pre(t, wg, wu, I, H, GDEPTH, GBN, GBK, 0)
        if not AHEAD:
            limit = grid_sync(bar_ptr, nprog, limit)
        da, db = rows_pre(pid, wd, H, I, DDEPTH, DBN, DBK, 0)
        if AHEAD:
            limit = grid_sync(bar_ptr, nprog, limit)
        # 5. down_proj + residual
        t = pid
        while t < TD:
            proj_run(t, da, db, act_ptr, wd, x_ptr, H, I, DDEPTH, DBN, DBK, 0)
            t += nprog
            da, db = rows_pre(t, wd, H, I, DDEPTH, DBN, DBK, 0)
        # before the barrier: the next layer's first q/k/v tile, or after the last layer lm_head's
        if not AHEAD:
            limit = grid_sync(bar_ptr, nprog, limit)
        last = layer == L - 1
        nxt = tl.minimum(layer + 1, L - 1)
        qa, qb, qc, qd = qkv_pre(tl.where(last, NONE, pid), _w(base_ptr, off_ptr, nxt, 1, ALIGN),
                                 _w(base_ptr, off_ptr, nxt, 2, ALIGN), _w(base_ptr, off_ptr, nxt, 3, ALIGN), H, NH,
                                 NKV, D, QR, QDEPTH, QBK, 0)
        la, lb = rows_pre(tl.where(last, pid, NONE), lm_ptr, V, H, LDEPTH, LBN, LBK, 0)
        if AHEAD:
            limit = grid_sync(bar_ptr, nprog, limit)
    # final RMSNorm and lm_head
    t = pid
    while t < TL:
        lm_head_run(t, la, lb, x_ptr, fnorm_ptr, lm_ptr, out_ptr, V, H, eps, LDEPTH, LBN, LBK, 0)
        t += nprog
        la, lb = rows_pre(t, lm_ptr, V, H, LDEPTH, LBN, LBK, 0)
