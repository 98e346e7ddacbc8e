"""A stopped run takes its processes with it (course.core.reaper): ranks die with the process that launched them,
and ``python -m course check`` stopped by SIGTERM (``timeout``) kills its notebook kernel and the kernel's ranks.
Also: a crash on one rank is reported as that rank's, not as the other's lost connection (course.core.agree)."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from course.core import agree, reaper
from course.core.launch import cause

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's parent-death signal")

SLEEPER = '''
def sleeper(ctx, folder):
    """Write this rank's pid, then wait (as a rank stuck in a collective would)."""
    import os, pathlib, time
    pathlib.Path(folder, f"rank{ctx.rank}").write_text(str(os.getpid()))
    time.sleep(600)
'''


def _dead(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def _wait(predicate, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.3)
    return predicate()


def _env():
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def _pids(folder: Path, names) -> list:
    return [int((folder / n).read_text()) for n in names if (folder / n).exists() and (folder / n).read_text()]


def test_knock_on_errors_and_the_cause_rank():
    assert agree.knock_on("RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer [1.2.3.4]")
    assert agree.knock_on("Timed out waiting 60000ms for recv operation to complete")
    assert not agree.knock_on("IndexError: list index out of range")
    errors = {0: ("RuntimeError: Connection closed by peer", ""), 1: ("ValueError: 11 tokens do not fit", "")}
    assert cause(errors) == 1 and cause({0: ("RuntimeError: timed out", "")}) == 0
    assert issubclass(agree.RankLost, RuntimeError) and agree.group_for and agree.exchange  # used on every rank below
    assert reaper.kill_group(os.getpgrp()) is False and reaper.kill_group(0) is False  # never our own group
    assert reaper.kernel_groups(object()) == []  # no kernel started (yet): nothing to kill


def test_ranks_die_with_the_process_that_launched_them(tmp_path):
    script = tmp_path / "launcher.py"
    script.write_text(SLEEPER + textwrap.dedent(f'''
        if __name__ == "__main__":
            from course.core.launch import launch
            launch(sleeper, 2, backend="gloo", timeout=600, folder={str(tmp_path)!r})
        '''))
    proc = subprocess.Popen([sys.executable, str(script)], env=_env(), cwd=tmp_path)
    try:
        assert _wait(lambda: len(_pids(tmp_path, ("rank0", "rank1"))) == 2, 120), "the ranks never started"
        ranks = _pids(tmp_path, ("rank0", "rank1"))
        proc.kill()  # SIGKILL: no handler, no atexit runs in the launcher
        proc.wait(10)
        assert _wait(lambda: all(_dead(p) for p in ranks), 10), f"ranks {ranks} outlived their launcher"
    finally:
        if proc.poll() is None:
            proc.kill()


def _notebook(path: Path, folder: Path) -> None:
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(f"import os, pathlib\npathlib.Path({str(folder)!r}, 'kernel')"
                                          ".write_text(str(os.getpid()))"),
                nbformat.v4.new_code_cell(SLEEPER.strip()),
                nbformat.v4.new_code_cell("from course.core.launch import launch\n"
                                          f"launch(sleeper, 2, backend='gloo', timeout=600, folder={str(folder)!r})")]
    nbformat.write(nb, path)


def test_a_stopped_course_check_kills_its_kernel_and_the_ranks(tmp_path):
    """`timeout 20 python -m course check NB` sends SIGTERM: the kernel and both ranks must go with it."""
    nb = tmp_path / "stuck.ipynb"
    _notebook(nb, tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "course", "check", str(nb)], env=_env(), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        names = ("kernel", "rank0", "rank1")
        assert _wait(lambda: len(_pids(tmp_path, names)) == 3, 150), "the kernel or its ranks never started"
        pids = _pids(tmp_path, names)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, out)
        assert "stopped by SIGTERM" in out and "killed its process group" in out, out
        assert _wait(lambda: all(_dead(p) for p in pids), 10), f"{json.dumps(dict(zip(names, pids)))} outlived it"
    finally:
        if proc.poll() is None:
            proc.kill()


LATE = '''
def late_guard(ctx):
    """Rank 1 fails before lesson 05's input guard; rank 0 waits in the guard's exchange."""
    import torch
    from course.lessons.sharding.vocab_parallel import check_inputs

    if ctx.rank == 1:
        raise ValueError("rank 1 broke before its check")
    check_inputs(torch.zeros(4, dtype=torch.long), torch.zeros(8, 2), 16)
'''


def test_lesson_05s_guard_is_bounded_and_the_failing_rank_is_named():
    from course.core.cell_workers import CellWorker
    from course.core.launch import WorkerError, launch

    t0 = time.monotonic()
    with pytest.raises(WorkerError) as e:
        launch(CellWorker("late_guard", LATE, "<late_guard>"), 2, backend="gloo", timeout=300)
    assert e.value.first == 1 and "failed first on rank 1: ValueError: rank 1 broke before its check" in str(e.value)
    assert time.monotonic() - t0 < 120  # the guard's own limit, not the run's 300 s


def test_killed_on_signal_kills_the_groups_then_stops_as_the_signal_would(capsys):
    child = subprocess.Popen(["sleep", "60"], start_new_session=True)  # its own group, as a kernel's is
    before = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as e:
            with reaper.killed_on_signal(lambda: [child.pid], "a test"):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # the handler raises before this ends
        assert e.value.code == 128 + signal.SIGTERM and child.wait(5) == -signal.SIGKILL
        assert f"a test: stopped by SIGTERM; killed its process group(s) [{child.pid}]" in capsys.readouterr().err
        assert signal.getsignal(signal.SIGTERM) is before  # put back
    finally:
        if child.poll() is None:
            child.kill()
    assert reaper.die_with_parent(os.getppid()) is True  # Linux: this process now dies with its parent
