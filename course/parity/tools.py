"""Tools for the parity programs (:mod:`course.parity.programs`): capture on either path, and name
an error.

:func:`capture` warms a function up on a side stream and captures it, :func:`capture_error` returns
the key phrase of the error a capture fails with (and leaves CUDA usable on a GPU), :func:`phrase`
finds the key phrase of an error among :data:`PHRASES`, the errors a GPU gives.
"""
from __future__ import annotations

import warnings

import torch

# key phrases of the errors a GPU gives (torch 2.11+, H100): a verdict names the phrase, not the
# whole message
PHRASES = ("operation not permitted when stream is capturing",
           "Cannot copy between CPU and CUDA tensors during CUDA graph capture",
           "capturing stream has unjoined "
           "work", "CUDA graphs must be captured on a non-default stream",
           "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", "CUDAGeneratorImpl::set_current_seed can "
                                                    "be called during stream capture only if "
                                                    "new seed is the same as the original seed",
           "beginAllocateToPool: already recording to mempool_id",
           "Called CUDAGraph::replay without a preceding successful capture",
           "This CUDAGraph instance already owns a captured graph",
           "Attempt to increase offset for a CUDA generator not in capture mode",
           "operation failed due to a previous error during capture")


def _root(e: BaseException) -> BaseException:
    while e.__context__ is not None:
        e = e.__context__
    return e


def phrase(e: BaseException) -> str:
    """The key phrase of ``e``'s root cause (the first error raised), or its type and first line."""
    cause = _root(e)
    text = str(cause)
    return next((p for p in PHRASES if p in text), f"{type(cause).__name__}: "
                                                   f"{(text.splitlines() or [''])[0]}")


def clean_up(cg, before, pool, graph=None) -> None:
    """After a failed capture: the previous stream current again and, on a GPU, CUDA usable
    (course.core.capture).

    On a GPU, ``pool`` is released unless ``graph`` ended its capture (it then owns the pool and
    releases it itself when it is freed: releasing it twice would break the allocator's count).
    """
    cg.set_stream(before)
    if cg is torch.cuda:
        from course.core.capture import recover, release_pool
        try:
            ended = graph is not None and graph.pool() is not None
        except RuntimeError:  # "without a preceding successful capture"
            ended = False
        if not ended:
            release_pool(pool)
        recover()


def capture_error(cg, body) -> str:
    """Capture ``body()`` into a fresh graph and pool: the key phrase of the error it fails with, or
    'captured'."""
    before, pool = cg.current_stream(), cg.graph_pool_handle()
    g = cg.CUDAGraph()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with cg.graph(g, pool=pool):
                body()
    except Exception as e:  # noqa: BLE001 - the verdict is the error
        clean_up(cg, before, pool, g)
        return phrase(e)
    return "captured"


def capture(cg, fn, pool=None):
    """Warm ``fn`` up on a side stream, then capture it: ``(graph, output)``."""
    side = cg.Stream()
    side.wait_stream(cg.current_stream())
    with cg.stream(side):
        for _ in range(2):
            fn()
    cg.current_stream().wait_stream(side)
    cg.synchronize()
    g = cg.CUDAGraph()
    with cg.graph(g, pool=pool):
        out = fn()
    return g, out


def _close(a, b) -> bool:
    return bool(torch.allclose(a, b, atol=1e-5))


def close(a, b) -> bool:
    """``torch.allclose`` with the tolerance the programs use."""
    return bool(torch.allclose(a, b, atol=1e-5))


def x8(dev):
    """Eight random numbers on ``dev``."""
    return torch.randn(8, device=dev)
