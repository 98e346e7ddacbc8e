"""Lesson 06 §11-12 and lab 4.5: the decode loop captured by hand (GraphedDecode), lab 4.5's check,
and torch.compile(mode="reduce-overhead") made to work on transformers' Llama (ReduceOverheadStep,
the static-input diagnosis, the experiment real_model_reduce_overhead).

CPU tests run on the simulator path (the hand capture on the simulator's graphs; torch.compile with
backend="aot_eager", which needs no GPU). GPU tests, skipped without one, check what only CUDA
shows: the fixed reduce-overhead step logs no "skipping cudagraphs", launches a CUDA graph per
token, and decodes eager's tokens."""
import inspect

import pytest
import torch

import course
from course.core import checks, reference
from course.core.runtime import capturing as runtime_capturing, runtime
from course.core.timing import Timing
from course.lessons.real_model import (StaticDecoder, assert_correct, build_model, check_variants,
                                       greedy, lesson)
from course.lessons.real_model import bench as reduce_bench
from course.lessons.real_model import hand_check as lab_checks
from course.lessons.real_model.handgraph import GraphedDecode
from course.lessons.real_model.reduce_fixed import (ReduceOverheadStep, cache_sources,
                                                    describe_sources, mark_static,
                                                    static_input_diagnosis, static_input_report)

ON_GPU = runtime().on_gpu
DEV = course.device()
gpu = pytest.mark.skipif(not ON_GPU,
                         reason="needs a real GPU (torch.compile's CUDA graphs, the profiler)")
NAME = "real_model_reduce_overhead"


@pytest.fixture(scope="module")
def model():
    return build_model("tiny")


# ----------------------------------------------------------------------------- the hand capture
def test_graphed_decode_replays_eager_tokens_and_logits(model):
    hand = GraphedDecode(StaticDecoder(model, 96))
    for token, n in ((3, 64), (11, 16)):  # a second sequence on the same graph starts afresh
        first = torch.tensor([token], device=DEV)
        assert torch.equal(hand.generate(first, n), greedy(StaticDecoder(model, 96).step, first, n))
    res = check_variants({"captured by hand": hand.step}, StaticDecoder(model, 96).step,
                         torch.tensor([5], device=DEV), 16)
    assert_correct(res)
    assert res.rows[0]["tokens_equal"]
    # the simulator replays the recorded aten ops: bit for bit eager's (a GPU: within tolerance)
    if not ON_GPU:
        assert res.rows[0]["max_logit_diff"] == 0.0
    with pytest.raises(ValueError, match="n_tokens"):
        hand.generate(torch.tensor([3], device=DEV), 97)
    if not ON_GPU:  # the simulator recorded the step's aten ops, ending in the argmax
        assert "aten.argmax.default" in hand.graph.recorded_ops()


def test_a_right_loop_that_writes_token_0_s_zero_row_is_seen_writing_it():
    """A pad row of zeros (token 0's embedding) gives zero keys and values at its position, which
    lab 4.5's check cannot tell from no write: on a GPU a mask that leaves out the token's own
    position gives NaN logits, whose argmax is token 0, and the ✗ named the positions, not the
    mask. The checks' model has no zero row."""
    model = lab_checks.lab_model()
    assert model.model.embed_tokens.weight[0].any()
    assert not build_model("tiny").model.embed_tokens.weight[0].any(), "the pad row, as built"
    with lab_checks._built(GraphedDecode, StaticDecoder(model, lab_checks.MAX_LEN)) as b:
        run = lab_checks._Run(b, 0, 8)
        assert run.writes.written == list(range(8))
        assert not any(r.test(run) for r in lab_checks.RUN_RULES)


def test_lab_hand_capture_check_passes_the_course_class_and_names_a_kept_output(capsys):
    checks.reset()
    lab_checks.check_hand_capture(GraphedDecode)
    assert checks.status(lab_checks.HAND) == "pass", capsys.readouterr().out

    class KeepsTheOutput(GraphedDecode):
        def generate(self, first_ids, n_tokens, start=0):
            self.ids.copy_(first_ids.view(1, 1))
            self.pos.fill_(start)
            out = []
            for _ in range(n_tokens):
                self.graph.replay()
                out.append(self.next)  # no clone: every entry is the graph's one output tensor
                self.ids.copy_(self.next)
                self.pos.add_(1)
            return torch.cat(out, dim=1)

    lab_checks.check_hand_capture(KeepsTheOutput)
    assert checks.status(lab_checks.HAND) == "fail" and "the last one" in capsys.readouterr().out

    class BreaksBeforeTheCapture(GraphedDecode):
        def one_token(self):
            if getattr(self, "warmed", False):
                # after the warm-up, before any capture
                raise AttributeError("a slip of the learner's own")
            self.warmed = True
            return super().one_token()

    # their own error, with its line: a crash, not a ✗ of ours
    lab_checks.check_hand_capture(BreaksBeforeTheCapture)
    assert (checks.status(lab_checks.HAND) == "crash"
            and "a slip of the learner's own" in capsys.readouterr().out)
    cg = course.graphs()
    back = cg.current_stream() == cg.default_stream() and not runtime_capturing()
    assert back, "the stream must be put back"
    checks.reset()


# ----------------------------------------------------------------------------- reduce-overhead,
# fixed
def test_static_input_report_and_describe_sources():
    msgs = ["Adding static input pos 0 for source L['self']._arange",
            "Non-static input pos 1 for source L['kwargs']['input_ids']",
            "Non-static input pos 2 for source L['kwargs']['past_key_values'].layers[0].keys",
            "Non-static input pos 3 for source "
            "L['kwargs']['past_key_values'].layers[1].cumulative_length",
            "static input indices metadata analysis: [0]",
            "Adding static input pos 0 for source L['ids']", "unrelated line"]
    graphs = static_input_report(msgs)
    assert (len(graphs) == 2 and graphs[0]["static"] == ["L['self']._arange"]
            and len(graphs[0]["non_static"]) == 3)
    assert graphs[1] == {"static": ["L['ids']"], "non_static": []}
    assert cache_sources(graphs[0]["non_static"]) == graphs[0]["non_static"][1:]
    text = describe_sources(graphs[0]["non_static"])
    assert text == "keys, cumulative_length of 2 cache layers (2 tensors); input_ids", text
    assert describe_sources([]) == "none"


def test_mark_static_marks_the_cache_positions_and_buffers(model):
    dec = StaticDecoder(model, 16)
    extra = torch.zeros(1)
    n = mark_static(dec, 1, extra=(extra,))
    assert n == 3 * model.config.num_hidden_layers + 2
    layer = dec.caches[1].layers[0]
    for t in (layer.keys, layer.values, layer.cumulative_length, dec._arange, extra):
        assert getattr(t, "_dynamo_static_input_type", None) is not None


def test_static_input_diagnosis_names_the_cache_tensors(model):
    """transformers' forward recipe leaves 3 tensors per layer not static (66 on TinyLlama's 22
    layers); the fix none."""
    res = static_input_diagnosis(model)
    hf, auto, fixed = res.rows
    layers = model.config.num_hidden_layers
    assert (hf["non_static_cache_tensors"] == 3 * layers
            and "mutated inputs (6 instances)" in hf["cudagraphs"])
    assert "keys, values, cumulative_length of 2 cache layers" in hf["non_static"]
    assert (fixed["non_static_inputs"] == 0 and fixed["non_static"] == "none"
            and fixed["graphs"] == 1)
    assert auto["graphs"] >= 1 and "input_ids" in auto["non_static"]
    # on this path the eager prefill's cache is static; the GPU's verdict is what lesson 06 prints
    if not ON_GPU:
        assert auto["non_static_cache_tensors"] == 0
    gc = model.generation_config
    left = "forward" not in vars(model) and "_compiled_call" not in vars(model)
    assert left, "the model must be left as it was"
    assert gc.cache_implementation is None and gc.compile_config is None


def test_reduce_overhead_step_decodes_like_eager_without_graphs(model):
    """The wrapper itself (buffers, mark_step_begin, clone), compiled with aot_eager: runs on any
    machine."""
    step = ReduceOverheadStep(model, 64, backend="aot_eager")
    assert step.marked == 3 * model.config.num_hidden_layers + 3
    res = check_variants({"reduce-overhead (aot_eager)": step.step}, StaticDecoder(model, 64).step,
                         torch.tensor([3], device=DEV), 32)
    assert_correct(res)
    a = step.step(*step.decoder.example_args(1, 2))
    b = step.step(*step.decoder.example_args(1, 2))
    assert torch.equal(a,
                       b) and a.data_ptr() != b.data_ptr(), ("each call returns its own copy of "
                                                             "the logits")
    torch._dynamo.reset()


def test_experiment_registered_and_summaries_compare_with_fused_gemv():
    exp = reference.get(NAME)
    assert exp.gpu_only and set(exp.quick) <= set(inspect.signature(exp.fn).parameters)
    def timing(us):
        return Timing(median=us * 1e-6, q1=us * 0.99e-6, q3=us * 1.01e-6, min=us * 0.9e-6,
                      max=us * 1.1e-6, repeats=5, inner=1, clock="cuda-events")

    rows = {n: {"status": "ok", "first_call_s": 1.0, "cudagraph_skips": 0, "non_static": "none",
                "log": ""}
            for n in (reduce_bench.FAST, reduce_bench.RO, reduce_bench.RO_GEMV)}
    res = reduce_bench.reduce_result(build_model("tiny"), rows, {reduce_bench.FAST: timing(1600),
                                                                reduce_bench.RO: timing(1900),
                                                                reduce_bench.RO_GEMV: timing(1650)},
                                     None, position=5)
    assert res.name == NAME and res.rows[1]["vs_fused_gemv"] == pytest.approx(1900 / 1600)
    assert res.value("best reduce-overhead") == reduce_bench.RO_GEMV
    assert res.value("best reduce-overhead / fused + GEMV") == pytest.approx(1650 / 1600)
    assert res.value("within 1.2x of fused + GEMV") == "yes"
    assert res.value(f"{reduce_bench.RO} / {reduce_bench.FAST}") == pytest.approx(1900 / 1600)


def test_reduce_overhead_result_is_recorded_or_awaits_its_first_recording(capsys):
    res = lesson.gpu_result(NAME)
    if res is None:
        assert "awaits its first recording" in capsys.readouterr().out and not ON_GPU
    else:
        assert res.rows and {r["variant"] for r in res.rows} >= {reduce_bench.FAST, reduce_bench.RO}


# ----------------------------------------------------------------------------- GPU
@gpu
def test_gpu_fixed_reduce_overhead_records_a_graph_per_token_and_decodes_like_eager():
    from torch._dynamo.utils import counters

    from course.core.compiled import torch_log_messages
    from course.core.profiling import launch_counts

    m = build_model("tiny", device="cuda")
    torch._dynamo.reset()
    counters.clear()
    # the log does catch a skip
    with torch_log_messages(cudagraphs=True, perf_hints=True) as control:
        f = torch.compile(lambda x: x.add_(1) * 2, mode="reduce-overhead")
        for _ in range(3):
            f(torch.ones(8, device="cuda"))
    assert any("skipping cudagraphs" in c for c in control), control
    torch._dynamo.reset()
    counters.clear()
    with torch_log_messages(cudagraphs=True, perf_hints=True, cudagraph_static_inputs=True) as msgs:
        step = ReduceOverheadStep(m, 64)
        args = step.decoder.example_args(1, 5)
        for _ in range(4):  # warm-up, recording, replays
            step.step(*args)
        torch.cuda.synchronize()
    skips = [x for x in msgs if "skipping cudagraph" in x.lower()]
    assert not skips and counters["inductor"]["cudagraph_skips"] == 0, skips
    graphs = static_input_report(msgs)
    assert graphs and graphs[-1]["non_static"] == [], (graphs[-1:]
                                                       or "torch logged no static-input analysis")
    counts = launch_counts(lambda: step.step(*args))
    assert counts["graph_launches"] >= 1, counts
    res = check_variants({"reduce-overhead, fixed": step.step}, StaticDecoder(m, 64).step,
                         torch.tensor([3], device="cuda"), 64)
    assert_correct(res)
    assert res.rows[0]["tokens_equal"]
    torch._dynamo.reset()


@gpu
def test_gpu_graphed_decode_launches_one_graph_per_token():
    from course.core.profiling import launch_counts

    m = build_model("tiny", device="cuda")
    hand = GraphedDecode(StaticDecoder(m, 64))
    args = hand.decoder.example_args(1, 3)
    with torch.no_grad():
        counts = launch_counts(lambda: hand.step(*args))
    assert counts["graph_launches"] == 1, counts


@gpu
def test_gpu_reduce_overhead_experiment_quick_run():
    exp = reference.get(NAME)
    res = exp.fn(**exp.quick, log=lambda *_: None)
    rows = {r["variant"]: r for r in res.rows}
    assert set(rows) == {reduce_bench.FAST, reduce_bench.RO, reduce_bench.RO_GEMV,
                         reduce_bench.RO_HAND}
    for name, r in rows.items():
        assert r["status"] == "ok" and r["correct"] is True and r["us"] > 0, (name, r)
        assert r["graphs_per_token"] >= 1, (name, r)
    for name in (reduce_bench.RO, reduce_bench.RO_GEMV):
        assert rows[name]["cudagraph_skips"] == 0 and rows[name]["non_static"] == "none", rows[name]
    assert res.value("best reduce-overhead / fused + GEMV") > 0
