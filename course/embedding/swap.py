"""Lab 2's two embeddings that compute the same thing; only one of them can be captured.

``cpu-copy`` (InfiniCore's "before": ``indices->to(cpu_device)``) copies the ids to the host, checks
them and sends them back: the host waits for the GPU, and a capture refuses the copy. ``device``
(the "after") reads the ids on the GPU with the Numba kernel: nothing waits, and it is captured.
:class:`SwapEmbedding` switches between them (``impl``), :func:`make_model` builds a small model,
:func:`swap` switches a whole model (:func:`check_swap` judges a learner's); :class:`ReplayStandIn`
is the simulator's graph for the replay exercise.
"""
from __future__ import annotations

import ast
import inspect
import textwrap
import types
import warnings

import torch

from course import embedding as E
from course.core.harness import Rule, check
from course.core.runtime import runtime

IMPLS = ("cpu-copy", "device")


def cpu_copy_lookup(ids, weight, padding_idx=None):
    """The "before" lookup: copy the ids to the host, check them there, send them back, gather.

    Correct, but the copy to the host waits for the GPU (a sync) and cannot be captured.
    """
    E.validate(ids, weight, padding_idx)
    ids_host = ids.to("cpu").contiguous()  # device -> host copy: the host waits for the GPU here
    E.host_bounds_check(ids_host, weight.shape[0])  # cheap now: the ids are on the host
    ids_back = ids_host.to(weight.device)  # host -> device copy
    return E.embedding(ids_back, weight, padding_idx, bounds="device")


def device_lookup(ids, weight, padding_idx=None):
    """The "after" lookup: the Numba kernel reads the ids on the device; nothing waits.

    Out-of-range ids are reported through the error flag (:func:`course.embedding.check_errors`).
    """
    return E.embedding(ids, weight, padding_idx)


LOOKUPS = {"cpu-copy": cpu_copy_lookup, "device": device_lookup}


def _check_impl(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    return impl


class SwapEmbedding(torch.nn.Module):
    """An inference-only embedding table whose lookup is ``cpu-copy`` or ``device`` (swappable).

    Like ``torch.nn.Embedding``, the ``padding_idx`` row starts at zero. The weight is a
    parameter without gradient: the Numba kernels implement the forward pass only.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, impl: str = "device", padding_idx=None,
                 dtype=torch.float32, device=None, generator=None, lookups=None):
        super().__init__()
        # ``lookups`` maps impl -> fn(ids, weight, padding_idx): a lab plugs in its own versions
        # here.
        self.lookups = {**LOOKUPS, **(lookups or {})}
        device = torch.device(device if device is not None else runtime().device)
        w = torch.randn(num_embeddings, embedding_dim, generator=generator).to(dtype)
        if padding_idx is not None:
            w[padding_idx] = 0
        self.weight = torch.nn.Parameter(w.to(device), requires_grad=False)
        self.padding_idx = padding_idx
        self.impl = _check_impl(impl)

    def forward(self, ids):
        """Look ``ids`` up with the current implementation."""
        return self.lookups[_check_impl(self.impl)](ids, self.weight, self.padding_idx)

    def extra_repr(self) -> str:
        """Shown by print(module): table size, impl and dtype."""
        v, d = self.weight.shape
        return f"{v}, {d}, impl={self.impl!r}, dtype={self.weight.dtype}"


class TinyModel(torch.nn.Module):
    """embedding -> linear: the smallest model with an embedding in front."""

    def __init__(self, vocab: int, dim: int, out_features: int, *, impl: str = "device", dtype=torch.float32,
                 device=None, generator=None, lookups=None):
        super().__init__()
        device = torch.device(device if device is not None else runtime().device)
        self.embed = SwapEmbedding(vocab, dim, impl=impl, dtype=dtype, device=device, generator=generator,
                                   lookups=lookups)
        self.proj = torch.nn.Linear(dim, out_features, dtype=dtype)
        with torch.no_grad():
            w = torch.randn(out_features, dim, generator=generator) / dim ** 0.5
            self.proj.weight.copy_(w.to(dtype))
            self.proj.bias.zero_()
        self.proj.to(device).requires_grad_(False)

    def forward(self, ids):
        """Logits ``[*ids.shape, out_features]``."""
        return self.proj(self.embed(ids))


def make_model(vocab: int = 1000, dim: int = 64, out_features: int = 32, *, impl: str = "device",
               dtype=torch.float32, seed: int = 0, lookups=None) -> TinyModel:
    """A :class:`TinyModel` on ``course.device()`` with reproducible weights.

    ``lookups`` ({"cpu-copy": fn, "device": fn}, each ``fn(ids, weight, padding_idx)``)
    replaces the course's implementations, e.g. with the ones written in lab 2.
    """
    return TinyModel(vocab, dim, out_features, impl=impl, dtype=dtype,
                     generator=torch.Generator().manual_seed(seed), lookups=lookups).eval()


def swap(model: torch.nn.Module, impl: str) -> torch.nn.Module:
    """Switch every :class:`SwapEmbedding` in ``model`` to ``impl`` (weights untouched); returns
    ``model``."""
    _check_impl(impl)
    found = [m for m in model.modules() if isinstance(m, SwapEmbedding)]
    if not found:
        raise ValueError(f"{type(model).__name__} contains no SwapEmbedding to "
                         "swap: build it with course.embedding.swap.make_model() "
                         "or use SwapEmbedding for its embedding.")
    for m in found:
        m.impl = impl
    return model


def _returns_model(s) -> str:
    got = s.swap(s.model, "device")
    return "" if got is s.model else f"swap() must return the model it was given, it returned {type(got).__name__}"


def _impl_is(impl: str):
    """A rule's test: after ``swap(model, impl)`` (the device one already ran), every table says
    ``impl``."""
    def test(s) -> str:
        if impl == "cpu-copy":
            s.before = s.model(s.ids)
            s.swap(s.model, impl)
        return "" if s.model.embed.impl == impl else \
            f"swap(model, {impl!r}) left model.embed.impl = {s.model.embed.impl!r}"
    return test


def _nested(s) -> str:
    nested = torch.nn.Sequential(make_model(vocab=50, dim=8, out_features=4),
                                 torch.nn.Sequential(make_model(vocab=50, dim=8, out_features=4, seed=1)))
    s.swap(nested, "cpu-copy")
    left = [name for name, m in nested.named_modules() if isinstance(m, SwapEmbedding) and m.impl != "cpu-copy"]
    return "" if not left else (f"in a nested model, swap() left {', '.join(left)} unchanged: "
                                "walk every module with model.modules() (it goes into "
                                "submodules), not only the top level or the first one")


def _refuses(s) -> str:
    try:
        s.swap(s.model, "gpu")
    except ValueError as e:
        missing = [i for i in IMPLS if i not in str(e)]
        return "" if not missing else \
            f'swap(model, "gpu") raised ValueError({str(e)!r}): say which values are valid, {IMPLS}'
    return f'swap(model, "gpu") should raise ValueError listing the valid impls {IMPLS}'


SWAP_RULES = [
    Rule("returns_model", "", _returns_model), Rule("sets_device", "", _impl_is("device")),
    Rule("sets_cpu_copy", "", _impl_is("cpu-copy")),
    Rule("keeps_weights", "", lambda s: "" if all(
        m.weight is w and m.weight.data_ptr() == ptr and torch.equal(m.weight, copy) for (w, ptr, copy), m in s.kept)
        else "swap() must keep the weights: change .impl only, not the table"),
    Rule("same_output", "", lambda s: "" if torch.equal(s.before, s.model(s.ids)) else
         "both implementations must give the same output for the same ids"),
    Rule("nested", "", _nested), Rule("refuses_unknown", "", _refuses)]


def check_swap(swap_fn, model: torch.nn.Module) -> None:
    """Check a learner's ``swap_fn(model, impl)`` on ``model`` and a nested model by
    :data:`SWAP_RULES` (it returns the model, sets every table's ``impl``, keeps the weights and the
    output, refuses an unknown impl by name). Leaves ``model`` on "device"."""
    ids = torch.randint(0, model.embed.weight.shape[0], (4, 32), device=model.embed.weight.device)
    tables = [m for m in model.modules() if isinstance(m, SwapEmbedding)]
    s = types.SimpleNamespace(swap=swap_fn, model=model, ids=ids,
                              kept=[((m.weight, m.weight.data_ptr(), m.weight.clone()), m) for m in tables])
    try:
        check(s, SWAP_RULES)
    finally:
        for m in model.modules():
            if isinstance(m, SwapEmbedding):
                m.impl = "device"


# --------------------------------------------------------------------------- finding host copies

_HOST_METHODS = {"cpu": "copies to the host", "item": "reads one value on the host",
                 "tolist": "copies to the host", "numpy": "copies to the host",
                 "synchronize": "waits for the GPU"}


def _is_cpu_device(node) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.split(":")[0] == "cpu"
    if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "device":
        return bool(node.args) and _is_cpu_device(node.args[0])
    return False


def find_host_copies(fn) -> list:
    """Lines of ``fn``'s own source that copy to the host or wait for the GPU (``.cpu()``,
    ``.to("cpu")``, ``.item()``, ``.tolist()``, ``.numpy()``, ``.synchronize()``): a shallow look,
    not into callees (the profiler, :func:`count_device_to_host_copies`, is the proof on a GPU)."""
    src = textwrap.dedent(inspect.getsource(fn))
    tree = ast.parse(src)
    lines = src.splitlines()
    first = fn.__code__.co_firstlineno if hasattr(fn, "__code__") else 1
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        name, why = node.func.attr, None
        if name in _HOST_METHODS:
            why = _HOST_METHODS[name]
        elif name == "to":
            targets = list(node.args[:1]) + [k.value for k in node.keywords if k.arg == "device"]
            if any(_is_cpu_device(t) for t in targets):
                why = "copies to the host"
        if why:
            found.append((node.lineno, f"line {first + node.lineno - 1}: "
                                       f"{lines[node.lineno - 1].strip()}  <- {why}"))
    return [text for _, text in sorted(found)]


def count_device_to_host_copies(fn) -> int:
    """Run ``fn()`` under ``torch.profiler`` and count device-to-host memory copies (GPU only)."""
    from course.core.capture import require_gpu
    require_gpu("profiling device-to-host copies")
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with warnings.catch_warnings():  # the profiler's notes about its own cycles are noise here
        warnings.simplefilter("ignore", UserWarning)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
    return sum(1 for e in prof.events() if "DtoH" in e.name or "Device -> Pageable" in e.name
               or "Device -> Pinned" in e.name)


# --------------------------------------------------------------------------- replay

class ReplayStandIn:
    """The simulator's graph (``course.graphs()``'s ``CUDAGraph``) for checking replay code:
    captures ``fn()`` (with ``static_out``, its result copied there), and ``replay()`` reruns the
    recorded ops on the captured tensors without ``fn``'s Python; ``output`` is the output tensor.
    """

    def __init__(self, fn, static_out: torch.Tensor | None = None, warmup: int = 3):
        from course.sim import cuda as cg

        for _ in range(warmup):  # as try_capture does on a GPU
            fn()
        self.graph = cg.CUDAGraph()
        with cg.graph(self.graph):
            out = fn()
            if static_out is not None:
                static_out.copy_(out)
        self.output = self.static_out = out if static_out is None else static_out

    def replay(self) -> None:
        """Run the recorded work: the output now holds the result for the static inputs' current
        contents."""
        self.graph.replay()


def capture_for_replay(fn):
    """Capture ``fn()`` for replay: ``(graph, static_out, how)``.

    GPU: a real ``torch.cuda.CUDAGraph`` (via :func:`course.core.capture.try_capture`; a failed
    capture raises RuntimeError with the root cause). Simulator: a :class:`ReplayStandIn`, the
    simulator's graph (a failed capture raises RuntimeError with the error a GPU gives).
    """
    if not runtime().on_gpu:
        from course.core.capture import _root_cause
        try:
            stand_in = ReplayStandIn(fn)
        except Exception as e:  # noqa: BLE001 - reported like a GPU capture failure
            cause = _root_cause(e)
            from course.sim import cuda as simcuda
            simcuda.set_stream(simcuda.default_stream())
            raise RuntimeError(f"capture failed: {type(cause).__name__}: "
                               f"{str(cause).splitlines()[0]}") from None
        return stand_in, stand_in.output, "simulator stand-in (records at capture, replays without running Python)"
    from course.core.capture import try_capture
    outcome = try_capture(fn)
    if not outcome.ok:
        raise RuntimeError(f"capture failed: {outcome.error_type}: {outcome.error}")
    return outcome.graph, outcome.output, "CUDA graph"


def replay_with(graph, static_ids: torch.Tensor, static_out: torch.Tensor, new_ids: torch.Tensor) -> torch.Tensor:
    """Write ``new_ids`` into the static input, replay, and return the static output (the reference
    answer)."""
    static_ids.copy_(new_ids)
    graph.replay()
    return static_out
