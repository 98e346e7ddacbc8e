"""Parity programs about streams, shared pools, Numba launches and ``make_graphed_callables`` (see
:mod:`course.parity.programs`, which lists them with the verdicts a GPU gives).
"""
from __future__ import annotations

import warnings

import torch

from course.parity.tools import capture, capture_error, close, x8


def fork_join(cg, dev, join: bool = True):
    """Work forked to a side stream and joined back: captured."""
    x, side = x8(dev), cg.Stream()

    def body():
        side.wait_stream(cg.current_stream())
        with cg.stream(side):
            y = x * 3
        if join:
            cg.current_stream().wait_stream(side)
        return y
    return capture_error(cg, body)


def unjoined(cg, dev):
    """Work forked to a side stream and never joined back: capture_end fails."""
    return fork_join(cg, dev, join=False)


def pool_shared_outputs(cg, dev):
    """Two graphs in one pool, both outputs kept: both stay right after both replays."""
    x, pool = torch.ones(1024, device=dev), cg.graph_pool_handle()
    ga, ya = capture(cg, lambda: x * 2, pool=pool)
    gb, yb = capture(cg, lambda: x * 3, pool=pool)
    gb.replay()
    ga.replay()
    same = ga.pool() == gb.pool() == pool
    return f"pool shared {same}, kept outputs intact {close(ya, x * 2) and close(yb, x * 3)}"


def pool_freed_memory_reused(cg, dev):
    """A's intermediate, freed during its capture, becomes B's output: replaying A overwrites it."""
    x, pool = torch.ones(1024, device=dev), cg.graph_pool_handle()

    def a():
        t = x * 2  # freed when a() returns, inside A's capture: its memory goes back to the pool
        return t + 1
    ga, ga_out = cg.CUDAGraph(), None
    with cg.graph(ga, pool=pool):
        ga_out = a()
    gb = cg.CUDAGraph()
    with cg.graph(gb, pool=pool):
        yb = x * 3  # may get the memory A's intermediate had
    gb.replay()
    right = close(yb, x * 3)
    ga.replay()  # writes A's intermediate: into B's output when they share that memory
    return f"B right {right}, then overwritten by A's replay {not close(yb, x * 3)}"


# --------------------------------------------------------------------------- Numba launches

def _affine():
    from course.core.numba_kernels import affine

    return affine()




def numba_kernel(cg, dev, on_torch_stream: bool = True):
    """A Numba kernel launched on course.numba_stream(): captured, and each replay runs it on the
    current input."""
    from course.core.runtime import as_numba, numba_stream

    kernel, x = _affine(), torch.ones(32, device=dev)

    def fn():
        out = torch.empty_like(x)
        if on_torch_stream:
            kernel[1, 32, numba_stream()](as_numba(x), as_numba(out))
        else:  # Numba's own default stream: not the capturing one
            kernel[1, 32](as_numba(x), as_numba(out))
        return out
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g, out = capture(cg, fn)
    x.fill_(5.0)
    g.replay()
    cg.synchronize()
    empty = any("empty" in str(w.message) for w in caught)
    return f"replay follows the input {close(out, x * 2 + 1)}, empty-graph warning {empty}"


def numba_default_stream(cg, dev):
    """A Numba kernel on Numba's own default stream: it runs at capture, the graph is empty, replays
    miss it."""
    return numba_kernel(cg, dev, on_torch_stream=False)


def numba_alloc(cg, dev):
    """cuda.device_array inside the capture: refused by the driver (cuMemAlloc)."""
    from course.core.runtime import cuda

    x, nc = x8(dev), cuda()
    return capture_error(cg, lambda: (nc.device_array(16), x * 2))


# --------------------------------------------------------------------------- make_graphed_callables

def graphed_module(cg, dev):
    """make_graphed_callables on a module: the graphed forward and its gradients equal eager's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).to(dev)
    ref = torch.nn.Sequential(*model)  # the same layers, forward not replaced
    x = torch.randn(8, 16, device=dev, requires_grad=True)
    graphed = cg.make_graphed_callables(model, (x,))
    new = torch.randn(8, 16, device=dev, requires_grad=True)
    out = graphed(new)
    out.square().sum().backward()
    grad_graphed = [p.grad.clone() for p in ref.parameters()] + [new.grad.clone()]
    for p in ref.parameters():
        p.grad = None
    new.grad = None
    ref(new).square().sum().backward()
    grads = all(close(a, b) for a, b in zip(grad_graphed, [p.grad for p in ref.parameters()] + [new.grad]))
    return f"forward matches eager {close(out, ref(new))}, gradients match {grads}"
