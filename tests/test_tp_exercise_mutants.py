"""Exercise 08.1's check against the answer's right and wrong variants, every one judged in ONE launch of the ranks.

Each wrong variant is one plausible learner mistake, written as edits of the answer cell; its check must name it
(the rule and words of its message), the same on every rank. The right variants must pass. On a machine with 2+
GPUs the same launch runs over NCCL (``COURSE_PATH=cuda python -m pytest tests/test_tp_exercise_mutants.py``).
"""
import json
import time
from pathlib import Path

import pytest
import torch

import course
from cellrun import apply_edits
from course.core.cell_workers import CellWorker
from course.core.harness import CRASH, FAIL, PASS, TODO, Outcome, warmup_problem
from course.core.launch import WorkerError, WorkerTimeout, launch, plan
from course.lessons.tensor_parallel import checks as C, rules as R, watch as W

WARM = ("        for _ in range(2):  # NCCL's communicator and buffers made here, every all-reduce run eagerly "
        "first\n")
CAPTURE = ("    with cg.graph(graph):  # the same code on every rank\n"
           "        nxt = step(ids, position).argmax(-1, keepdim=True)  # whole logits: the same token on every rank\n")
REPLAY = "        graph.replay()  # every rank, every token\n"
APPEND = "        out.append(nxt.clone())\n"
ADVANCE = "        position.add_(1)\n"
EAGER_LOOP = ("    out = []\n    for _ in range(n_tokens):\n        nxt = step(ids, position).argmax(-1, keepdim=True)\n"
              "        out.append(nxt.clone())\n        ids.copy_(nxt)\n        position.add_(1)\n"
              "    return torch.cat(out, dim=1)\n")

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
    ("torch.cuda.synchronize() after the replays (as a GPU takes it)",
     [("    return torch.cat(out, dim=1)\n", "    torch.cuda.synchronize()\n    return torch.cat(out, dim=1)\n")]),
]

# (name, edits of the answer cell, the rule its check must name, words its message must hold)
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
    ("the token not copied into ids", [("        ids.copy_(nxt)\n", "")], "no_copy",
     "the graph's next token never reached the tensor it reads"),
    ("ids rebound to the next token", [("        ids.copy_(nxt)\n", "        ids = nxt\n")], "rebound",
     "`ids` named a new tensor"),
    ("the position never advances", [(ADVANCE, "        pass\n")], "no_advance",
     "every token was decoded at the same position"),
    ("the graph's output kept, not cloned", [("out.append(nxt.clone())", "out.append(nxt)")], "no_clone",
     "the list held the graph's output tensor, which every replay overwrites"),
    ("an error on rank 1 only", [("    graph = cg.CUDAGraph()\n", "    graph = cg.CUDAGraph()\n"
                                  "    [0, 1][ctx.rank * 5]\n")], "crash", "rank 1: IndexError"),
    ("a host read inside the capture", [(CAPTURE, CAPTURE + "        print('next token', nxt.item())\n")],
     "host_sync", "a host read or a wait inside the capture"),
    # what a new learner found (issue 45): each now named
    ("the tokens returned as [n_tokens, 1]", [("torch.cat(out, dim=1)", "torch.cat(out)")], "shape",
     "as a tensor [1, 6], got (6, 1)"),
    ("each token appended before the replay", [(REPLAY + APPEND, APPEND + REPLAY)], "early_read",
     "token k returned is what replay k-1 wrote"),
    ("the position advanced before the replay", [(REPLAY, ADVANCE + REPLAY), ("nxt)\n" + ADVANCE, "nxt)\n")],
     "early", "before the first replay position held 1"),
    ("a Python position inside the capture",
     [(CAPTURE, "    pos = 0\n    with cg.graph(graph):\n        nxt = step(ids, torch.full((1,), pos, "
                "device=ids.device)).argmax(-1, keepdim=True)\n"), (ADVANCE, "        pos += 1\n")],
     "frozen", "every replay decoded at position 0: the `position` the graph reads was fixed at capture"),
    ("a warm-up that decodes without a reset",
     [(WARM + "            step(ids, position)\n", WARM + "            ids.copy_(step(ids, position).argmax(-1, "
                                                            "keepdim=True))\n            position.add_(1)\n")],
     "reset", "when the capture ended, position held 2 and ids no longer held the first token"),
    ("torch.cuda.synchronize() inside the capture", [(CAPTURE, CAPTURE + "        torch.cuda.synchronize()\n")],
     "host_sync", "a host read or a wait inside the capture"),
]


def answer_cell(folder: str = "solutions") -> str:
    """The source of exercise 08.1's cell in ``folder``'s notebook 08."""
    nb = json.loads((Path(__file__).resolve().parent.parent / folder / "08_tensor_parallel.ipynb").read_text())
    return next("".join(c["source"]) for c in nb["cells"] if "def tp_generate" in "".join(c["source"]))


def variants(table) -> list:
    """The table's variants of the answer cell, carried as source to the ranks (as a notebook cell's worker)."""
    src = answer_cell()
    return [CellWorker("tp_generate", apply_edits([src], row[1], row[0])[0], f"<08 answer, {row[0]}>")
            for row in table]


@pytest.fixture(scope="module")
def judged():
    """Every variant judged on every rank (capture_worker, judge_generate per function), in one launch;
    and the seconds it took."""
    fns = variants(RIGHT) + variants(WRONG) + [CellWorker("tp_generate", answer_cell("notebooks"), "<08 learner>")]
    t0 = time.monotonic()
    out = launch(C.capture_worker, 2, backend=plan(2).backend, timeout=300, pg_timeout=60, fns=fns)
    return out, time.monotonic() - t0


def test_the_right_variants_pass(judged):
    out, _ = judged
    for (name, _), res in zip(RIGHT, out[0]):
        assert res.status == PASS and len(res.detail["tokens"]) == 6, (name, res)


@pytest.mark.parametrize("i", range(len(WRONG)), ids=[w[0] for w in WRONG])
def test_each_wrong_variant_gets_its_named_cross_on_every_rank(judged, i):
    out, _ = judged
    name, _, rule, words = WRONG[i]
    res = [rank[len(RIGHT) + i] for rank in out]
    assert res[0].status == FAIL and res[0].rule == rule, (name, res[0])
    assert res[0].message.startswith(R.TITLES[rule]) and words in res[0].message, (name, res[0].message)
    assert res[1] == res[0]  # every rank, the same verdict
    assert "copy_(nxt)" not in res[0].message and "add_(1)" not in res[0].message  # the mistake, not the fix


def test_the_learner_version_is_not_done_and_the_whole_launch_is_quick(judged):
    out, seconds = judged
    assert out[0][-1].status == TODO and "your code goes here" in out[0][-1].message
    assert seconds < 60 * (1 + len(RIGHT) + len(WRONG)) / 4, seconds  # seconds per variant, not a time-out's minute


def test_the_warm_up_rule_is_the_harness_one_word_for_word(judged):
    out, _ = judged
    i = len(RIGHT) + [w[0] for w in WRONG].index("no warm-up")
    assert warmup_problem([], R.STEP, R.LAZY) in out[0][i].message and "NCCL" in R.LAZY


# ---------------------------------------------------------------------------- the pieces, in one process
def _ev(what, **kw):
    return {"what": what, **kw}


def test_lockstep_names_each_disagreement_the_same_on_every_rank():
    done = _ev("done", tokens=[5, 6], shape="", replays=2)
    end, rep = _ev("end", graph=1, steps=1, ids=[3], position=[0]), _ev("replay", n=1, steps=1, ids=[3], position=[0])
    assert R.lockstep([[end, rep, done]] * 2, 2) is None
    cases = [
        ([[_ev("eager", line=3, where="side"), done], [_ev("capture", graph=1, call=1, order=""), done]],
         "warm_up_one_rank"),
        ([[_ev("eager", line=3, where="side"), _ev("eager", line=3, where="side")],
          [_ev("eager", line=3, where="side"), _ev("capture", graph=1, call=1, order="")]], "warm_up_count"),
        ([[_ev("eager", line=3, where="side"), _ev("capture", graph=1, call=1, order="")],
          [_ev("eager", line=3, where="side"), _ev("eager", line=9, where="default")]], "capture_one_rank"),
        ([[_ev("capture", graph=1, call=2, order="")], [_ev("end", graph=1, steps=1)]], "branch"),
        ([[end, rep, done], [end, dict(done, replays=0)]], "one_rank"),
        ([[end, dict(rep, ids=[4]), done], [end, rep, done]], "drift"),
        ([[end, dict(rep, steps=2)], [end, rep]], "branch"),
        ([[end, rep, done], [end, rep, dict(done, tokens=[5, 7])]], "drift"),
        ([[_ev("crash", rule="crash", message="IndexError: x")], [_ev("eager", line=3, where="side"), done]],
         "crash"),
    ]
    for traces, rule in cases:
        out = R.lockstep(traces, 2)
        assert out.rule == rule and out.message.startswith(R.TITLES[rule]), (rule, out)
    assert R.lockstep(cases[-1][0], 2).message == "a rank raised an error: rank 0: IndexError: x"
    todo = R.lockstep([[_ev("crash", rule="not_done", message="your code goes here")]] * 2, 2)
    assert (todo.status, todo.message) == (TODO, "your code goes here")


def test_crashed_names_a_host_read_in_the_capture_and_the_learners_line():
    try:
        try:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        except RuntimeError:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
    except RuntimeError as e:
        assert W.crashed(e, test_crashed_names_a_host_read_in_the_capture_and_the_learners_line.__code__)["rule"] \
            == "host_sync"
    try:
        [][1]
    except IndexError as e:
        event = W.crashed(e, test_crashed_names_a_host_read_in_the_capture_and_the_learners_line.__code__)
    assert event["rule"] == "crash" and event["message"].startswith("IndexError: list index out of range (line ")
    assert W.crashed(NotImplementedError("todo"), W.crashed.__code__) == {"what": "crash", "rule": "not_done",
                                                                           "message": "todo"}


def test_check_turns_a_lost_or_late_rank_into_a_named_cross(monkeypatch):
    def lost(*a, **k):
        raise WorkerError("gloo run failed first on rank 1: boom", ranks=[1], first=1)

    def late(*a, **k):
        raise WorkerTimeout("passed its time limit", ranks=[0])

    monkeypatch.setattr(C, "launch", lambda *a, **k: [[Outcome(PASS, detail={"tokens": [1, 2]})]])
    assert C.check(C.capture_worker, "f") == [1, 2]
    monkeypatch.setattr(C, "launch", lambda *a, **k: [[Outcome(TODO, "not_done", "your code goes here")]])
    with pytest.raises(NotImplementedError, match="your code goes here"):
        C.check(C.capture_worker, "f")
    monkeypatch.setattr(C, "launch", lost)
    assert C.on_ranks(C.capture_worker, ["f", "g"])[1].status == CRASH
    with pytest.raises(AssertionError, match="rank 1 stopped outside the watched calls"):
        C.check(C.capture_worker, "f")
    monkeypatch.setattr(C, "launch", late)
    with pytest.raises(AssertionError, match="did not all finish within 240 s"):
        C.check(C.capture_worker, "f")


def test_torch_cuda_synchronize_is_taken_as_a_gpu_takes_it():
    """On the simulator too: outside a capture it waits (inside, refused: the mutant above)."""
    cg = course.graphs()
    with W.gpu_synchronize(cg):
        torch.cuda.synchronize()
        assert course.runtime().on_gpu or torch.cuda.synchronize is cg.synchronize
    assert course.runtime().on_gpu or torch.cuda.synchronize is not cg.synchronize  # put back


def test_the_watch_traces_a_toy_generation_in_one_process():
    """Watch's step and graph API on one rank with a toy step: the events, a rebinding seen, the synchronize."""
    table = torch.eye(5)[[1, 2, 3, 4, 0]]  # token t -> logits peaking at t + 1

    def toy(ids, position):
        return table[ids.view(-1)] + 0 * position

    def generate(ctx, step, ids, position, n, cg, rebind=False):
        side = cg.Stream()
        side.wait_stream(cg.current_stream())
        with cg.stream(side):
            step(ids, position)
        cg.current_stream().wait_stream(side)
        g = cg.CUDAGraph()
        with cg.graph(g):
            nxt = step(ids, position).argmax(-1, keepdim=True)
        out = []
        for _ in range(n):
            g.replay()
            out.append(nxt.clone())
            if rebind:
                ids = nxt.clone()
            else:
                ids.copy_(nxt)
            position.add_(1)
        torch.cuda.synchronize()  # the simulator takes it as a GPU does
        return torch.cat(out, dim=1)

    first = torch.zeros(1, dtype=torch.long, device=course.device())
    events = W.run_generate(None, generate, toy, first, 3)
    assert [e["what"] for e in events][-1] == "done", events[-1]
    assert [e["what"] for e in events] == ["eager", "capture", "end", "replay", "replay", "replay", "done"]
    assert events[-1]["tokens"] == [1, 2, 3] and [e["ids"] for e in events[3:6]] == [[0], [1], [2]]
    assert R.verdict([events], 3, [1, 2, 3], 0).ok
    rebound = W.run_generate(None, lambda *a: generate(*a, rebind=True), toy, first, 3)
    out = R.verdict([rebound], 3, [1, 2, 3], 0)
    assert out.rule == "rebound" and "before replay 2, `ids` named a new tensor" in out.message
