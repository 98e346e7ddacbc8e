"""Lab 2's captures, written by the learner: the device lookup captured and replayed, the cpu-copy
one refused.

The learner writes ``capture(fn, *static)`` with ``cg = course.graphs()``: a warm-up on a side
stream, ``cg.graph(g)`` with the collector off, and on failure the stream put back and the error
raised. Both checks run on the course's harness (:mod:`course.core.harness`): :func:`check_capture`
traces the lookup's calls and judges them by :data:`CAPTURE_RULES` (the shared capture rules, then
the replays and a failed capture), and :func:`check_cpu_copy_error` judges the error the learner
recorded by :data:`ERROR_RULES`.
"""
from __future__ import annotations

import inspect
import traceback

import torch
import torch.nn.functional as F

from course.core.capture import capture_once, recover
from course.core.harness import Rule, Tracer, capture_rules, check, first_line, root_cause
from course.core.runtime import torch_device
from course.core.text import clip

REFUSED_COPY = "Cannot copy between CPU and CUDA tensors during CUDA graph capture"
REFUSED_READ = "operation not permitted when stream is capturing"
WHAT = "the lookup"


def capture(fn, *static):
    """The course's answer to exercise 4: ``(graph, static output)``
    (:func:`course.core.capture.capture_once`)."""
    return capture_once(fn, *static)


def _host_read(ids, weight):
    """A lookup that reads a device value on the host: a capture refuses it."""
    return weight[ids] * float(ids.max() >= 0)


def _output(t) -> str:
    captured = [e["output"] for e in t.of(WHAT) if e["where"] == "capture"]
    return "" if captured and t.returned is captured[-1] else (
        "return the output of the captured call itself (out = fn(*static) "
        "inside `with cg.graph(g):`): every replay writes its result "
        "there; a copy or the output of another call never changes")


def _replays(t) -> str:
    for trial in range(3):
        new = torch.randint(0, t.vocab, tuple(t.static_ids.shape), generator=t.gen).to(t.static_ids.device)
        t.static_ids.copy_(new)
        t.graph.replay()
        if not torch.equal(t.returned, F.embedding(new, t.weight)):
            return f"replay {trial} with new ids in static_ids does not equal F.embedding(new_ids, weight)"
    return ""


def _failure_raised(t) -> str:
    """Capture :func:`_host_read` with the learner's function: it must raise the refusal, then put
    the stream back."""
    before = t.cg.current_stream()
    try:
        got = t.capture_fn(_host_read, t.static_ids, t.weight)
    except Exception as e:  # noqa: BLE001 - expected: the refused host read
        cause = root_cause(e)
        problem = "" if REFUSED_READ in str(cause) else f"a capture of a host read failed with {first_line(cause)}"
    else:
        problem = ("capturing a lookup that reads a value on the host "
                   f"returned {type(got).__name__}: a failed capture must "
                   "raise its error (exercise 6 reads it), not return")
    t.stream_left = t.cg.current_stream() != before
    if t.stream_left:
        recover(stream=before)
    return problem


def _stream_back(t) -> str:
    if not t.stream_left:
        return ""
    try:
        has_except = "except" in inspect.getsource(t.capture_fn)
    except (OSError, TypeError):  # source not available: say what holds either way
        has_except = False
    where = "In your except: recover(stream=before, graph=g), then raise" if has_except else (
        "Wrap the capture in try/except: on an error, recover(stream=before, graph=g), "
        "then raise (as is, the error leaves your function with the capture stream current)")
    return "after a failed capture, the capture stream is still current: every later op would run on it. " + where


CAPTURE_RULES = capture_rules(WHAT, WHAT) + [
    Rule("captured_output", "", _output), Rule("replays", "", _replays),
    Rule("failure_raised", "", _failure_raised), Rule("stream_back", "", _stream_back)]


def check_capture(capture_fn, lookup, vocab: int = 1000, dim: int = 64) -> None:
    """Exercise 4: ``capture_fn(lookup, static_ids, weight)`` captures well (:data:`CAPTURE_RULES`),
    its replays on new ids equal ``F.embedding``, and a capture that fails raises its error with the
    stream put back."""
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(vocab, dim, generator=gen).to(torch_device())
    static_ids = torch.randint(0, vocab, (4, 32), generator=gen).to(weight.device)
    with Tracer() as t:  # the streams' order too: a missing fork or join is named
        t.graph, t.returned = capture_fn(t.wrap(lookup, WHAT), static_ids, weight)
    t.capture_fn, t.static_ids, t.weight, t.vocab, t.gen = capture_fn, static_ids, weight, vocab, gen
    check(t, CAPTURE_RULES)
    print("3 replays with new ids equal F.embedding; a failed "
          "capture raised its error and put the stream back")


def _frames(error, fn) -> list:
    code = getattr(fn, "__code__", None)
    return [f for f in traceback.extract_tb(error.__traceback__)
            if code is not None and f.name == code.co_name and f.filename == code.co_filename]


ERROR_RULES = [
    Rule("nothing_failed", "", lambda e: "" if e.error is not None else (
        "your function returned None: nothing failed. Capture cpu_copy_lookup (exercise 1) with your capture(): "
        'its ids.to("cpu") is what a capture refuses (a call outside a capture, or of another lookup, runs fine)')),
    Rule("not_an_error", "", lambda e: "" if isinstance(e.error, BaseException) else (
        f"you returned a {type(e.error).__name__}, not the error: return the "
        "exception object itself, whose traceback says where it was raised")),
    Rule("not_the_copy", "", lambda e: "" if REFUSED_COPY in str(e.cause) else (
        f"the error you recorded is {clip(first_line(e.cause), 160)}: not the "
        f"capture's refusal of the host copy ('{REFUSED_COPY} ...'). Capture "
        "cpu_copy_lookup on valid ids: the warm-up runs it eagerly first")),
    Rule("not_your_line", "", lambda e: "" if e.frames and ".to(" in e.frames[-1].line else (
        "the refused copy was not raised in your cpu_copy_lookup: capture that function itself")),
]


class _Recorded:
    """What exercise 6 returned, as :data:`ERROR_RULES` read it."""

    def __init__(self, error, fn):
        self.error = error
        self.cause = root_cause(error) if isinstance(error, BaseException) else None
        self.frames = _frames(self.cause, fn) if self.cause is not None else []


def check_cpu_copy_error(error, cpu_copy_lookup) -> None:
    """Exercise 6: the error the learner recorded is the refused host copy, raised at their own
    ``.to("cpu")``."""
    seen = _Recorded(error, cpu_copy_lookup)
    if isinstance(seen.cause, NotImplementedError):
        raise NotImplementedError("exercise 6 captures your "
                                  "cpu_copy_lookup: finish exercise 1 first")
    check(seen, ERROR_RULES)
    print("the capture refused the copy at your line "
          f"`{seen.frames[-1].line}`:\n  {clip(first_line(seen.cause), 200)}")
