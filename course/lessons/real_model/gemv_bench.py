"""The batch-1 GEMV measured honestly: each weight shape of the model, cuBLAS against the course's Numba kernel.

A matrix-vector product timed alone, call after call on the same matrix, measures two wrong things:

- **the host**: one ``F.linear`` call costs tens of microseconds of Python and dispatch, more than the
  kernel; so the calls are captured in a CUDA graph and only the replay is timed (CUDA events);
- **the L2 cache**: the H100's L2 holds 50 MB, so a 23 MB matrix read twice in a row comes the second
  time from L2, faster than memory can deliver it (a probe here read 4,300 GB/s "from memory", above
  the copy bandwidth). In a decode step every weight is read once per token, from memory. So each
  shape gets enough distinct copies of the matrix to fill :data:`L2_FACTOR` times the L2
  (:func:`copies_for_l2`), and one call per copy is captured (:func:`graph_of_calls`): every call reads
  from memory, as in the model.

The experiment "real_model_gemv" stands in lesson 06's cell (:mod:`course.core.cells`); this module keeps its
bookkeeping: the shapes (:func:`shapes_of`, the stacked q/k/v and gate/up shapes of
:mod:`~course.lessons.real_model.projections` included), one row per shape (:func:`gemv_row`: microseconds per
call and the bandwidth reached, weight bytes / time, for both, with the IQR of the repeats, and the largest
difference from cuBLAS's result) and the table (:func:`gemv_result`).
"""
from __future__ import annotations

from course.core.capture import graph
from course.core.results import Result

L2_FACTOR = 4  # the copies of each matrix fill this many times the L2 cache
IMPLS = ("cuBLAS", "Numba GEMV")  # the implementations the table compares, in its column order


def shapes_of(size: str = "tinyllama") -> list:
    """``(N, K, layers using it, what)`` for every weight shape a batch-1 decode step of ``size`` multiplies by.

    The separate projections of transformers' Llama, then the stacked ones of the fused-projection twin.
    """
    from course.lessons.real_model.model import _size

    s = _size(size)
    kv = s.kv_heads * s.head_dim
    return [(s.hidden, s.hidden, 2 * s.layers, "q_proj, o_proj"), (kv, s.hidden, 2 * s.layers, "k_proj, v_proj"),
            (s.intermediate, s.hidden, 2 * s.layers, "gate_proj, up_proj"),
            (s.hidden, s.intermediate, s.layers, "down_proj"), (s.vocab, s.hidden, 1, "lm_head"),
            (s.hidden + 2 * kv, s.hidden, s.layers, "stacked q/k/v"),
            (2 * s.intermediate, s.hidden, s.layers, "stacked gate/up")]


def copies_for_l2(nbytes: int, l2_bytes: int, factor: int = L2_FACTOR) -> int:
    """How many distinct copies of an ``nbytes`` matrix fill ``factor`` times an L2 of ``l2_bytes`` (at least 2)."""
    if nbytes <= 0 or l2_bytes <= 0:
        raise ValueError(f"need a positive matrix size and L2 size, got {nbytes} and {l2_bytes} bytes")
    return max(2, -(-factor * l2_bytes // nbytes))


def graph_of_calls(fn, x, weights):
    """A CUDA graph of ``fn(x, w)`` for every ``w`` in ``weights``, in order, after a warm-up on the first two (GPU)."""
    import torch

    from course.core.capture import warm_up

    warm_up(lambda: [fn(x, w) for w in weights[:2]], iters=2)
    g = torch.cuda.CUDAGraph()
    with graph(g):
        for w in weights:
            fn(x, w)
    return g


def gemv_row(n: int, k: int, layers: int, what: str, timings: dict, copies: int, rel_diff: float) -> dict:
    """One row of the table: ``timings`` maps each of :data:`IMPLS` to the Timing of one replay of ``copies`` calls.

    Per call: the replay's median and quartiles over ``copies``, and the bandwidth reached, bf16 weight bytes / time.
    """
    missing = [name for name in IMPLS if name not in timings]
    if missing or copies < 1:
        raise ValueError(f"need a timing for each of {IMPLS} and copies >= 1; missing {missing}, copies={copies}")
    nbytes = n * k * 2
    row = {"shape": f"[{n}, {k}]", "what": what, "layers": layers, "MB": nbytes / 1e6, "rel_diff": rel_diff}
    for name in IMPLS:
        tm = timings[name]
        us = tm.us / copies
        row[f"{name} us"] = us
        row[f"{name} q1 us"], row[f"{name} q3 us"] = tm.q1 * 1e6 / copies, tm.q3 * 1e6 / copies
        row[f"{name} GB/s"] = nbytes / us / 1e3
    return row


def gemv_result(rows: list, size: str, repeats: int, l2_bytes: int) -> Result:
    """The ``real_model_gemv`` table from :func:`gemv_row` rows; summary: each implementation's microseconds per
    token for the model's separate projections (each shape's time times the layers that use it; stacked rows left
    out)."""
    import torch

    res = Result("real_model_gemv",
                 f"batch-1 matrix-vector products of the {size} shapes (bf16): one call per distinct copy of the "
                 f"matrix ({L2_FACTOR}x the L2 in copies), captured in a CUDA graph, CUDA events, interleaved",
                 {"shape": "", "what": "", "layers": "count", "MB": "MB", "cuBLAS us": "us", "cuBLAS q1 us": "us",
                  "cuBLAS q3 us": "us", "cuBLAS GB/s": "GB/s", "Numba GEMV us": "us", "Numba GEMV q1 us": "us",
                  "Numba GEMV q3 us": "us", "Numba GEMV GB/s": "GB/s", "rel_diff": "fraction"}, rows,
                 params={"size": size, "repeats": repeats, "l2_bytes": l2_bytes, "l2_factor": L2_FACTOR,
                         "torch": torch.__version__})
    per_token = {name: sum(r[f"{name} us"] * r["layers"] for r in rows if not r["what"].startswith("stacked"))
                 for name in IMPLS}
    res.add_summary("cuBLAS us per token (separate projections)", per_token["cuBLAS"], "us")
    res.add_summary("Numba GEMV us per token (separate projections)", per_token["Numba GEMV"], "us")
    return res
