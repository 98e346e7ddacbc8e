"""All-reduces per token, counted, never assumed: in an eager step, and inside a captured graph.

- :func:`eager_collectives`: one eager call under ``CommDebugMode`` (a ``TorchDispatchMode``: every
  ``dist.all_reduce`` reaches aten as ``c10d.allreduce_``, and every collective DTensor issues is counted too),
  as ``{collective: count}``.
- :func:`graph_collectives`: what one replay of a captured graph ran. On GPUs: the NCCL kernels the profiler saw
  during one replay, one per collective (``ncclDevKernel_AllReduce...``; NCCL names some of its kernels
  ``ncclDevKernel_Generic`` instead, so every NCCL kernel counts, under ``nccl_kernels``, and those named for an
  all-reduce under ``all_reduce``); on the simulator: the ``c10d`` ops the capture recorded
  (:meth:`course.sim.graph.CUDAGraph.recorded_ops`).
- :func:`count_kernels_named`: the rule behind the GPU count, on plain ``(name, on_gpu)`` pairs (tested anywhere).
"""
from __future__ import annotations


def eager_collectives(fn) -> dict:
    """``{name: count}`` of the collectives one call of ``fn`` issues (names as CommDebugMode gives them)."""
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as mode:
        fn()
    out = {}
    for op, n in mode.get_comm_counts().items():
        name = str(op).split(".")[-1].rstrip("_")  # c10d.allreduce_ -> allreduce; _c10d_functional.all_reduce
        out[name] = out.get(name, 0) + n
    return out


def all_reduces(counts: dict) -> int:
    """The all-reduces in an :func:`eager_collectives` count; in a :func:`graph_collectives` count, the collective
    kernels (``nccl_kernels``) when it has them (the steps here issue all-reduces only: the eager count says so)."""
    if "nccl_kernels" in counts:
        return counts["nccl_kernels"]
    return sum(n for name, n in counts.items() if name.replace("_", "").lower().startswith("allreduce"))


def count_kernels_named(events, word: str = "allreduce") -> int:
    """GPU activities among ``events`` (``(name, on_gpu)`` pairs) whose name contains ``word`` and "nccl"
    (case and underscores ignored): NCCL launches one kernel per collective."""
    key = word.replace("_", "").lower()
    return sum(1 for name, on_gpu in events
               if on_gpu and "nccl" in name.lower() and key in name.replace("_", "").lower())


def graph_collectives(graph, replay=None) -> dict:
    """``{"all_reduce": n, "nccl_kernels": k}``: the all-reduces, and all the collectives, one replay of ``graph``
    runs (see the module doc). A step whose eager count shows only all-reduces has ``k`` all-reduces in its graph.

    GPU: ``replay()`` (default ``graph.replay``) is profiled once; simulator: the recorded ops are read.
    """
    from course.core.runtime import runtime

    if not runtime().on_gpu:
        ops = [str(o) for o in graph.recorded_ops()]
        return {"all_reduce": sum(1 for o in ops if o.startswith("c10d.allreduce")),
                "nccl_kernels": sum(1 for o in ops if o.startswith("c10d."))}
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        (replay or graph.replay)()
        torch.cuda.synchronize()
    gpu = torch.autograd.DeviceType.CUDA
    events = [(e.name, e.device_type == gpu) for e in prof.events()]
    return {"all_reduce": count_kernels_named(events), "nccl_kernels": count_kernels_named(events, "")}
