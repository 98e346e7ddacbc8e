"""Installing wherever a learner is: the dependency set per platform, the torch build, the make targets,
the doctor's verdicts, quiet runs."""
import json
import os
import re
import subprocess
import sys
import tomllib
import urllib.request
from pathlib import Path

import pytest

from course.core import runtime as rt_mod
from course.tools import doctor, render, torch_install

ROOT = Path(__file__).resolve().parent.parent

# --------------------------------------------------------------------------- the dependency set per platform

# pip evaluates environment markers (of ours and of every dependency, e.g. torch's nvidia-* for Linux) for the
# machine it runs on, even with --platform; this shim makes it evaluate them for the target platform instead.
# --isolated: PyPI as published, without this machine's pip configuration (local indexes, mirrors).
_PIP_SHIM = """
import json, sys
import pip._vendor.packaging.markers as markers
env = markers.default_environment()
env.update(json.loads(sys.argv[1]))
markers.default_environment = lambda: dict(env)
from pip._internal.cli.main import main
sys.exit(main(sys.argv[2:]))
"""

PLATFORMS = {
    "macos-arm64": ({"sys_platform": "darwin", "platform_system": "Darwin", "platform_machine": "arm64",
                     "os_name": "posix"}, ["macosx_14_0_arm64", "macosx_13_0_arm64", "macosx_11_0_arm64"]),
    "linux-x86_64": ({"sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
                      "os_name": "posix"}, [f"manylinux_2_{i}_x86_64" for i in range(17, 29)] + ["manylinux2014_x86_64"]),
    "windows-amd64": ({"sys_platform": "win32", "platform_system": "Windows", "platform_machine": "AMD64",
                       "os_name": "nt"}, ["win_amd64"]),
}


PLATFORMS["linux-x86_64-gpu"] = PLATFORMS["linux-x86_64"]  # a machine with an NVIDIA driver: GPU_TORCH


def _declared_requirements(driver: bool = False) -> list:
    """What `make setup` installs: torch_install's torch for the machine (TORCH unset) first, then the course with
    [test,lab]."""
    proj = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = proj["optional-dependencies"]
    torch = torch_install.default_requirement(driver)
    deps = [d for d in proj["dependencies"] if not d.startswith("torch")]
    return [torch] + deps + list(extras["test"]) + list(extras["lab"])


@pytest.fixture(scope="module")
def resolved(tmp_path_factory):
    """pip's dry-run report per platform (returncode, stderr, report), the four resolved side by side (each waits
    on the index more than it computes)."""
    try:
        urllib.request.urlopen("https://pypi.org/simple/pip/", timeout=10).close()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"PyPI is not reachable from here ({type(e).__name__}); the platform resolution needs it")
    runs = {}
    for name, (env, tags) in sorted(PLATFORMS.items()):
        env = dict(env, python_version="3.12", python_full_version="3.12.8", implementation_name="cpython",
                   platform_python_implementation="CPython")
        tmp = tmp_path_factory.mktemp(name)
        cmd = [sys.executable, "-c", _PIP_SHIM, json.dumps(env), "install", "--isolated", "--dry-run",
               "--ignore-installed", "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
               *[a for t in tags for a in ("--platform", t)], "--target", str(tmp / "t"),
               "--quiet", "--report", str(tmp / "report.json"), *_declared_requirements(name.endswith("-gpu"))]
        runs[name] = (subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True),
                      tmp / "report.json")
    out = {}
    for name, (proc, report) in runs.items():
        try:
            _, err = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        out[name] = (proc.returncode, err, report)
    return out


@pytest.mark.parametrize("name", sorted(PLATFORMS))
def test_dependencies_resolve_for_every_platform(name, resolved):
    """pip resolves the whole declared dependency set (course + test + lab) to wheels for the platform."""
    code, stderr, report = resolved[name]
    errors = "\n".join(line for line in stderr.splitlines() if "is ignored" not in line)
    assert code == 0, f"{name}: the dependencies do not resolve:\n{errors[-3000:]}"
    install = json.loads(report.read_text())["install"]
    names = {i["metadata"]["name"].lower().replace("_", "-") for i in install}
    assert {"torch", "numba", "numpy", "nbval", "jupyterlab"} <= names, names
    torch_v = next(i["metadata"]["version"] for i in install if i["metadata"]["name"].lower() == "torch")
    assert torch_v == torch_install.pinned_version(torch_install.default_requirement(name.endswith("-gpu"))), torch_v
    if name.startswith("macos"):
        assert "numba-cuda" not in names and not any(n.startswith(("nvidia-", "cuda-")) for n in names), names
    else:
        assert "numba-cuda" in names


def test_markers_give_macos_plain_numba():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.startswith("numba-cuda") and "sys_platform != 'darwin'" in d for d in deps)
    assert any(d.startswith("numba>") and "sys_platform == 'darwin'" in d for d in deps)


# --------------------------------------------------------------------------- the torch build

def test_torch_plan_picks_the_cpu_build_without_a_driver():
    args, why = torch_install.plan("torch==2.13.0", system="Linux", machine="x86_64", driver=False,
                                   index_env=None, cpu_index_ok=lambda: True)
    assert args[:3] == ["torch==2.13.0", "--index-url", torch_install.CPU_INDEX] and "CPU" in why


def test_torch_plan_falls_back_quietly_when_the_cpu_index_is_unreachable():
    args, why = torch_install.plan("torch==2.13.0", system="Linux", machine="x86_64", driver=False,
                                   index_env=None, cpu_index_ok=lambda: False)
    assert args == ["torch==2.13.0"] and "TORCH_INDEX" in why


def test_torch_plan_driver_macos_and_override():
    never = lambda: pytest.fail("the CPU index must not be probed here")  # noqa: E731
    assert torch_install.plan("torch", system="Linux", machine="x86_64", driver=True, index_env=None,
                              cpu_index_ok=never)[0] == ["torch"]
    assert torch_install.plan("torch", system="Darwin", machine="arm64", driver=False, index_env=None,
                              cpu_index_ok=never)[0] == ["torch"]
    args, why = torch_install.plan("torch==2.11.0 --pre", system="Linux", machine="x86_64", driver=False,
                                   index_env="https://example.invalid/whl", cpu_index_ok=never)
    assert args[:4] == ["torch==2.11.0", "--pre", "--index-url", "https://example.invalid/whl"]


def test_torch_plan_without_TORCH_gives_a_gpu_box_the_version_the_gpu_path_was_measured_with():
    never = lambda: pytest.fail("the CPU index must not be probed with a driver")  # noqa: E731
    args, why = torch_install.plan(None, system="Linux", machine="x86_64", driver=True, index_env=None,
                                   cpu_index_ok=never)
    assert args == [torch_install.GPU_TORCH] == ["torch==2.11.0"] and "measured" in why and "TORCH=" in why
    args, why = torch_install.plan("", system="Linux", machine="x86_64", driver=False, index_env=None,
                                   cpu_index_ok=lambda: True)
    assert args[:3] == [torch_install.LAPTOP_TORCH, "--index-url", torch_install.CPU_INDEX]
    assert torch_install.plan(None, system="Darwin", machine="arm64", driver=False, index_env=None,
                              cpu_index_ok=never)[0] == [torch_install.LAPTOP_TORCH]
    # TORCH says otherwise: it wins on a GPU box too
    assert torch_install.plan("torch==2.13.0", system="Linux", machine="x86_64", driver=True, index_env=None,
                              cpu_index_ok=never)[0] == ["torch==2.13.0"]
    assert torch_install.default_requirement(True) == "torch==2.11.0"
    assert torch_install.default_requirement(False) == torch_install.LAPTOP_TORCH
    assert torch_install.pinned_version("torch==2.11.0 --pre") == "2.11.0"
    assert torch_install.pinned_version("torch>=2.4") is None and torch_install.pinned_version("") is None


def test_the_gpu_boxs_torch_is_the_one_the_recordings_name():
    gpu = doctor.tested_torch()["cuda"]
    assert gpu and gpu.split("+")[0] == torch_install.pinned_version(torch_install.GPU_TORCH), (
        f"the GPU recordings were made with torch {gpu}; torch_install.GPU_TORCH says {torch_install.GPU_TORCH}")


def test_torch_install_on_a_simulated_gpu_box_installs_the_gpu_paths_torch(monkeypatch, capsys):
    ran = []
    monkeypatch.delenv("TORCH", raising=False)
    monkeypatch.delenv("TORCH_INDEX", raising=False)
    monkeypatch.setattr(torch_install, "torch_imports", lambda python=None: None)
    monkeypatch.setattr(torch_install, "has_nvidia_driver", lambda: True)
    monkeypatch.setattr(torch_install, "index_reachable", lambda *a, **k: pytest.fail("no CPU index on a GPU box"))
    monkeypatch.setattr(torch_install.subprocess, "run",
                        lambda cmd, **k: ran.append(cmd) or subprocess.CompletedProcess(cmd, 0))
    assert torch_install.main() == 0
    assert ran[-1][-1] == "torch==2.11.0" and "Installing torch==2.11.0" in capsys.readouterr().out
    monkeypatch.setenv("TORCH", "torch==2.12.0")
    assert torch_install.main() == 0 and ran[-1][-1] == "torch==2.12.0"


def test_doctor_names_the_torch_each_path_was_tested_with_and_warns_on_another(tmp_path):
    tested = {"cuda": "2.11.0+cu130", "sim": "2.13.0"}
    ok = doctor.torch_tested_row("2.11.0+cu130", "cuda", tested)
    assert ok.status == doctor.OK and "GPU path: 2.11.0+cu130" in ok.value and "simulator path: 2.13.0" in ok.value
    assert doctor.torch_tested_row("2.11.0", "cuda", tested).status == doctor.OK  # PyPI's build of the same release
    bad = doctor.torch_tested_row("2.13.0+cu130", "cuda", tested)
    assert bad.status == doctor.WARN and "pip install torch==2.11.0" in bad.fix and "2.13.0+cu130" in bad.fix
    assert doctor.torch_tested_row("2.13.0+cpu", "sim", tested).status == doctor.OK
    lap = doctor.torch_tested_row("2.12.1", "sim", tested)
    assert lap.status == doctor.WARN and "pip install torch==2.13.0" in lap.fix
    for i, (path, torch_v) in enumerate([("cuda", "2.11.0+cu130"), ("cuda", "2.11.0+cu130"), ("cuda", "2.10.0"),
                                         ("sim", "2.13.0")]):
        (tmp_path / f"r{i}.json").write_text(json.dumps({"provenance": {"path": path, "torch": torch_v}}))
    (tmp_path / "broken.json").write_text("{")
    assert doctor.tested_torch(tmp_path)["cuda"] == "2.11.0+cu130"
    assert doctor.tested_torch(tmp_path / "none")["cuda"] is None


def test_the_doctor_reports_the_tested_torch_here():
    rows, verdict = doctor.diagnose()
    row = next(r for r in rows if r.item == "torch tested")
    assert "GPU path: 2.11.0" in row.value and verdict["path"] in ("sim", "cuda")


def test_torch_probes_are_quick_and_safe():
    assert torch_install.index_reachable("http://127.0.0.1:9/nothing", timeout=2) is False
    assert isinstance(torch_install.has_nvidia_driver(), bool)
    assert torch_install.torch_imports() == __import__("torch").__version__


def test_torch_install_leaves_an_importable_torch_alone(capsys):
    assert torch_install.main() == 0
    assert "already installed" in capsys.readouterr().out


# --------------------------------------------------------------------------- make targets

def _make_n(target, **env):
    e = {k: v for k, v in os.environ.items() if k not in ("CONDA_PREFIX", "CONDA_DEFAULT_ENV", "USE_VENV",
                                                         "MAKEFLAGS", "MAKEOVERRIDES", "MFLAGS", "MAKELEVEL")}
    e.update(env)
    out = subprocess.run(["make", "-n", "-B", target], cwd=ROOT, capture_output=True, text=True, env=e, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.skipif(subprocess.run(["which", "make"], capture_output=True).returncode != 0, reason="no make here")
def test_make_targets_venv_conda_lab_and_gpu_lane(tmp_path):
    plain = _make_n("test")
    assert "-m venv .venv" in plain and "course.tools.torch_install" in plain
    assert "TORCH ?=\n" in (ROOT / "Makefile").read_text(), "the Makefile must leave TORCH empty by default"
    assert (".venv/bin/python -m pytest -p no:cacheprovider -n 2 --dist loadfile --max-worker-restart=0 tests notebooks "
            "labs solutions") in plain
    assert "-m pytest -p no:cacheprovider  tests notebooks" in _make_n("test", TEST_WORKERS="0")
    conda = _make_n("test", CONDA_PREFIX=str(tmp_path), CONDA_DEFAULT_ENV="capture-replay")
    assert "-m venv" not in conda and f"{tmp_path}/bin/python -m pytest" in conda
    assert f"{tmp_path}/bin/python -m pip install -e . --no-deps" in conda
    assert "-m venv .venv" in _make_n("test", CONDA_PREFIX=str(tmp_path), CONDA_DEFAULT_ENV="base")
    assert "-m course workspace --lab" in _make_n("lab")
    gpu = _make_n("gpu-test", WHEELS=str(tmp_path))
    assert "--target" in gpu and "COURSE_PATH=cuda" in gpu and "gpu-site" in gpu and " -n " not in gpu


def test_pyproject_license_is_an_spdx_string():
    """setuptools >= 77 wants `license = "SPDX"`; the old table form prints a deprecation banner per build step."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert isinstance(meta["project"]["license"], str) and meta["project"]["license"] == "Apache-2.0"
    req = next(r for r in meta["build-system"]["requires"] if r.startswith("setuptools"))
    assert tuple(int(x) for x in re.search(r">=\s*([\d.]+)", req).group(1).split(".")) >= (77,), req


def test_building_the_course_prints_no_deprecation_banner(tmp_path):
    """Build a wheel with this environment's setuptools (no download): no warning banner, the licence in METADATA."""
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"setuptools {setuptools.__version__} here; the build uses >= 77 (pyproject.toml)")
    import shutil
    import zipfile
    src = tmp_path / "src"  # a copy: an in-tree build would leave build/ and *.egg-info in the checkout
    shutil.copytree(ROOT / "course", src / "course", ignore=shutil.ignore_patterns("__pycache__"))
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / f, src / f)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                          "-w", str(tmp_path / "wheel"), str(src)], capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert "deprecat" not in text.lower() and "BuildBackendWarning" not in text, text[-3000:]
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith("METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in meta


def test_make_course_doctor_does_not_say_run_make_course():
    recipe = _make_n("course")
    assert "COURSE_FROM_MAKE=course" in recipe and "COURSE_FROM_MAKE=doctor" in _make_n("doctor")
    ok = {"broken": False, "path": None}
    assert "make course" not in doctor.next_step(ok, "course") and "Running the notebooks next" in \
        doctor.next_step(ok, "course")
    assert "`make course`" in doctor.next_step(ok, "doctor")
    assert "python -m course run" in doctor.next_step(ok, None)
    assert "run `make course` again" in doctor.next_step({"broken": True}, "course")
    assert "`python -m course doctor` again" in doctor.next_step({"broken": True}, None)


def test_doctor_reads_where_it_runs(monkeypatch, capsys):
    rows = [doctor.Row("Python", "3")]
    monkeypatch.setattr(doctor, "diagnose", lambda: (rows, {"broken": False, "path": None}))
    monkeypatch.setenv(doctor.ENV_FROM_MAKE, "course")
    assert doctor.main() == 0
    assert capsys.readouterr().out.rstrip().endswith("Ready. Running the notebooks next (python -m course run).")
    monkeypatch.delenv(doctor.ENV_FROM_MAKE)
    doctor.main()
    assert "Ready: run `python -m course run`" in capsys.readouterr().out
    assert "Ready: run `make course`" in doctor.render(rows, {"broken": False, "path": None}, "doctor")


def test_ci_installs_the_browser_and_fails_on_no_tests():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "chromium-driver" in ci and "apt-get" in ci and "set -euo pipefail" in ci


# --------------------------------------------------------------------------- doctor and runtime

def test_doctor_warns_but_passes_without_numba_cuda(monkeypatch):
    real = doctor.package_version
    monkeypatch.setattr(doctor, "package_version", lambda n: None if n == "numba-cuda" else real(n))
    rows, verdict = doctor.diagnose()
    row = next(r for r in rows if r.item == "numba-cuda")
    assert row.status == doctor.WARN and "simulator" in row.fix and not verdict["broken"]


def test_doctor_breaks_without_numba(monkeypatch):
    real = doctor.package_version
    monkeypatch.setattr(doctor, "package_version", lambda n: None if n in ("numba", "numba-cuda") else real(n))
    rows, verdict = doctor.diagnose()
    assert next(r for r in rows if r.item == "numba").status == doctor.BROKEN and verdict["broken"]


def test_doctor_points_to_the_course_env(tmp_path, monkeypatch):
    assert doctor.other_env_hint(tmp_path) == ""
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "python").touch()
    monkeypatch.setattr(sys, "prefix", "/somewhere/else")
    assert "source .venv/bin/activate" in doctor.other_env_hint(tmp_path)


def test_runtime_without_numba_cuda_takes_the_simulator(monkeypatch):
    import torch
    monkeypatch.delenv("NUMBA_ENABLE_CUDASIM", raising=False)
    monkeypatch.delenv("COURSE_PATH", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Fake GPU")
    monkeypatch.setattr(rt_mod, "numba_cuda_installed", lambda: False)
    rt = rt_mod._decide()
    assert rt.path == "sim" and "numba-cuda is not installed" in rt.reason and rt.fixes
    monkeypatch.setenv("COURSE_PATH", "cuda")
    with pytest.raises(rt_mod.CourseEnvironmentError, match="numba-cuda"):
        rt_mod._decide()


def test_numba_cuda_installed_here():
    assert rt_mod.numba_cuda_installed() == (doctor.package_version("numba-cuda") is not None)


def test_cli_without_dependencies_says_which_python():
    code = ("import sys, runpy; sys.modules['nbformat'] = None; sys.argv = ['course', 'check', 'x.ipynb'];"
            "runpy.run_module('course', run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 3 and "Traceback" not in out.stderr
    assert "nbformat" in out.stderr and sys.executable in out.stderr


# --------------------------------------------------------------------------- quiet runs

def test_course_run_is_quiet_and_plain(tmp_path, capfd):
    import nbformat
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print('hi')"),
                                         nbformat.v4.new_code_cell("raise ValueError('boom')")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = tmp_path / "q.ipynb"
    nbformat.write(nb, path)
    _, err = render.execute(path, timeout=120)
    captured = capfd.readouterr()
    assert "without encryption" not in captured.err + captured.out
    assert "boom" in err and "\x1b[" not in err
    assert render.plain("\x1b[0;31mValueError\x1b[0m: x") == "ValueError: x"
    assert render.KERNEL_ARGS


@pytest.mark.skipif(rt_mod.runtime().on_gpu, reason="simulator behaviour")
def test_numba_stream_with_plain_numbas_simulator(monkeypatch):
    """macOS has plain numba, whose built-in simulator has stream() but no default_stream()."""
    import types
    fake = types.SimpleNamespace(stream=lambda: "plain-numba-stream")
    monkeypatch.setattr(rt_mod, "cuda", lambda: fake)
    assert rt_mod.numba_stream() == "plain-numba-stream"


# --------------------------------------------------------------------------- the GPU lane is self-contained

def test_notebook_kernels_import_this_checkout(tmp_path):
    """conftest.py puts the project root on the kernels' PYTHONPATH: a kernel started in notebooks/ imports this
    checkout's course even where the course is not installed (the GPU lane: 152 failures without it)."""
    import nbformat
    from nbclient import NotebookClient
    assert str(ROOT) in os.environ["PYTHONPATH"].split(os.pathsep)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import course; print(course.__file__)")])
    NotebookClient(nb, kernel_name="python3", timeout=120, extra_arguments=render.KERNEL_ARGS,
                   resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
    assert nb.cells[0].outputs[0]["text"].strip() == str(ROOT / "course" / "__init__.py")


def _target_installed_nbconvert(tmp_path, monkeypatch):
    """A fake ``pip --target`` install of nbconvert: the package and its templates under tmp_path/site."""
    import types
    site = tmp_path / "site"
    (site / "nbconvert").mkdir(parents=True)
    (site / "nbconvert" / "__init__.py").touch()
    (site / "share" / "jupyter" / "nbconvert" / "templates").mkdir(parents=True)
    monkeypatch.setitem(sys.modules, "nbconvert", types.SimpleNamespace(__file__=str(site / "nbconvert" / "__init__.py")))
    monkeypatch.setenv("JUPYTER_PATH", "")
    return site / "share" / "jupyter"


def test_nbconvert_templates_found_after_a_target_install(tmp_path, monkeypatch):
    """nbconvert installed with `pip --target DIR` keeps its templates in DIR/share/jupyter: put on JUPYTER_PATH,
    by one function (course.tools.render) that conftest.py (for nbval's kernels) and `course run` both call."""
    import conftest
    share = _target_installed_nbconvert(tmp_path, monkeypatch)
    assert render.nbconvert_share_dir() == share
    assert render.expose_nbconvert_templates() == share
    assert os.environ["JUPYTER_PATH"].split(os.pathsep) == [str(share)]
    render.prepend_env_path("JUPYTER_PATH", str(share))  # once only
    assert os.environ["JUPYTER_PATH"] == str(share)
    monkeypatch.setenv("JUPYTER_PATH", "")
    conftest._expose_course_to_kernels()
    assert os.environ["JUPYTER_PATH"].split(os.pathsep)[0] == str(share)


def test_course_run_finds_nbconvert_templates_after_a_target_install(tmp_path, monkeypatch):
    """The renderer puts the templates on JUPYTER_PATH before exporting HTML (the GPU lane wrote no HTML:
    "No template sub-directory with name 'lab' found")."""
    import nbformat
    share = _target_installed_nbconvert(tmp_path, monkeypatch)
    body, err = render.to_html(nbformat.v4.new_notebook())  # the fake nbconvert cannot export: a reason, no crash
    assert body is None and err
    assert os.environ["JUPYTER_PATH"].split(os.pathsep)[0] == str(share)


def test_no_target_install_leaves_jupyter_path_alone(tmp_path, monkeypatch):
    import types
    monkeypatch.setitem(sys.modules, "nbconvert", types.SimpleNamespace(__file__=str(tmp_path / "nbconvert.py")))
    monkeypatch.setenv("JUPYTER_PATH", "")
    assert render.expose_nbconvert_templates() is None and os.environ["JUPYTER_PATH"] == ""
    monkeypatch.setitem(sys.modules, "nbconvert", None)  # not installed at all
    assert render.nbconvert_share_dir() is None


def test_kernels_import_this_checkout_for_course_run_and_check(monkeypatch):
    """`course run` and `course check` kernels import this checkout's course where it is not installed (the GPU
    lane: `course check` there reported "No module named 'course'" in every cell)."""
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    render.expose_course_to_kernels()
    parts = os.environ["PYTHONPATH"].split(os.pathsep)
    assert parts[0] == str(render.ROOT) and "/elsewhere" in parts
    render.expose_course_to_kernels()  # once only
    assert os.environ["PYTHONPATH"].split(os.pathsep).count(str(render.ROOT)) == 1
