"""The graph cache memory probe's bookkeeping (its GPU run is by hand), and what the backends release per stream."""
import pytest
import torch

from course.core import hardware
from course.core.runtime import CourseEnvironmentError, runtime
from course.lessons.graph_cache import memory_probe as mp
from course.lessons.graph_cache.backends import CudaGraphBackend
from course.lessons.graph_cache.counting import CountingBackend

ON_GPU = runtime().on_gpu
MiB = 2**20


def test_ledger_notes_each_step_and_what_it_freed():
    readings = iter([(100 * MiB, 60 * MiB), (120 * MiB, 70 * MiB), (80 * MiB, 40 * MiB)])
    led = mp.Ledger("answer", "kept", lambda: next(readings))
    led.step("start")
    led.step("calls", "three misses")
    last = led.step("clear_cache()")
    assert [r["freed_MiB"] for r in led.rows] == [0.0, -20.0, 40.0]
    assert last == {"cache": "answer", "workspaces": "kept", "step": "clear_cache()", "what": "",
                    "reserved_MiB": 80.0, "allocated_MiB": 40.0, "freed_MiB": 40.0}
    table = mp.format_rows(led.rows)
    assert table.splitlines()[0].split()[:3] == ["cache", "workspaces", "step"] and "three misses" in table
    assert len(table.splitlines()) == 2 + 3
    releases = mp.release_table(led.rows)
    assert releases == [{"cache": "answer", "workspaces": "kept", "release": "clear_cache()", "freed_MiB": 40.0}]


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
    segs = mp.snapshot_summary(snap, {1000: "weight"}, {0: "default", 77: "capture"})
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
    from course.core.runtime import graphs
    from course.lessons.graph_cache.backends import RecordingBackend

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
