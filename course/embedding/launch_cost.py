"""Where the eager embedding call's host time goes, part by part, and what the lean launch path
saves.

Lab 1's eager ``E.embedding`` once took 350-440 us of host time for a kernel that runs in about 2
us, while a bare Numba launch costs about 20 us: so "a graph makes it 80x faster" mostly measured
the course's own Python. :func:`eager_parts_experiment` times each part of the call, the plain and
the lean launch (:mod:`course.embedding.lean`), the bare empty launch and ``F.embedding``,
interleaved in one run.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from course import embedding as E
from course.core.reference import experiment
from course.core.results import Result
from course.core.runtime import as_numba, cuda, numba_stream
from course.core.timing import time_interleaved
import course.embedding.lean as lean
import course.embedding.lookup as lookup

_EMPTY = {}


def empty_kernel():
    """A Numba kernel that does nothing (the bare cost of a Numba launch), compiled once."""
    if "k" not in _EMPTY:
        nc = cuda()

        @nc.jit
        def empty():
            pass

        _EMPTY["k"] = empty
    return _EMPTY["k"]


@experiment("embedding_eager_parts", gpu_only=True, quick=dict(repeats=5))
def eager_parts_experiment(n_ids: int = 128, dim: int = 128, vocab: int = 32000, repeats: int = 25,
                           inner: int = 10) -> Result:
    """Host time per call of each part of an eager ``E.embedding`` call, beside a bare empty launch
    (GPU)."""
    from course.core.capture import require_gpu

    require_gpu("timing the parts of an eager launch")
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(vocab, dim, device="cuda", generator=gen)
    ids = torch.randint(0, vocab, (n_ids,), device="cuda", generator=gen)
    out = torch.empty(n_ids, dim, device="cuda")
    err = E.error_flag(weight.device)
    wb = E.pick_word_bytes(dim * 4, weight, out)
    w, o = E.as_words(weight, wb), E.as_words(out, wb)
    kernel = E.fast_kernel(wb)
    blocks, threads = E.launch_config("fast", n_ids, w.shape[1] // (4 if wb == 16 else 1))
    views = [as_numba(t) for t in (ids, w, o, err)]
    empty = empty_kernel()

    def full(lean_path):
        def call():
            lookup.LEAN = lean_path
            E.embedding(ids, weight, bounds="device", out=out)
        return call

    parts = {
        "bare empty Numba launch (no arguments)": lambda: empty[1, 1, numba_stream()](),
        "validate() the arguments": lambda: E.validate(ids, weight, None, out),
        "torch views (flat ids, word views of table and output)":
            lambda: (ids.contiguous().view(-1), E.as_words(weight, wb), E.as_words(out.view(n_ids, dim), wb)),
        "as_numba() wrappers for 4 arrays": lambda: [as_numba(t) for t in (ids, w, o, err)],
        "plain Numba launch of the lookup (wrappers made once)":
            lambda: kernel[blocks, threads, numba_stream()](*views),
        "lean launch of the lookup": lambda: lean.launch(kernel, blocks, threads, ids, w, o, err),
        "E.embedding(), plain launch": full(False),
        "E.embedding(), lean launch": full(True),
        "F.embedding": lambda: F.embedding(ids, weight),
    }
    try:
        t = time_interleaved(parts, clock="enqueue", warmup=5, repeats=repeats, inner=inner)
    finally:
        lookup.LEAN = True
    E.check_errors()
    rows = [{"part": name, "host_us": t[name].us, "q1_us": t[name].q1 * 1e6, "q3_us": t[name].q3 * 1e6}
            for name in parts]
    res = Result("embedding_eager_parts",
                 f"Host time to issue one eager lookup ({n_ids} "
                 f"ids x {dim} dims), part by part (interleaved)",
                 {"part": "", "host_us": "us", "q1_us": "us", "q3_us": "us"}, rows,
                 params=dict(n_ids=n_ids, dim=dim, vocab=vocab, repeats=repeats, inner=inner,
                             lean_available=lean.available()))
    bare = t["bare empty Numba launch (no arguments)"].us
    res.add_summary("bare_launch_us", bare, "us")
    res.add_summary("embedding_plain_vs_bare", t["E.embedding(), plain launch"].us / bare, "x")
    res.add_summary("embedding_lean_vs_bare", t["E.embedding(), lean launch"].us / bare, "x")
    return res
