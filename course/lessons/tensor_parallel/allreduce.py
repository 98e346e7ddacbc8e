"""The all-reduce between a rank's kernels, two ways: NCCL's collective, or every rank reading its
peers' buffers.

- ``"nccl"``: ``dist.all_reduce(x, group=...)``, in place: the process group's collective (NCCL on
  GPUs, where it picks a ring or a tree of the ranks and pipelines the message through them; gloo on
  a laptop's CPU processes).
- ``"symm_one_shot"``: torch's symmetric memory (``torch.distributed._symmetric_memory``): every
  rank allocates the same buffer with ``symm_mem.empty`` and ``rendezvous`` maps every peer's buffer
  into its own address space (NVLink peer-to-peer). ``one_shot_all_reduce_copy_out`` copies ``x``
  into this rank's buffer, waits at a barrier of signal flags until every rank has done the same,
  then each rank reads **all** peers' buffers and sums them itself into ``x``: one step, ``world``
  reads per element; a closing barrier keeps the buffer from being reused while a peer still reads
  it.
- ``"symm_two_shot"``: the same buffers, two steps (``two_shot_all_reduce_``, in place on a
  symmetric ``x``): each rank sums one ``1/world`` slice from every peer (a reduce-scatter), writes
  the sum into every peer's buffer (an all-gather), with barriers between: fewer bytes read per
  rank, one more barrier.

**Multicast** (NVLink SHARP, NVSwitch multimem instructions: ``multimem_all_reduce_``, NCCL's NVLS
algorithms) would let the switch add the ranks' values as they pass, one load for all peers. The
machines that record the course keep it off (``NCCL_NVLS_ENABLE=0``,
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``): :func:`keep_multicast_off` sets these where they are unset
and never turns multicast on; the peer-to-peer one- and two-shot kernels need no multicast.

:func:`unavailable` says why a mode cannot run here ("" when it can): the symmetric-memory modes
need CUDA tensors, an NCCL process group and the ops (``torch.ops.symm_mem``); a laptop's gloo
processes run ``"nccl"``'s call over gloo, and the lesson says what that does not model.
"""
from __future__ import annotations

import os

MODES = ("nccl", "symm_one_shot", "symm_two_shot")
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
_OPS = {"symm_one_shot": ("one_shot_all_reduce_copy_out", "one_shot_all_reduce_out"),
        "symm_two_shot": ("two_shot_all_reduce_",)}


def keep_multicast_off() -> dict:
    """Set :data:`MULTICAST_OFF` in this process's environment where unset (never enabling
    multicast); the values now in force, to record beside the measurements. Call it before the
    worker processes start."""
    for k, v in MULTICAST_OFF.items():
        os.environ.setdefault(k, v)
    return {k: os.environ[k] for k in MULTICAST_OFF}


def unavailable(mode: str, backend: str = "nccl") -> str:
    """Why ``mode`` cannot run with a process group of ``backend`` here; "" when it can."""
    if mode not in MODES:
        return f"unknown all-reduce {mode!r}: choose one of {MODES}"
    if mode == "nccl":
        return ""
    if backend != "nccl":
        return (f"{mode} reads peers' GPU buffers over NVLink (torch's symmetric memory): it "
                f"needs CUDA tensors and an NCCL process group; this run uses {backend} (CPU "
                "processes), so only 'nccl' (dist.all_reduce, here over gloo) runs")
    try:
        import torch
        import torch.distributed._symmetric_memory as symm_mem  # noqa: F401
    except ImportError as e:
        return f"this torch has no torch.distributed._symmetric_memory ({e}); use 'nccl'"
    missing = [n for n in _OPS[mode] if not hasattr(torch.ops.symm_mem, n)]
    if len(missing) == len(_OPS[mode]):
        return (f"this torch ({torch.__version__}) has no torch.ops.symm_mem.{_OPS[mode][0]}; use "
                "'nccl' (or a torch whose symmetric memory has it)")
    return ""


def _rendezvous(t, group) -> str:
    """Map ``t`` (from ``symm_mem.empty``) into every rank of ``group``; returns the group's name
    for the ops."""
    import warnings

    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    group = group or dist.group.WORLD
    try:
        symm_mem.rendezvous(t, group)
    except RuntimeError:  # an older torch wants the group enabled first (deprecated in newer ones)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(group.group_name)
        symm_mem.rendezvous(t, group)
    return group.group_name


def residual_buffer(mode: str, n: int, dtype, device, group=None):
    """The residual stream ``[n]`` (zeros) for ``mode``: a symmetric-memory tensor for
    ``"symm_two_shot"`` (it reduces in place, writing into every peer's buffer), a plain tensor
    otherwise. Collective for symm modes."""
    import torch

    if mode != "symm_two_shot":
        return torch.zeros(n, dtype=dtype, device=device)
    import torch.distributed._symmetric_memory as symm_mem

    x = symm_mem.empty(n, dtype=dtype, device=device)
    x.zero_()
    _rendezvous(x, group)
    return x


def make_all_reduce(mode: str, x, group=None):
    """A function of no arguments that sums ``x`` over the ranks of ``group`` in place (see the
    module doc).

    ``x``: the residual stream (:func:`residual_buffer`). Refuses, with the reason, a mode
    :func:`unavailable` here. Every rank must call this (the symm modes allocate and rendezvous a
    buffer: a collective).
    """
    import torch
    import torch.distributed as dist

    backend = dist.get_backend(group) if dist.is_initialized() else "none"
    why = unavailable(mode, backend if x.is_cuda else "gloo")
    if why:
        raise ValueError(why)
    if mode == "nccl":
        def nccl():
            dist.all_reduce(x, group=group)
        return nccl
    ops = torch.ops.symm_mem
    if mode == "symm_two_shot":
        name = _rendezvous(x, group)

        def two_shot():
            ops.two_shot_all_reduce_(x, "sum", name)
        return two_shot
    import torch.distributed._symmetric_memory as symm_mem

    buf = symm_mem.empty(x.numel(), dtype=x.dtype, device=x.device)
    name = _rendezvous(buf, group)
    if hasattr(ops, "one_shot_all_reduce_copy_out"):
        def one_shot():  # x copied into this rank's buffer, every peer's read, the sum written to x
            ops.one_shot_all_reduce_copy_out(buf, x, "sum", name, x)
        return one_shot

    def one_shot_copy():  # an older torch: copy in first (one more kernel)
        buf.copy_(x)
        ops.one_shot_all_reduce_out(buf, "sum", name, x)
    return one_shot_copy
