"""Lab 4's checks, 4.1 to 4.6, in one namespace for the lab (4.5's own module:
:mod:`course.lessons.real_model.hand_check`).
"""
from __future__ import annotations

import functools

import torch

from course.core.checks import exercise
from course.core.harness import Rule, check, restored
from course.lessons.graph_cache.cache import GraphCache
from course.lessons.real_model import chat
from course.lessons.real_model.decode import StaticDecoder, model_backend
from course.lessons.real_model.generate import forced_logits, greedy, tolerance
from course.lessons.what_breaks import find_static
from course.lessons.real_model.checks import _first_diff, _slip, lab_model
from course.lessons.real_model.hand_check import (HAND, POSITION_RULES, Writes,  # noqa: F401
                                                  check_hand_capture, prompt_zeroed)


# ======================== lab 4.1 to 4.4
CAPTURABLE = "lab 4.1 a capturable step"
CAPTURABLE_HINT = ["the finder names the lines: every input must already be a device tensor",
                   "in step: keep the position in a device tensor [1] and build position ids and "
                   "the mask from it on the device; write it into each cache layer's "
                   "cumulative_length before the model runs",
                   "a smaller example: pos = torch.tensor([5], device=dev); mask = torch.arange(8, "
                   "device=dev) <= pos needs no host value, while int(pos) or range(pos) would"]
CAPTURABLE_ANSWER = ("layer.cumulative_length.copy_(position[0]); mask = (arange <= position)...; "
                     "model(input_ids=ids, position_ids=..., attention_mask=mask, "
                     "past_key_values=cache)")
WRAPPED = "lab 4.2 wrapped in the graph cache"
WRAPPED_HINT = ["lab 3's GraphCache wraps any step: which arguments of the step have a batch "
                "dimension, and what must padding rows hold?",
                "in wrap: only ids has a batch dimension (position is shared by the batch: "
                "batched=(0,)); padding rows get id 0 and position 0, and the model's own backend "
                "keeps its graphs' memory",
                "a smaller example: GraphCache(lambda x, s: x * s, buckets=[2, 4], batched=(0,)) "
                "pads x to its bucket and passes s through as it is"]
WRAPPED_ANSWER = ("GraphCache(decoder.step, buckets=[...], batched=(0,), pad_value=(0, 0), "
                  "backend=model_backend()), or graph_cached(decoder, buckets=...)")
PREDICT = "lab 4.3 predict tokens/s"
PREDICT_HINT = ["a step cannot beat bytes / bandwidth seconds, and it makes `batch` tokens",
                "in predict: seconds per step = nbytes over the bandwidth in bytes per second "
                "(GB/s: 1e9 bytes per second); tokens per second = batch over that",
                "a smaller example: 2 GB at 1000 GB/s is 2 ms a step; a batch of 4 then makes 4 / "
                "0.002 = 2000 tokens/s"]
PREDICT_ANSWER = "return batch / (nbytes / (bandwidth_GBps * 1e9))"
GAP = "lab 4.4 the gap, per kernel"
GAP_HINT = ["the difference of the two times per token, shared by every kernel of the step",
            "in per_kernel: slow_us - fast_us is the gap of one step; each of its kernels takes an "
            "equal share",
            "a smaller example: 100 us against 60 us over 20 kernels is 2 us per kernel"]
GAP_ANSWER = "return (slow_us - fast_us) / kernels"


class _Step:
    """Lab 4.1's evidence, computed as the rules ask for it: the learner's step run, captured and
    compared."""

    def __init__(self, cls, max_len: int):
        self.cls, self.max_len, self.model = cls, max_len, lab_model()
        self.first = torch.tensor([7, 9], device=self.model.device)

        self.args = (torch.tensor([[11], [12]], device=self.model.device),
                     torch.full((1,), 5, dtype=torch.long, device=self.model.device))

    @functools.cached_property
    def dec(self):
        return self.cls(self.model, self.max_len)

    def idempotent(self) -> bool:
        with torch.no_grad():
            return torch.equal(self.dec.step(*self.args).clone(), self.dec.step(*self.args).clone())

    def fallbacks(self) -> list:
        cache = GraphCache(self.dec.step, batched=(0,), pad_value=(0, 0), backend=model_backend())
        with torch.no_grad():
            cache(*self.args)
        return list(cache.get_stats()["fallback_reasons"].values())

    @functools.cached_property
    def tokens(self):
        return (greedy(self.cls(self.model, self.max_len).step, self.first, 16),
                greedy(StaticDecoder(self.model, self.max_len).step, self.first, 16))

    @functools.cached_property
    def logits(self):
        fed = torch.cat([self.first.view(-1, 1), self.tokens[1][:, :-1]], dim=1)
        return (forced_logits(self.cls(self.model, self.max_len).step, fed),
                forced_logits(StaticDecoder(self.model, self.max_len).step, fed))

    def logits_problem(self) -> str:
        mine, ref = self.logits
        tol, scale = tolerance(self.model.dtype), float(ref.abs().max()) or 1.0
        off = (mine - ref).abs().amax(dim=(0, 2)) / scale  # per step
        bad = (off > tol).nonzero()
        return "" if not len(bad) else (
            f"the greedy tokens agree, but from step {int(bad[0])} the logits differ from the "
            f"course's step by up to {float(off.max()):.1e} of the largest logit (tolerance "
            f"{tol:.0e}): check the position ids (one per row, from position), the mask and the "
            "positions the KV cache writes")


CAPTURABLE_RULES = [
    Rule("finder", "",
         lambda s: "" if not (found := find_static(s.cls.step)) else "the finder still sees "
         + "; ".join(
        f"{f.where()} {f.code}" for f in found)),
    Rule("idempotent", "", lambda s: "" if s.idempotent() else (
        "the same inputs gave different logits on a second run: a warm-up or a capture runs the "
        "step more than once, so it must not depend on how often it ran (does it trust the cache's "
        "own cumulative_length?)")),
    Rule("capture", "",
         lambda s: "" if not (why := s.fallbacks()) else f"the capture failed: {why[0]}"),
    Rule("tokens", "", lambda s: "" if torch.equal(*s.tokens) else (
        f"16 greedy tokens differ from the course's step from step {_first_diff(*s.tokens)}: check "
        "the positions and the mask")),
    Rule("logits_shape", "", lambda s: "" if s.logits[0].shape == s.logits[1].shape else (
        f"the step returns logits of shape {(s.logits[0].shape[0], *s.logits[0].shape[2:])}, "
        f"expected [B, vocab] = {(s.logits[1].shape[0], s.logits[1].shape[2])}")),
    Rule("logits", "", lambda s: s.logits_problem()),
]


def check_capturable(cls, max_len: int = 64) -> None:
    """Step 1: ``cls(model, max_len).step(ids, position)`` is capturable and decodes like the
    course's step."""
    with exercise(CAPTURABLE, hint=CAPTURABLE_HINT, answer=CAPTURABLE_ANSWER):
        check(_Step(cls, max_len), CAPTURABLE_RULES)


class _Wrapped:
    """Lab 4.2's evidence: the learner's GraphCache, its padding value, its tokens per batch and its
    statistics."""

    def __init__(self, wrap, cls, max_len: int):
        self.model = lab_model()
        self.eager, self.cache = StaticDecoder(self.model, max_len), wrap(cls(self.model, max_len))
        self.vocab = self.model.config.vocab_size
        pad = getattr(self.cache, "pad_value", 0)
        self.pad = pad[0] if isinstance(pad, (tuple, list)) else pad

    def leak(self) -> str:
        for batch in (1, 3, 2):
            first = torch.arange(5, 5 + batch, device=self.model.device)
            if not torch.equal(greedy(self.cache, first, 6), greedy(self.eager.step, first, 6)):
                return (f"batch {batch}: the cache's tokens differ from eager's: padding rows "
                        "leaked into real sequences, or the position was not copied in")
        return ""

    def eager_calls(self) -> str:
        s = self.cache.get_stats()
        if not s["eager_calls"]:
            return ""
        backend = "" if type(getattr(self.cache, "backend", None)) is type(model_backend()) else (
            "; pass backend=model_backend(): on this machine it is the backend that understands "
            "transformers' same-device moves")
        return (f"{s['eager_calls']} eager calls: the capture failed, so the steps ran eagerly "
                f"({'; '.join(sorted(set(s['fallback_reasons'].values())))})" + backend)


WRAPPED_RULES = [
    Rule("not_a_cache", "", lambda w: "" if hasattr(w.cache, "get_stats") else (
        f"wrap() should return a GraphCache, got {type(w.cache).__name__}")),
    Rule("pad_token", "", lambda w: "" if isinstance(w.pad, int) and 0 <= w.pad < w.vocab else (
        f"padding rows get token id {w.pad!r}, outside the embedding's {w.vocab} "
        "rows: on a GPU that is a device-side assert, which ends the session. Pad ids with a real "
        "token id (pad_value=(0, 0))")),
    Rule("padding_leaked", "", lambda w: w.leak()),
    Rule("eager_calls", "", lambda w: w.eager_calls()),
    Rule("hits", "", lambda w: "" if w.cache.get_stats()["cache_hits"] >= 10 else (
        f"only {w.cache.get_stats()['cache_hits']} hits: is every step recorded anew (a key on a "
        "value)?")),
    Rule("no_padding", "", lambda w: "" if w.cache.get_stats()["padded_rows"] > 0 else (
        "no padded rows: batch 3 should be padded to a bucket (give buckets, e.g. [1, 2, 4])")),
]


def check_wrapped(wrap, cls=StaticDecoder, max_len: int = 64) -> None:
    """Step 2: ``wrap(decoder)`` gives a GraphCache with buckets; replays equal eager, padding never
    leaks."""
    with exercise(WRAPPED, hint=WRAPPED_HINT, answer=WRAPPED_ANSWER):
        check(_Wrapped(wrap, cls, max_len), WRAPPED_RULES)


def _predict_problem(predict) -> str:
    for nbytes, bw, batch in ((2e9, 3000.0, 1), (2e9, 3000.0, 8), (1e6, 100.0, 3)):
        want, got = batch / (nbytes / (bw * 1e9)), predict(nbytes, bw, batch)
        if got is None:
            return "predict() returned None: return the tokens per second"
        why = _slip(got, want, {
            want / batch: "that is steps per second, and each step makes `batch` tokens",
            want / 1e9: "mind the units: bandwidth_GBps is in GB/s, 1e9 bytes per second",
            1 / want: "that is seconds per token: tokens per second is its inverse"})
        if why.startswith(": a number") or abs(float(got) - want) > 1e-6 * want:
            return (f"{nbytes:.0e} bytes at {bw} GB/s, batch {batch}: you said {got}, the roofline "
                    f"says {want:.4g} tokens/s{why}")
    return ""


def _gap_problem(per_kernel) -> str:
    for slow, fast, kernels in ((1000.0, 300.0, 350), (50.0, 40.0, 2)):
        want, got = (slow - fast) / kernels, per_kernel(slow, fast, kernels)
        if got is None:
            return "per_kernel() returned None: return microseconds per kernel"
        brackets = "mind the brackets: the difference first, then per kernel"
        why = _slip(got, want, {
            slow - fast: "that is the whole gap of a step: share it among its kernels",
            -want: "the sign: the slow time minus the fast one",
            slow - fast / kernels: brackets, slow / kernels - fast: brackets})
        if why.startswith(": a number") or abs(float(got) - want) > 1e-9 + 1e-6 * abs(want):
            return (f"{slow} us vs {fast} us, {kernels} kernels: you said {got}, expected "
                    f"{want:.4g} us{why}")
    return ""


def check_prediction(predict) -> None:
    """Step 3: ``predict(bytes_per_token, bandwidth_GBps, batch)`` is the roofline's tokens/s."""
    with exercise(PREDICT, hint=PREDICT_HINT, answer=PREDICT_ANSWER):
        check(predict, [Rule("tokens_per_s", "", _predict_problem)])


def check_gap(per_kernel) -> None:
    """Step 4: ``per_kernel(slow_us, fast_us, kernels)``: the time between two variants per kernel
    of a step."""
    with exercise(GAP, hint=GAP_HINT, answer=GAP_ANSWER):
        check(per_kernel, [Rule("per_kernel", "", _gap_problem)])



# ======================== lab 4.6 the loop answers a chat
CHAT = "lab 4.6 your loop answers a chat prompt"
N_CHAT = 48
CHAT_HINT = ["a prompt's keys and values are written into the decoder's KV cache by the prefill; "
             "the graph must read that cache and go on from the prompt's last position",
             "in MyGraphedDecode: the cache the graph reads is the decoder's, and generate's "
             "`start` is where the first replay decodes; every replay after it decodes one "
             "position further",
             "a smaller example: a prompt of 5 tokens fills positions 0..3; generate(prompt[0, "
             "-1:], 3, start=4) must write positions 4, 5 and 6, and leave 0..3 as they are"]
CHAT_ANSWER = ("self.cache = decoder.cache_for(1) in __init__ (the cache the prefill writes), and "
               "in generate: self.ids.copy_(first_ids.view(1, 1)); self.pos.fill_(start) before "
               "the loop of replays")
WORTH = ("A model this small (SmolLM2 has 135M parameters) writes fluent English and gets facts "
         "wrong: its answer tests your loop; it is not a source (compare what it says with lesson "
         "02)")
TEXT_CHARS = 400  # the ✓ line shows the loop's text up to this many characters


def answer_text(result: dict, tokenizer, eos=None) -> str:
    """The text of the loop's tokens in ``result`` (:func:`chat.answer`), up to the end of sequence,
    special tokens left out; its token ids as text when there is no tokenizer."""
    ids = chat.until_eos(result["tokens"], eos) if eos is not None else result["tokens"][0].tolist()
    if tokenizer is None:
        return " ".join(map(str, ids))
    return tokenizer.decode(ids, skip_special_tokens=True).strip()


def _chat_tokens(result, tokenizer, dtype) -> str:
    agree, compared = result["agree"], result["compared"]
    if agree == compared or dtype != torch.float32:
        return ""
    d = chat.divergence(result["want_logits"], result["want"], result["tokens"], agree, tokenizer)
    return ("float32: your loop wrote the right cache positions, but its tokens part from "
            f"model.generate's at answer token {agree} (generate {d['generate']}, your loop "
            f"{d['loop']}): check what one_token feeds the model, the mask (keys 0..position) and "
            "the position ids")


def check_chat(cls=None, model=None, tokenizer=None, prompt=None, n: int = N_CHAT):
    """Step 6: ``cls`` built on ``model``'s decoder answers ``prompt`` (the chat question) after a
    prefill, judged by the cache positions it wrote and its tokens; the run, or None (``cls`` None:
    "not done yet")."""
    result = None
    with exercise(CHAT, hint=CHAT_HINT, answer=CHAT_ANSWER) as notes:
        if cls is None:
            raise NotImplementedError("step 5 (lab 4.5) is not passed yet: your loop answers here "
                                      "once its check passes")
        prompt = chat.chat_ids(tokenizer, chat.QUESTION,
                               device=model.device) if prompt is None else prompt
        dec = StaticDecoder(model, prompt.shape[1] + n)
        with restored():  # no graph freed by the collector inside the loop's capture
            result = chat.answer(cls(dec), dec, prompt, n)
        start = result["start"]
        writes = Writes(result["written"], start, n, zeroed=prompt_zeroed(dec.cache_for(1), start))
        title = f"after the prompt (positions 0..{start - 1} prefilled)"
        check(writes, [Rule(p.name, title, p.test) for p in POSITION_RULES])
        check(result, [Rule("tokens", "", lambda r: _chat_tokens(r, tokenizer, model.dtype))])
        text = answer_text(result, tokenizer, model.config.eos_token_id)
        text = text if len(text) <= TEXT_CHARS else text[:TEXT_CHARS].rsplit(" ", 1)[0] + " ..."
        agree, compared = result["agree"], result["compared"]
        where = f"all {compared} of generate's tokens"
        if agree < compared:
            d = chat.divergence(result["want_logits"], result["want"], result["tokens"], agree,
                                tokenizer)
            where = (f"the first {agree} of generate's {compared} tokens; then generate chose "
                     f"{d['generate']} and your loop {d['loop']}, {d['gap']:.3f} apart in "
                     f"generate's logits, {d['gap'] / d['bf16_spacing']:.1f} bfloat16 steps")
        notes.append(f"your captured loop answered: {text!r} ({where}). {WORTH}")
    return result
