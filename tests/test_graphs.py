"""course.lessons.capture_replay and reduce_overhead: capture/replay experiments (GPU) and their helpers and reference data (CPU)."""
from __future__ import annotations

import inspect
import json

import pytest

from course.core import reference
from course.core.compiled import torch_log_messages
from course.core.profiling import launch_counts
from course.core.text import condense
from course.lessons import capture_replay, reduce_overhead, replay_launch
from course.core.results import Result
from course.core.runtime import runtime

ON_GPU = runtime().on_gpu
gpu = pytest.mark.skipif(not ON_GPU, reason="needs a real GPU")
NAMES = ("graphs_kernel_sweep", "graphs_seed_step", "graphs_new_shape", "graphs_frozen",
         "compile_skip_reasons", "compile_new_shapes", "graphs_replay_launch")


def _sweep(eager, replay, ks=(1, 16, 32, 64)):
    rows = [{"kernels": k, "eager_us": eager(k), "replay_us": replay(k), "eager_per_kernel_us": 0.0,
             "replay_per_kernel_us": 0.0, "saving_per_kernel_us": 0.0, "replay_launch_us": 0.0} for k in ks]
    return Result("graphs_kernel_sweep", "t", {c: "us" for c in rows[0]}, rows)


def test_per_kernel_slopes_recover_a_known_line():
    fit = capture_replay.per_kernel_slopes(_sweep(lambda k: 10 + 5.0 * k, lambda k: 8 + 1.5 * k))
    assert fit["eager_us_per_kernel"] == pytest.approx(5.0)
    assert fit["replay_us_per_kernel"] == pytest.approx(1.5)
    assert fit["saving_us_per_kernel"] == pytest.approx(3.5)


def test_per_kernel_slopes_ignore_small_counts():
    # below 16 kernels the fit must not look: a wild value at k=1 changes nothing
    fit = capture_replay.per_kernel_slopes(_sweep(lambda k: 1000.0 if k == 1 else 5.0 * k, lambda k: 1.0 * k))
    assert fit["eager_us_per_kernel"] == pytest.approx(5.0)


def test_fit_slope_of_a_flat_line_is_zero():
    assert capture_replay._fit_slope([1, 2, 3], [4, 4, 4]) == 0.0
    assert capture_replay._fit_slope([2, 2], [1, 5]) == 0.0


@pytest.mark.parametrize("name", NAMES)
def test_experiments_registered_with_valid_quick_params(name):
    exp = reference.get(name)
    assert exp.gpu_only
    assert set(exp.quick) <= set(inspect.signature(exp.fn).parameters)


def test_kernel_chain_launches_n_adds():
    import torch

    buf = torch.zeros(3)
    capture_replay.kernel_chain(buf, 5)()
    assert buf.tolist() == [5.0, 5.0, 5.0]


def test_log_condensing_keeps_the_reason():
    msg = "Recompiling function forward in a.py:3\n  triggered by:\n  - 0/0: tensor 'x' size mismatch at index 0"
    assert reduce_overhead._recompile_reason(msg) == "recompiled: tensor 'x' size mismatch at index 0"
    assert condense("a\n\n b\n c\n d\n e") == "a / b / c / d"


def test_compile_net_rejects_unknown_hazards():
    with pytest.raises(ValueError, match="one of"):
        reduce_overhead.CompileNet.build("nope")


def test_torch_log_messages_collects_and_restores():
    import logging

    with torch_log_messages(perf_hints=True, not_an_artifact=True) as msgs:
        logging.getLogger("torch._inductor").warning("skipping cudagraphs due to a test")
    assert msgs == ["skipping cudagraphs due to a test"]
    before = len(msgs)
    logging.getLogger("torch._inductor").warning("after")
    assert len(msgs) == before


@pytest.mark.skipif(ON_GPU, reason="the CPU path loads reference data")
def test_sim_path_loads_reference_or_explains(tmp_path, monkeypatch):
    monkeypatch.setattr(reference, "REFERENCE_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match="python -m course bench"):
        reference.run("graphs_kernel_sweep")
    res = _sweep(lambda k: 5.0 * k, lambda k: 1.0 * k)
    (tmp_path / "graphs_kernel_sweep.json").write_text(json.dumps(res.to_dict()))
    got = reference.run("graphs_kernel_sweep")
    assert got.source == "reference" and got.column("kernels") == [1, 16, 32, 64]


@pytest.mark.skipif(ON_GPU, reason="the CPU path's behaviour")
def test_experiments_refuse_to_run_without_a_gpu():
    from course.core.runtime import CourseEnvironmentError

    with pytest.raises(CourseEnvironmentError, match="needs a real GPU"):
        capture_replay.kernel_sweep(counts=(1,))


def _quick(name):
    exp = reference.get(name)
    return exp.fn(**exp.quick)


@gpu
def test_kernel_sweep_replay_wins_with_many_kernels():
    res = _quick("graphs_kernel_sweep")
    last = res.rows[-1]
    assert last["replay_us"] < last["eager_us"]
    assert res.value("saving per kernel (fit)") > 0


@gpu
def test_training_step_replays_match_eager_training():
    res = _quick("graphs_seed_step")
    assert res.value("replayed weights match eager training") is True
    assert res.value("speedup per step (CUDA events)") > 1


@gpu
def test_new_shape_costs_a_capture():
    res = _quick("graphs_new_shape")
    assert all(r["capture_ms"] > 0 and r["replay_us"] > 0 for r in res.rows)
    # allocator segments come in 2 MiB steps: sharing must not cost more than one extra segment
    assert res.value("memory reserved, one shared pool") <= res.value("memory reserved, one pool per graph") + 2.0


@gpu
def test_frozen_checks_all_as_expected():
    res = _quick("graphs_frozen")
    bad = [r for r in res.rows if not r["as_expected"]]
    assert not bad, bad


@gpu
def test_training_step_capture_helpers():
    import torch

    x, y, model, opt = capture_replay.training_setup(8, 32, 16)
    g, loss = capture_replay.capture_training_step(model, opt, x, y)
    w0 = model.weight.detach().clone()
    g.replay()
    torch.cuda.synchronize()
    assert not torch.equal(w0, model.weight) and loss.item() > 0


@gpu
def test_compile_experiments_quick():
    skip = _quick("compile_skip_reasons")
    rows = {r["hazard"]: r for r in skip.rows}
    assert rows["none"]["cudagraph_skips"] == 0
    assert rows["mutates_input"]["cudagraph_skips"] >= 1 and "skipping cudagraphs" in rows["mutates_input"]["skip_reason"]
    shapes = _quick("compile_new_shapes")
    firsts = [r for r in shapes.rows if r["new_shape"]]
    assert len(firsts) == 2


@gpu
def test_mlp_and_op_count():
    import torch

    net = capture_replay.mlp(64, 2)
    x = torch.randn(4, 64, device="cuda")
    assert net(x).shape == (4, 64)
    ops = capture_replay.gpu_ops_per_call(lambda: net(x))
    assert ops is None or ops >= 4  # two matmuls (+ bias) and two ReLUs at least


def test_condense_cuts_machine_paths():
    msg = 'skipping cudagraphs due to mutated inputs\n File "/work/main/course/x/graphs.py", line 3, in forward'
    out = condense(msg)
    assert "/work" not in out and '"graphs.py", line 3' in out


def _timing(us):
    from course.core.timing import Timing

    return Timing(us * 1e-6, us * 0.9e-6, us * 1.1e-6, us * 0.8e-6, us * 1.2e-6, 15, 10, "cuda-events")


def test_compile_skip_row_reads_the_measurements_and_the_log():
    from course.core.compiled import reset_compile

    reset_compile()  # torch's counters at zero: the row reads them
    msgs = ["skipping cudagraphs due to mutated inputs (1 instances)\nFound from File \"/w/net.py\", line 3",
            "Graph break in user code at /w/net.py:9", "skipping cudagraphs due to something else"]
    row = reduce_overhead.compile_skip_row("mutates_input", 1.5, {"graph_launches": 0, "kernel_launches": 12},
                                           {"compiled": _timing(300.0), "eager": _timing(100.0)}, msgs)
    assert row["hazard"] == "mutates_input" and row["first_call_s"] == 1.5
    assert row["compiled_us"] == pytest.approx(300.0) and row["eager_q3_us"] == pytest.approx(110.0)
    assert row["skip_reason"].startswith("skipping cudagraphs due to mutated inputs") and "/w/" not in row["skip_reason"]
    assert row["graph_break_reason"].startswith("Graph break") and row["graph_breaks"] == 1  # one logged, none counted
    assert row["cudagraph_skips"] == 0 and row["kernel_launches"] == 12 and row["partitions"] == ""
    assert row["difference_is_noise"] is False and "no CUDA graph" in row["why_slower"]
    same = reduce_overhead.compile_skip_row("none", 0.1, {"graph_launches": 1, "kernel_launches": 0},
                                            {"compiled": _timing(100.0), "eager": _timing(101.0)}, [])
    assert same["difference_is_noise"] is True and same["why_slower"] == "" and same["skip_reason"] == ""


def test_compile_skip_result_keeps_params_and_the_clean_ratio():
    def row(hazard):
        return reduce_overhead.compile_skip_row(hazard, 0.1, {"graph_launches": 1, "kernel_launches": 0},
                                                {"compiled": _timing(50.0), "eager": _timing(150.0)}, [])

    res = reduce_overhead.compile_skip_result([row("item"), row("none")], ("item", "none"), 256, 6, 32, 15)
    assert res.value("clean model: eager / compiled") == pytest.approx(3.0) and res.name == "compile_skip_reasons"
    assert res.params["hazards"] == ["item", "none"] and res.params["repeats"] == 15 and "torch" in res.params
    assert "clean model: eager / compiled" not in reduce_overhead.compile_skip_result([], ("item",), 256, 6, 32, 15).summary


def test_why_slower_reads_the_row():
    row = {"compiled_us": 300.0, "eager_us": 200.0, "graph_launches": 0, "cudagraph_skips": 1, "graph_breaks": 0}
    assert "no CUDA graph" in reduce_overhead.why_slower(row)
    assert "graph break" in reduce_overhead.why_slower({**row, "graph_launches": 2, "graph_breaks": 1})
    assert reduce_overhead.why_slower({**row, "compiled_us": 100.0}) == ""


@gpu
def test_launch_counts_sees_a_graph_launch():
    import torch

    x = torch.zeros(16, device="cuda")
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        x.add_(1)
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        x.add_(1)
    assert launch_counts(g.replay)["graph_launches"] == 1
    eager = launch_counts(lambda: x.add_(1))
    assert eager["graph_launches"] == 0 and eager["kernel_launches"] >= 1


# ----------------------------------------------------------------------------- what a replay's host time depends on
def test_replay_launch_slope_fits_microseconds_per_node():
    rows = [{"nodes": n, "a": 5.0 + 0.5 * n, "b": None} for n in (4, 16, 64)]
    assert replay_launch.slope(rows, "a") == pytest.approx(0.5)
    assert replay_launch.slope(rows, "b") != replay_launch.slope(rows, "b")  # nan: no values to fit


def test_replay_launch_driver_is_found_or_says_why():
    lib, why = replay_launch.driver()
    assert (lib is not None and why == "") or (lib is None and why)


@pytest.mark.skipif(ON_GPU, reason="the CPU path's behaviour")
def test_replay_launch_needs_a_gpu_and_awaits_its_recording_here():
    from course.core.runtime import CourseEnvironmentError

    with pytest.raises(CourseEnvironmentError, match="needs a real GPU"):
        replay_launch.launch_experiment(counts=(4,))
    assert reference.available("graphs_replay_launch") == reference.reference_path("graphs_replay_launch").exists()
    assert reference.available("graphs_kernel_sweep")


@gpu
def test_replay_launch_quick_measures_every_variant():
    import torch

    with pytest.raises(ValueError, match="multiples of"):
        replay_launch.launch_experiment(counts=(6,))
    res = _quick("graphs_replay_launch")
    assert {r["shape"] for r in res.rows} == {"chain", "fork"} and res.value("every replay ran every node") is True
    for r in res.rows:
        assert r["first_us"] > 0 and r["repeat_us"] > 0 and r["repeat_capture_stream_us"] > 0
    if res.params["notes"] == "":  # the driver and torch's raw graph handles were there
        assert all(r["first_after_upload_us"] and r["driver_flags0_repeat_us"] for r in res.rows)
    bufs = [torch.zeros(8, device="cuda") for _ in range(replay_launch.BRANCHES)]
    g = replay_launch.capture("fork", 8, bufs, torch.cuda.Stream(), keep_graph=False)
    for b in bufs:
        b.zero_()
    assert replay_launch.host_us(g.replay) > 0
    torch.cuda.synchronize()
    assert sum(float(b[0]) for b in bufs) == 8
    row = replay_launch.measure("chain", 4, 3, None)
    assert row["replay_correct"] and row["first_after_upload_us"] is None
