import json
import os
import subprocess
import sys

import pytest
import torch

import course
import importlib

rtmod = importlib.import_module("course.core.runtime")  # the module (course.runtime is also the function)
from course.core.runtime import CourseEnvironmentError, Runtime, runtime


def _decide_in_subprocess(env_extra, code="from course.core.runtime import runtime; r = runtime(); print(r.to_json())"):
    env = {k: v for k, v in os.environ.items() if k not in (rtmod.ENV_CACHE, rtmod.ENV_FORCE, "NUMBA_ENABLE_CUDASIM")}
    env.update(env_extra)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_runtime_is_decided_once_and_consistent():
    rt = runtime()
    assert rt is runtime()
    assert rt.path in ("cuda", "sim")
    assert rt.device == ("cuda:0" if rt.on_gpu else "cpu")
    assert str(course.device()) == rt.device
    assert rt.reason


def test_numba_mode_matches_decision():
    nc = course.cuda()
    from numba import config
    assert bool(config.ENABLE_CUDASIM) == (not runtime().on_gpu)
    assert nc is sys.modules["numba.cuda"]


def test_forcing_the_simulator():
    out = _decide_in_subprocess({"COURSE_PATH": "sim"})
    assert out.returncode == 0, out.stderr
    rt = json.loads(out.stdout.strip().splitlines()[-1])
    assert rt["path"] == "sim" and "COURSE_PATH=sim" in rt["reason"]


def test_bad_force_value_is_explained():
    out = _decide_in_subprocess({"COURSE_PATH": "gpu"})
    assert out.returncode != 0
    assert "COURSE_PATH=sim or COURSE_PATH=cuda" in out.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_forcing_cuda_without_gpu_fails_loudly():
    out = _decide_in_subprocess({"COURSE_PATH": "cuda"})
    assert out.returncode != 0
    assert "COURSE_PATH=cuda was asked for" in out.stderr


def test_numba_imported_first_in_wrong_mode_is_explained():
    # Import numba in GPU mode, then ask the course for the simulator.
    code = ("import os; os.environ.pop('NUMBA_ENABLE_CUDASIM', None); import numba.cuda; "
            "os.environ['COURSE_PATH']='sim'\n"
            "from course.core.runtime import runtime\n"
            "try:\n    runtime()\nexcept Exception as e:\n    print('ERR', e)")
    out = _decide_in_subprocess({}, code)
    assert "Restart the kernel" in out.stdout, out.stdout + out.stderr


def test_cached_decision_is_reused_by_children():
    raw = os.environ[rtmod.ENV_CACHE]
    data = json.loads(raw)
    assert data["path"] == runtime().path
    # a child that inherits the cache takes the same path without probing again
    env = dict(os.environ)
    out = subprocess.run([sys.executable, "-c", "from course.core.runtime import runtime; print(runtime().path)"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.strip() == runtime().path


def test_explain_numpy_25_failure():
    reason, fixes = rtmod.explain_numba_failure("AttributeError: module 'numpy' has no attribute 'row_stack'")
    assert "numpy" in reason and "row_stack" in reason
    assert fixes == ("pip install 'numpy<2.5'",)


def test_as_numba_views_share_memory():
    t = torch.arange(8, dtype=torch.float32, device=course.device())
    v = course.as_numba(t)
    assert tuple(v.shape) == (8,)
    if not runtime().on_gpu:
        v[0] = 42.0
        assert t[0].item() == 42.0


def test_as_numba_rejects_bad_input_with_advice():
    with pytest.raises(TypeError, match="torch.Tensor"):
        course.as_numba([1, 2, 3])
    with pytest.raises(TypeError, match=r"view\(torch.int16\)"):
        course.as_numba(torch.zeros(2, dtype=torch.bfloat16, device=course.device()))
    other = "cpu" if runtime().on_gpu else "meta"
    with pytest.raises(ValueError, match="course.device"):
        course.as_numba(torch.zeros(2, device=other))


cuda = course.cuda()


@cuda.jit
def fill(a, v):
    i = cuda.grid(1)
    if i < a.size:
        a[i] = v


def test_numba_stream_launches_a_kernel():
    t = torch.zeros(40, device=course.device())
    fill[2, 32, course.numba_stream()](course.as_numba(t), 7.0)
    course.synchronize()
    assert torch.all(t == 7.0)
    if course.runtime().on_gpu:
        assert course.numba_stream() is course.numba_stream()  # cached per torch stream


def test_runtime_serialises():
    r = Runtime("sim", "why", "cpu", "CPU", ("fix",))
    assert json.loads(r.to_json())["fixes"] == ["fix"]
    assert "simulator" in r.describe()


def test_header_prints_path(capsys):
    course.header()
    assert runtime().device_name in capsys.readouterr().out
