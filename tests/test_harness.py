"""The one check harness (course.core.harness): rules, outcomes, the tracer, the shared capture rules."""
import pytest
import torch

import course
from course.core import checks
from course.core import harness as H
from course.core.capture import collector_paused
from course.core.stream_order import FORK, JOIN


def test_judge_names_the_first_broken_rule_and_raise_gives_it_back():
    rules = [H.Rule("a", "", lambda t: ""), H.Rule("b", "rule b", lambda t: "t is " + str(t)),
             H.Rule("c", "", lambda t: "never reached")]
    out = H.judge(3, rules)
    assert (out.status, out.rule, out.message) == (H.FAIL, "b", "rule b: t is 3")
    with pytest.raises(H.Defect) as e:
        out.raise_()
    assert e.value.rule == "b" and str(e.value) == "rule b: t is 3"
    assert H.judge(3, rules[:1]) == H.Outcome(H.PASS)
    H.Outcome(H.SKIP, message="no GPU").raise_()  # a skip raises nothing
    with pytest.raises(NotImplementedError, match="todo"):
        H.Outcome(H.TODO, "not_done", "todo").raise_()


def test_expect_keeps_a_rule_while_its_test_holds_and_words_the_defect():
    rules = [H.expect("even", lambda t: t % 2 == 0, "odd"), H.expect("small", lambda t: t < 10, lambda t: f"{t} big")]
    assert H.judge(4, rules) == H.Outcome(H.PASS)
    assert (H.judge(3, rules).rule, H.judge(3, rules).message) == ("even", "odd")
    assert (H.judge(12, rules).rule, H.judge(12, rules).message) == ("small", "12 big")


def test_outcome_of_turns_each_ending_into_one_outcome():
    def defect():
        raise H.Defect("warm_up", "no warm-up ran", where="side")

    def todo():
        raise NotImplementedError("write it")

    def crash():
        raise RuntimeError("boom\nmore")

    assert H.outcome_of(lambda: 7) == (H.Outcome(H.PASS), 7)
    assert H.outcome_of(defect)[0] == H.Outcome(H.FAIL, "warm_up", "no warm-up ran", {"where": "side"})
    assert H.outcome_of(todo)[0] == H.Outcome(H.TODO, "not_done", "write it")
    assert H.outcome_of(crash)[0] == H.Outcome(H.CRASH, "crash", "RuntimeError: boom")


def test_capture_error_names_host_reads_and_copies_through_the_chain():
    try:
        try:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        except RuntimeError:
            raise RuntimeError("capture_end failed")
    except RuntimeError as e:
        assert H.capture_error(e) == ("host_read", H.HOST_READ)
        assert H.first_line(H.root_cause(e)).startswith("RuntimeError: CUDA error: operation not permitted")
    assert H.capture_error(RuntimeError("Cannot copy between CPU and CUDA tensors"))[0] == "host_copy"
    assert H.capture_error(ValueError("other")) == ("", "")


def test_exercise_logs_the_rule_of_a_defect(capsys):
    checks.reset()
    with checks.exercise("harness demo"):
        raise H.Defect("no_copy", "the next token never reached ids")
    assert checks.status("harness demo") == checks.FAIL
    assert "✗ harness demo: FAILED (the next token never reached ids)" in capsys.readouterr().out
    checks.reset()


def _capture(tracer, fn, x, *, warm="side", fork=True, join=True, gc_paused=True):
    cg = tracer.cg
    if warm == "side":
        side = cg.Stream()
        if fork:
            side.wait_stream(cg.current_stream())
        with cg.stream(side):
            fn(x)
        if join:
            cg.current_stream().wait_stream(side)
    elif warm == "default":
        fn(x)
    g = cg.CUDAGraph()
    if gc_paused:
        with collector_paused(), cg.graph(g):
            return g, fn(x)
    with cg.graph(g):
        return g, fn(x)


@pytest.mark.parametrize("how, rule, words", [
    ({}, "", ""),
    ({"warm": None}, "warm_up", "no warm-up ran"),
    ({"warm": "default"}, "warm_up", "the warm-up ran on the default stream"),
    ({"fork": False}, "stream_order", FORK[:40]),
    ({"join": False}, "stream_order", JOIN[:40]),
    ({"gc_paused": False}, "collector", "garbage collector was on"),
])
def test_capture_rules_name_each_slip(how, rule, words):
    x = torch.ones(3, device=course.device())
    with H.Tracer() as t:
        fn = t.wrap(lambda v: v * 2, "double")
        g, out = _capture(t, fn, x, **how)
    out_ = H.judge(t, H.capture_rules("double", "double(x)"))
    assert out_.rule == rule and words in out_.message
    captured = [e for e in t.of("double") if e["where"] == "capture"]
    assert captured and captured[0]["args"] == (x,) and captured[0]["output"] is out
    del g


def test_a_call_never_captured_is_named_and_the_patches_go_back():
    cg = course.graphs()
    record = cg.Event.record
    with H.Tracer() as t:
        t.wrap(lambda v: v + 1, "inc")(torch.ones(2, device=course.device()))
        assert cg.Event.record is not record
    assert cg.Event.record is record
    out = H.judge(t, H.capture_rules("inc", "inc(x)"))
    assert out.rule == "not_captured" and "inc(x) never ran inside a capture" in out.message


def test_hook_names_each_call_by_its_arguments_and_restored_puts_the_stream_back():
    model = torch.nn.Linear(3, 2).to(course.device())
    with H.Tracer() as t:
        t.hook(model, lambda a, k: f"batch {a[0].shape[0]}", rows=lambda a, k: a[0].shape[0])
        model(torch.ones(4, 3, device=course.device()))
    assert [(e["what"], e["rows"]) for e in t.events] == [("batch 4", 4)]
    cg = course.graphs()
    with pytest.raises(ZeroDivisionError):
        with H.restored():
            cg.set_stream(cg.Stream())
            1 / 0
    assert cg.current_stream() == cg.default_stream()


def _agree_worker(ctx):
    from course.core import harness as H

    mine = H.Outcome(H.PASS) if ctx.rank == 0 else H.Outcome(H.FAIL, "drift", f"rank {ctx.rank} drifted")
    return H.agree(mine, timeout_s=20.0)


def test_agree_gives_every_rank_the_first_failing_outcome_with_its_ranks():
    from course.core.launch import launch

    outs = launch(_agree_worker, 3, backend="gloo", timeout=90.0)
    assert outs[0] == outs[1] == outs[2]
    assert (outs[0].rule, outs[0].message, outs[0].detail["ranks"]) == ("drift", "rank 1 drifted", [1])
