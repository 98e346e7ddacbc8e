"""The course's one launch counter: what calls of a function launched, read from a
``torch.profiler`` trace (:func:`launch_counts`, per call: ``graph_launches``, ``kernel_launches``,
``gpu_kernels``, ``gpu_ops``); :func:`count_events` counts plain ``(name, on_gpu)`` pairs, so its
rules test anywhere.
"""
from __future__ import annotations

GRAPH_LAUNCH = ("cudaGraphLaunch", "cuGraphLaunch")
# ExC: caught by the first prefix too
KERNEL_LAUNCH = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC")
NOT_A_KERNEL = ("Memcpy", "Memset")
KEYS = ("graph_launches", "kernel_launches", "gpu_kernels", "gpu_ops")


def count_events(events) -> dict:
    """Counts of :data:`KEYS` over ``events``, an iterable of ``(name, on_gpu)``: host API calls and
    GPU activities.

    A host event named like ``cudaGraphLaunch`` is a graph launch, one named like
    ``cudaLaunchKernel`` a kernel launch; every GPU activity is a GPU op, and a GPU kernel unless it
    is a copy or a memset.
    """
    out = dict.fromkeys(KEYS, 0)
    for name, on_gpu in events:
        if on_gpu:
            out["gpu_ops"] += 1
            out["gpu_kernels"] += not name.startswith(NOT_A_KERNEL)
        else:
            out["graph_launches"] += name.startswith(GRAPH_LAUNCH)
            out["kernel_launches"] += name.startswith(KERNEL_LAUNCH)
    return out


def launch_counts(fn, calls: int = 1) -> dict:
    """``{key: count / calls}`` for :data:`KEYS` over ``calls`` profiled calls of ``fn`` (GPU). Warm
    ``fn`` up first (a first call compiles or captures), and profile after any timing."""
    if calls < 1:
        raise ValueError(f"calls must be >= 1, got {calls}")
    from course.core.capture import require_gpu

    require_gpu("counting launches with the profiler")
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    gpu = torch.autograd.DeviceType.CUDA
    counts = count_events((e.name, e.device_type == gpu) for e in prof.events())
    return {k: v / calls for k, v in counts.items()}
