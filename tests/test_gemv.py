"""The batch-1 GEMV (Numba), its custom op, GemvLinear, fused projections and the twin model; GPU
parts skip without one."""
import pytest
import torch

import course
from course.lessons.real_model import StaticDecoder, build_model
from course.lessons.real_model import gemv as G
from course.lessons.real_model.bench_sweep import (IMPLS, L2_FACTOR, copies_for_l2, gemv_result, gemv_row,
                                                  graph_of_calls, shapes_of)
from course.lessons.real_model.projections import fuse_projections, gemv_model

DEV = course.device()
GPU = pytest.mark.skipif(not course.runtime().on_gpu, reason="needs a GPU")


@pytest.mark.parametrize("dtype,n,k",
                         [(torch.float32, 12, 64), (torch.bfloat16, 9, 64),
                          (torch.float32, 5, 1032),
                                       (torch.bfloat16, 3, 1040)])
def test_gemv_matches_linear(dtype, n, k):
    """Small shapes (the simulator runs every thread in Python); 1032 and 1040 take the unrolled
    loop and its tail."""
    g = torch.Generator().manual_seed(n)
    w = torch.randn(n, k, generator=g).to(dtype).to(DEV)
    x = torch.randn(1, 1, k, generator=g).to(dtype).to(DEV)
    y = G.gemv(x, w)
    ref = torch.nn.functional.linear(x.float(), w.float())
    assert y.shape == (1, 1, n) and y.dtype == dtype
    # bf16: the output is rounded to 8 bits of mantissa
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert (y.float() - ref).abs().max().item() <= tol * ref.abs().max().item() + 1e-6


def test_gemv_bf16_rounds_to_nearest_even():
    """One row of ones times values whose sum needs rounding: the kernel's bf16 equals torch's
    rounding of the sum."""
    w = torch.ones(1, 8, dtype=torch.bfloat16, device=DEV)
    for vals in ([1.0, 2 ** -8, 0, 0, 0, 0, 0, 0], [1.0, 3 * 2 ** -9, 0, 0, 0, 0, 0, 0],
                 [-3.0, -2 ** -7, 0, 0, 0, 0, 0, 0]):
        x = torch.tensor([vals], dtype=torch.bfloat16, device=DEV)
        want = torch.tensor([sum(x[0].float().tolist())], dtype=torch.float32).to(torch.bfloat16)
        assert G.gemv(x, w).cpu().view(-1)[0] == want[0], vals


def test_eligible_and_gemv_name_what_to_change():
    assert G.eligible(torch.zeros(1, 64), torch.zeros(8, 64)) == ""
    assert "one row" in G.eligible(torch.zeros(2, 64), torch.zeros(8, 64))
    assert "16-byte" in G.eligible(torch.zeros(1, 63), torch.zeros(8, 63))
    assert "share a dtype" in G.eligible(torch.zeros(1, 64),
                                         torch.zeros(8, 64, dtype=torch.float64))
    assert "2-D" in G.eligible(torch.zeros(1, 64), torch.zeros(64))
    with pytest.raises(ValueError, match="F.linear|functional.linear"):
        G.gemv(torch.zeros(2, 64, device=DEV), torch.zeros(8, 64, device=DEV))
    with pytest.raises(ValueError, match="contiguous"):
        G.gemv(torch.zeros(1, 64, device=DEV), torch.zeros(64, 16, device=DEV).t())
    with pytest.raises(TypeError, match="GEMV kernel takes"):
        G.kernel(torch.float16)


def test_custom_op_and_its_fake_shape():
    x, w = torch.randn(1, 64, device=DEV), torch.randn(4, 64, device=DEV)
    assert torch.allclose(G.OP(x, w), x @ w.T, atol=1e-5)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fx, fw = mode.from_tensor(x), mode.from_tensor(w)
        assert G.OP(fx, fw).shape == (1, 4)


def test_gemv_linear_routes_one_row_to_the_gemv_and_more_to_cublas(monkeypatch):
    lin = torch.nn.Linear(64, 8, bias=True).to(DEV)
    lin.__class__ = G.GemvLinear
    calls = []
    real = G.OP
    monkeypatch.setattr(G, "OP", lambda x, w: calls.append(x.shape) or real(x, w))
    x1, x2 = torch.randn(1, 1, 64, device=DEV), torch.randn(3, 1, 64, device=DEV)
    with torch.no_grad():
        ref1, ref2 = (torch.nn.functional.linear(x1, lin.weight, lin.bias),
                      torch.nn.functional.linear(x2, lin.weight, lin.bias))
        assert torch.allclose(lin(x1), ref1, atol=1e-5) and torch.allclose(lin(x2), ref2, atol=1e-6)
    assert calls == [(1, 1, 64)]


def test_linear_shapes_and_shapes_of_agree_with_the_model():
    model = build_model("tiny", device="cpu")
    got = {(n, k): c for n, k, c in G.linear_shapes(model)}
    assert got == {(64, 64): 4, (32, 64): 4, (176, 64): 4, (64, 176): 2, (512, 64): 1}
    want = {(n, k): c for n, k, c, what in shapes_of("tiny") if not what.startswith("stacked")}
    assert want == {(64, 64): 4, (32, 64): 4, (176, 64): 4, (64, 176): 2, (512, 64): 1}
    assert [w for *_, w in shapes_of("tinyllama")][-2:] == ["stacked q/k/v", "stacked gate/up"]


def test_gemv_model_shares_weights_and_fused_projections_compute_the_same():
    """The twin shares every weight it keeps; its stacked products give the same logits (batch 3:
    the cuBLAS route, fast on the simulator; the GEMV route is checked above and on the GPU
    below)."""
    model = build_model("tiny")
    twin = gemv_model(model, fuse=True)
    kept = {id(p) for p in model.parameters()}
    assert all(id(p) in kept for n, p in twin.named_parameters() if "qkv" not in n
               and "gate_up" not in n)
    attn, mlp = twin.model.layers[0].self_attn, twin.model.layers[0].mlp
    assert type(attn).__name__ == "FusedAttention" and type(mlp).__name__ == "FusedMLP"
    assert not hasattr(attn, "q_proj") and hasattr(model.model.layers[0].self_attn, "q_proj")
    assert attn.qkv_weight.shape == (64 + 2 * 32, 64) and mlp.gate_up_weight.shape == (2 * 176, 64)
    assert type(twin.lm_head) is G.GemvLinear and type(model.lm_head) is torch.nn.Linear
    a, b = StaticDecoder(model, 16), StaticDecoder(twin, 16)
    args = a.example_args(3, position=2)
    with torch.no_grad():
        assert (a.step(*args) - b.step(*args)).abs().max().item() < 1e-5
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        fuse_projections(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    with pytest.raises(ValueError, match="no nn.Linear"):
        gemv_model(torch.nn.Sequential(torch.nn.ReLU()), fuse=False)


@GPU
def test_gpu_gemv_model_batch1_in_a_graph_matches_eager():
    """On the GPU: the twin's batch-1 step (Numba GEMV, stacked projections) captured by the cache,
    against eager."""
    from course.lessons.real_model import graph_cached

    model = build_model("tiny")
    twin = gemv_model(model)
    eager, fast = StaticDecoder(model, 32), graph_cached(StaticDecoder(twin, 32), fusion=True)
    args = eager.example_args(1, position=3)
    with torch.no_grad():
        want = eager.step(*args)
        got = fast(*args)
        got = fast(*args)
    assert fast.get_stats()["fusion_modes"] and (got - want).abs().max().item() < 1e-4


def test_copies_fill_the_l2_several_times_and_at_least_two():
    l2 = 50 * 2 ** 20
    assert copies_for_l2(23_068_672, l2) == 10  # 4 x 50 MiB in 22 MiB matrices: 9.1, rounded up
    assert copies_for_l2(23_068_672, l2) * 23_068_672 >= L2_FACTOR * l2
    # larger than the L2: still two copies, never one read twice in a row
    assert copies_for_l2(10 ** 9, l2) == 2
    with pytest.raises(ValueError, match="positive"):
        copies_for_l2(0, l2)


def _timing(us):
    from course.core.timing import Timing

    return Timing(us * 1e-6, us * 0.9e-6, us * 1.1e-6, us * 0.8e-6, us * 1.2e-6, 3, 1,
                  "cuda-events")


def test_gemv_row_and_result_divide_one_replay_by_its_copies():
    t = {"cuBLAS": _timing(100.0), "Numba GEMV": _timing(80.0)}
    row = gemv_row(2048, 2048, 44, "q_proj, o_proj", t, copies=10, rel_diff=1e-3)
    assert row["cuBLAS us"] == pytest.approx(10.0) and row["Numba GEMV q3 us"] == pytest.approx(8.8)
    assert row["MB"] == pytest.approx(2048 * 2048 * 2 / 1e6)
    # bytes / us -> GB/s
    assert row["Numba GEMV GB/s"] == pytest.approx(2048 * 2048 * 2 / 8.0 / 1e3)
    stacked = gemv_row(2560, 2048, 22, "stacked q/k/v", t, copies=5, rel_diff=0.0)
    res = gemv_result([row, stacked], "tinyllama", 3, 50 * 2 ** 20)
    assert (res.name == "real_model_gemv"
            and [r["what"] for r in res.rows] == ["q_proj, o_proj", "stacked q/k/v"])
    # stacked left out
    assert res.value("cuBLAS us per token (separate projections)") == pytest.approx(44 * 10.0)
    assert res.value("Numba GEMV us per token (separate projections)") == pytest.approx(44 * 8.0)
    assert res.params["l2_factor"] == L2_FACTOR and set(IMPLS) == {"cuBLAS", "Numba GEMV"}
    with pytest.raises(ValueError, match="missing"):
        gemv_row(8, 8, 1, "x", {"cuBLAS": _timing(1.0)}, copies=2, rel_diff=0.0)


def test_real_model_gemv_stands_in_lesson_06s_cell():
    import inspect

    from course.core import cells, reference
    from course.tools import catalog

    exp = reference.get("real_model_gemv")
    assert exp.gpu_only and exp.quick == {"size": "tiny", "repeats": 3}
    assert exp.fn.__module__ == cells.module_name(catalog.ROOT / "solutions/06_real_model.ipynb")
    assert "time_interleaved(" in inspect.getsource(exp.fn)
    if not course.runtime().on_gpu:
        with pytest.raises(Exception, match="needs a real GPU"):
            exp.fn(**exp.quick)


@GPU
def test_gpu_gemv_experiment_quick():
    from course.core import reference

    res = reference.run("real_model_gemv", **reference.get("real_model_gemv").quick)
    assert res.live and len(res.rows) == len(shapes_of("tiny"))
    assert all(r["rel_diff"] < 1e-3 and r["Numba GEMV us"] > 0 and r["cuBLAS us"] > 0
               for r in res.rows)


@GPU
def test_gpu_graph_of_calls_replays_one_call_per_weight():
    x = torch.ones(1, 1, 16, device="cuda", dtype=torch.bfloat16)
    weights = [torch.full((4, 16), float(i), device="cuda", dtype=torch.bfloat16) for i in range(3)]
    outs = []
    g = graph_of_calls(lambda x, w: outs.append(torch.nn.functional.linear(x, w)), x, weights)
    # the last three calls ran inside the capture: their outputs are the graph's
    captured = outs[-3:]
    for o in captured:
        o.fill_(-1.0)
    g.replay()
    torch.cuda.synchronize()
    assert [o.float().max().item() for o in captured] == [0.0, 16.0, 32.0]


@GPU
def test_gpu_gemv_twin_decodes_64_greedy_tokens_like_eager_in_float32():
    """The issue's correctness target for the fastest variant: 64 greedy tokens, tiny float32 model,
    exactly eager's."""
    from course.lessons.real_model import check_variants, graph_cached

    model = build_model("tiny")
    fast = graph_cached(StaticDecoder(gemv_model(model), 80), buckets=[1], fusion=True)
    first = torch.tensor([11], device=DEV)
    res = check_variants({"fused + GEMV": fast}, StaticDecoder(model, 80).step, first, 64)
    row = res.rows[0]
    assert row["tokens_equal"] and row["ok"], row
