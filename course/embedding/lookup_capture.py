"""Lab 2's captures, written by the learner: the device lookup captured and replayed, the cpu-copy one refused.

The learner writes ``capture(fn, *static)`` with ``cg = course.graphs()`` (``torch.cuda`` on a GPU, the simulator's
graphs otherwise): a warm-up on a side stream, ``cg.graph(g)`` with the collector off, and on failure the stream put
back (``course.core.capture.recover``) and the error raised. :func:`capture` is the course's version (the notebook
uses it until the learner's passed). :func:`check_capture` checks the learner's on the device lookup (replays on new
ids must equal ``F.embedding``) and on a function whose capture fails; :func:`check_cpu_copy_error` reads the error
the learner recorded from capturing the cpu-copy lookup: the refused host copy, raised at their ``.to("cpu")`` line.
"""
from __future__ import annotations

import traceback

import torch
import torch.nn.functional as F

from course.core.capture import capture_once, recover
from course.core.capturecheck import Watched, assert_captured_well, first_line, root_cause
from course.core.runtime import graphs, torch_device
from course.core.text import clip

REFUSED_COPY = "Cannot copy between CPU and CUDA tensors during CUDA graph capture"
REFUSED_READ = "operation not permitted when stream is capturing"


def capture(fn, *static):
    """Warm ``fn`` up on a side stream and capture ``fn(*static)`` into a new graph: ``(graph, static output)``.

    A failed capture raises its error, after the stream that was current is made current again (and, on a GPU,
    CUDA left usable: :func:`course.core.capture.recover`). The course's answer to exercise 4
    (:func:`course.core.capture.capture_once`).
    """
    return capture_once(fn, *static)


def _host_read(ids, weight):
    """A lookup that reads a device value on the host: a capture refuses it."""
    return weight[ids] * float(ids.max() >= 0)


def check_capture(capture_fn, lookup, vocab: int = 1000, dim: int = 64) -> None:
    """Exercise 4: ``capture_fn(lookup, static_ids, weight)`` captures well, its replays on new ids equal
    ``F.embedding``; and a capture that fails raises its error with the stream put back."""
    dev, g = torch_device(), torch.Generator().manual_seed(4)
    weight = torch.randn(vocab, dim, generator=g).to(dev)
    static_ids = torch.randint(0, vocab, (4, 32), generator=g).to(dev)
    watched = Watched(lookup, "the lookup", streams=True)  # a missing fork or join is named too
    try:
        graph, static_out = capture_fn(watched, static_ids, weight)
    finally:
        watched.close()
    assert_captured_well(watched, "the lookup")
    assert static_out is watched.output, (
        "return the output of the captured call itself (out = fn(*static) inside `with cg.graph(g):`): every replay "
        "writes its result there; a copy or the output of another call never changes")
    for trial in range(3):
        new = torch.randint(0, vocab, (4, 32), generator=g).to(dev)
        static_ids.copy_(new)
        graph.replay()
        assert torch.equal(static_out, F.embedding(new, weight)), (
            f"replay {trial} with new ids in static_ids does not equal F.embedding(new_ids, weight)")
    cg = graphs()
    before = cg.current_stream()
    try:
        got = capture_fn(_host_read, static_ids, weight)
    except Exception as e:  # noqa: BLE001 - expected: the refused host read
        cause = root_cause(e)
        assert REFUSED_READ in str(cause), f"a capture of a host read failed with {first_line(cause)}"
    else:
        raise AssertionError(f"capturing a lookup that reads a value on the host returned {type(got).__name__}: a "
                             "failed capture must raise its error (exercise 6 reads it), not return")
    finally:
        left = not cg.current_stream() == before
        if left:
            recover(stream=before)
    assert not left, ("after a failed capture, the capture stream is still current: every later op would run on it. "
                      + _where_to_recover(capture_fn))
    print("3 replays with new ids equal F.embedding; a failed capture raised its error and put the stream back")


def _where_to_recover(capture_fn) -> str:
    """Where the learner puts the stream back: in their ``except``, or in a try/except they have not written yet."""
    import inspect

    try:
        has_except = "except" in inspect.getsource(capture_fn)
    except (OSError, TypeError):  # source not available: say what holds either way
        has_except = False
    if has_except:
        return "In your except: recover(stream=before, graph=g), then raise"
    return ("Wrap the capture in try/except: on an error, recover(stream=before, graph=g), then raise (as is, "
            "the error leaves your function with the capture stream current)")


def _learner_frames(error, fn) -> list:
    code = getattr(fn, "__code__", None)
    return [f for f in traceback.extract_tb(error.__traceback__)
            if code is not None and f.name == code.co_name and f.filename == code.co_filename]


def check_cpu_copy_error(error, cpu_copy_lookup) -> None:
    """Exercise 6: the error the learner recorded from capturing the cpu-copy lookup is the refused host copy,
    raised at their own ``.to("cpu")`` line."""
    assert error is not None, (
        "your function returned None: nothing failed. Capture cpu_copy_lookup (exercise 1) with your capture(): "
        'its ids.to("cpu") is what a capture refuses (a call outside a capture, or of another lookup, runs fine)')
    assert isinstance(error, BaseException), (
        f"you returned a {type(error).__name__}, not the error: return the exception object itself, whose traceback "
        "says where it was raised")
    cause = root_cause(error)
    if isinstance(cause, NotImplementedError):
        raise NotImplementedError("exercise 6 captures your cpu_copy_lookup: finish exercise 1 first")
    assert REFUSED_COPY in str(cause), (
        f"the error you recorded is {clip(first_line(cause), 160)}: not the capture's refusal of the host copy "
        f"('{REFUSED_COPY} ...'). Capture cpu_copy_lookup on valid ids: the warm-up runs it eagerly first")
    frames = _learner_frames(cause, cpu_copy_lookup)
    assert frames and ".to(" in frames[-1].line, (
        "the refused copy was not raised in your cpu_copy_lookup: capture that function itself")
    print(f"the capture refused the copy at your line `{frames[-1].line}`:\n  {clip(first_line(cause), 200)}")
