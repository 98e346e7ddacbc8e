"""A lean launch path for the course's kernels: Numba's per-call argument typing and array wrapping
skipped (tens of microseconds for a kernel that runs for two).

Once a kernel is compiled for its argument types, :func:`launch` passes an array's parameters (size,
item size, pointer, shape, strides) straight from the torch tensors, through numba-cuda's own launch
(so a capture records it). Where the internals are missing it falls back to the plain launch
(:func:`available` says which runs).
"""
from __future__ import annotations

from course.core.runtime import as_numba, numba_stream, runtime

_COMPILED: dict = {}  # (dispatcher id, argument types) -> (cufunc kernel, launch configs)
_NUMBA_TYPES: dict = {}  # (dtype, ndim) -> Numba array type


def _internals():
    """numba-cuda's launch primitives, or None where this numba-cuda does not have them."""
    try:
        from numba.cuda import dispatcher as nd

        nd.launch, nd.LaunchConfig, nd.CUDA_CORE_GE_1_0  # noqa: B018 - probe only
        return nd
    except (ImportError, AttributeError):
        return None


def available() -> bool:
    """True when lean launches run (GPU path with a numba-cuda that has the launch primitives)."""
    return runtime().on_gpu and _internals() is not None


def array_params(t) -> tuple:
    """The kernel parameters of a contiguous torch tensor as a Numba array argument.

    (meminfo, parent, size, itemsize, pointer, *shape, *strides in bytes), the order Numba passes
    them in.
    """
    if not t.is_contiguous():
        raise ValueError("lean launches take contiguous tensors "
                         "only (make the view contiguous first)")
    item = t.element_size()
    strides, acc = [], item
    for n in reversed(t.shape):
        strides.append(acc)
        acc *= n
    return (0, 0, t.numel(), item, t.data_ptr(), *t.shape, *reversed(strides))


def _array_type(t):
    key = (t.dtype, t.dim())
    if key not in _NUMBA_TYPES:
        from numba.cuda.typing.typeof import Purpose, typeof

        _NUMBA_TYPES[key] = typeof(as_numba(t), Purpose.argument)
    return _NUMBA_TYPES[key]


def _compiled(kernel, tensors):
    types = tuple(_array_type(t) for t in tensors)
    key = (id(kernel), types)
    if key not in _COMPILED:
        k = kernel.compile(types)
        _COMPILED[key] = (k._codelibrary.get_cufunc().kernel, {})
    return _COMPILED[key]


def launch(kernel, blocks, threads, *tensors) -> None:
    """Launch the Numba ``kernel`` on torch's current stream with ``tensors`` (contiguous) as array
    arguments.

    GPU path: compiled once per argument types, then each call passes the tensors' numbers directly.
    Otherwise: the plain ``kernel[blocks, threads, stream](*views)`` launch.
    """
    nd = _internals() if runtime().on_gpu else None
    if nd is None:
        kernel[blocks, threads, numba_stream()](*(as_numba(t) for t in tensors))
        return
    cufunc, configs = _compiled(kernel, tensors)
    grid = blocks if isinstance(blocks, tuple) else (blocks,)
    block = threads if isinstance(threads, tuple) else (threads,)
    config = configs.get((grid, block))
    if config is None:
        extra = {"is_cooperative": False} if nd.CUDA_CORE_GE_1_0 else {"cooperative_launch": False}
        config = configs[(grid, block)] = nd.LaunchConfig(grid=grid, block=block, shmem_size=0, **extra)
    params = []
    for t in tensors:
        params.extend(array_params(t))
    nd.launch(numba_stream(), config, cufunc, *params)
