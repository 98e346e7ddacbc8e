"""The simulator's device memory limit, record_stream, and generator state in captures (simulator only).

Their both-path behaviour is tested in tests/test_torch_graph_behaviours.py; here: the stand-in's own pieces.
"""
import pytest
import torch

import course
from course.core.runtime import runtime
from course.parity import torch_behaviours as parity_torch
from course.sim import dispatch as simdispatch, graph as simgraph, memory as simmemory
from course.sim import rng as simrng, stream as simstream

pytestmark = pytest.mark.skipif(runtime().on_gpu, reason="the simulator's own behaviour")


@pytest.fixture(autouse=True)
def _clean():
    yield
    simgraph.end_all_captures()


def test_format_size_writes_bytes_as_cuda_does():
    assert [simmemory.format_size(n) for n in (512, 1024, 20 << 20, 3 << 29, 1 << 42)] == [
        "512 bytes", "1024 bytes", "20.00 MiB", "1.50 GiB", "4096.00 GiB"]


def test_check_refuses_only_past_the_limit(monkeypatch):
    monkeypatch.setattr(simmemory, "LIMIT", 1 << 20)
    simmemory.check(1 << 19, 1 << 19)  # exactly full: fine
    with pytest.raises(torch.OutOfMemoryError, match=r"CUDA out of memory. Tried to allocate 1024.00 KiB"):
        simmemory.check(1 << 20, 1)


@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty")
def test_a_smaller_limit_stands_for_a_smaller_card(monkeypatch):
    cg = course.graphs()
    monkeypatch.setattr(simmemory, "LIMIT", 1 << 20)
    x, g = torch.ones(16), cg.CUDAGraph()
    with cg.graph(g):
        y = x * 2  # a small block: fits
    with pytest.raises(torch.OutOfMemoryError, match="out of memory"):
        with cg.graph(cg.CUDAGraph()):
            torch.zeros(1 << 19)  # 2 MiB: past a 1 MiB card
    simgraph.end_all_captures()
    g.replay()
    assert torch.equal(y, x * 2)


def test_record_stream_takes_simulated_streams_and_leaves_others_to_torch():
    course.graphs()
    simmemory.install()  # a second call changes nothing
    t = torch.ones(2)
    assert t.record_stream(simstream.Stream()) is None
    with pytest.raises((RuntimeError, TypeError)):
        t.record_stream("not a stream")


def test_rng_patches_record_a_save_and_a_restore_only_in_a_capture():
    names = [(owner.__name__, name) for owner, name, _ in simrng.patches(torch)]
    assert names == [("torch", "get_rng_state"), ("torch", "set_rng_state"),
                     ("torch.random", "get_rng_state"), ("torch.random", "set_rng_state")]
    cg = course.graphs()
    g = cg.CUDAGraph()
    with cg.graph(g):
        state = torch.get_rng_state()
        a = torch.rand(4)
        torch.set_rng_state(state)
        b = torch.rand(4)
    ops = g.recorded_ops()
    assert "_save" in ops[0] and any("_restore" in o for o in ops)
    for _ in range(2):
        g.replay()
        assert torch.equal(a, b)  # the restore makes the second draw repeat the first, in every replay
    first = a.clone()
    g.replay()
    assert not torch.equal(a, first)  # while each replay draws fresh numbers
    assert torch.get_rng_state is not None and torch.get_rng_state().dtype == torch.uint8  # torch's own again


def test_an_in_place_op_with_no_meta_kernel_is_recorded():
    cg = course.graphs()
    p, grad, buf = torch.ones(4), torch.full((4,), 0.5), torch.zeros(4)
    g = cg.CUDAGraph()
    with cg.graph(g):  # _fused_sgd_ has no meta kernel: recorded as it is, run at replay
        torch._fused_sgd_([p], [grad], [buf], weight_decay=0.0, momentum=0.9, lr=0.1, dampening=0.0,
                          nesterov=False, maximize=False, is_first_step=False)
    assert torch.equal(p, torch.ones(4))
    g.replay()
    assert torch.allclose(p, torch.full((4,), 0.95))
    assert simdispatch._meta(torch.ops.aten._fused_sgd_.default, ([p], [grad], [buf]), {
        "weight_decay": 0.0, "momentum": 0.9, "lr": 0.1, "dampening": 0.0, "nesterov": False, "maximize": False,
        "is_first_step": False}) is simdispatch.NO_META


def test_parity_torch_names_its_programs():
    with pytest.raises(KeyError, match="no program"):
        parity_torch.run("nope")
    assert set(parity_torch.PROGRAMS) == set(parity_torch.EXPECTED)
