import json
import os
import time

import numpy as np
import pytest
import torch

import course
from course.core import checks, reference
from course.core.isolate import env_set
from course.core.results import Result
from course.core.runtime import cuda
from course.core.timing import Timing, capture_calls, time_enqueue
from course.lessons.launch_overhead import bench, launch
from course.lessons.launch_overhead.bench import launch_costs_result
from course.lessons.launch_overhead.checks import check_crossover
from course.lessons.launch_overhead.launch import tiny_kernels


def _rows():
    return [{"bytes": b, "host_enqueue_us": 5.0, "kernel_exec_us": e}
            for b, e in [(64, 1.5), (4096, 1.6), (65536, 3.0), (1 << 20, 6.0), (1 << 22, 20.0)]]


def test_crossover_bytes():
    assert launch.crossover_bytes(_rows()) == 1 << 20
    assert launch.crossover_bytes([{"bytes": 1, "host_enqueue_us": 9, "kernel_exec_us": 1}]) is None


def test_check_crossover_accepts_right_and_rejects_wrong():
    res = Result("s", "S", {"bytes": "B", "host_enqueue_us": "us", "kernel_exec_us": "us"}, _rows())
    res.add_summary("crossover_bytes", launch.crossover_bytes(res.rows), "B")

    checks.reset()
    check_crossover(launch.crossover_bytes, res)
    assert checks.status("01 crossover") == checks.PASS
    check_crossover(lambda rows: 64, res)
    assert checks.status("01 crossover") == checks.FAIL
    checks.reset()


def test_trace_rows_extracts_lanes():
    trace = {"traceEvents": [
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 100 + 10 * i, "dur": 4} for i in range(3)] + [
        {"ph": "X", "cat": "kernel", "name": "add_kernel", "ts": 103 + 10 * i, "dur": 2} for i in range(3)]}
    rows = bench._trace_rows(trace, skip=1)
    lanes = [r["lane"] for r in rows]
    assert lanes.count("GPU: kernel") == 2 and lanes.count("CPU: cudaLaunchKernel") == 2
    assert min(r["start_us"] for r in rows) == 0
    assert bench._trace_rows({"traceEvents": []}) == []


def test_cpu_dispatch_runs_live_everywhere():
    """The cell of lesson 01 (read out of its answer version) runs live on this machine."""

    res = reference.get("cpu_dispatch").fn(max_exp=8, repeats=3)
    assert res.live and len(res.rows) == 4
    assert all(r["time_us"] > 0 for r in res.rows)
    assert res.value("dispatch_floor_us") == min(res.column("time_us"))


@pytest.mark.skipif(not course.runtime().on_gpu, reason="needs a GPU")
def test_gpu_launch_experiments_quick():
    costs = reference.get("launch_costs").fn(repeats=5)
    assert costs.value("torch_launch_us") > costs.value("torch_kernel_exec_us") > 0
    sweep = reference.get("launch_sweep").fn(max_exp=16, repeats=5)
    assert sweep.rows[-1]["kernel_exec_us"] > 0
    tl = reference.get("launch_timeline").fn(ops=10)
    assert 0 < tl.value("gpu_busy_fraction") <= 1.0


def test_outliers_names_a_point_far_off_both_neighbours():
    rows = [{"bytes": b, "kernel_exec_us": v} for b, v in [(1, 1.5), (2, 1.6), (4, 11.7), (8, 1.8), (16, 3.0)]]
    (odd, left, right), = launch.outliers(rows)
    assert odd["bytes"] == 4 and left["bytes"] == 2 and right["bytes"] == 8
    assert launch.outliers(list(reversed(rows)))[0][0]["bytes"] == 4  # read in order of bytes, not of the list
    low = [{"bytes": b, "kernel_exec_us": v} for b, v in [(1, 9.0), (2, 1.0), (4, 9.5)]]
    assert [r["bytes"] for r, *_ in launch.outliers(low)] == [2]
    rising = [{"bytes": 2 ** i, "kernel_exec_us": 2.0 ** i} for i in range(8)]  # a slope is not an outlier
    assert launch.outliers(rising) == []
    with pytest.raises(ValueError, match="factor"):
        launch.outliers(rows, factor=1.0)


def test_sweep_timings_measures_sizes_in_turns_so_a_passing_disturbance_makes_no_outlier():
    """A disturbance as long as five samples: measured one size after the other it lands on five of the seven
    repeats of one size, whose median moves; measured in turns it lands on at most two repeats of any size."""


    def disturbed(first_call: int):
        calls = {"n": 0}
        window = range(first_call + 2 * 14, first_call + 2 * 19)  # samples 14..18 of 2 calls each

        def op():
            calls["n"] += 1
            if calls["n"] in window:
                time.sleep(0.004)
        return op

    op = disturbed(first_call=1)  # one size after the other, no warm-up: samples 14..18 all belong to size 3
    one_by_one = {n: time_enqueue(op, warmup=0, repeats=7, inner=2) for n in (1, 2, 3, 4, 5)}
    assert one_by_one[3].median >= 0.004 and all(one_by_one[n].median < 0.002 for n in (1, 2, 4, 5))

    op = disturbed(first_call=5 * 10 + 1)  # after time_interleaved's warm-up: 10 calls of each of the 5 sizes
    t = launch.sweep_timings({n: op for n in (1, 2, 3, 4, 5)}, {n: (lambda: None) for n in (1, 2, 3, 4, 5)},
                             repeats=7, inner=2)
    enq = {n: t[n][0] for n in t}
    assert all(tm.median < 0.002 for tm in enq.values()), {n: tm.median for n, tm in enq.items()}
    assert max(tm.max for tm in enq.values()) >= 0.004  # the disturbance happened, inside the spread
    assert all(t[n][2].inner == 2 for n in t)  # replay time is per call


@pytest.mark.skipif(course.runtime().on_gpu, reason="simulator behaviour")
def test_capture_calls_needs_a_gpu_and_a_count():
    with pytest.raises(ValueError, match="calls must be >= 1"):
        capture_calls(lambda: None, 0)
    with pytest.raises(Exception, match="needs a real GPU"):
        capture_calls(lambda: None, 3)


@pytest.mark.skipif(not course.runtime().on_gpu, reason="needs a GPU")
def test_capture_calls_replays_every_call():

    x = torch.zeros(4, device="cuda")
    g = capture_calls(lambda: x.add_(1.0), 5)
    x.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert x.tolist() == [5.0] * 4


def test_launch_costs_result_reads_the_cells_timings():
    def t(us):
        return Timing(us * 1e-6, us * 0.9e-6, us * 1.1e-6, us * 0.8e-6, us * 1.2e-6, 5, 20, "host-enqueue")

    rows = [{"op": "torch", "enqueue": t(10.0), "gpu": t(11.0), "exec_s": 2e-6},
            {"op": "numba empty", "enqueue": t(30.0), "gpu": t(31.0), "exec_s": 1e-6}]
    res = launch_costs_result(rows, repeats=5)
    assert res.column("op") == ["torch", "numba empty"]
    assert res.value("torch_launch_us") == pytest.approx(10.0) and res.value("numba_empty_launch_us") == pytest.approx(30.0)
    assert res.value("torch_launch_over_exec") == pytest.approx(5.0)
    assert res.rows[0]["host_q1_us"] == pytest.approx(9.0) and res.params == {"repeats": 5}


def test_tiny_kernels_compile_and_run_on_this_path():

    empty, add_one = tiny_kernels()
    a = cuda().to_device(np.zeros(4, dtype=np.float32))
    add_one[1, 4](a)
    empty[1, 1]()
    assert a.copy_to_host().tolist() == [1.0, 1.0, 1.0, 1.0]


def _timing(us):
    return Timing(us * 1e-6, us * 0.9e-6, us * 1.1e-6, us * 0.8e-6, us * 1.2e-6, 5, 10, "x")


def test_pow2_sizes_and_bad_ranges():
    assert launch.pow2_sizes(2, 6) == [4, 16, 64] and launch.pow2_sizes(4, 6, step=1) == [16, 32, 64]
    with pytest.raises(ValueError, match="min_exp <= max_exp"):
        launch.pow2_sizes(8, 4)


def test_sweep_result_reads_the_three_clocks_per_size():
    timings = {16: (_timing(5.0), _timing(6.0), _timing(1.0)), 1 << 20: (_timing(5.2), _timing(30.0), _timing(25.0)),
               1 << 24: (_timing(4.8), _timing(400.0), _timing(390.0))}
    facts = {"l2_bytes": 1 << 22, "peak_dram_GBps": 3350.0}
    res = bench.sweep_result(timings, facts, 4, 24, 5)
    assert res.column("elements") == [16, 1 << 20, 1 << 24] and res.column("bytes") == [64, 4 << 20, 64 << 20]
    assert res.column("fits_in_l2") == [True, True, False]
    assert res.rows[1]["eager_gpu_us"] == pytest.approx(30.0) and res.rows[1]["kernel_exec_q3_us"] == pytest.approx(27.5)
    assert res.value("launch_us") == pytest.approx(5.0) and res.value("crossover_bytes") == 4 << 20
    assert res.value("dram_bandwidth_GBps") == pytest.approx(2 * (64 << 20) / 390e-6 / 1e9)
    assert res.value("hardware_peak_dram_GBps") == 3350.0 and res.params["repeats"] == 5
    no_l2 = bench.sweep_result(timings, {"l2_bytes": None, "peak_dram_GBps": None}, 4, 24, 5)
    assert "dram_bandwidth_GBps" not in no_l2.summary and "hardware_peak_dram_GBps" not in no_l2.summary


def test_timeline_result_and_chrome_trace():
    trace = {"traceEvents": [
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 100 + 10 * i, "dur": 4} for i in range(4)] + [
        {"ph": "X", "cat": "kernel", "name": "add_kernel", "ts": 103 + 10 * i, "dur": 2} for i in range(4)]}

    class Prof:
        def export_chrome_trace(self, path):
            with open(path, "w") as f:
                json.dump(trace, f)

    assert bench.chrome_trace(Prof()) == trace
    res = bench.timeline_result(trace, ops=3, skip=1)
    assert res.params == {"ops": 3} and len(res.rows) == 6
    assert res.value("gpu_busy_fraction") == pytest.approx(6 / 22) and res.value("mean_gap_us") == pytest.approx(8.0)
    assert res.value("mean_kernel_us") == pytest.approx(2.0)
    assert "gpu_busy_fraction" not in bench.timeline_result({"traceEvents": []}, ops=3, skip=1).summary


def test_cpu_dispatch_result_finds_the_floor_and_the_doubling():
    res = bench.cpu_dispatch_result({4: _timing(2.0), 64: _timing(1.5), 1024: _timing(2.9), 16384: _timing(3.1)}, 2, 14, 5)
    assert res.value("dispatch_floor_us") == pytest.approx(1.5)
    assert res.value("size_at_twice_floor_bytes") == 16384 * 4
    assert res.rows[0]["q1_us"] == pytest.approx(1.8) and res.params["threads"] >= 1


def test_env_set_sets_and_unsets_for_the_block_then_puts_everything_back(monkeypatch):

    monkeypatch.setenv("COURSE_T_KEEP", "old")
    monkeypatch.setenv("COURSE_T_GONE", "there")
    monkeypatch.delenv("COURSE_T_NEW", raising=False)
    with pytest.raises(RuntimeError):
        with env_set({"COURSE_T_KEEP": "new", "COURSE_T_GONE": None, "COURSE_T_NEW": 3}):
            assert os.environ["COURSE_T_KEEP"] == "new" and os.environ["COURSE_T_NEW"] == "3"
            assert "COURSE_T_GONE" not in os.environ
            raise RuntimeError("the block fails: the environment comes back all the same")
    assert os.environ["COURSE_T_KEEP"] == "old" and os.environ["COURSE_T_GONE"] == "there"
    assert "COURSE_T_NEW" not in os.environ
