"""A zoo of capture hazards, each with its fix: shared by notebook 03, the finder and the tests.

Every entry pairs a *hazard* (it syncs with the host, copies between host and device or reads GPU
values on the host) with a *fix* that computes the same and captures cleanly. They are plain
functions, so the static finder (:func:`.static.find_static`) reads their source and points at
exact lines; each hazard line carries a ``# hazard`` comment: the line the finder must report
(the recorded ``hazards_finder`` holds these line numbers: keep them where they are).

Inputs are small and built by each entry (:meth:`Entry.hazard_args`, :meth:`Entry.fixed_args`) on
``course.device()``; on the simulator path they live on the CPU, where the fixes (and most hazards)
still run eagerly. The Numba hazards are in :mod:`.numba_zoo`.
"""
from __future__ import annotations

import dataclasses
import inspect
import io

import torch

from course.core.runtime import runtime, torch_device
from course.lessons.what_breaks.static import RULES, find_static

LOG = io.StringIO()  # where print_hazard prints (keeps notebook output readable)


# --- 1. .item() ---------------------------------------------------------------
def item_hazard(x):
    """Scale x by its largest magnitude, read on the host with .item()."""
    scale = x.abs().max().item()  # hazard: copies one value to the host and waits
    return x / scale


def item_fixed(x):
    """Scale x by its largest magnitude, kept on the device."""
    return x / x.abs().max()  # the max stays on the GPU as a 0-dim tensor


# --- 2. .cpu() ----------------------------------------------------------------
def cpu_hazard(x, w):
    """A ReLU layer that also returns its column means, copied to the host."""
    y = torch.relu(x @ w)
    stats = y.mean(dim=0).cpu()  # hazard: device-to-host copy for logging
    return y, stats


def cpu_fixed(x, w):
    """A ReLU layer that also returns its column means, left on the device."""
    y = torch.relu(x @ w)
    return y, y.mean(dim=0)  # stays on the device; copy it to the host after replay


# --- 3. .to("cpu"): InfiniCore's old embedding ---------------------------------
def to_cpu_hazard(ids, weight):
    """Rows of weight, the indices routed through the host (InfiniCore's old Embedding::forward)."""
    ids_host = ids.to("cpu")  # hazard: InfiniCore's old indices->to(cpu_device)
    return weight.index_select(0, ids_host.to(weight.device))  # hazard: and back again


def to_cpu_fixed(ids, weight):
    """Look up rows of weight on the device."""
    return torch.nn.functional.embedding(ids, weight)  # a device-side gather, no copies


# --- 4. .tolist() -------------------------------------------------------------
def tolist_hazard(x, ids):
    """Gather rows of x through a Python list of indices."""
    rows = ids.tolist()  # hazard: the indices become a Python list on the host
    return x[rows]


def tolist_fixed(x, ids):
    """Gather rows of x with the index tensor."""
    return x[ids]  # index with the device tensor itself


# --- 5. printing a tensor -----------------------------------------------------
def print_hazard(x, w):
    """A matmul that prints its result."""
    y = x @ w
    print("activations:", y, file=LOG)  # hazard: formatting reads the values on the host
    return y


def print_fixed(x, w):
    """The same matmul, without printing."""
    return x @ w  # print the graph's static output after replay instead


# --- 6. if tensor: --------------------------------------------------------------
def if_tensor_hazard(x):
    """Clamp negatives only if there are any (a Python branch on a GPU value), then double."""
    if (x < 0).any():  # hazard: Python needs a host bool
        x = x.clamp(min=0)
    return x * 2


def if_tensor_fixed(x):
    """Clamp negatives and double, without a branch."""
    return x.clamp(min=0) * 2  # no branch: clamp leaves x >= 0 unchanged


# --- 7. nonzero: a data-dependent shape ------------------------------------------
def nonzero_hazard(x):
    """Keep the positive entries of x via nonzero indices."""
    idx = (x > 0).nonzero(as_tuple=True)  # hazard: how many? only the GPU knows
    out = torch.zeros_like(x)
    out[idx] = x[idx]
    return out


def nonzero_fixed(x):
    """Keep the positive entries of x with torch.where."""
    return torch.where(x > 0, x, torch.zeros_like(x))  # same shape whatever the data


# --- 8. masked_select: a data-dependent shape -------------------------------------
def masked_select_hazard(x):
    """Sum of the positive entries, via masked_select."""
    pos = x.masked_select(x > 0)  # hazard: the result's length depends on the values
    return pos.sum()


def masked_select_fixed(x):
    """Sum of the positive entries, via a mask multiply."""
    return (x * (x > 0)).sum()  # multiply by the mask: fixed shape


# --- 9. unique: a data-dependent shape --------------------------------------------
def unique_hazard(ids, weight):
    """Sum of the rows of weight named by ids, each counted once, via unique."""
    vocab = torch.unique(ids)  # hazard: the number of distinct ids is read on the host
    return weight[vocab].sum(0)


def unique_fixed(ids, weight):
    """Sum of the rows of weight named by ids, each counted once, via index_fill_."""
    present = torch.zeros(weight.shape[0], 1, device=weight.device, dtype=weight.dtype)
    present.index_fill_(0, ids, 1.0)  # mark each id once: fixed shape
    return (weight * present).sum(0)


# --- 10. torch.cuda.synchronize() ---------------------------------------------------
def synchronize_hazard(x, w):
    """A matmul and a ReLU with a device-wide synchronize between them."""
    y = x @ w
    torch.cuda.synchronize()  # hazard: waits for the whole GPU
    return torch.relu(y)


def synchronize_fixed(x, w):
    """A matmul and a ReLU."""
    y = x @ w  # work on one stream runs in order: nothing to wait for
    return torch.relu(y)


# --- 11. a pageable host-to-device copy --------------------------------------------
def h2d_pageable_hazard(x, host_scale):
    """Scale x by a host tensor copied to the GPU on every call."""
    scale = host_scale.to(x.device)  # hazard: copy from pageable host memory
    return x * scale


def h2d_pageable_fixed(x, dev_scale):
    """Scale x by a tensor already on the GPU."""
    return x * dev_scale  # copied to the GPU once, before capture (a static input)


# --- 12. torch.tensor(..., device=cuda) from host data -----------------------------
def tensor_ctor_hazard(x):
    """Add constant offsets built from a Python list on every call."""
    offsets = torch.tensor([0.0, 1.0, 2.0, 3.0], device=x.device)  # hazard: built on the host
    return x[:, :4] + offsets


def tensor_ctor_fixed(x):
    """Add constant offsets made on the GPU."""
    offsets = torch.arange(4, device=x.device, dtype=x.dtype)  # made by a kernel on the GPU
    return x[:, :4] + offsets


# --- 13. a pinned device-to-host copy: captures, replays, and is wrong -------------
def pinned_frozen_hazard(ids, weight, host_ids):
    """Look up rows of weight, picked on the host from a pinned copy of ids."""
    host_ids.copy_(ids, non_blocking=True)  # into pinned memory: this copy IS captured
    if not torch.cuda.is_current_stream_capturing():  # hazard: eager and captured code differ
        torch.cuda.current_stream().synchronize()  # hazard: eager waits for the copy
    rows = [weight[i] for i in host_ids.tolist()]  # hazard: the host picks rows: frozen at capture
    return torch.stack(rows)


def pinned_frozen_fixed(ids, weight, host_ids):
    """Look up rows of weight on the device."""
    return weight[ids]  # the GPU picks the rows from the current ids on every replay


# --- safe functions: the finder must report nothing on these -------------------------
def safe_mlp(x, w):
    """A two-matmul MLP: safe to capture."""
    return torch.relu(x @ w) @ w.t()


def safe_shape_logic(x):
    """Branching on a shape (host metadata): safe to capture."""
    if x.shape[0] > 16:  # a shape is host metadata: branching on it is fine (and fixed per graph)
        x = x[:16]
    return torch.softmax(x, dim=-1)


def safe_embedding_bag(ids, weight):
    """Mean of looked-up rows, broadcast to 4 rows: safe to capture."""
    rows = torch.nn.functional.embedding(ids, weight)
    return rows.mean(dim=0, keepdim=True).expand(4, -1).contiguous()


# --- the registry ----------------------------------------------------------------
def _x(g, device):
    return torch.randn(64, 32, generator=g).to(device)


def _w(g, device):
    return torch.randn(32, 16, generator=g).to(device)


def _ids(g, device, n=8, vocab=100):
    return torch.randint(0, vocab, (n,), generator=g).to(device)


def _weight(g, device, vocab=100):
    return torch.randn(vocab, 16, generator=g).to(device)


def _pinned_ids(n=8):
    return torch.zeros(n, dtype=torch.int64, pin_memory=runtime().on_gpu)


@dataclasses.dataclass(frozen=True)
class Entry:
    """One hazard and its fix."""

    name: str
    title: str
    hazard: object
    fixed: object
    make: object  # make(generator, device, fixed: bool) -> tuple of args
    outcome: str  # what capture does: "error" (capture fails) or "wrong" (replays, wrong result)
    rules: tuple  # the static finder's rule ids expected on the hazard
    cpu_eager: bool = True  # can the hazard run eagerly on the CPU path?

    def args(self, fixed: bool = False, seed: int = 0, device=None) -> tuple:
        """Fresh inputs for the hazard (or the fix) from ``seed``, on ``device`` (the course's)."""
        g = torch.Generator().manual_seed(seed)
        return self.make(g, torch.device(device) if device is not None else torch_device(), fixed)

    def hazard_args(self, seed: int = 0, device=None) -> tuple:
        """Inputs for :attr:`hazard`."""
        return self.args(False, seed, device)

    def fixed_args(self, seed: int = 0, device=None) -> tuple:
        """Inputs for :attr:`fixed` (the same data; a device buffer where the hazard used host
        memory)."""
        return self.args(True, seed, device)

    def hazard_lines(self) -> list:
        """Absolute line numbers in this file of the lines marked ``# hazard`` in :attr:`hazard`."""
        src, start = inspect.getsourcelines(self.hazard)
        return [start + i for i, line in enumerate(src) if "# hazard" in line]


def _mk_x(g, d, fixed):
    return (_x(g, d),)


def _mk_xw(g, d, fixed):
    return (_x(g, d), _w(g, d))


def _mk_ids_weight(g, d, fixed):
    return (_ids(g, d), _weight(g, d))


def _mk_x_ids(g, d, fixed):
    return (_x(g, d), _ids(g, d, vocab=64))


def _mk_h2d(g, d, fixed):
    x, scale = _x(g, d), torch.rand(32, generator=g)  # scale: ordinary (pageable) host memory
    return (x, scale.to(d)) if fixed else (x, scale)


def _mk_pinned(g, d, fixed):
    return (_ids(g, d), _weight(g, d), _pinned_ids())


ENTRIES = (
    Entry("item", ".item()", item_hazard, item_fixed, _mk_x, "error", ("item",)),
    Entry("cpu", ".cpu()", cpu_hazard, cpu_fixed, _mk_xw, "error", ("cpu",)),
    Entry("to_cpu", '.to("cpu") (InfiniCore\'s old embedding)', to_cpu_hazard, to_cpu_fixed,
          _mk_ids_weight, "error", ("to_cpu", "h2d")),
    Entry("tolist", ".tolist()", tolist_hazard, tolist_fixed, _mk_x_ids, "error", ("tolist",)),
    Entry("print", "print(tensor)", print_hazard, print_fixed, _mk_xw, "error", ("print",)),
    Entry("if_tensor", "if tensor:", if_tensor_hazard, if_tensor_fixed, _mk_x, "error",
          ("host_bool",)),
    Entry("nonzero", "nonzero (data-dependent shape)", nonzero_hazard, nonzero_fixed, _mk_x,
          "error", ("data_dependent",)),
    Entry("masked_select", "masked_select (data-dependent shape)", masked_select_hazard,
          masked_select_fixed, _mk_x, "error", ("data_dependent",)),
    Entry("unique", "unique (data-dependent shape)", unique_hazard, unique_fixed, _mk_ids_weight,
          "error", ("data_dependent",)),
    Entry("synchronize", "torch.cuda.synchronize()", synchronize_hazard, synchronize_fixed, _mk_xw,
          "error", ("cuda_synchronize",), cpu_eager=False),
    Entry("h2d_pageable", "pageable host-to-device copy", h2d_pageable_hazard, h2d_pageable_fixed,
          _mk_h2d, "error", ("h2d",)),
    Entry("tensor_ctor", "torch.tensor(..., device=cuda)", tensor_ctor_hazard, tensor_ctor_fixed,
          _mk_x, "error", ("tensor_ctor",)),
    Entry("pinned_frozen", "pinned device-to-host copy (frozen values)", pinned_frozen_hazard,
          pinned_frozen_fixed, _mk_pinned, "wrong", ("capture_branch", "synchronize", "tolist"),
          cpu_eager=False),
)

SAFE = (
    ("safe_mlp", safe_mlp, _mk_xw),
    ("safe_shape_logic", safe_shape_logic, _mk_x),
    ("safe_embedding_bag", safe_embedding_bag, _mk_ids_weight),
)


def names() -> list:
    """The zoo's entry names, in teaching order."""
    return [e.name for e in ENTRIES]


def get(name: str) -> Entry:
    """The zoo entry called ``name``."""
    for e in ENTRIES:
        if e.name == name:
            return e
    raise KeyError(f"no zoo entry {name!r}; known: {names()}")


def safe_functions(seed: int = 0, device=None) -> list:
    """(name, fn, args) of every function that must capture cleanly: the safe ones, every fix."""
    dev = torch.device(device) if device is not None else torch_device()
    out = []
    for name, fn, make in SAFE:
        out.append((name, fn, make(torch.Generator().manual_seed(seed), dev, False)))
    for e in ENTRIES:
        out.append((f"{e.name}_fixed", e.fixed, e.fixed_args(seed, dev)))
    return out


def source(fn, mark: dict | None = None) -> str:
    """``fn``'s source with absolute line numbers; ``mark`` maps line -> note printed beside it."""
    lines, start = inspect.getsourcelines(fn)
    mark = mark or {}
    out = []
    for i, line in enumerate(lines):
        n = start + i
        note = f"   <-- {mark[n]}" if n in mark else ""
        out.append(f"{n:4d} | {line.rstrip()}{note}")
    return "\n".join(out)


def describe(name: str, row: dict | None = None, fixed_row: dict | None = None,
             sources: bool = True) -> str:
    """One zoo entry as text: the hazard (its source marked by the static finder, or with
    ``sources=False`` the finder's lines alone), what capture did (``row``, ``fixed_row``: rows of
    ``hazards_finder``), then the fix."""
    e = get(name)

    def outcome(r):
        if r is None:
            return ""
        where = f" (at {r['capture_where']})" if r.get("capture_where") else ""
        out = f"  under capture: {r['capture']}{where}"
        if r.get("replay") not in (None, "", "-"):
            out += f"\n  replay with new inputs: {r['replay']}"
        if r.get("blocked") is not None:
            waits = "yes" if r["blocked"] else "no"
            out += f"\n  host waits for the GPU when called eagerly: {waits}"
        return out

    marks = {f.line: RULES[f.rule].what for f in find_static(e.hazard)}
    found = "\n".join(f"  the finder: line {n}: {what}" for n, what in sorted(marks.items()))
    parts = [f"== {e.title} ==", f"hazard: {e.hazard.__name__}",
             source(e.hazard, marks) if sources else found, outcome(row),
             f"fix: {e.fixed.__name__}", source(e.fixed) if sources else "", outcome(fixed_row)]
    return "\n".join(p for p in parts if p)
