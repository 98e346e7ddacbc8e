"""Lab 4's checks: each runs the learner's own code on the tiny Llama (live on any machine) and diagnoses it.

1. :func:`check_capturable`: the learner's decoder class has a capturable ``step(ids, position)``: the
   finder reads no hazard in it, a capture succeeds, running it twice on the same inputs gives the same
   logits (it does not trust the cache's own counter), and its greedy tokens equal the course's step.
2. :func:`check_wrapped`: the learner's ``wrap(decoder)`` puts that step in a GraphCache with buckets
   whose replays equal eager for batches that need padding, without leaking padding into real rows.
3. :func:`check_prediction`: tokens/s predicted from the roofline (bytes per token, bandwidth, batch).
4. :func:`check_gap`: a gap per kernel (eager to replayed: the launch cost; fused to the floor), from the times
   per token and the kernel count.
"""
from __future__ import annotations

import torch

from course.core.checks import exercise
from course.lessons.real_model.decode import StaticDecoder, model_backend
from course.lessons.real_model.generate import greedy
from course.lessons.real_model.model import build_model

_MODEL = {}


def lab_model():
    """The tiny Llama every check uses (built once per session, seed 0)."""
    if "m" not in _MODEL:
        _MODEL["m"] = build_model("tiny")
    return _MODEL["m"]


def check_capturable(cls, max_len: int = 64) -> None:
    """Step 1: ``cls(model, max_len).step(ids, position)`` is capturable and decodes like the course's step."""
    from course.lessons.graph_cache.cache import GraphCache
    from course.lessons.what_breaks import find_static

    with exercise("lab 4.1 a capturable step",
                  hint=["the finder names the lines: every input must already be a device tensor",
                        "keep the position in a device tensor [1] and build position ids and the mask from it on "
                        "the device; write it into each cache layer's cumulative_length before the model runs",
                        "layer.cumulative_length.copy_(position[0]); mask = (arange <= position)...; "
                        "model(input_ids=ids, position_ids=..., attention_mask=mask, past_key_values=cache)"]):
        found = find_static(cls.step)
        assert not found, "the finder still sees " + "; ".join(f"{f.where()} {f.code}" for f in found)
        model = lab_model()
        dec = cls(model, max_len)
        ids = torch.tensor([[11], [12]], device=model.device)
        pos = torch.full((1,), 5, dtype=torch.long, device=model.device)
        with torch.no_grad():
            a, b = dec.step(ids, pos).clone(), dec.step(ids, pos).clone()
        assert torch.equal(a, b), ("the same inputs gave different logits on a second run: a warm-up or a capture "
                                   "runs the step more than once, so it must not depend on how often it ran (does "
                                   "it trust the cache's own cumulative_length?)")
        cache = GraphCache(dec.step, batched=(0,), pad_value=(0, 0), backend=model_backend())
        with torch.no_grad():
            cache(ids, pos)
        reasons = list(cache.get_stats()["fallback_reasons"].values())
        assert not reasons, f"the capture failed: {reasons[0]}"
        first = torch.tensor([7, 9], device=model.device)
        want = greedy(StaticDecoder(model, max_len).step, first, 16)
        got = greedy(cls(model, max_len).step, first, 16)
        assert torch.equal(got, want), (f"16 greedy tokens differ from the course's step from step "
                                        f"{int((got != want).any(0).nonzero()[0])}: check the positions and the mask")


def check_wrapped(wrap, cls=StaticDecoder, max_len: int = 64) -> None:
    """Step 2: ``wrap(decoder)`` gives a GraphCache with buckets; replays equal eager, padding never leaks."""
    with exercise("lab 4.2 wrapped in the graph cache",
                  hint=["GraphCache(decoder.step, buckets=[...], batched=(0,), pad_value=(0, 0), "
                        "backend=model_backend()): or graph_cached(decoder, buckets=...)",
                        "only ids has a batch dimension: position is shared by the batch (batched=(0,))"]):
        model = lab_model()
        eager, dec = StaticDecoder(model, max_len), cls(model, max_len)
        cache = wrap(dec)
        assert hasattr(cache, "get_stats"), f"wrap() should return a GraphCache, got {type(cache).__name__}"
        for batch in (1, 3, 2):
            first = torch.arange(5, 5 + batch, device=model.device)
            want, got = greedy(eager.step, first, 6), greedy(cache, first, 6)
            assert torch.equal(got, want), (f"batch {batch}: the cache's tokens differ from eager's: padding rows "
                                            "leaked into real sequences, or the position was not copied in")
        s = cache.get_stats()
        assert s["cache_hits"] >= 10, f"only {s['cache_hits']} hits: is every step recorded anew (a key on a value)?"
        assert s["padded_rows"] > 0, ("no padded rows: batch 3 should be padded to a bucket (give buckets, e.g. "
                                      "[1, 2, 4])")
        assert s["eager_calls"] == 0, f"{s['eager_calls']} eager calls: {s['fallback_reasons']}"


def check_prediction(predict) -> None:
    """Step 3: ``predict(bytes_per_token, bandwidth_GBps, batch)`` is the roofline's tokens/s."""
    with exercise("lab 4.3 predict tokens/s",
                  hint="a step cannot beat bytes / bandwidth seconds, and it makes `batch` tokens"):
        for nbytes, bw, batch in ((2e9, 3000.0, 1), (2e9, 3000.0, 8), (1e6, 100.0, 3)):
            want = batch / (nbytes / (bw * 1e9))
            got = predict(nbytes, bw, batch)
            assert got is not None and abs(got - want) <= 1e-6 * want, \
                f"{nbytes:.0e} bytes at {bw} GB/s, batch {batch}: you said {got}, the roofline says {want:.4g} tokens/s"


def check_gap(per_kernel) -> None:
    """Step 4: ``per_kernel(slow_us, fast_us, kernels)``: the time between two variants per kernel of a step."""
    with exercise("lab 4.4 the gap, per kernel",
                  hint="the difference of the two times per token, shared by every kernel of the step"):
        for slow, fast, kernels in ((1000.0, 300.0, 350), (50.0, 40.0, 2)):
            want = (slow - fast) / kernels
            got = per_kernel(slow, fast, kernels)
            assert got is not None and abs(got - want) <= 1e-9 + 1e-6 * abs(want), \
                f"{slow} us vs {fast} us, {kernels} kernels: you said {got}, expected {want:.4g} us"
