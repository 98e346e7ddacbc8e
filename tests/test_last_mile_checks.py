"""Lesson 07's checks (course.lessons.last_mile.checks): each exercise's answer passes, and every
wrong version, built from the answer cell with apply_edits and run through the notebook's own cells,
gets a ✗ from the rule that names its defect, in the same words on both paths (on a GPU, 07.3's
check runs the interpreter in a subprocess, then the kernel compiled)."""
import importlib
import json
import linecache
import math
import time

import pytest
import torch

from cellrun import ROOT, _fresh_checks, apply_edits, one, run_cells  # noqa: F401
from course.core import triton_path as TP
from course.core.harness import Defect, judge
from course.core.results import Result
from course.core.runtime import runtime
from course.lessons.last_mile import checks as C

ON_GPU = runtime().on_gpu
needs_triton = pytest.mark.skipif(not TP.available(), reason=TP.missing_reason() or "triton")
laptop = pytest.mark.skipif(ON_GPU or not TP.available(), reason="the interpreter's path")
K1, K2, K3 = "07.1 a fused RMSNorm + GEMV", "07.2 predict what PDL saves", \
    "07.3 two stages, one launch, one barrier"
CELLS = ["".join(c["source"]) for c in json.loads(
    (ROOT / "solutions" / "07_last_mile.ipynb").read_text(encoding="utf-8"))["cells"]
    if c["cell_type"] == "code"]
TIMELINE = ("from course.core.results import Result\n"
            "TL = Result('last_mile_timeline', 't', {}, [{'variant': 'Triton', 'index': i, "
            "'start_us': s, 'end_us': s + 2.0} for i, s in enumerate((0.0, 2.5, 3.5, 5.75))])")


def cell(text: str) -> str:
    """The one code cell of lesson 07's answer version that holds ``text``."""
    found = [c for c in CELLS if text in c]
    assert len(found) == 1, f"{len(found)} cells hold {text!r}"
    return found[0]


# exercise -> (the cells its check needs before the answer, the answer cell, the check cell)
EXERCISES = {K1: ([], "def rms_gemv(", "check_rms_gemv(rms_gemv)"),
             K2: ([TIMELINE], "def predicted_saving(",
                  "check_gap_prediction(predicted_saving, TL)"),
             K3: (["def grid_sync("], "def two_stage(",
                  "check_two_stage(two_stage)")}


def kernel_from(edits=(), name: str = "two_stage"):
    """Exercise 07.3's kernel built from its answer cell and the grid_sync cell before it, with
    ``edits`` applied to them, as a notebook defines them (its source readable)."""
    src = "\n\n".join(apply_edits([cell("def grid_sync("),
                                    cell("def two_stage(")], edits, "07.3's cells"))
    label = f"<07.3 {hash(src)}>"
    linecache.cache[label] = (len(src), None, src.splitlines(True), label)
    ns = {"__name__": "__lab__", "tr": TP.triton(),
          "tl": importlib.import_module("triton.language")}
    exec(compile(src, label, "exec"), ns)  # noqa: S102 - the course's own answer cell
    return ns[name]


def run_07(name: str, edits=(), log_dir=None) -> dict:
    """Exercise ``name`` of lesson 07 as a notebook runs it (the header, the imports, the cells it
    needs, its answer cell with ``edits`` applied, its check cell): its logged outcome."""
    needs, answer, check = EXERCISES[name]
    steps = apply_edits([cell(answer)], edits, f"{name}'s answer")
    setup = [cell("course.header()"), cell("from course.lessons.last_mile.checks import")]
    needs = [n if n == TIMELINE else cell(n) for n in needs]
    entries = run_cells(setup + needs + steps + [cell(check)], log_dir, "07")
    return next(e for e in entries if e["name"] == name)


_W2, _SYNC, _H = (next(line for line in cell("def two_stage(").splitlines(True)
                       if line.lstrip().startswith(start))
                  for start in ("w2 = ", "grid_sync(", "h = "))  # the answer's three lines
_RSTD = "rstd = 1.0 / tl.sqrt(tl.sum(sq, axis=0) / K + eps)"
_N = "n = tl.load(x_ptr + c, mask=c < K, other=0.0) * rstd * nw"
_BARRIER = {  # barriers a learner writes by hand
    "relaxed": "    target = (tl.atomic_add(bar_ptr + 3, 0, sem='relaxed') // tl.num_programs(0) "
               "+ 1) * tl.num_programs(0)\n    tl.atomic_add(bar_ptr + 3, 1, sem='relaxed')\n"
               "    while tl.atomic_add(bar_ptr + 3, 0, sem='relaxed') < target:\n        pass\n",
    "never reset": "    tl.atomic_add(bar_ptr, 1, sem='release')\n"
                   "    while tl.atomic_add(bar_ptr, 0, sem='acquire') < tl.num_programs(0):\n"
                   "        pass\n",
    "one look": "    arrived = tl.atomic_add(bar_ptr, 1, sem='acq_rel')\n"
                "    if arrived < tl.num_programs(0) - 1:\n"
                "        tl.atomic_add(bar_ptr, 0, sem='acquire')  # looks at the count once\n"}
# (name, edits of the answer cell, exercise, the rule that must fail, words its ✗ must contain)
MUTANTS = [
    ("no eps", one(_RSTD, _RSTD.replace(" + eps", "")), K1, "no_eps", ["eps is missing"]),
    ("no RMSNorm at all", one(_N, "n = tl.load(x_ptr + c, mask=c < K, other=0.0)"), K1, "no_norm",
     ["not normalized"]),
    ("no 1/RMS", one(_N, _N.replace(" * rstd", "")), K1, "no_rms", ["not divided by its RMS"]),
    ("no norm weight", one(_N, _N.replace(" * nw", "")), K1, "no_weight", ["nw is not applied"]),
    ("the mean over a block", one(_RSTD, _RSTD.replace("/ K", "/ BLOCK_K")), K1, "mean_over_block",
     ["block width"]),
    ("the last row unwritten", one("mask=rows < N)", "mask=rows < N - 1)"), K1, "unwritten",
     ["never written"]),
    ("padding counted as ones", one("mask=c < K, other=0.0).to(", "mask=c < K, other=1.0).to("), K1,
     "wrong", ["largest difference"]),
    ("a tile of the wrong shape (07.1)", one("acc += w * n[None, :]", "acc += w * n[:, None]"), K1,
     "tile_shape", ["wrong shape", "make_shape_compatible"]),
    ("the overlap counted as negative idle", one('max(0.0, b["start_us"] - a["end_us"])',
                                                  'b["start_us"] - a["end_us"]'), K2, "sum_of_gaps",
     ["you said", "the timeline's rows give"]),
    ("no barrier", one(_SYNC, ""), K3, "no_barrier", ["no barrier between the stages"]),
    ("a count too big", one("tl.num_programs(0), spin", "tl.num_programs(0) + 1, spin"), K3,
     "deadlock", ["never opens", "deadlock"]),
    ("a count too small", one("tl.num_programs(0), spin", "tl.num_programs(0) - 1, spin"), K3,
     "leaky_barrier", ["let a program through"]),
    ("h loaded before the wait", one(_SYNC + _H, _H + _SYNC), K3, "early_read",
     ["h was loaded before the wait"]),
    ("W2 loaded after the wait", one(_W2 + _SYNC, _SYNC + _W2), K3, "late_weights",
     ["W2 is loaded only after the wait"]),
    ("a barrier without release/acquire", one(_SYNC, _BARRIER["relaxed"]), K3, "leaky_barrier",
     ["sem='release'"]),
    ("a counter never reset for the next launch", one(_SYNC, _BARRIER["never reset"]), K3,
     "not_reset", ["works once, not on the next launch", "second launch"]),
    ("one look at the count, no wait", one(_SYNC, _BARRIER["one look"]), K3, "no_wait",
     ["does not wait"]),
    ("a tile of the wrong shape (07.3)", one(_H, _H.replace("h_ptr + cols", "h_ptr + rows")), K3,
     "tile_shape", ["wrong shape", "make_shape_compatible"]),
]


@needs_triton
@pytest.mark.parametrize("name", [K1, K2, K3])
def test_each_answer_passes(name, tmp_path):
    entry = run_07(name, log_dir=tmp_path)
    assert entry["status"] == "pass", entry


@needs_triton
@pytest.mark.parametrize("name, edits, exercise, rule, words", MUTANTS,
                         ids=[m[0] for m in MUTANTS])
def test_each_wrong_version_gets_the_rule_that_names_it(name, edits, exercise, rule, words,
                                                        tmp_path):
    entry = run_07(exercise, edits, tmp_path)
    assert entry["status"] == "fail" and entry.get("rule") == rule, entry
    missing = [w for w in words if w.lower() not in entry["message"].lower()]
    assert not missing, f"the ✗ does not say {missing}: {entry['message']!r}"


@needs_triton
@pytest.mark.parametrize("name", [K1, K3])
def test_an_unfinished_kernel_is_not_done_yet(name, tmp_path):
    answer = cell(EXERCISES[name][1])
    block = answer[answer.index("    ### BEGIN SOLUTION"):answer.index("### END SOLUTION") + 16]
    entry = run_07(name, one(block, '    raise NotImplementedError("your code here")'), tmp_path)
    assert entry["status"] == "todo", entry


@laptop
def test_a_wrong_barrier_is_named_as_fast_as_the_answer_passes(tmp_path):
    """A ✗ costs no more than the ✓: the barrier check stops at the first launch a rule breaks."""
    kernels = {"answer": kernel_from(),
               "never reset": kernel_from(one(_SYNC, _BARRIER["never reset"]))}
    took = {}
    for label, k in kernels.items():
        t0 = time.perf_counter()
        took[label] = (C.two_stage_outcome(k), time.perf_counter() - t0)
    assert took["answer"][0].ok and took["never reset"][0].rule == "not_reset", took
    assert took["never reset"][1] <= 1.5 * took["answer"][1] + 0.05, took


@laptop
def test_the_gpu_path_judges_the_kernel_on_its_own_with_the_same_words():
    """The GPU check's first half: the kernel's source, and the grid_sync of the learner's cell it
    calls (here edited: its wait does not acquire), judged in a subprocess under the interpreter:
    the laptop's outcome, word for word."""
    wait = 'sem="acquire", scope="gpu") == gen'
    kernel = kernel_from(one(wait, wait.replace("acquire", "relaxed")))
    shown = C.kernel_source(kernel)
    assert shown.index("def grid_sync(") < shown.index("def two_stage(")
    here = C.two_stage_outcome(kernel)
    there = C.judge_source(shown, "two_stage", "sim")
    assert (here.status, here.rule, here.message) == (there.status, there.rule, there.message)
    assert there.rule == "leaky_barrier"
    assert C.judge_source(C.kernel_source(kernel_from()), "two_stage", "sim").status == "pass"
    with pytest.raises(RuntimeError, match="on its own"):
        C.judge_source("def broken(:\n", "broken")


def test_source_of_and_tile_shapes():
    def unfinished():
        raise NotImplementedError

    with pytest.raises(NotImplementedError, match="write it"):
        C.source_of(unfinished, "write it")
    assert C.source_of(C.inputs, "").startswith("def inputs(")
    with pytest.raises(Defect) as e:
        with C.tile_shapes():
            try:
                raise ValueError("Cannot make_shape_compatible: incompatible dimensions at index "
                                 "1: 32 and 8")
            except ValueError as inner:
                raise RuntimeError("at 12:4:\n    h = ...") from inner
    assert e.value.rule == "tile_shape" and "index 1: 32 and 8" in str(e.value)
    with pytest.raises(KeyError):
        with C.tile_shapes():
            raise KeyError("anything else goes on")


def test_rms_gemv_reference_and_each_wrong_version_it_names():
    g = torch.Generator().manual_seed(0)
    x, nw = torch.randn(12, generator=g), torch.randn(12, generator=g)
    w = torch.randn(5, 12, generator=g)
    n = x.double() / math.sqrt(float((x.double() ** 2).mean()) + C.EPS)
    assert torch.allclose(C.rms_gemv_reference(x, nw, w, C.EPS), w.double() @ (n * nw.double()))
    for rule, why, kw in C.WRONG:
        run = C.GemvRun(5, 12, 4, 8, x, nw, w, torch.zeros(5))
        kw = {**kw, "count": 8} if kw.get("count") == "BLOCK_K" else kw
        run.got = C.rms_gemv_reference(x, nw, w, C.EPS, **kw).float()
        out = judge(run, C.GEMV_RULES)
        assert (out.rule, out.message) == (rule, f"{run.where}: {why}")
    assert judge(C.GemvRun(5, 12, 4, 8, x, nw, w, torch.zeros(5)), C.GEMV_RULES).rule == "wrong"


def test_idle_between_kernels_counts_only_the_gaps():
    rows = [{"variant": "Triton", "index": i, "start_us": s, "end_us": s + 2.0}
            for i, s in enumerate((0.0, 2.5, 3.5, 5.75))]
    res = Result("last_mile_timeline", "t", {}, rows)
    assert C.idle_between_kernels(res) == 0.75
    with pytest.raises(ValueError, match="no rows"):
        C.idle_between_kernels(res, "Triton + PDL")


def test_a_launch_names_where_it_was_seen():
    from course.lessons.last_mile.coop import Race, Trace

    race = Race("h", 8, "write over an unordered read", 1, 0, atomics=2)
    launch = C.Launch(1, "ahead", "", 0, [4, 0, 0, 0], Trace([race], [2, 1, 0, 0], 3))
    assert launch.race is race and race.reader == 0 and launch.tail == C.SECOND
    assert C.Launch(0, "gpu", "", 0, []).tail == " (compiled, on the GPU)"
    assert len(C.inputs()) == 3 and C.inputs()[1].shape == (C.N, C.N)
