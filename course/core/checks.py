"""Checked exercises: every exercise ends with a visible ✓, ✗ or "not done yet".

Usage in a notebook::

    with exercise("1. launch cost", hint="time_enqueue measures the host side"):
        assert my_answer > 0, "your launch cost should be positive"

- no exception: ✓ (pass)
- ``NotImplementedError`` (an unfinished TODO in a lab): "not done yet", and the
  notebook carries on, so a shipped lab still runs top to bottom;
- ``AssertionError`` (a wrong answer): ✗ with the hint, then the error is raised
  again so the learner sees exactly what failed.

When ``COURSE_CHECK_LOG`` names a file, every outcome is appended to it as a JSON
line; ``python -m course check`` uses that to report on a whole notebook.
"""
from __future__ import annotations

import contextlib
import json
import os

ENV_LOG = "COURSE_CHECK_LOG"
PASS, FAIL, TODO = "pass", "fail", "todo"
_MARK = {PASS: "✓", FAIL: "✗", TODO: "…"}


class ExerciseFailed(AssertionError):
    """A check failed; the message carries the hint."""


def record(name: str, status: str, message: str = "", hint: str = "") -> dict:
    """Print one check outcome and append it to the check log if one is set."""
    if status not in _MARK:
        raise ValueError(f"status must be one of {list(_MARK)}")
    entry = {"name": name, "status": status, "message": message, "hint": hint}
    label = {PASS: "passed", FAIL: "FAILED", TODO: "not done yet"}[status]
    line = f"{_MARK[status]} {name}: {label}"
    if message and status != PASS:
        line += f" ({message})"
    elif message:
        line += f" - {message}"
    print(line)
    if status != PASS and hint:
        print(f"  hint: {hint}")
    path = os.environ.get(ENV_LOG)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")
    return entry


@contextlib.contextmanager
def exercise(name: str, hint: str = ""):
    """Run the body as the check of one exercise (see module docstring)."""
    try:
        yield
    except NotImplementedError as e:
        record(name, TODO, str(e) or "the TODO still raises NotImplementedError", hint)
    except AssertionError as e:
        record(name, FAIL, str(e) or "an assertion failed", hint)
        raise ExerciseFailed(f"{name}: {e}" + (f" -- hint: {hint}" if hint else "")) from None
    else:
        record(name, PASS)


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
