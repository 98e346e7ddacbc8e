"""Lab 4.5's check: the learner's own capture of the batch-1 decode loop (gpt-fast's ``decode_one_token``).

:func:`check_hand_capture` builds the learner's class on a :class:`~course.lessons.real_model.decode.StaticDecoder`
of the tiny Llama (float32), decodes 64 greedy tokens, then a second sequence of 16, and compares them with eager
decoding. It runs the same way on the GPU (``torch.cuda``'s graphs) and on the simulator (``course.graphs()``), so
its verdict is the GPU's on both. What it sees, besides the tokens:

- a forward pre-hook on the model (:class:`CallSpy`) records every forward that ran in Python: on which stream,
  inside a capture or not, with which KV cache. Replays run no Python, so it sees the warm-up (there must be
  one, on a side stream, forked from the stream the buffers were written on and joined before the capture:
  :mod:`course.core.stream_order`), the capture, and any forward that ``generate`` ran eagerly instead of
  replaying;
- the learner's tensor attributes before and after ``generate``: one rebound instead of copied into is named;
- the KV cache's own counter after a sequence: a cache left to advance it writes where it counts, not at the
  position.

Wrong tokens are diagnosed by the outcome each usual slip gives: every token the last one (the next token kept
without a clone), every step at position 0 (a position frozen at capture), the first token never fed back, the
second sequence wrong (buffers not reset).

Last, as step 6 will: a prompt prefilled into the decoder's cache (``decoder.cache_for(1)``), then
``generate(last, n, start=L-1)``. Which positions of that cache the replays wrote is measured
(:mod:`~course.lessons.real_model.continuation`): none (the graph reads a cache of its own, so it never sees the
prompt), the prompt's from 0 (``start`` ignored), the prompt zeroed (a reset), or others than ``L-1..L+n-2``.
"""
from __future__ import annotations

import gc
import inspect
import warnings

import torch

from course.core.capture import collector_paused
from course.core.checks import exercise
from course.parity.tools import phrase
from course.lessons.real_model.decode import StaticDecoder
from course.lessons.real_model.generate import greedy
from course.lessons.real_model.lab import lab_model
from course.core.stream_order import StreamOrder

NAME = "lab 4.5 the token loop, captured by hand"
RUNS = ((3, 64), (11, 16))  # (first token, greedy tokens): a sequence, then a second one on the same graph
PROMPT = (6, 16)  # then a prompt of 6 tokens prefilled into the decoder's cache, and 16 tokens from its last one
MAX_LEN = 128  # room for both runs even when the position is never reset (no write past the cache)
HINT = ["a replay reads and writes only the tensors the capture saw: the token, the position, the KV cache and "
        "the next token must all be tensors made before the capture, and stay the same tensors",
        "make ids [1, 1] and pos [1] on the device and take the decoder's cache (decoder.cache_for(1)); warm "
        "one_token() up on a side stream; capture it in cg.graph(g); then per token: replay, clone the next token, "
        "copy it into ids, advance pos. generate sets pos to `start` first",
        "a smaller example, with no model: x = torch.zeros(1, device=dev); warm up, then with cg.graph(g): y = x * 2 "
        "+ 1. Now x.fill_(3); g.replay() leaves 7 in y: the replay read the new value from the same x and wrote the "
        "same y (y.clone() keeps it before the next replay)"]
ANSWER = ("__init__: self.ids = torch.zeros((1, 1), dtype=torch.long, device=dev); self.pos = torch.zeros(1, "
          "dtype=torch.long, device=dev); self.cache = decoder.cache_for(1); side = cg.Stream(); "
          "side.wait_stream(cg.current_stream()); with cg.stream(side): self.one_token() (twice); "
          "cg.current_stream().wait_stream(side); self.graph = cg.CUDAGraph(); with cg.graph(self.graph): self.next = "
          "self.one_token().  one_token: for layer in self.cache.layers: layer.cumulative_length.copy_(self.pos[0]); "
          "mask = (self.decoder._arange <= self.pos).view(1, 1, 1, -1); out = self.model(input_ids=self.ids, "
          "position_ids=self.pos.view(1, 1), attention_mask=mask, past_key_values=self.cache, use_cache=True); return "
          "out.logits[:, -1].argmax(-1, keepdim=True).  generate: self.ids.copy_(first_ids.view(1, 1)); "
          "self.pos.fill_(start); per token: self.graph.replay(); out.append(self.next.clone()); "
          "self.ids.copy_(self.next); self.pos.add_(1); return torch.cat(out, dim=1)")
HOST_READ = ("a host read or a wait inside the capture (.item(), int(), .tolist(), print of a tensor, a "
             "synchronize): the capture records GPU work and cannot stop to hand a value to Python. Keep the next "
             "token on the device: argmax(-1, keepdim=True)")
HOST_COPY = ("a copy between host and device inside the capture (torch.tensor(...), .cpu(), .to() of a host "
             "tensor): make every buffer before the capture, on the device")


class CallSpy:
    """A forward pre-hook: one entry per forward run in Python, ``(where, cache)``.

    ``where`` is "capture" (inside a capture), "side" (a side stream) or "default" (the default stream);
    ``cache`` is the class name of the ``past_key_values`` passed ("none" when absent).
    """

    def __init__(self, cg):
        self.cg, self.calls = cg, []
        self.order = None  # a StreamOrder while the learner's class is built: a missing fork or join

    def __call__(self, module, args, kwargs) -> None:
        """Record one forward (the hook's signature: ``with_kwargs=True``)."""
        cg = self.cg
        if cg.is_current_stream_capturing():
            where = "capture"
        else:
            where = "default" if cg.current_stream() == cg.default_stream() else "side"
        if self.order is not None:
            self.order.work(where == "capture")
        cache = kwargs.get("past_key_values")
        self.calls.append((where, "none" if cache is None else type(cache).__name__))

    def problem(self) -> str:
        """What the recorded forwards say is wrong before any token is compared ('' when nothing)."""
        where = [w for w, _ in self.calls]
        no_cache = sorted({c for _, c in self.calls if c != "StaticCache"})
        if no_cache:
            return (f"the model ran with past_key_values={no_cache[0]}, not a static KV cache: without one "
                    "transformers makes a DynamicCache that grows by concatenation, which a capture freezes at one "
                    "length. Pass the StaticCache made before the capture (past_key_values=self.cache)")
        if "capture" not in where:
            return ("the model's forward never ran inside a capture: call one_token() inside `with cg.graph(g):` "
                    "and keep what it returns (the static output)")
        before = where[:where.index("capture")]
        if "side" not in before:
            what = "the warm-up ran on the default stream" if before else "no warm-up ran"
            return (f"{what} before the capture: run one_token() once or twice on a side stream first "
                    "(s = cg.Stream(); s.wait_stream(cg.current_stream()); with cg.stream(s): ...; "
                    "cg.current_stream().wait_stream(s)). Lazy set-up (cuBLAS handles, first-use allocations) must "
                    "not happen inside a capture, and torch's rule is a side stream")
        if self.order is not None and self.order.problem is not None:
            return self.order.problem
        return ""


def _tensors(obj) -> dict:
    return {k: v for k, v in vars(obj).items() if isinstance(v, torch.Tensor)}


def _static_caches(obj, dec) -> list:
    from transformers import StaticCache

    found = [v for v in vars(obj).values() if isinstance(v, StaticCache)] + list(dec.caches.values())
    return [c for c in dict((id(c), c) for c in found).values() if c.layers and c.layers[0].is_initialized]


def _build(cls, dec, spy, cg):
    """``cls(dec)``, the collector paused; a failed capture becomes an AssertionError that names it."""
    before = cg.current_stream()
    gc.collect()  # a graph freed by the collector in the middle of a capture would invalidate it (GPU)
    spy.order = StreamOrder(cg)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with collector_paused():
                loop = cls(dec)
        for w in caught:  # kept when the build succeeded; a failed capture's ("the CUDA Graph is empty") are noise
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        return loop
    except NotImplementedError:
        cg.set_stream(before)
        raise
    except Exception as e:
        cg.set_stream(before)  # a failed capture leaves its own stream current, as torch's does
        if cg is torch.cuda:
            from course.core.capture import recover
            recover()
        why, captured = spy.problem(), any(w == "capture" for w, _ in spy.calls)
        if why and (captured or "past_key_values" in why):
            raise AssertionError(why) from None
        if not captured:
            raise  # the learner's code broke before any capture: a crash, with its own line
        key = phrase(e)
        advice = HOST_READ if "not permitted when stream is capturing" in key else (
            HOST_COPY if "Cannot copy between CPU and CUDA" in key else "look at the line the capture reached")
        raise AssertionError(f"the capture failed ({key}): {advice}") from None
    finally:
        spy.order.close()  # the order it found stays for spy.problem()


def _diagnose(loop, dec, got, want, first, n, run, attrs) -> str:
    """Why ``got`` differs from ``want``: the usual slip whose outcome it matches, else where they part."""
    rebound = sorted(k for k, t in attrs.items() if getattr(loop, k, None) is not t)
    if rebound:
        return (f"generate rebound self.{rebound[0]} to a new tensor: the graph still reads the tensor it saw at "
                f"capture. Copy into it instead (self.{rebound[0]}.copy_(...), .fill_(), .add_(1))")
    if n > 1 and torch.equal(got, want[:, -1:].expand_as(want)):
        return ("every token you returned is the last one: the graph writes its next token into the same tensor "
                "at every replay, so keep a copy (self.next.clone()) before the next replay")
    ref = StaticDecoder(dec.model, dec.max_len)
    zero = torch.zeros(1, dtype=torch.long, device=got.device)
    if torch.equal(got, greedy(lambda ids, p: ref.step(ids, zero), first, n)):
        return ("every replay decoded at position 0: the position was frozen at capture (a Python number, or a "
                "tensor made inside the capture). Keep it in a static device buffer and advance that buffer "
                "before each replay (self.pos.add_(1))")
    with torch.no_grad():
        same = torch.cat([ref.step(first.view(1, 1), torch.full((1,), t, dtype=torch.long, device=got.device))
                          .argmax(-1, keepdim=True) for t in range(n)], dim=1)
    if torch.equal(got, same):
        return ("every replay decoded the first token again: the next token never reached the buffer the graph "
                "reads. Copy it in before the next replay (self.ids.copy_(self.next))")
    if run > 0:
        return ("the first sequence decoded right and the second did not: each generate must start its sequence "
                "from its own first token at position `start` (copy first_ids into the token buffer, then "
                "self.pos.fill_(start): 0 for a new sequence, as here; step 6 passes a prompt's last position)")
    for cache in _static_caches(loop, dec):
        counter = int(cache.layers[0].cumulative_length)
        if counter != n:
            return (f"the KV cache wrote where its own counter points, not at the position: after positions "
                    f"0..{n - 1} its cumulative_length is {counter}, not {n}. transformers' StaticCache advances "
                    "it at every run (warm-ups included) and the graph replays that add_: set it from the position "
                    "buffer before the model runs (layer.cumulative_length.copy_(pos[0]))")
    step = int((got != want).any(0).nonzero()[0])
    if step == 0:
        return ("the first token is already wrong: copy first_ids into the static token buffer before the first "
                "replay")
    return f"{n} greedy tokens differ from eager decoding from step {step}: check the position and the mask"


def _generate(loop, spy, first, n, start=0):
    """``loop.generate(first, n, start)`` under no_grad; none of the model's forwards may run in Python."""
    seen = len(spy.calls)
    with torch.no_grad():
        got = loop.generate(first, n, start=start) if start else loop.generate(first, n)
    eager = len(spy.calls) - seen
    assert eager == 0, (f"generate ran the model's forward in Python {eager} times: replay the graph instead "
                        "(self.graph.replay()); a replay runs the recorded kernels, no Python")
    assert isinstance(got, torch.Tensor), f"generate() should return a tensor, got {type(got).__name__}"
    assert tuple(got.shape) == (1, n), (f"generate(first_ids, {n}) returned shape {tuple(got.shape)}: expected "
                                        f"[1, {n}] (torch.cat of the [1, 1] tokens, dim=1)")
    return got.long()


def _check_prompt(loop, dec, model, spy) -> None:
    """A prompt prefilled into the decoder's cache, then ``generate(last, n, start=L-1)``, as step 6 does it: the
    positions it writes are measured (:mod:`~course.lessons.real_model.continuation`), then its tokens compared."""
    from course.lessons.real_model import continuation
    from course.lessons.real_model.chat import prefill

    length, n = PROMPT
    if "start" not in inspect.signature(loop.generate).parameters:
        raise AssertionError("generate takes no `start`: step 6 goes on from a prompt's last position, so write "
                             "def generate(self, first_ids, n_tokens, start=0) and set the position to it")
    prompt = continuation.prompt_for(model, length)
    ref = StaticDecoder(model, dec.max_len)
    prefill(ref, prompt)
    want = greedy(ref.step, prompt[0, -1:], n, start=length - 1)
    prefill(dec, prompt)
    before = continuation.snapshot(dec.cache_for(1))
    got = _generate(loop, spy, prompt[0, -1:], n, start=length - 1)
    why = continuation.problem(before, dec.cache_for(1), length - 1, n)
    assert not why, f"after a prompt of {length} tokens (as in step 6): {why}"
    if not torch.equal(got, want):
        step = int((got != want).any(0).nonzero()[0])
        raise AssertionError(f"after a prompt of {length} tokens prefilled into the decoder's cache, generate(last, "
                             f"{n}, start={length - 1}) wrote the right positions but its tokens differ from eager "
                             f"decoding from step {step}: check the mask (keys 0..position) and the position ids")


def check_hand_capture(cls, max_len: int = MAX_LEN) -> None:
    """Step 5: ``cls(decoder)`` captures one decode step by hand; ``.generate(first_ids, n, start=0)`` replays it per
    token: two sequences from position 0, then one from a prompt prefilled into the decoder's cache (as in step 6)."""
    import course

    with exercise(NAME, hint=HINT, answer=ANSWER):
        model = lab_model()
        cg = course.graphs()
        dec = StaticDecoder(model, max_len)
        spy = CallSpy(cg)
        handle = model.register_forward_pre_hook(spy, with_kwargs=True)
        try:
            loop = _build(cls, dec, spy, cg)
            why = spy.problem()
            assert not why, why
            for run, (token, n) in enumerate(RUNS):
                first = torch.tensor([token], device=model.device)
                attrs = _tensors(loop)
                got = _generate(loop, spy, first, n)
                want = greedy(StaticDecoder(model, max_len).step, first, n)
                if not torch.equal(got, want):
                    raise AssertionError(_diagnose(loop, dec, got, want, first, n, run, attrs))
            _check_prompt(loop, dec, model, spy)
        finally:
            handle.remove()
