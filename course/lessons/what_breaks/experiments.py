"""Lesson 03's GPU experiments, their bookkeeping: the zoo under the finder, and the misleading event test.

The experiments' code stands in lesson 03's cells (:mod:`course.core.cells`); this module keeps what they use:

- ``hazards_finder``: static + dynamic finder on every zoo hazard, fix and safe function. Here: the functions it
  runs (:func:`finder_targets`), the check after each one (:func:`canary_ok`), a row (:func:`finder_row`) and the
  table (:func:`finder_result`).
- ``hazards_event_test``: "the event is complete right after the call" vs the real host-blocking test, for calls
  whose launch cost exceeds their kernel time. Here: the Numba kernel it launches (:func:`launch_tiny`), the GPU
  time of a call (:func:`gpu_us_per_call`) and the table (:func:`event_test_result`).
"""
from __future__ import annotations

from course.core.results import Result


def canary_ok() -> bool:
    """After a capture attempt: does a fresh capture + replay of a safe function still work?"""
    import torch
    from course.core.capture import try_capture

    x = torch.arange(8.0, device="cuda")
    out = try_capture(lambda: x * 2 + 1, warmup=1)
    if not out.ok:
        return False
    x.copy_(torch.arange(8.0, 16.0))
    out.graph.replay()
    torch.cuda.synchronize()
    return bool(torch.equal(out.output.cpu(), torch.arange(8.0, 16.0) * 2 + 1))


def _lines(findings, source) -> str:
    return ",".join(str(l) for l in sorted({f.line for f in findings if f.source == source and f.line}))


def finder_targets(names=None) -> list:
    """``[(function name, entry, kind, fn, args), ...]``: each zoo entry's hazard and fix (only ``names``, when
    given), then the safe functions; ``kind`` is "hazard", "fix" or "safe". Arguments are made here, in that order."""
    import course.lessons.what_breaks.zoo as zoo

    if isinstance(names, str):
        names = (names,)
    unknown = sorted(set(names or ()) - set(zoo.names()))
    if unknown:
        raise ValueError(f"no zoo entry called {unknown}: choose from {zoo.names()}")
    targets = []
    for e in zoo.ENTRIES:
        if names is None or e.name in names:
            targets.append((e.hazard.__name__, e.name, "hazard", e.hazard, e.hazard_args()))
            targets.append((e.fixed.__name__, e.name, "fix", e.fixed, e.fixed_args()))
    for name, fn, args in zoo.safe_functions()[:len(zoo.SAFE)]:
        targets.append((name, "-", "safe", fn, args))
    return targets


def finder_row(function: str, entry: str, kind: str, report, event, next_ok: bool) -> dict:
    """One ``hazards_finder`` row: the finder's ``report`` (static and dynamic) on ``function``, the event test's
    verdict (``event``) and whether the next capture worked (``next_ok``), as the table's columns."""
    d = report.dynamic
    cap = [f for f in d.findings if f.source == "capture"]
    return {
        "function": function, "entry": entry, "kind": kind, "flagged": report.flagged,
        "static_lines": _lines(report.static, "static"),
        "static_rules": ",".join(sorted({f.rule for f in report.static})),
        "sync_debug_lines": _lines(d.findings, "sync-debug"),
        "blocking_line": _lines(d.findings, "host-blocking"),
        "capture_line": _lines(d.findings, "capture"),
        "capture": "captured" if d.capture.ok else f"{d.capture.error_type}: {d.capture.error}",
        "replay": "-" if d.replay_matches is None else ("matches eager" if d.replay_matches else "DIFFERS"),
        "host_return_ms": d.blocking.host_return_ms, "gpu_busy_ms": d.blocking.gpu_busy_ms,
        "blocked": bool(d.blocking.blocked), "event_complete": bool(event),
        "next_capture_ok": next_ok,
        "capture_where": cap[0].where() if cap else "",
    }


def finder_result(rows: list, names, sleep_ms: float) -> Result:
    """The ``hazards_finder`` table from its rows (:func:`finder_row`), with how many hazards and safe functions
    were flagged and how many follow-up captures worked."""
    res = Result("hazards_finder", "The hazard finder on the zoo: static and dynamic findings per function",
                 {"function": "", "entry": "", "kind": "", "flagged": "", "static_lines": "", "static_rules": "",
                  "sync_debug_lines": "", "blocking_line": "", "capture_line": "", "capture": "", "replay": "",
                  "host_return_ms": "ms", "gpu_busy_ms": "ms", "blocked": "", "event_complete": "",
                  "next_capture_ok": "", "capture_where": ""},
                 rows, params={"names": list(names) if names else None, "sleep_ms": sleep_ms})
    haz = [r for r in rows if r["kind"] == "hazard"]
    safe = [r for r in rows if r["kind"] != "hazard"]
    res.add_summary("hazards flagged", sum(r["flagged"] for r in haz), f"of {len(haz)}")
    res.add_summary("safe functions flagged", sum(r["flagged"] for r in safe), f"of {len(safe)}")
    res.add_summary("captures after a failure that still worked", sum(r["next_capture_ok"] for r in rows),
                    f"of {len(rows)}")
    return res


_TINY_KERNEL = None
_nc = None  # numba.cuda, set by tiny_kernel()


def tiny_kernel():
    """A one-block Numba kernel that adds 1 to every element (compiled once, GPU or simulator)."""
    global _TINY_KERNEL
    if _TINY_KERNEL is None:
        from course.core.runtime import cuda
        global _nc
        _nc = cuda()  # a module global, resolved by Numba when it compiles the kernel

        def add_one(a):
            i = _nc.grid(1)
            if i < a.size:
                a[i] += 1

        _TINY_KERNEL = _nc.jit(add_one)
    return _TINY_KERNEL


def launch_tiny(t) -> None:
    """Launch :func:`tiny_kernel` on ``t`` (<= 32 elements) on torch's stream via course.numba_stream()."""
    from course.core.runtime import as_numba, numba_stream

    if t.numel() > 32:
        raise ValueError("launch_tiny is a one-block kernel: pass at most 32 elements")
    tiny_kernel()[1, 32, numba_stream()](as_numba(t))


def gpu_us_per_call(fn, n: int = 20, host_us: float = 1000.0) -> float:
    """GPU time per call of an asynchronous ``fn``: ``n`` calls queued behind a GPU sleep long enough to cover
    their host time (``host_us`` each), so launch gaps vanish; CUDA events around them."""
    import torch
    from course.core.blocking import gpu_sleep
    from course.core.timing import one_sample

    torch.cuda.synchronize()
    gpu_sleep(5.0 + 1.5 * n * host_us / 1e3)
    return one_sample(fn, n, "device") * 1e6 / n  # events around the n calls, queued behind the sleep


def event_test_result(rows: list, repeats: int, sleep_ms: float) -> Result:
    """The ``hazards_event_test`` table from the cell's measurements, one row per call; the first is the Numba launch.

    ``rows``: ``{"call": name, "host": Timing, "gpu_us": us or None, "events": [bool, ...] (five event tests),
    "blocking": BlockingReport}`` per call. The event test says "synchronized" when 3 of the 5 say complete.
    """
    out = [{"call": r["call"], "host_call_us": r["host"].us, "gpu_us": r["gpu_us"],
            "event_complete": sum(r["events"]) >= 3, "event_complete_of_5": sum(r["events"]),
            "blocked": bool(r["blocking"].blocked), "host_return_ms": r["blocking"].host_return_ms,
            "gpu_busy_ms": r["blocking"].gpu_busy_ms} for r in rows]
    res = Result("hazards_event_test", "Misleading event test vs the host-blocking test",
                 {"call": "", "host_call_us": "us", "gpu_us": "us", "event_complete": "",
                  "event_complete_of_5": "count", "blocked": "", "host_return_ms": "ms", "gpu_busy_ms": "ms"},
                 out, params={"repeats": repeats, "sleep_ms": sleep_ms})
    nb = out[0]
    res.add_summary("numba launch, host time", nb["host_call_us"], "us")
    res.add_summary("numba kernel, GPU time", nb["gpu_us"], "us")
    res.add_summary("launch / kernel", nb["host_call_us"] / nb["gpu_us"], "x")
    return res
