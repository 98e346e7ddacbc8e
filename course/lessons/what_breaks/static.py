"""The static capture-hazard finder: read a function's source and flag what breaks capture.

InfiniCore's embedding graph-recording guide checks for the host sync with ``grep "to(cpu_device)"``. This module does
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

The dynamic finder, which runs the function on a GPU, is :mod:`course.lessons.what_breaks.dynamic`.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import textwrap

from course.lessons.what_breaks.rules import (_DATA_DEPENDENT, _DTYPES, _HOST_FACTORIES,  # noqa: F401
                                             _HOST_VALUE_PREFIXES, _NOT_TENSOR_TORCH, _TENSORISH_METHODS, RULES)


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
        if isinstance(f, ast.Subscript) and isinstance(f.slice, ast.Tuple) and len(f.slice.elts) == 2:
            self.add("numba_default_stream", node.lineno)  # kernel[blocks, threads](...): no stream given
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
        elif attr in ("device_array", "device_array_like", "to_device", "pinned_array", "mapped_array"):
            self.add("numba_alloc", line)  # Numba's allocators (torch has no methods by these names)
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
