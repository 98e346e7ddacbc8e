"""Lab 4's checks: each runs the learner's own code on the tiny Llama (live on any machine) and diagnoses it.

1. :func:`check_capturable`: the learner's decoder class has a capturable ``step(ids, position)``: the
   finder reads no hazard in it, a capture succeeds, running it twice on the same inputs gives the same
   logits (it does not trust the cache's own counter), its greedy tokens equal the course's step, and so do
   its logits on the course's tokens (teacher forcing: a wrong position can leave the argmax intact).
2. :func:`check_wrapped`: the learner's ``wrap(decoder)`` puts that step in a GraphCache with buckets
   whose replays equal eager for batches that need padding, without leaking padding into real rows,
   padding with a real token id and capturing on this machine's model backend.
3. :func:`check_prediction`: tokens/s predicted from the roofline (bytes per token, bandwidth, batch).
4. :func:`check_gap`: a gap per kernel (eager to replayed: the launch cost; fused to the floor), from the times
   per token and the kernel count.

The ✗ of 3 and 4 names the usual slips when the answer matches one (steps for tokens, GB/s as bytes/s, the
whole gap for its share per kernel, the sign). Hints are staged: the rule, where, a smaller example; the answer on request.
"""
from __future__ import annotations

import torch

from course.core.checks import exercise
from course.lessons.real_model.decode import StaticDecoder, model_backend
from course.lessons.real_model.generate import forced_logits, greedy, tolerance
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
                  hint=[
                "the finder names the lines: every input must already be a device tensor",
                "in step: keep the position in a device tensor [1] and build position ids and the mask from it on the"
                " device; write it into each cache layer's cumulative_length before the model runs",
                "a smaller example: pos = torch.tensor([5], device=dev); mask = torch.arange(8, device=dev) <= pos "
                "needs no host value, while int(pos) or range(pos) would"],
            answer="layer.cumulative_length.copy_(position[0]); mask = (arange <= position)...; model(input_ids=ids, "
                   "position_ids=..., attention_mask=mask, past_key_values=cache)"):
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
        _check_logits(cls, model, max_len, torch.cat([first.view(-1, 1), want[:, :-1]], dim=1))


def _check_logits(cls, model, max_len: int, fed) -> None:
    """The learner's logits on the course's token sequence (teacher forcing) equal the course's step's."""
    ref = forced_logits(StaticDecoder(model, max_len).step, fed)
    mine = forced_logits(cls(model, max_len).step, fed)
    assert mine.shape == ref.shape, (f"the step returns logits of shape {(mine.shape[0], *mine.shape[2:])}, "
                                     f"expected [B, vocab] = {(ref.shape[0], ref.shape[2])}")
    tol, scale = tolerance(model.dtype), float(ref.abs().max()) or 1.0
    off = (mine - ref).abs().amax(dim=(0, 2)) / scale  # per step
    bad = (off > tol).nonzero()
    assert not len(bad), (
        f"the greedy tokens agree, but from step {int(bad[0])} the logits differ from the course's step by up to "
        f"{float(off.max()):.1e} of the largest logit (tolerance {tol:.0e}): check the position ids (one per row, "
        "from position), the mask and the positions the KV cache writes")


def check_wrapped(wrap, cls=StaticDecoder, max_len: int = 64) -> None:
    """Step 2: ``wrap(decoder)`` gives a GraphCache with buckets; replays equal eager, padding never leaks."""
    with exercise("lab 4.2 wrapped in the graph cache",
                  hint=[
                "lab 3's GraphCache wraps any step: which arguments of the step have a batch dimension, and what must"
                " padding rows hold?",
                "in wrap: only ids has a batch dimension (position is shared by the batch: batched=(0,)); padding "
                "rows get id 0 and position 0, and the model's own backend keeps its graphs' memory",
                "a smaller example: GraphCache(lambda x, s: x * s, buckets=[2, 4], batched=(0,)) pads x to its bucket"
                " and passes s through as it is"],
            answer="GraphCache(decoder.step, buckets=[...], batched=(0,), pad_value=(0, 0), backend=model_backend()), or"
                   " graph_cached(decoder, buckets=...)"):
        model = lab_model()
        eager, dec = StaticDecoder(model, max_len), cls(model, max_len)
        cache = wrap(dec)
        assert hasattr(cache, "get_stats"), f"wrap() should return a GraphCache, got {type(cache).__name__}"
        pad = getattr(cache, "pad_value", 0)
        pad = pad[0] if isinstance(pad, (tuple, list)) else pad
        vocab = model.config.vocab_size
        assert isinstance(pad, int) and 0 <= pad < vocab, (
            f"padding rows get token id {pad!r}, outside the embedding's {vocab} rows: on a GPU that is a device-side "
            "assert, which ends the session. Pad ids with a real token id (pad_value=(0, 0))")
        for batch in (1, 3, 2):
            first = torch.arange(5, 5 + batch, device=model.device)
            want, got = greedy(eager.step, first, 6), greedy(cache, first, 6)
            assert torch.equal(got, want), (f"batch {batch}: the cache's tokens differ from eager's: padding rows "
                                            "leaked into real sequences, or the position was not copied in")
        s = cache.get_stats()
        reasons = sorted(set(s["fallback_reasons"].values()))
        assert s["eager_calls"] == 0, (
            f"{s['eager_calls']} eager calls: the capture failed, so the steps ran eagerly ({'; '.join(reasons)})"
            + ("; pass backend=model_backend(): on this machine it is the backend that understands transformers' "
               "same-device moves" if type(getattr(cache, "backend", None)) is not type(model_backend()) else ""))
        assert s["cache_hits"] >= 10, f"only {s['cache_hits']} hits: is every step recorded anew (a key on a value)?"
        assert s["padded_rows"] > 0, ("no padded rows: batch 3 should be padded to a bucket (give buckets, e.g. "
                                      "[1, 2, 4])")


def check_prediction(predict) -> None:
    """Step 3: ``predict(bytes_per_token, bandwidth_GBps, batch)`` is the roofline's tokens/s."""
    with exercise("lab 4.3 predict tokens/s",
                  hint=[
                "a step cannot beat bytes / bandwidth seconds, and it makes `batch` tokens",
                "in predict: seconds per step = nbytes over the bandwidth in bytes per second (GB/s: 1e9 bytes per "
                "second); tokens per second = batch over that",
                "a smaller example: 2 GB at 1000 GB/s is 2 ms a step; a batch of 4 then makes 4 / 0.002 = 2000 "
                "tokens/s"],
            answer="return batch / (nbytes / (bandwidth_GBps * 1e9))"):
        for nbytes, bw, batch in ((2e9, 3000.0, 1), (2e9, 3000.0, 8), (1e6, 100.0, 3)):
            want = batch / (nbytes / (bw * 1e9))
            got = predict(nbytes, bw, batch)
            assert got is not None, "predict() returned None: return the tokens per second"
            why = _diagnose(got, want, {
                want / batch: "that is steps per second, and each step makes `batch` tokens",
                want / 1e9: "mind the units: bandwidth_GBps is in GB/s, 1e9 bytes per second",
                1 / want: "that is seconds per token: tokens per second is its inverse"})
            assert abs(got - want) <= 1e-6 * want, (f"{nbytes:.0e} bytes at {bw} GB/s, batch {batch}: you said {got}, "
                                                    f"the roofline says {want:.4g} tokens/s{why}")


def check_gap(per_kernel) -> None:
    """Step 4: ``per_kernel(slow_us, fast_us, kernels)``: the time between two variants per kernel of a step."""
    with exercise("lab 4.4 the gap, per kernel",
                  hint=[
                "the difference of the two times per token, shared by every kernel of the step",
                "in per_kernel: slow_us - fast_us is the gap of one step; each of its kernels takes an equal share",
                "a smaller example: 100 us against 60 us over 20 kernels is 2 us per kernel"],
            answer="return (slow_us - fast_us) / kernels"):
        for slow, fast, kernels in ((1000.0, 300.0, 350), (50.0, 40.0, 2)):
            want = (slow - fast) / kernels
            got = per_kernel(slow, fast, kernels)
            assert got is not None, "per_kernel() returned None: return microseconds per kernel"
            why = _diagnose(got, want, {
                slow - fast: "that is the whole gap of a step: share it among its kernels",
                -want: "the sign: the slow time minus the fast one",
                slow - fast / kernels: "mind the brackets: the difference first, then per kernel",
                slow / kernels - fast: "mind the brackets: the difference first, then per kernel"})
            assert abs(got - want) <= 1e-9 + 1e-6 * abs(want), \
                f"{slow} us vs {fast} us, {kernels} kernels: you said {got}, expected {want:.4g} us{why}"


def _diagnose(got, want, known: dict) -> str:
    """': <why>' when ``got`` (not ``want``) matches one of the ``known`` wrong values, else ''."""
    try:
        got = float(got)
    except (TypeError, ValueError):
        raise AssertionError(f"a number was expected, got {type(got).__name__}") from None
    for value, why in known.items():
        if abs(value - want) > 1e-9 * abs(want) and abs(got - value) <= 1e-6 * abs(value) + 1e-12:
            return f": {why}"
    return ""
