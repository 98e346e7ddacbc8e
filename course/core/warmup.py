"""The course's one warm-up rule, for every check that watches a learner's capture (lab 4.5,
exercise 08.1).

Before a capture, the captured code must have run eagerly (lazy set-up, such as cuBLAS handles,
first-use allocations or NCCL's communicator, cannot happen inside a capture), and that warm-up runs
on a **side stream**: torch's rule (its CUDA graph notes: "warmup must occur on a side stream"),
forked from the stream the data was written on and joined before the capture
(:mod:`course.lessons.stream_order` names a missing fork or join). The rule takes, for each call of
the watched code before the capture, where it ran (:func:`where`); the verdict and its words are the
same wherever it applies.
"""
from __future__ import annotations

SIDE_RECIPE = ("s = cg.Stream(); s.wait_stream(cg.current_stream()); with cg.stream(s): ...; "
               "cg.current_stream().wait_stream(s)")
LAZY = "Lazy set-up (cuBLAS handles, first-use allocations)"


def where(cg) -> str:
    """Where a call runs now: "capture" (a capture is under way on the current stream), "side" (a
    side stream) or "default" (the default stream)."""
    if cg.is_current_stream_capturing():
        return "capture"
    return "default" if cg.current_stream() == cg.default_stream() else "side"


def warmup_problem(before, what: str, lazy: str = LAZY) -> str:
    """What breaks the warm-up rule ('' when nothing): ``before`` lists where (:func:`where`) each
    call of ``what`` (the watched code, as the learner calls it: "one_token()", "step(ids,
    position)") ran before the capture."""
    before = list(before)
    if "side" in before:
        return ""
    what_ran = "the warm-up ran on the default stream" if before else "no warm-up ran"
    return (f"{what_ran} before the capture: run {what} once or twice "
            f"on a side stream first ({SIDE_RECIPE}). {lazy} must not "
            "happen inside a capture, and torch's rule is a side stream")
