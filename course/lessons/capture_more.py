"""Beyond the basic recipe (lesson 02, section 8): capture part of a model, capture two streams, error modes.

- :func:`graphed_callables_experiment`: ``torch.cuda.make_graphed_callables`` graphs one block of a training
  step (forward and backward) while a data-dependent loss stays eager; time and gradients against eager.
- :func:`two_streams_experiment`: two independent branches captured on two streams (fork with
  ``wait_stream``, join before the capture ends) against the same work captured on one stream, and what
  happens when the join is forgotten.
- :func:`capture_modes_experiment`: the same unsafe call (Numba allocating device memory) captured under each
  ``capture_error_mode``.

GPU only; on the simulator path notebooks load the reference results.
"""
from __future__ import annotations

import copy

import course.core.isolate as isolate
from course.core.capture import require_gpu, try_capture, warm_up
from course.core.reference import experiment
from course.core.results import Result
from course.core.text import clip
from course.core.timing import speedup, time_interleaved
from course.lessons.capture_replay import mlp


def data_dependent_loss(y):
    """A loss that cannot be captured: it keeps only rows with a positive sum (a data-dependent shape)."""
    return y[y.sum(1) > 0].pow(2).mean()


@experiment("graphs_make_graphed_callables", gpu_only=True, quick={"repeats": 5})
def graphed_callables_experiment(batch: int = 64, width: int = 1024, depth: int = 4, repeats: int = 15) -> Result:
    """A training step whose MLP block is graphed with make_graphed_callables and whose loss stays eager."""
    require_gpu("make_graphed_callables")
    import torch

    torch.manual_seed(0)
    eager_block = mlp(width, depth)
    graphed_source = copy.deepcopy(eager_block)
    x = torch.randn(batch, width, device="cuda", requires_grad=True)
    graphed_block = torch.cuda.make_graphed_callables(graphed_source, (x,))

    def step(block):
        block.zero_grad(set_to_none=True)
        data_dependent_loss(block(x)).backward()

    step(eager_block)
    step(graphed_block)
    torch.cuda.synchronize()
    max_diff = max((a.grad - b.grad).abs().max().item()
                   for a, b in zip(eager_block.parameters(), graphed_source.parameters()))
    t = time_interleaved({"eager": lambda: step(eager_block), "graphed block": lambda: step(graphed_block)},
                         warmup=3, repeats=repeats, inner=5)
    s = speedup("eager", t["eager"], "graphed block", t["graphed block"])
    rows = [{"step": name, "us": t[name].us, "q1_us": t[name].q1 * 1e6, "q3_us": t[name].q3 * 1e6}
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


@experiment("graphs_two_streams", gpu_only=True, quick={"repeats": 5})
def two_streams_experiment(batch: int = 64, width: int = 2048, repeats: int = 15) -> Result:
    """Two independent matmul branches: captured on one stream vs forked onto two streams and joined."""
    require_gpu("capturing two streams")
    import torch

    torch.manual_seed(0)
    x = torch.randn(batch, width, device="cuda")
    w1, w2 = (torch.randn(width, width, device="cuda") / width ** 0.5 for _ in range(2))
    side = torch.cuda.Stream()

    def one_stream():
        return branch(x, w1) + branch(x, w2)

    def two_streams():
        return fork_join(x, w1, w2, side)

    want = one_stream()
    rows, graphs = [], {}
    for name, fn in (("one stream", one_stream), ("two streams, fork and join", two_streams)):
        out = try_capture(fn)
        graphs[name] = out
        ok = out.ok
        if ok:
            out.graph.replay()
            torch.cuda.synchronize()
        rows.append({"capture": name, "captured": ok, "error": "" if ok else f"{out.error_type}: {out.error}",
                     "replay_matches": bool(ok and torch.allclose(out.output, want, atol=1e-3, rtol=1e-3)),
                     "replay_us": None, "q1_us": None, "q3_us": None})
    bad = isolate.run_isolated("course.lessons.capture_more", "forgotten_join", batch=batch, width=width)
    rows.append({"capture": "two streams, join forgotten", **bad, "replay_matches": None,
                 "replay_us": None, "q1_us": None, "q3_us": None})
    t = time_interleaved({k: v.graph.replay for k, v in graphs.items() if v.ok} | {"eager, one stream": one_stream},
                         warmup=3, repeats=repeats, inner=10)
    for r in rows:
        if r["capture"] in t:
            r["replay_us"], r["q1_us"], r["q3_us"] = t[r["capture"]].us, t[r["capture"]].q1 * 1e6, t[r["capture"]].q3 * 1e6
    res = Result("graphs_two_streams", f"Two independent branches (batch {batch}, {width}x{width} matmuls)",
                 {"capture": "", "captured": "", "error": "", "replay_matches": "", "replay_us": "us",
                  "q1_us": "us", "q3_us": "us"}, rows, params={"batch": batch, "width": width, "repeats": repeats})
    res.add_summary("eager, one stream", t["eager, one stream"].us, "us")
    if all(v.ok for v in graphs.values()):
        s = speedup("one stream", t["one stream"], "two streams", t["two streams, fork and join"])
        res.add_summary("two streams vs one: speedup", s.ratio, "x")
        res.add_summary("two streams vs one: difference is noise", s.noise)
    return res


@experiment("graphs_capture_modes", gpu_only=True, quick={})
def capture_modes_experiment() -> Result:
    """Capture a function that allocates with Numba (an unsafe call) under each capture_error_mode."""
    require_gpu("capture error modes")
    import torch

    from course.lessons.what_breaks.numba_zoo import capture_and_replay, device_array_hazard

    rows = []
    for mode in ("global", "thread_local", "relaxed"):
        x = torch.randn(1024, device="cuda")
        rows.append({"mode": mode, **capture_and_replay(device_array_hazard, (x,), x, mode=mode)})
    return Result("graphs_capture_modes", "cuda.device_array inside a capture, under each capture_error_mode",
                  {"mode": "", "captured": "", "error": "", "empty_graph_warning": "", "replay_matches_eager": ""},
                  rows)
