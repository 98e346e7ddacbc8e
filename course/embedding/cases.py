"""Checks for any embedding function (named rules of the course's harness): random lookups against
F.embedding, and inputs it must reject.

:func:`check_lookup` and :func:`check_rejects` drive a learner's function (or the course's) with
:func:`lookup_cases` and :func:`reject_cases`; :func:`fallback` lets a notebook go on with the
reference version when the learner's is not done yet. When a lookup is wrong, :func:`diagnose`
reruns it on a :func:`named_table` (values that name their row and column) and says what was read
where; :func:`check_bad_ids` names the out-of-range ids that were not zeroed or not counted (the
output's memory poisoned by :func:`poisoned_empty`, so a row never written cannot pass for a zero
row). ``check_rejects(..., host=True)`` checks a host check alone: the kernel's error flag cannot
stand in.
"""
from __future__ import annotations

import contextlib
import types

import torch
import torch.nn.functional as F

from course.core.checks import close
from course.core.harness import Rule, check
from course.core.runtime import runtime
from course.embedding.lookup import check_errors, reset_errors


def lookup_cases(*, padding: bool = True, seed=None) -> list:
    """Fresh random lookups covering dtypes, id dtypes, batch shapes, padding_idx and strided ids.

    Each case is a dict with ``desc``, ``ids``, ``weight`` and ``padding_idx``. Sizes are
    tiny on the simulator and moderate on a GPU.
    """
    gen = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
    dev = torch.device(runtime().device)
    big = runtime().on_gpu
    vocab = 1000 if big else 11

    def table(dim, dtype):
        return torch.randn(vocab, dim, generator=gen).to(dtype).to(dev)

    def idx(*shape, dtype=torch.int64):
        return torch.randint(0, vocab, shape, generator=gen).to(dtype).to(dev)

    d = (lambda small, large: large if big else small)
    cases = [
        dict(desc="float32 weight, int64 ids of shape [N]", ids=idx(d(6, 500)),
             weight=table(d(8, 256), torch.float32)),
        dict(desc="float16 weight, int32 ids of shape [B, "
                  "T]", ids=idx(2, d(3, 77), dtype=torch.int32),
             weight=table(d(6, 96), torch.float16)),
        dict(desc="bfloat16 weight, int64 ids of shape [A, B, T]", ids=idx(2, 2, d(2, 33)),
             weight=table(d(8, 4096), torch.bfloat16)),
        dict(desc="bfloat16 weight with an odd dim (rows of 6 bytes), int32 ids",
             ids=idx(d(5, 129), dtype=torch.int32), weight=table(3, torch.bfloat16)),
        dict(desc="float32 weight, non-contiguous int64 ids (a transposed view)",
             ids=idx(d(3, 40), d(2, 17)).t(), weight=table(d(4, 100), torch.float32)),
        dict(desc="float16 weight, non-contiguous int32 ids (every other column)",
             ids=idx(2, d(6, 64), dtype=torch.int32)[:, ::2], weight=table(d(8, 64), torch.float16)),
        dict(desc="float32 weight, a single 0-d "
                  "id", ids=idx(), weight=table(d(5, 33), torch.float32)),
    ]
    if padding:
        ids = idx(3, d(2, 50), dtype=torch.int32)
        ids[0, 0] = 3
        cases.append(dict(desc="float32 weight, int32 ids, padding_idx=3 "
                               "(row 3 is not zero: the forward returns it "
                               "as stored)", ids=ids, weight=table(d(8, 128), torch.float32),
                          padding_idx=3))
    for c in cases:
        c.setdefault("padding_idx", None)
    return cases


def _matches(p) -> str:
    """Every case of :func:`lookup_cases` equals ``F.embedding`` exactly (what was read where, if
    not)."""
    for c in lookup_cases(padding=p.padding, seed=p.seed):
        kw = {} if c["padding_idx"] is None else {"padding_idx": c["padding_idx"]}
        got = p.fn(c["ids"], c["weight"], **kw)
        if not isinstance(got, torch.Tensor):
            return f"{c['desc']}: expected a tensor, got {type(got).__name__}"
        want = F.embedding(c["ids"], c["weight"], **kw)
        try:
            close(got, want, rtol=0, atol=0, what=f"[{c['desc']}] output")
        except AssertionError as e:
            if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
                return str(e)
            return f"[{c['desc']}] {diagnose(p.fn, c['ids'], c['weight'], **kw) or e}"
        p.passed.append(c["desc"])
    return ""


def check_lookup(fn, *, padding: bool = True, seed=None) -> list:
    """Compare ``fn(ids, weight)`` with ``F.embedding`` on :func:`lookup_cases` (the harness's rule
    "matches"); exact match required. The padding case calls ``fn(ids, weight, padding_idx=...)``
    (not with ``padding=False``). A case that differs runs again on a table whose values name their
    row and column (:func:`diagnose`): the ✗ says what was read where. Returns the case descriptions
    that passed."""
    p = types.SimpleNamespace(fn=fn, padding=padding, seed=seed, passed=[])
    check(p, [Rule("matches", "", _matches)])
    return p.passed


_EXACT = {torch.float32: 2 ** 24, torch.float16: 2 ** 11, torch.bfloat16: 2 ** 8}


def named_table(vocab: int, dim: int, dtype=torch.float32, device=None) -> torch.Tensor:
    """A table whose value at [row, col] is ``1 + row * dim + col``: every value names its row and
    column.

    Uses ``dtype`` when it holds those integers exactly, else float32. 0 never occurs (a zero says
    "written as zero", not "read from the table").
    """
    if vocab * dim + 1 > _EXACT.get(dtype, 0):
        dtype = torch.float32
    if vocab * dim + 1 > _EXACT[torch.float32]:
        raise ValueError(f"a {vocab} x {dim} table is too large to name every element exactly")
    return (torch.arange(vocab * dim, dtype=torch.float64) + 1).view(vocab, dim).to(dtype).to(device)


def _rows(values: list) -> str:
    vals = [str(v) for v in values]
    return vals[0] if len(vals) == 1 else ", ".join(vals[:-1]) + " and " + vals[-1]


def diagnose(fn, ids, weight, **kw) -> str:
    """Run ``fn`` on a :func:`named_table` like ``weight`` and say, in words, what it read and wrote
    wrong.

    Returns "" when ``fn`` is right on the named table (a dtype-specific bug, then).
    """
    vocab, dim = weight.shape
    table = named_table(vocab, dim, weight.dtype, weight.device)
    # recycled memory: not codes
    torch.full((ids.numel() * dim * 2 + 64,), float("nan"), device=weight.device)
    got = fn(ids, table, **kw).detach().cpu().double().reshape(-1, dim)
    flat = ids.detach().cpu().reshape(-1).long()
    code = got.round()
    valid = (code == got) & (code >= 1) & (code <= vocab * dim)
    g_row = torch.where(valid, (code - 1) // dim, torch.full_like(code, -1)).long()
    g_col = torch.where(valid, (code - 1) % dim, torch.full_like(code, -1)).long()
    e_row = flat.view(-1, 1).expand(-1, dim)
    e_col = torch.arange(dim).view(1, -1).expand(len(flat), -1)
    bad = ~(valid & (g_row == e_row) & (g_col == e_col))
    if not bad.any():
        return ""
    said = [f"wrong at {int(bad.sum())} of {bad.numel()} output values. Rerun on a table "
            f"whose values name their row and column (value = 1 + row * {dim} + column):"]
    cols_never = [c for c in range(dim) if bool((bad[:, c] & ~valid[:, c]).all())]
    if cols_never:
        zero = bool((got[:, cols_never] == 0).all())
        said.append(f"column{'s' if len(cols_never) > 1 else ''} {_rows(cols_never)} "
                    f"{'were' if len(cols_never) > 1 else 'was'} never written"
                    + (" (zeros)" if zero else " (values that are not from the table)") + ";")
    swaps = {}
    for n, c in bad.nonzero().tolist():
        if valid[n, c] and g_col[n, c] == c and g_row[n, c] != e_row[n, c]:
            swaps.setdefault((int(g_row[n, c]), int(e_row[n, c])), n)
    for (gr, er), n in list(swaps.items())[:3]:
        said.append(f"row {gr} was read where row {er} was expected (output row {n}, id {er});")
    if len(swaps) > 3:
        said.append(f"... and {len(swaps) - 3} more wrong rows;")
    shown = 0
    for n, c in bad.nonzero().tolist():
        if shown == 3:
            break
        if valid[n, c] and g_col[n, c] != c:
            said.append(f"out[{n}, {c}] holds row {int(g_row[n, c])} column {int(g_col[n, c])}, "
                        f"expected row {int(e_row[n, c])} column {c};")
            shown += 1
        elif not valid[n, c] and c not in cols_never:
            said.append(f"out[{n}, {c}] holds {got[n, c].item():g}, not a value from the table "
                        f"(expected row {int(e_row[n, c])} column {c}: never written?);")
            shown += 1
    return " ".join(said).rstrip(";") + "."


@contextlib.contextmanager
def poisoned_empty():
    """While active, ``torch.empty`` returns floating tensors filled with NaN instead of leftover
    memory.

    Fresh memory is often zeros (always on a CPU), so an output row a kernel never wrote could
    pass for a zeroed one; poisoned, it holds NaN and the check sees it.
    """
    real = torch.empty

    def empty(*args, **kwargs):
        t = real(*args, **kwargs)
        if t.dtype.is_floating_point:
            with torch.no_grad():
                t.fill_(float("nan"))
        return t
    torch.empty = empty
    try:
        yield
    finally:
        torch.empty = real


_BAD = (5, 9, -1)  # on a 5-row table: the first id past the end, one far past it, a negative one


def _bad_rows(p) -> str:
    for n, bad_id in enumerate(_BAD, 1):
        if bool(torch.isnan(p.out[n]).all()):
            return (f"id {bad_id} is outside the 5-row table: its output row {n} "
                    "must be zeros, but it was never written (it still holds the "
                    "NaN the check filled it with): write a zero for a bad id")
        held = p.out[n].tolist()
        if p.out[n].abs().sum() != 0:
            return (f"id {bad_id} is outside the 5-row table: its output row {n} must be zeros, it "
                    f"holds {held[:8]}{' ...' if len(held) > 8 else ''} (never read the table with "
                    "a bad id: only ids with idx >= 0 and idx < weight.shape[0] may read it)")
    return ""


def _counted(p) -> str:
    want, count = len(_BAD), p.count
    if count == 0:
        return f"ids 5, 9 and -1 were not counted (err[0] is 0, expected {want}): cuda.atomic.add(err, 0, 1) once " \
               "per bad id"
    if count < want:
        return (f"err[0] is {count}, expected {want}: {want - count} of the bad ids 5, 9 and -1 "
                f"{'was' if want - count == 1 else 'were'} not counted. Every id outside idx >= 0 "
                "and idx < weight.shape[0] is bad (5 too: valid ids are 0..4), counted once")
    if count == want:
        return ""
    return f"err[0] is {count}, expected {want} (ids 5, 9 and -1): " + (
        f"each bad id was counted {count // want} times; count it once, by "
        "one thread of its row (the thread of column 0: d == 0, or tx == "
        "0 in a row of threads)" if count % want == 0 else "count each bad id exactly once")


BAD_ID_RULES = [
    Rule("index_error", "", lambda p: "" if not p.index_error else (
        f"with ids {p.ids} on a 5-row table the kernel went outside an array "
        f"({p.index_error}): a bad id must never index the table. Valid ids are 0..4, "
        "so 5 is already outside: guard with idx >= 0 and idx < weight.shape[0]")),
    Rule("good_row", "", lambda p: "" if torch.equal(p.out[0], p.table[0].cpu()) else (
        f"id 0 must give row 0 {p.table[0].tolist()}, got {p.out[0].tolist()}")),
    Rule("bad_rows_zero", "", _bad_rows), Rule("counted_once", "", _counted)]


def check_bad_ids(launch, *, dim: int = 4, device=None) -> None:
    """Judge ``launch(ids, weight)`` by :data:`BAD_ID_RULES`: zero rows for out-of-range ids, each
    counted once in err[0], a bad id never indexing the table. Ids [0, 5, 9, -1] on a 5-row table,
    the output's memory poisoned (:func:`poisoned_empty`)."""
    from course.embedding.kernels import EmbeddingIndexError
    from course.embedding.lookup import error_flag

    device = device if device is not None else torch.device(runtime().device)
    reset_errors()
    table = named_table(5, dim, device=device)
    ids = torch.tensor([0, *_BAD], device=device)
    p = types.SimpleNamespace(table=table, ids=ids.tolist(), index_error="", out=None, count=0)
    try:
        with poisoned_empty():
            p.out = launch(ids, table).reshape(len(ids), dim).cpu()
    except EmbeddingIndexError:
        raise
    except IndexError as e:
        p.index_error = (str(e).strip().splitlines() or [""])[0][:160]
    p.count = int(error_flag()[0].item())
    reset_errors()
    check(p, BAD_ID_RULES)


def reject_cases(*, padding: bool = True) -> list:
    """Bad inputs and the exception each must raise: (desc, args, kwargs, exception type)."""
    dev = torch.device(runtime().device)
    w = torch.randn(7, 4, device=dev)
    ids = torch.tensor([1, 2, 3], device=dev)
    cases = [
        ("float ids", (ids.float(), w), {}, TypeError),
        ("1-D weight", (ids, w[0]), {}, ValueError),
        ("3-D weight", (ids, w.view(7, 2, 2)), {}, ValueError),
        ("integer weight", (ids, w.long()), {}, TypeError),
        ("an id equal to num_embeddings", (torch.tensor([0, 7, 1], device=dev), w), {}, IndexError),
        ("a negative id", (torch.tensor([[0, 1], [-1, 2]], device=dev), w), {}, IndexError),
    ]
    if runtime().on_gpu:
        cases.append(("ids on the CPU, weight on the GPU", (ids.cpu(), w), {}, ValueError))
    if padding:
        cases.append(("padding_idx outside the table", (ids, w), {"padding_idx": 7}, ValueError))
    return cases


_HOST_MISSED = {  # what a host check that let this case through is missing
    "an id equal to num_embeddings": ("an id >= num_embeddings", "raise IndexError when ids.max() >= weight.shape[0]"),
    "a negative id": ("an id < 0", "raise IndexError when ids.min() < 0"),
}


def _rejects(p) -> str:
    """Each of :func:`reject_cases` raises its exception with a message (the flag cleared after
    each)."""
    for desc, args, kw, exc in reject_cases(padding=p.padding):
        try:
            p.fn(*args, **kw)
            p.after()
        except exc as e:
            if len(str(e)) < 20:
                return f"{desc}: raised {type(e).__name__} with a message too short to act on: {str(e)!r}"
            p.lines.append(f"{desc}: {type(e).__name__}: {e}")
            continue
        except NotImplementedError:
            raise
        except Exception as e:  # noqa: BLE001 - report the wrong type
            return f"{desc}: expected {exc.__name__}, got {type(e).__name__}: {e}"
        finally:
            reset_errors()
        if p.host and desc in _HOST_MISSED:
            what, fix = _HOST_MISSED[desc]
            return (f"{what} was not rejected by your host check (ids {args[0].tolist()} for a "
                    f"table of {args[1].shape[0]} rows, and the call returned normally): {fix}")
        return f"{desc}: expected {exc.__name__}, but the call returned normally"
    return ""


def check_rejects(fn, *, padding: bool = True, after=None, host: bool = False) -> list:
    """Check that ``fn`` rejects each of :func:`reject_cases` with the right exception and a message
    (the harness's rule "rejects"); "case: Error: message" lines.

    ``after`` (default :func:`check_errors`) runs right after ``fn`` returns, so errors a kernel
    reports through the error flag count too. ``host=True`` checks a host check alone: every error
    must be raised by ``fn`` itself, and a missed id range is named ("an id < 0 was not rejected by
    your host check")."""
    after = (lambda: None) if host else (check_errors if after is None else after)
    reset_errors()
    p = types.SimpleNamespace(fn=fn, padding=padding, after=after, host=host, lines=[])
    check(p, [Rule("rejects", "", _rejects)])
    return p.lines


def fallback(fn, reference, what: str, exercise: str | None = None):
    """``fn``, or ``reference`` while the learner's version is not ready (with ``exercise``: until
    its check passed in this session; else while ``fn`` raises NotImplementedError), saying so once.
    The wrapper keeps ``fn`` as ``__course_learner__`` for the checks
    (:func:`course.core.checks.own`)."""
    from course.core.checks import describe, passed

    told = []

    def tell(why):
        if not told:
            print(f"note: {what} {why}, so this uses the course's reference version.")
            told.append(True)

    def call(*args, **kwargs):
        if exercise is not None and not passed(exercise):
            tell(f"has not passed exercise {exercise!r} ({describe(exercise)})")
            return reference(*args, **kwargs)
        try:
            return fn(*args, **kwargs)
        except NotImplementedError:
            tell("is not done yet")
            return reference(*args, **kwargs)
    call.__name__ = getattr(fn, "__name__", "call")
    call.__doc__ = fn.__doc__
    call.__course_learner__ = fn
    return call
