"""``python -m course.tools.torch_install`` (``make setup``): the torch build that fits this
machine.

Standard library only (it runs in a fresh venv first). A torch that imports is left alone;
``TORCH_INDEX=URL`` installs from that index; Linux without an NVIDIA driver gets the CPU build from
PyTorch's CPU index when it answers (else pip's own configuration, with a warning); anything else
PyPI's default build. ``TORCH`` sets the requirement; unset: :data:`GPU_TORCH` with an NVIDIA driver
(the version the GPU recordings name), else :data:`LAPTOP_TORCH` (the version CI tests).
"""
from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
import urllib.request
from pathlib import Path

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PYPI = "https://pypi.org/simple"
GPU_TORCH = "torch==2.11.0"  # what the GPU path was measured with (the recordings' provenance: 2.11.0+cu130)
LAPTOP_TORCH = "torch==2.13.0"  # what CI tests the simulator path with
DEFAULT_TORCH = LAPTOP_TORCH  # (the name before the split; kept for callers)


def default_requirement(driver: bool) -> str:
    """The torch requirement when ``TORCH`` is unset: :data:`GPU_TORCH` with an NVIDIA driver, else
    :data:`LAPTOP_TORCH`."""
    return GPU_TORCH if driver else LAPTOP_TORCH


def pinned_version(requirement: str) -> str | None:
    """The version an ``==`` requirement pins (``"torch==2.11.0"`` -> ``"2.11.0"``), else None."""
    first = shlex.split(requirement)[0] if requirement.strip() else ""
    return first.split("==", 1)[1] if "==" in first else None


def has_nvidia_driver() -> bool:
    """True when an NVIDIA kernel driver is loaded (Linux: /proc/driver/nvidia) or ``nvidia-smi -L``
    lists a GPU."""
    if Path("/proc/driver/nvidia/version").exists():
        return True
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
        return out.returncode == 0 and "GPU" in out.stdout
    except (OSError, subprocess.SubprocessError):
        return False


def index_reachable(url: str = CPU_INDEX, timeout: float = 5.0) -> bool:
    """True when ``url`` answers an HTTP request within ``timeout`` seconds."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/torch/", timeout=timeout) as r:
            return r.status < 400
    except Exception:  # noqa: BLE001 - DNS failure, refused, timeout, HTTP error: all "not reachable"
        return False


def plan(requirement: str, *, system: str, machine: str, driver: bool, index_env: str | None,
         cpu_index_ok) -> tuple[list, str]:
    """The pip arguments to install ``requirement`` and one sentence saying why.

    ``requirement`` None or empty (``TORCH`` unset): :func:`default_requirement` for ``driver``.
    ``cpu_index_ok`` is a callable, asked only when the CPU index matters (so no probe on machines
    that do not need it).
    """
    chosen = not (requirement or "").strip()
    if chosen:
        requirement = default_requirement(driver)
    req = shlex.split(requirement)
    if index_env:
        return req + ["--index-url", index_env, "--extra-index-url", PYPI], f"TORCH_INDEX={index_env}"
    if system == "Linux" and machine in ("x86_64", "aarch64", "AMD64") and not driver:
        if cpu_index_ok():
            return (req + ["--index-url", CPU_INDEX, "--extra-index-url", PYPI],
                    f"no NVIDIA driver: the CPU build from {CPU_INDEX}")
        return (req, f"no NVIDIA driver, but {CPU_INDEX} did not answer: pip's "
                     "configured indexes. If this downloads nvidia-* packages, "
                     "stop it and run again with TORCH_INDEX=<a CPU wheel index>")
    if driver:
        if chosen:
            return req, ("NVIDIA driver found: the CUDA build from PyPI "
                         f"of {requirement}, the version the course's GPU "
                         "path was measured with (TORCH=... picks another)")
        return req, "NVIDIA driver found: the CUDA build from PyPI"
    return req, f"{system} {machine}: PyPI's build"


def torch_imports(python: str = sys.executable) -> str | None:
    """The torch version importable by ``python``, or None."""
    out = subprocess.run([python, "-c", "import torch; "
                                        "print(torch.__version__)"], capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else None


def main(argv=None) -> int:
    """Install torch into this interpreter's environment unless it already imports; returns pip's
    exit code."""
    requirement = os.environ.get("TORCH") or None
    have = torch_imports()
    if have:
        print(f"torch {have} is already installed here; leaving it "
              "(remove it to let setup choose a build).")
        return 0
    args, why = plan(requirement, system=platform.system(), machine=platform.machine(),
                     driver=has_nvidia_driver(), index_env=os.environ.get("TORCH_INDEX") or None,
                     cpu_index_ok=index_reachable)
    cmd = [sys.executable, "-m", "pip", "install", "--progress-bar", "on", *args]
    print(f"Installing {args[0]} ({why}):\n  {' '.join(shlex.quote(c) for c in cmd)}", flush=True)
    return subprocess.run(cmd).returncode


if __name__ == "__main__":
    sys.exit(main())
