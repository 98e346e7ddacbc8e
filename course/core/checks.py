"""Checked exercises: every exercise ends with a visible ✓, ✗ or "not done yet", and never lies.

Usage in a notebook::

    with exercise("1. launch cost", hint=["the rule", "where", "an example"], answer="the line"):
        assert my_answer > 0, "your launch cost should be positive"

No exception: ✓; ``NotImplementedError``: "not done yet"; ``AssertionError`` (a harness ``Defect``
names its rule): ✗ failed, with the hint's next stage; any other error: ✗ crashed, in one line with
the learner's own line (``COURSE_TRACEBACK=1``: every frame). The notebook goes on either way.
``raise_on_fail=True``, nbgrader's autograder (``NBGRADER_EXECUTION``) and the suite's gate
(``COURSE_GATE``: ``learner`` or ``answers``) make a ✗ (and for answers "not done yet") raise.
Staged hints advance with each ✗, from ``COURSE_HINT_STAGES`` when ``course check`` carries them;
the answer is shown only on request (:mod:`course.core.answers`). Outcomes are kept for the session
(:func:`status`, :func:`progress`) and appended to ``COURSE_CHECK_LOG`` when set.
"""
from __future__ import annotations

import contextlib
import json
import linecache
import os
import sys
import sysconfig
import traceback

from course.core.answers import forget, remember, requested, offer, show_answer  # noqa: F401 - show_answer: notebooks' door

ENV_LOG = "COURSE_CHECK_LOG"
ENV_TRACEBACK = "COURSE_TRACEBACK"
# set by nbgrader while it autogrades: then every ✗ and TODO raises
ENV_NBGRADER = "NBGRADER_EXECUTION"
ENV_GATE = "COURSE_GATE"  # set by the test suite's gate: "learner" (✗ raises) or "answers" (✗ and TODO raise)
# JSON {exercise: ✗ so far}, set by `course check`: where each staged hint starts
ENV_STAGES = "COURSE_HINT_STAGES"
PASS, FAIL, TODO, CRASH, SKIP = "pass", "fail", "todo", "crash", "skip"
_MARK = {PASS: "✓", FAIL: "✗", TODO: "…", CRASH: "✗", SKIP: "-"}
_LABEL = {PASS: "passed", FAIL: "FAILED", TODO: "not done yet", CRASH: "CRASHED", SKIP: "skipped"}
_SESSION: dict = {}  # exercise name -> {"status", "message", "failures"} for this Python session

_CRASH_HINTS = {
    "IndexError": "an index went outside an array. The simulator checks every access (on a "
                  "GPU the same bug silently reads or writes memory that is not yours): "
                  "check the guard (`<`, not `<=`) and that a bad id never indexes the table.",
    "NameError": "a name is not defined here: run the cells above "
                 "this one (Run All), or check the spelling.",
    "TypeError": "a call got the wrong number or type of arguments: "
                 "compare it with the function's docstring.",
    "AttributeError": "an object has no such attribute: check its "
                      "type (print(type(x))) and the spelling.",
    "ZeroDivisionError": "a division by zero: which value can be 0 here?",
    "RuntimeError": "PyTorch or Numba refused an operation: "
                    "the message says which; look at your line.",
    "ValueError": "a function got a value it does not accept: the message says which.",
}


class ExerciseFailed(AssertionError):
    """A check failed; the message carries the hint (only with ``raise_on_fail=True``)."""


def carried_failures(name: str) -> int:
    """The ✗ of exercise ``name`` in earlier runs, from ``COURSE_HINT_STAGES`` (0 when unset or
    unreadable)."""
    try:
        n = json.loads(os.environ.get(ENV_STAGES) or "{}").get(name, 0)
    except (ValueError, AttributeError):  # a bad value must never break the learner's notebook
        return 0
    return n if isinstance(n, int) and n > 0 else 0


def failures(name: str) -> int:
    """How many times exercise ``name`` has failed or crashed: in this session, plus those carried
    in."""
    return _SESSION[name]["failures"] if name in _SESSION else carried_failures(name)


def _hint_stage(name: str, hint) -> str:
    """The hint to show for this ✗: the next stage of a staged (list) hint, the offer of the answer
    after the last."""
    if not hint:
        return ""
    if isinstance(hint, str):
        return hint + offer(name)
    stages = list(hint)
    i = min(failures(name), len(stages) - 1)
    tail = " (run the check again after a change for the next hint)" if i < len(stages) - 1 else offer(name)
    return f"[{i + 1}/{len(stages)}] {stages[i]}{tail}"


def record(name: str, status: str, message: str = "", hint: str = "", **extra) -> dict:
    """Print one check outcome, remember it for the session, append it to the check log if set."""
    if status not in _MARK:
        raise ValueError(f"status must be one of {list(_MARK)}")
    count = failures(name) + (status in (FAIL, CRASH))
    entry = {"name": name, "status": status, "message": message, "hint": hint, **extra, "failures": count}
    line = f"{_MARK[status]} {name}: {_LABEL[status]}"
    if message and status != PASS:
        line += f" ({message})"
    elif message:
        line += f" - {message}"
    print(line)
    if extra.get("where"):
        print(f"  your line: {extra['where']}")
    if extra.get("why"):
        print(f"  why: {extra['why']}")
    if status != PASS and hint:
        print(f"  hint: {hint}")
    if extra.get("answer"):
        print(f"  answer (you asked for it): {extra['answer']}")
    _SESSION[name] = {"status": status, "message": message, "failures": count}
    path = os.environ.get(ENV_LOG)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")
    return entry


def skip(name: str, why: str) -> dict:
    """Record that exercise ``name`` cannot run on this machine (e.g. it needs a GPU), and why."""
    return record(name, SKIP, why)


def status(name: str):
    """The latest outcome of exercise ``name`` in this session ("pass", "fail", "crash", "todo"), or
    None."""
    return _SESSION.get(name, {}).get("status")


def passed(name: str) -> bool:
    """True when the latest check of exercise ``name`` in this session passed."""
    return status(name) == PASS


def progress() -> dict:
    """Every exercise checked in this session -> its latest outcome, in the order first checked."""
    return {k: v["status"] for k, v in _SESSION.items()}


def describe(name: str) -> str:
    """One line for "What you measured": the latest outcome of ``name``, in words."""
    s = status(name)
    return {None: "not checked yet (run its check cell)", PASS: "passed its check",
            FAIL: "checked, FAILED (see its ✗)", CRASH: "checked, CRASHED (see its ✗)",
            TODO: "not done yet", SKIP: "skipped on this machine"}[s]


def reset() -> None:
    """Forget every outcome of this session, and the answers its checks remembered (tests use it).
    """
    _SESSION.clear()
    forget()


_LIB_DIRS = tuple(os.path.realpath(p) + os.sep for p in {
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # course/
    sys.prefix, sys.base_prefix, sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"]} if p)


def _is_library(filename: str) -> bool:
    if filename.startswith("<frozen") or "site-packages" in filename or "dist-packages" in filename:
        return True
    real = os.path.realpath(filename) if not filename.startswith("<") else filename
    return real.startswith(_LIB_DIRS)


def learner_frame(exc: BaseException):
    """(filename, line number, function, source line) of the deepest frame of the learner's own
    code, or None."""
    found = None
    for fs in traceback.extract_tb(exc.__traceback__):
        if not _is_library(fs.filename):
            found = fs
    if found is None:
        return None
    text = (found.line or linecache.getline(found.filename, found.lineno)).strip()
    return found.filename, found.lineno, found.name, text


def crash_summary(exc: BaseException) -> dict:
    """A crash in one line: ``message`` (type: first line), ``where`` (the learner's line), ``why``
    (a hint)."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    message = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    where = ""
    fr = learner_frame(exc)
    if fr is not None:
        _, lineno, func, text = fr
        where = (f"{func}(), " if func != "<module>" else "") + f"line {lineno} of its cell" + \
            (f": {text}" if text else "")
    why = _CRASH_HINTS.get(type(exc).__name__, "read the message and the line it points at.")
    if not where:  # no line of the learner's in the traceback: never point them at one
        what = why.split(":")[0].split(";")[0].rstrip(".") if type(exc).__name__ in _CRASH_HINTS else "an error"
        why = (f"{what}. It was raised inside the course's code, with no "
               "line of yours in between: read the message for what your "
               "code handed over (a tensor, a graph) and how it was made.")
    return {"message": message, "where": where, "why": why}


def raising_statuses(raise_on_fail: bool = False) -> set:
    """The outcomes that :func:`exercise` re-raises here: by ``raise_on_fail``, nbgrader, and the
    suite's gate."""
    out = {FAIL} if raise_on_fail else set()
    if os.environ.get(ENV_NBGRADER):
        out |= {FAIL, CRASH, TODO}
    gate = os.environ.get(ENV_GATE, "")
    if gate in ("learner", "answers"):
        out |= {FAIL, CRASH} | ({TODO} if gate == "answers" else set())
    elif gate:
        raise ValueError(f"{ENV_GATE}={gate!r}: use 'learner' or 'answers' (or leave it unset)")
    return out


@contextlib.contextmanager
def exercise(name: str, hint="", answer: str = "", *, raise_on_fail: bool = False):
    """Run the body as the check of one exercise (see the module docstring): ✓, ✗ or "not done yet".
    The body gets a list whose items are the ✓ line's note; ``answer`` is printed only when asked
    for (:func:`course.core.answers.requested`); hints follow a ✗ only."""
    remember(name, answer)
    shown = {"answer": answer} if answer and requested(name) else {}
    raising = raising_statuses(raise_on_fail)
    strict = raise_on_fail or CRASH in raising  # a ✗ re-raised: no "the notebook goes on" note
    caught, notes = None, []
    try:
        yield notes
    except NotImplementedError as e:
        entry = record(name, TODO, str(e) or "the TODO still raises NotImplementedError", **shown)
    except AssertionError as e:  # a harness Defect names its rule (course.core.harness)
        entry = record(name, FAIL, str(e) or "an assertion failed", _hint_stage(name, hint),
                       **({"rule": e.rule} if getattr(e, "rule", "") else {}), **shown)
    except Exception as e:  # noqa: BLE001 - any crash of the learner's code is a ✗, not a stop
        caught = e
        info = crash_summary(e)
        entry = record(name, CRASH, info["message"], _hint_stage(name, hint), where=info["where"], why=info["why"],
                       **shown)
        if os.environ.get(ENV_TRACEBACK):
            traceback.print_exception(e)
        elif not strict:
            print("  (library frames hidden; the notebook goes on. "
                  "COURSE_TRACEBACK=1 shows the full traceback.)")
    else:
        record(name, PASS, " ".join(str(n) for n in notes), **shown)
        return
    if entry["status"] in raising:
        gate = os.environ.get(ENV_GATE)
        why = {"answers": " [the test suite's gate: an answer version must pass every exercise]",
               "learner": " [the test suite's gate: a learner "
                          "version may say 'not done yet', never ✗]"}.get(gate, "")
        raise ExerciseFailed(f"{name}: {entry['message']}" + (f" -- hint: {entry['hint']}" if entry["hint"] else "")
                             + why) from (caught if entry["status"] == CRASH else None)


def own(fn):
    """The learner's own function behind a fallback wrapper (or ``fn`` itself): checks test this,
    never a substitute."""
    seen = 0
    while getattr(fn, "__course_learner__", None) is not None and seen < 10:
        fn, seen = fn.__course_learner__, seen + 1
    return fn


def close(actual, expected, *, rtol: float = 1e-5, atol: float = 1e-8, what: str = "result") -> None:
    """Assert two tensors/arrays match, with a message that says where they differ."""
    import torch

    a = torch.as_tensor(actual).detach().cpu()
    e = torch.as_tensor(expected).detach().cpu()
    assert tuple(a.shape) == tuple(e.shape), f"{what} has shape {tuple(a.shape)}, expected {tuple(e.shape)}"
    assert a.dtype == e.dtype, f"{what} has dtype {a.dtype}, expected {e.dtype}"
    if a.dtype.is_floating_point:
        bad = ~torch.isclose(a.float(), e.float(), rtol=rtol, atol=atol, equal_nan=True)
    else:
        bad = a != e
    if bad.any():
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(f"{what} differs at {int(bad.sum())} of {a.numel()} positions; "
                             f"first at index {idx}: got {a[idx].item()}, expected {e[idx].item()}")


def flat_tensors(out) -> list:
    """The tensors in a function's output (a tensor, or a tuple/list of them), in order."""
    import torch

    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in flat_tensors(o)]
    return []


def same_result(a, b, rtol: float = 1e-4, atol: float = 1e-5) -> bool:
    """True when two outputs hold the same values (compared on the CPU, any device)."""
    import torch

    ta, tb = flat_tensors(a), flat_tensors(b)
    if len(ta) != len(tb):
        return False
    for p, q in zip(ta, tb):
        p, q = p.detach().cpu(), q.detach().cpu()
        if p.shape != q.shape or not torch.allclose(p.float(), q.float(), rtol=rtol, atol=atol):
            return False
    return True
