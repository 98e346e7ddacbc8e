"""Mutants of labs 1 and 2: every wrong variant of an answer fails a check whose ✗ names its defect.

Function level, for speed: the answer notebook's code cells run once in one namespace (cells that only
show recorded results are left out); a mutant copies that namespace as it was before the answer's cell,
runs the cell with one textual change inside its ``### BEGIN SOLUTION`` region, then runs the exercise's
own check cell, as the notebook does. The ✗ the learner would see (the printed check output) must name
the defect. A mutant whose find-string no longer matches fails loudly, so the suite cannot rot into
testing nothing; the unmutated answers must pass every check.
"""
from __future__ import annotations

import ast
import contextlib
import io
import itertools
import linecache
from typing import NamedTuple

import nbformat
import pytest

import course
from course.core import checks
from course.tools import learner_versions as L
from course.tools.catalog import ROOT

ON_GPU = course.runtime().on_gpu
LABS = {1: ROOT / "solutions" / "lab1_embedding_kernel.ipynb", 2: ROOT / "solutions" / "lab2_embedding_swap.ipynb"}
REFRESH = {2: ("S.make_model(",)}  # cells that build state a check changes: rerun for every mutant


class Mutant(NamedTuple):
    lab: int
    exercise: str  # the name its check cell gives exercise(...)
    name: str  # the defect, in words
    edits: tuple  # ((find, replace), ...) applied in order inside one solution region
    words: tuple  # each must appear in the ✗ the learner sees
    gpu_only: str = ""  # why only a GPU can see this defect ("" = checked everywhere)
    sim_only: str = ""  # why it must not run on a GPU


def M(lab, exercise, name, edits, words, gpu_only="", sim_only=""):
    return Mutant(lab, exercise, name, tuple(edits), tuple(words), gpu_only, sim_only)


NAIVE, PREDICT, ERRORS, FAST = "1. naive kernel", "1b. predict the coalescing score", "2. clear errors", "3. fast kernel"
CPU_COPY, DEVICE, SWAP, REPLAY = "1. cpu-copy lookup", "2. device lookup", "3. swap", "5. replay with new ids"
CAPTURE, CPU_FAILS = "4. capture the device lookup", "6. the cpu-copy capture fails"
I16, I20 = " " * 16, " " * 20  # indentation inside the fast kernel's loops
NO_SIM_DEVICES = "the simulator runs everything on the CPU: ids and weight cannot be on different devices"

MUTANTS = [
    # lab 1, exercise 1: the naive kernel
    M(1, NAIVE, "no id < 0 guard", [("if idx >= 0 and idx < weight.shape[0]:", "if idx < weight.shape[0]:")],
      ["id -1 is outside the 5-row table", "must be zeros", "idx >= 0 and idx < weight.shape[0]"]),
    M(1, NAIVE, "guard idx <= V", [("idx < weight.shape[0]:", "idx <= weight.shape[0]:")],
      ["idx >= 0 and idx < weight.shape[0]"]),  # simulator: an IndexError; GPU: row 5 not zero, or not counted
    M(1, NAIVE, "reads the wrong row", [("idx = ids[n]", "idx = ids[out.shape[0] - 1 - n]")],
      ["was read where row", "was expected"]),
    M(1, NAIVE, "bad id not zeroed", [("out[n, d] = 0\n", "pass\n")], ["id 5", "was never written", "write a zero for a bad id"]),
    M(1, NAIVE, "bad id counted by every thread", [("if d == 0:", "if True:")], ["each bad id was counted 4 times"]),
    M(1, NAIVE, "bad id not counted", [("cuda.atomic.add(err, 0, 1)", "pass")], ["ids 5, 9 and -1 were not counted"]),
    M(1, NAIVE, "no i < N * D guard", [("if i < out.shape[0] * dim:", "if True:")],
      ["IndexError", "out of bounds", "your line", "idx = ids[n]"],
      sim_only="on a GPU the unguarded threads write past the output: corrupted memory or an illegal-address error "
               "that ends the process, so only the simulator (which raises IndexError) can run it"),
    # lab 1, exercise 1b: the prediction
    M(1, PREDICT, "predictions swapped", [('{"naive": 1.0, "uncoalesced": 8.0}', '{"naive": 8.0, "uncoalesced": 1.0}')],
      ["naive: you predicted 8"]),
    M(1, PREDICT, "one sector per byte", [('"uncoalesced": 8.0', '"uncoalesced": 32.0')],
      ["uncoalesced: you predicted 32"]),
    # lab 1, exercise 2: the host check
    M(1, ERRORS, "no id range check", [("if lo < 0 or hi >= vocab:", "if False:")],
      ["an id >= num_embeddings was not rejected by your host check", "ids.max() >= weight.shape[0]"]),
    M(1, ERRORS, "no id < 0 half", [("if lo < 0 or hi >= vocab:", "if hi >= vocab:")],
      ["an id < 0 was not rejected by your host check", "ids.min() < 0"]),
    M(1, ERRORS, "id == V let through", [("hi >= vocab", "hi > vocab")],
      ["an id >= num_embeddings was not rejected by your host check", "[0, 7, 1]"]),
    M(1, ERRORS, "float ids accepted", [("ids.dtype not in (torch.int32, torch.int64)", "False")],
      ["float ids: expected TypeError"]),
    M(1, ERRORS, "wrong exception for a 1-D weight", [('raise ValueError(f"weight must be 2-D', 'raise TypeError(f"weight must be 2-D')],
      ["1-D weight: expected ValueError, got TypeError"]),
    M(1, ERRORS, "padding_idx range not checked", [("if padding_idx is not None and not -vocab <= padding_idx < vocab:",
                                                    "if False:")],
      ["padding_idx outside the table: expected ValueError"]),
    M(1, ERRORS, "message too short", [('raise IndexError(f"ids must be in [0, {vocab}), found {lo if lo < 0 else hi}: check '
                                        'that the "\n                             "tokenizer and the table agree on the '
                                        'vocabulary size")', 'raise IndexError("bad id")')],
      ["too short to act on", "'bad id'"]),
    M(1, ERRORS, "devices not compared", [("if ids.device != weight.device:", "if False:")],
      ["ids on the CPU, weight on the GPU: expected ValueError"], gpu_only=NO_SIM_DEVICES),
    # lab 1, exercise 3: the fast kernel
    M(1, FAST, "no grid-stride loop", [("while row < out.shape[0]:", "if row < out.shape[0]:")],
      ["were never written", "grid-stride", "row += cuda.gridDim.x * cuda.blockDim.y"]),
    M(1, FAST, "one thread per row (tx 0 copies, the others idle)",
      [("tx, bx = cuda.threadIdx.x, cuda.blockDim.x\n",
        "tx, bx = 0, 1\n        if cuda.threadIdx.x != 0:\n            return\n")],
      ["was copied by one thread alone", "a row of blockDim.x = 8 threads must share it"]),
    M(1, FAST, "one thread per row (every thread its own row)",
      [("tx, bx = cuda.threadIdx.x, cuda.blockDim.x", "tx, bx = 0, 1"),
       ("row = cuda.blockIdx.x * cuda.blockDim.y + cuda.threadIdx.y",
        "row = (cuda.blockIdx.x * cuda.blockDim.y + cuda.threadIdx.y) * cuda.blockDim.x + cuda.threadIdx.x"),
       ("row += cuda.gridDim.x * cuda.blockDim.y", "row += cuda.gridDim.x * cuda.blockDim.y * cuda.blockDim.x")],
      ["was copied by one thread alone", "thread tx copying words tx, tx + blockDim.x"]),
    M(1, FAST, "threadIdx.x picks the row (columns of threads)",
      [("tx, bx = cuda.threadIdx.x, cuda.blockDim.x", "tx, bx = cuda.threadIdx.y, cuda.blockDim.y"),
       ("row = cuda.blockIdx.x * cuda.blockDim.y + cuda.threadIdx.y",
        "row = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x"),
       ("row += cuda.gridDim.x * cuda.blockDim.y", "row += cuda.gridDim.x * cuda.blockDim.x")],
      ["different rows of threads", "threadIdx.y picks the row"]),
    M(1, FAST, "grid stride without gridDim.x", [("row += cuda.gridDim.x * cuda.blockDim.y", "row += cuda.blockDim.y")],
      ["was copied more than once", "cuda.gridDim.x * cuda.blockDim.y"]),
    M(1, FAST, "no loads in flight", [("while j + 3 * bx < words:  # 4 loads in flight, then 4 stores", "while False:")],
      ["after loading 1 word", "4 loads are in flight"]),
    M(1, FAST, "each load stored at once",
      [(f"a = weight[idx, j]\n{I20}b", f"a = weight[idx, j]\n{I20}out[row, j] = a\n{I20}b"),
       (f"out[row, j] = a\n{I20}out[row, j + bx] = b", f"out[row, j + bx] = b")],
      ["after loading 1 word", "4 loads are in flight"]),
    M(1, FAST, "no tail loop", [("while j < words:  # the tail", "while False:  # the tail")], ["never written"]),
    M(1, FAST, "bad id counted by every thread of the row", [(f"if tx == 0:\n{I20}cuda.atomic.add", f"if True:\n{I20}cuda.atomic.add")],
      ["each bad id was counted 8 times", "tx == 0"]),
    M(1, FAST, "bad id row not zeroed", [("out[row, j] = 0", "pass")], ["id 5", "was never written", "write a zero for a bad id"]),
    # lab 2, exercise 1: the cpu-copy lookup
    M(2, CPU_COPY, "no host copy", [('ids_host = ids.to("cpu")', "ids_host = ids")],
      ['it should copy the ids to the host with ids.to("cpu")']),
    M(2, CPU_COPY, "no host bounds check", [("E.host_bounds_check(ids_host, weight.shape[0])", "pass")],
      ["an id >= num_embeddings was not rejected by your host check"]),
    M(2, CPU_COPY, "ids left on the host", [("E.embedding(ids_host.to(weight.device),", "E.embedding(ids_host,")],
      ["ids is on cpu"], gpu_only="on the simulator the host is the device: ids on the host are where the kernel reads them"),
    # lab 2, exercise 2: the device lookup
    M(2, DEVICE, "copies the ids to the host", [("return E.embedding(ids,", "return E.embedding(ids.cpu().to(weight.device),")],
      ["no host copies here", ".cpu()"]),
    M(2, DEVICE, "drops padding_idx", [("return E.embedding(ids, weight, padding_idx)", "return E.embedding(ids, weight)")],
      ["padding_idx outside the table: expected ValueError"]),
    M(2, DEVICE, "checks the ids on the host", [("E.embedding(ids, weight, padding_idx)", 'E.embedding(ids, weight, padding_idx, bounds="host")')],
      ["device_lookup waited for the GPU"],
      gpu_only="the simulator's ids are already on the host: its host check waits for nothing (bounds='auto' is "
               "'host' there), so only a GPU shows the wait"),
    # lab 2, exercise 3: swap
    M(2, SWAP, "unknown impl accepted", [('    if impl not in S.IMPLS:\n        raise ValueError(f"impl must be one of {S.IMPLS}, '
                                          'got {impl!r}")\n', "")],
      ['swap(model, "gpu") should raise ValueError']),
    M(2, SWAP, "error does not list the valid impls", [('raise ValueError(f"impl must be one of {S.IMPLS}, got {impl!r}")',
                                                        'raise ValueError(f"unknown impl {impl!r}")')],
      ["say which values are valid"]),
    M(2, SWAP, "top-level modules only", [("for m in model.modules():", "for m in model.children():")],
      ["in a nested model, swap() left", "model.modules()"]),
    M(2, SWAP, "first embedding only", [("m.impl = impl\n", "m.impl = impl\n            break\n")],
      ["in a nested model, swap() left"]),
    M(2, SWAP, "replaces the weights", [("m.impl = impl\n", "m.impl = impl\n            m.weight = torch.nn.Parameter("
                                                          "m.weight.clone(), requires_grad=False)\n")],
      ["swap() must keep the weights"]),
    M(2, SWAP, "does not return the model", [("    return model\n", "    return None\n")],
      ["swap() must return the model"]),
    # lab 2, exercise 4: the learner's capture
    M(2, CAPTURE, "no warm-up", [("        fn(*static)  # the warm-up, on a side stream\n", "        pass\n")],
      ["no warm-up ran before the capture"]),
    M(2, CAPTURE, "warm-up on the default stream", [("    with cg.stream(side):\n", "    if True:\n")],
      ["warm-up ran on the default stream", "side stream"]),
    M(2, CAPTURE, "no fork before the side stream's warm-up", [("    side.wait_stream(cg.current_stream())\n", "")],
      ["did not wait for the stream your data was written on", "side.wait_stream(cg.current_stream())"]),
    M(2, CAPTURE, "no join after the warm-up", [("    cg.current_stream().wait_stream(side)\n", "")],
      ["the capture began before", "cg.current_stream().wait_stream(side)"]),
    M(2, CAPTURE, "collector on during the capture", [("with collector_paused(), cg.graph(g):", "with cg.graph(g):")],
      ["garbage collector", "collector_paused()"]),
    M(2, CAPTURE, "returns an eager call's output", [("    return g, out\n", "    return g, fn(*static)\n")],
      ["output of the captured call itself"]),
    M(2, CAPTURE, "returns a copy of the output", [("    return g, out\n", "    return g, out.clone()\n")],
      ["output of the captured call itself"]),
    M(2, CAPTURE, "a failed capture swallowed", [("        raise\n", "        return None, None\n")],
      ["must raise its error"]),
    M(2, CAPTURE, "no recover after a failure", [("        recover(stream=before, graph=g)\n", "")],
      ["capture stream is still current", "recover(stream=before, graph=g)"]),
    M(2, CAPTURE, "no try/except around the capture", [
        ("    try:\n        with collector_paused(), cg.graph(g):\n            out = fn(*static)\n"
         "    except Exception:\n        recover(stream=before, graph=g)\n        raise\n",
         "    with collector_paused(), cg.graph(g):\n        out = fn(*static)\n")],
      ["capture stream is still current", "Wrap the capture in try/except", "recover(stream=before, graph=g)"]),
    # lab 2, exercise 6: the cpu-copy capture, refused
    M(2, CPU_FAILS, "captures the device lookup", [("capture(cpu_copy_lookup, static_ids, weight)",
                                                    "capture(device_lookup, static_ids, weight)")],
      ["returned None: nothing failed", "cpu_copy_lookup"]),
    M(2, CPU_FAILS, "runs it without a capture", [("capture(cpu_copy_lookup, static_ids, weight)",
                                                   "cpu_copy_lookup(static_ids, weight)")],
      ["returned None: nothing failed"]),
    M(2, CPU_FAILS, "returns the message, not the error", [("        return caught\n", "        return str(caught)\n")],
      ["not the error", "exception object"]),
    M(2, CPU_FAILS, "bad static ids: the warm-up's error", [("capture(cpu_copy_lookup, static_ids, weight)",
                                                            "capture(cpu_copy_lookup, static_ids + 1000, weight)")],
      ["not the capture's refusal of the host copy", "IndexError"]),
    M(2, CPU_FAILS, "the error escapes", [("except Exception as caught:", "except (TypeError, ValueError) as caught:")],
      ["let the capture's error escape"]),
    # lab 2, exercise 5: replay with new ids
    M(2, REPLAY, "renames instead of copying", [("static_ids.copy_(new_ids)", "static_ids = new_ids")],
      ["static_ids does not hold the new ids", "static_ids.copy_(new_ids)"]),
    M(2, REPLAY, "no replay", [("    graph.replay()\n", "")], ["replay the graph (graph.replay())"]),
    M(2, REPLAY, "returns a copy", [("return static_out", "return static_out.clone()")], ["return static_out itself"]),
]

# --------------------------------------------------------------------------- running cells like the notebook

_CELL_IDS = itertools.count()


def run_cell(source: str, ns: dict) -> None:
    """Execute one cell in ``ns``, its source registered like IPython's (inspect.getsource works on it)."""
    name = f"<notebook cell {next(_CELL_IDS)}>"
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    exec(compile(source, name, "exec"), ns)  # noqa: S102 - the course's own notebook


def _names(source: str, ctx) -> set:
    return {n.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name) and isinstance(n.ctx, ctx)}


def _shows_results(source: str, unset: set) -> bool:
    """A cell that loads a recorded result (run(...)), draws, or reads what such a cell made: no exercise needs it."""
    calls = {n.func.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    if "with exercise(" in source:
        assert not _names(source, ast.Load) & unset, "a check cell reads what a results cell made"
        return False
    return "run" in calls or "plots." in source or bool(_names(source, ast.Load) & unset)


class Lab(NamedTuple):
    cells: list  # code cell sources
    before: list  # namespace snapshot before each cell (None for a skipped cell)


@contextlib.contextmanager
def _quiet_session():
    """Run with the check session's memory as it was, and with no gate forcing ✗ to raise."""
    saved = dict(checks._SESSION)
    try:
        yield
    finally:
        checks._SESSION.clear()
        checks._SESSION.update(saved)


@pytest.fixture(scope="module")
def labs(monkeypatch_module):
    return build_labs()


def build_labs() -> dict:
    """Run each answer notebook's cells once (results cells left out); {lab: Lab}."""
    out = {}
    for lab, path in LABS.items():
        cells = [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
        last = max(i for i, s in enumerate(cells) if "with exercise(" in s)
        ns, before, unset = {"__name__": "__main__", "display": print}, [], set()
        with _quiet_session(), contextlib.redirect_stdout(io.StringIO()):
            for i, src in enumerate(cells):
                skip = i > last or _shows_results(src, unset)
                before.append(None if skip else dict(ns))
                if skip:
                    unset |= _names(src, ast.Store)
                else:
                    run_cell(src, ns)
        out[lab] = Lab(cells, before)
    return out


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    mp.delenv(checks.ENV_GATE, raising=False)  # the checks print their ✗ here; the test reads them
    mp.delenv(checks.ENV_NBGRADER, raising=False)
    yield mp
    mp.undo()


def _solution_span(source: str):
    """(start, end) character offsets of the solution region of a cell, or None."""
    if L.BEGIN not in source:
        return None
    return source.index(L.BEGIN), source.index(L.END)


def answer_cell(lab: Lab, exercise: str) -> int:
    """The index of the cell holding ``exercise``'s answer: the last answer cell before its check."""
    check = next(j for j, s in enumerate(lab.cells) if f'with exercise("{exercise}"' in s)
    return max(j for j in range(check) if _solution_span(lab.cells[j]))


def mutate(lab: Lab, exercise: str, edits) -> tuple:
    """(index of the answer cell, its mutated source); fails loudly unless each find-string occurs once there."""
    i = answer_cell(lab, exercise)
    src = lab.cells[i]
    for f, r in edits:
        a, b = _solution_span(src)
        region = src[a:b]
        assert region.count(f) == 1, (f"the mutant's find-string {f!r} occurs {region.count(f)} times in the answer "
                                      f"region of cell {i} (expected once): the answer changed, update the mutant")
        src = src[:a] + region.replace(f, r) + src[b:]
    return i, src


def run_check(lab: int, labs_: dict, exercise: str, i: int, source: str) -> tuple:
    """Run answer cell ``i`` (as ``source``) and the cells after it up to ``exercise``'s check; (status, output)."""
    nb = labs_[lab]
    check = next(j for j, s in enumerate(nb.cells) if f'with exercise("{exercise}"' in s)
    assert check > i, f"the check of {exercise!r} comes before its answer cell"
    ns = dict(nb.before[i])
    buf = io.StringIO()
    with _quiet_session(), contextlib.redirect_stdout(buf):
        checks._SESSION.pop(exercise, None)
        run_cell(source, ns)
        for j in range(check):  # fresh state for the check (a model the check changes, say)
            if j != i and nb.before[j] is not None and any(m in nb.cells[j] for m in REFRESH.get(lab, ())):
                run_cell(nb.cells[j], ns)
        run_cell(nb.cells[check], ns)
        return checks.status(exercise), buf.getvalue()


# --------------------------------------------------------------------------- the tests

ANSWERS = sorted({(m.lab, m.exercise) for m in MUTANTS})


def test_every_exercise_has_mutants():
    for lab, path in LABS.items():
        cells = [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
        names = [ast.literal_eval(s.split('with exercise(', 1)[1].split(",", 1)[0]) for s in cells if "with exercise(" in s]
        assert names and set(names) == {e for (lb, e) in ANSWERS if lb == lab}, f"lab {lab}: {names}"


@pytest.mark.parametrize("lab,exercise", ANSWERS, ids=[f"lab{lb}-{e}" for lb, e in ANSWERS])
def test_the_answer_passes(labs, lab, exercise):
    nb = labs[lab]
    i = answer_cell(nb, exercise)
    status, out = run_check(lab, labs, exercise, i, nb.cells[i])
    assert status == checks.PASS, out
    if exercise == FAST:  # the ✓ comes with what it covered, and says what only a GPU can check
        assert "grid-stride loop" in out and "rows of threads" in out and "loads in flight" in out, out
        assert "speed: " + ("faster than the naive kernel" if ON_GPU else "checked on a GPU only") in out, out


@pytest.mark.parametrize("mutant", MUTANTS, ids=[f"lab{m.lab}-{m.exercise.split('.')[0]}-{m.name}" for m in MUTANTS])
def test_mutant_fails_naming_its_defect(labs, mutant):
    if mutant.gpu_only and not ON_GPU:
        pytest.skip(f"GPU only: {mutant.gpu_only}")
    if mutant.sim_only and ON_GPU:
        pytest.skip(f"simulator only: {mutant.sim_only}")
    i, src = mutate(labs[mutant.lab], mutant.exercise, mutant.edits)
    status, out = run_check(mutant.lab, labs, mutant.exercise, i, src)
    assert status in (checks.FAIL, checks.CRASH), f"mutant {mutant.name!r} passed its check:\n{out}"
    shown = out[out.index(f"✗ {mutant.exercise}"):]
    missing = [w for w in mutant.words if w not in shown]
    assert not missing, f"mutant {mutant.name!r}: the ✗ does not say {missing}:\n{shown}"


def test_a_stale_find_string_fails_loudly(labs):
    with pytest.raises(AssertionError, match="occurs 0 times"):
        mutate(labs[1], NAIVE, [("this text is in no answer", "")])
    with pytest.raises(AssertionError, match="occurs 0 times"):
        mutate(labs[1], NAIVE, [("if d == 0:", "if True:"), ("not there any more", "")])
    with pytest.raises(AssertionError, match="occurs [2-9] times"):
        mutate(labs[1], FAST, [("out[row, j + bx] = b", ""), ("out[row, j]", "")])
