"""course.sim.optim: capturable optimizers on the simulator path, captured and replayed like on a GPU."""
import copy

import pytest

import course
from course.core.runtime import runtime

pytestmark = pytest.mark.skipif(runtime().on_gpu, reason="the simulator path's stand-in (a GPU runs torch's own)")


def _setup(capturable=True, seed=0):
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2, capturable=capturable)


def _step(model, opt, x, y):
    import torch

    opt.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def test_installed_with_the_simulated_cuda_module():
    from course.sim import optim as simoptim

    course.graphs()
    assert simoptim.installed()
    simoptim.install()  # a second call changes nothing
    assert simoptim.installed()


def test_capturable_adam_on_the_cpu_computes_plain_adam():
    import torch

    course.graphs()
    x, y = torch.randn(4, 8), torch.randn(4, 2)
    a, opt_a = _setup(capturable=True)
    b, opt_b = _setup(capturable=False)
    for _ in range(3):
        _step(a, opt_a, x, y)
        _step(b, opt_b, x, y)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.allclose(p, q, atol=1e-6)
    assert opt_a.state[next(a.parameters())]["step"].device.type == "cpu"


def test_a_captured_step_replays_like_eager_steps():
    import torch

    cg = course.graphs()
    x, y = torch.randn(4, 8), torch.randn(4, 2)
    model, opt = _setup()
    twin = copy.deepcopy(model)
    twin_opt = torch.optim.Adam(twin.parameters(), lr=1e-2, capturable=True)
    for _ in range(2):  # warm-up steps on both
        _step(model, opt, x, y)
        _step(twin, twin_opt, x, y)
    opt.zero_grad(set_to_none=True)
    g = cg.CUDAGraph()
    with cg.graph(g):
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    for _ in range(3):
        g.replay()
        _step(twin, twin_opt, x, y)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


def test_non_capturable_adam_is_refused_inside_a_capture_only():
    import torch

    from course.sim import optim as simoptim

    cg = course.graphs()
    model, opt = _setup(capturable=False)
    x, y = torch.randn(4, 8), torch.randn(4, 2)
    _step(model, opt, x, y)
    simoptim.health_check(opt)  # outside a capture: fine
    g = cg.CUDAGraph()
    with pytest.raises(RuntimeError, match="capturable is False"):
        with cg.graph(g):
            _step(model, opt, x, y)
    assert not cg.is_current_stream_capturing()
