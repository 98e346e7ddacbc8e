"""Checks for any embedding function: random lookups against F.embedding, and inputs it must reject.

:func:`check_lookup` and :func:`check_rejects` drive a learner's function (or the course's) with
:func:`lookup_cases` and :func:`reject_cases`; :func:`fallback` lets a notebook go on with the
reference version when the learner's is not done yet.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from course.core.checks import close
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
        dict(desc="float16 weight, int32 ids of shape [B, T]", ids=idx(2, d(3, 77), dtype=torch.int32),
             weight=table(d(6, 96), torch.float16)),
        dict(desc="bfloat16 weight, int64 ids of shape [A, B, T]", ids=idx(2, 2, d(2, 33)),
             weight=table(d(8, 4096), torch.bfloat16)),
        dict(desc="bfloat16 weight with an odd dim (rows of 6 bytes), int32 ids",
             ids=idx(d(5, 129), dtype=torch.int32), weight=table(3, torch.bfloat16)),
        dict(desc="float32 weight, non-contiguous int64 ids (a transposed view)",
             ids=idx(d(3, 40), d(2, 17)).t(), weight=table(d(4, 100), torch.float32)),
        dict(desc="float16 weight, non-contiguous int32 ids (every other column)",
             ids=idx(2, d(6, 64), dtype=torch.int32)[:, ::2], weight=table(d(8, 64), torch.float16)),
        dict(desc="float32 weight, a single 0-d id", ids=idx(), weight=table(d(5, 33), torch.float32)),
    ]
    if padding:
        ids = idx(3, d(2, 50), dtype=torch.int32)
        ids[0, 0] = 3
        cases.append(dict(desc="float32 weight, int32 ids, padding_idx=3 (row 3 is not zero: the forward "
                               "returns it as stored)", ids=ids, weight=table(d(8, 128), torch.float32),
                          padding_idx=3))
    for c in cases:
        c.setdefault("padding_idx", None)
    return cases


def check_lookup(fn, *, padding: bool = True, seed=None) -> list:
    """Compare ``fn(ids, weight)`` with ``F.embedding`` on :func:`lookup_cases`; exact match required.

    The padding case calls ``fn(ids, weight, padding_idx=...)`` (skip it with
    ``padding=False``). Raises AssertionError naming the case that differs; returns the
    list of case descriptions that passed.
    """
    passed = []
    for c in lookup_cases(padding=padding, seed=seed):
        kw = {} if c["padding_idx"] is None else {"padding_idx": c["padding_idx"]}
        got = fn(c["ids"], c["weight"], **kw)
        assert isinstance(got, torch.Tensor), f"{c['desc']}: expected a tensor, got {type(got).__name__}"
        want = F.embedding(c["ids"], c["weight"], **kw)
        close(got, want, rtol=0, atol=0, what=f"[{c['desc']}] output")
        passed.append(c["desc"])
    return passed


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


def check_rejects(fn, *, padding: bool = True, after=None) -> list:
    """Check that ``fn`` rejects each of :func:`reject_cases` with the right exception and a message.

    ``after`` (default :func:`check_errors`) runs right after ``fn`` returns, so errors a
    kernel reports through the error flag count too. Returns "case: Error: message" lines.
    """
    after = check_errors if after is None else after
    reset_errors()
    lines = []
    for desc, args, kw, exc in reject_cases(padding=padding):
        try:
            fn(*args, **kw)
            after()
        except exc as e:
            msg = str(e)
            assert len(msg) >= 20, f"{desc}: raised {type(e).__name__} with a message too short to act on: {msg!r}"
            lines.append(f"{desc}: {type(e).__name__}: {msg}")
            continue
        except NotImplementedError:
            raise
        except Exception as e:  # noqa: BLE001 - report the wrong type
            raise AssertionError(f"{desc}: expected {exc.__name__}, got {type(e).__name__}: {e}") from None
        raise AssertionError(f"{desc}: expected {exc.__name__}, but the call returned normally")
    return lines


def fallback(fn, reference, what: str):
    """Wrap ``fn`` so that, while it still raises NotImplementedError, ``reference`` is used instead.

    Lets the cells after an unfinished exercise run: prints a note the first time.
    """
    told = []

    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except NotImplementedError:
            if not told:
                print(f"note: {what} is not done yet, so this uses the course's reference version.")
                told.append(True)
            return reference(*args, **kwargs)
    call.__name__ = getattr(fn, "__name__", "call")
    call.__doc__ = fn.__doc__
    return call
