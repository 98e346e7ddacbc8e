"""Beyond the basic recipe (lesson 02, section 8): capture part of a model, capture two streams, error modes.

The experiments' code stands in lesson 02's cells (tagged ``experiment``, :mod:`course.core.cells`); this module
keeps their pieces and bookkeeping:

- ``graphs_make_graphed_callables``: ``torch.cuda.make_graphed_callables`` graphs one block of a training step
  (forward and backward) while a data-dependent loss (:func:`data_dependent_loss`) stays eager; time and gradients
  against eager (:func:`graphed_callables_result`).
- ``graphs_two_streams``: two independent branches (:func:`branch`) captured on two streams (:func:`fork_join`:
  fork with ``wait_stream``, join before the capture ends) against the same work captured on one stream, and what
  happens when the join is forgotten (:func:`forgotten_join`, run in its own process) (:func:`stream_row`,
  :func:`two_streams_result`).
- ``graphs_capture_modes``: the same unsafe call (Numba allocating device memory) captured under each
  ``capture_error_mode`` (:func:`capture_modes_result`).

GPU only; on the simulator path notebooks load the reference results.
"""
from __future__ import annotations

from course.core.capture import try_capture, warm_up
from course.core.results import Result
from course.core.text import clip
from course.core.timing import speedup


def data_dependent_loss(y):
    """A loss that cannot be captured: it keeps only rows with a positive sum (a data-dependent shape)."""
    return y[y.sum(1) > 0].pow(2).mean()


def graphed_callables_result(times: dict, max_diff: float, batch: int, width: int, depth: int,
                            repeats: int) -> Result:
    """The ``graphs_make_graphed_callables`` table from the cell's interleaved ``{"eager": Timing, "graphed block":
    Timing}`` and the largest gradient difference between the graphed and the eager block."""
    s = speedup("eager", times["eager"], "graphed block", times["graphed block"])
    rows = [{"step": name, "us": times[name].us, "q1_us": times[name].q1 * 1e6, "q3_us": times[name].q3 * 1e6}
            for name in ("eager", "graphed block")]
    res = Result("graphs_make_graphed_callables",
                 f"A training step: MLP {depth}x{width} (batch {batch}) graphed, data-dependent loss eager",
                 {"step": "", "us": "us", "q1_us": "us", "q3_us": "us"}, rows,
                 params={"batch": batch, "width": width, "depth": depth, "repeats": repeats})
    res.add_summary("largest gradient difference vs eager", max_diff, "")
    res.add_summary("speedup", s.ratio, "x")
    res.add_summary("difference is noise", s.noise)
    return res


def branch(x, w):
    """One branch of the two-stream example: relu(x @ w) @ w."""
    import torch

    return torch.relu(x @ w) @ w


def fork_join(x, w1, w2, side):
    """``branch(x, w1) + branch(x, w2)`` with the second branch forked onto stream ``side`` and joined back."""
    import torch

    main = torch.cuda.current_stream()
    side.wait_stream(main)  # fork: the side stream starts after everything queued so far
    with torch.cuda.stream(side):
        b = branch(x, w2)
    a = branch(x, w1)  # runs on the main stream at the same time
    main.wait_stream(side)  # join: the capture must end with every forked stream joined back
    return a + b


def forgotten_join(batch: int = 64, width: int = 2048) -> dict:
    """Capture the two branches but forget the join (GPU; run it in its own process): what CUDA says."""
    import torch

    x = torch.randn(batch, width, device="cuda")
    w1, w2 = (torch.randn(width, width, device="cuda") / width ** 0.5 for _ in range(2))
    side = torch.cuda.Stream()

    def forgot_join():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            b = branch(x, w2)
        return branch(x, w1) + b  # uses b without waiting for the side stream, and never joins it back

    warm_up(forgot_join, 1)
    out = try_capture(forgot_join)
    return {"captured": out.ok, "error": "" if out.ok else clip(f"{out.error_type}: {out.error}", 240)}


def stream_row(capture: str, captured: bool, error: str, replay_matches) -> dict:
    """One ``graphs_two_streams`` row before timing: how ``capture`` went (``replay_matches`` None: not replayed)."""
    return {"capture": capture, "captured": captured, "error": error, "replay_matches": replay_matches,
            "replay_us": None, "q1_us": None, "q3_us": None}


def two_streams_result(rows: list, times: dict, batch: int, width: int, repeats: int) -> Result:
    """The ``graphs_two_streams`` table: :func:`stream_row` rows with their replay times from ``times`` (the
    interleaved timings: a key per captured graph and ``"eager, one stream"``) and the two-vs-one comparison."""
    for r in rows:
        if r["capture"] in times:
            t = times[r["capture"]]
            r["replay_us"], r["q1_us"], r["q3_us"] = t.us, t.q1 * 1e6, t.q3 * 1e6
    res = Result("graphs_two_streams", f"Two independent branches (batch {batch}, {width}x{width} matmuls)",
                 {"capture": "", "captured": "", "error": "", "replay_matches": "", "replay_us": "us",
                  "q1_us": "us", "q3_us": "us"}, rows, params={"batch": batch, "width": width, "repeats": repeats})
    res.add_summary("eager, one stream", times["eager, one stream"].us, "us")
    if "one stream" in times and "two streams, fork and join" in times:  # both captured
        s = speedup("one stream", times["one stream"], "two streams", times["two streams, fork and join"])
        res.add_summary("two streams vs one: speedup", s.ratio, "x")
        res.add_summary("two streams vs one: difference is noise", s.noise)
    return res


def capture_modes_result(rows: list) -> Result:
    """The ``graphs_capture_modes`` table: one row per capture_error_mode (``mode`` and what the capture did)."""
    return Result("graphs_capture_modes", "cuda.device_array inside a capture, under each capture_error_mode",
                  {"mode": "", "captured": "", "error": "", "empty_graph_warning": "", "replay_matches_eager": ""},
                  rows)
