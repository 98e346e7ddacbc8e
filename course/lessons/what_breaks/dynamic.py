"""The dynamic capture-hazard finder (GPU): run the function and watch what it does.

:func:`find_dynamic` runs a function

1. under ``torch.cuda.set_sync_debug_mode("warn")``, mapping every warning to the line
   that triggered it through the live Python stack;
2. under the host-blocking test (:func:`course.core.blocking.host_blocking`), with a line
   tracer that says which line the host waited on;
3. under a trial capture (:func:`course.core.capture.try_capture`), mapping the error's
   traceback to a line; and, when capture succeeds, replaying with new inputs and comparing
   with eager (catches values frozen at capture time).

:func:`find_hazards` runs the static finder always and the dynamic one where there is a GPU.
"""
from __future__ import annotations

import dataclasses
import inspect
import os
import sys
import sysconfig
import time
import traceback
import warnings

import torch

from course.core.blocking import host_blocking
from course.core.capture import exception_frames, require_gpu, try_capture
from course.core.checks import flat_tensors, same_result
from course.core.runtime import runtime
from course.lessons.what_breaks.static import Finding, _target, find_static


def _library_dirs() -> tuple:
    dirs = {os.path.dirname(torch.__file__)}
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        p = sysconfig.get_paths().get(key)
        if p:
            dirs.add(p)
    here = os.path.dirname(os.path.abspath(__file__))
    pkg = os.path.dirname(os.path.dirname(here))
    tools = tuple(os.path.join(here, f)
                  for f in ("static.py", "dynamic.py", "bench.py", "__init__.py"))
    for part in ("core", "sim"):  # the course's toolkit and simulator: never the learner's line
        folder = os.path.join(pkg, part)
        tools += tuple(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".py"))
    return tuple(sorted(dirs)), tools


def is_library_file(filename: str) -> bool:
    """True for frames that are not 'user code': torch, the standard library, site-packages, the
    course's tools."""
    if not filename or filename.startswith("<frozen") or filename.startswith("<string"):
        return True
    dirs, tools = _library_dirs()
    path = os.path.abspath(filename)
    if path in tools:
        return True
    if "site-packages" in path or "dist-packages" in path:
        return True
    return any(path.startswith(d + os.sep) for d in dirs)


def user_frame(frames):
    """The innermost frame (filename, lineno, function, line) that is user code, or None."""
    for fr in reversed(list(frames)):
        if not is_library_file(fr[0]):
            return fr
    return None


def sync_debug_events(fn) -> list:
    """Run ``fn()`` once under ``torch.cuda.set_sync_debug_mode("warn")``; one dict per sync
    warning.

    Each dict has the warning ``message`` and the user ``frame`` (filename, lineno,
    function, line) that was running when torch warned, found from the live stack.
    """
    events = []

    def hook(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if "called a synchronizing CUDA operation" not in text:
            return  # e.g. the one-time "sync debug mode is a prototype" notice
        stack = traceback.extract_stack(sys._getframe(1))
        frames = [(f.filename, f.lineno, f.name, (f.line or "").strip()) for f in stack]
        message = text.split("(Triggered internally")[0].strip()
        events.append({"message": message, "frame": user_frame(frames)})

    prev = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = hook
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(prev)
    return events


def blocking_with_line(fn, *, sleep_ms: float = 20.0):
    """:func:`course.core.blocking.host_blocking` plus the user line the host waited on (if it
    blocked).

    A line tracer records when each user line starts; the line that took most of
    the queued GPU sleep is the one that waited. Returns (BlockingReport, frame or None).
    """
    events = []

    def local(frame, event, arg):
        if event in ("line", "return"):
            events.append((time.perf_counter(), frame.f_code.co_filename, frame.f_lineno,
                           frame.f_code.co_name))
        return local

    def global_tracer(frame, event, arg):
        if event == "call" and not is_library_file(frame.f_code.co_filename):
            events.append((time.perf_counter(), frame.f_code.co_filename, frame.f_lineno,
                           frame.f_code.co_name))
            return local
        return None

    def traced():
        events.clear()
        old = sys.gettrace()
        sys.settrace(global_tracer)
        try:
            return fn()
        finally:
            sys.settrace(old)

    report = host_blocking(traced, sleep_ms=sleep_ms)
    frame = None
    if report.blocked:
        ev = waiting_line(events, 0.8 * sleep_ms * 1e-3)
        if ev is not None:
            import linecache
            frame = (ev[1], ev[2], ev[3], linecache.getline(ev[1], ev[2]).strip())
    return report, frame


def waiting_line(events, threshold_s: float):
    """The traced event (time, file, line, function) whose line was running when ``threshold_s`` had
    passed.

    ``events`` are the tracer's line starts in order (the first is the call). The host
    waited on the line during which the elapsed time crossed the queued GPU sleep; using
    that crossing (not the longest line) keeps a later host stall, such as the process
    being descheduled, from taking the blame. None if the call finished before the threshold.
    """
    if not events:
        return None
    start = events[0][0]
    for here, nxt in zip(events, events[1:]):
        if nxt[0] - start >= threshold_s:
            return here
    return None


def _perturb(args, seed: int = 1234):
    """Give every CUDA tensor argument new values in place; return the saved originals."""
    g = torch.Generator().manual_seed(seed)
    saved = []
    for a in args:
        if isinstance(a, torch.Tensor) and a.is_cuda:
            saved.append((a, a.detach().clone()))
            with torch.no_grad():
                if a.dtype.is_floating_point:
                    a.copy_(torch.randn(a.shape, generator=g, dtype=torch.float32).to(a.dtype))
                elif a.numel() > 1:
                    a.copy_(a.flatten().roll(1).view_as(a))
    return saved


def _restore(saved) -> None:
    with torch.no_grad():
        for a, old in saved:
            a.copy_(old)


@dataclasses.dataclass
class DynamicReport:
    """What running the function on the GPU showed."""

    findings: list
    blocking: object  # course.core.blocking.BlockingReport
    capture: object  # course.core.capture.CaptureOutcome (graph dropped)
    replay_matches: bool | None  # None: not captured, or the check was skipped
    sync_warnings: int


def eager_failure(exc: BaseException) -> Finding:
    """A finding for a function that raises when simply called (no capture involved), at the user's
    line."""
    fr = user_frame(exception_frames(exc))
    first = str(exc).splitlines()[0] if str(exc) else ""
    return Finding("fails", fr[1] if fr else None, fr[0] if fr else None, fr[3] if fr else "",
                   "eager", f"{type(exc).__name__}: {first} (it fails without any capture: fix "
                   "that first; the other checks did not run)")


def find_dynamic(fn, *args, sleep_ms: float = 20.0, replay_check: bool = True) -> DynamicReport:
    """Run ``fn(*args)`` on the GPU under three checks and report each hazard with its line.

    1. sync debug mode ("warn"): every synchronizing op, mapped to the user line;
    2. host blocking: does the call wait for a queued GPU sleep, and on which line;
    3. a trial capture: the error and its line; if it captures, replay with new
       values in the (static) CUDA tensor arguments and compare with eager: a
       mismatch means something was frozen at capture time.

    ``fn`` should be free of side effects beyond its return value (the replay check
    calls it again). Needs a GPU.
    """
    require_gpu("the dynamic hazard finder")
    call = lambda: fn(*args)  # noqa: E731
    try:
        call()  # eager warm-up: lazy init must not be reported as a hazard
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - broken before any capture: that is the finding
        return DynamicReport([eager_failure(e)], None, None, None, 0)
    findings = []

    events = sync_debug_events(call)
    per_line = {}
    for ev in events:
        fr = ev["frame"] or (None, None, "", "")
        per_line.setdefault((fr[0], fr[1]), [fr, 0, ev["message"]])[1] += 1
    for (file, line), (fr, count, message) in per_line.items():
        times = f"{count} times" if count > 1 else "once"
        findings.append(Finding("sync", line, file, fr[3], "sync-debug",
                                f"torch warned {times}: {message}"))

    report, frame = blocking_with_line(call, sleep_ms=sleep_ms)
    if report.blocked:
        findings.append(Finding("blocks", frame[1] if frame else None, frame[0] if frame else None,
                                frame[3] if frame else "", "host-blocking",
                                f"returned after {report.host_return_ms:.1f} ms, with the GPU busy "
                                f"for {report.gpu_busy_ms:.1f} ms: the host waited"))

    outcome = try_capture(call)
    replay = None
    if not outcome.ok:
        fr = user_frame(outcome.frames)
        findings.append(Finding("capture", fr[1] if fr else None, fr[0] if fr else None,
                                fr[3] if fr else "",
                                "capture", f"{outcome.error_type}: {outcome.error}"))
    elif replay_check:
        saved = _perturb(args)
        try:
            outcome.graph.replay()
            torch.cuda.synchronize()
            got = [t.clone() for t in flat_tensors(outcome.output)]
            expected = fn(*args)
            replay = same_result(got, expected)
        finally:
            _restore(saved)
        if not replay:
            try:
                target = _target(fn)
                file, line = inspect.getsourcefile(target), inspect.getsourcelines(target)[1]
            except (OSError, TypeError):
                file, line = None, None
            findings.append(Finding("frozen", line, file,
                                    f"def {getattr(fn, '__name__', '?')}(...)", "replay",
                                    "replay with new inputs differs from eager: values were frozen "
                                    "at capture"))
    outcome.graph = None
    outcome.output = None
    torch.cuda.synchronize()
    return DynamicReport(findings, report, outcome, replay, len(events))


@dataclasses.dataclass
class HazardReport:
    """Static and (on a GPU) dynamic findings for one function."""

    name: str
    static: list
    dynamic: DynamicReport | None
    note: str = ""

    @property
    def findings(self) -> list:
        """Every finding, static first."""
        return list(self.static) + (list(self.dynamic.findings) if self.dynamic else [])

    @property
    def flagged(self) -> bool:
        """True when any check found a hazard."""
        return bool(self.findings)

    def lines(self, source: str | None = None) -> list:
        """Sorted distinct line numbers reported (by one source, or all)."""
        return sorted({f.line for f in self.findings
                       if f.line is not None and (source is None or f.source == source)})

    def __str__(self) -> str:
        head = f"{self.name}: " + (f"{len(self.findings)} finding(s)" if self.flagged
                                   else "no hazards found")
        body = [str(f) for f in self.findings]
        if self.dynamic and self.dynamic.blocking is not None:
            b = self.dynamic.blocking
            body.append(f"{'':20}host returned after {b.host_return_ms:.2f} ms; GPU busy "
                        f"{b.gpu_busy_ms:.2f} ms; capture: {self.dynamic.capture}")
        if self.note:
            body.append(f"{'':20}({self.note})")
        return "\n".join([head] + body)

    def __repr__(self) -> str:
        return str(self)


def find_hazards(fn, *args, dynamic: bool | None = None, sleep_ms: float = 20.0,
                 replay_check: bool = True) -> HazardReport:
    """Static findings always; dynamic ones too on a GPU (``dynamic=None``: when there is one)."""
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    static = find_static(fn)
    on_gpu = runtime().on_gpu
    if dynamic is None:
        dynamic = on_gpu
    if dynamic and not on_gpu:
        require_gpu("the dynamic hazard finder")
    if not dynamic:
        note = "" if on_gpu else ("static only: the dynamic checks need a GPU (see the reference "
                                  "results)")
        return HazardReport(name, static, None, note)
    return HazardReport(name, static,
                        find_dynamic(fn, *args, sleep_ms=sleep_ms, replay_check=replay_check))
