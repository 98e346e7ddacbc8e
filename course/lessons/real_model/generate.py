"""Greedy decoding with any decode step, and the check that a fast variant decodes what eager does.

A step is ``step(ids [B, 1], position [1]) -> logits``; :func:`check_variants` compares every
variant's tokens (exactly, in float32) and its logits on eager's tokens (within :func:`tolerance`)
with eager's.
"""
from __future__ import annotations

import torch

from course.core.results import Result
from course.core.text import condense

# Largest |logit difference| allowed, as a fraction of the largest |logit| of the eager reference.
TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2, "float16": 1e-2}


def tolerance(dtype) -> float:
    """Allowed max |logit difference| / max |eager logit| for a model kept in ``dtype``."""
    name = str(dtype).replace("torch.", "")
    if name not in TOLERANCE:
        raise KeyError(f"no logit tolerance for dtype {name!r}; known: {sorted(TOLERANCE)}")
    return TOLERANCE[name]


def _first(first_ids):
    ids = first_ids if first_ids.dim() == 2 else first_ids.view(-1, 1)
    if ids.shape[1] != 1:
        raise ValueError("first_ids must be [B] or [B, 1] (one token per sequence), got "
                         f"{tuple(first_ids.shape)}")
    return ids.long()


def greedy(step, first_ids, n_tokens: int, start: int = 0):
    """``n_tokens`` greedy tokens per sequence after ``first_ids`` (``[B]``, at position ``start``):
    ``[B, n]``."""
    if n_tokens < 1:
        raise ValueError(f"n_tokens must be >= 1, got {n_tokens}")
    ids = _first(first_ids)
    pos = torch.full((1,), start, dtype=torch.long, device=ids.device)
    out = []
    with torch.no_grad():
        for _ in range(n_tokens):
            ids = step(ids, pos).argmax(-1, keepdim=True)
            out.append(ids)
            pos = pos + 1  # a new device tensor, made on the device: no host-to-device copy
    return torch.cat(out, dim=1)


def forced_logits(step, tokens, start: int = 0):
    """Logits ``[B, T, vocab]`` of the step fed ``tokens[:, t]`` at position ``start + t`` (teacher
    forcing)."""
    if tokens.dim() != 2 or tokens.shape[1] < 1:
        raise ValueError(f"tokens must be [B, T] with T >= 1, got {tuple(tokens.shape)}")
    pos = torch.full((1,), start, dtype=torch.long, device=tokens.device)
    out = []
    with torch.no_grad():
        for t in range(tokens.shape[1]):
            out.append(step(tokens[:, t:t + 1].long(), pos).float().clone())
            pos = pos + 1
    return torch.stack(out, dim=1)


def compare(tokens, want_tokens, logits, want_logits, tol: float,
            exact_tokens: bool = True) -> dict:
    """One variant against the reference: tokens equal, first divergent step, relative logit
    difference, ``ok`` (logits within ``tol`` and, with ``exact_tokens``, the same tokens)."""
    same = tokens.shape == want_tokens.shape and bool(torch.equal(tokens, want_tokens))
    diverge = -1
    if not same and tokens.shape == want_tokens.shape:
        diverge = int((tokens != want_tokens).any(0).nonzero()[0])
    scale = float(want_logits.abs().max()) or 1.0
    rel = float((logits.float() - want_logits.float()).abs().max()) / scale
    return {"tokens_equal": same, "first_divergence": diverge, "max_logit_diff": rel,
            "tolerance": tol,
            "ok": rel <= tol and (same or not exact_tokens)}


def check_variants(variants: dict, eager, first_ids, n_tokens: int = 64, dtype=torch.float32,
                   start: int = 0) -> Result:
    """Every step of ``variants`` against the ``eager`` step, live: ``n_tokens`` greedy tokens
    each, and the logits on eager's tokens (teacher forcing), as a Result."""
    if not variants:
        raise ValueError("check_variants needs at least one variant to compare with eager")
    tol = tolerance(dtype)
    want = greedy(eager, first_ids, n_tokens, start)
    fed = torch.cat([_first(first_ids), want[:, :-1]], dim=1)
    want_logits = forced_logits(eager, fed, start)
    rows = []
    for name, step in variants.items():
        try:
            got = greedy(step, first_ids, n_tokens, start)
            row = compare(got, want, forced_logits(step, fed, start), want_logits, tol,
                          exact_tokens=dtype == torch.float32)
            row["error"] = ""
        # noqa: BLE001 - a variant that crashes is a failed row, not a lost check
        except Exception as e:
            row = {"tokens_equal": False, "first_divergence": 0, "max_logit_diff": float("nan"),
                   "tolerance": tol,
                   "ok": False, "error": f"{type(e).__name__}: {condense(str(e), 1, 200)}"}
        rows.append({"variant": name, **row})
    dt = str(dtype).replace("torch.", "")
    return Result("real_model_correctness",
                  f"{len(first_ids)} sequence(s) x {n_tokens} greedy tokens, every variant against "
                  f"eager ({dt}); logit difference relative to the largest eager logit, on eager's "
                  "tokens",
                  {"variant": "", "tokens_equal": "", "first_divergence": "step",
                   "max_logit_diff": "fraction",
                   "tolerance": "fraction", "ok": "", "error": ""}, rows,
                  params={"n_tokens": n_tokens, "dtype": dt, "batch": len(first_ids),
                          "start": start})


def _why_not_ok(row) -> str:
    tokens = "" if row["tokens_equal"] else f"tokens differ from step {row['first_divergence']}"
    if row["max_logit_diff"] <= row["tolerance"]:
        return tokens
    return tokens + (f", logits off by {row['max_logit_diff']:.2e} of the largest (tolerance "
                     f"{row['tolerance']:.0e})")


def assert_correct(result: Result) -> None:
    """Raise AssertionError naming every variant of a :func:`check_variants` result that is not ok,
    and why."""
    bad = [r for r in result.rows if not r["ok"]]
    if bad:
        why = "; ".join(f"{r['variant']}: " + (r["error"] or _why_not_ok(r)) for r in bad)
        raise AssertionError(f"{len(bad)} of {len(result.rows)} variant(s) decode differently from "
                             f"eager: {why}")
