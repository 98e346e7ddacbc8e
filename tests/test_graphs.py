"""Lesson 02 (course.lessons.capture_replay): capture/replay experiments (GPU), their helpers and reference data (CPU)."""
from __future__ import annotations

import inspect
import json
import logging

import pytest
import torch

from course.core import cells, reference
from course.core.compiled import reset_compile, torch_log_messages
from course.core.profiling import launch_counts
from course.core.results import Result
from course.core.runtime import CourseEnvironmentError, runtime
from course.core.text import condense
from course.core.timing import Timing
from course.lessons.capture_replay import bench, compiled, driver, replay
from course.tools import catalog

ON_GPU = runtime().on_gpu
gpu = pytest.mark.skipif(not ON_GPU, reason="needs a real GPU")
NAMES = ("graphs_kernel_sweep", "graphs_seed_step", "graphs_new_shape", "graphs_frozen",
         "compile_skip_reasons", "compile_new_shapes", "graphs_replay_launch")


def _sweep(eager, replay, ks=(1, 16, 32, 64)):
    rows = [{"kernels": k, "eager_us": eager(k), "replay_us": replay(k), "eager_per_kernel_us": 0.0,
             "replay_per_kernel_us": 0.0, "saving_per_kernel_us": 0.0, "replay_launch_us": 0.0} for k in ks]
    return Result("graphs_kernel_sweep", "t", {c: "us" for c in rows[0]}, rows)


def test_per_kernel_slopes_recover_a_known_line():
    fit = bench.per_kernel_slopes(_sweep(lambda k: 10 + 5.0 * k, lambda k: 8 + 1.5 * k))
    assert fit["eager_us_per_kernel"] == pytest.approx(5.0)
    assert fit["replay_us_per_kernel"] == pytest.approx(1.5)
    assert fit["saving_us_per_kernel"] == pytest.approx(3.5)


def test_per_kernel_slopes_ignore_small_counts():
    # below 16 kernels the fit must not look: a wild value at k=1 changes nothing
    fit = bench.per_kernel_slopes(_sweep(lambda k: 1000.0 if k == 1 else 5.0 * k, lambda k: 1.0 * k))
    assert fit["eager_us_per_kernel"] == pytest.approx(5.0)


def test_fit_slope_of_a_flat_line_is_zero():
    assert bench._fit_slope([1, 2, 3], [4, 4, 4]) == 0.0
    assert bench._fit_slope([2, 2], [1, 5]) == 0.0


@pytest.mark.parametrize("name", NAMES)
def test_experiments_registered_with_valid_quick_params(name):
    exp = reference.get(name)
    assert exp.gpu_only
    assert set(exp.quick) <= set(inspect.signature(exp.fn).parameters)


def test_kernel_chain_launches_n_adds():
    buf = torch.zeros(3)
    replay.kernel_chain(buf, 5)()
    assert buf.tolist() == [5.0, 5.0, 5.0]


def test_log_condensing_keeps_the_reason():
    msg = "Recompiling function forward in a.py:3\n  triggered by:\n  - 0/0: tensor 'x' size mismatch at index 0"
    assert compiled._recompile_reason(msg) == "recompiled: tensor 'x' size mismatch at index 0"
    assert condense("a\n\n b\n c\n d\n e") == "a / b / c / d"


def test_compile_net_rejects_unknown_hazards():
    with pytest.raises(ValueError, match="one of"):
        compiled.CompileNet.build("nope")


def test_torch_log_messages_collects_and_restores():
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
    with pytest.raises(CourseEnvironmentError, match="needs a real GPU"):
        reference.get("graphs_kernel_sweep").fn(counts=(1,))


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
    x, y, model, opt = replay.training_setup(8, 32, 16)
    g, loss = replay.capture_training_step(model, opt, x, y)
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
    net = replay.mlp(64, 2)
    x = torch.randn(4, 64, device="cuda")
    assert net(x).shape == (4, 64)
    ops = bench.gpu_ops_per_call(lambda: net(x))
    assert ops is None or ops >= 4  # two matmuls (+ bias) and two ReLUs at least


def test_condense_cuts_machine_paths():
    msg = 'skipping cudagraphs due to mutated inputs\n File "/work/main/course/x/graphs.py", line 3, in forward'
    out = condense(msg)
    assert "/work" not in out and '"graphs.py", line 3' in out


def _timing(us):
    return Timing(us * 1e-6, us * 0.9e-6, us * 1.1e-6, us * 0.8e-6, us * 1.2e-6, 15, 10, "cuda-events")


def test_compile_skip_row_reads_the_measurements_and_the_log():
    reset_compile()  # torch's counters at zero: the row reads them
    msgs = ["skipping cudagraphs due to mutated inputs (1 instances)\nFound from File \"/w/net.py\", line 3",
            "Graph break in user code at /w/net.py:9", "skipping cudagraphs due to something else"]
    row = compiled.compile_skip_row("mutates_input", 1.5, {"graph_launches": 0, "kernel_launches": 12},
                                           {"compiled": _timing(300.0), "eager": _timing(100.0)}, msgs)
    assert row["hazard"] == "mutates_input" and row["first_call_s"] == 1.5
    assert row["compiled_us"] == pytest.approx(300.0) and row["eager_q3_us"] == pytest.approx(110.0)
    assert row["skip_reason"].startswith("skipping cudagraphs due to mutated inputs") and "/w/" not in row["skip_reason"]
    assert row["graph_break_reason"].startswith("Graph break") and row["graph_breaks"] == 1  # one logged, none counted
    assert row["cudagraph_skips"] == 0 and row["kernel_launches"] == 12 and row["partitions"] == ""
    assert row["difference_is_noise"] is False and "no CUDA graph" in row["why_slower"]
    same = compiled.compile_skip_row("none", 0.1, {"graph_launches": 1, "kernel_launches": 0},
                                            {"compiled": _timing(100.0), "eager": _timing(101.0)}, [])
    assert same["difference_is_noise"] is True and same["why_slower"] == "" and same["skip_reason"] == ""


def test_compile_skip_result_keeps_params_and_the_clean_ratio():
    def row(hazard):
        return compiled.compile_skip_row(hazard, 0.1, {"graph_launches": 1, "kernel_launches": 0},
                                                {"compiled": _timing(50.0), "eager": _timing(150.0)}, [])

    res = compiled.compile_skip_result([row("item"), row("none")], ("item", "none"), 256, 6, 32, 15)
    assert res.value("clean model: eager / compiled") == pytest.approx(3.0) and res.name == "compile_skip_reasons"
    assert res.params["hazards"] == ["item", "none"] and res.params["repeats"] == 15 and "torch" in res.params
    assert "clean model: eager / compiled" not in compiled.compile_skip_result([], ("item",), 256, 6, 32, 15).summary


def test_why_slower_reads_the_row():
    row = {"compiled_us": 300.0, "eager_us": 200.0, "graph_launches": 0, "cudagraph_skips": 1, "graph_breaks": 0}
    assert "no CUDA graph" in compiled.why_slower(row)
    assert "graph break" in compiled.why_slower({**row, "graph_launches": 2, "graph_breaks": 1})
    assert compiled.why_slower({**row, "compiled_us": 100.0}) == ""


@gpu
def test_launch_counts_sees_a_graph_launch():
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
    assert driver.slope(rows, "a") == pytest.approx(0.5)
    assert driver.slope(rows, "b") != driver.slope(rows, "b")  # nan: no values to fit


def test_replay_launch_driver_is_found_or_says_why():
    lib, why = driver.driver()
    assert (lib is not None and why == "") or (lib is None and why)


@pytest.mark.skipif(ON_GPU, reason="the CPU path's behaviour")
def test_replay_launch_needs_a_gpu_and_awaits_its_recording_here():
    with pytest.raises(CourseEnvironmentError, match="needs a real GPU"):
        reference.get("graphs_replay_launch").fn(counts=(4,))
    assert reference.available("graphs_replay_launch") == reference.reference_path("graphs_replay_launch").exists()
    assert reference.available("graphs_kernel_sweep")


@gpu
def test_replay_launch_quick_measures_every_variant():
    with pytest.raises(ValueError, match="multiples of"):
        reference.get("graphs_replay_launch").fn(counts=(6,))
    res = _quick("graphs_replay_launch")
    assert {r["shape"] for r in res.rows} == {"chain", "fork"} and res.value("every replay ran every node") is True
    for r in res.rows:
        assert r["first_us"] > 0 and r["repeat_us"] > 0 and r["repeat_capture_stream_us"] > 0
    if res.params["notes"] == "":  # the driver and torch's raw graph handles were there
        assert all(r["first_after_upload_us"] and r["driver_flags0_repeat_us"] for r in res.rows)
    bufs = [torch.zeros(8, device="cuda") for _ in range(driver.BRANCHES)]
    g = driver.capture("fork", 8, bufs, torch.cuda.Stream(), keep_graph=False)
    for b in bufs:
        b.zero_()
    assert driver.host_us(g.replay) > 0
    torch.cuda.synchronize()
    assert sum(float(b[0]) for b in bufs) == 8
    lib, notes = driver.launch_driver((4,))
    if lib is not None:
        cap = torch.cuda.Stream()
        g = driver.capture("chain", 4, bufs, cap, keep_graph=True)
        cols = driver.driver_launches(lib, g, "chain", 4, bufs, cap, 3)
        assert set(cols) == {"first_after_upload_us", "driver_flags0_first_us", "driver_flags0_repeat_us"}
        assert all(v > 0 for v in cols.values()) and driver.ctypes_call_us(lib, 3) > 0


# ----------------------------------------------------------------------------- the cells' bookkeeping, on recordings
# Each experiment's code stands in lesson 02's cell; the module turns its measurements into the table. Fed the
# recorded medians and quartiles back, the bookkeeping must give the recording's own rows and summary.
def _t(us, q1=None, q3=None):
    q1, q3 = (us if q1 is None else q1), (us if q3 is None else q3)
    return Timing(us * 1e-6, q1 * 1e-6, q3 * 1e-6, q1 * 1e-6, q3 * 1e-6, 15, 10, "cuda-events")


def _same(got, want, title=True):
    assert set(got.summary) == set(want.summary), (list(got.summary), list(want.summary))
    for k, s in want.summary.items():
        assert got.summary[k]["value"] == pytest.approx(s["value"]), k
    assert len(got.rows) == len(want.rows)
    for g, w in zip(got.rows, want.rows):
        assert set(g) == set(w)
        for k, v in w.items():
            assert g[k] == (pytest.approx(v) if isinstance(v, float) else v), (k, g[k], v)
    assert list(got.columns) == list(want.columns) and got.name == want.name and (got.title == want.title or not title)


def test_experiment_cells_of_lesson_02_load_and_refuse_without_a_gpu_by_name():
    names = ("graphs_kernel_sweep", "graphs_seed_step", "graphs_new_shape", "graphs_frozen", "graphs_replay_launch",
             "compile_new_shapes", "graphs_make_graphed_callables", "graphs_two_streams", "graphs_capture_modes")
    nb = [p for p in catalog.experiment_notebooks() if p.name == "02_capture_and_replay.ipynb"]
    assert nb, "lesson 02's answer version must be listed with experiment_cells"
    for name in names:
        exp = reference.get(name)
        assert exp.fn.__module__ == cells.module_name(nb[0]), f"{name} is not defined in lesson 02's cells"
        if not ON_GPU:
            with pytest.raises(CourseEnvironmentError, match="needs a real GPU"):
                exp.fn(**exp.quick)


def test_sweep_result_gives_the_recording_back():
    want = reference.load_reference("graphs_kernel_sweep")
    rows = [{"kernels": r["kernels"], "eager": _t(r["eager_us"]), "replay": _t(r["replay_us"]),
             "launch": _t(r["replay_launch_us"])} for r in want.rows]
    _same(bench.sweep_result(rows, want.params["counts"], 1024, 15), want)


def test_training_result_gives_the_recording_back():
    want = reference.load_reference("graphs_seed_step")
    eager, replay = want.rows
    iters = want.params["iters"]
    times = {"eager": _t(eager["per_step_us"]), "replay": _t(replay["per_step_us"]),
             "eager_loop": _t(eager["loop_ms"] * 1e3 / iters), "replay_loop": _t(replay["loop_ms"] * 1e3 / iters)}
    got = bench.training_result(times, True, want.value("GPU operations per step"), 64, 1024, 1024, iters, 7)
    _same(got, want, title=False)  # recorded before its title was reworded
    unchecked = bench.training_result(times, False, None, 64, 1024, 1024, iters, 7)
    assert unchecked.value("replayed weights match eager training") is False
    assert "GPU operations per step" not in unchecked.summary


def test_new_shape_rows_and_result_give_the_recording_back():
    want = reference.load_reference("graphs_new_shape")
    rows = []
    for r in want.rows:
        cap = {k: r[k] for k in ("batch", "warmup_ms", "capture_ms", "pool_reserved_mib", "pool_allocated_mib")}
        cap["graph"] = object()  # a row keeps numbers only, never the graph
        times = {"eager": _t(r["eager_us"], r["eager_q1_us"], r["eager_q3_us"]),
                 "replay": _t(r["replay_us"], r["replay_q1_us"], r["replay_q3_us"])}
        rows.append(bench.new_shape_row(cap, times))
    shared = {"reserved": want.value("memory reserved, one shared pool"),
              "allocated": want.value("memory allocated, one shared pool")}
    _same(bench.new_shape_result(rows, shared, [1, 8, 64, 512], 1024, 4, 15), want)
    assert bench.pool_totals([{"pool_reserved_mib": 2.0, "pool_allocated_mib": 0.5, "graph": None}] * 3) == \
        {"reserved": 6.0, "allocated": 1.5}


def test_new_shape_row_claims_no_break_even_inside_the_noise_or_without_a_saving():
    cap = {"batch": 8, "warmup_ms": 1.0, "capture_ms": 1.0, "pool_reserved_mib": 2.0, "pool_allocated_mib": 1.0}
    clear = bench.new_shape_row(cap, {"eager": _t(30.0, 29.0, 31.0), "replay": _t(10.0, 9.0, 11.0)})
    assert clear["break_even_replays"] == pytest.approx(2000 / 20.0) and clear["saving_is_noise"] is False
    noisy = bench.new_shape_row(cap, {"eager": _t(11.0, 5.0, 20.0), "replay": _t(10.0, 5.0, 20.0)})
    assert noisy["saving_is_noise"] is True and noisy["break_even_replays"] is None
    slower = bench.new_shape_row(cap, {"eager": _t(10.0, 9.9, 10.1), "replay": _t(30.0, 29.9, 30.1)})
    assert slower["break_even_replays"] is None


def _frozen_seen(want):
    err = want.rows[2]["what_happened"].removeprefix("RuntimeError: ")
    calls = int(want.rows[6]["what_happened"].split()[2])
    return {"copy": True, "rebind": True, "shape": RuntimeError(err + "\nmore lines"), "held": True, "branch": True,
            "float": True, "counter": (calls, calls), "rand": True}


def test_frozen_result_gives_the_recording_back():
    want = reference.load_reference("graphs_frozen")
    _same(bench.frozen_result(_frozen_seen(want)), want)


@pytest.mark.parametrize("key", [k for k, *_ in bench.FROZEN_CHECKS])
def test_frozen_result_names_each_check_that_went_otherwise(key):
    want = reference.load_reference("graphs_frozen")
    seen = _frozen_seen(want)
    seen[key] = {"shape": None, "counter": (4, 14)}.get(key, False)
    got = bench.frozen_result(seen)
    bad = [r for r in got.rows if not r["as_expected"]]
    assert len(bad) == 1 and got.value("checks as expected") == 7
    i = [k for k, *_ in bench.FROZEN_CHECKS].index(key)
    assert bad[0]["check"] == want.rows[i]["check"] and bad[0]["what_happened"] != want.rows[i]["what_happened"]
    if key == "shape":  # the copy went through: the lesson says only what was expected
        assert bad[0]["what_happened"] == "no error" and bad[0]["lesson"] == "shapes are fixed"
    del seen[key]
    with pytest.raises(KeyError, match=key):
        bench.frozen_result(seen)


def test_launch_rows_and_result_give_the_recording_back():
    want = reference.load_reference("graphs_replay_launch")
    rows = []
    for r in want.rows:
        row = driver.launch_row(r["shape"], r["nodes"], r["replay_correct"], r["first_us"],
                                       _t(r["repeat_us"], r["repeat_q1_us"], r["repeat_q3_us"]),
                                       _t(r["repeat_capture_stream_us"]))
        assert row["first_after_upload_us"] is None and row["driver_flags0_repeat_us"] is None
        row.update({k: r[k] for k in ("first_after_upload_us", "driver_flags0_first_us", "driver_flags0_repeat_us")})
        rows.append(row)
    got = driver.launch_result(rows, want.params["counts"], want.params["repeats"], want.params["notes"],
                                      want.value("ctypes call"))
    _same(got, want)
    without = driver.launch_result(rows, want.params["counts"], 25, "no driver", None)
    assert "ctypes call" not in without.summary and not any("driver" in k for k in without.summary)
    assert driver.ctypes_call_us(None, 5) is None


def test_launch_driver_refuses_counts_the_fork_cannot_split():
    with pytest.raises(ValueError, match="multiples of 4"):
        driver.launch_driver((4, 6))
    lib, notes = driver.launch_driver((4, 8))
    assert (lib is None) == bool(notes)


def test_shape_call_row_reads_counters_and_logs():
    before, after = {"unique_graphs": 1}, {"unique_graphs": 2}
    msgs = ["Recompiling function forward in a.py:3\n  triggered by:\n  - 0/0: tensor 'x' size mismatch at index 0",
            "Recording function 0 of graph recording id 1", "unrelated"]
    row = compiled.shape_call_row(4, 16, True, 0.25, before, after, msgs)
    assert row == {"call": 4, "batch": 16, "new_shape": True, "call_ms": 250.0, "graphs_compiled": 1,
                   "graphs_recorded": 1,
                   "log": "recompiled: tensor 'x' size mismatch at index 0 | recorded 1 CUDA graph(s)"}
    assert compiled.shape_call_row(0, 8, True, 1.0, {"unique_graphs": 0}, after, [])["log"] == "compiled"
    assert compiled.shape_call_row(1, 8, False, 1e-3, after, after, [])["log"] == ""


def test_new_shapes_result_gives_the_recording_back():
    want = reference.load_reference("compile_new_shapes")
    got = compiled.new_shapes_result(want.rows, want.params["batches"], want.params["calls_per_shape"], 256)
    assert got.params["torch"]  # the version that ran, whatever it is
    _same(got, want)
