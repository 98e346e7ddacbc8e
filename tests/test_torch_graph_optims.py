"""Optimizers and grad scaling in CUDA graphs, as PyTorch's own tests check them (TestCudaOptims), on both paths.

Each test names the PyTorch test it mirrors. The same body runs on the simulator in CI (tensors on the CPU, where
:mod:`course.sim.optim` lets ``capturable=True`` optimizers run) and on a GPU. A captured training step, replayed,
must leave the parameters where the same number of eager steps leaves them. What this file leaves out, and why:
the table in tests/test_torch_graph_behaviours.py.
"""
import copy

import pytest
import torch

import course
from course.core.runtime import runtime
from course.parity import torch_behaviours as parity_torch

ON_GPU = runtime().on_gpu
cg = course.graphs()
DEV = course.device()


from simguard import verdict


def warm_up(fn, n: int = 3) -> None:
    """Run ``fn`` ``n`` times on a side stream, joined back (:func:`course.parity.torch_behaviours.warm_up`)."""
    parity_torch.warm_up(cg, fn, n)


def _pair(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)).to(DEV)
    return model, copy.deepcopy(model)


def _train_step(model, opt, x, y, scaler=None):
    opt.zero_grad(set_to_none=False)
    loss = torch.nn.functional.mse_loss(model(x), y)
    if scaler is None:
        loss.backward()
        opt.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


def _captured_matches_eager(make_opt, steps: int = 3, scalers=(None, None)):
    """Warm up both twins alike, capture one's step, replay it ``steps`` times beside as many eager steps of the
    same optimizer built with ``capturable=False`` (the control PyTorch's tests use)."""
    model, twin = _pair()
    opt, twin_opt = make_opt(model.parameters()), make_opt(twin.parameters())
    for group in twin_opt.param_groups:
        if "capturable" in group:  # SGD has no such flag
            group["capturable"] = False  # read at every step: the twin steps as a plain eager optimizer
    x, y = torch.randn(4, 8, device=DEV), torch.randn(4, 2, device=DEV)
    warm_up(lambda: _train_step(model, opt, x, y, scalers[0]))
    warm_up(lambda: _train_step(twin, twin_opt, x, y, scalers[1]))
    g = cg.CUDAGraph()
    with cg.graph(g):
        _train_step(model, opt, x, y, scalers[0])
    start = [p.detach().clone() for p in model.parameters()]
    for _ in range(steps):
        g.replay()
        _train_step(twin, twin_opt, x, y, scalers[1])
    moved = any(not torch.equal(p, s) for p, s in zip(model.parameters(), start))
    same = all(torch.allclose(p, q, rtol=1e-5, atol=1e-5) for p, q in zip(model.parameters(), twin.parameters()))
    return moved, same


CAPTURABLE = {
    "Adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, capturable=True),
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-2, capturable=True),
    "NAdam": lambda ps: torch.optim.NAdam(ps, lr=1e-2, capturable=True),
    "RAdam": lambda ps: torch.optim.RAdam(ps, lr=1e-2, capturable=True),
    "Adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2, capturable=True),
    "RMSprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, capturable=True),
    "Adadelta": lambda ps: torch.optim.Adadelta(ps, lr=1.0, capturable=True),
    "SGD momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
}


@pytest.mark.parametrize("name", list(CAPTURABLE))
def test_a_captured_optimizer_step_replays_like_eager_steps(name):  # mirrors: TestCudaOptims.test_graph_optims
    moved, same = _captured_matches_eager(CAPTURABLE[name])
    assert moved and same


FUSED = {
    "Adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, capturable=True, fused=True),
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-2, capturable=True, fused=True),
    "SGD": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, fused=True),
}


@pytest.mark.parametrize("name", list(FUSED))
def test_a_captured_fused_optimizer_step_replays_like_eager_steps(name):
    # mirrors: TestCudaOptims.test_graph_optims (fused=True, capturable=True)
    moved, same = _captured_matches_eager(FUSED[name])
    assert moved and same


def test_param_groups_all_capturable_capture_and_replay():
    # mirrors: TestCudaOptims.test_graph_optims_with_explicitly_capturable_param_groups
    def make(ps):
        first, *rest = list(ps)
        return torch.optim.Adam([{"params": [first], "capturable": True},
                                 {"params": rest, "capturable": True, "lr": 5e-3}], lr=1e-2)
    moved, same = _captured_matches_eager(make)
    assert moved and same


def test_a_param_group_that_is_not_capturable_is_refused_in_a_capture():
    # mirrors: TestCudaOptims.test_graph_optims_with_explicitly_capturable_param_groups
    assert verdict("non_capturable_group") == parity_torch.EXPECTED["non_capturable_group"]


# ----------------------------------------------------------------------------- grad scaling
def test_captured_scaled_backward_with_eager_scaler_steps():  # mirrors: TestCudaOptims.test_graph_grad_scaling
    scaler = torch.amp.GradScaler(DEV.type, init_scale=4.0, growth_interval=1000)
    weight = torch.ones(1, device=DEV, requires_grad=True)
    opt = torch.optim.SGD([weight], lr=0.0)  # lr 0: the weight stays 1, so the gradient is the input
    static_input = torch.ones(1, dtype=torch.half, device=DEV)

    def scaled_backward():
        loss = (weight.half() * static_input).sum()
        scaler.scale(loss).backward()
    warm_up(scaled_backward, 1)
    opt.zero_grad(set_to_none=True)
    g = cg.CUDAGraph()
    with cg.graph(g):
        scaled_backward()
    seen = []
    for value in (5.0, 20000.0, 5.0, 40000.0):  # 20000 x 2 and 40000 x 1 overflow half precision: inf
        static_input.fill_(value)
        g.replay()
        grad = float(weight.grad[0])
        scaler.step(opt)  # outside the capture: the scaler reads found_inf on the host to skip the step
        scaler.update()
        seen.append((grad, scaler.get_scale()))
    assert seen == [(20.0, 4.0), (float("inf"), 2.0), (10.0, 2.0), (float("inf"), 1.0)]


@pytest.mark.parametrize("name", ["Adam", "AdamW"])
def test_a_whole_scaled_step_with_a_fused_optimizer_is_captured(name):
    # mirrors: TestCudaOptims.test_graph_scaling_fused_optimizers: scale, backward, scaler.step and update in one
    # graph (a fused optimizer takes the scaler's found_inf as a tensor: nothing is read on the host)
    scalers = [torch.amp.GradScaler(DEV.type, init_scale=2.0 ** 8, growth_interval=2) for _ in range(2)]
    moved, same = _captured_matches_eager(FUSED[name], steps=4, scalers=scalers)
    assert moved and same
    assert scalers[0].get_scale() == scalers[1].get_scale()


def test_a_fused_step_skipped_on_inf_leaves_the_parameters_and_halves_the_scale():
    # mirrors: TestCudaOptims.test_graph_scaling_fused_optimizers (the overflow step)
    model, _ = _pair()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, capturable=True, fused=True)
    scaler = torch.amp.GradScaler(DEV.type, init_scale=2.0 ** 8, growth_interval=1000)
    x, y = torch.randn(4, 8, device=DEV), torch.randn(4, 2, device=DEV)
    warm_up(lambda: _train_step(model, opt, x, y, scaler))
    g = cg.CUDAGraph()
    with cg.graph(g):
        _train_step(model, opt, x, y, scaler)
    before, scale = [p.detach().clone() for p in model.parameters()], scaler.get_scale()
    x.fill_(float("inf"))  # the next replay's gradients overflow
    g.replay()
    kept = all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert kept and scaler.get_scale() == scale / 2


def test_scaler_step_with_a_non_fused_optimizer_is_refused_in_a_capture():
    # mirrors: TestCudaOptims.test_graph_grad_scaling (why its scaler.step stays outside the capture)
    assert verdict("scaler_step_not_fused") == parity_torch.EXPECTED["scaler_step_not_fused"]
