"""A capture-hazard finder: static (read the source) and dynamic (run it on a GPU).

The seeds check for a host sync with ``grep "to(cpu_device)"``. This module does
that job properly.

Static (:func:`find_static`, runs anywhere): parse a function's source with
``ast`` and report every call that syncs with the host, copies between host and
device, or reads GPU values on the host: ``.item()``, ``.cpu()``, ``.to("cpu")``,
``.tolist()``, ``.numpy()``, ``print(tensor)``, ``torch.cuda.synchronize()``,
``.synchronize()``, data-dependent shapes (``nonzero``, ``masked_select``,
``unique``...), ``if tensor:`` / ``bool(t)`` / ``float(t)`` where the expression is
recognisably a tensor, host-built tensors copied to the GPU, and code that
behaves differently while capturing. Each finding has the file, the line, a short
*why* and a *fix*. It is a reader, not a type checker: ``if flag:`` on a tensor
called ``flag`` looks like any other ``if``, so it cannot be seen statically.

Dynamic (:func:`find_dynamic`, GPU only): run the function

1. under ``torch.cuda.set_sync_debug_mode("warn")``, mapping every warning to the
   line that triggered it through the live Python stack;
2. under the host-blocking test (:func:`course.blocking.host_blocking`), with a
   line tracer that says which line the host waited on;
3. under a trial capture (:func:`course.capture.try_capture`), mapping the error's
   traceback to a line; and, when capture succeeds, replaying with new inputs
   and comparing with eager (catches values frozen at capture time).

:func:`find_hazards` runs both (dynamic only where there is a GPU).
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import sys
import sysconfig
import textwrap
import time
import traceback
import warnings

from .reference import experiment
from .results import Result
from .runtime import runtime


# =====================================================================================
# Rules
# =====================================================================================
@dataclasses.dataclass(frozen=True)
class Rule:
    """A kind of hazard: what the finder reports and what to do about it."""

    id: str
    what: str
    why: str
    fix: str


_RULES = (
    Rule("item", ".item()",
         "copies one value to the host and waits for the GPU (a sync); during capture it fails",
         "keep the value on the device as a 0-dim tensor and use it in tensor ops (x / t, torch.where)"),
    Rule("cpu", ".cpu()",
         "a device-to-host copy: the host waits for the GPU; during capture it fails (pageable destination)",
         "keep results on the device; copy the graph's static output to the host after replay"),
    Rule("to_cpu", '.to("cpu")',
         "a device-to-host copy (the seeds' indices->to(cpu_device)): a sync; during capture it fails",
         "do the work on the device (a device kernel, F.embedding, index_select) and copy results out after replay"),
    Rule("tolist", ".tolist()",
         "copies the tensor into a Python list on the host (a sync); on a host copy of GPU data the values "
         "freeze at capture time",
         "index with the device tensor itself (x[ids], index_select) instead of a Python list"),
    Rule("numpy", ".numpy()",
         "needs the values on the host: a device-to-host copy and a sync",
         "keep the computation in torch on the device; convert the static output after replay"),
    Rule("print", "print(tensor)",
         "formatting a CUDA tensor copies its values to the host (a sync); during capture it fails, and a "
         "replay never prints",
         "print outside the captured function, from the graph's static outputs after replay"),
    Rule("cuda_synchronize", "torch.cuda.synchronize()",
         "waits for all GPU work; not allowed while a stream is capturing",
         "delete it: work on one stream already runs in order; synchronize after replay if the host needs results"),
    Rule("synchronize", ".synchronize()",
         "a stream or event synchronize makes the host wait; not allowed while capturing",
         "delete it, or use stream/event waits on the device (wait_stream, wait_event) that a graph can record"),
    Rule("data_dependent", "data-dependent shape",
         "the output's size depends on the values: the host must read a count from the GPU (a sync), and a "
         "graph needs fixed shapes",
         "use a fixed-shape formulation: torch.where(mask, x, 0), multiply by the mask, index_fill_, "
         "or torch.nonzero_static(x, size=...)"),
    Rule("host_bool", "if tensor / bool(tensor)",
         "Python needs a host bool, so the value is copied from the GPU (a sync); during capture it fails, "
         "and a branch taken at capture would be frozen",
         "compute without branching: torch.where, clamp, masks; branch on shapes and Python values only"),
    Rule("host_scalar", "float(tensor) / int(tensor)",
         "converting a GPU tensor to a Python number copies it to the host (a sync), like .item()",
         "keep it a 0-dim tensor on the device"),
    Rule("tensor_ctor", "torch.tensor(..., device=cuda)",
         "builds the tensor on the host and copies it from pageable memory: a sync; during capture it fails",
         "create constants once before capture (a static buffer), or build them on the GPU "
         "(torch.arange/full/zeros with device=)"),
    Rule("h2d", "host-to-device copy",
         "copies host (pageable) memory to the GPU: the host waits, and during capture it fails",
         "copy the data into a static device buffer before capture (static.copy_(new)), or read it from pinned "
         "memory with non_blocking=True"),
    Rule("capture_branch", "torch.cuda.is_current_stream_capturing()",
         "the code does something different while capturing: the graph records the capture-time path and a "
         "replay can silently differ from eager",
         "make the captured path the same as eager; move the host-side logic out of the captured function"),
    Rule("host_value", "host value (random/time)",
         "a value computed on the host is read once, at capture; every replay reuses it",
         "use torch's device RNG (torch.rand(..., device=)), which graphs replay with fresh numbers, or pass "
         "the value in a static tensor"),
)
RULES = {r.id: r for r in _RULES}

_DATA_DEPENDENT = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount",
                   "repeat_interleave"}
_TENSORISH_METHODS = {"any", "all", "sum", "mean", "max", "min", "amax", "amin", "prod", "norm", "std", "var",
                      "eq", "ne", "gt", "lt", "ge", "le", "isnan", "isinf", "isfinite", "logical_and",
                      "logical_or", "logical_not", "count_nonzero", "abs", "item"}
_NOT_TENSOR_TORCH = ("torch.cuda.", "torch.is_", "torch.jit.", "torch.compiler.", "torch.backends.",
                     "torch.distributed.", "torch._dynamo.", "torch.get_", "torch.are_")
_HOST_FACTORIES = {"tensor", "as_tensor", "from_numpy", "Tensor", "ones", "zeros", "empty", "full", "arange",
                   "linspace", "rand", "randn", "randint", "eye"}
_DTYPES = {"float", "float16", "float32", "float64", "half", "double", "bfloat16", "int", "int8", "int16",
           "int32", "int64", "long", "short", "uint8", "bool", "complex64", "complex128", "cfloat"}
_HOST_VALUE_PREFIXES = ("random.", "np.random.", "numpy.random.", "time.time", "time.perf_counter",
                        "time.monotonic", "datetime.")


# =====================================================================================
# Findings
# =====================================================================================
@dataclasses.dataclass(frozen=True)
class Finding:
    """One hazard at one line."""

    rule: str
    line: int | None  # absolute line number in ``file`` (None: the check could not tell)
    file: str | None
    code: str  # the source line, stripped
    source: str = "static"  # static | sync-debug | host-blocking | capture | replay
    detail: str = ""  # the warning, error or measurement behind a dynamic finding

    @property
    def why(self) -> str:
        """Why this is a hazard."""
        return RULES[self.rule].why if self.rule in RULES else self.detail

    @property
    def fix(self) -> str:
        """What to do instead."""
        return RULES[self.rule].fix if self.rule in RULES else ""

    def where(self) -> str:
        """``file.py:LINE`` (short file name)."""
        name = os.path.basename(self.file) if self.file else "?"
        return f"{name}:{self.line if self.line is not None else '?'}"

    def __str__(self) -> str:
        what = RULES[self.rule].what if self.rule in RULES else self.rule
        head = f"{self.where():>18}  [{self.source}] {what}: {self.code}".rstrip(": ")
        return head + (f"\n{'':20}{self.detail}" if self.detail else "")


# =====================================================================================
# Static analysis
# =====================================================================================
def _dotted(node) -> str | None:
    """'torch.cuda.synchronize' for a chain of attributes on a name; None otherwise."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _ident(node) -> str | None:
    """The last identifier of a name or attribute (``cpu_device`` for ``self.cpu_device``)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _looks_tensor(expr) -> bool:
    """Heuristic: does ``expr`` compute something on a tensor (a reduction, a comparison method, torch.*)?"""
    for n in ast.walk(expr):
        if isinstance(n, ast.Call):
            if isinstance(n.func, ast.Attribute) and n.func.attr in _TENSORISH_METHODS:
                return True
            d = _dotted(n.func)
            if d and d.startswith("torch.") and not d.startswith(_NOT_TENSOR_TORCH):
                return True
    return False


def _device_kind(node) -> str | None:
    """Classify a ``.to(...)`` target: 'cpu', 'device', 'dtype' or None (unknown)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return "cpu" if node.value.lower().startswith("cpu") else "device"
    if isinstance(node, ast.Call) and _dotted(node.func) in ("torch.device", "device"):
        return _device_kind(node.args[0]) if node.args else None
    d = _dotted(node)
    if d and d.startswith("torch.") and d.split(".")[-1] in _DTYPES:
        return "dtype"
    name = _ident(node)
    if name:
        return "cpu" if "cpu" in name.lower() else "device"
    return None


def _looks_host(node) -> bool:
    """Heuristic: is ``node`` a host (CPU, pageable) tensor? A name saying so, or a torch factory without device=."""
    name = _ident(node)
    if name and "pinned" not in name.lower() and any(k in name.lower() for k in ("host", "cpu")):
        return True
    if isinstance(node, ast.Call):
        d = _dotted(node.func) or ""
        if d.startswith("torch.") and d.split(".")[-1] in _HOST_FACTORIES:
            return not any(k.arg == "device" for k in node.keywords)
        if isinstance(node.func, ast.Attribute) and node.func.attr in ("cpu", "numpy"):
            return True
    return False


class _Finder(ast.NodeVisitor):
    def __init__(self, lines, first_line, file):
        self.lines, self.first, self.file = lines, first_line, file
        self.found = []

    def add(self, rule: str, lineno: int) -> None:
        line = self.first + lineno - 1
        code = self.lines[lineno - 1].strip() if 0 < lineno <= len(self.lines) else ""
        self.found.append(Finding(rule, line, self.file, code))

    # calls -----------------------------------------------------------------------
    def visit_Call(self, node):
        f = node.func
        d = _dotted(f) or ""
        if isinstance(f, ast.Attribute):
            self._method(node, f, d)
        elif isinstance(f, ast.Name):
            self._function(node, f.id)
        if d.startswith(_HOST_VALUE_PREFIXES):
            self.add("host_value", node.lineno)
        self.generic_visit(node)

    def _method(self, node, f, d):
        attr, line = f.attr, f.end_lineno or node.lineno
        if attr == "item" and not node.args:
            self.add("item", line)
        elif attr in ("cpu", "tolist", "numpy") and not node.args:
            self.add("cpu" if attr == "cpu" else attr, line)
        elif attr == "to":
            targets = list(node.args[:1]) + [k.value for k in node.keywords if k.arg == "device"]
            kinds = {_device_kind(t) for t in targets}
            if "cpu" in kinds:
                self.add("to_cpu", line)
            elif "device" in kinds and _looks_host(f.value):
                self.add("h2d", line)
        elif attr == "cuda" and not d.startswith("torch.") and d != "torch.cuda":
            self.add("h2d", line)
        elif attr == "synchronize":
            self.add("cuda_synchronize" if d.endswith("cuda.synchronize") else "synchronize", line)
        elif attr in _DATA_DEPENDENT:
            if attr == "repeat_interleave":
                reps = node.args[1:2] if d.startswith("torch.") else node.args[:1]
                reps = reps + [k.value for k in node.keywords if k.arg == "repeats"]
                if reps and all(isinstance(r, ast.Constant) for r in reps):
                    return
            self.add("data_dependent", line)
        elif attr == "where" and d.startswith("torch.") and len(node.args) == 1 and not node.keywords:
            self.add("data_dependent", line)
        elif attr in ("equal", "allclose"):
            self.add("host_bool", line)
        elif attr == "is_current_stream_capturing":
            self.add("capture_branch", line)
        elif d.startswith("torch.") and attr in ("tensor", "as_tensor"):
            dev = [k.value for k in node.keywords if k.arg == "device"]
            if dev and _device_kind(dev[0]) not in ("cpu", None):
                self.add("tensor_ctor", line)

    def _function(self, node, name):
        if name == "print":
            if any(not isinstance(a, ast.Constant) and not (isinstance(a, ast.JoinedStr) and all(
                    isinstance(v, ast.Constant) for v in a.values)) for a in node.args):
                self.add("print", node.lineno)
        elif name in ("bool", "float", "int", "complex") and len(node.args) == 1 and _looks_tensor(node.args[0]):
            if not self._flagged_inside(node.args[0]):
                self.add("host_bool" if name == "bool" else "host_scalar", node.lineno)
        elif name == "synchronize":
            self.add("cuda_synchronize", node.lineno)
        elif name in _DATA_DEPENDENT:  # from torch import nonzero
            self.add("data_dependent", node.lineno)

    # branches on tensors -----------------------------------------------------------
    @staticmethod
    def _flagged_inside(expr) -> bool:
        """True when ``expr`` already contains a call reported on its own (.item(), .tolist(), ...)."""
        for n in ast.walk(expr):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in (
                    "item", "tolist", "cpu", "numpy", "equal", "allclose", "is_current_stream_capturing"):
                return True
        return False

    def _test(self, test):
        if test is not None and _looks_tensor(test) and not self._flagged_inside(test):
            self.add("host_bool", test.lineno)

    def visit_If(self, node):
        self._test(node.test)
        self.generic_visit(node)

    def visit_While(self, node):
        self._test(node.test)
        self.generic_visit(node)

    def visit_IfExp(self, node):
        self._test(node.test)
        self.generic_visit(node)

    def visit_Assert(self, node):
        self._test(node.test)
        self.generic_visit(node)

    def visit_comprehension(self, node):
        for cond in node.ifs:
            self._test(cond)
        self.generic_visit(node)


def _target(obj):
    """The plain Python function (or class/module) whose source describes ``obj``."""
    import functools

    if isinstance(obj, functools.partial):
        return _target(obj.func)
    orig = getattr(obj, "_orig_mod", None)  # torch.compile'd module
    if orig is not None:
        return _target(orig)
    try:
        import torch
        if isinstance(obj, torch.nn.Module):
            return type(obj).forward
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    if inspect.ismethod(obj):
        obj = obj.__func__
    if inspect.isfunction(obj) or inspect.isclass(obj) or inspect.ismodule(obj):
        return inspect.unwrap(obj)
    if callable(obj) and inspect.isfunction(getattr(type(obj), "__call__", None)):
        return type(obj).__call__
    raise TypeError(f"find_static needs a Python function, method, class, module or nn.Module; "
                    f"got {type(obj).__name__} (built-in and C functions have no Python source to read).")


def find_static(obj) -> list:
    """Read ``obj``'s source (AST) and report every capture hazard, sorted by line.

    ``obj``: a function, method, lambda, class, module, ``functools.partial``, or an
    ``nn.Module`` (its ``forward`` is read). Returns a list of :class:`Finding` with
    absolute line numbers in the file that defines ``obj``.
    """
    target = _target(obj)
    try:
        lines, first = inspect.getsourcelines(target)
        file = inspect.getsourcefile(target) or inspect.getfile(target)
    except (OSError, TypeError) as e:
        raise ValueError(f"cannot read the source of {target!r} ({e}); define it in a file or a notebook cell.") \
            from None
    first = max(first, 1)
    text = textwrap.dedent("".join(lines))
    try:
        tree = ast.parse(text)
    except SyntaxError:
        # a lambda in the middle of a statement: parse the lambda expression on its own
        tree = _parse_lambda(text, target)
    finder = _Finder([l.rstrip("\n") for l in lines], first, file)
    finder.visit(tree)
    return sorted(set(finder.found), key=lambda f: (f.line or 0, f.rule))


def _parse_lambda(text: str, target):
    start = text.find("lambda")
    if start < 0:
        raise ValueError(f"cannot parse the source of {target!r}")
    chunk = text[start:]
    # try ever shorter prefixes until the lambda parses as an expression
    for end in range(len(chunk), 6, -1):
        try:
            tree = ast.parse("(" + chunk[:end] + ")", mode="eval")
        except SyntaxError:
            continue
        line_off = text[:start].count("\n")
        for n in ast.walk(tree):
            if hasattr(n, "lineno"):
                n.lineno += line_off
                if getattr(n, "end_lineno", None) is not None:
                    n.end_lineno += line_off
        return tree
    raise ValueError(f"cannot parse the source of {target!r}")


# =====================================================================================
# Dynamic analysis (GPU)
# =====================================================================================
def _library_dirs() -> tuple:
    import torch

    dirs = {os.path.dirname(torch.__file__)}
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        p = sysconfig.get_paths().get(key)
        if p:
            dirs.add(p)
    here = os.path.dirname(os.path.abspath(__file__))
    tools = tuple(os.path.join(here, f) for f in ("hazards.py", "capture.py", "blocking.py", "timing.py",
                                                  "runtime.py", "reference.py"))
    return tuple(sorted(dirs)), tools


def is_library_file(filename: str) -> bool:
    """True for frames that are not 'user code': torch, the standard library, site-packages, the course's tools."""
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
    """Run ``fn()`` once under ``torch.cuda.set_sync_debug_mode("warn")``; one dict per sync warning.

    Each dict has the warning ``message`` and the user ``frame`` (filename, lineno,
    function, line) that was running when torch warned, found from the live stack.
    """
    import torch

    events = []

    def hook(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if "called a synchronizing CUDA operation" not in text:
            return  # e.g. the one-time "sync debug mode is a prototype" notice
        stack = traceback.extract_stack(sys._getframe(1))
        frames = [(f.filename, f.lineno, f.name, (f.line or "").strip()) for f in stack]
        events.append({"message": text.split("(Triggered internally")[0].strip(), "frame": user_frame(frames)})

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
    """:func:`course.blocking.host_blocking` plus the user line the host waited on (if it blocked).

    A line tracer records when each user line starts; the line that took most of
    the queued GPU sleep is the one that waited. Returns (BlockingReport, frame or None).
    """
    from .blocking import host_blocking

    events = []

    def local(frame, event, arg):
        if event in ("line", "return"):
            events.append((time.perf_counter(), frame.f_code.co_filename, frame.f_lineno,
                           frame.f_code.co_name))
        return local

    def global_tracer(frame, event, arg):
        if event == "call" and not is_library_file(frame.f_code.co_filename):
            events.append((time.perf_counter(), frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
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
    """The traced event (time, file, line, function) whose line was running when ``threshold_s`` had passed.

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
    import torch

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
    import torch

    with torch.no_grad():
        for a, old in saved:
            a.copy_(old)


@dataclasses.dataclass
class DynamicReport:
    """What running the function on the GPU showed."""

    findings: list
    blocking: object  # course.blocking.BlockingReport
    capture: object  # course.capture.CaptureOutcome (graph dropped)
    replay_matches: bool | None  # None: not captured, or the check was skipped
    sync_warnings: int


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
    from .capture import require_gpu, try_capture
    from .zoo import flat_tensors, same_result
    import torch

    require_gpu("the dynamic hazard finder")
    call = lambda: fn(*args)  # noqa: E731
    call()  # eager warm-up: lazy init must not be reported as a hazard
    torch.cuda.synchronize()
    findings = []

    events = sync_debug_events(call)
    per_line = {}
    for ev in events:
        fr = ev["frame"] or (None, None, "", "")
        per_line.setdefault((fr[0], fr[1]), [fr, 0, ev["message"]])[1] += 1
    for (file, line), (fr, count, message) in per_line.items():
        times = f"{count} times" if count > 1 else "once"
        findings.append(Finding("sync", line, file, fr[3], "sync-debug", f"torch warned {times}: {message}"))

    report, frame = blocking_with_line(call, sleep_ms=sleep_ms)
    if report.blocked:
        findings.append(Finding("blocks", frame[1] if frame else None, frame[0] if frame else None,
                                frame[3] if frame else "", "host-blocking",
                                f"returned after {report.host_return_ms:.1f} ms, with the GPU busy for "
                                f"{report.gpu_busy_ms:.1f} ms: the host waited"))

    outcome = try_capture(call)
    replay = None
    if not outcome.ok:
        fr = user_frame(outcome.frames)
        findings.append(Finding("capture", fr[1] if fr else None, fr[0] if fr else None, fr[3] if fr else "",
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
                file, line = inspect.getsourcefile(_target(fn)), inspect.getsourcelines(_target(fn))[1]
            except (OSError, TypeError):
                file, line = None, None
            findings.append(Finding("frozen", line, file, f"def {getattr(fn, '__name__', '?')}(...)", "replay",
                                    "replay with new inputs differs from eager: values were frozen at capture"))
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
        return sorted({f.line for f in self.findings if f.line is not None and (source is None or f.source == source)})

    def __str__(self) -> str:
        head = f"{self.name}: " + (f"{len(self.findings)} finding(s)" if self.flagged else "no hazards found")
        body = [str(f) for f in self.findings]
        if self.dynamic:
            b = self.dynamic.blocking
            body.append(f"{'':20}host returned after {b.host_return_ms:.2f} ms; GPU busy {b.gpu_busy_ms:.2f} ms; "
                        f"capture: {self.dynamic.capture}")
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
        from .capture import require_gpu
        require_gpu("the dynamic hazard finder")
    if not dynamic:
        note = "" if on_gpu else "static only: the dynamic checks need a GPU (see the reference results)"
        return HazardReport(name, static, None, note)
    return HazardReport(name, static, find_dynamic(fn, *args, sleep_ms=sleep_ms, replay_check=replay_check))


# =====================================================================================
# Experiments (GPU): the zoo under the finder, and the misleading event test
# =====================================================================================
def _canary_ok() -> bool:
    """After a capture attempt: does a fresh capture + replay of a safe function still work?"""
    import torch
    from .capture import try_capture

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
    from . import zoo
    from .blocking import event_complete_right_after

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
        from .runtime import cuda
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
    from .runtime import as_numba, numba_stream

    if t.numel() > 32:
        raise ValueError("launch_tiny is a one-block kernel: pass at most 32 elements")
    tiny_kernel()[1, 32, numba_stream()](as_numba(t))


def _gpu_us_per_call(fn, n: int = 20, host_us: float = 1000.0) -> float:
    """GPU time per call of an asynchronous ``fn``: queue it behind a sleep so launch gaps vanish."""
    import torch
    from .blocking import gpu_sleep

    torch.cuda.synchronize()
    gpu_sleep(5.0 + 1.5 * n * host_us / 1e3)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / n


@experiment("hazards_event_test", gpu_only=True, quick={"repeats": 5})
def event_test_experiment(repeats: int = 25, sleep_ms: float = 20.0) -> Result:
    """The seeds' 'event already complete, so it synchronized' test against the robust host-blocking test."""
    import torch
    from .blocking import event_complete_right_after, host_blocking
    from .timing import time_enqueue

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
