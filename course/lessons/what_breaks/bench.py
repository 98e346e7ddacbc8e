"""Lesson 03's recordings: the tables its experiment cells make (course/reference/*.json), and what
they run: the zoo's targets and the canary after each capture, the event test's tiny kernel, the
Numba hazards' captures, the recovery cases in fresh processes (``capture_recovery``)."""
from __future__ import annotations

import warnings
from concurrent.futures import ThreadPoolExecutor

import torch

from course.core.blocking import gpu_sleep
from course.core.capture import require_gpu, try_capture
from course.core.isolate import run_isolated
from course.core.reference import experiment
from course.core.results import Result
from course.core.runtime import as_numba, numba_stream, runtime
from course.core.text import clip
from course.core.timing import one_sample
from course.lessons.launch_overhead.launch import tiny_kernels
from course.lessons.what_breaks import numba_zoo, zoo
from course.lessons.what_breaks.recovery import KINDS

RECOVERY = "course.lessons.what_breaks.recovery"  # each recovery case runs from it, in a process


def canary_ok() -> bool:
    """After a capture attempt: does a fresh capture + replay of a safe function still work?"""
    x = torch.arange(8.0, device="cuda")
    out = try_capture(lambda: x * 2 + 1, warmup=1)
    if not out.ok:
        return False
    x.copy_(torch.arange(8.0, 16.0))
    out.graph.replay()
    torch.cuda.synchronize()
    return bool(torch.equal(out.output.cpu(), torch.arange(8.0, 16.0) * 2 + 1))


def _lines(findings, source) -> str:
    lines = {f.line for f in findings if f.source == source and f.line}
    return ",".join(str(n) for n in sorted(lines))


def finder_targets(names=None) -> list:
    """``[(function name, entry, kind, fn, args), ...]``: each zoo entry's hazard and fix (only
    ``names``, when given), then the safe functions; ``kind`` is "hazard", "fix" or "safe".
    Arguments are made here, in that order."""
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
    """One ``hazards_finder`` row: the finder's ``report`` (static and dynamic) on ``function``, the
    event test's verdict (``event``) and whether the next capture worked (``next_ok``), as the
    table's columns."""
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
        "replay": "-" if d.replay_matches is None else
                  ("matches eager" if d.replay_matches else "DIFFERS"),
        "host_return_ms": d.blocking.host_return_ms, "gpu_busy_ms": d.blocking.gpu_busy_ms,
        "blocked": bool(d.blocking.blocked), "event_complete": bool(event),
        "next_capture_ok": next_ok,
        "capture_where": cap[0].where() if cap else "",
    }


def finder_result(rows: list, names, sleep_ms: float) -> Result:
    """The ``hazards_finder`` table from its rows (:func:`finder_row`), with how many hazards and
    safe functions were flagged and how many follow-up captures worked."""
    columns = {c: "" for c in ("function", "entry", "kind", "flagged", "static_lines",
                               "static_rules", "sync_debug_lines", "blocking_line", "capture_line",
                               "capture", "replay")}
    columns |= {"host_return_ms": "ms", "gpu_busy_ms": "ms", "blocked": "", "event_complete": "",
                "next_capture_ok": "", "capture_where": ""}
    res = Result("hazards_finder",
                 "The hazard finder on the zoo: static and dynamic findings per function", columns,
                 rows, params={"names": list(names) if names else None, "sleep_ms": sleep_ms})
    haz = [r for r in rows if r["kind"] == "hazard"]
    safe = [r for r in rows if r["kind"] != "hazard"]
    res.add_summary("hazards flagged", sum(r["flagged"] for r in haz), f"of {len(haz)}")
    res.add_summary("safe functions flagged", sum(r["flagged"] for r in safe), f"of {len(safe)}")
    res.add_summary("captures after a failure that still worked",
                    sum(r["next_capture_ok"] for r in rows), f"of {len(rows)}")
    return res


def launch_tiny(t) -> None:
    """Lesson 01's ``add_one`` on ``t`` (at most 32 elements), one block, on torch's current
    stream."""
    if t.numel() > 32:
        raise ValueError("launch_tiny is a one-block kernel: pass at most 32 elements")
    add_one = tiny_kernels()[1]
    add_one[1, 32, numba_stream()](as_numba(t))


def gpu_us_per_call(fn, n: int = 20, host_us: float = 1000.0) -> float:
    """GPU time per call of an asynchronous ``fn``: ``n`` calls queued behind a GPU sleep long
    enough to cover their host time (``host_us`` each), so launch gaps vanish; CUDA events around
    them."""
    torch.cuda.synchronize()
    gpu_sleep(5.0 + 1.5 * n * host_us / 1e3)
    return one_sample(fn, n, "device") * 1e6 / n  # events around the n calls, behind the sleep


def event_test_result(rows: list, repeats: int, sleep_ms: float) -> Result:
    """The ``hazards_event_test`` table from the cell's measurements, one row per call; the first is
    the Numba launch.

    ``rows``: ``{"call": name, "host": Timing, "gpu_us": us or None, "events": [bool, ...] (five
    event tests), "blocking": BlockingReport}`` per call. The event test says "synchronized" when 3
    of the 5 say complete.
    """
    out = [{"call": r["call"], "host_call_us": r["host"].us, "gpu_us": r["gpu_us"],
            "event_complete": sum(r["events"]) >= 3, "event_complete_of_5": sum(r["events"]),
            "blocked": bool(r["blocking"].blocked), "host_return_ms": r["blocking"].host_return_ms,
            "gpu_busy_ms": r["blocking"].gpu_busy_ms} for r in rows]
    res = Result("hazards_event_test", "Misleading event test vs the host-blocking test",
                 {"call": "", "host_call_us": "us", "gpu_us": "us", "event_complete": "",
                  "event_complete_of_5": "count", "blocked": "", "host_return_ms": "ms",
                  "gpu_busy_ms": "ms"},
                 out, params={"repeats": repeats, "sleep_ms": sleep_ms})
    nb = out[0]
    res.add_summary("numba launch, host time", nb["host_call_us"], "us")
    res.add_summary("numba kernel, GPU time", nb["gpu_us"], "us")
    res.add_summary("launch / kernel", nb["host_call_us"] / nb["gpu_us"], "x")
    return res


def capture_and_replay(fn, args, x, mode: str = "global") -> dict:
    """Capture ``fn(*args)``, replay it with new values in ``x``, compare with eager: what happened,
    in words."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = try_capture(lambda: fn(*args), warmup=1, mode=mode)
    empty = any("empty" in str(w.message).lower() for w in caught)
    error = "" if out.ok else clip(f"{out.error_type}: {out.error}", 240)
    row = {"captured": out.ok, "error": error, "empty_graph_warning": empty,
           "replay_matches_eager": None}
    if out.ok:
        x.copy_(torch.randn_like(x))
        out.graph.replay()
        torch.cuda.synchronize()
        row["replay_matches_eager"] = bool(torch.allclose(out.output, 2.0 * x + 1.0))
    out.graph = out.output = None
    torch.cuda.synchronize()
    return row


def numba_result(rows: list, n: int) -> Result:
    """The ``hazards_numba`` table from the cell's rows (one per hazard and per fix, each a
    :func:`capture_and_replay` verdict with the entry's names and static rules), with how many fixes
    replayed right and how many hazards failed to capture or replayed wrong."""
    res = Result("hazards_numba", "Numba inside a CUDA graph capture: four hazards and their fixes",
                 {c: "" for c in ("entry", "title", "kind", "function", "static_rules", "captured",
                                  "error", "empty_graph_warning", "replay_matches_eager")},
                 rows, params={"n": n})
    fixes_ok = sum(1 for r in rows if r["kind"] == "fix" and r["replay_matches_eager"])
    broken = sum(1 for r in rows if r["kind"] == "hazard" and not r["replay_matches_eager"])
    of = f"of {len(numba_zoo.ENTRIES)}"
    res.add_summary("fixes that capture and replay right", fixes_ok, of)
    res.add_summary("hazards that fail to capture or replay wrong", broken, of)
    return res


def run_eagerly(name: str, kind: str = "hazard"):
    """Run one entry eagerly on this path (simulator or GPU) and return its output (for tests and
    notebooks)."""
    entry = {e[0]: e for e in numba_zoo.ENTRIES}[name]
    fn = entry[2] if kind == "hazard" else entry[3]
    x = torch.arange(8, dtype=torch.float32, device=runtime().device)
    return fn(*numba_zoo.entry_args(name, kind == "fix", x)), x


@experiment("capture_recovery", gpu_only=True, quick={"kinds": ("host_read", "d2h_copy")})
def recovery_experiment(kinds=KINDS, timeout: float = 120.0) -> Result:
    """Per kind of failed capture: does the next capture into the same pool work, raw and
    guarded?"""
    require_gpu("capture recovery")
    jobs = [("after_failure", {"kind": k, "guarded": g}) for k in kinds for g in (False, True)]
    jobs.append(("all_in_a_row", {"kinds": list(kinds)}))
    jobs += [("freed_during_capture", {"guarded": g, "by_hand": h})
             for g in (False, True) for h in (False, True)]
    run = lambda job: run_isolated(RECOVERY, job[0], timeout=timeout, **job[1])  # noqa: E731
    with ThreadPoolExecutor(max_workers=4) as pool:  # independent processes: 4 at a time on one GPU
        rows = list(pool.map(run, jobs))
    res = Result("capture_recovery", "After each kind of failed capture: the next capture into the "
                 "same pool; and a graph freed by the garbage collector during a capture",
                 {"kind": "", "capture": "", "failure": "", "next_capture_ok": "",
                  "replay_right": "",
                  "next_error": ""}, rows, params={"kinds": list(kinds)})
    freed = {r["capture"]: r for r in rows if r["kind"] == "graph freed during capture"}
    rows = [r for r in rows if not r["kind"].startswith("graph freed during capture")]
    guarded = [r for r in rows if r["capture"] == "course graph()"]
    raw = [r for r in rows if r["capture"] == "torch.cuda.graph"]
    res.add_summary("captures_after_failure_ok",
                    all(r["next_capture_ok"] and r["replay_right"] for r in guarded))
    res.add_summary("raw torch.cuda.graph: kinds that poisoned the next capture",
                    sum(not (r["next_capture_ok"] and r["replay_right"]) for r in raw))
    res.add_summary("graph freed during capture: torch.cuda.graph captured",
                    bool(freed["torch.cuda.graph"]["next_capture_ok"]))
    res.add_summary("graph freed during capture: course graph() captured and replayed right",
                    bool(freed["course graph()"]["next_capture_ok"] and freed["course "
                                                                       "graph()"]["replay_right"]))
    return res
