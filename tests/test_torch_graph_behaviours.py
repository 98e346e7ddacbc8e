"""The behaviours PyTorch's own CUDA-graph tests check (test/test_cuda.py), in the course's words, on both paths.

Each test names the PyTorch test it mirrors (``mirrors: TestCuda.test_...``). The same body runs on the simulator in
CI (``cg`` is :mod:`course.sim.cuda`, tensors on the CPU) and on a GPU (``cg`` is ``torch.cuda``), so a laptop ✓ is a
GPU ✓. Captures that fail run each in a fresh process on a GPU (:mod:`course.parity.torch_behaviours`). The optimizer and
grad-scaling tests are in tests/test_torch_graph_optims.py.

PyTorch graph tests this file and its twin leave out, and why (the README and CAPTURE_RULES.md point here):

=====================================================  ===========================================================
PyTorch test                                           why the course does not mirror it here
=====================================================  ===========================================================
test_graph_error, test_cuda_graph_tensor_item_not_      already parity programs (course.parity.programs: default_stream,
allowed, test_graph_manual_seed_mismatch_raises         item, manual_seed), run on both paths by test_simgraph.py
test_cuda_graph_error_options (its thread)             a second thread allocating during a capture: the simulator
                                                       runs one thread (not modelled, course/sim/graph.py)
test_graph_cudnn_dropout                               cuDNN's RNN dropout state: no cuDNN on the simulator
test_graph_memory_stats_and_use_result_after_          the allocator's statistics (torch.cuda.memory_stats) are
destroy_graph (its statistics),                        not modelled; the "use the result after the graph is
test_cuda_graph_allocator_propagates_stream            destroyed" part is mirrored below
test_repeat_graph_capture_cublas_workspace_memory,     cuBLAS workspaces and cudaMallocAsync: libraries and
test_graph_capture_oom under cudaMallocAsync           allocators a laptop does not have
test_graph_debugdump, test_cuda_graph_raw_graph*       ``debug_dump``, ``keep_graph`` and the raw cudaGraph_t do
(keep_graph, instantiate, raw_cuda_graph_exec)         not exist on the simulator (not modelled)
test_graph_optims for ASGD, Rprop; test_graph_rng_     the course's optimizers (Adam, AdamW, SGD) and five more
functional for rrelu                                   with ``capturable`` are mirrored, and four random ops; the
                                                       others are not met in the course
=====================================================  ===========================================================
"""
import gc
import warnings

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import course
from course.core.runtime import runtime
from course.parity import torch_behaviours as parity_torch

ON_GPU = runtime().on_gpu
cg = course.graphs()
DEV = course.device()


from simguard import verdict


@pytest.fixture
def collect():
    """Free the graphs a test left in reference cycles (graphed callables) now, not inside a later capture (where
    freeing a graph breaks the capture, on a GPU as on the simulator)."""
    yield
    gc.collect()


def warm_up(fn, n: int = 3) -> None:
    """Run ``fn`` ``n`` times on a side stream, joined back (:func:`course.parity.torch_behaviours.warm_up`)."""
    parity_torch.warm_up(cg, fn, n)


# ----------------------------------------------------------------------------- capture and replay
def test_capturing_is_true_only_inside_the_capture():  # mirrors: TestCuda.test_graph_is_current_stream_capturing
    assert not cg.is_current_stream_capturing()
    g, seen = cg.CUDAGraph(), []
    x = torch.ones(4, device=DEV)
    with cg.graph(g):
        seen.append(cg.is_current_stream_capturing())
        x.mul_(2)
    assert seen == [True] and not cg.is_current_stream_capturing()


def test_a_chain_of_ops_replays_to_the_eager_result():  # mirrors: TestCuda.test_graph_capture_simple
    a = torch.arange(1000, dtype=torch.float32, device=DEV)
    g = cg.CUDAGraph()
    with cg.graph(g):
        b = a
        for _ in range(10):
            b = b + 1
    g.replay()
    assert torch.equal(b, a + 10)


def test_reset_lets_the_same_graph_capture_new_work():  # mirrors: TestCuda.test_graph_capture_reset_recapture
    a = torch.full((100,), 2.0, device=DEV)
    g = cg.CUDAGraph()
    with cg.graph(g):
        b = a * 3
    g.replay()
    assert torch.equal(b, torch.full_like(a, 6.0))
    g.reset()
    with cg.graph(g):
        c = a - 5
    g.replay()
    assert torch.equal(c, torch.full_like(a, -3.0))


def test_an_empty_capture_warns_that_the_graph_is_empty():  # mirrors: TestCuda.test_graph_warn_if_has_zero_nodes
    g, side = cg.CUDAGraph(), cg.Stream()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with cg.stream(side):
            g.capture_begin()
            g.capture_end()
    assert any("The CUDA Graph is empty" in str(w.message) for w in caught)


@pytest.mark.parametrize("share", ["no sharing", "via g.pool()", "via graph_pool_handle()"])
def test_two_graphs_replayed_in_capture_order(share):  # mirrors: TestCuda.test_graph_two_successive
    a = torch.ones(256, device=DEV)
    g0, g1 = cg.CUDAGraph(), cg.CUDAGraph()
    handle = cg.graph_pool_handle() if share == "via graph_pool_handle()" else None
    with cg.graph(g0, pool=handle):
        b = a * 2 + 1
    pool = g0.pool() if share == "via g.pool()" else handle
    with cg.graph(g1, pool=pool):
        c = b * 2 + 1  # reads g0's output
    for _ in range(2):
        g0.replay()
        g1.replay()
    assert torch.equal(b, torch.full_like(a, 3.0)) and torch.equal(c, torch.full_like(a, 7.0))
    if share != "no sharing":
        assert g1.pool() == g0.pool()


def test_three_graphs_in_one_pool_keep_their_live_outputs():  # mirrors: TestCuda.test_graph_three_successive
    a = torch.ones(256, device=DEV)
    handle, graphs, outs, x = cg.graph_pool_handle(), [], [], a
    for k in range(3):
        g = cg.CUDAGraph()
        with cg.graph(g, pool=handle):
            tmp = x + 1  # freed inside the capture: later graphs may reuse its memory
            y = tmp * (k + 2)
        del tmp
        graphs.append(g)
        outs.append(y)
        x = y
    for g in graphs:
        g.replay()
    assert [float(o[0]) for o in outs] == [4.0, 15.0, 64.0]


def test_graphs_in_separate_pools_replay_concurrently_on_two_streams():  # mirrors: TestCuda.test_graph_concurrent_replay
    a = torch.ones(256, device=DEV)
    g1, g2 = cg.CUDAGraph(), cg.CUDAGraph()
    with cg.graph(g1):
        b = a * 3
    with cg.graph(g2):
        c = a + 4
    s1, s2 = cg.Stream(), cg.Stream()
    s1.wait_stream(cg.current_stream())
    s2.wait_stream(cg.current_stream())
    with cg.stream(s1):
        g1.replay()
    with cg.stream(s2):
        g2.replay()
    cg.current_stream().wait_stream(s1)
    cg.current_stream().wait_stream(s2)
    cg.synchronize()
    assert torch.equal(b, torch.full_like(a, 3.0)) and torch.equal(c, torch.full_like(a, 5.0))


def test_an_output_stays_valid_after_its_graph_is_destroyed():
    # mirrors: TestCuda.test_graph_memory_stats_and_use_result_after_destroy_graph (the "use result" part)
    a = torch.arange(64, dtype=torch.float32, device=DEV)
    g = cg.CUDAGraph()
    with cg.graph(g):
        b = a.square()
    g.replay()
    del g
    gc.collect()
    assert torch.equal(b, a.square())


# ----------------------------------------------------------------------------- capture error modes
@pytest.mark.parametrize("mode", ["global", "thread_local", "relaxed"])
def test_every_capture_error_mode_captures_plain_work(mode):  # mirrors: TestCuda.test_cuda_graph_error_options
    x = torch.ones(2000, device=DEV)
    g = cg.CUDAGraph()
    with cg.graph(g, capture_error_mode=mode):
        y = x + x + x
    g.replay()
    assert torch.equal(y, torch.full_like(x, 3.0))


def test_an_unknown_capture_error_mode_is_refused():  # mirrors: TestCuda.test_cuda_graph_error_options
    g, side = cg.CUDAGraph(), cg.Stream()
    with cg.stream(side):
        with pytest.raises(RuntimeError, match="Unknown capture error mode"):
            g.capture_begin(capture_error_mode="strict")
    assert not cg.is_current_stream_capturing()


# ----------------------------------------------------------------------------- random numbers
DRAWS = {
    "dropout": lambda x: torch.nn.functional.dropout(x, p=0.5, training=True),
    "rand_like": lambda x: x + torch.rand_like(x),
    "randn_like": lambda x: x * torch.randn_like(x),
    "bernoulli_": lambda x: torch.empty_like(x).bernoulli_(0.3) + x,
}


@pytest.mark.parametrize("op", list(DRAWS))
def test_replays_draw_the_numbers_eager_calls_would(op):
    # mirrors: TestCuda.test_graph_rng_functional and test_graph_rng_distributions: after the same seed, a
    # replay, an eager call and a replay draw what three eager calls draw
    fn, x = DRAWS[op], torch.ones(1000, device=DEV)
    warm_up(lambda: fn(x), 1)
    g = cg.CUDAGraph()
    with cg.graph(g):
        y = fn(x)
    torch.manual_seed(11)
    mixed = []
    g.replay()
    mixed.append(y.clone())
    mixed.append(fn(x))
    g.replay()
    mixed.append(y.clone())
    torch.manual_seed(11)
    eager = [fn(x) for _ in range(3)]
    assert all(torch.equal(m, e) for m, e in zip(mixed, eager))
    assert not torch.equal(mixed[0], mixed[2])  # every replay draws fresh numbers


def test_checkpoint_recomputes_the_forward_draw_in_the_captured_backward():
    # mirrors: TestCuda.test_graph_checkpoint_preserve_rng_state
    def block(x):
        return x * torch.sigmoid(torch.randn(x.shape, device=x.device))

    block(torch.ones(16, device=DEV))  # the random op runs once before any capture
    torch.manual_seed(42)
    eager_in = torch.ones(16, device=DEV, requires_grad=True)
    (eager_grad,) = torch.autograd.grad(checkpoint(block, eager_in, use_reentrant=False).sum(), eager_in)
    g = cg.CUDAGraph()
    with cg.graph(g):
        graph_in = torch.ones(16, device=DEV, requires_grad=True)
        out = checkpoint(block, graph_in, use_reentrant=False, preserve_rng_state=True)
        (graph_grad,) = torch.autograd.grad(out.sum(), graph_in)
    torch.manual_seed(42)
    g.replay()
    assert torch.equal(graph_grad, eager_grad)


# ----------------------------------------------------------------------------- streams and memory
def test_record_stream_takes_a_side_stream_outside_a_capture():  # mirrors: TestCuda.test_graph_record_stream
    side = cg.Stream()
    x = torch.zeros(3, device=DEV)
    side.wait_stream(cg.current_stream())
    with cg.stream(side):
        x.record_stream(side)
        x.fill_(1.0)
    cg.current_stream().wait_stream(side)
    cg.synchronize()
    assert torch.equal(x, torch.ones(3, device=DEV))


def test_record_stream_inside_a_capture_on_a_forked_stream():  # mirrors: TestCuda.test_graph_record_stream
    a = torch.full((3,), 2.0, device=DEV)
    side, g, kept = cg.Stream(), cg.CUDAGraph(), []
    with cg.graph(g):
        b = a.clone()
        side.wait_stream(cg.current_stream())
        with cg.stream(side):
            b.mul_(5)
            b.record_stream(side)
            kept.append(b * 1)
        cg.current_stream().wait_stream(side)
    g.replay()
    cg.synchronize()
    assert torch.equal(kept[0], torch.full((3,), 10.0, device=DEV))


def test_a_capture_that_runs_out_of_memory_says_so():  # mirrors: TestCuda.test_graph_capture_oom
    assert verdict("capture_oom") == parity_torch.EXPECTED["capture_oom"]


# ----------------------------------------------------------------------------- make_graphed_callables
def _mlp(seed=0, dropout=0.0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(dropout),
                               torch.nn.Linear(16, 4)).to(DEV)


def _grads(module):
    return [p.grad.clone() for p in module.parameters()]


def test_graphed_module_matches_eager_forward_and_gradients(collect):  # mirrors: TestCuda.test_graph_make_graphed_callables
    eager, graphed = _mlp(), _mlp()
    x = torch.randn(5, 8, device=DEV, requires_grad=True)
    graphed = cg.make_graphed_callables(graphed, (x,))
    for _ in range(2):
        xe, xg = x.detach().clone().requires_grad_(True), x.detach().clone().requires_grad_(True)
        for m in (eager, graphed):
            m.zero_grad(set_to_none=True)
        ye, yg = eager(xe), graphed(xg)
        ye.square().sum().backward()
        yg.square().sum().backward()
        assert torch.allclose(ye, yg, atol=1e-5) and torch.allclose(xe.grad, xg.grad, atol=1e-5)
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(_grads(eager), _grads(graphed)))


def test_graphed_functions_chain_like_their_eager_versions(collect):  # mirrors: TestCuda.test_graph_make_graphed_callables
    w1 = torch.randn(8, 8, device=DEV, requires_grad=True)
    w2 = torch.randn(8, 2, device=DEV, requires_grad=True)

    def first(x):
        return torch.tanh(x @ w1)

    def second(h):
        return h @ w2
    x = torch.randn(4, 8, device=DEV, requires_grad=True)
    h = torch.randn(4, 8, device=DEV, requires_grad=True)
    g_first, g_second = cg.make_graphed_callables((first, second), ((x,), (h,)))
    new = torch.randn(4, 8, device=DEV)
    eager = second(first(new))
    graphed = g_second(g_first(new))
    assert torch.allclose(eager, graphed, atol=1e-5)


def test_graphed_module_under_autocast_without_its_cache(collect):  # mirrors: TestCuda.test_graph_make_graphed_callables
    eager, graphed = _mlp(), _mlp()
    x = torch.randn(5, 8, device=DEV)
    with torch.autocast(DEV.type, cache_enabled=False):
        graphed = cg.make_graphed_callables(graphed, (x,))
        ye, yg = eager(x), graphed(x)
    assert ye.dtype == yg.dtype != torch.float32
    assert torch.allclose(ye.float(), yg.float(), atol=1e-2)


def test_make_graphed_callables_refuses_autocast_caching(collect):  # mirrors: TestCuda.test_graph_make_graphed_callables
    model, x = _mlp(), torch.randn(5, 8, device=DEV)
    with torch.autocast(DEV.type):  # cache_enabled defaults to True
        with pytest.raises(RuntimeError, match="does not support the autocast caching"):
            cg.make_graphed_callables(model, (x,))
    assert not cg.is_current_stream_capturing()


def test_an_unused_input_needs_allow_unused_input(collect):  # mirrors: TestCuda.test_graph_make_graphed_callables
    w = torch.randn(4, device=DEV, requires_grad=True)

    def uses_one(a, b):
        return a * w
    a, b = torch.randn(4, device=DEV, requires_grad=True), torch.randn(4, device=DEV, requires_grad=True)
    with pytest.raises(RuntimeError, match="appears to not have been used in the graph"):
        cg.make_graphed_callables(uses_one, (a, b))
    assert cg.current_stream() == cg.default_stream()
    graphed = cg.make_graphed_callables(uses_one, (a, b), allow_unused_input=True)
    new_a, new_b = a.detach().clone().requires_grad_(True), b.detach().clone().requires_grad_(True)
    graphed(new_a, new_b).sum().backward()
    assert torch.allclose(new_a.grad, w.detach()) and new_b.grad is None


def test_graphed_callables_can_share_one_pool(collect):  # mirrors: TestCuda.test_graph_make_graphed_callables_same_pool
    pool = cg.graph_pool_handle()
    models = [_mlp(seed) for seed in (1, 2)]
    twins = [_mlp(seed) for seed in (1, 2)]
    x = torch.randn(3, 8, device=DEV, requires_grad=True)
    graphed = [cg.make_graphed_callables(m, (x,), pool=pool) for m in models]
    for m, t in zip(graphed, twins):
        assert torch.allclose(m(x), t(x), atol=1e-5)


def test_a_parameterless_module_with_no_grad_inputs_is_graphed(collect):
    # mirrors: TestCuda.test_graph_make_graphed_callables_parameterless_nograd_module
    module = torch.nn.GELU()
    x = torch.randn(6, device=DEV)
    graphed = cg.make_graphed_callables(module, (x,))
    new = torch.randn(6, device=DEV)
    out = graphed(new)
    assert torch.allclose(out, torch.nn.functional.gelu(new), atol=1e-6) and not out.requires_grad


def test_a_module_graphed_in_training_runs_its_own_forward_in_eval(collect):
    # mirrors: TestCuda.test_graph_make_graphed_callables (the training-flag check)
    model, twin = _mlp(dropout=0.5), _mlp(dropout=0.5)
    x = torch.randn(5, 8, device=DEV, requires_grad=True)
    model = cg.make_graphed_callables(model, (x,))
    model.eval()
    twin.eval()
    assert torch.equal(model(x), twin(x))  # no dropout: the eager eval forward, not the training graph


def test_a_graphed_module_with_dropout_trains_like_eager_from_the_same_seed(collect):
    # mirrors: TestCuda.test_graph_make_graphed_callables (dropout draws the same masks after the same seed)
    graphed, eager = _mlp(dropout=0.3), _mlp(dropout=0.3)
    x = torch.randn(5, 8, device=DEV, requires_grad=True)
    graphed = cg.make_graphed_callables(graphed, (x,))
    data = [torch.randn(5, 8, device=DEV) for _ in range(3)]
    for model in (graphed, eager):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(5)
        for batch in data:
            opt.zero_grad(set_to_none=True)
            model(batch).square().mean().backward()
            opt.step()
    assert all(torch.allclose(p, q, atol=1e-6) for p, q in zip(graphed.parameters(), eager.parameters()))
