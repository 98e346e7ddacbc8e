"""course.core.profiling (the one launch counter), course.core.compiled (torch.compile's state) and release_memory."""
from __future__ import annotations

import pytest

from course.core import compiled, hardware, profiling
from course.core.runtime import runtime

gpu = pytest.mark.skipif(not runtime().on_gpu, reason="needs a real GPU")


def test_count_events_tells_launches_kernels_and_copies_apart():
    events = [("cudaGraphLaunch", False), ("cudaLaunchKernel", False), ("cudaLaunchKernelExC", False),
              ("cuLaunchKernel", False), ("cudaMemcpyAsync", False), ("aten::add_", False),
              ("void add_kernel<float>", True), ("Memcpy HtoD (Pageable -> Device)", True), ("Memset (Device)", True)]
    got = profiling.count_events(events)
    assert got == {"graph_launches": 1, "kernel_launches": 3, "gpu_kernels": 1, "gpu_ops": 3}


@pytest.mark.parametrize("events,key,want", [
    ([("cudaGraphLaunch", True)], "graph_launches", 0),      # a GPU activity is never a host launch
    ([("Memcpy DtoH", True)], "gpu_kernels", 0),              # a copy is a GPU op, not a kernel
    ([("Memcpy DtoH", True)], "gpu_ops", 1),
    ([("cudaGraphLaunch", False)], "kernel_launches", 0),     # a graph launch is not a kernel launch
    ([("cudaStreamSynchronize", False)], "kernel_launches", 0),
])
def test_count_events_rules_one_by_one(events, key, want):
    assert profiling.count_events(events)[key] == want


def test_launch_counts_refuses_bad_calls_and_names_the_gpu():
    with pytest.raises(ValueError, match="calls must be >= 1"):
        profiling.launch_counts(lambda: None, calls=0)
    if not runtime().on_gpu:
        with pytest.raises(Exception, match="needs a real GPU"):
            profiling.launch_counts(lambda: None)


@gpu
def test_launch_counts_per_call_on_a_gpu():
    import torch

    x = torch.zeros(16, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        x.add_(1)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        x.add_(1)
        x.mul_(2)
    replay = profiling.launch_counts(g.replay, calls=4)
    assert replay["graph_launches"] == 1 and replay["kernel_launches"] == 0 and replay["gpu_kernels"] == 2
    eager = profiling.launch_counts(lambda: x.add_(1), calls=3)
    assert eager["graph_launches"] == 0 and eager["kernel_launches"] == 1 and eager["gpu_kernels"] == 1


def test_reset_compile_forgets_counters_anywhere():
    from torch._dynamo.utils import counters

    counters["graph_break"]["a test break"] += 2
    assert compiled.compile_counters()["graph_breaks"] == 2
    compiled.reset_compile()
    assert compiled.compile_counters() == {"cudagraph_skips": 0, "graph_breaks": 0, "unique_graphs": 0}


def test_compile_counters_see_a_compile():
    import torch

    compiled.reset_compile()
    f = torch.compile(lambda t: t * 2 + 1, backend="eager")
    f(torch.ones(3))
    assert compiled.compile_counters()["unique_graphs"] >= 1
    compiled.reset_compile()


def test_release_memory_runs_anywhere():
    hardware.release_memory()
