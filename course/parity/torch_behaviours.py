"""Capture programs whose capture fails, from the behaviours PyTorch's own graph tests check, with
the GPU's verdict.

``tests/test_torch_graph_behaviours.py`` and ``tests/test_torch_graph_optims.py`` run them on the
simulator in CI and, on a GPU, each in a fresh process (:func:`course.core.isolate.run_isolated`): a
failed capture may leave CUDA state behind there. :func:`run` runs one by name and returns its
verdict; :data:`EXPECTED` gives the verdict a GPU gives (torch 2.11, H100).
"""
from __future__ import annotations

import warnings

import torch

from course.parity.tools import PHRASES, capture_error, clean_up


def capture_oom(cg, dev):
    """A 4 TiB tensor made inside a capture (PyTorch's test_graph_capture_oom): torch's
    out-of-memory error."""
    before, pool = cg.current_stream(), cg.graph_pool_handle()
    g = cg.CUDAGraph()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the capture recorded nothing: "The CUDA Graph is empty"
            with cg.graph(g, pool=pool):
                torch.zeros(1 << 40, device=dev)
    except Exception as e:  # noqa: BLE001 - the verdict is the error
        clean_up(cg, before, pool, g)
        oom = isinstance(e, getattr(torch, "OutOfMemoryError", RuntimeError))
        return f"OutOfMemoryError {oom}, says 'out of memory' {'out of memory' in str(e)}"
    return "captured"


def _model(dev):
    torch.manual_seed(0)
    return torch.nn.Linear(8, 4).to(dev), torch.randn(16, 8, device=dev)


def warm_up(cg, fn, n: int = 3) -> None:
    """Run ``fn`` ``n`` times on a side stream, joined back (what a capture of backward or an
    optimizer needs)."""
    side = cg.Stream()
    side.wait_stream(cg.current_stream())
    with cg.stream(side):
        for _ in range(n):
            fn()
    cg.current_stream().wait_stream(side)
    cg.synchronize()


def scaler_step_not_fused(cg, dev):
    """GradScaler.step with a (capturable, not fused) Adam inside a capture: the scaler reads
    found_inf with .item() to decide whether to step, which a capturing stream refuses (PyTorch's
    grad-scaling graph tests step a non-fused optimizer outside the capture)."""
    model, x = _model(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, capturable=True, foreach=True)
    scaler = torch.amp.GradScaler(dev.type, init_scale=4.0)

    def step():
        opt.zero_grad(set_to_none=False)
        scaler.scale(model(x).pow(2).mean()).backward()
        scaler.step(opt)
        scaler.update()
    warm_up(cg, step)
    return capture_error(cg, step)


def non_capturable_group(cg, dev):
    """An optimizer whose second param group says capturable=False, stepped inside a capture
    (PyTorch's test_graph_optims_with_explicitly_capturable_param_groups): refused before any update
    is recorded."""
    model, x = _model(dev)
    opt = torch.optim.Adam([{"params": [model.weight], "capturable": True},
                            {"params": [model.bias], "capturable": False}], lr=1e-2)

    def step():
        opt.zero_grad(set_to_none=False)
        model(x).pow(2).mean().backward()
        opt.step()
    step()  # eager, outside a capture: fine
    return capture_error(cg, step)


PROGRAMS = {"capture_oom": capture_oom, "scaler_step_not_fused": scaler_step_not_fused,
            "non_capturable_group": non_capturable_group}
EXPECTED = {"capture_oom": "OutOfMemoryError True, says 'out of memory' True",
            "scaler_step_not_fused": PHRASES[0],
            "non_capturable_group": "RuntimeError: Attempting CUDA graph capture of step() for "
                                    "an instance of Adam but param_groups' capturable is False."}


def run(name: str) -> str:
    """The verdict of program ``name`` on ``course.graphs()`` and ``course.device()``."""
    from course.core.runtime import graphs, torch_device

    if name not in PROGRAMS:
        raise KeyError(f"no program {name!r}; known: {sorted(PROGRAMS)}")
    return PROGRAMS[name](graphs(), torch_device())
