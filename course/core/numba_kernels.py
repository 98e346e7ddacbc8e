"""Numba kernels that more than one part of the course launches: :func:`affine` (``out = 2 * x + 1``), used by lesson
03's Numba hazards (:mod:`course.lessons.what_breaks.numba_zoo`) and by the simulator's stream parity programs
(:mod:`course.sim.parity_streams`).

Compiled on first use, once per process. The kernels reach ``numba.cuda`` through the module global ``ncuda``
(bound by the first call), so that the simulator can swap it inside them.
"""
from __future__ import annotations

ncuda = None  # numba.cuda, bound on first use: a module global, so the simulator can swap it inside the kernels
_K: dict = {}


def affine():
    """The kernel ``affine[blocks, threads(, stream)](x, out)``: ``out[i] = 2 * x[i] + 1`` for every ``i < x.size``
    (one thread per element, guarded), compiled once."""
    global ncuda
    if "affine" not in _K:
        from course.core.runtime import cuda

        ncuda = cuda()

        @ncuda.jit
        def affine(x, out):
            i = ncuda.grid(1)
            if i < x.size:
                out[i] = 2.0 * x[i] + 1.0

        _K["affine"] = affine
    return _K["affine"]
