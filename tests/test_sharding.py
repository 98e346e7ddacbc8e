"""Lesson 05: PyTorch's DTensor sharded-embedding test ported, and the course's sharding code.

The DTensor test's cases run in 2 worker processes: gloo on the CPU always, NCCL too when 2 GPUs are present
(``COURSE_PATH=cuda python -m pytest tests/test_sharding.py`` on a 2-GPU machine). Every multi-process
run has a time limit (``launch(timeout=...)``), so nothing here can hang.
"""
import json

import pytest
import torch

import course
from course.core import reference
from course.core.results import Result
from course.core.runtime import gpu_count
from course.lessons import sharding as S
from course.lessons.sharding import bench as B
from course.lessons.sharding import layouts as L
from course.lessons.sharding import lesson as SL

BACKENDS = ["gloo"] + (["nccl"] if gpu_count() >= 2 else [])
TWO_GPUS = pytest.mark.skipif(gpu_count() < 2, reason="needs 2 GPUs on the GPU path (NCCL)")


# ---------------------------------------------------------------------------- pure helpers
def test_shards_and_pictures():
    assert L.chunk_bounds(13, 2) == [(0, 7), (7, 13)] and L.chunk_bounds(16, 4)[3] == (12, 16)
    assert S.shard_bounds(16, 1, 2) == (8, 16)
    with pytest.raises(ValueError, match=r"rank 1: the table has 17 rows.*do not divide by the world size 2.*Pad"):
        S.shard_bounds(17, 1, 2)
    w = torch.arange(32.0).reshape(16, 2)
    shard, start = S.local_rows(w, 1, 2)
    assert start == 8 and torch.equal(shard, w[8:])
    assert S.plot_ownership(16, 8, 2, ids=[3, 9, 12]) is not None
    pic = S.ownership(16, 8, 2, ids=[3, 9, 12])
    assert "rank 1: rows   8..15" in pic and "looks up [9, 12], masks 1 id(s)" in pic and "cols   4..7" in pic
    b = S.comm_bytes(128, 64, 4)
    assert b["output_bytes"] == 128 * 64 * 4 and b["allreduce_bytes"] == 2 * 3 * b["output_bytes"] // 4
    assert b["allgather_bytes"] == 3 * b["output_bytes"] // 4 and b["colwise_lookup_bytes"] == b["output_bytes"] // 2


def test_masked_lookup_gives_zero_rows_for_other_shards():
    """The Numba kernel (simulator on CPUs) and F.embedding agree; ids of other shards give zero rows."""
    dev = course.device()
    w = torch.randn(8, 4, device=dev)
    shard, start = S.local_rows(w, 1, 2)
    ids = torch.tensor([[0, 5], [7, 3]], device=dev)
    for impl in ("numba", "torch"):
        out = S.masked_lookup(ids, shard, start, impl)
        assert torch.equal(out[0, 1], w[5]) and torch.equal(out[1, 0], w[7])
        assert not out[0, 0].any() and not out[1, 1].any()
    with pytest.raises(ValueError, match="impl must be one of"):
        S.masked_lookup(ids, shard, start, "cuda")


def test_buckets_and_plan():
    assert S.pick_bucket(5, (8, 16)) == 8 and S.pick_bucket(16, (16, 8)) == 16
    with pytest.raises(ValueError, match="do not fit the largest captured bucket 16"):
        S.pick_bucket(17, (8, 16))
    p = S.plan()
    assert (p.backend, p.world_size) == (("nccl", gpu_count()) if gpu_count() >= 2 else ("gloo", 2))
    g = S.plan(8, "gloo")
    assert g.gpus == 0 and g.device_type == "cpu" and "gloo with 8 processes" in g.describe()
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        S.plan(0)
    if gpu_count() < 2:
        with pytest.raises(ValueError, match="NCCL needs 2 or more GPUs"):
            S.plan(2, "nccl")
    prov = B.run_provenance(g)
    assert prov["device"].startswith("8 CPU processes (gloo)") and prov["gpus"] == 0


def test_context_says_and_names_its_device():
    class Q(list):
        put = list.append
    ctx = S.Context(1, 2, "gloo", "cpu", Q())
    ctx.say("in all-reduce 2 of 2")
    assert ctx.queue == [(1, "note", "in all-reduce 2 of 2")] and ctx.torch_device == torch.device("cpu")
    S.Context(0, 2, "gloo", "cpu").say("no queue: ignored")


def test_launch_refuses_functions_spawn_cannot_run():
    with pytest.raises(ValueError, match="not a lambda"):
        S.launch(lambda ctx: 0, 2, backend="gloo")


# ---------------------------------------------------------------------------- workers written in a notebook cell
def _kernel_cell(src: str, filename: str = "/tmp/ipykernel_1/123456.py") -> dict:
    """Run ``src`` as a notebook kernel runs a cell: in ``__main__``'s name, its lines in linecache."""
    import linecache

    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    ns = {"__name__": "__main__"}
    exec(compile(src, filename, "exec"), ns)
    return ns


CELL = '''
import torch  # a cell's own import: the worker cannot see it


def cell_worker(ctx, scale=1.0):
    """Sum of the ranks, times scale, over the process group."""
    import torch
    import torch.distributed as dist
    from course.core.launch import device_mesh

    x = torch.tensor([float(ctx.rank)]) * scale
    dist.all_reduce(x)
    return {"rank": ctx.rank, "sum": float(x), "mesh": device_mesh(ctx).size(), "lines": [l for l in range(3)]}


def broken_worker(ctx):
    import torch

    if ctx.rank == 1:
        raise ValueError("rank 1 refuses")  # the cell's line
    return 0


def forgets_import(ctx):
    return torch.zeros(1) + helper()


def helper():
    return 1
'''


def test_portable_keeps_course_functions_and_carries_a_cells_source():
    import pickle

    from course.core import cell_workers as C

    assert C.portable(SL.bucket_worker) is SL.bucket_worker and C.importable(SL.bucket_worker)
    ns = _kernel_cell(CELL)
    assert not C.importable(ns["cell_worker"])
    carried = pickle.loads(pickle.dumps(C.portable(ns["cell_worker"])))
    assert isinstance(carried, C.CellWorker) and carried.name == "cell_worker"
    fn = carried.load()
    assert fn.__code__.co_filename == "/tmp/ipykernel_1/123456.py"
    assert fn.__code__.co_firstlineno == ns["cell_worker"].__code__.co_firstlineno  # the cell's own line numbers
    assert {"torch", "dist", "device_mesh"} <= set(fn.__code__.co_varnames) and C.global_names(fn.__code__) <= {"float", "range"}


def test_portable_refuses_what_cannot_travel_naming_it():
    from course.core import cell_workers as C

    ns = _kernel_cell(CELL, "/tmp/ipykernel_1/654321.py")
    with pytest.raises(ValueError, match=r"'forgets_import' uses helper, torch without importing.*top of its body"):
        C.portable(ns["forgets_import"])
    scale = 2.0

    def closure(ctx):
        return scale
    with pytest.raises(ValueError, match=r"uses \['scale'\] of the function it is defined in"):
        C.portable(closure)
    with pytest.raises(ValueError, match="is decorated"):
        C.portable(_kernel_cell("import functools\n@functools.lru_cache\ndef deco(ctx):\n    return 1\n",
                                "/tmp/ipykernel_1/7.py")["deco"].__wrapped__)
    unreadable = {"__name__": "__main__"}
    exec(compile("def ghost(ctx):\n    return 1\n", "<no file>", "exec"), unreadable)
    with pytest.raises(ValueError, match="the source of worker 'ghost' cannot be read"):
        C.portable(unreadable["ghost"])
    import functools
    partial = functools.partial(SL.bucket_worker, agree=True)
    assert C.portable(partial) is partial  # picklable as it is


def test_a_worker_written_in_a_cell_runs_on_every_rank_and_its_errors_show_the_cell():
    """What notebook 05's experiment cells rely on: the kernel's function travels as source to 2 gloo processes."""
    ns = _kernel_cell(CELL, "/tmp/ipykernel_1/999.py")
    out = S.launch(ns["cell_worker"], 2, backend="gloo", timeout=120, scale=2.0)
    assert [o["rank"] for o in out] == [0, 1] and all(o["sum"] == 2.0 and o["mesh"] == 2 for o in out)
    with pytest.raises(S.WorkerError, match=r"failed first on rank 1: ValueError: rank 1 refuses") as e:
        S.launch(ns["broken_worker"], 2, backend="gloo", timeout=120)
    assert 'File "/tmp/ipykernel_1/999.py", line 20' in str(e.value) and "# the cell's line" in str(e.value)


# ---------------------------------------------------------------------------- PyTorch's DTensor test, in processes
@pytest.fixture(scope="module", params=BACKENDS)
def lesson(request):
    """One launch per backend: lesson_worker runs the DTensor test's cases (dtensor_worker; the test's _apply_sharding is
    layouts.shard_embedding) and the vocab-parallel checks."""
    out = S.run_lesson(2, backend=request.param)  # launch(lesson_worker, ...) + dtensor_result
    assert isinstance(out["plan"], S.Plan) and out["plan"].backend == request.param
    return out


def test_dtensor_cases_match_the_local_table(lesson):
    res = lesson["dtensor"]
    assert len(res.rows) == len(L.DTENSOR_CASES) == 10
    for r in res.rows:
        assert r["forward_ok"] and r["grad_ok"] and r["F.embedding_ok"], r
        assert r["fwd_comms"] == 0 and r["bwd_comms"] == 0, r  # no communication in forward or backward
    cases = lesson["ranks"][0]["dtensor"]["cases"]
    assert {c["kwargs"].get("padding_idx") for c in cases} == {None, 10, 12}
    assert all(c["padding_row_grad_zero"] for c in cases if c["kwargs"].get("padding_idx") is not None)
    assert res.value("cases_all_equal") is True


def test_dtensor_comm_counts_and_placements(lesson):
    for r in lesson["dtensor"].rows:
        if r["layout"].startswith("row-wise"):
            assert r["output"] == "_MaskPartial" and r["full_tensor"] == "all_reducex1"
        else:
            assert r["output"].startswith("Shard(") and r["full_tensor"] == "all_gather_into_tensorx1"
    assert lesson["dtensor"].rows[8]["shard_per_rank"] == "7x22 | 6x22"  # 13 rows over 2 ranks: torch.chunk split


def test_dtensor_max_norm_has_no_sharding_strategy(lesson):
    """The DTensor test's max_norm case: NotImplementedError from DTensor (max_norm_error returns its message)."""
    msg = lesson["dtensor"].value("max_norm_error")
    assert "aten.embedding_renorm_.default does not have a sharding strategy registered" in msg


def test_vocab_parallel_equals_dtensor(lesson):
    """masked_lookup + all_reduce (vocab_parallel_embedding), with Numba and F.embedding, equals DTensor row-wise."""
    for r in lesson["ranks"]:
        assert r["dtensor_equal_local"] and r["numba_equal_dtensor"] and r["torch_equal_dtensor"], r
    r0, r1 = lesson["ranks"]
    assert r0["shard_rows"] == (0, 8) and r1["shard_rows"] == (8, 16)
    assert r0["masked_positions"] + r1["masked_positions"] == len(sum(r0["ids"], []))  # each id is held once


def test_bad_input_is_refused_on_every_rank_naming_the_rank(lesson):
    """check_inputs: every rank raises the same error naming the rank at fault; nobody is left in a collective."""
    for r in lesson["ranks"]:
        e = r["errors"]
        assert "rank 1: 1 id(s) out of range for a table of 16 rows" in e["out_of_range"]
        assert f"rank {r['rank']}: the table has 17 rows" in e["rows_not_divisible"]
        assert "different dtypes" in e["mismatched_dtypes"] and "rank 0: table dtype torch.float64" in e["mismatched_dtypes"]


# ---------------------------------------------------------------------------- never hang
def test_worker_error_names_the_rank_and_stops_the_others():
    """bucket_worker with one bucket of 8: rank 1 (11 tokens) raises; rank 0 would wait forever in its all-reduce."""
    with pytest.raises(S.WorkerError, match=r"failed first on rank 1: ValueError: 11 tokens do not fit the largest") as e:
        S.launch(SL.bucket_worker, 2, backend="gloo", timeout=60, agree=False, buckets=(8,))
    assert e.value.first == 1 and 1 in e.value.ranks  # rank 0 may report its knock-on error (peer closed) too


def test_bucket_demo_agrees_or_is_stopped_by_the_time_limit():
    """bucket_demo: agree_bucket makes both ranks replay bucket 16; without it the run is killed at the time limit."""
    d = S.bucket_demo(timeout=12)
    assert [a["bucket"] for a in d["agreed"]] == [16, 16] and all(a["sum"] == 2.0 for a in d["agreed"])
    assert d["disagree_outcome"].startswith("stopped by the time limit"), d["disagree_outcome"]
    assert d["disagree_error"] == "WorkerTimeout" and issubclass(S.WorkerTimeout, S.WorkerError)
    assert 1 in d["disagree_stuck_ranks"] and d["disagree_seconds"] < 12 + 10
    x = torch.ones(16, 2)
    with pytest.raises((RuntimeError, ValueError)):
        S.bucket_step(x)  # bucket_step needs a process group (launch makes one)


# ---------------------------------------------------------------------------- experiments and figures
def test_cost_experiment_runs_live():
    """cost_experiment: sweep_worker at one world size, ids x widths; world_sizes_experiment is the same worker
    over subgroups (notebook 05 runs it at 2, 4 and 8 gloo processes)."""
    res = reference.run("sharding_cost", **reference.get("sharding_cost").quick)
    assert res.live and res.value("all_correct") and len(res.rows) == 4
    assert all(r["allreduce_bytes"] == r["output_bytes"] for r in res.rows)  # 2 ranks: 2*(W-1)/W = 1
    assert "CPU processes (gloo)" in res.caption() or res.provenance["gpus"] >= 2
    assert S.plot_cost(res) is not None


def test_registry_declares_gpus():
    reg = reference.load_all()
    assert reg["sharding_capture"].gpus == 2 and reg["sharding_capture_world_sizes"].gpus == 2
    assert not reg["sharding_dtensor_test"].gpu_only and not reg["sharding_world_sizes"].gpu_only
    assert reg["sharding_world_sizes"].quick == {"sizes": (2, 4)}


def _fake(name, rows, columns):
    return Result(name, name, columns, rows, params={"backend": "gloo"})


def test_summary_and_world_size_plot_from_results(tmp_path, monkeypatch):
    live = _fake("sharding_world_sizes",
                 [{"world_size": w, "eager_us": 10.0 * w, **S.comm_bytes(128, 32, w)} for w in (2, 4, 8)],
                 {"world_size": "", "eager_us": "us", **{k: "B" for k in S.comm_bytes(1, 1, 2)}})
    cap_rows = [{"world_size": 2, "variant": v, "eager_us": 900.0, "eager_q1_us": 850.0, "eager_q3_us": 950.0,
                 "replay_us": 20.0, "replay_q1_us": 19.0, "replay_q3_us": 21.0, "speedup": 45.0,
                 "replay_correct": True} for v in B.VARIANTS]
    cap = _fake("sharding_capture", cap_rows, {k: "" for k in cap_rows[0]})
    text = S.capture_summary(cap)
    assert "dtensor_rowwise on 2 GPUs: eager 900.0 us" in text and "45.0x faster" in text
    assert "No capture figures" in S.capture_summary(None)
    assert S.plot_world_sizes(live, cap) is not None
    monkeypatch.setattr(reference, "REFERENCE_DIR", tmp_path)
    if gpu_count() < 2:
        assert S.recorded("sharding_capture") is None


def test_capture_reference_when_recorded():
    """sharding_capture's data, once `course bench` recorded it on 2+ GPUs: valid, correct replays, 2x <GPU>."""
    path = reference.reference_path("sharding_capture")
    if not path.exists():
        pytest.skip("not recorded yet: `python -m course bench` on a machine with 2 GPUs writes it")
    res = Result.from_dict(json.loads(path.read_text()))
    assert res.provenance["gpus"] >= 2 and res.provenance["device"].startswith(f"{res.provenance['gpus']}x ")
    assert res.value("all_replays_correct") and res.value("bucket_agreement_ok")


# ---------------------------------------------------------------------------- GPU lane (2 GPUs, NCCL)
@TWO_GPUS
def test_capture_experiment_on_two_gpus():
    """capture_worker: make_step per variant, capture_graph, replay with new ids: correct, and faster than eager."""
    res = reference.run("sharding_capture", **reference.get("sharding_capture").quick)
    assert res.live and res.value("all_replays_correct") and res.value("bucket_agreement_ok")
    assert {r["variant"] for r in res.rows} == set(B.VARIANTS)
    assert all(r["replay_us"] < r["eager_us"] for r in res.rows)


@TWO_GPUS
def test_capture_world_sizes_on_gpus():
    res = reference.run("sharding_capture_world_sizes", **reference.get("sharding_capture_world_sizes").quick)
    assert res.value("all_replays_correct") and res.params["sizes"][0] == 2
    assert res.provenance["device"].startswith(f"{max(res.params['sizes'])}x ")


def timing_worker(ctx, sleep_s: float = 0.002, repeats: int = 3, inner: int = 2) -> dict:
    """An all-reduce whose last rank is slower, timed with time_ranks on every rank."""
    import time

    import torch.distributed as dist

    from course.core.timing import time_ranks

    x = torch.ones(4, device=ctx.torch_device)

    def fn():
        if ctx.rank == ctx.world_size - 1:
            time.sleep(sleep_s)
        dist.all_reduce(x)

    t = time_ranks(fn, warmup=1, repeats=repeats, inner=inner)
    return {"rank": ctx.rank, "median": t.median, "q1": t.q1, "clock": t.clock, "repeats": t.repeats}


def test_time_ranks_reports_the_slowest_rank_on_every_rank():
    """One number for a collective step: every rank returns the same Timing, and it includes the slow rank."""
    from course.core.launch import launch

    out = launch(timing_worker, 2, backend="gloo", timeout=120, sleep_s=0.004, repeats=3, inner=2)
    assert len({o["median"] for o in out}) == 1, out  # the same figure on every rank
    assert all(o["median"] >= 0.004 and o["repeats"] == 3 and o["clock"].endswith("slowest rank") for o in out)


def test_capture_figures_record_their_timing_method():
    assert "slowest rank" in B.TIMING and "aligned" in B.TIMING


def test_same_step_in_two_tables_agrees_or_says_why():
    base = _fake("sharding_capture", [{"world_size": 2, "variant": "dtensor_rowwise", "replay_us": 25.7,
                                        "replay_q1_us": 25.6, "replay_q3_us": 25.9}],
                 {"world_size": "", "variant": "", "replay_us": "us", "replay_q1_us": "us", "replay_q3_us": "us"})
    base.params["timing"] = B.TIMING
    other = _fake("sharding_capture_world_sizes", [dict(base.rows[0])], dict(base.columns))
    other.params["timing"] = B.TIMING
    other.provenance = dict(base.provenance)
    assert S.same_step(base, other).endswith("they agree.")
    skewed = _fake("sharding_capture", [{**base.rows[0], "replay_us": 48.7, "replay_q1_us": 44.7,
                                         "replay_q3_us": 53.8}], dict(base.columns))
    skewed.provenance = dict(base.provenance)
    text = S.same_step(skewed, other)
    assert "48.7 us (IQR 44.7-53.8)" in text and "rank skew" in text and "bench sharding_capture" in text
    assert S.timing_method(skewed) != S.timing_method(other)
    assert S.same_step(None, other) == "" and S.same_step(base, other, variant="vocab_numba") == ""


def test_the_same_table_and_ids_on_every_rank_and_the_sweep_table():
    from course.lessons.sharding.bench import sweep_result

    assert torch.equal(B.full_table(16, 4, "cpu"), B.full_table(16, 4, "cpu")) and B.full_table(16, 4, "cpu").shape == (16, 4)
    ids = B.same_ids((3, 5), 10, "cpu")
    assert torch.equal(ids, B.same_ids((3, 5), 10, "cpu")) and int(ids.max()) < 10 and int(ids.min()) >= 0
    assert not torch.equal(ids, B.same_ids((3, 5), 10, "cpu", seed=99))
    p = S.Plan("gloo", 2, "cpu", "test")
    rows = [{"world_size": 2, "ids": 16, "dim": d, "eager_us": 5.0, "eager_q1_us": 4.0, "eager_q3_us": 6.0, "correct": ok,
             **S.comm_bytes(16, d, 2)} for d, ok in ((8, True), (16, False))]
    res = sweep_result("sharding_cost", "t", rows, p, {"num_embeddings": 64})
    assert res.value("all_correct") is False and res.params["processes"] == 2 and res.params["num_embeddings"] == 64
    assert res.params["timing"] == B.TIMING and "2 CPU processes (gloo)" in res.provenance["device"]


def test_the_capture_cells_worker_travels_to_the_processes_and_refuses_gloo_clearly():
    """Lesson 05's capture worker (a cell, read out of the answer version) runs from its source on every rank."""
    worker = reference.load_all()["sharding_capture"].fn.__globals__["capture_worker"]
    assert worker.__module__.startswith("course_cells.")
    with pytest.raises(S.WorkerError, match="capture_worker captures CUDA graphs: it needs the NCCL backend"):
        S.launch(worker, 2, backend="gloo", timeout=120)


def test_capture_rows_and_results_from_the_workers_output():
    from course.core.timing import Timing
    from course.lessons.sharding.bench import capture_result

    def t(us):
        return Timing(us * 1e-6, us * 0.9e-6, us * 1.1e-6, us * 0.8e-6, us * 1.2e-6, 5, 3, "slowest rank")

    rows = [B.variant_row(v, 2, t(100.0), t(20.0 if v != "vocab_numba" else 30.0), True, 128, 64) for v in B.VARIANTS]
    assert rows[0]["speedup"] == pytest.approx(5.0) and rows[0]["replay_q3_us"] == pytest.approx(22.0)
    assert rows[0]["allreduce_bytes"] == S.comm_bytes(128, 64, 2)["allreduce_bytes"] and rows[0]["ids"] == 128
    agreement = [{"world_size": 2, "rank": r, "tokens": 5, "own_bucket": 8, "bucket": 16, "correct": True} for r in (0, 1)]
    out = [{"rank": 0, "rows": rows, "agreement": agreement[:1]}, {"rank": 1, "rows": [], "agreement": agreement[1:]}]
    p = S.Plan("nccl", 2, "cuda", "test")
    res = capture_result("sharding_capture", "t", out, p, {"dim": 64})
    assert res.value("all_replays_correct") and res.value("bucket_agreement_ok") and len(res.value("bucket_agreement")) == 2
    assert res.value("numba_over_torch_replay") == pytest.approx(1.5) and res.value("rowwise_speedup") == pytest.approx(5.0)
    assert res.params["timing"] == B.TIMING
    wrong = [dict(rows[0], replay_correct=False)]
    ws = capture_result("sharding_capture_world_sizes", "t", [{"rows": wrong, "agreement": []}], p, {}, buckets=False)
    assert ws.value("all_replays_correct") is False and set(ws.summary) == {"all_replays_correct"}


BUCKET_CELL = '''
def bucket_cell_worker(ctx):
    from course.lessons.sharding import bench as B
    return B.bucket_replay(ctx, None, ctx.world_size, 64, 8)
'''


@TWO_GPUS
def test_bucket_replay_on_two_gpus_from_a_worker_written_in_a_cell():
    """A cell's worker over NCCL (sent as source), running the bucket agreement with captured graphs."""
    ns = _kernel_cell(BUCKET_CELL, "/tmp/ipykernel_1/bucket.py")
    out = S.launch(ns["bucket_cell_worker"], 2, backend="nccl", timeout=300)
    assert [o["bucket"] for o in out] == [16, 16] and all(o["correct"] for o in out)
