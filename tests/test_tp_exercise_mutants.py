"""Exercise 08.1's check against the answer's right and wrong variants, every one judged in ONE launch of the ranks.

Each wrong variant is one plausible learner mistake, written as edits of the answer cell; its check must name it
(the kind and the start of the message below), the same on every rank, within seconds. The right variants (the next
token chosen inside or outside the graph; a warm-up of three steps on the capture's own side stream, captured with
capture_begin/capture_end) must pass. On a machine with 2+ GPUs the same launch runs over NCCL
(``COURSE_PATH=cuda python -m pytest tests/test_tp_exercise_mutants.py``).
"""
import time

import pytest

from cellrun import apply_edits
from course.lessons.tensor_parallel import referee as R

WARM = ("        for _ in range(2):  # NCCL's communicator and buffers made here, every all-reduce run eagerly "
        "first\n")
CAPTURE = ("    with cg.graph(graph):  # the same code on every rank\n"
           "        nxt = step(ids, position).argmax(-1, keepdim=True)  # whole logits: the same token on every rank\n")
REPLAY = "        graph.replay()  # every rank, every token\n"
EAGER_LOOP = ("    out = []\n    for _ in range(n_tokens):\n        nxt = step(ids, position).argmax(-1, keepdim=True)\n"
              "        out.append(nxt.clone())\n        ids.copy_(nxt)\n        position.add_(1)\n"
              "    return torch.cat(out, dim=1)\n")
ANSWER_BODY_START = "    side = cg.Stream()\n"

RIGHT = [
    ("the answer", []),
    ("the next token chosen outside the graph",
     [(CAPTURE, "    with cg.graph(graph):\n        logits = step(ids, position)\n"),
      (REPLAY, REPLAY + "        nxt = logits.argmax(-1, keepdim=True)\n")]),
    ("three warm-ups on the capture's own side stream, capture_begin/capture_end",
     [(WARM, "        for _ in range(3):\n"),
      ("    cg.current_stream().wait_stream(side)\n    graph = cg.CUDAGraph()\n" + CAPTURE,
       "        graph = cg.CUDAGraph()\n        graph.capture_begin()\n"
       "        nxt = step(ids, position).argmax(-1, keepdim=True)\n        graph.capture_end()\n"
       "    cg.current_stream().wait_stream(side)\n")]),
]

# (name, edits of the answer cell, the kind of ✗ its check must give, words its message must hold)
WRONG = [
    ("no graph at all: the eager step in a loop", [("    ### BEGIN SOLUTION\n", "    ### BEGIN SOLUTION\n" +
                                                    EAGER_LOOP)], "no_graph", "captured no graph"),
    ("captures, then calls the eager step per token", [(REPLAY, "        nxt = step(ids, position).argmax(-1, "
                                                                "keepdim=True)\n")], "eager_after_capture",
     "called step(ids, position) eagerly"),
    ("no warm-up", [(WARM + "            step(ids, position)\n", "        pass\n")], "warm_up", "no warm-up ran"),
    ("warm-up on the default stream", [("    with cg.stream(side):\n", "    if True:\n")], "warm_up",
     "the warm-up ran on the default stream"),
    ("warm-up on rank 0 only", [(WARM, "        for _ in range(2 if ctx.rank == 0 else 0):\n")], "warm_up_one_rank",
     "without any warm-up"),
    ("more warm-up steps on rank 0", [(WARM, "        for _ in range(3 if ctx.rank == 0 else 2):\n")],
     "warm_up_count", "the same number of warm-up steps"),
    ("rank 0 captures while rank 1 runs the step eagerly",
     [(CAPTURE, "    if ctx.rank == 0:\n        with cg.graph(graph):\n"
                "            nxt = step(ids, position).argmax(-1, keepdim=True)\n"
                "    else:\n        nxt = step(ids, position).argmax(-1, keepdim=True)\n")], "capture_one_rank",
     "began capturing the step while rank(s) [1] ran it eagerly"),
    ("rank 0 captures another branch", [("    with cg.graph(graph):  # the same code on every rank\n",
                                         "    with cg.graph(graph):\n        if ctx.rank == 0:\n"
                                         "            step(ids, position)\n")], "branch", "same code path"),
    ("replay on rank 0 only", [(REPLAY, "        if ctx.rank == 0:\n            graph.replay()\n")], "one_rank",
     "replayed on every rank"),
    ("rank 0 alone feeds its token back", [("        ids.copy_(nxt)\n", "        if ctx.rank == 0:\n"
                                            "            ids.copy_(nxt)\n")], "drift", "static inputs differ"),
    ("the token not copied into ids", [("        ids.copy_(nxt)\n", "")], "no_copy", "ids.copy_(nxt)"),
    ("ids rebound to the next token", [("        ids.copy_(nxt)\n", "        ids = nxt\n")], "rebound",
     "`ids` named a new tensor"),
    ("the position never advances", [("        position.add_(1)\n", "        pass\n")], "no_advance",
     "position.add_(1)"),
    ("the graph's output kept, not cloned", [("out.append(nxt.clone())", "out.append(nxt)")], "no_clone",
     "out.append(nxt.clone())"),
    ("an error on rank 1 only", [("    graph = cg.CUDAGraph()\n", "    graph = cg.CUDAGraph()\n"
                                  "    [0, 1][ctx.rank * 5]\n")], "crash", "rank 1: IndexError"),
    ("a host read inside the capture", [(CAPTURE, CAPTURE + "        print('next token', nxt.item())\n")],
     "host_sync", "a host read or a wait inside the capture"),
]


def answer_cell(folder: str = "solutions") -> str:
    """The source of exercise 08.1's cell in ``folder``'s notebook 08."""
    import json
    from pathlib import Path

    nb = json.loads((Path(__file__).resolve().parent.parent / folder / "08_tensor_parallel.ipynb").read_text())
    return next("".join(c["source"]) for c in nb["cells"] if "def tp_generate" in "".join(c["source"]))


def cell_function(source: str, label: str):
    """The cell's tp_generate, carried as source to the ranks (as a notebook cell's worker travels)."""
    from course.core.cell_workers import CellWorker

    return CellWorker("tp_generate", source, f"<08 answer, {label}>")


@pytest.fixture(scope="module")
def judged():
    """Every variant judged on every rank, in one launch (the host read last: on a GPU it is the roughest)."""
    from course.core.launch import launch, plan
    from course.lessons.tensor_parallel.exercise import exercise_worker

    src = answer_cell()
    fns = [cell_function(apply_edits([src], edits, name)[0], name) for name, edits in RIGHT]
    fns += [cell_function(apply_edits([src], edits, name)[0], name) for name, edits, _, _ in WRONG]
    fns.append(cell_function(answer_cell("notebooks"), "learner version"))
    p = plan(2)
    t0 = time.monotonic()
    out = launch(exercise_worker, 2, backend=p.backend, timeout=300, pg_timeout=60, fns=fns)
    return out, time.monotonic() - t0


def test_the_right_variants_pass(judged):
    out, _ = judged
    for (name, _), res in zip(RIGHT, out[0]):
        assert res["ok"] and len(res["tokens"]) == 6, (name, res)


@pytest.mark.parametrize("i", range(len(WRONG)), ids=[w[0] for w in WRONG])
def test_each_wrong_variant_gets_its_named_cross_on_every_rank(judged, i):
    out, _ = judged
    name, _, kind, words = WRONG[i]
    res = [rank[len(RIGHT) + i] for rank in out]
    assert not res[0]["ok"] and res[0]["kind"] == kind, (name, res[0])
    assert res[0]["message"].startswith(R.TITLES[kind]) and words in res[0]["message"], (name, res[0]["message"])
    assert res[1]["kind"] == kind, (name, res[1])  # every rank, the same verdict


def test_the_learner_version_is_not_done_and_the_whole_launch_is_quick(judged):
    out, seconds = judged
    assert out[0][-1]["kind"] == "not_done" and "your code goes here" in out[0][-1]["message"]
    assert seconds < 60 * (1 + len(RIGHT) + len(WRONG)) / 4, seconds  # seconds per variant, not a time-out's minute


# ---------------------------------------------------------------------------- the pieces, in one process
def _ev(kind, problem=None, **kw):
    return {"kind": kind, "problem": problem, **kw}


def test_judge_names_each_disagreement_the_same_on_every_rank():
    R.judge([_ev("replay", n=1, steps=1, ids=[3], position=[0])] * 2)
    R.judge([_ev("done", replays=6, tokens=[5, 6])] * 2)
    cases = [
        ([_ev("eager", n=1, new_site=True, graphs=0), _ev("capture", graph=1, call=1, eager=0)], "warm_up_one_rank"),
        ([_ev("eager", n=3, new_site=False, graphs=0), _ev("capture", graph=1, call=1, eager=2)], "warm_up_count"),
        ([_ev("capture", graph=1, call=1, eager=2), _ev("eager", n=3, new_site=True, graphs=0)], "capture_one_rank"),
        ([_ev("capture", graph=1, call=2, eager=2), _ev("end", graph=1, steps=1)], "branch"),
        ([_ev("replay", n=1, steps=1, ids=[3], position=[0]), _ev("done", replays=0, tokens=[])], "one_rank"),
        ([_ev("replay", n=2, steps=1, ids=[3], position=[1]), _ev("replay", n=2, steps=1, ids=[4], position=[1])],
         "drift"),
        ([_ev("replay", n=1, steps=2, ids=[3], position=[0]), _ev("replay", n=1, steps=1, ids=[3], position=[0])],
         "branch"),
        ([_ev("done", replays=6, tokens=[1]), _ev("done", replays=5, tokens=[1])], "one_rank"),
        ([_ev("done", replays=6, tokens=[1, 2]), _ev("done", replays=6, tokens=[1, 3])], "drift"),
        ([_ev("done", ("no_graph", "none")), _ev("done", ("no_graph", "none"))], "no_graph"),
        ([_ev("crash", defect="crash", message="IndexError: x"), _ev("eager", n=1, new_site=True, graphs=0)],
         "crash"),
    ]
    for events, kind in cases:
        with pytest.raises(R.CaptureDefect) as e:
            R.judge(events)
        assert e.value.kind == kind and str(e.value).startswith(R.TITLES[kind]), (kind, str(e.value))
    with pytest.raises(R.CaptureDefect, match=r"rank 0: IndexError: x \(rank\(s\) \[1\] stopped"):
        R.judge(cases[-1][0])


def test_classify_names_a_host_read_in_the_capture_and_the_learners_line():
    from course.lessons.tensor_parallel.exercise import classify

    try:
        try:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        except RuntimeError:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
    except RuntimeError as e:
        kind, msg = classify(e, __file__)
    assert kind == "host_sync" and ".item()" in msg and "not permitted" in msg
    try:
        [][1]
    except IndexError as e:
        kind, msg = classify(e, __file__)
    assert kind == "crash" and msg.startswith("IndexError: list index out of range (line ")
    assert classify(NotImplementedError("your code goes here"), "x") == ("not_done", "your code goes here")


def test_the_warm_up_rule_gives_lab_4_5s_verdict_word_for_word():
    """08.1 and lab 4.5 apply one rule (course.core.warmup): a warm-up on the default stream is refused by both."""
    import course
    from course.core.warmup import warmup_problem, where
    from course.lessons.real_model.lab_graph import CallSpy

    cg = course.graphs()
    assert where(cg) == "default" and warmup_problem(["side", "default"], "x") == ""
    for before in ([], ["default", "default"]):
        spy = CallSpy(cg)
        spy.calls = [(w, "StaticCache") for w in before] + [("capture", "StaticCache")]
        assert spy.problem() == warmup_problem(before, "one_token()") != ""
    assert "NCCL" in warmup_problem([], R.STEP, R.LAZY) and "torch's rule is a side stream" in warmup_problem([], "x")


def test_check_capture_turns_outcomes_into_the_checks_verdicts(monkeypatch):
    import course.lessons.tensor_parallel.exercise as EX
    from course.core.launch import WorkerError

    outcomes = {"ok": {"ok": True, "kind": "", "message": "", "tokens": [1, 2]},
                "todo": {"ok": False, "kind": "not_done", "message": "your code goes here", "tokens": None},
                "bad": {"ok": False, "kind": "no_graph", "message": "no graph: ...", "tokens": None}}
    monkeypatch.setattr(EX, "run_capture", lambda fns, *a: [outcomes[fns[0]]])
    assert EX.check_capture("ok") == [1, 2]
    with pytest.raises(NotImplementedError, match="your code goes here"):
        EX.check_capture("todo")
    with pytest.raises(AssertionError, match="^no graph"):
        EX.check_capture("bad")

    def lost(*a):
        raise WorkerError("gloo run failed first on rank 1: boom", ranks=[1], first=1)

    monkeypatch.setattr(EX, "run_capture", lost)
    with pytest.raises(AssertionError, match="rank 1 stopped outside tp_generate"):
        EX.check_capture("x")


@pytest.fixture
def one_rank():
    """A process group of one rank (gloo) in this process, for the referee's exchange."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_watch_counts_the_calls_and_sees_a_rebinding_in_one_process(one_rank):
    """WatchedStep, WatchedGraphs and WatchedGraph tell the Referee each call; one rank, a toy step."""
    import types

    import torch

    import course
    from course.lessons.tensor_parallel.watch import WatchedGraph, WatchedGraphs, WatchedStep

    cg = course.graphs()
    table = torch.eye(5)[[1, 2, 3, 4, 0]]  # token t -> logits peaking at t + 1

    def toy(ids, position):
        return table[ids.view(-1)].unsqueeze(0) + 0 * position

    def run(rebind: bool):
        referee = R.Referee(types.SimpleNamespace(rank=0), cg, 3, 5.0, False)
        graphs = WatchedGraphs(cg, referee)
        step, ids, position = WatchedStep(toy, referee), torch.zeros(1, 1, dtype=torch.long), torch.zeros(1).long()
        try:
            side = cg.Stream()
            side.wait_stream(cg.current_stream())
            with cg.stream(side):
                step(ids, position)
            cg.current_stream().wait_stream(side)
            g = graphs.CUDAGraph()
            with graphs.graph(g):
                nxt = step(ids, position).argmax(-1)
            out = []
            for _ in range(3):
                g.replay()
                out.append(int(nxt))
                if rebind:
                    ids = nxt.clone()
                else:
                    ids.copy_(nxt)
                position.add_(1)
            return referee, referee.done(out), g
        finally:
            referee.close()

    referee, tokens, g = run(rebind=False)
    assert tokens == [1, 2, 3] and isinstance(g, WatchedGraph) and g.steps == 1
    assert (referee.eager_calls, referee.replays, referee.graphs) == (1, 3, [1])
    assert [s[0] for s in referee.seen] == [[0], [1], [2]] and referee.rebound is None
    referee, tokens, _ = run(rebind=True)
    assert tokens == [1, 1, 1] and referee.rebound == ("ids", 2)
    assert referee.diagnose(tokens, [1, 2, 3])[0] == "rebound"
