"""The graph cache memory probe and its ledger (the GPU run is by hand), and what the backends release per stream."""
import pytest
import torch

from course.core import hardware
from course.core.runtime import CourseEnvironmentError, graphs, runtime
from course.lessons.graph_cache import GraphCache, memory_ledger as ml, memory_probe as mp
from course.lessons.graph_cache.backends import CudaGraphBackend, RecordingBackend
from course.lessons.graph_cache.cache_checks import what_stays
from course.lessons.graph_cache.counting import CountingBackend

ON_GPU = runtime().on_gpu
MiB = 2**20


def test_ledger_notes_each_step_and_what_it_freed():
    readings = iter([(100 * MiB, 60 * MiB), (120 * MiB, 70 * MiB), (80 * MiB, 40 * MiB)])
    led = ml.Ledger("answer", "kept", lambda: next(readings))
    led.step("start")
    led.step("calls", "three misses")
    last = led.step("clear_cache()")
    assert [r["freed_MiB"] for r in led.rows] == [0.0, -20.0, 40.0]
    assert last == {"cache": "answer", "workspaces": "kept", "inputs": "kept", "step": "clear_cache()",
                    "what": "", "reserved_MiB": 80.0, "allocated_MiB": 40.0, "freed_MiB": 40.0}
    table = ml.format_rows(led.rows)
    assert table.splitlines()[0].split()[:4] == ["cache", "workspaces", "inputs", "step"] and "three misses" in table
    assert len(table.splitlines()) == 2 + 3
    releases = mp.release_table(led.rows)
    assert releases == [{"cache": "answer", "workspaces": "kept", "inputs": "kept", "release": "clear_cache()",
                         "freed_MiB": 40.0}]


def test_release_table_keeps_the_clear_and_every_release_in_order():
    rows = [{"cache": "GraphCache", "workspaces": "released", "step": s, "freed_MiB": float(i)}
            for i, s in enumerate(["start", "clear_cache()", "gc + synchronize + empty_cache"]
                                  + [name for name, _ in mp.RELEASES])]
    got = [r["release"] for r in mp.release_table(rows)]
    assert got == ["clear_cache()", "gc + synchronize + empty_cache"] + [name for name, _ in mp.RELEASES]
    assert "drop cuBLAS workspaces" in got and "drop the pool handle" in got


def test_snapshot_summary_names_known_tensors_workspaces_and_the_rest():
    snap = [{"stream": 0, "segment_pool_id": (0, 0), "total_size": 20 * MiB, "allocated_size": 16 * MiB,
             "blocks": [{"address": 1000, "size": 16 * MiB, "state": "active_allocated", "frames": []},
                        {"address": 2000, "size": 4 * MiB, "state": "inactive"}]},
            {"stream": 77, "segment_pool_id": (0, 3), "total_size": 32 * MiB, "allocated_size": 32 * MiB,
             "blocks": [{"address": 5000, "size": 32 * MiB, "state": "active_allocated",
                         "frames": [{"name": "c10::cuda::CUDACachingAllocator::malloc", "filename": "a.cpp"},
                                    {"name": "at::cuda::getCurrentCUDABlasHandle", "filename": "CublasHandlePool.cpp",
                                     "line": 9}]}]},
            {"stream": 5, "segment_pool_id": (0, 0), "total_size": 2 * MiB, "allocated_size": 2 * MiB,
             "blocks": [{"address": 7000, "size": 2 * MiB, "state": "active_allocated",
                         "frames": [{"name": "<lambda>", "filename": "memory_probe.py", "line": 3}]}]}]
    segs = ml.snapshot_summary(snap, {1000: "weight"}, {0: "default", 77: "capture"})
    assert [s["stream"] for s in segs] == ["default", "capture", "stream 5"]
    assert [s["private_pool"] for s in segs] == [False, True, False]
    assert [s["total_MiB"] for s in segs] == [20.0, 32.0, 2.0]
    assert [[b["name"] for b in s["live_blocks"]] for s in segs] == [
        ["weight"], ["cuBLAS workspace"], ["made in the forward (no tensor)"]]
    assert segs[1]["live_blocks"][0]["frames"] == ["at::cuda::getCurrentCUDABlasHandle (CublasHandlePool.cpp:9)"]


def test_the_answer_cache_is_lab3s_own_class_without_its_checks():
    cls = mp.answer_cache_class()
    assert cls.__name__ == "MyGraphCache" and callable(cls.clear_cache)
    if not ON_GPU:  # it runs here too, on the simulator's graphs
        w = torch.randn(4, 4)
        cache = cls(lambda t: torch.relu(t @ w) @ w, buckets=[2, 4])
        x = torch.randn(3, 4)
        assert torch.allclose(cache(x), torch.relu(x @ w) @ w, atol=1e-5) and cache.stats["recordings"] == 1


@pytest.mark.skipif(ON_GPU, reason="the refusal is the simulator path's")
def test_the_probe_refuses_on_the_simulator_path(tmp_path, capsys):
    with pytest.raises(CourseEnvironmentError, match="needs a real GPU"):
        mp.run_one()
    with pytest.raises(CourseEnvironmentError, match="caching allocator"):
        mp.probe()
    assert mp.main(["--json", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert "memory_probe:" in err and "simulator" in err and not (tmp_path / "p.json").exists()


@pytest.mark.skipif(ON_GPU, reason="without CUDA")
def test_release_blas_workspaces_without_cuda_releases_nothing():
    assert hardware.release_blas_workspaces() is False


def test_the_gpu_backend_drops_the_workspaces_before_a_capture_and_at_reset(monkeypatch):
    calls = []
    monkeypatch.setattr(hardware, "release_blas_workspaces", lambda: calls.append(1) or True)
    backend = CudaGraphBackend("separate")
    assert backend.new_pool() is None and len(calls) == 1
    backend._pool = ("a", "pool")
    backend.reset_pool()
    assert backend._pool is None and len(calls) == 2


@pytest.mark.skipif(ON_GPU, reason="the simulator's accounting")
def test_pool_bytes_counts_a_static_output_still_referenced():
    cg = graphs()
    backend = CountingBackend(RecordingBackend())
    fwd = backend.watch(lambda t: t * 2)
    with backend.counting():
        static = torch.ones(4, 8)
        g = cg.CUDAGraph()
        with cg.graph(g, pool=backend.pool()):
            out = fwd(static)
        assert backend.pool_bytes() == 2 * 4 * 8 * 4  # the static input (the graph alive) and the output
        del g
        assert backend.pool_bytes() == 4 * 8 * 4, "the output, still referenced, keeps its bytes"
        del out
        assert backend.pool_bytes() == 0


def _seg(stream, pool, mib, blocks=()):
    return {"stream": stream, "segment_pool_id": pool, "total_size": mib * MiB, "allocated_size": 0,
            "blocks": list(blocks)}


def test_by_stream_pool_sums_segments_per_stream_and_pool_largest_first():
    snap = [_seg(0, (0, 0), 20), _seg(9, (1, 2), 2), _seg(9, (1, 2), 32), _seg(0, (0, 0), 2), _seg(5, None, 32)]
    got = ml.by_stream_pool(snap, {0: "default", 9: "capture"})
    assert got == {"capture/pool (1, 2)": 34 * MiB, "stream 5/ordinary": 32 * MiB, "default/ordinary": 22 * MiB}
    assert ml.pool_kind((0, 0)) == ml.pool_kind(None) == "ordinary" and ml.pool_kind([3, 4]) == "pool (3, 4)"


def test_a_ledger_with_a_split_notes_where_each_rows_memory_lies():
    led = ml.Ledger("answer", "released", lambda: (52 * MiB, 40 * MiB), split=lambda: {"default/ordinary": 52 * MiB})
    row = led.step("weight")
    assert row["where_MiB"] == {"default/ordinary": 52.0}
    assert "in: default/ordinary 52.0" in ml.format_rows(led.rows).splitlines()[-1]


def test_held_and_kept_are_measured_from_the_weights_row():
    rows = [{"step": s, "reserved_MiB": v} for s, v in [("start", 0.0), ("weight", 16.0),
                                                         ("settled, before the clear", 172.0),
                                                         ("gc + synchronize + empty_cache", 100.0)]]
    assert ml.held_and_kept(rows) == {"held_MiB": 156.0, "kept_MiB": 84.0}


def test_name_block_prefers_known_tensors_then_cublas_frames_then_the_workspace_size():
    known = {1: "weight"}
    assert ml.name_block(1, 32 * MiB, ["at::cuda::getCurrentCUDABlasHandle (x.cpp:1)"], known, 32 * MiB) == "weight"
    assert ml.name_block(2, 8, ["getCUDABlasLtWorkspace (x.cpp:2)"], known) == "cuBLAS workspace"
    assert ml.name_block(3, 32 * MiB, [], known, 32 * MiB) == "cuBLAS workspace (by its size)"
    assert ml.name_block(4, 32 * MiB, ["<lambda> (p.py:3)"], known, None) == "made in the forward (no tensor)"
    assert ml.name_block(5, 2 * MiB, [], known, 32 * MiB) == "?"


def test_format_segments_lists_each_segments_live_blocks():
    segs = ml.snapshot_summary([_seg(0, (0, 0), 20, [{"address": 1, "size": 16 * MiB, "state": "active_allocated"}]),
                                _seg(7, (0, 1), 2)], {1: "weight"}, {0: "default"})
    lines = ml.format_segments(segs)
    assert "stream default" in lines[0] and "weight 16.0" in lines[0] and "no live block" in lines[1]


def test_stream_names_number_new_streams_and_skip_the_ones_torch_only_wraps():
    class FakeStream:
        def __new__(cls, *args, **kwargs):
            s = object.__new__(cls)
            s.cuda_stream = kwargs.get("stream_id", 100 + FakeStream.count)
            FakeStream.count += 1
            return s

    FakeStream.count = 0
    fake = type("T", (), {"cuda": type("C", (), {"Stream": FakeStream})})
    names = ml.StreamNames()
    names.install(fake)
    names.name(0, "default")
    names.context = "call, batch 256"
    a = fake.cuda.Stream()
    fake.cuda.Stream(stream_id=0)  # torch wrapping the current stream: not a new one
    names.context = ""
    b = fake.cuda.Stream()
    assert names.names == {0: "default", a.cuda_stream: "side 1 (call, batch 256)", b.cuda_stream: "side 2"}
    names.name(b, "capture")
    assert names.names[b.cuda_stream] == "capture"
    names.uninstall()
    assert fake.cuda.Stream is FakeStream and names.names[0] == "default"


@pytest.mark.skipif(ON_GPU, reason="the caches run on the simulator's graphs here")
def test_cache_tensors_names_the_static_inputs_and_outputs_of_both_caches():
    w = torch.randn(4, 4)
    fwd = lambda t: torch.relu(t @ w) @ w  # noqa: E731
    for cache in (mp.answer_cache_class()(fwd, buckets=[2, 4]), GraphCache(fwd, buckets=[2, 4])):
        cache(torch.randn(3, 4))
        names = sorted(mp.cache_tensors(cache).values())
        assert names == ["cache's static input (bucket 4)", "cache's static output (bucket 4)"], type(cache)


def test_report_says_held_and_kept_the_workspace_facts_and_the_segments():
    rows = [{"cache": "answer", "workspaces": "released", "step": "weight", "what": "", "reserved_MiB": 16.0,
             "allocated_MiB": 16.0, "freed_MiB": 0.0}]
    run = {"rows": rows, "summary": {"held_MiB": 156.0, "kept_MiB": 84.0},
           "facts": {"after": "nothing", "torch": "2.11.0+cu130", "device": "H200",
                     "workspace_facts": {"mm float32": {"kept_MiB": 32.0, "left_after_release_MiB": 0.0}}},
           "snapshots": {"after the clear": ml.snapshot_summary([_seg(0, (0, 0), 20)], {}, {0: "default"})}}
    text = mp.report({"rows": rows, "runs": [run]})
    assert "156.0 MiB held before the clear, 84.0 MiB kept after it" in text
    assert "mm float32 32.00 MiB (0.00 left after the release)" in text and "segments reserved, after the clear" in text


def test_the_command_line_names_a_bad_run(capsys):
    with pytest.raises(SystemExit):
        mp.main(["--json", "x.json", "--runs", "answer:released:twice"])
    assert "cache:workspaces:after" in capsys.readouterr().err


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
def test_workspace_facts_on_a_gpu_measure_each_product():
    facts = ml.workspace_facts()
    assert set(facts) == {"mm float32", "addmm with bias float32", "mm bfloat16", "addmm with bias bfloat16"}
    assert all(v["kept_MiB"] >= 0 for v in facts.values())


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
def test_run_one_on_a_gpu_notes_every_step_and_frees_what_the_cache_owns():
    res = mp.run_one("answer", "released", "eager", width=256, buckets=(16, 32))
    steps = [r["step"] for r in res["rows"]]
    assert steps[:2] == ["start", "weight"] and "eager forward after the captures" in steps
    assert set(res["snapshots"]) == {"settled, before the clear", "after the clear", "after every release"}
    names = {b["name"] for s in res["snapshots"]["settled, before the clear"] for b in s["live_blocks"]}
    assert {"weight", "cache's static input (bucket 32)", "cache's static output (bucket 32)"} <= names
    after = {b["name"] for s in res["segments"] for b in s["live_blocks"]}
    assert not any(n.startswith("cache's") for n in after), after


def test_what_stays_after_a_clear_names_the_streams_and_no_pool():
    snap = [_seg(0, (0, 0), 20), _seg(0, (0, 0), 2), _seg(7, (0, 0), 32)]
    text = what_stays(72 * MiB, 70 * MiB, snap, {0: "the default stream"})
    assert text.startswith("clear_cache() gave back 72.0 MiB (the captures' pool held 70.0 MiB); 54.0 MiB stay")
    assert "22.0 MiB on the default stream" in text and "32.0 MiB on stream 7" in text
    assert "0.0 MiB of it in a graph pool" in text
    assert "2.0 MiB of it in a graph pool" in what_stays(0, 2 * MiB, [_seg(9, (1, 4), 2)])


def test_a_run_names_its_inputs_and_the_command_line_takes_them(tmp_path, capsys):
    """Issue 44's scenario is one run: the caller's inputs made in each call and dropped (per_call)."""
    assert ("answer", "released", "nothing", "per_call") in mp.RUNS and mp.INPUTS == ("kept", "per_call")
    with pytest.raises(SystemExit):
        mp.main(["--json", "x.json", "--runs", "answer:released:nothing:twice"])
    assert "inputs" in capsys.readouterr().err
    if not ON_GPU:  # the four-field run parses; the simulator path then refuses, as every run
        assert mp.main(["--json", str(tmp_path / "p.json"), "--runs", "answer:released:nothing:per_call"]) == 2


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
def test_run_one_with_inputs_made_per_call_keeps_nothing_of_the_callers_or_the_caches():
    res = mp.run_one("answer", "released", "nothing", "per_call", width=256, buckets=(16, 32))
    assert res["facts"]["inputs"] == "per_call" and all(r["inputs"] == "per_call" for r in res["rows"])
    after = {b["name"] for s in res["segments"] for b in s["live_blocks"]}
    assert not any(n.startswith(("cache's", "caller's")) for n in after), after
