"""The static capture-hazard finder: read a function's source and flag what breaks capture.

InfiniCore's embedding graph-recording guide checks for the host sync with ``grep
"to(cpu_device)"``; :func:`find_static` parses the source with ``ast`` and reports every call that
syncs with the host, copies between host and device or reads GPU values on the host (:data:`RULES`),
each with its line, a short *why* and a *fix*. It is a reader, not a type checker: ``if flag:`` on a
tensor called ``flag`` looks like any other ``if``. The dynamic finder, run on a GPU, is
:mod:`course.lessons.what_breaks.dynamic`.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import os
import textwrap

import torch


# --- Rules: what the finder reports, why it breaks capture, and what to do instead -------------
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
         "keep the value on the device as a 0-dim tensor and use it in tensor ops (x / t, "
         "torch.where)"),
    Rule("cpu", ".cpu()",
         "a device-to-host copy: the host waits for the GPU; during capture it fails (pageable "
         "destination)",
         "keep results on the device; copy the graph's static output to the host after replay"),
    Rule("to_cpu", '.to("cpu")',
         "a device-to-host copy (InfiniCore's old Embedding::forward: indices->to(cpu_device)): a "
         "sync; during capture it fails",
         "do the work on the device (a device kernel, F.embedding, index_select) and copy results "
         "out after replay"),
    Rule("tolist", ".tolist()",
         "copies the tensor into a Python list on the host (a sync); on a host copy of GPU data "
         "the values freeze at capture time",
         "index with the device tensor itself (x[ids], index_select) instead of a Python list"),
    Rule("numpy", ".numpy()",
         "needs the values on the host: a device-to-host copy and a sync",
         "keep the computation in torch on the device; convert the static output after replay"),
    Rule("print", "print(tensor)",
         "formatting a CUDA tensor copies its values to the host (a sync); during capture it "
         "fails, and a replay never prints",
         "print outside the captured function, from the graph's static outputs after replay"),
    Rule("cuda_synchronize", "torch.cuda.synchronize()",
         "waits for all GPU work; not allowed while a stream is capturing",
         "delete it: work on one stream already runs in order; synchronize after replay if the "
         "host needs results"),
    Rule("synchronize", ".synchronize()",
         "a stream or event synchronize makes the host wait; not allowed while capturing",
         "delete it, or use stream/event waits on the device (wait_stream, wait_event) that a "
         "graph can record"),
    Rule("data_dependent", "data-dependent shape",
         "the output's size depends on the values: the host must read a count from the GPU (a "
         "sync), and a graph needs fixed shapes",
         "use a fixed-shape formulation: torch.where(mask, x, 0), multiply by the mask, "
         "index_fill_, or torch.nonzero_static(x, size=...)"),
    Rule("host_bool", "if tensor / bool(tensor)",
         "Python needs a host bool, so the value is copied from the GPU (a sync); during capture "
         "it fails, and a branch taken at capture would be frozen",
         "compute without branching: torch.where, clamp, masks; branch on shapes and Python values "
         "only"),
    Rule("host_scalar", "float(tensor) / int(tensor)",
         "converting a GPU tensor to a Python number copies it to the host (a sync), like .item()",
         "keep it a 0-dim tensor on the device"),
    Rule("tensor_ctor", "torch.tensor(..., device=cuda)",
         "builds the tensor on the host and copies it from pageable memory: a sync; during capture "
         "it fails",
         "create constants once before capture (a static buffer), or build them on the GPU "
         "(torch.arange/full/zeros with device=)"),
    Rule("h2d", "host-to-device copy",
         "copies host (pageable) memory to the GPU: the host waits, and during capture it fails",
         "copy the data into a static device buffer before capture (static.copy_(new)), or read it "
         "from pinned memory with non_blocking=True"),
    Rule("capture_branch", "torch.cuda.is_current_stream_capturing()",
         "the code does something different while capturing: the graph records the capture-time "
         "path and a replay can silently differ from eager",
         "make the captured path the same as eager; move the host-side logic out of the captured "
         "function"),
    Rule("numba_default_stream", "Numba launch without a stream",
         "kernel[blocks, threads](...) launches on Numba's default stream, not on torch's "
         "capturing stream: the capture does not record it (or CUDA refuses it)",
         "launch on torch's current stream: kernel[blocks, threads, course.numba_stream()](...)"),
    Rule("numba_alloc", "cuda.device_array / cuda.to_device",
         "Numba allocates device memory with cuMemAlloc (and to_device copies from pageable host "
         "memory): not allowed while a stream is capturing, and a replay would not allocate again",
         "allocate once before capture (torch.empty(..., device='cuda') or a static buffer) and "
         "reuse it"),
    Rule("host_value", "host value (random/time)",
         "a value computed on the host is read once, at capture; every replay reuses it",
         "use torch's device RNG (torch.rand(..., device=)), which graphs replay with fresh "
         "numbers, or pass the value in a static tensor"),
)
RULES = {r.id: r for r in _RULES}

_DATA_DEPENDENT = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive",
                   "bincount", "repeat_interleave"}
_TENSORISH_METHODS = {"any", "all", "sum", "mean", "max", "min", "amax", "amin", "prod", "norm",
                      "std", "var", "eq", "ne", "gt", "lt", "ge", "le", "isnan", "isinf",
                      "isfinite", "logical_and", "logical_or", "logical_not", "count_nonzero",
                      "abs", "item"}
_NOT_TENSOR_TORCH = ("torch.cuda.", "torch.is_", "torch.jit.", "torch.compiler.", "torch.backends.",
                     "torch.distributed.", "torch._dynamo.", "torch.get_", "torch.are_")
_HOST_FACTORIES = {"tensor", "as_tensor", "from_numpy", "Tensor", "ones", "zeros", "empty", "full",
                   "arange", "linspace", "rand", "randn", "randint", "eye"}
_DTYPES = {"float", "float16", "float32", "float64", "half", "double", "bfloat16", "int", "int8",
           "int16", "int32", "int64", "long", "short", "uint8", "bool", "complex64", "complex128",
           "cfloat"}
_NUMBA_ALLOCATORS = ("device_array", "device_array_like", "to_device", "pinned_array",
                     "mapped_array")
_HOST_VALUE_PREFIXES = ("random.", "np.random.", "numpy.random.", "time.time", "time.perf_counter",
                        "time.monotonic", "datetime.")


# --- Findings ----------------------------------------------------------------------------------
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


# --- Static analysis ---------------------------------------------------------------------------
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
    """Heuristic: does ``expr`` compute something on a tensor (a reduction, a comparison method,
    torch.*)?"""
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
    """Heuristic: is ``node`` a host (CPU, pageable) tensor? A name saying so, or a torch factory
    without device=."""
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
        pair = isinstance(f, ast.Subscript) and isinstance(f.slice, ast.Tuple) \
            and len(f.slice.elts) == 2
        if pair:  # kernel[blocks, threads](...): no stream given
            self.add("numba_default_stream", node.lineno)
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
        elif attr == "where" and d.startswith("torch.") and len(node.args) == 1 \
                and not node.keywords:
            self.add("data_dependent", line)
        elif attr in ("equal", "allclose"):
            self.add("host_bool", line)
        elif attr == "is_current_stream_capturing":
            self.add("capture_branch", line)
        elif attr in _NUMBA_ALLOCATORS:  # (torch has no methods by these names)
            self.add("numba_alloc", line)
        elif d.startswith("torch.") and attr in ("tensor", "as_tensor"):
            dev = [k.value for k in node.keywords if k.arg == "device"]
            if dev and _device_kind(dev[0]) not in ("cpu", None):
                self.add("tensor_ctor", line)

    def _function(self, node, name):
        if name == "print":
            if any(not isinstance(a, ast.Constant) and not (isinstance(a, ast.JoinedStr) and all(
                    isinstance(v, ast.Constant) for v in a.values)) for a in node.args):
                self.add("print", node.lineno)
        elif name in ("bool", "float", "int", "complex") and len(node.args) == 1 \
                and _looks_tensor(node.args[0]):
            if not self._flagged_inside(node.args[0]):
                self.add("host_bool" if name == "bool" else "host_scalar", node.lineno)
        elif name == "synchronize":
            self.add("cuda_synchronize", node.lineno)
        elif name in _DATA_DEPENDENT:  # from torch import nonzero
            self.add("data_dependent", node.lineno)

    # branches on tensors -----------------------------------------------------------
    @staticmethod
    def _flagged_inside(expr) -> bool:
        """True when ``expr`` already contains a call reported on its own (.item(), .tolist(),
        ...)."""
        for n in ast.walk(expr):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in (
                    "item", "tolist", "cpu", "numpy", "equal", "allclose",
                    "is_current_stream_capturing"):
                return True
        return False

    def _test(self, test):
        if test is not None and _looks_tensor(test) and not self._flagged_inside(test):
            self.add("host_bool", test.lineno)

    def _visit_test(self, node):
        self._test(node.test)
        self.generic_visit(node)

    visit_If = visit_While = visit_IfExp = visit_Assert = _visit_test

    def visit_comprehension(self, node):
        for cond in node.ifs:
            self._test(cond)
        self.generic_visit(node)


def _target(obj):
    """The plain Python function (or class/module) whose source describes ``obj``."""
    if isinstance(obj, functools.partial):
        return _target(obj.func)
    orig = getattr(obj, "_orig_mod", None)  # torch.compile'd module
    if orig is not None:
        return _target(orig)
    if isinstance(obj, torch.nn.Module):
        return type(obj).forward
    if inspect.ismethod(obj):
        obj = obj.__func__
    if inspect.isfunction(obj) or inspect.isclass(obj) or inspect.ismodule(obj):
        return inspect.unwrap(obj)
    if callable(obj) and inspect.isfunction(getattr(type(obj), "__call__", None)):
        return type(obj).__call__
    raise TypeError("find_static needs a Python function, method, class, module or nn.Module; got "
                    f"{type(obj).__name__} (built-in and C functions have no Python source to "
                    "read).")


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
        raise ValueError(f"cannot read the source of {target!r} ({e}); define it in a file or a "
                         "notebook cell.") \
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
