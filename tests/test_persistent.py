"""The persistent step (course.lessons.last_mile.persistent, persistent_decoder, coop, bench): one
launch per token with grid barriers, against the five-kernel step and transformers, and the
co-operating interpreter's race and deadlock finding (exercise 07.3's check: test_last_mile_checks).
On the simulator path the kernels run under Triton's interpreter; GPU tests at the end."""
import dataclasses
import faulthandler
import inspect

import pytest
import torch

import course
from course.core import triton_path as TP
from course.core.results import Result
from course.core.runtime import runtime
from course.lessons.last_mile import bench, coop
from course.lessons.last_mile.decoder import TritonDecoder, config_for, graphed
from course.lessons.last_mile.persistent_decoder import (PersistentDecoder, persistent_config,
                                                         resident_per_sm)
from course.lessons.last_mile.shapes import build_shape
from course.lessons.real_model import StaticDecoder, build_model, check_variants, greedy

ON_GPU = runtime().on_gpu
DEV = course.device()
AVAILABLE = TP.available()
needs_triton = pytest.mark.skipif(not AVAILABLE, reason=TP.missing_reason() or "triton")
laptop = pytest.mark.skipif(ON_GPU or not AVAILABLE, reason="the co-operating interpreter's path")
gpu = pytest.mark.skipif(not (ON_GPU and AVAILABLE), reason="needs a GPU with Triton")

if AVAILABLE:
    tr = TP.triton()
    import triton.language as tl

    from course.lessons.last_mile import kernels, persistent
    from course.lessons.last_mile.kernels import rows_pre
    from course.lessons.last_mile.persistent import _proj_tiles, grid_sync

    @tr.jit
    def sync_none(bar_ptr, nprog, limit):
        return limit

    @tr.jit
    def sync_one_more(bar_ptr, nprog, limit):
        return grid_sync(bar_ptr, nprog + 1, limit)

    @tr.jit
    def one_program_walks_the_tiles(a_ptr, w_ptr, x_ptr, N: tl.constexpr, K: tl.constexpr,
                                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        wa, wb = rows_pre(0, w_ptr, N, K, 2, BLOCK_N, BLOCK_K, 0)
        _proj_tiles(0, 1, wa, wb, a_ptr, w_ptr, x_ptr, N, K, 2, BLOCK_N, BLOCK_K)


@pytest.fixture(scope="module")
def tiny():
    return build_model("tiny")


# ----------------------------------------------------------------------------- the persistent step
@laptop
def test_persistent_step_matches_the_five_kernel_step_with_no_race(tiny):
    eager, five = StaticDecoder(tiny, 64), TritonDecoder(tiny, 64)
    per = PersistentDecoder(tiny, 64, watch=True)
    assert per.kernels_per_token == 1 and per.programs == 3
    for p in (0, 5):
        ids, pos = eager.example_args(1, p, seed=p)
        want = eager.step(ids, pos)
        a, b = five.step(ids, pos).clone(), per.step(ids, pos).clone()
        assert (b - want).abs().max() <= 1e-5 * want.abs().max()
        assert (a - b).abs().max() <= 1e-5 * a.abs().max()
        t = per.last_trace()
        assert t.ok and not t.deadlock, [str(r) for r in t.races]
        barriers = 1 + 5 * tiny.config.num_hidden_layers
        assert min(t.atomics) >= 2 * barriers, "each program reads the generation, then arrives"
        assert torch.allclose(per.k_cache[:, :, p], five.k_cache[:, :, p], atol=1e-6)
    assert int(per.bar[0]) == 0 and int(per.bar[1]) == 2 * (1 + 5 * tiny.config.num_hidden_layers)
    per.check()


@laptop
def test_persistent_step_greedy_tokens_equal_on_an_odd_tied_shape():
    model = build_shape("tiny-tied")
    first = torch.tensor([11], device=DEV)
    want = greedy(StaticDecoder(model, 64).step, first, 3)
    assert torch.equal(greedy(PersistentDecoder(model, 64, programs=2).step, first, 3), want)


@laptop
@pytest.mark.parametrize("sync", ["sync_none", "sync_one_more"])
def test_a_broken_barrier_in_the_step_is_a_race_or_a_deadlock(tiny, monkeypatch, sync):
    """The step's own barrier replaced: one that waits for nobody lets a stage read rows not yet
    written; one that waits for one program more never opens (ended, and the check says so)."""
    per = PersistentDecoder(tiny, 32, watch=True)
    monkeypatch.setattr(persistent, "grid_sync", globals()[sync])
    per.step(*StaticDecoder(tiny, 32).example_args(1, 3))
    t = per.last_trace()
    if sync == "sync_none":
        assert not t.ok and not t.deadlock, t.races[:3]
        assert t.races[0].kind == "read before its write", t.races[:3]
        assert "without waiting for program" in str(t.races[0])
        per.check()  # no barrier, no timeout: only the race finder sees it
    else:
        assert t.deadlock
        with pytest.raises(RuntimeError, match="never opened"):
            per.check()


def test_resident_per_sm_and_persistent_config():
    h100 = {"max_num_regs": 65536, "max_threads": 2048, "max_shared_mem": 232448}
    assert resident_per_sm(247, 4096, 8, h100) == 1  # 248 x 32 x 8 warps = 63,488 of 65,536
    assert resident_per_sm(126, 4096, 16, h100) == 1
    assert resident_per_sm(64, 4096, 4, h100) == 8  # by registers
    assert resident_per_sm(64, 100_000, 4, h100) == 2  # by shared memory
    assert resident_per_sm(255, 300_000, 8, h100) == 0
    c = persistent_config(2048, 5632, 64, 32000)
    assert c.o.rows * 128 == 2048 and c.down.depth == 2 and not c.packed
    assert persistent_config(64, 176, 16, 512, interpret=True).block_t == 16


@needs_triton
def test_persistent_decoder_refuses_what_it_cannot_run(tiny):
    cfg = persistent_config(64, 176, 16, 512, interpret=not ON_GPU)
    cfg = dataclasses.replace(cfg, packed=True)
    with pytest.raises(ValueError, match="own weights"):
        PersistentDecoder(tiny, 32, config=cfg)
    with pytest.raises(ValueError, match="one sequence"):
        PersistentDecoder(tiny, 32).step(*StaticDecoder(tiny, 32).example_args(2, 0))
    per = PersistentDecoder(tiny, 32)
    per.bar[2] = 1
    with pytest.raises(RuntimeError, match="never opened"):
        per.check()


# ----------------------------------------------------------------------------- GPU
@gpu
def test_persistent_step_on_the_gpu_in_a_graph(tiny):
    per = PersistentDecoder(tiny, 64)
    assert per.programs <= per.sms * per.per_sm
    ids, pos = StaticDecoder(tiny, 64).example_args(1, 3)
    step = graphed(per, ids, pos)
    res = check_variants({"persistent": step}, StaticDecoder(tiny, 64).step,
                         torch.tensor([11], device=DEV), 16)
    per.check()
    assert res.rows[0]["ok"], res.rows[0]
    with pytest.raises(ValueError, match="resident"):
        PersistentDecoder(tiny, 64, programs=per.sms * per.per_sm + 1)


# ---------------------------------------------------------------- options that earn their place
def _positions(rows):
    from course.lessons.last_mile.sweeps import COLUMNS

    out = []
    for p, plain, split in rows:
        for v, (q1, med, q3) in (("+ packed weights", plain), ("+ split-KV attention", split)):
            out.append({**{k: float("nan") for k in COLUMNS}, "positions": str(p), "variant": v,
                        "us": med, "q1_us": q1, "q3_us": q3})
    return Result("last_mile_positions", "t", COLUMNS, out)


def test_split_kv_from_reads_the_threshold_from_a_recording(tiny):
    from course.lessons.last_mile.sweeps import split_kv_from

    rec = _positions([(32, (820, 827, 835), (845, 852, 860)),
                      (512, (1280, 1295, 1310), (1060, 1067, 1075)),
                      (2048, (2840, 2850, 2860), (1130, 1135, 1140))])
    assert split_kv_from(rec) == 512
    noise = _positions([(32, (820, 827, 835), (815, 822, 830))])
    assert split_kv_from(noise) is None, "inside the spread: noise"
    assert split_kv_from(_positions([(32, (820, 827, 835), (845, 852, 860))])) is None
    for pos, on in ((32, False), (511, False), (512, True), (2048, True)):
        cfg = config_for(tiny, split_kv="auto", position=pos, split_kv_from=512, interpret=False)
        assert bool(cfg.kv_chunk) == on, pos
    assert not config_for(tiny, split_kv="auto", position=4096, split_kv_from=None,
                          interpret=False).kv_chunk
    with pytest.raises(ValueError, match="auto"):
        config_for(tiny, split_kv="yes")


def test_timeline_plot_keeps_the_kernels_readable_beside_one_long_launch():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from course.lessons.last_mile.lesson import plot_timeline

    rows = [{"variant": "Triton", "index": i, "layer": 0, "kernel": "proj", "start_us": 3.0 * i,
             "end_us": 3.0 * i + 2.0} for i in range(12)]
    rows.append({"variant": "persistent", "index": 0, "layer": -1, "kernel": "persistent",
                 "start_us": 0.0, "end_us": 500.0})
    fig, ax = plt.subplots()
    plot_timeline(ax, Result("last_mile_timeline", "t", {}, rows), last_index=10)
    assert ax.get_xlim()[1] < 40, "the one long launch runs off the edge, the kernels stay wide"
    assert any("1 kernel (the whole step)" in t.get_text() for t in ax.texts)
    plt.close(fig)


def _answer(step, prompt, n: int):
    """Greedy tokens after ``prompt`` ([1, L]) through ``step``: the prompt fed one token per step
    (its K/V written by the step itself), then ``n`` tokens; also each answer step's logits."""
    toks, logits = [], []
    pos = torch.zeros(1, dtype=torch.long, device=prompt.device)
    for i in range(prompt.shape[1] - 1):
        pos.fill_(i)
        step(prompt[:, i:i + 1], pos)
    ids = prompt[:, -1:]
    for i in range(n):
        pos.fill_(prompt.shape[1] - 1 + i)
        out = step(ids, pos)
        logits.append(out[0].clone())
        ids = out.argmax(-1).view(1, 1)
        toks.append(int(ids))
    return toks, logits


@gpu
def test_trained_smollm2_answers_the_chat_prompt_as_the_five_kernel_step_does():
    """Lesson 06's chat prompt, SmolLM2-135M-Instruct (bfloat16): the persistent step's answer is
    the five-kernel step's, token for token (a difference only where the five-kernel step's two
    candidates are within bfloat16's spacing: a near-tie any change of summation order may flip)."""
    from course.lessons.real_model.chat import chat_ids
    from course.lessons.real_model.checkpoint import load_trained

    t = load_trained(log=lambda *a: None)
    prompt = chat_ids(t.tokenizer, device=DEV)
    zero = (prompt[:, :1], torch.zeros(1, dtype=torch.long, device=DEV))
    per = PersistentDecoder(t.model, 256)
    five, fast = graphed(TritonDecoder(t.model, 256, pdl=True), *zero), graphed(per, *zero)
    want, want_logits = _answer(five, prompt, 24)
    got, _ = _answer(fast, prompt, 24)
    per.check()
    same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
    if same < len(want):
        row = want_logits[same]
        gap = float(row[want[same]] - row[got[same]])
        assert gap <= 2.0 ** (float(row[want[same]].abs().log2().floor()) - 7), \
            f"token {same}: {t.tokenizer.decode(got)!r} vs {t.tokenizer.decode(want)!r} (gap {gap})"
    print(t.tokenizer.decode(got))


def test_probe_and_coop_refuse_the_wrong_path(monkeypatch):
    if not ON_GPU:
        cancelled = []
        real = faulthandler.cancel_dump_traceback_later
        monkeypatch.setattr(faulthandler, "cancel_dump_traceback_later",
                            lambda: (cancelled.append(1), real()))
        assert bench.main(["--shapes", "tiny-tied", "--limit", "60"]) == 2  # it needs a GPU
        assert cancelled, "the probe's watchdog outlived its refusal: it would end its caller later"
    with pytest.raises(TypeError, match="interpreter"):
        coop.run(lambda: None, 2)
    r = coop.Race("h", 3, "read before its write", 0, 2)
    assert str(r) == "program 0 read h[3] without waiting for program 2's write of it"
    assert r.reader == 0 and coop.Race("h", 3, "write over an unordered read", 1, 0).reader == 0


STAGES = ("embed_tile", "qkv_pre", "qkv_run", "attention_tile", "rows_pre", "proj_run",
          "gate_up_pre", "gate_up_run", "lm_head_run")


@needs_triton
def test_both_steps_run_the_same_stage_functions():
    """No near-copies: every stage function of kernels.py is called by a five-kernel kernel and by
    the persistent kernel."""
    five = "".join(inspect.getsource(getattr(kernels, k).fn) for k in (
        "embed", "norm_qkv_rope", "attention", "proj_residual", "norm_gate_up", "norm_lm_head"))
    one = inspect.getsource(persistent)
    for name in STAGES:
        assert f"{name}(" in five and f"{name}(" in one, name


@needs_triton
def test_one_program_walking_every_tile_with_the_next_prefetched():
    """The persistent step's _proj_tiles: one program, every tile, the next tile's weights loaded
    before the current tile's product is stored; the last prefetch (past the rows) reads nothing."""
    g = torch.Generator().manual_seed(6)
    w, a = torch.randn(40, 72, generator=g), torch.randn(72, generator=g)
    x = torch.randn(40, generator=g)
    xd = x.clone().to(DEV)
    one_program_walks_the_tiles[(1,)](a.to(DEV), w.to(DEV), xd, 40, 72, BLOCK_N=16, BLOCK_K=32)
    assert torch.allclose(xd.cpu(), x + w @ a, atol=1e-4)


@gpu
def test_probe_shape_on_a_tiny_shape():
    rows = bench.probe_shape("tiny-tied", 3, 4, 3, bw=1000.0, first=True, deadline=float("inf"),
                             log=lambda *a: None)
    assert {r["candidate"] for r in rows} >= {bench.FIVE, "persistent",
                                             "persistent, loads after the barrier"}
    assert all(r["correct"] and r["status"] == "ok" for r in rows), rows
    assert next(r for r in rows if r["candidate"] == "persistent")["launches"] == 1
