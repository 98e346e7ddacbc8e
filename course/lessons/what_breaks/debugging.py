"""Lesson 03's debugging exercises: the checks of 03.3 to 03.5, on the suspects of :mod:`.suspects`.

The learner debugs code they did not write with torch's own tools first: the sync debug mode (03.3), then a capture
they write with ``cg = course.graphs()`` and the error it raises (03.4), then fixes the one that replays wrong
(03.5). Every check runs on both paths: ``cg`` is ``torch.cuda`` on a GPU and the simulator's graphs otherwise, and
the suspects' verdicts are the GPU's on both. A :class:`Probe` (a function with no hazard that records how it was
called, :mod:`course.core.capturecheck`) lets 03.4's check see whether the learner's capture warmed up on a side
stream, kept the collector off, copied the new inputs in and replayed. Hints are staged: the rule, where, a smaller example; the answer on request.
"""
from __future__ import annotations

import traceback
import warnings

import torch

from course.core.capture import capture_once, recover
from course.core.capturecheck import Watched, assert_captured_well, first_line, root_cause
from course.core.checks import exercise, passed
from course.core.runtime import graphs, torch_device
from course.core.text import clip
from course.lessons.what_breaks import suspects as S
from course.lessons.what_breaks.static import find_static

SYNC_WARNING = "called a synchronizing CUDA operation"
CAPTURE_NAME = "03.4 capture them yourself"  # 03.5 uses the learner's capture once this one passed


def legacy_softmax(x):
    """A softmax that warns it is deprecated: a warning, but no synchronizing call."""
    warnings.warn("legacy_softmax is deprecated: use torch.softmax(x, dim=-1)", UserWarning, stacklevel=2)
    return torch.softmax(x, dim=-1)


# --------------------------------------------------------------------------- 03.3 the sync debug mode

def check_synchronizes(synchronizes) -> None:
    """03.3: ``synchronizes(fn, *args)`` runs fn under torch's sync debug mode and says whether it synchronized."""
    with exercise("03.3 which ones synchronize", hint=[
                "torch can tell you itself: it has a mode that warns at every call that makes the host wait for the "
                "GPU",
                "in synchronizes: inside warnings.catch_warnings(record=True) (and simplefilter('always')), set "
                "cg.set_sync_debug_mode('warn'), call fn(*args), set it back to 'default' in a finally; look for "
                "torch's warning text",
                "a smaller example: with warnings.catch_warnings(record=True) as caught: "
                "warnings.simplefilter('always'); x.sum().item() — caught then holds torch's warning about a "
                "synchronizing call"],
            answer="return any('synchronizing' in str(w.message) for w in caught)"):
        cg = graphs()
        cases = [(s.fn, s.args(), s.verdict == "fails", s) for s in S.SUSPECTS]
        cases.append((legacy_softmax, (torch.randn(3, 4, device=torch_device()),), False, None))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for fn, args, _, _ in cases:
                fn(*args)  # warmed up: lazy initialisation is not what is asked about
        for fn, args, syncs, suspect in cases:
            try:
                got = synchronizes(fn, *args)
            except NotImplementedError:
                raise
            except RuntimeError as e:
                if SYNC_WARNING not in str(e):
                    raise
                _mode_off(cg)
                raise AssertionError(
                    f"synchronizes({fn.__name__}) raised {first_line(e)}: in 'error' mode the first synchronizing "
                    "call raises. Use 'warn' and read the warnings it gives (or catch that error and return True)"
                ) from None
            if cg.get_sync_debug_mode() != 0:
                _mode_off(cg)
                raise AssertionError(
                    f"after synchronizes({fn.__name__}), the sync debug mode is still on: every later synchronizing "
                    "call in this notebook would warn. Set it back with cg.set_sync_debug_mode('default'), in a "
                    "finally: so that it is set back even when fn raises")
            if syncs and not got:
                where, line = suspect.hazard_line()
                raise AssertionError(
                    f"synchronizes({fn.__name__}) returned {got!r}, but {fn.__name__} makes a synchronizing call when "
                    f"it runs ({where}, line {line}). Run fn(*args) under cg.set_sync_debug_mode('warn') and look "
                    f"for torch's warning '{SYNC_WARNING}': the mode sees calls inside helpers too, a reading of "
                    "fn's source does not")
            if got and not syncs:
                raise AssertionError(
                    f"synchronizes({fn.__name__}) returned {got!r}, but {fn.__name__} makes no synchronizing call"
                    + (" (it warns about something else: a deprecation). Count only torch's warning "
                       f"'{SYNC_WARNING}'" if fn is legacy_softmax else
                       ": it is wrong in another way, which no sync shows (exercise 03.4)"))
        print("sharpened and active_rows_mean synchronize; rotated and legacy_softmax do not "
              "(rotated is wrong all the same: 03.4)")


def _mode_off(cg) -> None:
    cg.set_sync_debug_mode(0)


# --------------------------------------------------------------------------- 03.4 the learner's capture

class Probe(Watched):
    """A function with no hazard, ``relu(x @ w) + 1``, watched (:class:`course.core.capturecheck.Watched`)."""

    def __init__(self):
        self.w = torch.randn(4, 3, generator=torch.Generator().manual_seed(7)).to(torch_device())
        super().__init__(lambda x, w: torch.relu(x @ w) + 1, "probe")

    def args(self, seed: int = 0) -> tuple:
        """The probe's inputs: new x for each seed, the same weight."""
        g = torch.Generator().manual_seed(100 + seed)
        return torch.randn(5, 4, generator=g).to(torch_device()), self.w


def reference_capture(fn, make_args):
    """The course's answer to 03.4: capture ``fn(*make_args(0))``, replay on ``make_args(1)``; (verdict, error)."""
    static = list(make_args(0))
    try:
        g, out = capture_once(fn, *static)
    except Exception as e:  # noqa: BLE001 - the verdict is the error
        return "fails", e
    new = make_args(1)
    for s, n in zip(static, new):
        if isinstance(s, torch.Tensor):
            s.copy_(n)
    g.replay()
    return ("replays right" if torch.allclose(out, fn(*new), atol=1e-5) else "replays wrong"), None


def _check_probe(capture_and_replay) -> None:
    """The learner's capture of a function with no hazard: warmed up on a side stream, captured with the collector
    off, the new inputs copied in, replayed, and judged right."""
    probe = Probe()
    verdict, error = capture_and_replay(probe, probe.args)
    assert_captured_well(probe)
    if verdict == "fails":
        raise AssertionError(f"your capture of a function with no hazard (relu(x @ w) + 1) failed: "
                             f"{first_line(root_cause(error)) if isinstance(error, BaseException) else error}")
    new = probe.args(1)
    assert torch.equal(probe.static[0], new[0]), (
        "after the capture, the static input does not hold the new inputs: the graph reads the memory it was "
        "captured with, so write the new values into it with static.copy_(new) (rebinding a name changes nothing "
        "the graph reads)")
    want = probe(*new)
    assert torch.allclose(probe.output, want, atol=1e-5), (
        "the static inputs hold the new values, but the output of your capture does not follow them: replay the "
        "graph (g.replay()) before you compare its output with fn on the new inputs")
    assert verdict == "replays right", (
        f"your capture replayed a function with no hazard right (its output equals fn on the new inputs), but you "
        f"returned {verdict!r}: compare the replayed output with fn(*new) (torch.allclose) and say 'replays right'")


def check_captures(capture_and_replay, failing_line) -> None:
    """03.4: the learner's capture gives each suspect the GPU's verdict, and their reading of the error its line."""
    with exercise("03.4 capture them yourself", hint=[
                "a capture of your own: warm up, capture, and on new inputs replay and compare with eager; when it "
                "fails, the error's traceback says where",
                "in capture_and_replay: warm up on a side stream; capture fn on the static inputs in cg.graph(g) with "
                "the collector paused, in a try whose except recovers (the stream that was current, the graph) and "
                "returns ('fails', e); else copy_ the new inputs in, replay, compare with fn(*new). failing_line: "
                "follow error.__context__ to the first error, then its traceback",
                "a smaller example: try: {}['k'] except KeyError: try: 1 / 0 except ZeroDivisionError as e: err = e —"
                " err.__context__ is the KeyError, and traceback.extract_tb(err.__context__.__traceback__)[-1].lineno"
                " its line"],
            answer="while error.__context__ is not None: error = error.__context__; frames = [f for f in "
                   "traceback.extract_tb(error.__traceback__) if f.filename == suspects.__file__]; return "
                   "frames[-1].name, frames[-1].lineno"):
        cg = graphs()
        before = cg.current_stream()
        try:
            _check_probe(capture_and_replay)
        finally:
            if not cg.current_stream() == before:
                recover(stream=before)
        for s in S.SUSPECTS:
            before = cg.current_stream()
            verdict, error = capture_and_replay(s.fn, s.args)
            if not cg.current_stream() == before:
                recover(stream=before)
                raise AssertionError(
                    f"after {s.name}'s capture failed, the capture stream is still current: every later op, and "
                    "your next capture, would run on it. In your except: recover(stream=before, graph=g) (on a GPU "
                    "it also takes the random generator out of capture mode)")
            assert verdict == s.verdict, (
                f"{s.name}: your capture says {verdict!r}, the GPU says {s.verdict!r}"
                + (f" ({first_line(root_cause(error))})" if isinstance(error, BaseException) else ""))
            if s.verdict != "fails":
                continue
            assert isinstance(error, BaseException), f"{s.name}: return the error itself with 'fails', got {error!r}"
            cause = root_cause(error)
            assert s.error in str(cause), f"{s.name} failed with {first_line(cause)}, not '{s.error}'"
            try:
                got = failing_line(error)
            except NotImplementedError:
                raise
            except Exception as e:  # noqa: BLE001 - a reading that breaks on the real error is this step's defect
                raise AssertionError(_reading_hint(s, error, f"failing_line raised {first_line(e)}")) from None
            want = s.hazard_line()
            if got != want:
                raise AssertionError(_reading_hint(s, error, f"for {s.name} you named {got!r}, the capture broke at "
                                                             f"{want!r}", got))
            print(f"{s.name}: {verdict} at {want[0]}, line {want[1]}: {clip(first_line(cause), 110)}")
        print("rotated: replays wrong, with no error at all")


def _reading_hint(s, error, said: str, got=None) -> str:
    outer = _suspect_frames(root_cause(error))
    if got is not None and outer and got == (outer[0].name, outer[0].lineno) and len(outer) > 1:
        return (f"{said}: {s.name} only called the function that broke the capture. Take the innermost frame of "
                "the suspects' code in the traceback (the last one), not the outermost")
    if root_cause(error) is not error and not _suspect_frames(error):
        return (f"{said}. The error that ends the `with cg.graph(...)` block is capture_end's "
                f"({clip(first_line(error), 90)}): it was raised while handling the first one. That first error, "
                "error.__context__ (follow it to the end of the chain), broke the capture; read its traceback")
    return f"{said}: read the traceback of the first error (traceback.extract_tb), in the suspects' own file"


def _suspect_frames(error) -> list:
    return [f for f in traceback.extract_tb(error.__traceback__) if f.filename == S.__file__]


# --------------------------------------------------------------------------- 03.5 the fix

def check_frozen_step_fix(rotated_fixed, fixed_args, capture_and_replay=None) -> None:
    """03.5: ``rotated_fixed`` computes ``rotated``; with its inputs from ``fixed_args`` it captures and replays right
    (with the learner's capture of 03.4 once that passed, else the course's)."""
    with exercise("03.5 fix the frozen step", hint=[
                "what is frozen at capture is what the graph cannot read at replay: a Python number. What can a "
                "replay read new values from?",
                "pass the step as a tensor on the device (fixed_args) and compute the angle, its cos and sin with "
                "torch ops: no float(), no .item(), no math on a tensor",
                "a smaller example: math.cos(0.1 * step) is a number fixed at capture; torch.cos(0.1 * step_t), with "
                "step_t a device tensor refilled with copy_, is recomputed at every replay"],
            answer="angle = 0.1 * step; c, s = torch.cos(angle), torch.sin(angle); in fixed_args: torch.tensor(step, "
                   "device=course.device())"):
        rot = S.get("rotated")
        for seed in range(3):
            args = fixed_args(seed)
            x, step = rot.args(seed)
            kinds = [type(a).__name__ for a in args if not isinstance(a, torch.Tensor)]
            assert not kinds, (f"fixed_args({seed}) gives a Python {kinds[0]} among the inputs: a graph reads only "
                               "tensor memory at replay, so a Python number is frozen at capture. Give the step as a "
                               "tensor")
            got, want = rotated_fixed(*args), S.rotated(x, step)
            assert tuple(got.shape) == tuple(want.shape) and torch.allclose(got.float(), want, atol=1e-5), (
                f"rotated_fixed(*fixed_args({seed})) differs from rotated(x, {step}): same rotation, step as a tensor")
        harness = capture_and_replay if capture_and_replay is not None and passed(CAPTURE_NAME) else reference_capture
        verdict, error = harness(rotated_fixed, fixed_args)
        if verdict == "fails":
            cause = root_cause(error)
            frames = [f for f in traceback.extract_tb(cause.__traceback__) if f.name == rotated_fixed.__name__]
            where = f" at `{frames[-1].line}`" if frames else ""
            raise AssertionError(f"rotated_fixed failed to capture{where}: keep the step on the device (no float(), "
                                 f".item() or math.* on a tensor). The error: {clip(first_line(cause), 120)}")
        assert verdict == "replays right", f"captured, rotated_fixed replays wrong on new inputs ({verdict!r})"
        found = find_static(rotated_fixed)
        assert not found, f"the static finder still reports: {[str(f) for f in found]}"
        whose = "your capture of 03.4" if harness is not reference_capture else "the course's capture (03.4 not passed)"
        print(f"rotated_fixed: captured once, right on new inputs ({whose})")
