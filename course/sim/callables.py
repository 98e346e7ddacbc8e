"""``make_graphed_callables`` on the simulator: torch's algorithm, run on the stand-in graphs and
streams.

Like ``torch.cuda.make_graphed_callables``: warm each callable up on a side stream, capture the
forward passes in order and the backward passes in reverse into one shared pool, and return
callables (or modules whose ``forward`` is replaced) that copy their arguments into the static
inputs and replay. Under autocast with its cast cache on, it refuses with torch's error
(``cache_enabled=False`` is the fix). A module whose ``training`` flag differs from the one it was
graphed in runs its original forward. Gradients come from the captured backward graph when outputs
require grad, as in torch.
"""
from __future__ import annotations

import course.sim.graph as sg
import course.sim.stream as ss


def _check(callables, sample_args):
    import torch
    from torch.utils._pytree import arg_tree_leaves

    flat = []
    for c, args in zip(callables, sample_args):
        if isinstance(c, torch.nn.Module):
            if c._backward_hooks or c._forward_hooks or c._forward_pre_hooks:
                raise AssertionError("Modules must not have hooks registered at the time they "
                                     "are passed. However, registering hooks on modules after "
                                     "passing them through make_graphed_callables is allowed.")
            if not all(b.requires_grad is False for b in c.buffers()):
                raise AssertionError("In any :class:`~torch.nn.Module` passed to "
                                     ":func:`~make_graphed_callables`, only parameters may be "
                                     "trainable. All buffers must have ``requires_grad=False``.")
        leaves = tuple(arg_tree_leaves(*args))
        if not all(isinstance(a, torch.Tensor) for a in leaves):
            raise AssertionError("In the beta API, sample_args for each callable must "
                                 "contain only Tensors. Other types are not allowed.")
        flat.append(leaves)
    return flat


AUTOCAST_CACHE = ("make_graphed_callables does not support the autocast caching. Please set "
                  "`cache_enabled=False`.")


def _autocast_caching() -> bool:
    """True under autocast with its cast cache on, which torch's ``make_graphed_callables`` refuses
    (on the simulator the CPU's autocast is the device's)."""
    import torch

    return torch.is_autocast_cache_enabled() and any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda"))


def _grads(outputs, surface, grad_outputs, allow_unused):
    import torch

    return torch.autograd.grad(outputs=outputs, inputs=tuple(i for i in surface if i.requires_grad),
                               grad_outputs=grad_outputs, only_inputs=True, allow_unused=allow_unused)


def make_graphed_callables(callables, sample_args, num_warmup_iters: int = 3, allow_unused_input: bool = False,
                           pool=None):
    """Graphed versions of ``callables`` (a function or module, or a tuple of them), as
    torch.cuda's."""
    import torch
    from torch.utils._pytree import tree_flatten, tree_leaves

    if _autocast_caching():
        raise RuntimeError(AUTOCAST_CACHE)
    one = not isinstance(callables, tuple)
    callables, sample_args = ((callables,), (sample_args,)) if one else (callables, sample_args)
    flat = _check(callables, sample_args)
    params = [tuple(c.parameters()) if isinstance(c, torch.nn.Module) else () for c in callables]
    surfaces = [flat[i] + params[i] for i in range(len(callables))]
    fwd = [sg.CUDAGraph() for _ in callables]
    bwd = [sg.CUDAGraph() for _ in callables]
    mempool = sg.graph_pool_handle() if pool is None else pool

    ss.synchronize()
    with ss.stream(ss.Stream()):
        for func, args, surface in zip(callables, sample_args, surfaces):
            for _ in range(num_warmup_iters):
                outputs = tree_leaves(func(*args))
                need = tuple(o for o in outputs if o.requires_grad)
                if need:
                    _grads(need, surface, tuple(torch.empty_like(o) for o in need), allow_unused_input)
    ss.synchronize()

    static_outputs, specs = [], []
    for func, args, g in zip(callables, sample_args, fwd):
        with sg.graph(g, pool=mempool):
            outputs = func(*args)
        leaves, spec = tree_flatten(outputs)
        static_outputs.append(tuple(leaves))
        specs.append(spec)

    grad_outs, grad_ins = [], []
    for surface, outs, g in zip(reversed(surfaces), reversed(static_outputs), reversed(bwd)):
        static_grad_outputs = tuple(torch.empty_like(o) if o.requires_grad else None for o in outs)
        need = tuple(o for o in outs if o.requires_grad)
        grads = None
        if need:
            with sg.graph(g, pool=mempool):
                grads = _grads(need, surface, tuple(o for o in static_grad_outputs if o is not None),
                               allow_unused_input)
        it = iter(grads or ())
        grad_ins.append(tuple(next(it) if a.requires_grad and grads is not None else None for a in surface))
        grad_outs.append(static_grad_outputs)
    grad_outs.reverse()
    grad_ins.reverse()

    graphed = [_graphed(fwd[i], bwd[i], params[i], len(flat[i]), specs[i], surfaces[i], static_outputs[i],
                        grad_outs[i], grad_ins[i]) for i in range(len(callables))]
    ret = []
    for func, fn in zip(callables, graphed):
        if isinstance(func, torch.nn.Module):
            func.forward = _module_forward(func, func.training, fn, func.forward)
            ret.append(func)
        else:
            ret.append(fn)
    return ret[0] if one else tuple(ret)


def _module_forward(module, training, graphed, original):
    def forward(*args, **kwargs):
        return graphed(*args, **kwargs) if module.training == training else original(*args, **kwargs)
    return forward


def _graphed(fwd, bwd, params, n_user, spec, surface, outputs, grad_outputs, grad_inputs):
    """The autograd function that replays ``fwd`` (and ``bwd`` for the gradients) for one callable.
    """
    import torch
    from torch.utils._pytree import arg_tree_leaves, tree_unflatten

    class Graphed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            for i in range(n_user):
                if surface[i].data_ptr() != inputs[i].data_ptr():
                    surface[i].copy_(inputs[i])
            fwd.replay()
            return tuple(o.detach() for o in outputs)

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, *grads):
            for g, grad in zip(grad_outputs, grads):
                if g is not None and g.data_ptr() != grad.data_ptr():
                    g.copy_(grad)
            bwd.replay()
            return tuple(b.detach() if b is not None else b for b in grad_inputs)

    def functionalized(*user_args):
        out = Graphed.apply(*(tuple(arg_tree_leaves(*user_args)) + params))
        return tree_unflatten(out, spec)

    return functionalized
