"""Lesson 03's debugging exercises (03.3 to 03.5): the suspects' verdicts on this path, and mutants of the answers.

The suspects must get the GPU's verdict on the path this machine has (the simulator in CI, torch.cuda on a GPU):
``course.graphs()`` is one or the other. The mutants are the answer notebook's own cells (its imports, then the
answer and check cells of 03.3 to 03.5, read from disk) with one textual edit each; the exercise's check must fail,
and its ✗ must name the defect. A find-string that does not occur exactly once in the answer cells fails its test.
The same tests run on both paths (no mutant here is blind on either).
"""
from __future__ import annotations

import contextlib
import io
import json
import linecache
import warnings
from pathlib import Path

import pytest
import torch

import course
from course.core import checks, harness as H, reference
from course.sim import graph as simgraph, stream as simstream
from course.core.runtime import runtime
from course.lessons.what_breaks import checks as D, find_static, suspects as S

ROOT = Path(__file__).resolve().parent.parent
LESSON = ROOT / "solutions" / "03_what_breaks_capture.ipynb"
ON_GPU = runtime().on_gpu
SYNC, CAP, FIX = "03.3 which ones synchronize", "03.4 capture them yourself", "03.5 fix the frozen step"


@pytest.fixture(autouse=True)
def _clean():
    checks.reset()
    yield
    checks.reset()
    if not ON_GPU:
        left = bool(simstream._ACTIVE) or simstream.current_stream() is not simstream.default_stream()
        simgraph.end_all_captures()
        assert not left, "a capture or a capture stream was left behind"
    assert course.graphs().get_sync_debug_mode() == 0, "the sync debug mode was left on"


# ----------------------------------------------------------------------------- the suspects, on this path
@pytest.mark.parametrize("suspect", S.SUSPECTS, ids=lambda s: s.name)
def test_the_course_capture_gives_the_gpu_verdict(suspect):
    verdict, error = D.reference_capture(suspect.fn, suspect.args)
    assert verdict == suspect.verdict, (verdict, error)
    if error is not None:
        cause = H.root_cause(error)
        assert suspect.error in str(cause)
        frames = [f for f in __import__("traceback").extract_tb(cause.__traceback__) if f.filename == S.__file__]
        assert (frames[-1].name, frames[-1].lineno) == suspect.hazard_line()
    suspect.fn(*suspect.args())  # eagerly: no complaint


def test_suspects_hide_from_the_static_finder_and_their_inputs_change():
    assert [find_static(s.fn) for s in S.SUSPECTS] == [[], [], []], "each needs torch's tools, not a reading"
    assert [f.rule for f in find_static(S._temperature)] == ["item"], "pointed at the helper, the finder sees it"
    assert S.get("rotated").args(0)[1] != S.get("rotated").args(1)[1], "the step changes between the two calls"
    assert S.get("sharpened").hazard_line() == ("_temperature", S._temperature.__code__.co_firstlineno + 2)
    with pytest.raises(KeyError, match="no suspect"):
        S.get("nope")
    assert H.first_line(RuntimeError("a\nb")) == "RuntimeError: a"


def test_the_probe_has_no_hazard_and_new_inputs_per_seed():
    fn, make_args = D.probe()
    x, w = make_args(0)
    assert torch.equal(fn(x, w), torch.relu(x @ w) + 1)
    assert not torch.equal(make_args(1)[0], x) and make_args(1)[1] is w
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        D.legacy_softmax(torch.zeros(2))
    assert "deprecated" in str(caught[0].message)


# ----------------------------------------------------------------------------- running the answer cells
def _cells() -> list:
    nb = json.loads(LESSON.read_text(encoding="utf-8"))
    return [c for c in nb["cells"] if c["cell_type"] == "code"]


def _src(cell) -> str:
    return "".join(cell["source"])


def run_exercises(edits=(), until: str = "") -> dict:
    """The lesson's header and import cells, then the cells of 03.3 to 03.5 (answers and checks), with ``edits``;
    exercise name -> (status, printed output)."""
    cells = _cells()
    first = next(i for i, c in enumerate(cells)
                 if "from course.lessons.what_breaks import checks as hazard_checks, suspects" in _src(c))
    setup = [_src(c) for c in cells[:3]] + [_src(cells[first])]
    steps = [_src(c) for c in cells[first + 1:]
             if "### BEGIN SOLUTION" in _src(c) or "check" in c.get("metadata", {}).get("tags", [])]
    for find, replace in edits:
        hits = sum(s.count(find) for s in steps)
        if hits != 1:
            pytest.fail(f"a mutant's find-string occurs {hits} times in the answer and check cells of 03.3 to 03.5 "
                        f"(it must occur once): update the mutant to the answer\n{find}")
        steps = [s.replace(find, replace) for s in steps]
    ns, outputs = {"__name__": "__main__", "display": print}, {}
    checks.reset()
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(checks.ENV_GATE, raising=False)
        mp.delenv(checks.ENV_NBGRADER, raising=False)
        for i, src in enumerate(setup + steps):
            name = f"<03 cell {i}>"
            linecache.cache[name] = (len(src), None, src.splitlines(True), name)
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                exec(compile(src, name, "exec"), ns)  # noqa: S102 - the course's own notebook
            for ex in (SYNC, CAP, FIX):
                if ex not in outputs and checks.status(ex) is not None:
                    outputs[ex] = (checks.status(ex), buf.getvalue())
            if until and until in outputs:
                break
    return outputs


def test_the_answers_pass():
    got = run_exercises()
    assert {k: v[0] for k, v in got.items()} == {SYNC: checks.PASS, CAP: checks.PASS, FIX: checks.PASS}, got
    assert "rotated: replays wrong" in got[CAP][1] and "your capture of 03.4" in got[FIX][1]


# (name, edits, the exercise whose check must fail, words its ✗ must contain)
_GET_LINE = "    return frames[-1].name, frames[-1].lineno"
_CONTEXT = ("    while error.__context__ is not None:  # capture_end's error was raised while handling the first one\n"
            "        error = error.__context__\n")
_COPY = ("    for s, n in zip(static, new):\n        if isinstance(s, torch.Tensor):\n"
         "            s.copy_(n)  # the new values, into the memory the graph reads\n")
MUTANTS = [
    # 03.3: torch's sync debug mode
    ("mode never set", [('        cg.set_sync_debug_mode("warn")\n', "")], SYNC,
     ["synchronizes(sharpened) returned False", "set_sync_debug_mode('warn')"]),
    ("mode set after the call", [('        cg.set_sync_debug_mode("warn")\n        try:\n            fn(*args)\n',
                                  '        try:\n            fn(*args)\n            cg.set_sync_debug_mode("warn")\n')],
     SYNC, ["returned False", "_temperature"]),
    ("mode left on", [('            cg.set_sync_debug_mode("default")\n', "            pass\n")], SYNC,
     ["still on", "finally"]),
    ("every warning counted", [('return any("synchronizing" in str(w.message) for w in caught)',
                                "return bool(caught)")], SYNC, ["legacy_softmax", "something else"]),
    ("error mode, its error uncaught", [('cg.set_sync_debug_mode("warn")', 'cg.set_sync_debug_mode("error")')], SYNC,
     ["'error' mode", "raises"]),
    ("reads the source instead", [('return any("synchronizing" in str(w.message) for w in caught)',
                                   "return bool(finder.find_static(fn))")], SYNC, ["sharpened", "helpers"]),
    # 03.4: the learner's capture, and their reading of its error
    ("no warm-up", [("        fn(*static)  # the warm-up, on a side stream\n", "        pass\n")], CAP,
     ["no warm-up ran before the capture"]),
    ("warm-up on the default stream", [("    with cg.stream(side):\n        fn(*static)",
                                        "    if True:\n        fn(*static)")], CAP, ["default stream", "side stream"]),
    ("collector on during the capture", [("with collector_paused(), cg.graph(g):", "with cg.graph(g):")], CAP,
     ["garbage collector", "collector_paused()"]),
    ("rebinds the inputs instead of copy_", [(_COPY, "    static = list(new)\n")], CAP, ["copy_", "rebinding"]),
    ("no replay", [("    g.replay()\n", "")], CAP, ["replay the graph"]),
    ("no recover after a failure", [("        recover(stream=before, graph=g)\n", "")], CAP,
     ["capture stream is still current", "recover(stream=before, graph=g)"]),
    ("verdict inverted", [('("replays right" if right else "replays wrong")', '("replays wrong" if right else '
                                                                              '"replays right")')], CAP,
     ["you returned 'replays wrong'"]),
    ("compared with eager on the static inputs", [("torch.allclose(out, fn(*new), atol=1e-5)",
                                                   "torch.allclose(out, fn(*static), atol=1e-5)")], CAP,
     ["rotated", "the GPU says 'replays wrong'"]),
    ("capture_end's error read, not the first", [(_CONTEXT, "")], CAP, ["__context__", "capture_end"]),
    ("outermost frame", [(_GET_LINE, "    return frames[0].name, frames[0].lineno")], CAP, ["innermost"]),
    # 03.5: the fix
    ("step left a Python int", [("    return x, torch.tensor(step, device=DEV)", "    return x, step")], FIX,
     ["Python number", "as a tensor"]),
    ("math on a tensor", [("c, s = torch.cos(angle), torch.sin(angle)",
                           'c, s = __import__("math").cos(angle), __import__("math").sin(angle)')], FIX,
     ["failed to capture", "math"]),
    ("step read on the host", [("    angle = 0.1 * step\n", "    angle = 0.1 * torch.full((), float(step), "
                                                             "device=x.device)\n")], FIX,
     ["failed to capture", "float(step)"]),
    ("sign flipped", [("c * x[:, 0] - s * x[:, 1]", "c * x[:, 0] + s * x[:, 1]")], FIX, ["differs from rotated"]),
    ("angle without its scale", [("    angle = 0.1 * step\n", "    angle = step * 1.0\n")], FIX,
     ["differs from rotated"]),
]


def test_every_exercise_has_at_least_four_mutants():
    counts = {ex: sum(m[2] == ex for m in MUTANTS) for ex in (SYNC, CAP, FIX)}
    assert all(n >= 4 for n in counts.values()), counts


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m[0] for m in MUTANTS])
def test_mutant_fails_a_check_that_names_it(mutant):
    name, edits, exercise, words = mutant
    got = run_exercises(edits, until=exercise)
    assert exercise in got, f"{exercise} never ran: {sorted(got)}"
    status, out = got[exercise]
    assert status in (checks.FAIL, checks.CRASH), f"mutant {name!r} passed {exercise}:\n{out}"
    shown = out[out.index(f"✗ {exercise}"):]
    missing = [w for w in words if w not in shown]
    assert not missing, f"mutant {name!r}: the ✗ does not say {missing}:\n{shown}"


def test_a_stale_find_string_fails_loudly():
    with pytest.raises(pytest.fail.Exception, match="occurs 0 times"):
        run_exercises([("this line is in no answer", "")])


def test_the_checks_called_directly(capsys):
    """The three checks on the course's own answers, and on one wrong answer each (function level)."""
    cg = course.graphs()

    def synchronizes(fn, *args):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cg.set_sync_debug_mode("warn")
            try:
                fn(*args)
            finally:
                cg.set_sync_debug_mode("default")
        return any(D.SYNC_WARNING in str(w.message) for w in caught)

    def failing_line(error):
        cause = H.root_cause(error)
        frames = [f for f in __import__("traceback").extract_tb(cause.__traceback__) if f.filename == S.__file__]
        return frames[-1].name, frames[-1].lineno

    def fixed(x, step):
        angle = 0.1 * step
        return torch.stack((torch.cos(angle) * x[:, 0] - torch.sin(angle) * x[:, 1],
                            torch.sin(angle) * x[:, 0] + torch.cos(angle) * x[:, 1]), dim=1)

    def fixed_args(seed):
        x, step = S.get("rotated").args(seed)
        return x, torch.tensor(step, device=course.device())

    D.check_synchronizes(synchronizes)
    D.check_captures(D.reference_capture, failing_line)
    D.check_frozen_step_fix(fixed, fixed_args, D.reference_capture)
    assert capsys.readouterr().out.count(": passed") == 3
    D.check_synchronizes(lambda fn, *args: False)
    D.check_captures(D.reference_capture, lambda error: ("sharpened", 0))
    D.check_frozen_step_fix(S.rotated, lambda seed: S.get("rotated").args(seed))
    out = capsys.readouterr().out
    assert out.count("FAILED") == 3 and "active_rows_mean" not in out.split("✗ 03.3")[0], out
    assert isinstance(S.SUSPECTS[0], S.Suspect) and S.active_rows_mean(torch.ones(2, 3)).tolist() == [1.0] * 3


def _normalize_rows(x):
    peak = x.abs().amax(dim=1, keepdim=True)
    if (peak == 0).any():
        peak = torch.where(peak == 0, torch.ones_like(peak), peak)
    return x / peak.cpu().to(x.device)


def _normalize_rows_fixed(x):
    peak = x.abs().amax(dim=1, keepdim=True)
    return x / torch.where(peak == 0, torch.ones_like(peak), peak)


def test_the_first_two_checks_called_directly(capsys):
    """03.1 names a hazard the finder still sees; 03.2 names a wrong prediction with the GPU's verdict."""
    D.check_normalize(_normalize_rows_fixed, _normalize_rows)
    assert checks.status("03.1 make it capturable") == checks.PASS
    D.check_normalize(_normalize_rows, _normalize_rows)
    assert checks.status("03.1 make it capturable") == checks.FAIL
    assert "the finder still reports" in capsys.readouterr().out

    rows = {r["function"]: r for r in reference.load_reference("hazards_finder").rows}
    right = {"tensor_ctor_hazard": "fails", "pinned_frozen_hazard": "replays wrong",
             "unique_fixed": "captures"}
    D.check_predictions(lambda: right, rows)
    assert checks.status("03.2 predict the capture") == checks.PASS
    D.check_predictions(lambda: {**right, "pinned_frozen_hazard": "captures"}, rows)
    assert checks.status("03.2 predict the capture") == checks.FAIL
    assert "pinned_frozen_hazard: you said 'captures', the GPU says 'replays wrong'" in \
        capsys.readouterr().out
