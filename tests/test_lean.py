"""The lean launch path (course.embedding.lean) and the eager-cost breakdown (course.embedding.launch_cost)."""
import pytest
import torch
import torch.nn.functional as F

import course
from course import embedding as E
from course.embedding import lean, lookup
from course.embedding.launch_cost import eager_parts_experiment, empty_kernel

ON_GPU = course.runtime().on_gpu


def test_array_params_are_numbas_order():
    t = torch.zeros(3, 5, dtype=torch.int64)
    params = lean.array_params(t)
    assert params == (0, 0, 15, 8, t.data_ptr(), 3, 5, 40, 8)
    with pytest.raises(ValueError, match="contiguous"):
        lean.array_params(t.t())


def test_available_only_on_the_gpu_path():
    assert lean.available() == (ON_GPU and lean._internals() is not None)


@pytest.mark.parametrize("use_lean", [True, False])
def test_both_launch_paths_give_f_embedding(use_lean):
    dev = course.device()
    w = torch.randn(11, 8, device=dev)
    ids = torch.tensor([[0, 3, 10], [7, 7, 1]], device=dev)
    saved = lookup.LEAN
    try:
        lookup.LEAN = use_lean
        got = E.embedding(ids, w, bounds="device" if ON_GPU else "auto")
    finally:
        lookup.LEAN = saved
    assert torch.equal(got, F.embedding(ids, w))


def test_empty_kernel_is_compiled_once():
    assert empty_kernel() is empty_kernel()


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
def test_lean_launch_is_captured_and_replays_new_ids():
    w = torch.randn(1000, 64, device="cuda")
    ids = torch.randint(0, 1000, (32,), device="cuda")
    out = torch.empty(32, 64, device="cuda")
    E.embedding(ids, w, out=out, bounds="device")  # warm up (compile)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        E.embedding(ids, w, out=out, bounds="device")
    ids.copy_(torch.randint(0, 1000, (32,), device="cuda"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, F.embedding(ids, w))


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
def test_eager_parts_quick_lean_is_cheaper():
    res = eager_parts_experiment(repeats=5)
    assert res.value("embedding_lean_vs_bare") < res.value("embedding_plain_vs_bare")
