"""The batch-1 GEMV measured honestly: each weight shape of the model, cuBLAS against the course's Numba kernel.

A matrix-vector product timed alone, call after call on the same matrix, measures two wrong things:

- **the host**: one ``F.linear`` call costs tens of microseconds of Python and dispatch, more than the
  kernel; so the calls are captured in a CUDA graph and only the replay is timed (CUDA events);
- **the L2 cache**: the H100's L2 holds 50 MB, so a 23 MB matrix read twice in a row comes the second
  time from L2, faster than memory can deliver it (a probe here read 4,300 GB/s "from memory", above
  the copy bandwidth). In a decode step every weight is read once per token, from memory. So each
  shape gets enough distinct copies of the matrix to fill :data:`L2_FACTOR` times the L2, and one call
  per copy is captured: every call reads from memory, as in the model.

:func:`gemv_experiment` ("real_model_gemv") reports, for each shape, microseconds per call and the
bandwidth reached (weight bytes / time) for both, with the IQR of the repeats, the largest difference from
cuBLAS's result, and how
many layers of the model use that shape (the stacked q/k/v and gate/up shapes of
:mod:`~course.lessons.real_model.projections` included).
"""
from __future__ import annotations

from course.core.capture import graph, require_gpu
from course.core.reference import experiment
from course.core.results import Result
from course.core.timing import time_interleaved

L2_FACTOR = 4  # the copies of each matrix fill this many times the L2 cache


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


def _graph_of_calls(fn, x, weights):
    import torch

    from course.core.capture import warm_up

    warm_up(lambda: [fn(x, w) for w in weights[:2]], iters=2)
    g = torch.cuda.CUDAGraph()
    with graph(g):
        for w in weights:
            fn(x, w)
    return g


@experiment("real_model_gemv", gpu_only=True, quick={"size": "tiny", "repeats": 3})
def gemv_experiment(size: str = "tinyllama", repeats: int = 15, log=print) -> Result:
    """Per weight shape of ``size`` (bf16): cuBLAS (``F.linear``) vs the course's Numba GEMV, replayed from memory."""
    require_gpu("timing the batch-1 GEMV")
    import torch

    from course.lessons.real_model.gemv import OP

    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    impls = {"cuBLAS": lambda x, w: torch.nn.functional.linear(x, w), "Numba GEMV": OP}
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for n, k, layers, what in shapes_of(size):
        nbytes = n * k * 2
        copies = max(2, -(-L2_FACTOR * l2 // nbytes))
        log(f"real_model_gemv: {what} [{n}, {k}]: {copies} copies of {nbytes / 1e6:.1f} MB, capturing and timing ...")
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02 for _ in range(copies)]
        x = torch.randn(1, 1, k, device="cuda", dtype=torch.bfloat16, generator=g)
        ref = torch.nn.functional.linear(x, weights[0]).float()
        err = ((OP(x, weights[0]).float() - ref).abs().max() / ref.abs().max()).item()
        graphs = {name: _graph_of_calls(fn, x, weights) for name, fn in impls.items()}
        t = time_interleaved({name: gr.replay for name, gr in graphs.items()}, warmup=2, repeats=repeats, inner=1)
        row = {"shape": f"[{n}, {k}]", "what": what, "layers": layers, "MB": nbytes / 1e6, "rel_diff": err}
        for name, tm in t.items():
            us = tm.us / copies
            row[f"{name} us"] = us
            row[f"{name} q1 us"], row[f"{name} q3 us"] = tm.q1 * 1e6 / copies, tm.q3 * 1e6 / copies
            row[f"{name} GB/s"] = nbytes / us / 1e3
        rows.append(row)
        del graphs, weights
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    res = Result("real_model_gemv",
                 f"batch-1 matrix-vector products of the {size} shapes (bf16): one call per distinct copy of the "
                 f"matrix ({L2_FACTOR}x the L2 in copies), captured in a CUDA graph, CUDA events, interleaved",
                 {"shape": "", "what": "", "layers": "count", "MB": "MB", "cuBLAS us": "us", "cuBLAS q1 us": "us",
                  "cuBLAS q3 us": "us", "cuBLAS GB/s": "GB/s", "Numba GEMV us": "us", "Numba GEMV q1 us": "us",
                  "Numba GEMV q3 us": "us", "Numba GEMV GB/s": "GB/s", "rel_diff": "fraction"}, rows,
                 params={"size": size, "repeats": repeats, "l2_bytes": l2, "l2_factor": L2_FACTOR,
                         "torch": torch.__version__})
    per_token = {name: sum(r[f"{name} us"] * r["layers"] for r in rows if not r["what"].startswith("stacked"))
                 for name in impls}
    res.add_summary("cuBLAS us per token (separate projections)", per_token["cuBLAS"], "us")
    res.add_summary("Numba GEMV us per token (separate projections)", per_token["Numba GEMV"], "us")
    return res
