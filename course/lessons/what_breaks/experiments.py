"""Lesson 03's GPU experiments: the zoo under the finder, and the misleading event test.

- :func:`finder_experiment`: static + dynamic finder on every zoo hazard, fix and safe function.
- :func:`event_test_experiment`: "the event is complete right after the call" vs the real
  host-blocking test, for calls whose launch cost exceeds their kernel time.
"""
from __future__ import annotations

from course.core.reference import experiment
from course.core.results import Result
from course.lessons.what_breaks.dynamic import find_hazards


def _canary_ok() -> bool:
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


@experiment("hazards_finder", gpu_only=True, quick={"names": ("item", "synchronize", "pinned_frozen")})
def finder_experiment(names=None, sleep_ms: float = 20.0) -> Result:
    """Run the finder (static + dynamic) on every zoo hazard, every fix and the safe functions."""
    import course.lessons.what_breaks.zoo as zoo
    from course.core.blocking import event_complete_right_after

    targets = []
    for e in zoo.ENTRIES:
        if names is None or e.name in names:
            targets.append((e.hazard.__name__, e.name, "hazard", e.hazard, e.hazard_args()))
            targets.append((e.fixed.__name__, e.name, "fix", e.fixed, e.fixed_args()))
    for name, fn, args in zoo.safe_functions()[:len(zoo.SAFE)]:
        targets.append((name, "-", "safe", fn, args))
    rows = []
    for fname, entry, kind, fn, args in targets:
        rep = find_hazards(fn, *args, dynamic=True, sleep_ms=sleep_ms)
        d = rep.dynamic
        cap = [f for f in d.findings if f.source == "capture"]
        event = event_complete_right_after(lambda: fn(*args))
        rows.append({
            "function": fname, "entry": entry, "kind": kind, "flagged": rep.flagged,
            "static_lines": _lines(rep.static, "static"),
            "static_rules": ",".join(sorted({f.rule for f in rep.static})),
            "sync_debug_lines": _lines(d.findings, "sync-debug"),
            "blocking_line": _lines(d.findings, "host-blocking"),
            "capture_line": _lines(d.findings, "capture"),
            "capture": "captured" if d.capture.ok else f"{d.capture.error_type}: {d.capture.error}",
            "replay": "-" if d.replay_matches is None else ("matches eager" if d.replay_matches else "DIFFERS"),
            "host_return_ms": d.blocking.host_return_ms, "gpu_busy_ms": d.blocking.gpu_busy_ms,
            "blocked": bool(d.blocking.blocked), "event_complete": bool(event),
            "next_capture_ok": _canary_ok(),
            "capture_where": cap[0].where() if cap else "",
        })
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


def _gpu_us_per_call(fn, n: int = 20, host_us: float = 1000.0) -> float:
    """GPU time per call of an asynchronous ``fn``: queue it behind a sleep so launch gaps vanish."""
    import torch
    from course.core.blocking import gpu_sleep
    from course.core.timing import one_sample

    torch.cuda.synchronize()
    gpu_sleep(5.0 + 1.5 * n * host_us / 1e3)
    return one_sample(fn, n, "device") * 1e6 / n  # events around the n calls, queued behind the sleep


@experiment("hazards_event_test", gpu_only=True, quick={"repeats": 5})
def event_test_experiment(repeats: int = 25, sleep_ms: float = 20.0) -> Result:
    """InfiniCore's 'event already complete, so it synchronized' test against the robust host-blocking test."""
    import torch
    from course.core.blocking import event_complete_right_after, host_blocking
    from course.core.timing import time_enqueue

    t = torch.zeros(32, device="cuda")
    x = torch.randn(1024, device="cuda")
    calls = [
        ("numba tiny kernel (launch_tiny)", lambda: launch_tiny(t), True),
        ("torch x.add_(1)", lambda: x.add_(1.0), True),
        ("x.sum().item()", lambda: x.sum().item(), False),
        ("torch.cuda.synchronize()", torch.cuda.synchronize, False),
    ]
    rows = []
    for name, fn, asynchronous in calls:
        host = time_enqueue(fn, warmup=3, repeats=repeats, inner=1)
        gpu_us = _gpu_us_per_call(fn, host_us=host.us) if asynchronous else None
        events = [event_complete_right_after(fn) for _ in range(5)]
        rep = host_blocking(fn, sleep_ms=sleep_ms)
        rows.append({"call": name, "host_call_us": host.us, "gpu_us": gpu_us,
                     "event_complete": sum(events) >= 3, "event_complete_of_5": sum(events),
                     "blocked": bool(rep.blocked), "host_return_ms": rep.host_return_ms,
                     "gpu_busy_ms": rep.gpu_busy_ms})
    res = Result("hazards_event_test", "Misleading event test vs the host-blocking test",
                 {"call": "", "host_call_us": "us", "gpu_us": "us", "event_complete": "",
                  "event_complete_of_5": "count", "blocked": "", "host_return_ms": "ms", "gpu_busy_ms": "ms"},
                 rows, params={"repeats": repeats, "sleep_ms": sleep_ms})
    nb = rows[0]
    res.add_summary("numba launch, host time", nb["host_call_us"], "us")
    res.add_summary("numba kernel, GPU time", nb["gpu_us"], "us")
    res.add_summary("launch / kernel", nb["host_call_us"] / nb["gpu_us"], "x")
    return res
