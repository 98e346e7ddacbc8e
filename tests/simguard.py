"""Helpers shared by the test files that capture on either path (the suite's conftest.py sees that no
capture is left under way after a test, and no earlier file's graph is freed inside a capture).

:func:`verdict` runs one of :mod:`course.parity.torch_behaviours`'s failing captures on the path this machine has.

:func:`one_rank` (and the fixture :func:`one_rank_group`) is a process group of this one process.
"""
from __future__ import annotations

import contextlib
import datetime
import gc
import socket

import pytest
import torch
import torch.distributed as dist

from course.core.runtime import runtime
from course.parity import torch_behaviours as parity_torch


@contextlib.contextmanager
def one_rank(backend: str = "gloo"):
    """A process group of one rank (this process) over ``backend``, torn down after the block (graphs freed and,
    with NCCL, the GPU synchronized first: NCCL's teardown with live graphs has hung)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        yield
    finally:
        gc.collect()
        if backend == "nccl":
            torch.cuda.synchronize()
        dist.destroy_process_group()


@pytest.fixture
def one_rank_group():
    """A one-rank gloo process group for the test (:func:`one_rank`)."""
    with one_rank():
        yield


def verdict(name: str) -> str:
    """A failing-capture program's verdict: here on the simulator, in a fresh process on a GPU."""
    if runtime().on_gpu:
        from course.core.isolate import run_isolated
        return run_isolated("course.parity.torch_behaviours", "run", timeout=120, name=name)
    return parity_torch.run(name)
