"""Lesson 06's checks 06.1 to 06.3 on the course's one harness (:mod:`course.core.harness`), and
the helpers every real-model check shares (06.4: :mod:`.reduce_check`; lab 4: :mod:`.lab_checks`).

Each check runs the learner's code on the tiny Llama (live on any machine), gathers what it did (a
trace of the model's forwards, the KV-cache positions each ``generate`` wrote, what it returned) and
judges that by named rules: the first broken rule is the ✗, with the same words on the laptop and on
a GPU. Hints are staged (the rule, where, a smaller example); the answer comes only on request.
"""
from __future__ import annotations

import functools

import torch

import course
from course.core.checks import exercise
from course.core.harness import Rule, check
from course.lessons.real_model.decode import StaticDecoder, graph_cached
from course.lessons.real_model.generate import greedy
from course.lessons.real_model.model import build_model, bytes_per_token
from course.lessons.real_model.roofline import floor_us

_MODEL: dict = {}


def lab_model():
    """The tiny Llama every check uses (built once per session, seed 0), token 0's embedding not
    zero: the pad row's zeros give zero keys and values, which no check tells from no write."""
    if "m" not in _MODEL:
        m = build_model("tiny")
        emb = m.model.embed_tokens.weight
        with torch.no_grad():
            row = torch.randn(emb.shape[1], generator=torch.Generator().manual_seed(0))
            emb[0].copy_(row.to(emb.device, emb.dtype) * emb[1:].std())
        _MODEL["m"] = m
    return _MODEL["m"]


def _first_diff(got, want) -> int:
    return int((got != want).any(0).nonzero()[0])


def _close(got, want) -> bool:
    return got is not None and abs(got - want) <= 1e-6 * abs(want)


def _slip(got, want, known: dict) -> str:
    """': <why>' when ``got`` (not ``want``) matches one of the ``known`` wrong values, else ''."""
    try:
        got = float(got)
    except (TypeError, ValueError):
        return f": a number was expected, got {type(got).__name__}"
    for value, why in known.items():
        if abs(value - want) > 1e-9 * abs(want) and abs(got - value) <= 1e-6 * abs(value) + 1e-12:
            return f": {why}"
    return ""



def _storage(t) -> int:
    return t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) else -1



# ======================== lesson 06: 06.1 to 06.3
STATS = "06.1 predict the statistics"
STATS_HINT = ["a bucket's first step records its graph (a miss); every later step of that bucket "
              "replays it (a hit); each step pads the batch up to its bucket",
              "in my_prediction: 3 sequences run in bucket 4 for 5 steps, then 1 sequence in "
              "bucket 1 for 5 steps: count the first steps, the other steps, and the padded rows "
              "of every step",
              "a smaller example: buckets [2, 4], 3 sequences for 2 tokens: one miss, one hit, and "
              "1 padded row per step: 2 padded rows"]
STATS_ANSWER = 'return {"cache_misses": 2, "cache_hits": 8, "padded_rows": 5}'
STAT_KEYS = ("cache_misses", "cache_hits", "padded_rows")
FLOOR = "06.2 the floor"
FLOOR_HINT = ["a decode step cannot be faster than reading its bytes once at full bandwidth: time "
              "= bytes / (bytes per second)",
              "in my_floor_us: the bytes are bytes_per_token(model, batch); the bandwidth comes in "
              "GB/s (1e9 bytes per second); the result goes out in microseconds (1e6 per second)",
              "a smaller example: 3 GB at 1000 GB/s take 3e9 / 1e12 = 0.003 s = 3000 us"]
FLOOR_ANSWER = "return bytes_per_token(model, batch) / (bandwidth_GBps * 1e9) * 1e6"
SAVING = "06.3 what stacking saves"
SAVING_HINT = ["stacking turns five products into two: a layer saves the time of the five separate "
               "ones minus the time of the two stacked ones",
               "in my_saving: read each row's 'Numba GEMV us' by its 'what'. Separate: q (one "
               "'q_proj, o_proj'), k and v (two 'k_proj, v_proj'), gate and up (two 'gate_proj, "
               "up_proj'); stacked: the two 'stacked' rows",
               "a smaller example: products of 3, 1 and 1 us stacked into one of 4 us save 3 + 1 + "
               "1 - 4 = 1 us"]
SAVING_ANSWER = ('us = {r["what"]: r["Numba GEMV us"] for r in gemv_result.rows}; return '
                 'us["q_proj, o_proj"] + 2 * us["k_proj, v_proj"] + 2 * us["gate_proj, up_proj"] - '
                 'us["stacked q/k/v"] - us["stacked gate/up"]')
STATS_RULES = [Rule("returned", "", lambda t: "" if isinstance(t[0], dict) else (
    f"my_prediction() should return a dict of {', '.join(STAT_KEYS)}, got "
    f"{type(t[0]).__name__}"))] + [
    Rule(k, "",
         lambda t, k=k: "" if t[0].get(k) == t[1][k]
         else f"{k}: you said {t[0].get(k)}, the cache counted "
         f"{t[1][k]}") for k in STAT_KEYS]


def check_statistics(predict) -> None:
    """06.1: ``predict()`` gives a graph cache's misses, hits and padded rows for 3 then 1 sequences
    (run live)."""
    with exercise(STATS, hint=STATS_HINT, answer=STATS_ANSWER):
        guess = predict()
        c = graph_cached(StaticDecoder(lab_model(), 32), buckets=[1, 2, 4])
        dev = course.device()
        greedy(c, torch.tensor([5, 6, 7], device=dev), 5)
        greedy(c, torch.tensor([5], device=dev), 5)
        check((guess, c.get_stats()), STATS_RULES)


def _floor_problem(fn, model) -> str:
    for bw, batch in ((3000.0, 1), (3000.0, 16), (100.0, 2)):
        want, got = floor_us(bytes_per_token(model, batch), bw), fn(model, bw, batch)
        if not _close(got, want):
            return f"{bw} GB/s, batch {batch}: you said {got}, the floor is {want:.4g} us"
    return ""


def check_floor(fn, model) -> None:
    """06.2: ``fn(model, bandwidth_GBps, batch)`` is the weight-read floor in microseconds, for
    ``model``."""
    with exercise(FLOOR, hint=FLOOR_HINT, answer=FLOOR_ANSWER):
        check(model, [Rule("floor", "", functools.partial(_floor_problem, fn))])


def check_saving(fn, gemv_result) -> None:
    """06.3: ``fn(gemv_result)`` is what stacking q/k/v and gate/up saves per layer, from the GEMV
    table."""
    with exercise(SAVING, hint=SAVING_HINT, answer=SAVING_ANSWER):
        us = {r["what"]: r["Numba GEMV us"] for r in gemv_result.rows}
        want = (us["q_proj, o_proj"] + 2 * us["k_proj, v_proj"] + 2 * us["gate_proj, up_proj"]
                - us["stacked q/k/v"] - us["stacked gate/up"])
        got = fn(gemv_result)
        check(got, [Rule("saving", "", lambda g: "" if _close(g, want) else
                         f"you said {g}, the table gives {want:.2f} us")])
