"""The command line, the doctor, the notebook runner, the catalog and the blocking test."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

import course
from course.core import blocking
from course.tools import catalog, doctor, render
from course.tools.cli import build_parser, main

ROOT = Path(__file__).resolve().parent.parent


def test_cli_parses_every_command():
    p = build_parser()
    for argv in (["doctor"], ["run", "--only", "x"], ["bench", "--quick"], ["build-labs", "--check"],
                 ["check", "labs/x.ipynb"], ["verify-embedding", "--impl", "device"]):
        assert p.parse_args(argv).func
    with pytest.raises(SystemExit):
        p.parse_args(["verify-embedding", "--impl", "cpu"])


def test_doctor_reports_path_and_never_tracebacks():
    out = subprocess.run([sys.executable, "-m", "course", "doctor"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Traceback" not in out.stdout + out.stderr
    assert "Path:" in out.stdout and "numba-cuda" in out.stdout


def test_doctor_json_and_verdict():
    rows, verdict = doctor.diagnose()
    assert verdict["path"] == course.runtime().path and not verdict["broken"]
    assert {r.item for r in rows} >= {"Python", "torch", "numba-cuda", "numpy", "nbval", "trivial kernel"}


def test_doctor_flags_numpy_25(monkeypatch):
    """numpy 2.5 only blocks the GPU path (numba-cuda 0.30): a warning with the fix, exit 0."""
    real = doctor.package_version
    monkeypatch.setattr(doctor, "package_version", lambda n: "2.5.2" if n == "numpy" else real(n))
    rows, verdict = doctor.diagnose()
    row = next(r for r in rows if r.item == "numpy")
    assert row.status == doctor.WARN and "numpy<2.5" in row.fix and "row_stack" in row.fix
    assert not verdict["broken"]
    monkeypatch.setattr(doctor, "diagnose", lambda: (rows, verdict))
    assert doctor.main() == 0
    broken = rows + [doctor.Row("x", "y", doctor.BROKEN)]  # exit code 1 only when the course cannot run:
    monkeypatch.setattr(doctor, "diagnose", lambda: (broken, dict(verdict, broken=True)))
    assert doctor.main() == 1


def test_doctor_flags_missing_torch(monkeypatch):
    real = doctor.package_version
    monkeypatch.setattr(doctor, "package_version", lambda n: None if n == "torch" else real(n))
    rows, verdict = doctor.diagnose()
    assert next(r for r in rows if r.item == "torch").status == doctor.BROKEN and verdict["broken"]
    assert "Traceback" not in doctor.render(rows, verdict)


def test_run_executes_a_notebook_and_writes_html(tmp_path, monkeypatch):
    """`course run` on a notebook with figures (a stand-in for a lesson: every lesson runs under nbval already):
    the executed copy keeps the figures and the HTML carries them."""
    import nbformat

    monkeypatch.setenv("MPLBACKEND", "Agg")  # must not keep figures out of the executed notebook
    src = tmp_path / "notebooks" / "01_figures.ipynb"
    src.parent.mkdir()
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import course\ncourse.header()")] + [
        nbformat.v4.new_code_cell(f"import matplotlib.pyplot as plt\nplt.plot([0, 1], [{i}, 2])\nplt.show()")
        for i in range(3)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, src)
    rel = str(src.relative_to("/"))
    monkeypatch.setattr(render, "CATALOG", (catalog.Entry(rel, "figures", "lesson", ""),))
    monkeypatch.setattr(render, "ROOT", Path("/"))
    code = render.main(out=str(tmp_path / "out"), only=[Path(rel).name])
    assert code == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["path"] == course.runtime().path
    assert summary["notebooks"][0]["status"] == "passed"
    assert (tmp_path / "out" / "html" / Path(rel).with_suffix(".html")).stat().st_size > 10_000
    executed = json.loads((tmp_path / "out" / "executed" / rel).read_text())
    assert any(c.get("outputs") for c in executed["cells"] if c["cell_type"] == "code")
    images = [o for c in executed["cells"] for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) >= 3, "the executed notebook should carry its figures"


def test_run_reports_a_failing_notebook(tmp_path, monkeypatch):
    import nbformat
    bad = tmp_path / "bad.ipynb"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("raise ValueError('boom')")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, bad)
    monkeypatch.setattr(render, "CATALOG", (catalog.Entry(str(bad.relative_to("/")), "bad", "lesson", ""),))
    monkeypatch.setattr(render, "ROOT", Path("/"))
    assert render.main(out=str(tmp_path / "out")) == 1
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["notebooks"][0]["status"] == "failed" and "boom" in s["notebooks"][0]["error"]


def test_run_executes_two_notebooks_at_once_and_lists_them_in_the_courses_order(tmp_path, monkeypatch):
    import nbformat

    entries = []
    for name, src in (("slow", "import time; time.sleep(3); print('slow')"), ("fast", "print('fast')")):
        path = tmp_path / f"{name}.ipynb"
        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src)])
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        nbformat.write(nb, path)
        entries.append(catalog.Entry(str(path.relative_to("/")), name, "lesson", ""))
    monkeypatch.setattr(render, "CATALOG", tuple(entries))
    monkeypatch.setattr(render, "ROOT", Path("/"))
    assert render.main(out=str(tmp_path / "out"), jobs=2) == 0
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["jobs"] == 2 and [r["notebook"] for r in s["notebooks"]] == [e.path for e in entries]
    assert all(r["status"] == "passed" and r["html"] for r in s["notebooks"])
    executed = nbformat.read(tmp_path / "out" / "executed" / entries[0].path, as_version=4)
    assert executed.cells[0].outputs[0]["text"].strip() == "slow"


def test_side_by_side_notebooks_share_the_cpus_threads():
    assert render.thread_share(2, cpus=2) == 1 and render.thread_share(2, cpus=16) == 8
    assert render.thread_share(4, cpus=2) == 1 and render.thread_share(1, cpus=None) >= 1


def test_default_jobs_is_one_on_a_gpu_and_two_on_two_cpus():
    assert render.default_jobs(on_gpu=True, cpus=64) == 1
    assert render.default_jobs(on_gpu=False, cpus=2) == 2 and render.default_jobs(on_gpu=False, cpus=16) == 2
    assert render.default_jobs(on_gpu=False, cpus=1) == 1


def test_run_executes_the_lessons_and_labs_and_the_answers_on_request(tmp_path, monkeypatch):
    """`make course` runs what a learner reads (each answer version once more only with --answers)."""
    import nbformat

    ran = []
    monkeypatch.setattr(render, "execute", lambda path, timeout=900, env=None: (
        ran.append(Path(path).parent.name) or nbformat.v4.new_notebook(), None))
    assert main(["run", "--jobs", "1", "--out", str(tmp_path / "a")]) == 0
    assert sorted(set(ran)) == ["labs", "notebooks"] and len(ran) == len(catalog.entries()) - len(
        catalog.entries("solution"))
    ran.clear()
    assert main(["run", "--jobs", "1", "--answers", "--out", str(tmp_path / "b")]) == 0
    assert ran.count("solutions") == len(catalog.entries("solution"))


def test_run_rejects_unknown_notebook(tmp_path):
    assert main(["run", "--only", "nope.ipynb", "--out", str(tmp_path)]) == 2


def test_course_map_lists_lessons_and_labs():
    m = catalog.course_map()
    assert "01_launch_overhead" in m and "lab1_embedding_kernel" in m and "solutions/" not in m
    assert len(catalog.entries("lab")) >= 2 and {e.kind for e in catalog.entries("lab")} == {"lab"}


def test_course_map_lists_the_modules_of_every_experiment():
    from course.core import reference

    mods = reference.experiment_modules()
    assert mods == catalog.experiment_modules() and len(mods) == len(set(mods)) >= 5
    registered = {e.fn.__module__ for e in reference.load_all().values()}
    registered = {m for m in registered if not m.startswith("course_cells.")}  # cells: tests/test_cells.py
    assert registered == set(mods), f"listed but registering nothing: {set(mods) - registered}; " \
                                    f"registering but not listed: {registered - set(mods)}"
    for e in catalog.CATALOG:
        assert not e.experiments or e.kind in ("lesson", "lab"), f"{e.path}: experiments belong to a lesson or lab"


def test_a_listed_experiment_module_that_is_gone_fails_loudly(monkeypatch):
    from course.core import reference

    gone = catalog.Entry("notebooks/99_gone.ipynb", "gone", "lesson", "", ("course.lessons.no_such_module",))
    monkeypatch.setattr(catalog, "CATALOG", catalog.CATALOG + (gone,))
    with pytest.raises(ModuleNotFoundError, match=r"course/tools/catalog\.py.*'course\.lessons\.no_such_module'"):
        reference.load_all()
    deeper = catalog.Entry("notebooks/99_gone.ipynb", "gone", "lesson", "", ("course.no_such_package.experiments",))
    monkeypatch.setattr(catalog, "CATALOG", catalog.CATALOG[:-1] + (deeper,))
    with pytest.raises(ModuleNotFoundError, match="no such module"):
        reference.load_all()


def test_a_module_whose_own_import_fails_is_not_called_gone(monkeypatch, tmp_path):
    import sys

    from course.core import reference

    (tmp_path / "course_test_broken_mod.py").write_text("import course_test_missing_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    broken = catalog.Entry("notebooks/99_broken.ipynb", "b", "lesson", "", ("course_test_broken_mod",))
    monkeypatch.setattr(catalog, "CATALOG", catalog.CATALOG + (broken,))
    with pytest.raises(ModuleNotFoundError) as err:
        reference.load_all()
    assert err.value.name == "course_test_missing_dependency" and "course map" not in str(err.value)
    sys.modules.pop("course_test_broken_mod", None)


@pytest.mark.skipif(course.runtime().on_gpu, reason="simulator behaviour")
def test_blocking_is_not_measurable_on_simulator():
    rep = blocking.host_blocking(lambda: None)
    assert rep.blocked is None and "GPU" in rep.note
    assert blocking.event_complete_right_after(lambda: None) is None


@pytest.mark.skipif(not course.runtime().on_gpu, reason="needs a GPU")
def test_blocking_tells_sync_from_async():
    import torch
    x = torch.zeros(16, device="cuda")
    assert blocking.host_blocking(lambda: x.add_(1)).blocked is False
    assert blocking.host_blocking(lambda: x.sum().item()).blocked is True
    t0 = time.perf_counter()
    blocking.gpu_sleep(20)
    torch.cuda.synchronize()
    assert time.perf_counter() - t0 > 0.015


def test_provenance_helpers():
    from course.core import provenance
    assert provenance.cpu_model()
    drv = provenance.driver_version()
    assert drv is None or drv[0].isdigit()
    assert provenance.package_version("no-such-package-xyz") is None
    assert "torch" in provenance.describe(provenance.provenance())


def test_probe_numba_cuda_on_simulator():
    from course.core.runtime import probe_numba_cuda
    ok, err = probe_numba_cuda(simulator=True)
    assert ok and err is None


def test_torch_device_and_experiment_record():
    from course.core import reference
    from course.core.runtime import torch_device
    assert str(torch_device()) == course.runtime().device
    exp = reference.get("cpu_dispatch")
    assert isinstance(exp, reference.Experiment) and not exp.gpu_only and exp.quick


def test_doctor_row_and_render_html():
    import nbformat
    row = doctor.Row("x", "1")
    assert row.status == doctor.OK
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# hi")])
    body, err = render.to_html(nb)
    assert (body and "hi" in body and err is None) or (body is None and err)


@pytest.mark.skipif(not course.runtime().on_gpu, reason="needs a GPU")
def test_sleep_calibration_and_graph_time_per_op():
    import torch
    from course.lessons.launch_overhead.launch import graph_time_per_op
    assert blocking.sleep_cycles_per_ms() > 1e5  # GPU clocks run at hundreds of MHz
    x = torch.zeros(16, device="cuda")
    per_op, timing = graph_time_per_op(lambda: x.add_(1), ops=4, repeats=3)
    assert 0 < per_op < 1e-3 and timing.clock == "cuda-events"


def test_cell_times_times_each_code_cell(tmp_path):
    import nbformat

    from course.tools.cell_times import main, time_cells

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# t"), nbformat.v4.new_code_cell("import time\ntime.sleep(0.3)"),
                nbformat.v4.new_code_cell("print('graph_cache_trace [1/2] eager: a fresh process ...')")]
    path = tmp_path / "t.ipynb"
    nbformat.write(nb, str(path))
    lines = []
    rows = time_cells(path, timeout=60, log=lines.append)
    assert [r["cell"] for r in rows] == [1, 2] and rows[0]["seconds"] >= 0.3
    assert any("[1/2] eager" in line for line in lines) and lines[-3].startswith("total")
    assert main([str(path), "--json", str(tmp_path / "t.json"), "--root", str(tmp_path)]) == 0
    assert (tmp_path / "t.json").exists()
