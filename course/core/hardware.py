"""What the GPU's datasheet would say, read from the device itself: L2 size and peak DRAM bandwidth;
:func:`release_memory`, which hands the memory nothing holds any more back to the device; and
:func:`release_blas_workspaces`, which drops the cuBLAS workspaces torch keeps per stream.

Bandwidth figures mean DRAM bandwidth only when the data is well above the L2 cache; below that the
data sits in L2 and a kernel can move it faster than the memory could. Lessons use
:func:`memory_facts` to label the L2-resident region and to quote the hardware peak beside a
measured one.
"""
from __future__ import annotations

from course.core.runtime import runtime


def peak_dram_gbps(memory_clock_khz: float, bus_width_bits: int) -> float:
    """Peak DRAM bandwidth in GB/s from the memory clock (kHz, as CUDA reports it) and bus width
    (bits).

    Double data rate: two transfers per clock, ``bus_width_bits / 8`` bytes each.
    """
    if memory_clock_khz <= 0 or bus_width_bits <= 0:
        raise ValueError("memory clock and bus width must be positive")
    return 2 * memory_clock_khz * 1e3 * (bus_width_bits / 8) / 1e9


def memory_facts() -> dict:
    """``{"l2_bytes", "peak_dram_GBps", "memory_clock_khz", "bus_width_bits"}`` of the current GPU
    (GPU only).

    Read from CUDA's device attributes (through numba-cuda; torch exposes the L2 size too). A value
    the driver does not report is None.
    """
    rt = runtime()
    if not rt.on_gpu:
        raise RuntimeError("memory_facts() reads a real GPU's attributes; "
                           "this machine runs the simulator path")
    import torch

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    facts = {"l2_bytes": getattr(props, "L2_cache_size", None), "memory_clock_khz": None, "bus_width_bits": None}
    clock = getattr(props, "memory_clock_rate", None)
    width = getattr(props, "memory_bus_width", None)
    if not (clock and width):
        from course.core.runtime import cuda

        dev = cuda().get_current_device()
        clock = clock or getattr(dev, "MEMORY_CLOCK_RATE", None)
        width = width or getattr(dev, "GLOBAL_MEMORY_BUS_WIDTH", None)
        facts["l2_bytes"] = facts["l2_bytes"] or getattr(dev, "L2_CACHE_SIZE", None)
    facts["memory_clock_khz"], facts["bus_width_bits"] = clock, width
    facts["peak_dram_GBps"] = peak_dram_gbps(clock, width) if clock and width else None
    return facts


def release_memory() -> None:
    """Collect garbage, wait for the GPU and empty torch's caching allocator: what stays reserved is
    held by live objects.

    Experiments call it between variants (and before reading ``torch.cuda.memory_reserved()``), so
    one variant's freed blocks neither count against the next one nor crowd it out. Without CUDA it
    only collects garbage.
    """
    import gc

    gc.collect()
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def release_blas_workspaces() -> bool:
    """Drop the cuBLAS workspaces torch keeps per (handle, stream) (32 MiB each on Hopper; one a
    capture allocated pins its graph pool's segment). True when dropped; False without CUDA, while
    capturing, or in a torch without ``torch._C._cuda_clearCublasWorkspaces``."""
    import torch

    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None or not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return False
    if torch.cuda.is_current_stream_capturing():
        return False
    clear()
    return True
