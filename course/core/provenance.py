"""Where a number came from: device, driver, library versions and date."""
from __future__ import annotations

import datetime as _dt
import platform
import shutil
import subprocess
from importlib import metadata

from course.core.runtime import runtime


def package_version(name: str) -> str | None:
    """Installed version of a distribution, or None if it is not installed."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def driver_version() -> str | None:
    """The NVIDIA driver version, or None when there is no driver."""
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError):
            pass
    return None


def cpu_model() -> str:
    """The host CPU's model name (for CPU-side measurements)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def provenance(gpus: int | None = None) -> dict:
    """A dict that travels with every result: path, device, driver, versions, date (UTC).

    ``gpus``: how many GPUs the measurement used (default: 1 on the GPU path, 0 on the
    simulator). With 2 or more the device reads "2x NVIDIA H200".
    """
    import torch

    rt = runtime()
    gpus = (1 if rt.on_gpu else 0) if gpus is None else int(gpus)
    return {
        "path": rt.path,
        "device": f"{gpus}x {rt.device_name}" if gpus > 1 else rt.device_name,
        "gpus": gpus,
        "driver": driver_version() if rt.on_gpu else None,
        "cuda_runtime": torch.version.cuda,
        "cpu": cpu_model(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numba": package_version("numba"),
        "numba_cuda": package_version("numba-cuda"),
        "numpy": package_version("numpy"),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def describe(prov: dict) -> str:
    """One line: device, driver and versions, for captions."""
    bits = [prov.get("device", "?")]
    if prov.get("driver"):
        bits.append(f"driver {prov['driver']}")
    bits.append(f"torch {prov.get('torch')}")
    bits.append(f"numba-cuda {prov.get('numba_cuda')}")
    bits.append(f"numpy {prov.get('numpy')}")
    return ", ".join(bits)
