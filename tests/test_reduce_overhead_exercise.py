"""Lesson 06's exercise 06.4 (the learner writes the reduce-overhead step): the answer passes, every
wrong variant fails a check that names it, and the check's tools (the decoder with an unmarked
cache, the compile watch) do what they say.

Each mutant is the answer version's own cell (the solution notebook's, read from disk) with textual
edits from a table: (name, edits, words the ✗ must contain, what sees it). The cells run as the
notebook runs them, in one namespace: the header and import cells, the answer, the check cell. A
find-string that does not occur exactly once fails its test (the table must follow the answer).

The same tests run on the simulator path (torch on the CPU: the check compiles the learner's call
with ``backend="aot_eager"``, no CUDA graphs) and on a GPU (``COURSE_PATH=cuda``: the learner's call
as written, inductor and CUDA graphs), with the same verdict: every verdict below comes from what
both paths see (the compile's arguments, the marks and calls the watch records, dynamo's graph
count, torch's static-input analysis, the outputs). On a GPU the answer must also pass the GPU-only
parts (no "skipping cudagraphs", one CUDA graph launch per token); the tests marked ``gpu`` check
those directly and skip on the simulator path.
"""
import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

from cellrun import apply_edits, run_cells
from course.core import checks
from course.core.runtime import runtime
from course.lessons.real_model import build_model
from course.lessons.real_model import reduce_check as rc

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "solutions" / "06_real_model.ipynb"
ON_GPU = runtime().on_gpu
gpu = pytest.mark.skipif(not ON_GPU,
                         reason="needs a real GPU (torch.compile's CUDA graphs, the profiler)")
ANSWER = "class MyReduceOverheadStep"
CELLS = ("course.header()", "ON_GPU = course.runtime().on_gpu", ANSWER,
         "check_reduce_overhead(MyReduceOverheadStep)")


def _one(marker: str) -> str:
    nb = json.loads(NOTEBOOK.read_text(encoding="utf-8"))
    hits = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"
            and marker in "".join(c["source"])]
    assert len(hits) == 1, (f"{len(hits)} code cells of {NOTEBOOK.name} contain {marker!r} "
                            "(expected one)")
    return hits[0]


def run_exercise(edits, log_dir) -> dict:
    """Run the header and import cells, the answer cell with ``edits`` applied, and the check: its
    log entry."""
    cells = [_one(m) for m in CELLS]
    cells[2], = apply_edits([cells[2]], edits, "the 06.4 answer")
    entries = run_cells(cells, log_dir, "06.4")
    got = [e for e in entries if e["name"] == rc.REDUCE]
    assert got, f"the 06.4 check never reported: {entries}"
    return got[-1]


@pytest.fixture(autouse=True)
def _fresh_checks():
    checks.reset()
    yield
    checks.reset()
    assert torch.compile.__module__ == "torch", ("the check left its stand-in for torch.compile in "
                                                 "place")


_MARKS = ("        for layer in self.cache.layers:  "
          "# written by the step: addresses the graph must trust\n"
          "            for t in (layer.keys, layer.values, layer.cumulative_length):\n"
          "                torch._dynamo.mark_static_address(t)\n")
_BUFFERS = ("        for t in (decoder._arange, self.ids, self.pos):  "
            "# read by address: never copied\n"
            "            torch._dynamo.mark_static_address(t)\n")
_MARK_STEP = ("        torch.compiler.cudagraph_mark_step_begin()  "
              "# a new step: earlier outputs may be overwritten\n")
_CALL = ("        return self.compiled(self.ids, self.pos).clone()  "
         "# the next replay overwrites the output\n")
_COMPILE = ('        self.compiled = torch.compile(decoder.step, mode="reduce-overhead", '
            'fullgraph=True)\n')

# (name, edits, words the ✗ must contain, which path sees it, and how). "both": the verdict comes
# from what the simulator path and a GPU both see, so it is the same on both.
MUTANTS = [
    ("no mark_static_address at all", [(_MARKS, ""), (_BUFFERS, "")],
     ["not marked static", "keys, values, cumulative_length of 2 cache layers", "mutated inputs"],
     "both: torch's static-input analysis (AOT, the same on aot_eager and inductor) lists the "
     "cache tensors"),
    ("keys and values marked, cumulative_length not",
     [("(layer.keys, layer.values, layer.cumulative_length)",
                                                        "(layer.keys, layer.values)")],
     ["not marked static", "cumulative_length of 2 cache layers (2 tensors)"],
     "both: the static-input analysis lists the two counters (the step writes them: copy_, add_)"),
    ("buffers and positions not marked", [(_BUFFERS, "")], ["_arange", "ids", "pos", "copy"],
     "both: the static-input analysis lists them; a GPU records its graph but copies them before "
     "each replay"),
    ("passes the caller's tensors, not the buffers",
     [(_CALL, _CALL.replace("(self.ids, self.pos)", "(ids, pos)"))],
     ["ids", "position", "not static"],
     "both: the static-input analysis lists the caller's tensors"),
    ("no cudagraph_mark_step_begin", [(_MARK_STEP, "")],
     ["cudagraph_mark_step_begin", "ran 0 times"],
     "both: the watch counts the marks (torch's own heuristic hides the omission in this step, see "
     "the check)"),
    ("cudagraph_mark_step_begin after the call", [(_MARK_STEP, ""), (_CALL, _CALL.replace(
        "        return ", "        out = ") + _MARK_STEP + "        return out\n")],
     ["cudagraph_mark_step_begin", "after the call"],
     "both: the watch sees each mark after its call"),
    ("logits returned without a clone", [(_CALL, _CALL.replace(".clone()", ""))],
     ["own output", "overwrite", ".clone()"],
     "both: the returned tensor is the compiled call's output (same storage)"),
    ('mode="default"', [(_COMPILE, _COMPILE.replace('mode="reduce-overhead"', 'mode="default"'))],
     ["mode='default'", "reduce-overhead"],
     "both: the compile's arguments (a GPU would launch no graph at all)"),
    ("the position as a Python int", [
        (_COMPILE,
         '        self.compiled = torch.compile(lambda ids, p: decoder.step(ids, '
         'decoder._arange[p:p + 1]), '
                   'mode="reduce-overhead", fullgraph=True)\n'),
        (_CALL, _CALL.replace("(self.ids, self.pos)", "(self.ids, int(self.pos))"))],
     ["graphs over 8 tokens", "recompiled on"],
     "both: dynamo recompiles when the int changes (then treats it as dynamic)"),
    ("the position never copied in", [("        self.pos.copy_(pos)\n", "")],
     ["differ from the eager step", "pos"],
     "both: every token is computed at position 0: its logits against the eager step's"),
    ("compiled again in every step", [("        self.ids.copy_(ids)\n",
                                       _COMPILE.replace("(decoder", "(self.decoder")
                                       + "        self.ids.copy_(ids)\n")],
     ["inside step()"], "both: the watch sees torch.compile called after __init__"),
]


def test_answer_passes(tmp_path):
    entry = run_exercise((), tmp_path)
    assert entry["status"] == "pass", entry


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m[0] for m in MUTANTS])
def test_mutant_is_named(mutant, tmp_path):
    name, edits, words, _where = mutant
    entry = run_exercise(edits, tmp_path)
    assert entry["status"] == "fail", f"06.4 passed or crashed on the mutant {name!r}: {entry}"
    missing = [w for w in words if w.lower() not in entry["message"].lower()]
    assert not missing, f"06.4's ✗ for {name!r} does not say {missing}: {entry['message']!r}"


def test_there_are_enough_mutants_and_each_says_which_path_sees_it():
    assert len(MUTANTS) >= 5
    assert all(m[3].startswith("both:")
               for m in MUTANTS), ("every verdict must be the same on both paths")


def test_learner_version_says_not_done_yet(tmp_path):
    """The answer left as its TODO is "not done yet", never a ✗."""
    begin = "        ### BEGIN SOLUTION\n"
    answer = _one(ANSWER)
    head = answer[:answer.index(begin) + len(begin)]
    entry = run_exercise([(head,
                           head + "        raise NotImplementedError('your code goes here')\n")],
                         tmp_path)
    assert entry["status"] == "todo", entry


# ----------------------------------------------------------------------------- the check's tools
@pytest.fixture(scope="module")
def model():
    return build_model("tiny")


def test_unmarked_decoder_leaves_the_cache_unmarked(model):
    dec = rc.unmarked_decoder(model, 16)
    layer = dec.caches[1].layers[0]
    for t in (layer.keys, layer.values, layer.cumulative_length):
        assert not hasattr(t, "_dynamo_static_input_type")
    from course.lessons.real_model import StaticDecoder

    # transformers marks an eagerly allocated cache
    plain = StaticDecoder(model, 16).cache_for(1).layers[0]
    assert plain.keys._dynamo_static_input_type == "unguarded"


def test_watch_compile_traces_swaps_the_backend_off_gpu_and_restores():
    real = torch.compile
    with rc.watch_compile(on_gpu=False) as w:
        f = torch.compile(lambda x: x * 2, mode="reduce-overhead", fullgraph=True)
        torch.compiler.cudagraph_mark_step_begin()
        y = f(torch.ones(3))
        f(torch.ones(3))
    assert torch.compile is real
    assert torch.compiler.cudagraph_mark_step_begin.__name__ == "cudagraph_mark_step_begin"
    assert [e["kwargs"]
            for e in w.of("compile")] == [{"mode": "reduce-overhead", "fullgraph": True}]
    assert (rc.graphs_asked(w)
            and [e["what"] for e in w.events] == ["compile", "mark", "call", "call"])
    assert rc.marks_before_calls(w) == [1, 0]
    assert (torch.equal(y, torch.full((3,), 2.0))
            and w.of("call")[0]["output"] == y.untyped_storage().data_ptr())
    with rc.watch_compile(on_gpu=False) as w:
        torch.compile(mode="default")(lambda x: x + 1)(torch.ones(2))  # the decorator form
    assert ([e["kwargs"] for e in w.of("compile")] == [{"mode": "default"}]
            and not rc.graphs_asked(w))
    assert len(w.of("call")) == 1
    torch._dynamo.reset()


def test_static_problem_and_recompile_reason_name_their_cause():
    assert rc._static_problem([]) == ""
    text = rc._static_problem(["L['self'].caches[1].layers[0].cumulative_length", "L['ids']"])
    assert "cumulative_length of 1 cache layer" in text and "not static either: ids" in text
    assert "copy" in rc._static_problem(["L['position']"])
    msg = ("Recompiling function step in x.py:3\n    triggered by the following guard failure(s):\n"
           "    - 0/0: p == 0                       # comment\n")
    assert rc._recompile_reason([msg]) == "p == 0" and rc._recompile_reason(["other"]) == ""


# ----------------------------------------------------------------------------- GPU
# What the verdicts stand for, seen on a GPU with the learner's class itself (outside the check):
# the answer records one graph and skips none; the unmarked cache makes torch skip it; a kept output
# without a clone is overwritten; mode="default" launches no graph.
def learner_class(edits=()):
    """``MyReduceOverheadStep`` as the answer cell (with ``edits``) defines it, after the header and
    import cells."""
    cells = [_one(m) for m in CELLS[:3]]
    for find, replace in edits:
        assert cells[2].count(find) == 1, find
        cells[2] = cells[2].replace(find, replace)
    ns = {"__name__": "__lab__"}
    with contextlib.redirect_stdout(io.StringIO()):
        for src in cells:
            exec(compile(src, "<06.4>", "exec"), ns)  # noqa: S102 - the course's own notebook
    return ns["MyReduceOverheadStep"]


def _gpu_run(edits=(), tokens=6):
    """The learner's step on the tiny Llama on the GPU for ``tokens`` steps: (step, logs, counters,
    last outputs)."""
    from course.core.compiled import compile_counters, reset_compile, torch_log_messages

    model = build_model("tiny", device="cuda")
    reset_compile()
    outs = []
    with torch_log_messages(cudagraphs=True, perf_hints=True) as msgs, torch.no_grad():
        step = learner_class(edits)(rc.unmarked_decoder(model), batch=1)
        ids = torch.full((1, 1), 3, device="cuda")
        for p in range(tokens):
            outs.append(step.step(ids, torch.full((1,), p, device="cuda")))
            ids = outs[-1].argmax(-1, keepdim=True)
        torch.cuda.synchronize()
    return step, msgs, compile_counters(), outs, ids


@gpu
def test_gpu_answer_records_one_graph_and_skips_nothing():
    from course.core.compiled import reset_compile
    from course.core.profiling import launch_counts

    step, msgs, counters, _, ids = _gpu_run()
    assert (not [m for m in msgs if "skipping cudagraphs" in m.lower()]
            and counters["cudagraph_skips"] == 0), msgs
    with torch.no_grad():
        counts = launch_counts(lambda: step.step(ids, torch.full((1,), 6, device="cuda")))
    assert counts["graph_launches"] == 1, counts
    reset_compile()


@gpu
def test_gpu_mode_default_launches_no_graph():
    from course.core.compiled import reset_compile
    from course.core.profiling import launch_counts

    step, _, _, _, ids = _gpu_run([(_COMPILE,
                                    _COMPILE.replace('mode="reduce-overhead"', 'mode="default"'))])
    with torch.no_grad():
        counts = launch_counts(lambda: step.step(ids, torch.full((1,), 6, device="cuda")))
    assert counts["graph_launches"] == 0 and counts["kernel_launches"] > 1, counts
    reset_compile()
