"""Capturable optimizers on the simulator path, where CPU tensors stand for device tensors.

:func:`install` lets ``capturable=True`` optimizers run on the CPU (torch allows them on
accelerators only) and keeps torch's capture health check: ``step()`` of a non-capturable param
group inside a capture raises torch's error. A capturable step then records its update, and every
replay applies it.
"""
from __future__ import annotations

import importlib
import pkgutil

NOT_CAPTURABLE = ("Attempting CUDA graph capture of step() for an "
                  "instance of {} but param_groups' capturable is False.")
# torch 2.13, older names
HEALTH = ("_accelerator_graph_capture_health_check", "_cuda_graph_capture_health_check")
_installed = [False]


def _optimizer_modules() -> list:
    """torch.optim's modules that read the capturable devices list (each imported it under its own
    name)."""
    import torch.optim as optim

    mods = []
    for info in pkgutil.iter_modules(optim.__path__):
        mod = importlib.import_module(f"torch.optim.{info.name}")
        if hasattr(mod, "_get_capturable_supported_devices"):
            mods.append(mod)
    return mods


def health_check(optimizer) -> None:
    """What torch checks on a GPU before a capturable-aware ``step()``, with the simulator's capture
    state."""
    import torch

    import course.sim.stream as ss

    if torch.compiler.is_compiling():
        return
    if ss.capturing() is not None and not all(group["capturable"] for group in optimizer.param_groups):
        raise RuntimeError(NOT_CAPTURABLE.format(type(optimizer).__name__))


def install() -> None:
    """Let capturable optimizers take CPU tensors and check captures as on a GPU (once per process).
    """
    if _installed[0]:
        return
    import torch.optim.optimizer as om

    original = om._get_capturable_supported_devices

    def devices(supports_xla: bool = True) -> list:
        return [*original(supports_xla), "cpu"]

    for mod in _optimizer_modules():
        mod._get_capturable_supported_devices = devices
    for name in HEALTH:
        if name in vars(om.Optimizer):
            setattr(om.Optimizer, name, health_check)
    _installed[0] = True


def installed() -> bool:
    """True once :func:`install` has run in this process."""
    return _installed[0]
