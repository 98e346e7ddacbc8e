"""Capture and replay, the idea: the recipe (warm up on a side stream, capture, replay), a training
step captured whole, part of a model graphed, two streams forked and joined, and the models lesson
02 captures."""
from __future__ import annotations

import torch

import course
from course.core.capture import try_capture, warm_up
from course.core.text import clip

LR = 1e-2  # Adam's learning rate in 02.7


def kernel_chain(buf, n: int):
    """A function that launches ``n`` tiny kernels (in-place adds on ``buf``)."""
    def chain():
        for _ in range(n):
            buf.add_(1.0)
    return chain


def mlp(width: int = 1024, depth: int = 4):
    """A plain MLP (Linear+ReLU, ``depth`` times) on the GPU, for the shape experiments."""
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers).cuda()


def training_setup(N: int = 64, D_in: int = 1024, D_out: int = 1024, seed: int = 0):
    """The CUDA Graph lesson's static inputs, model and optimizer: (x, y, model, optimizer) on the
    GPU."""
    torch.manual_seed(seed)
    x = torch.randn(N, D_in, device="cuda")
    y = torch.randn(N, D_out, device="cuda")
    model = torch.nn.Linear(D_in, D_out).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    return x, y, model, optimizer


def training_step(model, optimizer, x, y):
    """One eager training step, as in the CUDA Graph lesson: zero grads, forward, loss, backward,
    SGD step."""
    optimizer.zero_grad(set_to_none=True)
    loss = (model(x) - y).pow(2).sum()
    loss.backward()
    optimizer.step()
    return loss


def capture_training_step(model, optimizer, x, y, warmup: int = 3):
    """Warm up on a side stream, then capture forward, backward and step whole: (graph,
    static_loss).

    The gradients are None before the capture, so backward allocates them from the graph's pool and
    every replay overwrites them.
    """
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            training_step(model, optimizer, x, y)
    torch.cuda.current_stream().wait_stream(s)

    g = torch.cuda.CUDAGraph()
    optimizer.zero_grad(set_to_none=True)
    with torch.cuda.graph(g):
        static_loss = (model(x) - y).pow(2).sum()
        static_loss.backward()
        optimizer.step()
    return g, static_loss


def data_dependent_loss(y):
    """A loss that cannot be captured: it keeps only rows with a positive sum (a data-dependent
    shape)."""
    return y[y.sum(1) > 0].pow(2).mean()


def branch(x, w):
    """One branch of the two-stream example: relu(x @ w) @ w."""
    return torch.relu(x @ w) @ w


def fork_join(x, w1, w2, side):
    """``branch(x, w1) + branch(x, w2)`` with the second branch forked onto stream ``side`` and
    joined back."""
    main = torch.cuda.current_stream()
    side.wait_stream(main)  # fork: the side stream starts after everything queued so far
    with torch.cuda.stream(side):
        b = branch(x, w2)
    a = branch(x, w1)  # runs on the main stream at the same time
    main.wait_stream(side)  # join: the capture must end with every forked stream joined back
    return a + b


def forgotten_join(batch: int = 64, width: int = 2048) -> dict:
    """Capture the two branches but forget the join (GPU; run it in its own process): what CUDA
    says."""
    x = torch.randn(batch, width, device="cuda")
    w1, w2 = (torch.randn(width, width, device="cuda") / width ** 0.5 for _ in range(2))
    side = torch.cuda.Stream()

    def forgot_join():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            b = branch(x, w2)
        # uses b without waiting for the side stream, and never joins it back
        return branch(x, w1) + b

    warm_up(forgot_join, 1)
    out = try_capture(forgot_join)
    return {"captured": out.ok,
            "error": "" if out.ok else clip(f"{out.error_type}: {out.error}", 240)}


def amp() -> tuple:
    """``(device_type, dtype)`` for ``torch.autocast``: bfloat16 on ``"cuda"`` on a GPU, on
    ``"cpu"`` on the simulator (CPU autocast supports bfloat16; float16 autocast on the CPU is
    narrower)."""
    return ("cuda" if course.runtime().on_gpu else "cpu"), torch.bfloat16


def train_loss(model, x, y):
    """The loss 02.7 trains: mean squared error of the model's output, computed in float32."""
    return torch.nn.functional.mse_loss(model(x).float(), y)


def train_step(model, optimizer, x, y):
    """One eager training step: gradients to None, forward and loss under autocast, backward, step;
    the loss."""
    device_type, dtype = amp()
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(device_type, dtype, cache_enabled=False):
        loss = train_loss(model, x, y)
    loss.backward()
    optimizer.step()
    return loss.detach()
