"""The course's one runtime decision: a real CUDA GPU, or the Numba CUDA simulator.

Made once per process, before numba is imported (``NUMBA_ENABLE_CUDASIM=1`` must come first), and
handed to notebook kernels through the environment. The GPU path needs torch to see a GPU and
numba-cuda to launch a trivial kernel there (tried in a subprocess). ``COURSE_PATH=sim`` forces the
simulator; ``COURSE_PATH=cuda`` insists on the GPU and fails loudly instead of falling back.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from functools import lru_cache

ENV_FORCE = "COURSE_PATH"
ENV_CACHE = "COURSE_RUNTIME_DECISION"

SIM, CUDA = "sim", "cuda"

# A trivial kernel, compiled and launched in a fresh interpreter.
_PROBE = r"""
import json, sys
out = {}
try:
    import numpy as np
    from numba import cuda
    @cuda.jit
    def add_one(a):
        i = cuda.grid(1)
        if i < a.size:
            a[i] += 1
    a = cuda.to_device(np.zeros(32, dtype=np.float32))
    add_one[1, 32](a)
    ok = bool((a.copy_to_host() == 1).all())
    out = {"ok": ok, "error": None if ok else "kernel ran but gave a wrong result"}
except BaseException as e:  # report anything, never crash the probe
    out = {"ok": False, "error": f"{type(e).__name__}: {e}"}
print("COURSE_PROBE " + json.dumps(out))
"""


class CourseEnvironmentError(RuntimeError):
    """The environment cannot run the course; the message says what to do."""


@dataclasses.dataclass(frozen=True)
class Runtime:
    """The path the course takes in this process, and why."""

    path: str  # "cuda" or "sim"
    reason: str  # one sentence: why this path was taken
    device: str  # torch device string: "cuda:0" or "cpu"
    device_name: str  # e.g. "NVIDIA H100 80GB HBM3" or "CPU (Numba CUDA simulator)"
    fixes: tuple = ()  # concrete steps that would enable the GPU path, if any apply

    @property
    def on_gpu(self) -> bool:
        """True on the real-GPU path."""
        return self.path == CUDA

    def describe(self) -> str:
        """A short human sentence for notebook headers."""
        where = "a real GPU" if self.on_gpu else "the Numba CUDA simulator (CPU)"
        return f"Running on {where}: {self.device_name}. {self.reason}"

    def to_json(self) -> str:
        """Serialise (used to pass the decision to child processes)."""
        return json.dumps(dataclasses.asdict(self))


def probe_numba_cuda(*, simulator: bool = False, timeout: float = 180.0) -> tuple[bool, str | None]:
    """Compile and launch a trivial numba-cuda kernel in a fresh interpreter.

    ``simulator=True`` runs it on the Numba CUDA simulator instead of the GPU.
    Returns (ok, error message or None).
    """
    env = dict(os.environ)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    if simulator:
        env["NUMBA_ENABLE_CUDASIM"] = "1"
    try:
        proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True,
                              text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return False, f"the numba-cuda probe did not finish in {timeout:.0f} s"
    for line in proc.stdout.splitlines():
        if line.startswith("COURSE_PROBE "):
            res = json.loads(line[len("COURSE_PROBE "):])
            return res["ok"], res["error"]
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    return False, f"the numba-cuda probe crashed (exit {proc.returncode}): {tail[0]}"


def numba_cuda_installed() -> bool:
    """True when the numba-cuda package is installed (the GPU path needs it; the simulator does
    not)."""
    from importlib import metadata
    try:
        metadata.version("numba-cuda")
        return True
    except metadata.PackageNotFoundError:
        return False


def explain_numba_failure(error: str) -> tuple[str, tuple[str, ...]]:
    """Turn a numba-cuda failure message into a reason and concrete fixes."""
    import numpy as np

    if "row_stack" in error or not hasattr(np, "row_stack"):
        return (f"numba-cuda cannot compile kernels with numpy {np.__version__} "
                "(numpy 2.5 removed np.row_stack, which numba-cuda 0.30 uses)",
                ("pip install 'numpy<2.5'",))
    if "libcudart" in error or "NVVM" in error or "libnvvm" in error or "cuda_bindings" in error:
        return (f"numba-cuda cannot find the CUDA libraries it needs ({error})",
                ("pip install 'numba-cuda[cu12]' (or [cu13], matching your driver)",))
    return (f"numba-cuda cannot launch a kernel: {error}",
            ("run `python -m course doctor` and follow its advice",))


def _simulator(forced: str, reason: str, fixes: tuple, gpu: str = "") -> Runtime:
    """The simulator path for ``reason`` (torch seeing ``gpu``), or the loud failure
    ``COURSE_PATH=cuda`` asks for."""
    if forced == CUDA:
        raise CourseEnvironmentError(f"{ENV_FORCE}=cuda was asked for, "
                                     f"but {reason}. Fix: {fixes[0]}")
    seen = f"torch sees {gpu}, but " if gpu else ""
    return Runtime(SIM, "Simulator path: "
                        f"{seen}{reason}.", "cpu", "CPU (Numba CUDA simulator)", fixes)


def _decide() -> Runtime:
    forced = os.environ.get(ENV_FORCE, "").strip().lower()
    if forced and forced not in (SIM, CUDA):
        raise CourseEnvironmentError(
            f"{ENV_FORCE}={forced!r} is not understood: use "
            f"{ENV_FORCE}=sim or {ENV_FORCE}=cuda, or unset it.")
    if forced == SIM or (os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" and forced != CUDA):
        why = (f"forced by {ENV_FORCE}=sim" if forced == SIM
               else "NUMBA_ENABLE_CUDASIM=1 was set before the course started")
        return Runtime(SIM, f"Simulator path, {why}.", "cpu", "CPU (Numba CUDA simulator)")
    try:
        import torch
    except ImportError as e:
        raise CourseEnvironmentError(
            f"PyTorch is not installed ({e}). Run `make setup` "
            "(or `pip install -e .`) and restart the kernel.") from None

    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            reason = f"this torch ({torch.__version__}) is a CPU build, so no GPU can be used"
            fixes = ("on a machine with an NVIDIA GPU, install a CUDA "
                     "build of torch: https://pytorch.org/get-started/locally/",)
        else:
            reason = "torch is a CUDA build but sees no GPU (no NVIDIA driver or device visible)"
            fixes = ("check `nvidia-smi`; on a laptop without an "
                     "NVIDIA GPU the simulator path is the right one",)
        return _simulator(forced, reason, fixes)

    if not numba_cuda_installed():
        reason = ("numba-cuda is not installed (it has no macOS wheels; plain "
                  "numba's built-in simulator runs the course's kernels)")
        fixes = ("pip install 'numba-cuda>=0.30,<0.31' (Linux or Windows with an NVIDIA GPU)",)
        return _simulator(forced, reason, fixes, torch.cuda.get_device_name(0))
    ok, error = probe_numba_cuda()
    if not ok:
        reason, fixes = explain_numba_failure(error or "")
        return _simulator(forced, reason, fixes, torch.cuda.get_device_name(0))
    return Runtime(CUDA, "GPU path: torch and numba-cuda both launched kernels on the GPU.",
                   "cuda:0", torch.cuda.get_device_name(0))


def _from_cache() -> Runtime | None:
    raw = os.environ.get(ENV_CACHE)
    if not raw:
        return None
    try:
        data = json.loads(raw)
        if data.pop("python", None) != sys.executable or data.pop("force", "") != os.environ.get(ENV_FORCE, ""):
            return None
        data["fixes"] = tuple(data.get("fixes", ()))
        return Runtime(**data)
    except (ValueError, TypeError):
        return None


def _apply(rt: Runtime) -> None:
    """Make numba's mode match the decision, or explain why it cannot."""
    want_sim = rt.path == SIM
    if "numba" in sys.modules:
        from numba import config
        if bool(config.ENABLE_CUDASIM) != want_sim:
            raise CourseEnvironmentError(
                "numba was imported before the course chose its runtime, in the "
                f"wrong mode ({'simulator' if config.ENABLE_CUDASIM else 'GPU'}; "
                f"the course needs {'the simulator' if want_sim else 'the GPU'}). "
                "Restart the kernel and run `import course` (or `from "
                "course.core.runtime import runtime`) before importing numba.")
    if want_sim:
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    else:
        os.environ.pop("NUMBA_ENABLE_CUDASIM", None)
    # Triton too: interpreted on the simulator path, before anything imports it
    prepare_triton(interpret=want_sim)


TRITON_ENV = "TRITON_INTERPRET"


def prepare_triton(interpret: bool) -> None:
    """Set ``TRITON_INTERPRET`` for the path chosen (Triton's interpreter on the simulator path),
    before Triton loads.

    Triton reads it as it is imported; once it is, this does nothing and
    :mod:`course.core.triton_path` checks the mode it was imported in.
    """
    if "triton" in sys.modules:
        return
    if interpret:
        os.environ[TRITON_ENV] = "1"
    else:
        os.environ.pop(TRITON_ENV, None)


@lru_cache(maxsize=1)
def runtime() -> Runtime:
    """The runtime for this process: decided once, then shared by every module."""
    rt = _from_cache() or _decide()
    _apply(rt)
    cache = dataclasses.asdict(rt)
    cache.update(python=sys.executable, force=os.environ.get(ENV_FORCE, ""))
    os.environ[ENV_CACHE] = json.dumps(cache)
    return rt


def gpu_count() -> int:
    """How many GPUs the course may use: 0 on the simulator path, else
    ``torch.cuda.device_count()``.

    Multi-GPU lessons (the sharded embedding) start one process per GPU when this is 2 or more.
    """
    if not runtime().on_gpu:
        return 0
    import torch
    return torch.cuda.device_count()


def torch_device():
    """The torch.device every course tensor lives on: cuda:0 on the GPU path, cpu otherwise."""
    import torch
    return torch.device(runtime().device)


def cuda():
    """The ``numba.cuda`` module, imported in the mode the runtime chose."""
    runtime()
    from numba import cuda as numba_cuda
    return numba_cuda


def as_numba(tensor):
    """A torch tensor as an array a Numba kernel takes, without a copy (``as_cuda_array`` on a GPU,
    a NumPy view on the simulator). View bfloat16 as int16 first (exact for kernels that move
    values)."""
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"as_numba expects a torch.Tensor, got {type(tensor).__name__}.")
    if tensor.dtype == torch.bfloat16:
        raise TypeError("bfloat16 has no Numba type. For a kernel that "
                        "only moves values (a gather, a copy), pass "
                        "tensor.view(torch.int16) instead; the bits are copied exactly.")
    rt = runtime()
    t = tensor.detach()
    if rt.on_gpu:
        if t.device.type != "cuda":
            raise ValueError(f"This tensor is on {t.device}, but the "
                             f"course runs on {rt.device}: create it with "
                             "device=course.device() or move it with .to(course.device()).")
        return cuda().as_cuda_array(t)
    if t.device.type != "cpu":
        raise ValueError(f"This tensor is on {t.device}, but the course runs on the "
                         "simulator (CPU): create it with device=course.device().")
    return t.numpy()


_streams: dict = {}


def numba_stream():
    """The Numba stream to launch on so kernels join torch's current stream.

    GPU path: ``numba.cuda.external_stream`` wrapping torch's current stream (cached
    per stream handle), so the launch is ordered with torch's work and is captured
    by ``torch.cuda.graph``. Simulator path: a simulator stream standing for the current
    stream of ``course.graphs()`` (cached per stream), so a simulated capture records the launch.
    """
    nc = cuda()
    # one simulator stream per stand-in torch stream, so a capture sees its launches
    if not runtime().on_gpu:
        from course.sim import stream as simstream
        return simstream.numba_stream_for(simstream.current_stream(), nc)
    import torch
    handle = torch.cuda.current_stream().cuda_stream
    stream = _streams.get(handle)
    if stream is None:
        stream = _streams[handle] = nc.external_stream(handle)
    return stream


def synchronize() -> None:
    """Wait for all queued GPU work (simulator: nothing to wait for, but refused during a capture,
    as on a GPU)."""
    if runtime().on_gpu:
        import torch
        torch.cuda.synchronize()
    else:
        from course.sim import stream as simstream
        simstream.synchronize()


def graphs():
    """``torch.cuda`` on the GPU path; its simulated graph and stream API (:mod:`course.sim.cuda`)
    otherwise.

    ``cg = course.graphs()`` then ``cg.CUDAGraph()``, ``cg.graph(g)``, ``cg.Stream()``,
    ``g.replay()``... run the same learner code on both paths: the simulator records at capture and
    replays without running Python.
    """
    if runtime().on_gpu:
        import torch
        return torch.cuda
    from course.sim import cuda as simcuda
    return simcuda


def capturing() -> bool:
    """True while the current stream captures a graph (``torch.cuda``'s, or the simulator's)."""
    return bool(graphs().is_current_stream_capturing())
