import pytest

import course
from course.lessons import launch_overhead as launch
from course.core.results import Result


def _rows():
    return [{"bytes": b, "host_enqueue_us": 5.0, "kernel_exec_us": e}
            for b, e in [(64, 1.5), (4096, 1.6), (65536, 3.0), (1 << 20, 6.0), (1 << 22, 20.0)]]


def test_crossover_bytes():
    assert launch.crossover_bytes(_rows()) == 1 << 20
    assert launch.crossover_bytes([{"bytes": 1, "host_enqueue_us": 9, "kernel_exec_us": 1}]) is None


def test_check_crossover_accepts_right_and_rejects_wrong():
    res = Result("s", "S", {"bytes": "B", "host_enqueue_us": "us", "kernel_exec_us": "us"}, _rows())
    res.add_summary("crossover_bytes", launch.crossover_bytes(res.rows), "B")
    launch.check_crossover(launch.crossover_bytes, res)
    with pytest.raises(AssertionError, match="median"):
        launch.check_crossover(lambda rows: 64, res)


def test_trace_rows_extracts_lanes():
    trace = {"traceEvents": [
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 100 + 10 * i, "dur": 4} for i in range(3)] + [
        {"ph": "X", "cat": "kernel", "name": "add_kernel", "ts": 103 + 10 * i, "dur": 2} for i in range(3)]}
    rows = launch._trace_rows(trace, skip=1)
    lanes = [r["lane"] for r in rows]
    assert lanes.count("GPU: kernel") == 2 and lanes.count("CPU: cudaLaunchKernel") == 2
    assert min(r["start_us"] for r in rows) == 0
    assert launch._trace_rows({"traceEvents": []}) == []


def test_cpu_dispatch_runs_live_everywhere():
    res = launch.cpu_dispatch(max_exp=8, repeats=3)
    assert res.live and len(res.rows) == 4
    assert all(r["time_us"] > 0 for r in res.rows)
    assert res.value("dispatch_floor_us") == min(res.column("time_us"))


@pytest.mark.skipif(not course.runtime().on_gpu, reason="needs a GPU")
def test_gpu_launch_experiments_quick():
    costs = launch.launch_costs(repeats=5)
    assert costs.value("torch_launch_us") > costs.value("torch_kernel_exec_us") > 0
    sweep = launch.launch_sweep(max_exp=16, repeats=5)
    assert sweep.rows[-1]["kernel_exec_us"] > 0
    tl = launch.launch_timeline(ops=10)
    assert 0 < tl.value("gpu_busy_fraction") <= 1.0
