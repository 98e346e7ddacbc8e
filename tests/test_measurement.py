import json
import time

import pytest
import torch

import course
from course.core import reference
from course.core.results import Result
from course.core.timing import Timing, time_device, time_enqueue, time_wall


def test_time_wall_measures_sleep():
    t = time_wall(lambda: time.sleep(0.002), warmup=1, repeats=5, inner=2)
    assert 0.0018 < t.median < 0.02
    assert t.min <= t.q1 <= t.median <= t.q3 <= t.max
    assert t.repeats == 5 and t.inner == 2 and t.clock == "host-synchronized"
    assert abs(t.us - t.median * 1e6) < 1e-6 and "us per call" in str(t)


def test_time_enqueue_and_device_return_positive_times():
    x = torch.zeros(4, device=course.device())
    for fn in (time_enqueue, time_device):
        t = fn(lambda: x.add_(1), warmup=2, repeats=4, inner=3)
        assert isinstance(t, Timing) and t.median > 0


def test_timing_rejects_nonsense():
    with pytest.raises(ValueError, match="repeats"):
        time_wall(lambda: None, repeats=0)


def _result():
    r = Result("demo", "Demo", {"n": "", "t": "us"}, [{"n": 1, "t": 2.5}, {"n": 2, "t": 3.5}], params={"k": 1})
    r.add_summary("best", 2.5, "us")
    return r


def test_result_rows_units_and_caption():
    r = _result()
    assert r.column("t") == [2.5, 3.5] and r.column("t", n=2) == [3.5]
    assert r.value("best") == 2.5 and r.live
    assert r.caption().startswith("measured here on")
    assert "t [us]" in r.table() and "best: 2.5 us" in r.table()
    with pytest.raises(KeyError, match="has no column"):
        r.column("nope")
    with pytest.raises(ValueError, match="lacks columns"):
        Result("bad", "Bad", {"a": "", "b": ""}, [{"a": 1}])


def test_result_round_trip_and_edit_detection():
    d = json.loads(json.dumps(_result().to_dict()))
    back = Result.from_dict(d)
    assert back.rows == _result().rows and back.source == "reference"
    assert back.caption().startswith("recorded on")
    d["rows"][0]["t"] = 1.0
    with pytest.raises(ValueError, match="edited by hand"):
        Result.from_dict(d)


def test_provenance_has_versions_and_date():
    p = _result().provenance
    for k in ("path", "device", "torch", "numba_cuda", "numpy", "date", "python"):
        assert p.get(k), k


# GPU experiments whose reference data has not been recorded yet (their notebooks say "reference data not recorded
# yet" until `python -m course bench NAME` runs on a GPU). Once the JSON is committed it is checked like any other;
# then drop the name from here.
AWAITING_FIRST_RECORDING: set = set()


def test_reference_registry_and_files_are_valid():
    reg = reference.load_all()
    assert {"launch_costs", "launch_sweep", "launch_timeline", "cpu_dispatch"} <= set(reg)
    for name, exp in reg.items():
        if exp.gpu_only:
            if exp.gpus > 1 and not reference.reference_path(name).exists():
                continue  # multi-GPU data exists only once `course bench` ran on a machine with that many GPUs
            if name in AWAITING_FIRST_RECORDING and not reference.reference_path(name).exists():
                continue
            res = reference.load_reference(name)  # verifies the checksum
            assert res.provenance.get("gpus", 1) >= exp.gpus, f"{name}: recorded on fewer GPUs than it needs"
            assert res.provenance["path"] == "cuda", f"{name}: reference data must come from a GPU"
            assert res.provenance["driver"], f"{name}: reference data must name the driver"
            assert res.params.get("quick") is False, f"{name}: reference data must be a full (not --quick) bench run"
            assert res.rows


def test_reference_run_is_live_for_cpu_experiments():
    res = reference.run("cpu_dispatch", max_exp=6, repeats=3)
    assert res.live and res.rows and res.value("dispatch_floor_us") > 0


def test_missing_reference_says_how_to_make_it(tmp_path, monkeypatch):
    monkeypatch.setattr(reference, "REFERENCE_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match="python -m course bench"):
        reference.load_reference("launch_sweep")


def test_unknown_experiment():
    with pytest.raises(KeyError, match="no experiment called"):
        reference.get("no_such_experiment")


@pytest.mark.skipif(course.runtime().on_gpu, reason="checks the refusal on the simulator path")
def test_bench_refuses_on_simulator(tmp_path):
    with pytest.raises(RuntimeError, match="needs a real GPU"):
        reference.bench(["launch_sweep"], out_dir=tmp_path)
    assert not list(tmp_path.iterdir())


@pytest.mark.skipif(not course.runtime().on_gpu, reason="needs a GPU")
def test_bench_quick_writes_valid_reference(tmp_path):
    paths = reference.bench(["launch_costs"], out_dir=tmp_path, quick=True, log=lambda *_: None)
    res = Result.from_dict(json.loads(paths[0].read_text()))
    assert res.params["quick"] is True and res.provenance["path"] == "cuda"


@pytest.mark.skipif(course.runtime().on_gpu, reason="simulator behaviour")
def test_time_graph_replay_needs_a_gpu():
    from course.core.runtime import CourseEnvironmentError
    from course.core.timing import time_graph_replay
    with pytest.raises(CourseEnvironmentError, match="needs a real GPU"):
        time_graph_replay(lambda: None, calls=2)


@pytest.mark.skipif(not course.runtime().on_gpu, reason="needs a GPU")
def test_time_graph_replay_is_per_replay():
    from course.core.timing import graph_time, time_graph_replay
    x = torch.zeros(1 << 20, device="cuda")
    per_replay = time_graph_replay(lambda: x.add_(1), calls=8, repeats=3)
    per_call = graph_time(lambda: x.add_(1), calls=8, repeats=3)
    assert per_replay.clock == "cuda-events" and per_call.clock == "cuda-graph-replay"
    assert per_replay.median > per_call.median > 0


def test_time_interleaved_rotates_and_times_every_variant():
    from course.core.timing import time_interleaved

    order = []
    res = time_interleaved({"a": lambda: order.append("a"), "b": lambda: order.append("b")},
                           clock="wall", warmup=0, repeats=4, inner=1)
    assert set(res) == {"a", "b"} and all(t.repeats == 4 for t in res.values())
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a"], order  # rotated: neither always runs last


def test_time_interleaved_rejects_bad_input():
    from course.core.timing import time_interleaved

    with pytest.raises(ValueError, match="clock"):
        time_interleaved({"a": lambda: None}, clock="sundial")
    with pytest.raises(ValueError, match="at least one"):
        time_interleaved({})


def test_time_interleaved_sees_a_real_difference():
    import time as _t

    from course.core.timing import speedup, time_interleaved

    res = time_interleaved({"slow": lambda: _t.sleep(0.002), "fast": lambda: None}, clock="wall",
                           warmup=1, repeats=6, inner=1)
    s = speedup("slow", res["slow"], "fast", res["fast"])
    from course.core.timing import Speedup
    assert isinstance(s, Speedup) and not s.noise and s.ratio > 10
    text = str(s)
    assert "slow" in text and "fast" in text and "IQR" in text and "x" in text


def test_speedup_calls_overlapping_spreads_noise():
    from course.core.timing import Timing, speedup

    a = Timing(10e-6, 9e-6, 11e-6, 8e-6, 12e-6, 5, 1, "cuda-events")
    b = Timing(9.5e-6, 9e-6, 10e-6, 8e-6, 12e-6, 5, 1, "cuda-events")
    s = speedup("eager", a, "replay", b)
    assert s.noise and "noise" in str(s) and "eager 10.00 us (IQR 9.00-11.00)" in str(s)
    c = Timing(1e-6, 0.9e-6, 1.1e-6, 0.8e-6, 1.2e-6, 5, 1, "cuda-events")
    assert not speedup("eager", a, "replay", c).noise


def test_peak_dram_bandwidth_from_clock_and_bus():
    from course.core.hardware import peak_dram_gbps

    # H100 SXM (HBM3): 2619 MHz memory clock, 5120-bit bus -> about 3.35 TB/s
    assert abs(peak_dram_gbps(2_619_000, 5120) - 3352.3) < 1.0
    with pytest.raises(ValueError):
        peak_dram_gbps(0, 5120)


def test_memory_facts_on_this_path():
    from course.core.hardware import memory_facts

    if not course.runtime().on_gpu:
        with pytest.raises(RuntimeError, match="simulator"):
            memory_facts()
        return
    facts = memory_facts()
    assert facts["l2_bytes"] and facts["l2_bytes"] > 1 << 20
    assert facts["peak_dram_GBps"] and 100 < facts["peak_dram_GBps"] < 20000


def test_bench_names_follow_the_gpu_count():
    """One GPU: the single-GPU experiments; two or more: only the multi-GPU ones that fit."""
    reg = reference.load_all()
    one, two, eight = (reference.bench_names(reg, n) for n in (1, 2, 8))
    assert one and all(reg[n].gpus == 1 and reg[n].gpu_only for n in one)
    assert "sharding_capture" in two and not set(one) & set(two)
    assert set(two) <= set(eight) and all(reg[n].gpus >= 2 for n in eight)
    assert reference.bench_names(reg, 0) == one
    with pytest.raises(ValueError, match="gpu_only"):
        reference.experiment("bad_multi_gpu", gpu_only=False, gpus=2)


def test_provenance_names_the_gpu_count():
    from course.core.provenance import provenance
    from course.core.runtime import gpu_count
    assert provenance(gpus=2)["device"].startswith("2x ") and provenance(gpus=2)["gpus"] == 2
    assert provenance()["gpus"] == (1 if course.runtime().on_gpu else 0)
    assert gpu_count() == (0 if not course.runtime().on_gpu else torch.cuda.device_count())


def test_run_loads_reference_when_the_machine_has_too_few_gpus(monkeypatch, tmp_path):
    """A 1-GPU machine (the H100 lane) must not try a 2-GPU experiment live: it reads the reference data."""
    import types
    monkeypatch.setattr(reference, "runtime", lambda: types.SimpleNamespace(on_gpu=True))
    monkeypatch.setattr(reference, "gpu_count", lambda: 1)
    monkeypatch.setattr(reference, "REFERENCE_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match="No reference data for 'sharding_capture'"):
        reference.run("sharding_capture")
    with pytest.raises(RuntimeError, match=r"need 2 GPUs; this machine has 1"):
        reference.bench(["sharding_capture"], out_dir=tmp_path)
    assert not list(tmp_path.iterdir())


def test_one_sample_times_one_repeat():
    import time as _t

    from course.core.timing import one_sample

    calls = []
    took = one_sample(lambda: (calls.append(1), _t.sleep(0.001)), 3, "wall")
    assert len(calls) == 3 and took >= 0.003


def test_too_few_gpus_caption_says_so(monkeypatch):
    """On the 1-GPU H100 lesson 05 said 'this machine has no usable GPU': the caption names the GPU count instead."""
    import types
    monkeypatch.setattr(reference, "runtime", lambda: types.SimpleNamespace(on_gpu=True))
    monkeypatch.setattr(reference, "gpu_count", lambda: 1)
    cap = reference.run("sharding_capture").caption()
    assert "this machine has 1 GPU(s) and the experiment needs 2" in cap and "no usable GPU" not in cap


def test_eager_versus_reads_a_rows_medians_and_spreads():
    from course.core.timing import eager_versus

    row = {"eager_us": 900.0, "eager_q1_us": 850.0, "eager_q3_us": 950.0, "replay_us": 20.0, "replay_q1_us": 19.0,
           "replay_q3_us": 21.0, "speedup": 45.0}
    assert eager_versus(row, "replay") == ("eager 900.0 us (IQR 850.0-950.0) -> replay 20.0 us (IQR 19.0-21.0): "
                                           "45.0x faster")
    graph = {"eager_us": 9000.0, "eager_q1_us": 8000.0, "eager_q3_us": 9900.0, "graph_us": 8500.0,
             "graph_q1_us": 7000.0, "graph_q3_us": 8000.0, "speedup": 1.06}
    assert eager_versus(graph, "graph", ",.0f").endswith("graph 8,500 us (IQR 7,000-8,000): inside the spread, noise")
