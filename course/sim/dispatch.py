"""How a simulated capture routes aten ops: recorded (:mod:`course.sim.record`), or refused as host
reads.

:class:`Recorder` (a ``TorchDispatchMode``) records an op on a capturing stream and runs one on
another stream at once; host reads (``_local_scalar_dense``, ``nonzero``, boolean masks...) are
refused with the GPU's error. Each op runs on meta tensors first, so a bad shape raises at capture,
as on a GPU. A collective is recorded and really runs at each replay over its group
(:class:`Collective`); NCCL's lazy communicator is not modelled, and a DTensor capture is refused
(:func:`refuse_dtensor`).
"""
from __future__ import annotations

import course.sim.stream as ss

# aten ops that read device memory on the host (their output size, or a value): a GPU waits for them
_SIZED = "sizes its output from device values"
HOST_READS = {"_local_scalar_dense": "reads a device value on the host "
                                     "(.item(), float(t), int(t), if t:)",
              "nonzero": f"{_SIZED} (nonzero, "
                         "torch.where(cond), argwhere)", "masked_select": _SIZED,
              "unique_dim": _SIZED, "_unique": _SIZED, "_unique2": _SIZED, "unique_consecutive": _SIZED,
              "equal": "returns a Python bool computed on the device", "bincount": _SIZED}
# memory only: nothing to run
EMPTY = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"}
HOST_SIDE = {"resize_", "set_", "resize_as_"}  # metadata changes made on the host


def _as_meta(x):
    import torch

    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    if isinstance(x, torch.device):
        return torch.device("meta")
    return None if isinstance(x, torch.Generator) else x


NO_META = object()  # _meta's answer for an op with no meta kernel (None is what an op returning nothing returns)


def _meta(func, args, kwargs):
    """``func`` run on meta tensors: the outputs' shapes, dtypes and strides (:data:`NO_META` when
    it has no meta kernel)."""
    import torch
    from torch.utils._pytree import tree_map

    margs, mkwargs = tree_map(_as_meta, (args, kwargs))
    if "device" in mkwargs:
        mkwargs["device"] = torch.device("meta")
    if mkwargs.get("pin_memory"):
        mkwargs["pin_memory"] = False
    try:
        return func(*margs, **mkwargs)
    except NotImplementedError:
        return NO_META


def _real_error(func, args, kwargs):
    """The error ``func`` raises when run for real (on copies: nothing is written), or None."""
    import torch
    from torch.utils._pytree import tree_map

    cargs, ckwargs = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, (args, kwargs))
    try:
        func(*cargs, **ckwargs)
    except Exception as e:  # noqa: BLE001 - returned to be raised
        return e.with_traceback(None)
    return None


def _host_read(func, name: str, args, kwargs):
    """Why ``func`` would read device memory on the host (so a GPU refuses it during capture), or
    None."""
    import torch

    if name in HOST_READS:
        return f"aten.{name} {HOST_READS[name]}"
    if name == "repeat_interleave" and func._overloadname == "Tensor" and kwargs.get("output_size") is None:
        return "aten.repeat_interleave with tensor repeats sizes its output from device values"
    if name in ("index", "index_put_", "index_put", "_index_put_impl_"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ()):
            return f"aten.{name} with a boolean mask finds the selected elements on the host (nonzero)"
    return None


class Collective:
    """A recorded ``c10d`` op: at replay it runs over the process group and is waited for (a GPU
    stream orders the collective's kernel before the next one; gloo returns a ``Work`` that must be
    waited on)."""

    def __init__(self, func):
        self.func = func

    def __call__(self, *args, **kwargs):
        import torch
        from torch.utils._pytree import tree_leaves

        res = self.func(*args, **kwargs)
        for leaf in tree_leaves(res):
            if isinstance(leaf, torch.ScriptObject) and hasattr(leaf, "wait"):
                leaf.wait()
        return res

    def __str__(self) -> str:
        return str(self.func)


def _aliased(schema, args, kwargs, alias):
    """The argument a return value aliases (the tensor an in-place or out= op wrote into)."""
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.before_set == alias.before_set:
            return args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name, a.default_value)
    raise NotImplementedError(f"the simulated capture cannot tell what {schema.name} returns")


def refuse_dtensor(args, kwargs) -> None:
    """Raise NotImplementedError when an op's arguments hold a DTensor: the simulated capture does
    not record them."""
    import sys

    # only once DTensor is loaded: never import it here
    mod = sys.modules.get("torch.distributed.tensor._api")
    if mod is None or not hasattr(mod, "DTensor"):
        return
    from torch.utils._pytree import tree_leaves

    if any(isinstance(t, mod.DTensor) for t in tree_leaves((args, kwargs))):
        raise NotImplementedError("the simulated capture does not record DTensor programs (a "
                                  "DTensor's op becomes several ops on its local shards); run "
                                  "this capture on GPUs, or capture plain tensors and explicit "
                                  "collectives (dist.all_reduce), which the simulator records")


def record_op(cap, func, args, kwargs):
    """Record one aten op on capture ``cap`` and return what the op returns at capture (see the
    module doc)."""
    import torch
    from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten

    schema = func._schema
    name = schema.name.split("::")[-1]
    refuse_dtensor(args, kwargs)
    why = _host_read(func, name, args, kwargs)
    if why:
        ss.on_sync(why)  # the sync debug mode speaks first, as torch's does (it checks before calling CUDA)
        ss.refuse_sync(why, cap)
    if func.is_view or torch.Tag.inplace_view in func.tags or name in HOST_SIDE:
        return func(*args, **kwargs)
    if torch.Tag.nondeterministic_seeded in func.tags:
        gen = kwargs.get("generator") or next((a for a in args if isinstance(a, torch.Generator)), None)
        if gen is not None and not any(g._cdata == gen._cdata for g in cap.generators):
            raise RuntimeError("Attempt to increase offset for a "
                               "CUDA generator not in capture mode.")
    writes = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
    try:
        meta = _meta(func, args, kwargs)
    except Exception as e:  # noqa: BLE001 - a bad shape or dtype: raise what the real op raises, as a GPU does
        raise _real_error(func, args, kwargs) or e from None
    if meta is NO_META:
        if writes and not all(r.alias_info is not None for r in schema.returns):
            raise NotImplementedError("the simulated capture cannot record "
                                      f"{schema.name} (no meta kernel)")
        # in place with nothing new to allocate (a fused optimizer's step, ``_fused_sgd_``): record
        # it as it is; functional: safe to run for its shapes
        meta = None if writes else tree_map(_as_meta, func(*args, **kwargs))
    device = next((t.device for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)),
                  kwargs.get("device") or torch.device("cpu"))
    program, outs = cap.program, []
    aliases = [r.alias_info for r in schema.returns]
    if any(aliases):
        result = [_aliased(schema, args, kwargs, a) if a is not None else m
                  for a, m in zip(aliases, (meta if len(aliases) > 1 else (meta,)) if meta is not None
                                  else (None,) * len(aliases))]
        result = tuple(result) if len(aliases) > 1 else result[0]
    else:
        result = meta
    leaves, spec = tree_flatten(result)
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor) and leaf.device.type == "meta":
            leaves[i] = program.alloc_like(leaf, device)
            outs.append((i, program.ref(leaves[i])))
    if name not in EMPTY:
        cap.note_work(ss.current_stream())
        if schema.name.startswith("c10d::"):
            func = Collective(func)
        program.steps.append(("op", func, program.refs(args), program.refs(kwargs), outs))
    return tree_unflatten(leaves, spec)


def _composite(func) -> bool:
    """True for an op made of other aten ops (CompositeImplicitAutograd: ``linear``, ``to``,
    ``matmul``...).

    Outside ``inference_mode`` autograd splits such an op before a dispatch mode sees it; under it
    the mode gets the op whole, and its returns' alias annotations ("may alias") cannot say whether
    it made a new tensor. The recorder splits it the same way, so a capture records the same ops in
    both modes."""
    import torch

    return torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), torch._C.DispatchKey.CompositeImplicitAutograd)


def _recorder_class():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        """Routes every aten op to the capture of the current stream (ops on other streams run at
        once)."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            cap = ss.capturing()
            if cap is not None and _composite(func):  # under inference_mode, autograd's decomposition is skipped
                with self:
                    out = func.decompose(*args, **kwargs)
                if out is not NotImplemented:
                    return out
            if cap is None:
                if ss._ACTIVE:
                    ss.OUTSIDE[0] += 1
                watch = _watch[0] or ss.sync_debug_mode()
                why = watch and _host_read(func, func._schema.name.split("::")[-1], args, kwargs)
                if why:
                    ss.on_sync(why)  # torch's sync debug mode ("warn" or "error"), when it is on
                    if _watch[0]:
                        raise ss._accelerator_error(f"{ss.SYNC} ({why})")
                return func(*args, **kwargs)
            return record_op(cap, func, args, kwargs)

    return Recorder


_mode: list = []
_watch = [0]  # host_reads_refused() blocks under way


def begin() -> None:
    """Start routing aten ops to captures (the first capture under way pushes the mode)."""
    if not _mode:
        _mode.append(_recorder_class()())
        _mode[0].__enter__()


def end() -> None:
    """Stop routing when no capture, no watch and no sync debug mode is under way any more."""
    if _mode and not ss._ACTIVE and not _watch[0] and not ss.sync_debug_mode():
        _mode.pop().__exit__(None, None, None)


def begin_watch() -> None:
    """Refuse aten host reads even outside a capture (:func:`course.sim.patch.host_reads_refused`).
    """
    _watch[0] += 1
    begin()


def end_watch() -> None:
    """End one :func:`begin_watch`."""
    _watch[0] -= 1
    end()
