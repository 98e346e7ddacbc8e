"""Decode attention in one Numba kernel: one query token per sequence against its KV cache, masked.

transformers' sdpa path runs each layer's decode attention as several kernels: the boolean mask turned
into what the attention kernel takes, K and V repeated from 4 KV heads to 32 query heads (grouped-query
attention), then the attention kernel itself, which reads every slot of the static cache (256 here),
masked or not. At batch 1 each costs its fixed start-up time for very little work.

:func:`decode_attention` does it in one launch, one block per (sequence, query head):

- the block's threads each take cache positions ``t``; where the mask allows ``t`` they compute the score
  ``q . k[t]`` (the query already scaled), elsewhere ``-inf``; masked slots cost no memory reads;
- the block finds the largest score and the sum of ``exp(score - max)`` with shared-memory reductions
  (a numerically safe softmax);
- then groups of threads, one thread per head dimension, add ``p[t] * v[t]`` over the allowed positions,
  and the partial sums are added and divided by the softmax's sum.

K and V are read at the query head's KV head (``h // (heads // kv_heads)``): nothing is repeated. The mask
is read on the device, so nothing reads the position on the host and the launch is captured like any other.
:data:`OP` registers it as ``torch.ops.course.decode_attention`` (``torch.compile`` keeps it as one call);
:func:`attention` is the drop-in for transformers' attention function that uses it when it applies (one
query token, a boolean 4-D mask, a cache of at most :data:`MAX_LEN` positions) and transformers' sdpa
otherwise.
"""
from __future__ import annotations

import math

import torch

import course.embedding.lean as lean
from course.core.runtime import cuda as _numba_cuda, runtime
from course.lessons.real_model import gemv as _g

cuda = _numba_cuda()
import numba  # noqa: E402  (after the runtime decision, on purpose)

MAX_LEN = 2048  # cache positions a block keeps scores for (shared memory: 8 KB)
MAX_DIM = 256  # head dimension
THREADS = 256 if runtime().on_gpu else 32  # per block (the simulator runs each thread in Python)
DTYPES = (torch.bfloat16, torch.float32)


def _bf16_at_py(a, i, j):
    return _g._f32_py((int(a[i, j]) & 0xFFFF) << 16)


def _f32_at_py(a, i, j):
    return float(a[i, j])


def _make_loaders():
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline=True)
    def bf16_at(a, i, j):
        return libdevice.int_as_float(numba.int32((numba.int32(a[i, j]) & 0xFFFF) << 16))

    @cuda.jit(device=True, inline=True)
    def f32_at(a, i, j):
        return a[i, j]

    return bf16_at, f32_at


if runtime().on_gpu:
    _bf16_at, _f32_at = _make_loaders()
else:
    _bf16_at, _f32_at = _bf16_at_py, _f32_at_py


def _make_body(load, store):
    def body(q, k, v, mask, out):
        """``out[bh] = softmax(q[bh] . k[rows]) @ v[rows]`` over the rows ``mask`` allows (see the module doc)."""
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        bh = cuda.blockIdx.x
        batch, length, dim = mask.shape[0], mask.shape[1], q.shape[1]
        heads = q.shape[0] // batch
        kv_heads = k.shape[0] // (batch * length)
        b = bh // heads
        base = (b * kv_heads + (bh % heads) // (heads // kv_heads)) * length  # first row of this KV head's cache
        qs = cuda.shared.array(MAX_DIM, numba.float32)
        sc = cuda.shared.array(MAX_LEN, numba.float32)
        red = cuda.shared.array(256, numba.float32)
        for d in range(tid, dim, nt):
            qs[d] = load(q, bh, d)
        cuda.syncthreads()
        m = -math.inf
        for t in range(tid, length, nt):  # scores, and each thread's largest
            s = -math.inf
            if mask[b, t]:
                s = numba.float32(0.0)
                for d in range(dim):
                    s += qs[d] * load(k, base + t, d)
                m = max(m, s)
            sc[t] = s
        red[tid] = m
        cuda.syncthreads()
        half = nt // 2
        while half > 0:  # the block's largest score
            if tid < half:
                red[tid] = max(red[tid], red[tid + half])
            cuda.syncthreads()
            half //= 2
        m = red[0]
        cuda.syncthreads()
        z = numba.float32(0.0)
        for t in range(tid, length, nt):  # exp(score - max), and each thread's sum
            e = numba.float32(0.0)
            if sc[t] > -math.inf:
                e = math.exp(sc[t] - m)
            sc[t] = e
            z += e
        red[tid] = z
        cuda.syncthreads()
        half = nt // 2
        while half > 0:  # the softmax's sum
            if tid < half:
                red[tid] += red[tid + half]
            cuda.syncthreads()
            half //= 2
        z = red[0]
        cuda.syncthreads()
        groups = nt // dim
        d = tid % dim
        g = tid // dim
        acc = numba.float32(0.0)
        if g < groups:
            for t in range(g, length, groups):  # p[t] * v[t], over the allowed positions only
                p = sc[t]
                if p != 0.0:
                    acc += p * load(v, base + t, d)
        red[tid] = acc
        cuda.syncthreads()
        if tid < dim:
            total = numba.float32(0.0)
            for j in range(groups):
                total += red[tid + j * dim]
            store(out, bh, tid, total / z)
    return body


def _store_bf16(out, i, j, x):
    out[i, j] = _g._to_bf16(x)


def _store_f32(out, i, j, x):
    out[i, j] = x


if runtime().on_gpu:
    _store_bf16 = cuda.jit(device=True, inline=True)(_store_bf16)
    _store_f32 = cuda.jit(device=True, inline=True)(_store_f32)

_KERNELS: dict = {}


def kernel(dtype):
    """The compiled attention kernel for ``dtype`` (bf16 tensors travel as int16 views)."""
    if dtype not in DTYPES:
        raise TypeError(f"decode attention takes {[str(d) for d in DTYPES]}, got {dtype}")
    if dtype not in _KERNELS:
        load, store = (_bf16_at, _store_bf16) if dtype == torch.bfloat16 else (_f32_at, _store_f32)
        _KERNELS[dtype] = cuda.jit(_make_body(load, store))
    return _KERNELS[dtype]


def applies(query, key, mask) -> str:
    """Why :func:`decode_attention` cannot take these ("" when it can); shapes and dtypes only, no data read."""
    if query.dim() != 4 or query.shape[2] != 1:
        return f"one query token per sequence ([B, H, 1, D]), got {tuple(query.shape)}"
    b, h, _, d = query.shape
    if mask is None or mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[0] != b or mask.shape[2] != 1:
        return "a boolean mask [B, 1, 1, L] (True: attend)"
    if key.dim() != 4 or key.shape[0] != b or key.shape[3] != d or mask.shape[3] != key.shape[2] or h % key.shape[1]:
        return f"a cache [B, KV heads, L, D] that matches the query and mask, got {tuple(key.shape)}"
    if query.dtype not in DTYPES or key.dtype != query.dtype:
        return f"query and cache in one of {[str(t) for t in DTYPES]}, got {query.dtype} and {key.dtype}"
    if key.shape[2] > MAX_LEN or d > MAX_DIM or THREADS % d:
        return f"at most {MAX_LEN} positions and a head dimension dividing {THREADS}"
    return ""


def decode_attention(q, k, v, mask):
    """Attention of ``q`` ``[B*H, D]`` (already scaled) over ``k``, ``v`` ``[B*KV*L, D]`` where ``mask`` ``[B, L]`` is True.

    Returns ``[B*H, D]`` in ``q``'s dtype; launched on torch's current stream. Raises ValueError on shapes
    that do not fit together.
    """
    batch, length = mask.shape
    if q.dim() != 2 or k.shape != v.shape or k.dim() != 2 or q.shape[0] % batch or k.shape[0] % (batch * length):
        raise ValueError(f"decode_attention takes q [B*H, D], k and v [B*KV*L, D], mask [B, L]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}, {tuple(mask.shape)}")
    out = torch.empty_like(q)

    def ints(t):
        return t.contiguous().view(torch.int16) if t.dtype == torch.bfloat16 else t.contiguous()

    lean.launch(kernel(q.dtype), q.shape[0], THREADS, ints(q), ints(k), ints(v), mask.contiguous().view(torch.uint8),
                ints(out))
    return out


def _register():
    if hasattr(torch.ops, "course") and hasattr(torch.ops.course, "decode_attention"):
        return torch.ops.course.decode_attention

    @torch.library.custom_op("course::decode_attention", mutates_args=())
    def op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return decode_attention(q, k, v, mask)

    @op.register_fake
    def _(q, k, v, mask):
        return torch.empty_like(q)

    return torch.ops.course.decode_attention


OP = _register()


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function signature: :func:`decode_attention` where :func:`applies`, else sdpa.

    Returns ``(output [B, 1, H, D], None)`` like transformers' attention functions.
    """
    if applies(query, key, attention_mask) or dropout:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    b, h, _, d = query.shape
    scale = scaling if scaling is not None else d ** -0.5
    q = (query * scale).reshape(b * h, d)
    out = OP(q, key.reshape(-1, d), value.reshape(-1, d), attention_mask[:, 0, 0, :])
    return out.view(b, 1, h, d), None
