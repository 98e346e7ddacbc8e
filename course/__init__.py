"""Capture & Replay: a hands-on course on GPU launch overhead and CUDA Graphs.

``import course`` first in every notebook: it makes the course's one runtime
decision (real GPU or Numba CUDA simulator) before numba is imported.
"""
from course.core.runtime import (CourseEnvironmentError, as_numba, cuda, graphs, numba_stream, runtime,
                                 synchronize, torch_device)
from course.core.answers import show_answer  # an exercise's answer, on request only (course.core.answers)

__version__ = "0.1.0"


def device():
    """The torch.device that course tensors live on (cuda:0 on the GPU path, cpu on the simulator).
    """
    return torch_device()


def header() -> None:
    """Print the path the notebook runs on; the first cell of every notebook calls it."""
    rt = runtime()
    print(rt.describe())
    for fix in rt.fixes:
        print(f"  to use a GPU: {fix}")


__all__ = ["CourseEnvironmentError", "as_numba", "cuda", "device", "graphs", "header", "numba_stream",
           "runtime", "show_answer", "synchronize", "torch_device", "__version__"]
