"""Lesson 03's checks: 03.1, 03.2 on the finder and the zoo's recording; 03.3-03.5 on the suspects.

The learner debugs code they did not write (:mod:`.suspects`) with torch's tools first: the sync
debug mode (03.3), then a capture they write with ``cg = course.graphs()`` (03.4), then a fix
(03.5). Every check runs on both paths, and the suspects' verdicts are the GPU's on both. 03.4 first
hands the learner's capture a function with no hazard, traced
(:class:`~course.core.harness.Tracer`), so the shared capture rules can name a missing warm-up on a
side stream, fork or join, or collector pause.
"""
from __future__ import annotations

import traceback
import warnings

import torch

from course.core.capture import capture_once, recover
from course.core.checks import exercise, passed, same_result
from course.core.harness import Tracer, capture_rules, check, expect, first_line, root_cause
from course.core.runtime import graphs, torch_device
from course.core.text import clip
from course.lessons.what_breaks import suspects as S
from course.lessons.what_breaks.static import find_static

SYNC_WARNING = "called a synchronizing CUDA operation"
CAPTURE_NAME = "03.4 capture them yourself"  # 03.5 uses the learner's capture once this one passed


def _verdict(row) -> str:
    """What a trial capture did to a ``hazards_finder`` row: "fails", "replays wrong" or
    "captures"."""
    if row["capture"] != "captured":
        return "fails"
    return "replays wrong" if row["replay"] == "DIFFERS" else "captures"


# --------------------------------------------------------------------------------- 03.1, 03.2
def check_normalize(fn, reference) -> None:
    """03.1: ``fn`` computes ``reference`` (normalize_rows) and the static finder finds nothing in
    it."""
    with exercise("03.1 make it capturable", hint=[
                "a capture records device work only: a line that needs a value on the host (an if "
                "on a tensor, print, .cpu(), .item()) cannot be recorded",
                "which lines does find_static print above? each is one thing to remove or replace: "
                "an if on a tensor value becomes a choice made on the device; print and .cpu() can "
                "simply go",
                "a smaller example: `if x.max() == 0: x = x + 1` needs the host; `x = "
                "torch.where(x.max() == 0, x + 1, x)` does not"],
            answer="peak = torch.where(peak == 0, torch.ones_like(peak), peak); return x / peak"):
        x = torch.randn(6, 5, device=torch_device())
        x[2] = 0
        got, found = fn(x), find_static(fn)
        check(got, [expect("finder", lambda g: not found,
                           f"the finder still reports: {[str(f) for f in found]}"),
                    expect("values", lambda g: same_result(g, reference(x)),
                           "the values differ from normalize_rows")])


def check_predictions(predict, rows) -> None:
    """03.2: ``predict()`` says what a trial capture does to three functions, as the zoo's recording
    (``rows``: ``hazards_finder``'s rows by function) says."""
    names = ("tensor_ctor_hazard", "pinned_frozen_hazard", "unique_fixed")
    with exercise("03.2 predict the capture", hint=[
                "read each function's source: which line needs the host, and does capture refuse "
                "it or record it?",
                "pinned memory makes a copy capturable, not correct: a value read on the host at "
                "capture time is frozen",
                "a smaller example: rows = [w[i] for i in host_ids.tolist()] picks rows on the "
                "host: a capture records the rows picked then, and every replay reads those same "
                "rows, whatever the new ids"],
            answer="; ".join(f"{n}: {_verdict(rows[n])}" for n in names)):
        guesses = predict()
        missing = sorted(set(names) - set(guesses))
        check(guesses, [expect("all", lambda g: not missing,
                               f"predict every function: {missing} missing")] + [
            expect("prediction", lambda g, n=n: g[n] == _verdict(rows[n]), lambda g, n=n: (
                f"{n}: you said {g[n]!r}, the GPU says {_verdict(rows[n])!r} "
                f"({rows[n]['capture']})"))
            for n in guesses])


# --------------------------------------------------------------------------------- 03.3
def legacy_softmax(x):
    """A softmax that warns it is deprecated: a warning, but no synchronizing call."""
    warnings.warn("legacy_softmax is deprecated: use torch.softmax(x, dim=-1)", UserWarning,
                  stacklevel=2)
    return torch.softmax(x, dim=-1)


def check_synchronizes(synchronizes) -> None:
    """03.3: ``synchronizes(fn, *args)`` runs fn under torch's sync debug mode: did it
    synchronize?"""
    with exercise("03.3 which ones synchronize", hint=[
                "torch can tell you itself: it has a mode that warns at every call that makes the "
                "host wait for the GPU",
                "in synchronizes: inside warnings.catch_warnings(record=True) (and "
                "simplefilter('always')), set cg.set_sync_debug_mode('warn'), call fn(*args), set "
                "it back to 'default' in a finally; look for torch's warning text",
                "a smaller example: with warnings.catch_warnings(record=True) as caught: "
                "warnings.simplefilter('always'); x.sum().item() — caught then holds torch's "
                "warning about a synchronizing call"],
            answer="return any('synchronizing' in str(w.message) for w in caught)"):
        cg = graphs()
        cases = [(s.fn, s.args(), s.verdict == "fails", s) for s in S.SUSPECTS]
        cases.append((legacy_softmax, (torch.randn(3, 4, device=torch_device()),), False, None))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for fn, args, _, _ in cases:
                fn(*args)  # warmed up: lazy initialisation is not what is asked about
        for fn, args, syncs, suspect in cases:
            t = {"name": fn.__name__}
            try:
                t["got"] = synchronizes(fn, *args)
            except NotImplementedError:
                raise
            except RuntimeError as e:
                if SYNC_WARNING not in str(e):
                    raise
                t["error"] = first_line(e)
            t["mode"] = cg.get_sync_debug_mode()
            if t.get("error") or t["mode"] != 0:
                cg.set_sync_debug_mode(0)
            check(t, _sync_rules(fn, syncs, suspect))
        print("sharpened and active_rows_mean synchronize; rotated and legacy_softmax do not "
              "(rotated is wrong all the same: 03.4)")


def _sync_rules(fn, syncs, suspect) -> list:
    def missed(t) -> str:
        where, line = suspect.hazard_line()
        return (f"synchronizes({t['name']}) returned {t['got']!r}, but {t['name']} makes a "
                f"synchronizing call when it runs ({where}, line {line}). Run fn(*args) under "
                f"cg.set_sync_debug_mode('warn') and look for torch's warning '{SYNC_WARNING}': "
                "the mode sees calls inside helpers too, a reading of fn's source does not")

    return [
        expect("error_mode", lambda t: not t.get("error"), lambda t: (
            f"synchronizes({t['name']}) raised {t['error']}: in 'error' mode the first "
            "synchronizing call raises. Use 'warn' and read the warnings it gives (or catch that "
            "error and return True)")),
        expect("mode_left_on", lambda t: t["mode"] == 0, lambda t: (
            f"after synchronizes({t['name']}), the sync debug mode is still on: every later "
            "synchronizing call in this notebook would warn. Set it back with "
            "cg.set_sync_debug_mode('default'), in a finally: so that it is set back even when fn "
            "raises")),
        expect("missed", lambda t: not syncs or t["got"], missed),
        expect("false_alarm", lambda t: syncs or not t["got"], lambda t: (
            f"synchronizes({t['name']}) returned {t['got']!r}, but {t['name']} makes no "
            "synchronizing call" + (" (it warns about something else: a deprecation). Count only "
                                    f"torch's warning '{SYNC_WARNING}'" if fn is legacy_softmax else
                                    ": it is wrong in another way, which no sync shows (exercise "
                                    "03.4)"))),
    ]


# --------------------------------------------------------------------------------- 03.4
def probe():
    """A function with no hazard, ``relu(x @ w) + 1``, and ``make_args(seed)``: new x, the same
    w."""
    w = torch.randn(4, 3, generator=torch.Generator().manual_seed(7)).to(torch_device())

    def make_args(seed: int = 0) -> tuple:
        g = torch.Generator().manual_seed(100 + seed)
        return torch.randn(5, 4, generator=g).to(torch_device()), w

    return (lambda x, w: torch.relu(x @ w) + 1), make_args


def reference_capture(fn, make_args):
    """The course's answer to 03.4: capture ``fn(*make_args(0))``, replay on ``make_args(1)``;
    (verdict, error)."""
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
    """The learner's capture of a function with no hazard, traced: the capture rules kept, the new
    inputs copied in, replayed, and judged right."""
    fn, make_args = probe()
    with Tracer() as t:
        watched = t.wrap(fn, "probe")
        verdict, error = capture_and_replay(watched, make_args)
    why = first_line(root_cause(error)) if isinstance(error, BaseException) else error
    check(t, capture_rules("probe", "fn") + [
        expect("no_hazard_failed", lambda t: verdict != "fails",
               f"your capture of a function with no hazard (relu(x @ w) + 1) failed: {why}")])
    captured = next(e for e in t.of("probe") if e["where"] == "capture")
    new = make_args(1)
    check(captured, [
        expect("input_not_copied", lambda c: torch.equal(c["args"][0], new[0]), (
            "after the capture, the static input does not hold the new inputs: the graph reads the "
            "memory it was captured with, so write the new values into it with static.copy_(new) "
            "(rebinding a name changes nothing the graph reads)")),
        expect("no_replay", lambda c: torch.allclose(c["output"], fn(*new), atol=1e-5), (
            "the static inputs hold the new values, but the output of your capture does not follow "
            "them: replay the graph (g.replay()) before you compare its output with fn on the new "
            "inputs")),
        expect("verdict", lambda c: verdict == "replays right", (
            "your capture replayed a function with no hazard right (its output equals fn on the "
            f"new inputs), but you returned {verdict!r}: compare the replayed output with "
            "fn(*new) (torch.allclose) and say 'replays right'"))])


def _suspect_frames(error) -> list:
    return [f for f in traceback.extract_tb(error.__traceback__) if f.filename == S.__file__]


def _reading_hint(s, error, said: str, got=None) -> str:
    outer = _suspect_frames(root_cause(error))
    if got is not None and outer and got == (outer[0].name, outer[0].lineno) and len(outer) > 1:
        return (f"{said}: {s.name} only called the function that broke the capture. Take the "
                "innermost frame of the suspects' code in the traceback (the last one), not the "
                "outermost")
    if root_cause(error) is not error and not _suspect_frames(error):
        return (f"{said}. The error that ends the `with cg.graph(...)` block is capture_end's "
                f"({clip(first_line(error), 90)}): it was raised while handling the first one. "
                "That first error, error.__context__ (follow it to the end of the chain), broke "
                "the capture; read its traceback")
    return (f"{said}: read the traceback of the first error (traceback.extract_tb), in the "
            "suspects' own file")


def check_captures(capture_and_replay, failing_line) -> None:
    """03.4: the learner's capture gives each suspect the GPU's verdict, and their reading of the
    error its line."""
    with exercise(CAPTURE_NAME, hint=[
                "a capture of your own: warm up, capture, and on new inputs replay and compare "
                "with eager; when it fails, the error's traceback says where",
                "in capture_and_replay: warm up on a side stream; capture fn on the static inputs "
                "in cg.graph(g) with the collector paused, in a try whose except recovers (the "
                "stream that was current, the graph) and returns ('fails', e); else copy_ the new "
                "inputs in, replay, compare with fn(*new). failing_line: follow error.__context__ "
                "to the first error, then its traceback",
                "a smaller example: try: {}['k'] except KeyError: try: 1 / 0 except "
                "ZeroDivisionError as e: err = e — err.__context__ is the KeyError, and "
                "traceback.extract_tb(err.__context__.__traceback__)[-1].lineno its line"],
            answer="while error.__context__ is not None: error = error.__context__; frames = [f "
                   "for f in traceback.extract_tb(error.__traceback__) if f.filename == "
                   "suspects.__file__]; return frames[-1].name, frames[-1].lineno"):
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
            left = not cg.current_stream() == before
            if left:
                recover(stream=before)
            cause = root_cause(error) if isinstance(error, BaseException) else None
            check(verdict, [
                expect("stream_left", lambda v: not left, (
                    f"after {s.name}'s capture failed, the capture stream is still current: every "
                    "later op, and your next capture, would run on it. In your except: "
                    "recover(stream=before, graph=g) (on a GPU it also takes the random generator "
                    "out of capture mode)")),
                expect("verdict", lambda v: v == s.verdict, lambda v: (
                    f"{s.name}: your capture says {v!r}, the GPU says {s.verdict!r}"
                    + (f" ({first_line(cause)})" if cause is not None else "")))])
            if s.verdict != "fails":
                continue
            check(error, [
                expect("error", lambda e: cause is not None,
                       f"{s.name}: return the error itself with 'fails', got {error!r}"),
                expect("error", lambda e: s.error in str(cause),
                       lambda e: f"{s.name} failed with {first_line(cause)}, not '{s.error}'")])
            _check_reading(s, error, failing_line)
            where, line = s.hazard_line()
            print(f"{s.name}: {verdict} at {where}, line {line}: {clip(first_line(cause), 110)}")
        print("rotated: replays wrong, with no error at all")


def _check_reading(s, error, failing_line) -> None:
    """The learner's ``failing_line(error)`` names the suspect's line that broke the capture."""
    try:
        got, raised = failing_line(error), None
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001 - a reading that breaks on the real error is the defect
        got, raised = None, first_line(e)
    want = s.hazard_line()
    check(got, [
        expect("reading_raised", lambda g: raised is None,
               lambda g: _reading_hint(s, error, f"failing_line raised {raised}")),
        expect("reading", lambda g: g == want, lambda g: _reading_hint(
            s, error, f"for {s.name} you named {g!r}, the capture broke at {want!r}", g))])


# --------------------------------------------------------------------------------- 03.5
def check_frozen_step_fix(rotated_fixed, fixed_args, capture_and_replay=None) -> None:
    """03.5: ``rotated_fixed`` computes ``rotated``; with its inputs from ``fixed_args`` it captures
    and replays right (with the learner's capture of 03.4 once that passed, else the course's)."""
    with exercise("03.5 fix the frozen step", hint=[
                "what is frozen at capture is what the graph cannot read at replay: a Python "
                "number. What can a replay read new values from?",
                "pass the step as a tensor on the device (fixed_args) and compute the angle, its "
                "cos and sin with torch ops: no float(), no .item(), no math on a tensor",
                "a smaller example: math.cos(0.1 * step) is a number fixed at capture; "
                "torch.cos(0.1 * step_t), with step_t a device tensor refilled with copy_, is "
                "recomputed at every replay"],
            answer="angle = 0.1 * step; c, s = torch.cos(angle), torch.sin(angle); in fixed_args: "
                   "torch.tensor(step, device=course.device())"):
        rot = S.get("rotated")
        for seed in range(3):
            args = fixed_args(seed)
            x, step = rot.args(seed)
            kinds = [type(a).__name__ for a in args if not isinstance(a, torch.Tensor)]
            check(kinds, [expect("python_number", lambda k: not k, lambda k: (
                f"fixed_args({seed}) gives a Python {k[0]} among the inputs: a graph reads only "
                "tensor memory at replay, so a Python number is frozen at capture. Give the step "
                "as a tensor"))])
            got, want = rotated_fixed(*args), S.rotated(x, step)
            check(got, [
                expect("values", lambda g: tuple(g.shape) == tuple(want.shape)
                       and torch.allclose(g.float(), want, atol=1e-5),
                       f"rotated_fixed(*fixed_args({seed})) differs from rotated(x, {step}): same "
                       "rotation, step as a tensor")])
        mine = capture_and_replay is not None and passed(CAPTURE_NAME)
        harness = capture_and_replay if mine else reference_capture
        verdict, error = harness(rotated_fixed, fixed_args)
        cause = root_cause(error) if verdict == "fails" else None
        frames = [f for f in traceback.extract_tb(cause.__traceback__)
                  if f.name == rotated_fixed.__name__] if cause is not None else []
        where = f" at `{frames[-1].line}`" if frames else ""
        found = find_static(rotated_fixed)
        check(verdict, [
            expect("capture_failed", lambda v: v != "fails", lambda v: (
                f"rotated_fixed failed to capture{where}: keep the step on the device (no float(), "
                f".item() or math.* on a tensor). The error: {clip(first_line(cause), 120)}")),
            expect("replays_wrong", lambda v: v == "replays right",
                   f"captured, rotated_fixed replays wrong on new inputs ({verdict!r})"),
            expect("finder", lambda v: not found,
                   f"the static finder still reports: {[str(f) for f in found]}")])
        whose = "your capture of 03.4" if mine else "the course's capture (03.4 not passed)"
        print(f"rotated_fixed: captured once, right on new inputs ({whose})")
