"""Lesson 07's checks: a fused RMSNorm + GEMV kernel of the learner's, and a prediction from the timeline.

- :func:`check_rms_gemv`: the learner's Triton kernel ``rms_gemv(x_ptr, nw_ptr, w_ptr, y_ptr, N, K, eps,
  BLOCK_N, BLOCK_K)`` (``K``, ``BLOCK_N`` and ``BLOCK_K`` compile-time constants) computes
  ``y = W @ (nw * x / sqrt(mean(x^2) + eps))`` in float32; run on two small shapes whose sizes are not
  multiples of the blocks (so the masks matter), with a large ``eps`` (so forgetting it shows), against
  :func:`rms_gemv_reference`. A wrong result is named by the defect it matches (no normalization, no
  norm weight, no eps, the mean over the wrong count). Under Triton's interpreter on a laptop, compiled on a GPU.
- :func:`check_gap_prediction`: the idle time between consecutive kernels of the step without PDL,
  summed, from the timeline's rows (:mod:`~course.lessons.last_mile.timeline`).
"""
from __future__ import annotations

import inspect

import torch

from course.core.checks import exercise

SHAPES = ((24, 80, 16, 32), (16, 64, 8, 64))  # (N, K, BLOCK_N, BLOCK_K): N and K not multiples of the blocks
EPS = 0.25  # large on purpose: a kernel that forgets eps is off by far more than rounding


def rms_gemv_reference(x, nw, w, eps: float, *, norm: bool = True, weight: bool = True, use_eps: bool = True,
                       count=None):
    """``w @ (nw * x * rsqrt(mean(x^2) + eps))`` in float64; the keywords build the wrong versions the check names."""
    x, nw, w = x.double(), nw.double(), w.double()
    n = x * torch.rsqrt((x * x).sum() / (count or x.numel()) + (eps if use_eps else 0.0)) if norm else x
    return w @ (n * nw if weight else n)


WRONG = {"x is not normalized (no RMSNorm at all: neither 1/RMS nor nw)": {"norm": False, "weight": False},
         "x is multiplied by nw but not divided by its RMS": {"norm": False},
         "the norm weight nw is not applied": {"weight": False},
         "eps is missing from the square root": {"use_eps": False}}


def _diagnose(got, x, nw, w, bk: int) -> str:
    """The name of the wrong version ``got`` matches, or a plain mismatch message."""
    for why, kw in {**WRONG, "the mean divides by the block width, not by K (sum / BLOCK_K)": {"count": bk}}.items():
        if torch.allclose(got.double(), rms_gemv_reference(x, nw, w, EPS, **kw), rtol=1e-4, atol=1e-5):
            return why
    want = rms_gemv_reference(x, nw, w, EPS)
    return (f"largest difference {float((got.double() - want).abs().max()):.3g} "
            f"(outputs of size ~{float(want.abs().max()):.2g})")


def check_rms_gemv(kernel, name: str = "07.1 a fused RMSNorm + GEMV") -> None:
    """Run the learner's ``rms_gemv`` kernel on :data:`SHAPES` and compare with :func:`rms_gemv_reference`."""
    import course

    with exercise(name, hint=[
                "one program owns BLOCK_N rows: first the sum of x*x over all K (a loop over chunks), then the "
                "product, chunk by chunk, with the normalized chunk",
                "in rms_gemv: rstd = 1 / sqrt(mean of x*x + eps), with the mean over K (not over a block); every load"
                " is masked with c < K (and rows < N for w)",
                "a smaller example, in plain torch: rstd = 1 / torch.sqrt((x * x).sum() / K + eps); y = w @ (nw * x *"
                " rstd)"],
            answer="rstd = 1 / tl.sqrt(tl.sum(acc) / K + eps); n = tl.load(nw_ptr + c) * x * rstd; acc += tl.load(w_ptr "
                   "+ rows[:, None] * K + c[None, :], mask=...) * n[None, :]; tl.store(y_ptr + rows, tl.sum(acc, "
                   "axis=1), mask=rows < N)"):
        src = inspect.getsource(getattr(kernel, "fn", kernel))
        if "NotImplementedError" in src:
            raise NotImplementedError("write the body of rms_gemv first")
        dev = course.device()
        g = torch.Generator().manual_seed(7)
        for n, k, bn, bk in SHAPES:
            x, nw = torch.randn(k, generator=g), 1.0 + 0.5 * torch.randn(k, generator=g)
            w = torch.randn(n, k, generator=g) / k ** 0.5
            y = torch.full((n,), float("nan"))
            xd, nwd, wd, yd = (t.to(dev) for t in (x, nw, w, y))
            kernel[(-(-n // bn),)](xd, nwd, wd, yd, n, k, EPS, BLOCK_N=bn, BLOCK_K=bk)
            got = yd.cpu()
            assert not got.isnan().any(), (f"[{n} x {k}], BLOCK_N={bn}: {int(got.isnan().sum())} of the {n} outputs "
                                           "were never written: does every program store its rows (mask rows < N)?")
            want = rms_gemv_reference(x, nw, w, EPS)
            assert torch.allclose(got.double(), want, rtol=1e-4, atol=1e-5), \
                f"[{n} x {k}], BLOCK_N={bn}, BLOCK_K={bk}: {_diagnose(got, x, nw, w, bk)}"


def idle_between_kernels(timeline, variant: str = "Triton") -> float:
    """Sum of the positive gaps between consecutive kernels of ``variant`` in a timeline result (us)."""
    from course.lessons.last_mile.timeline import gaps

    rows = sorted((r for r in timeline.rows if r["variant"] == variant), key=lambda r: r["index"])
    if not rows:
        have = sorted({r["variant"] for r in timeline.rows})
        raise ValueError(f"the timeline has no rows of {variant!r}; it has {have}")
    return sum(g for g in gaps(rows) if g > 0)


def check_gap_prediction(fn, timeline, name: str = "07.2 predict what PDL saves") -> None:
    """The learner's ``fn(timeline)``: the idle time between the kernels of the step without PDL, summed (us)."""
    with exercise(name, hint=[
                "the GPU idles between two kernels when the next one starts after the previous one ended",
                "in your function: take the rows of variant 'Triton' in order of 'index'; the idle time before a "
                "kernel is its start_us minus the previous kernel's end_us, when that is positive",
                "a smaller example: kernels at 0-5, 7-9 and 8-12 us idle 2 us (7 - 5), then none (8 < 9): 2 us in all"],
            answer="sum(max(0, b['start_us'] - a['end_us']) for a, b in zip(rows, rows[1:]))"):
        got = fn(timeline)
        want = idle_between_kernels(timeline)
        assert got is not None and abs(got - want) <= 1e-6 * max(1.0, abs(want)), \
            f"you said {got}, the timeline's rows give {want:.2f} us"
