"""Lab 4.5's check: the token loop captured by hand, judged on the harness by what its replays
read and wrote (:mod:`course.core.harness`).
"""
from __future__ import annotations

import functools
import gc
import inspect
import warnings
from contextlib import contextmanager

import torch

import course
from course.core.capture import collector_paused, recover
from course.core.checks import exercise, learner_frame
from course.core.harness import Rule, Tracer, capture_error, capture_rules, check, root_cause
from course.lessons.real_model import chat
from course.lessons.real_model.decode import StaticDecoder
from course.lessons.real_model.generate import greedy
from course.lessons.real_model.checks import _first_diff, _storage, lab_model


# ======================== lab 4.5 the token loop, by hand
HAND = "lab 4.5 the token loop, captured by hand"
# (first token, greedy tokens): a sequence, then a second one on the same graph
RUNS = ((3, 32), (11, 16))
PROMPT = (6, 16)  # then a prompt of 6 tokens prefilled, and 16 tokens from its last one
MAX_LEN = 100  # the sequences' decoder: not 128, so a mask of a length copied from lesson 06 shows
PROMPT_LEN = 40  # the prompt's decoder, of another length: a length fixed in the code shows
HAND_HINT = ["a replay reads and writes only the tensors the capture saw: the token, the position, "
             "the KV cache and the next token must all be tensors made before the capture, and "
             "stay the same tensors",
             "in __init__, what the graph reads exists before the warm-up and the capture; in "
             "generate, what changes from token to token changes inside those same tensors, "
             "between replays",
             "a smaller example, with no model: x = torch.zeros(1, device=dev); warm up, then with "
             "cg.graph(g): y = x * 2 + 1. Now x.fill_(3); g.replay() leaves 7 in y: the replay "
             "read the new value from the same x and wrote the same y (y.clone() keeps it before "
             "the next replay)"]
HAND_ANSWER = ("__init__: self.ids = torch.zeros((1, 1), dtype=torch.long, device=dev); self.pos = "
               "torch.zeros(1, dtype=torch.long, device=dev); self.cache = decoder.cache_for(1); "
               "side = cg.Stream(); side.wait_stream(cg.current_stream()); with cg.stream(side): "
               "self.one_token() (twice); cg.current_stream().wait_stream(side); self.graph = "
               "cg.CUDAGraph(); with cg.graph(self.graph): self.next = self.one_token().  "
               "one_token: for layer in self.cache.layers: "
               "layer.cumulative_length.copy_(self.pos[0]); mask = (self.decoder._arange <= "
               "self.pos).view(1, 1, 1, -1); out = self.model(input_ids=self.ids, "
               "position_ids=self.pos.view(1, 1), attention_mask=mask, past_key_values=self.cache, "
               "use_cache=True); return out.logits[:, -1].argmax(-1, keepdim=True).  generate: "
               "self.ids.copy_(first_ids.view(1, 1)); self.pos.fill_(start); per token: "
               "self.graph.replay(); out.append(self.next.clone()); self.ids.copy_(self.next); "
               "self.pos.add_(1); return torch.cat(out, dim=1)")
OWN_CACHE = ("your graph never writes the decoder's KV cache (decoder.cache_for(1)): it reads and "
             "writes a cache of its own, made apart from the decoder's, so it never sees a prompt "
             "prefilled into the decoder's cache and answers as if there were none")


def _span(ps) -> str:
    if not ps:
        return "none"
    if ps == list(range(ps[0], ps[-1] + 1)):
        return f"{ps[0]}..{ps[-1]}"
    return ", ".join(map(str, ps[:8])) + (", ..." if len(ps) > 8 else "")


def prompt_zeroed(cache, start: int) -> bool:
    """True when layer 0's keys and values of the prompt's positions ``0..start-1`` are all zeros (a
    reset)."""
    keys, values = cache.layers[0].keys[:, :, :start], cache.layers[0].values[:, :, :start]
    return start > 0 and bool((keys == 0).all() and (values == 0).all())


class Writes:
    """The KV-cache positions one ``generate(first, n, start)`` wrote, and what the check set up
    before it: the moved ``counter``, the previous sequence's end, the prompt ``zeroed`` after it,
    whether the captured position was a tensor of the loop's (``from_buffer``)."""

    def __init__(self, written, start, n, counter=None, prev_end=None, zeroed=False,
                 from_buffer=None):
        self.written, self.start, self.n, self.counter = list(written), start, n, counter
        self.prev_end, self.zeroed, self.from_buffer = prev_end, zeroed, from_buffer

    def run_of(self, first: int) -> bool:
        """True when the positions written are exactly ``first..first+n-1``."""
        return self.written == list(range(first, first + self.n))

    def frozen(self) -> str:
        """Why every replay decoded at the same position ('' when it did not)."""
        if self.n < 2 or self.written != [self.start]:
            return ""
        if self.from_buffer is False:
            return (f"every replay decoded at position {self.start}: the position the graph reads "
                    "was made inside the capture, from a Python number, so it was frozen at "
                    "capture")
        if self.from_buffer:
            return (f"every replay decoded at position {self.start}: generate never advanced the "
                    "position buffer the graph reads between replays")
        return (f"every replay decoded at position {self.start}: the position the graph reads "
                "never moved")


POSITION_RULES = [
    Rule("own_cache", "", lambda w: "" if w.written else OWN_CACHE),
    Rule("cache_emptied", "", lambda w: "" if not w.zeroed else (
        f"generate emptied the KV cache: the prompt's keys and values (positions 0..{w.start - 1}, "
        "written by the prefill) are zeros after it. A new sequence needs no reset: every replay "
        "writes its own position before it attends over 0..position")),
    Rule("own_counter", "", lambda w: "" if w.counter is None or not w.run_of(w.counter) else (
        f"the KV cache wrote where its own counter pointed (cumulative_length {w.counter}, where "
        "the check had moved it), not at the position: transformers' StaticCache writes at that "
        "counter and advances it at every run, so a step that leaves it alone writes wherever "
        "earlier runs left it")),
    Rule("position_frozen", "", lambda w: w.frozen()),
    Rule("from_zero", "",
         lambda w: "" if not w.start or not set(w.written) <= set(range(w.n)) or min(
        w.written) >= w.start else (
        f"generate decoded from position 0, not from start={w.start}: its replays wrote over the "
        "prompt's keys and values")),
    Rule("second_sequence", "",
         lambda w: "" if w.prev_end is None or not w.run_of(w.prev_end) else (
        f"the second sequence began at position {w.prev_end}, where the first ended, not at "
        f"start={w.start}: each generate begins its sequence at `start`")),
    Rule("one_late", "", lambda w: "" if not w.run_of(w.start + 1) else (
        "generate decoded every token one position late: the first replay ran at position "
        f"{w.start + 1}, not at start={w.start} (the position was one ahead of its token at every "
        "replay)")),
    Rule("positions", "", lambda w: "" if w.run_of(w.start) else (
        f"generate wrote positions {_span(w.written)} of the KV cache, not "
        f"{_span(list(range(w.start, w.start + w.n)))} (one per token from start={w.start})")),
]


def _kw(name):
    return lambda args, kwargs: kwargs.get(name)


class _Built:
    """The learner's class built on a decoder, the model's forwards and ``one_token`` traced
    (harness.Tracer)."""

    def __init__(self, cls, dec):
        cg = course.graphs()
        self.dec, self.error, self.loop = dec, None, None
        self.tracer = Tracer(cg)
        self.tracer.hook(dec.model, "forward", cache=_kw("past_key_values"),
                         mask=_kw("attention_mask"),
                         pos=_kw("position_ids"))
        traced = cls
        if callable(getattr(cls, "one_token", None)):
            one_token = self.tracer.wrap(cls.one_token, "one_token")
            traced = type(cls.__name__, (cls,), {"one_token": one_token})
        before = cg.current_stream()
        # a graph freed by the collector in the middle of a capture would invalidate it (GPU)
        gc.collect()
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with collector_paused():
                    self.loop = traced(dec)
            for w in caught:  # kept when the build succeeded; a failed capture's are noise
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        # noqa: BLE001 - judged by BUILD_RULES, else raised again as the learner's crash
        except Exception as e:
            cg.set_stream(before)  # a failed capture leaves its own stream current, as torch's does
            if cg is torch.cuda:
                recover()
            if isinstance(e, NotImplementedError):
                self.tracer.close()
                raise
            self.error = e

    def forwards(self, where: str | None = None) -> list:
        return [e for e in self.tracer.of("forward") if where is None or e["where"] == where]

    def captured(self, what: str = "forward") -> dict:
        return next((e for e in self.tracer.of(what) if e["where"] == "capture"), {})

    def no_static_cache(self) -> str:
        kinds = sorted({"none" if e["cache"] is None else type(e["cache"]).__name__
                        for e in self.forwards()} -
                       {"StaticCache"})
        return "" if not kinds else (
            f"the model ran with past_key_values={kinds[0]}, not a static KV cache: without one "
            "transformers makes a DynamicCache that grows by concatenation, which a capture "
            "freezes at one length. Pass the StaticCache made before the capture")

    def mask_length(self) -> str:
        masks = [e["mask"] for e in self.forwards() if isinstance(e["mask"], torch.Tensor)]
        lengths = sorted({m.shape[-1] for m in masks} - {self.dec.max_len})
        return "" if not lengths else (
            f"the attention mask covers {lengths[0]} positions and the decoder's KV cache holds "
            f"{self.dec.max_len}: a mask of a length fixed in the code fits one cache only (step "
            "6's is another length)")

    def host(self, kind: str) -> str:
        rule, text = capture_error(self.error) if self.error is not None else ("", "")
        if rule != kind:
            return ""
        frame = learner_frame(root_cause(self.error))
        return text + (f" (your line: {frame[3]})" if frame and frame[3] else "")

    def token_shape(self) -> str:
        if not self.tracer.of("one_token"):
            return ""
        out = self.captured("one_token").get("output")
        if not isinstance(out, torch.Tensor):
            return f"one_token() returned {type(out).__name__}, not the next token as int64 [1, 1]"
        if out.shape == (1, 1) and not out.is_floating_point():
            return ""
        why = ": its argmax ran over the logits of every position the model returned, not the last"
        return (f"one_token() returned shape {list(out.shape)}, {out.dtype}, not the next token as "
                f"int64 [1, 1]" + (why if out.dim() > 2 else ""))


BUILD_RULES = [
    Rule("no_static_cache", "", _Built.no_static_cache),
    Rule("mask_length", "", _Built.mask_length),
    Rule("host_read", "the capture failed", lambda b: b.host("host_read")),
    Rule("host_copy", "the capture failed", lambda b: b.host("host_copy")),
]
CAPTURE_RULES = [Rule(r.name, r.title, lambda b, f=r.test: f(b.tracer))
                 for r in capture_rules("forward", "one_token()")] + [
    Rule("own_cache", "",
         lambda b: "" if b.captured()["cache"] is b.dec.cache_for(1) else OWN_CACHE),
    Rule("token_shape", "", _Built.token_shape),
]


def _tensors(obj) -> dict:
    return {k: v for k, v in vars(obj).items() if isinstance(v, torch.Tensor)}


class _Run:
    """One ``generate(first, n, start)`` of a built loop, and what it showed (for
    :data:`RUN_RULES`)."""

    def __init__(self, built, token: int, n: int, start: int = 0, prev_end=None, ref=None):
        self.built, self.n, self.start = built, n, start
        dec, loop = built.dec, built.loop
        self.first = torch.tensor([token], device=dec.device)
        # eager decoding, from the same cache state
        self.ref = ref or StaticDecoder(dec.model, dec.max_len)
        cache = dec.cache_for(1)
        # the cache's own counter moved where the right loop never writes first
        counter = dec.max_len - n
        for layer in cache.layers:
            layer.cumulative_length.fill_(counter)
            layer.keys[:, :, start:].zero_()  # every position written from here on shows
            layer.values[:, :, start:].zero_()
        before, self.attrs, seen = chat.snapshot(cache), _tensors(loop), len(built.forwards())
        with torch.no_grad():
            self.got = loop.generate(self.first, n,
                                     start=start) if start else loop.generate(self.first, n)
        self.eager = len(built.forwards()) - seen
        pos = built.captured().get("pos")
        mine = {_storage(t) for t in _tensors(loop).values()}
        self.writes = Writes(chat.written(before, cache), start, n, counter, prev_end,
                             prompt_zeroed(cache, start),
                             None if pos is None else _storage(pos) in mine)

    @functools.cached_property
    def want(self):
        return greedy(self.ref.step, self.first, self.n, start=self.start)

    @property
    def wrong(self) -> bool:
        return not torch.equal(self.got, self.want)

    def returned(self) -> str:
        if not isinstance(self.got, torch.Tensor):
            return f"generate() should return a tensor, got {type(self.got).__name__}"
        return "" if tuple(self.got.shape) == (1, self.n) else (
            f"generate(first_ids, {self.n}) returned shape {tuple(self.got.shape)}: expected [1, "
            f"{self.n}] (the [1, 1] tokens side by side)")

    def rebound(self) -> str:
        loop = self.built.loop
        moved = sorted(k for k, t in self.attrs.items() if getattr(loop, k, None) is not t)
        return "" if not moved else (
            f"generate rebound self.{moved[0]} to a new tensor: the graph still reads the tensor "
            "it saw at capture")

    def mask(self) -> str:
        mask = self.built.captured().get("mask")
        if not self.wrong or not isinstance(mask, torch.Tensor):
            return ""
        allowed = (mask if mask.dtype == torch.bool else mask == 0).reshape(-1, mask.shape[-1])[0]
        # the last replay's position (the positions written are right)
        last = self.start + self.n - 1
        keys = torch.arange(mask.shape[-1], device=mask.device)
        if torch.equal(allowed, keys < last):
            return (f"the attention mask leaves out the token's own position: at position {last} "
                    f"it allowed keys 0..{last - 1}, not 0..{last} (a token attends to itself too)")
        return "" if torch.equal(allowed, keys <= last) else (
            f"at position {last} the attention mask allowed keys {_span(keys[allowed].tolist())}, "
            f"not 0..{last}")

    def not_fed_back(self) -> str:
        if not self.wrong:
            return ""
        dev, ids = self.first.device, self.first.view(1, 1)
        # the first token decoded at every position, as a loop that never feeds back
        with torch.no_grad():
            same = torch.cat([self.ref.step(ids, torch.full((1,), p, dtype=torch.long, device=dev))
                              .argmax(-1, keepdim=True) for p in range(self.start,
                                                                       self.start + self.n)], dim=1)
        return "" if not torch.equal(self.got, same) else (
            "every replay decoded the first token again: the next token never reached the buffer "
            "the graph reads")


def _run_rules(title: str = "") -> list:
    return [
        Rule("eager_forward", title, lambda r: "" if not r.eager else (
            f"generate ran the model's forward in Python {r.eager} times: a replay runs the "
            "recorded kernels, with no Python, and generate should replay the graph instead")),
        Rule("returned", title, _Run.returned),
        Rule("rebound", title, _Run.rebound),
        Rule("not_cloned", title, lambda r: "" if r.n < 2 or not r.wrong or not torch.equal(
            r.got, r.want[:, -1:].expand_as(r.want)) else (
            "every token you returned is the last one: the graph writes its next token into the "
            "same tensor at every replay, and your list holds that one tensor many times")),
    ] + [Rule(p.name, title, lambda r, f=p.test: f(r.writes)) for p in POSITION_RULES] + [
        Rule("mask", title, _Run.mask),
        Rule("not_fed_back", title, _Run.not_fed_back),
        Rule("first_token", title, lambda r: "" if not r.wrong or _first_diff(r.got, r.want) else (
            "the first token is already wrong: the first replay did not read first_ids")),
        Rule("tokens", title, lambda r: "" if not r.wrong else (
            f"{r.n} greedy tokens differ from eager decoding from step "
            f"{_first_diff(r.got, r.want)}, with the right cache positions written: check the "
            "position ids and the mask")),
    ]


RUN_RULES = _run_rules()
PROMPT_RULES = _run_rules(f"after a prompt of {PROMPT[0]} tokens prefilled into the decoder's "
                          "cache (as in step 6)")


def _no_start(loop) -> str:
    if "start" in inspect.signature(loop.generate).parameters:
        return ""
    return ("generate takes no `start`: step 6 goes on from a prompt's last position, which "
            "generate(first_ids, n_tokens, start=0) takes as its first position")


@contextmanager
def _built(cls, dec):
    """``cls(dec)`` built, judged by :data:`BUILD_RULES`, then (the learner's own crash raised) by
    :data:`CAPTURE_RULES`; its tracer closed however the block ends (no hook left on the model)."""
    b = _Built(cls, dec)
    try:
        check(b, BUILD_RULES)
        if b.error is not None:
            raise b.error
        check(b, CAPTURE_RULES)
        yield b
    finally:
        b.tracer.close()


def check_hand_capture(cls, max_len: int = MAX_LEN) -> None:
    """Step 5: ``cls(decoder)`` captures one decode step by hand and ``.generate(first_ids, n,
    start=0)`` replays it per token: two sequences from position 0, then (on a decoder of another
    length) one after a prefilled prompt."""
    with exercise(HAND, hint=HAND_HINT, answer=HAND_ANSWER):
        model = lab_model()
        with _built(cls, StaticDecoder(model, max_len)) as b:
            prev = None
            for token, n in RUNS:
                check(_Run(b, token, n, prev_end=prev), RUN_RULES)
                prev = n
            check(b.loop, [Rule("no_start", "", _no_start)])
        length, n = PROMPT
        dec, ref = StaticDecoder(model, PROMPT_LEN), StaticDecoder(model, PROMPT_LEN)
        with _built(cls, dec) as b:
            prompt = chat.prompt_for(model, length)
            chat.prefill(ref, prompt)
            chat.prefill(dec, prompt)
            check(_Run(b, int(prompt[0, -1]), n, start=length - 1, ref=ref), PROMPT_RULES)
