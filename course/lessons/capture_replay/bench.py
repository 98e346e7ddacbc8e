"""Lesson 02's recordings: the tables its experiment cells make (course/reference/*.json); the
replay-launch experiment's pieces are in :mod:`.driver`, torch.compile's in :mod:`.compiled`."""
from __future__ import annotations

from course.core.profiling import launch_counts
from course.core.results import Result
from course.core.timing import speedup


SWEEP_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def _fit_slope(xs, ys) -> float:
    """Least-squares slope of ys against xs."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0


def per_kernel_slopes(result, min_kernels: int = 16) -> dict:
    """Fit time = a + b * kernels to the sweep (rows with >= ``min_kernels``): b for eager, replay,
    and saving (us)."""
    rows = [r for r in result.rows if r["kernels"] >= min_kernels]
    if len(rows) < 2:
        rows = result.rows
    ks = [r["kernels"] for r in rows]
    eager = _fit_slope(ks, [r["eager_us"] for r in rows])
    replay = _fit_slope(ks, [r["replay_us"] for r in rows])
    return {"eager_us_per_kernel": eager, "replay_us_per_kernel": replay,
            "saving_us_per_kernel": eager - replay}


def sweep_result(rows: list, counts, size: int, repeats: int) -> Result:
    """The ``graphs_kernel_sweep`` table from the cell's timings, with the per-kernel fit in its
    summary.

    ``rows``: ``{"kernels": n, "eager": Timing, "replay": Timing, "launch": Timing}`` per count, in
    order (``launch`` is the host time of one ``g.replay()``).
    """
    out = [{"kernels": r["kernels"], "eager_us": r["eager"].us, "replay_us": r["replay"].us,
            "eager_per_kernel_us": r["eager"].us / r["kernels"],
            "replay_per_kernel_us": r["replay"].us / r["kernels"],
            "saving_per_kernel_us": (r["eager"].us - r["replay"].us) / r["kernels"],
            "replay_launch_us": r["launch"].us}
           for r in rows]
    res = Result("graphs_kernel_sweep", "Eager launches vs one graph replay, by number of kernels",
                 {"kernels": "count", "eager_us": "us", "replay_us": "us",
                  "eager_per_kernel_us": "us",
                  "replay_per_kernel_us": "us", "saving_per_kernel_us": "us",
                  "replay_launch_us": "us"},
                 out, params={"counts": list(counts), "size": size, "repeats": repeats})
    fit = per_kernel_slopes(res)
    res.add_summary("eager, per kernel (fit)", fit["eager_us_per_kernel"], "us")
    res.add_summary("replay, per kernel (fit)", fit["replay_us_per_kernel"], "us")
    res.add_summary("saving per kernel (fit)", fit["saving_us_per_kernel"], "us")
    last = out[-1]
    res.add_summary(f"speedup at {last['kernels']} "
                    "kernels", last["eager_us"] / last["replay_us"], "x")
    return res


def gpu_ops_per_call(fn) -> int | None:
    """GPU activities (kernels, memcpys, memsets) one call of ``fn`` issues, counted by
    :func:`course.core.profiling.launch_counts`; None where the profiler cannot run (no CUPTI,
    another profiler active): the count is optional here."""
    try:
        return int(launch_counts(fn)["gpu_ops"])
    except Exception:  # noqa: BLE001 - the profiler is optional here
        return None


def training_result(times: dict, match: bool, ops, N: int, D_in: int, D_out: int, iters: int,
                    repeats: int) -> Result:
    """The ``graphs_seed_step`` table from the cell's timings.

    ``times``: ``{"eager": Timing, "replay": Timing}`` per step (CUDA events) and ``"eager_loop"``,
    ``"replay_loop"`` per step over ``iters`` steps (synchronized wall clock); ``match``: the
    replayed weights equal eagerly trained ones; ``ops``: GPU operations per eager step, or None
    (the profiler could not run).
    """
    eager, replay = times["eager"], times["replay"]
    eager_loop, replay_loop = times["eager_loop"], times["replay_loop"]
    rows = [{"mode": "eager", "per_step_us": eager.us, "loop_ms": eager_loop.median * iters * 1e3},
            {"mode": "graph replay", "per_step_us": replay.us,
                     "loop_ms": replay_loop.median * iters * 1e3}]
    res = Result("graphs_seed_step",
                 f"The CUDA Graph lesson's training step (Linear {D_in}->{D_out}, batch {N}): "
                 "eager vs replay",
                 {"mode": "", "per_step_us": "us", "loop_ms": "ms"}, rows,
                 params={"N": N, "D_in": D_in, "D_out": D_out, "iters": iters, "repeats": repeats})
    res.add_summary("speedup per step (CUDA events)", eager.us / replay.us, "x")
    res.add_summary(f"speedup over {iters} steps (synchronized wall "
                    "clock)", eager_loop.median / replay_loop.median,
                    "x")
    res.add_summary("replayed weights match eager training", bool(match))
    if ops is not None:
        res.add_summary("GPU operations per step", ops, "count")
    return res


NEW_SHAPE_COLUMNS = {"batch": "count", "warmup_ms": "ms", "capture_ms": "ms", "eager_us": "us",
                     "eager_q1_us": "us",
                     "eager_q3_us": "us", "replay_us": "us", "replay_q1_us": "us",
                     "replay_q3_us": "us",
                     "saving_is_noise": "", "pool_reserved_mib": "MiB", "pool_allocated_mib": "MiB",
                     "break_even_replays": "count"}


def new_shape_row(capture: dict, times: dict) -> dict:
    """One ``graphs_new_shape`` row: a capture's costs and memory (``batch``, ``warmup_ms``,
    ``capture_ms``, ``pool_reserved_mib``, ``pool_allocated_mib``) and its interleaved ``{"eager":
    Timing, "replay": Timing}``.

    Break-even counts the warm-up and the capture; it is None where the saving is inside the spread
    (or no saving).
    """
    e, r = times["eager"], times["replay"]
    s = speedup("eager", e, "replay", r)
    saving = e.us - r.us
    paid = not s.noise and saving > 0
    return {"batch": capture["batch"], "warmup_ms": capture["warmup_ms"],
            "capture_ms": capture["capture_ms"],
            "eager_us": e.us, "eager_q1_us": e.q1 * 1e6, "eager_q3_us": e.q3 * 1e6,
            "replay_us": r.us,
            "replay_q1_us": r.q1 * 1e6, "replay_q3_us": r.q3 * 1e6, "saving_is_noise": s.noise,
            "pool_reserved_mib": capture["pool_reserved_mib"],
            "pool_allocated_mib": capture["pool_allocated_mib"],
            "break_even_replays": ((capture["warmup_ms"] + capture["capture_ms"]) * 1e3 / saving)
            if paid else None}


def pool_totals(captures: list) -> dict:
    """``{"reserved": MiB, "allocated": MiB}``: the memory a list of captures added, summed (numbers
    only, so the captures' graphs can be freed)."""
    return {"reserved": sum(c["pool_reserved_mib"] for c in captures),
            "allocated": sum(c["pool_allocated_mib"] for c in captures)}


def new_shape_result(rows: list, shared: dict, batches, width: int, depth: int,
                     repeats: int) -> Result:
    """The ``graphs_new_shape`` table: :func:`new_shape_row` rows (one pool per graph) and the
    :func:`pool_totals` of the same shapes captured into one shared pool."""
    res = Result("graphs_new_shape", f"A new shape is a new capture (MLP {depth}x{width}, no_grad)",
                 dict(NEW_SHAPE_COLUMNS), rows,
                 params={"batches": list(batches), "width": width, "depth": depth,
                         "repeats": repeats})
    res.add_summary("memory reserved, one pool per "
                    "graph", sum(r["pool_reserved_mib"] for r in rows), "MiB")
    res.add_summary("memory reserved, one shared pool", shared["reserved"], "MiB")
    res.add_summary("memory allocated, one pool per "
                    "graph", sum(r["pool_allocated_mib"] for r in rows), "MiB")
    res.add_summary("memory allocated, one shared pool", shared["allocated"], "MiB")
    return res


FROZEN_CHECKS = (  # key, check, lesson, what happened when as expected, when not
    ("copy", "copy_ new data into the static input, "
             "replay", "new data goes in with static_x.copy_(new)",
     "output matches eager on the new data", "output does NOT match eager"),
    ("rebind", "rebind the Python name (static_x = new tensor), replay",
     "the graph recorded an address, not a Python "
     "name", "output still computed from the old buffer",
     "output follows the new tensor"),
    ("shape", "copy a batch of 8 into the static batch of "
              "4", "shapes are fixed: a new shape needs a new capture",
     "RuntimeError: {error}", "no error"),
    ("held", "hold the output tensor, replay "
             "again", "outputs are static too: clone() what you keep",
     "the held tensor changed under us", "the held tensor kept its values"),
    ("branch", "Python if on a host flag, flip the flag, "
               "replay", "Python control flow runs once, at capture",
     "still the branch taken at capture (relu)", "followed the new flag"),
    ("float", "Python float read at capture (2.0), change it to 3.0, replay",
     "host values are baked into the kernels' "
     "arguments", "still multiplies by 2.0", "multiplies by 3.0"),
    ("counter", "a Python counter in the function, 10 replays",
     "replay runs no Python: side effects happen only at "
     "capture", "counter is {calls} (3 warm-ups + 1 capture)",
     "counter is {calls} (3 warm-ups + 1 capture)"),
    ("rand", "torch.rand inside the graph, replay twice",
     "torch's CUDA RNG is graph-safe (the offset advances per "
     "replay)", "new random numbers each replay",
     "the same numbers"),
)


def frozen_result(seen: dict) -> Result:
    """The ``graphs_frozen`` table from what the cell's eight checks observed, worded by
    :data:`FROZEN_CHECKS`.

    ``seen[key]`` is True when the graph behaved as the lesson says, except ``"shape"`` (the
    RuntimeError the copy raised, or None: no error) and ``"counter"`` (``(calls at capture, calls
    after the replays)``). A key missing from ``seen`` is an error that names it.
    """
    missing = [k for k, *_ in FROZEN_CHECKS if k not in seen]
    if missing:
        raise KeyError(f"graphs_frozen: the cell observed no {missing}; every one of the eight "
                       "checks must run")
    rows = []
    for key, check, lesson, yes, no in FROZEN_CHECKS:
        got, words = seen[key], {}
        if key == "shape":
            ok = got is not None
            words["error"] = str(got).splitlines()[0] if ok else ""
        elif key == "counter":
            at_capture, calls = got
            ok, words["calls"] = calls == at_capture, calls
        else:
            ok = bool(got)
        rows.append({"check": check, "what_happened": (yes if ok else no).format(**words),
                     "as_expected": bool(ok),
                     "lesson": lesson if key != "shape" or ok else "shapes are fixed"})
    res = Result("graphs_frozen", "What a CUDA graph records and what it freezes",
                 {"check": "", "what_happened": "", "as_expected": "", "lesson": ""}, rows)
    res.add_summary("checks as expected", sum(r["as_expected"] for r in rows), f"of {len(rows)}")
    return res


def graphed_callables_result(times: dict, max_diff: float, batch: int, width: int, depth: int,
                            repeats: int) -> Result:
    """The ``graphs_make_graphed_callables`` table from the cell's interleaved ``{"eager": Timing,
    "graphed block": Timing}`` and the largest gradient difference between the graphed and the eager
    block."""
    s = speedup("eager", times["eager"], "graphed block", times["graphed block"])
    rows = [{"step": name, "us": times[name].us, "q1_us": times[name].q1 * 1e6,
             "q3_us": times[name].q3 * 1e6}
            for name in ("eager", "graphed block")]
    res = Result("graphs_make_graphed_callables",
                 f"A training step: MLP {depth}x{width} (batch {batch}) graphed, data-dependent "
                 "loss eager",
                 {"step": "", "us": "us", "q1_us": "us", "q3_us": "us"}, rows,
                 params={"batch": batch, "width": width, "depth": depth, "repeats": repeats})
    res.add_summary("largest gradient difference vs eager", max_diff, "")
    res.add_summary("speedup", s.ratio, "x")
    res.add_summary("difference is noise", s.noise)
    return res


def stream_row(capture: str, captured: bool, error: str, replay_matches) -> dict:
    """One ``graphs_two_streams`` row before timing: how ``capture`` went (``replay_matches`` None:
    not replayed)."""
    return {"capture": capture, "captured": captured, "error": error,
            "replay_matches": replay_matches,
            "replay_us": None, "q1_us": None, "q3_us": None}


def two_streams_result(rows: list, times: dict, batch: int, width: int, repeats: int) -> Result:
    """The ``graphs_two_streams`` table: :func:`stream_row` rows with their replay times from
    ``times`` (the interleaved timings: a key per captured graph and ``"eager, one stream"``) and
    the two-vs-one comparison."""
    for r in rows:
        if r["capture"] in times:
            t = times[r["capture"]]
            r["replay_us"], r["q1_us"], r["q3_us"] = t.us, t.q1 * 1e6, t.q3 * 1e6
    res = Result("graphs_two_streams", f"Two independent branches (batch {batch}, {width}x{width} "
                                       "matmuls)",
                 {"capture": "", "captured": "", "error": "", "replay_matches": "",
                  "replay_us": "us",
                  "q1_us": "us", "q3_us": "us"}, rows,
                  params={"batch": batch, "width": width, "repeats": repeats})
    res.add_summary("eager, one stream", times["eager, one stream"].us, "us")
    if "one stream" in times and "two streams, fork and join" in times:  # both captured
        s = speedup("one stream", times["one stream"], "two streams", times["two streams, fork and "
                                                                            "join"])
        res.add_summary("two streams vs one: speedup", s.ratio, "x")
        res.add_summary("two streams vs one: difference is noise", s.noise)
    return res


def capture_modes_result(rows: list) -> Result:
    """The ``graphs_capture_modes`` table: one row per capture_error_mode (``mode`` and what the
    capture did)."""
    return Result("graphs_capture_modes", "cuda.device_array inside a capture, under each "
                                          "capture_error_mode",
                  {"mode": "", "captured": "", "error": "", "empty_graph_warning": "",
                   "replay_matches_eager": ""},
                  rows)


