"""Lesson 08: the model split by hand and with parallelize_module, the all-reduces counted (exercise 08.1's check:
tests/test_tp_exercise_mutants.py).

Multi-process runs use lesson 05's launcher (gloo CPU processes here; NCCL on a machine with 2+ GPUs, where
``COURSE_PATH=cuda python -m pytest tests/test_tensor_parallel.py`` runs the same tests over NCCL with TinyLlama's
shape). Every run has a time limit. The 8-rank run (8 gloo processes) costs about a minute on two cores: it runs with
``COURSE_SLOW=1`` (the GPU machine's command sets it).
"""
import os
import types

import pytest
import torch

from course.core.runtime import gpu_count
from course.core.timing import Timing
from course.lessons import tensor_parallel as TP
from course.lessons.real_model import StaticDecoder, build_model, greedy
from course.lessons.real_model.model import Size
from course.lessons.sharding import lesson as SL
from course.lessons.tensor_parallel import bench as B, lesson as TL, tp as SH

NCCL = gpu_count() >= 2
SLOW = os.environ.get("COURSE_SLOW") == "1"
# the tiny model with 8 query heads (2 KV heads), so that 8 ranks split it: the 8-rank path, KV heads replicated
TINY8 = Size("tiny8", hidden=64, intermediate=176, layers=2, heads=8, kv_heads=2, vocab=512, dtype="float32",
             max_positions=512)


# ---------------------------------------------------------------------------- the layout, in one process
def test_head_plan_splits_heads_and_replicates_kv_heads_past_their_count():
    assert SH.head_plan(32, 4, 2, 1) == SH.HeadPlan((16, 32), (2, 4), False)
    p = SH.head_plan(32, 4, 8, 5)  # 8 ranks, 4 KV heads: ranks 4 and 5 share KV head 2
    assert (p.q, p.kv, p.replicated_kv, p.n_q, p.n_kv) == ((20, 24), (2, 3), True, 4, 1)
    assert SH.head_plan(32, 4, 8, 4).kv == (2, 3)
    with pytest.raises(ValueError, match="4 query heads do not split over 8 ranks"):
        SH.head_plan(4, 2, 8, 0)
    with pytest.raises(ValueError, match="do not split over 3 ranks"):
        SH.head_plan(6, 6, 3, 0) if False else SH.head_plan(32, 4, 3, 0)
    assert SH.mlp_rows(5632, 4, 3) == (4224, 5632)
    with pytest.raises(ValueError, match="do not split over 3"):
        SH.mlp_rows(176, 3, 0)
    assert SH.predicted_all_reduces(22, 1) == 0 and SH.predicted_all_reduces(22, 4) == 44


def test_layout_bytes_match_the_shards_and_the_table():
    m = build_model("tiny", device="cpu")
    for w in (1, 2, 4):
        for r in range(w):
            d = SH.HandShardedDecoder(m, r, w, max_len=16)
            assert d.bytes_per_token() == B.layout_bytes("tiny", w, r)
            assert len(d.tensors()) == 3 + 6 * 2
    lay = TP.layout("tinyllama")
    by = {r["world_size"]: r for r in lay.rows}
    assert by[8]["kv"] == "replicated" and by[8]["kv_heads"] == 1 and by[2]["kv"] == "split"
    assert by[1]["bytes_per_token"] / by[4]["bytes_per_token"] < 4  # the replicated LM head keeps a floor per rank


def test_hand_split_at_one_rank_is_lesson_06s_model():
    assert torch.equal(SH.rotate_half(torch.tensor([1.0, 2, 3, 4])), torch.tensor([-3.0, -4, 1, 2]))
    assert issubclass(SH.HandShardedDecoder, SH.RankShare) and not hasattr(SH.RankShare, "step")
    m = build_model("tiny", device="cpu")
    ref, hand = StaticDecoder(m, 64), SH.HandShardedDecoder(m, 0, 1, max_len=64)
    first = SH.first_token("cpu", m.config.vocab_size)
    assert torch.equal(greedy(ref.step, first, 12), greedy(hand.step, first, 12))
    ids, pos = hand.example_args(1, 3)
    ref.reset()
    hand.reset()
    # the stacked q/k/v and gate/up products may sum in another order than three separate ones (seen on a GPU
    # machine's CPU: last-bit differences), so the logits agree to float32 rounding and the tokens exactly
    torch.testing.assert_close(ref.step(ids, pos), hand.step(ids, pos), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"step takes ids \[B, 1\]"):
        hand.step(ids.view(1), pos)
    with pytest.raises(ValueError, match="linear must be"):
        SH.HandShardedDecoder(m, linear="cublas")
    assert SH.shard_layer(m.model.layers[0], SH.head_plan(4, 2, 2, 0), (0, 88), 16)["qkv"].shape == (64, 64)


def test_parallelize_modules_plan_refuses_what_cannot_split():
    from course.lessons.real_model.model import llama_config

    plan = TP.tp_plan(llama_config("tinyllama"), 4)
    assert type(plan["self_attn.o_proj"]).__name__ == "RowwiseParallel"
    assert type(plan["mlp.up_proj"]).__name__ == "ColwiseParallel"
    with pytest.raises(ValueError, match="4 KV heads do not split over 8 ranks.*hand-sharded"):
        TP.tp_plan(llama_config("tinyllama"), 8)
    assert TP.parallelize and TP.DTensorDecoder  # run on every rank by the launches below


# ---------------------------------------------------------------------------- counting and the floor
def test_counting_rules():
    events = [("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgs)", True),
              ("ncclKernel_AllReduce_RING_LL_Sum_float", True), ("cudaLaunchKernel", False),
              ("ncclDevKernel_AllGather_RING_LL", True), ("ampere_bf16_gemv", True)]
    assert B.count_kernels_named(events) == 2 and B.count_kernels_named(events, "all_gather") == 1
    assert B.count_kernels_named(events + [("ncclDevKernel_Generic", True)], "") == 4  # every NCCL kernel
    assert B.all_reduces({"all_reduce": 2, "nccl_kernels": 3}) == 3
    assert B.all_reduces({"allreduce": 3, "all_reduce": 1, "all_gather_into_tensor": 2}) == 4
    x = torch.ones(3)
    assert B.eager_collectives(lambda: x * 2) == {}


def test_floor_rows_result_and_sentences():
    f = B.floor_us(2e9, 2000.0, 10.0, 44)
    assert f["weights_us"] == pytest.approx(1000.0) and f["collectives_us"] == 440.0 and f["floor_us"] == 1440.0
    with pytest.raises(ValueError, match="positive copy rate"):
        B.floor_us(1, 0, 1, 1)

    def t(us):
        return Timing(us * 1e-6, us * 0.9e-6, us * 1.1e-6, us * 0.8e-6, us * 1.2e-6, 7, 2, "cuda-events, slowest rank")

    rows = [B.timing_row(1, "hand", t(9000), t(3000), 0, 0, 22, B.layout_bytes("tinyllama", 1), 3000.0, 0.0, 0.0),
            B.timing_row(2, "hand", t(9000), t(2000), 44, 44, 22, B.layout_bytes("tinyllama", 2), 3000.0, 2.0, 0.01)]
    p = types.SimpleNamespace(gpus=2, backend="nccl", world_size=2)
    res = TP.tp_result(rows, p, {"sizes": (1, 2)})
    assert res.value("all_reduces_as_predicted") is True and rows[1]["speedup"] == pytest.approx(4.5)
    s = TP.scaling(res, "hand")
    assert s[1]["speedup_vs_tp1"] == pytest.approx(1.5) and 1 < s[1]["floor_speedup"] < 2
    text = TP.timing_summary(res)
    assert "hand TP=2: eager 9,000 us" in text and "4.5x" in text and "all-reduces eager/graph/predicted 44/44/44" in text
    assert "scaling TP=1 time / TP=2 time: 1.50x; the floor predicts" in text and "slowest rank" in text
    # the floor's two terms: 44 all-reduces of 2 us (88 us) against the weight time one half of the ranks saves
    saved = rows[0]["weights_us"] - rows[1]["weights_us"]
    assert f"floor at TP=2: {saved:,.0f} us of weight reading saved per token, 88 us of all-reduce latency added" \
        in text and ("faster than one GPU" if saved > 88 else "slower than one GPU") in text
    slow = [dict(r, all_reduce_us=50.0, collectives_us=44 * 50.0) if r["world_size"] == 2 else r for r in rows]
    assert "the floor predicts the split slower" in "\n".join(TP.floor_reading(TP.tp_result(slow, p, {})))
    close = [dict(r, graph_q1_us=2900.0, graph_q3_us=3100.0) for r in rows]
    assert "(the IQRs overlap: noise)" in TP.timing_summary(TP.tp_result(close, p, {}))
    assert "7,000 us of host work per token removed by the graph (78% of eager)" in text
    # the floor as a share of the graph's time (2000 us at TP=2), and the graph as a multiple of the floor
    share = f"the floor is {rows[1]['floor_us'] / 2000:.0%} of the graph's time (the graph {2000 / rows[1]['floor_us']:.1f}x"
    assert share in text and "% of it" not in text
    assert TP.plot_scaling(res) is not None
    assert TP.timing_summary(None).startswith("No multi-GPU figures")


def test_recorded_says_how_to_record_when_nothing_is(capsys, monkeypatch):
    monkeypatch.setattr(SL, "available", lambda name: False)
    monkeypatch.setattr(SL, "get", lambda name: types.SimpleNamespace(gpus=2))
    assert TP.recorded("tp_decode", recording=True) is None
    assert "not recorded yet: run `python -m course bench tp_decode` on a machine with 2+ GPUs" in capsys.readouterr().out
    monkeypatch.setattr(SL, "available", lambda name: True)
    monkeypatch.setattr(SL, "reference_path", lambda name: types.SimpleNamespace(exists=lambda: True))
    monkeypatch.setattr(SL, "heavy", lambda name: f"recorded {name}")
    monkeypatch.setattr(SL, "run", lambda name: f"live {name}")
    assert TP.recorded("tp_decode", recording=True) == "recorded tp_decode"  # live with COURSE_FULL=1
    assert TP.recorded("sharding_capture") == "live sharding_capture"  # lesson 05's: live where it can run


def test_the_timing_experiment_is_registered_for_two_gpus():
    from course.core import reference

    exp = reference.get("tp_decode")
    assert exp.gpus == 2 and exp.gpu_only
    assert "tp_decode" in reference.bench_names(reference.load_all(), 4)
    assert "tp_decode" not in reference.bench_names(reference.load_all(), 1)
    assert "tp_decode" in reference.bench_skipped(reference.load_all(), 1)  # a 1-GPU bench says it skipped it
    assert "tp_decode" not in reference.bench_skipped(reference.load_all(), 4)


def test_the_simulators_collective_step_and_dtensor_guard_in_one_process():
    from course.sim.dispatch import Collective, refuse_dtensor

    step = Collective(torch.ops.aten.add.Tensor)
    assert str(step) == str(torch.ops.aten.add.Tensor) and torch.equal(step(torch.ones(2), torch.ones(2)),
                                                                       torch.full((2,), 2.0))
    assert refuse_dtensor((torch.ones(1),), {}) is None  # plain tensors pass; a DTensor is refused (every_rank below)


# ---------------------------------------------------------------------------- every rank (gloo; NCCL on 2+ GPUs)
def every_rank_worker(ctx):
    """Test worker, one launch for the lot: the correctness run of both splits and (CPU processes) what the
    simulator's capture does with a collective and with a DTensor (exercise 08.1: tests/test_tp_exercise_mutants.py)."""
    import torch
    import torch.distributed as dist

    import course
    from course.core.runtime import runtime
    from course.lessons.tensor_parallel.lesson import split_tokens

    out = {"tokens": split_tokens(ctx, ("hand", "dtensor"), "tinyllama" if ctx.backend == "nccl" else "tiny", 16,
                                  max_len=24)}
    if runtime().on_gpu:
        return out
    cg = course.graphs()
    x, y = torch.ones(4), torch.zeros(4)
    g = cg.CUDAGraph()
    with cg.graph(g):
        y.copy_(x * (ctx.rank + 1))
        dist.all_reduce(y)
    out["recorded"] = [str(o) for o in g.recorded_ops()]
    from course.lessons.tensor_parallel.bench import graph_collectives

    out["graph_collectives"] = graph_collectives(g)
    x.fill_(2.0)
    g.replay()
    out["after_replay"] = y.tolist()
    from course.core.launch import device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    d = distribute_tensor(torch.ones(4, 2), device_mesh(ctx), [Shard(0)])
    try:
        with cg.graph(cg.CUDAGraph()):
            d * 2
    except NotImplementedError as e:
        out["dtensor"] = str(e)
    return out


@pytest.fixture(scope="module")
def every_rank():
    from course.core.launch import launch, plan

    p = plan(2)
    return launch(every_rank_worker, 2, backend=p.backend, timeout=400)


def test_split_models_decode_as_tp1_on_every_rank_with_the_all_reduces_counted(every_rank):
    """Both splits, eager and captured, against TP=1 on every rank; all-reduces counted in the step and the graph."""
    want = 2 * (22 if NCCL else 2)
    for rank in every_rank:
        for r in rank["tokens"]:
            assert r["ranks_agree"] and r["eager_logit_diff"] <= r["tolerance"], r
            assert r["eager_all_reduces"] == want, r["eager_collectives"]
            assert r["dtype"] != "float32" or r["eager"] == r["tp1"]
            if "captured" in r:
                assert r["graph_all_reduces"] == want and r["captured_logit_diff"] <= r["tolerance"]
                assert r["dtype"] != "float32" or r["captured"] == r["tp1"]
            else:
                assert r["variant"] == "dtensor" and "does not capture DTensor" in r["capture_skipped"] and not NCCL
    report = TP.tokens_report({"variants": ("hand", "dtensor"), "plan": types.SimpleNamespace(world_size=2),
                               "ranks": [r["tokens"] for r in every_rank]})
    assert "hand x2" in report and "every rank the same tokens: True" in report
    assert B.make_decoder and TP.run_tokens  # run_tokens: notebook 08 runs it


@pytest.mark.skipif(NCCL, reason="the simulator's claims (gloo CPU processes); GPUs run NCCL for real")
def test_the_simulator_replays_collectives_over_gloo_and_refuses_dtensor(every_rank):
    for r in every_rank:
        assert sum(o.startswith("c10d.allreduce") for o in r["recorded"]) == 1
        assert r["graph_collectives"] == {"all_reduce": 1, "nccl_kernels": 1}
        assert r["after_replay"] == [6.0] * 4  # 2*1 + 2*2: the replay ran the all-reduce on the new input
        assert "does not record DTensor programs" in r["dtensor"]


@pytest.mark.skipif(gpu_count() < 4, reason="needs 4 GPUs (NCCL)")
def test_tiny_fp32_tokens_at_two_and_four_gpus_equal_tp1():
    """64 greedy tokens of the tiny model in float32 at TP = 2 and 4, over NCCL, eager and captured: TP=1's."""
    kv_heads = build_model("tiny", device="cpu").config.num_key_value_heads
    for w in (2, 4):
        # parallelize_module splits whole KV heads: where the ranks outnumber them only the hand split runs
        variants = ("hand", "dtensor") if kv_heads % w == 0 else ("hand",)
        run = TP.run_tokens(TL.split_tokens, variants, world_size=w, n_tokens=64, size="tiny", timeout=200)
        for ranks in run["ranks"]:
            for r in ranks:
                assert r["eager"] == r["tp1"] == r["captured"] and r["ranks_agree"], (w, r["variant"])
                assert r["eager_all_reduces"] == r["graph_all_reduces"] == 4


@pytest.mark.skipif(not SLOW, reason="8 gloo processes (about a minute on 2 cores): set COURSE_SLOW=1")
def test_eight_ranks_replicate_kv_heads_and_still_decode_as_tp1():
    from course.core.launch import launch

    out = launch(TL.split_tokens, 8, backend="gloo", timeout=300, variants=("hand",), size=TINY8, n_tokens=6,
                 max_len=16)
    for (r,) in out:
        assert r["eager"] == r["tp1"] == r["captured"] and r["ranks_agree"] and r["graph_all_reduces"] == 4

