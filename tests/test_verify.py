"""`python -m course verify-embedding`: the report, its exit codes, never a traceback."""
import pytest
import torch

from course.embedding import verify as V
from course.embedding.lookup import error_flag, reset_errors
from course.tools.cli import main as cli
from course.core.runtime import runtime

GPU = pytest.mark.skipif(not runtime().on_gpu, reason="needs a real GPU")
SIM = pytest.mark.skipif(runtime().on_gpu, reason="simulator behaviour")


@SIM
@pytest.mark.parametrize("impl", ["cpu-copy", "device"])
def test_simulator_says_capture_needs_a_gpu_and_exits_2(impl, capsys):
    assert V.main(impl) == 2
    out = capsys.readouterr()
    assert f"impl={impl}" in out.out
    assert "✓ the" in out.out and "matches F.embedding on the Numba CUDA simulator" in out.out
    assert "need a real GPU" in out.out and runtime().reason in out.out
    assert "Traceback" not in out.out + out.err


@SIM
def test_the_report_judges_its_own_forward_not_an_earlier_lookups_error(capsys):
    """An earlier lookup's out-of-range id left in the error flag (a -1 in a 512-row table, from
    another test in the same process) is not this report's."""
    flag = error_flag()
    flag.copy_(torch.tensor([1, 3, -1, 512]))
    try:
        assert V.main("cpu-copy") == 2, capsys.readouterr().out
    finally:
        reset_errors()


@SIM
def test_cli_wires_verify_embedding(capsys):
    assert cli(["verify-embedding", "--impl", "device"]) == 2
    assert "need a real GPU" in capsys.readouterr().out


def test_internal_errors_are_reported_without_traceback(monkeypatch, capsys):
    def boom(*args, **kwargs):
        raise ValueError("something broke")
    monkeypatch.setattr(V, "_simulator_report", boom)
    monkeypatch.setattr(V, "run_checks", boom)
    assert V.main("device") == 3
    out = capsys.readouterr().out
    assert "could not finish: ValueError: something broke" in out and "Traceback" not in out


def test_summary_marks_and_exit_code(capsys):
    good = [V.Check("capture", True, ["ok"]), V.Check("async", True, ["ok"])]
    assert V.summary(good) == 0
    assert "✓ all checks passed" in capsys.readouterr().out
    bad = good + [V.Check("replay", False, ["no"])]
    assert V.summary(bad) == 1
    out = capsys.readouterr().out
    assert out.count("✓ pass") == 2 and out.count("✗ FAIL") == 1
    assert "1 check(s) failed (replay with new ids)" in out
    assert bad[2].title == "replay with new ids"


@GPU
def test_gpu_device_impl_passes_every_check(capsys):
    checks = V.run_checks("device")
    assert [c.key for c in checks] == ["capture", "replay", "device_input", "async"]
    assert all(c.passed for c in checks), [(c.key, c.lines) for c in checks]
    assert V.main("device") == 0


@GPU
def test_gpu_cpu_copy_fails_with_the_exact_error(capsys):
    checks = {c.key: c for c in V.run_checks("cpu-copy")}
    assert not checks["capture"].passed
    assert "Cannot copy between CPU and CUDA tensors during CUDA graph capture" in checks["capture"].lines[0]
    assert not checks["replay"].passed and not checks["device_input"].passed and not checks["async"].passed
    assert V.main("cpu-copy") == 1
