"""What a simulated capture records, where its tensors live, and how a replay runs it without
Python.

Every aten op (:mod:`course.sim.dispatch`) and Numba launch (:mod:`course.sim.patch`) on a capturing
stream goes into a :class:`Program`, as on a GPU: a new tensor comes from the graph's pool, filled
with poison, and is the one every replay writes; an in-place write takes effect at replay; views run
at once; Python scalars are kept by value, tensors by address. Pool memory is shared as the caching
allocator shares it (a freed block may go to the next capture into the pool), so graphs sharing a
pool can overwrite each other's freed memory where a GPU can.
"""
from __future__ import annotations

import itertools
import weakref

import course.sim.memory as simmemory
import course.sim.stream as ss

ROUND, SMALL = 512, 1 << 20
_BLOCKS = weakref.WeakValueDictionary()  # (device, storage data_ptr) -> Block
_POOLS = weakref.WeakValueDictionary()  # pool handle -> Pool
_ids = itertools.count(1)

def new_handle(user: bool = True) -> tuple:
    """A fresh pool id: ``(0, n)`` from graph_pool_handle(), ``(n, 0)`` for a graph's private pool
    (as torch)."""
    n = next(_ids)
    return (0, n) if user else (n, 0)


class Block:
    """One capture allocation's memory, in a pool: a byte storage kept alive by the pool."""

    def __init__(self, pool, nbytes: int, stream, device):
        import torch

        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        # cuda -> cuda:0, as tensors say
        self.storage, self.device = buf.untyped_storage(), buf.device
        self.nbytes, self.stream, self.pool = nbytes, stream, pool
        self.internal = 0  # references held by graphs' own records
        _BLOCKS[(self.device, self.storage.data_ptr())] = self

    def free(self) -> bool:
        """True when no tensor outside the graphs' records uses this memory."""
        import torch

        return torch._C._storage_Use_Count(self.storage._cdata) <= 1 + self.internal


class Pool:
    """A graph memory pool: the blocks its captures allocated, reused when free."""

    def __init__(self, handle):
        self.handle, self.blocks, self.recording = handle, [], False

    def alloc(self, nbytes: int, stream, device="cpu") -> Block:
        """A block of ``nbytes`` or more for ``stream`` on ``device``: the smallest free one that
        fits, or a new one."""
        import torch

        size, device = max(ROUND, -(-nbytes // ROUND) * ROUND), torch.device(device)
        if device.index is None and device.type not in ("cpu", "meta"):
            device = torch.device(device.type, getattr(torch, device.type).current_device())
        best = None
        for b in self.blocks:
            if ((b.nbytes > SMALL) == (size > SMALL) and b.stream is stream and b.device == device
                    and b.nbytes >= size and (best is None or b.nbytes < best.nbytes) and b.free()):
                best = b
        if best is None:
            simmemory.check(size, sum(b.nbytes for b in list(_BLOCKS.values())))
            best = Block(self, size, stream, device)
            self.blocks.append(best)
        return best


def pool_for(handle) -> Pool:
    """The pool a handle names (made on first use; it lives as long as a graph uses it)."""
    pool = _POOLS.get(handle)
    if pool is None:
        pool = _POOLS[handle] = Pool(handle)
    return pool


class _Desc:
    """A tensor in pool memory, by address: records do not keep the memory in use."""

    __slots__ = ("block", "dtype", "offset", "shape", "stride", "numpy")

    def __init__(self, block, dtype, offset, shape, stride, numpy=False):
        self.block, self.dtype, self.offset, self.shape, self.stride, self.numpy = (block, dtype, offset, shape,
                                                                                    stride, numpy)


def _extent(t) -> int:
    if t.numel() == 0:
        return 0
    return t.storage_offset() + 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


def _poison(t) -> None:
    import torch

    if t.numel():
        if t.dtype.is_floating_point or t.dtype.is_complex:
            t.fill_(float("nan"))
        else:
            t.fill_(True if t.dtype == torch.bool else torch.iinfo(t.dtype).max)


class Program:
    """The ops and launches one capture recorded, and the pool its new tensors come from."""

    def __init__(self, pool):
        self.pool, self.steps = pool, []

    # ------------------------------------------------------------------ recording
    def ref(self, x):
        """``x`` as a record keeps it: pool tensors by address, other tensors as views of their
        memory."""
        import numpy as np
        import torch

        if isinstance(x, torch.Tensor):
            block = _BLOCKS.get((x.device, x.untyped_storage().data_ptr()))
            if block is None:
                # its memory, with its own version counter: a replay is invisible to autograd
                return x.data
            return _Desc(block, x.dtype, x.storage_offset(), tuple(x.shape), tuple(x.stride()))
        if isinstance(x, np.ndarray) and x.ndim:
            base = x
            while isinstance(base, np.ndarray) and base.base is not None:
                base = base.base
            block = (_BLOCKS.get((base.device, base.untyped_storage().data_ptr())) if isinstance(base, torch.Tensor)
                     else None)
            if block is not None:
                offset = x.__array_interface__["data"][0] - block.storage.data_ptr()
                return _Desc(block, x.dtype, offset, x.shape, x.strides, numpy=True)
        return x

    def refs(self, tree):
        """:meth:`ref` over nested args."""
        from torch.utils._pytree import tree_map

        return tree_map(self.ref, tree)

    def alloc_like(self, meta, device):
        """A poisoned tensor shaped like ``meta``, in this pool's memory."""
        import torch

        block = self.pool.alloc(_extent(meta) * meta.element_size(), ss.current_stream(), device)
        t = torch.empty(0, dtype=meta.dtype, device=device).set_(block.storage, meta.storage_offset(), meta.shape,
                                                                 meta.stride())
        _poison(t)
        return t

    def record_kernel(self, kernel, args, stream) -> None:
        """A Numba launch on a capturing stream: kept with its configuration, run at replay."""
        cap = stream.capture
        cap.note_work(stream)
        config = (kernel.grid_dim, kernel.block_dim, kernel.dynshared_size)
        self.steps.append(("kernel", kernel, config, tuple(self.ref(a) for a in args), None))

    # ------------------------------------------------------------------ ending
    def finish(self):
        """The replayable steps, with pool addresses turned into the graph's own views; and the
        blocks held."""
        import numpy as np
        import torch
        from torch.utils._pytree import tree_map

        views, held = {}, []

        def view(d):
            if not isinstance(d, _Desc):
                return d
            if d.numpy:
                base = view(_Desc(d.block, torch.uint8, 0, (d.block.nbytes,), (1,))).numpy()
                return np.ndarray(d.shape, d.dtype, buffer=base, offset=d.offset, strides=d.stride)
            key = (id(d.block), d.dtype, d.offset, d.shape, d.stride)
            if key not in views:
                views[key] = torch.empty(0, dtype=d.dtype, device=d.block.device).set_(d.block.storage, d.offset,
                                                                                         d.shape, d.stride)
                d.block.internal += 1
                held.append(d.block)
            return views[key]

        steps = []
        for kind, *rest in self.steps:
            if kind == "op":
                func, args, kwargs, outs = rest
                steps.append((kind, func, tree_map(view, args), tree_map(view, kwargs),
                              [(i, view(o)) for i, o in outs]))
            else:
                kernel, config, args, _ = rest
                steps.append((kind, kernel, config, tuple(view(a) for a in args), None))
        self.steps = []
        return steps, held


def release(held) -> None:
    """A graph is gone: its views of pool memory no longer count as uses."""
    for block in held:
        block.internal -= 1


def run(steps, launch) -> None:
    """Replay: every recorded op into its recorded outputs, every launch with ``launch(kernel,
    config, args)``."""
    import torch
    from torch.utils._pytree import tree_leaves

    with torch.inference_mode(ss.capturing() is None):
        for kind, a, b, c, d in steps:
            if kind == "kernel":
                launch(a, b, c)
                continue
            res = a(*b, **c)
            if d:
                leaves = tree_leaves(res)
                for i, out in d:
                    out.copy_(leaves[i])
