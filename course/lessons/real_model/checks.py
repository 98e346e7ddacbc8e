"""Lesson 06's and lab 4's checks, on the course's one harness (:mod:`course.core.harness`).

Each check runs the learner's code on the tiny Llama (live on any machine), gathers what it did (a
trace of the model's forwards, the KV-cache positions each ``generate`` wrote, what it returned) and
judges that by named rules: the first broken rule is the ✗, with the same words on the laptop and on
a GPU. Hints are staged (the rule, where, a smaller example); the answer comes only on request.
"""
from __future__ import annotations

import functools
import gc
import inspect
import re
import warnings
from contextlib import contextmanager

import torch

import course
from course.core.capture import collector_paused, recover
from course.core.checks import exercise, learner_frame
from course.core.compiled import compile_counters, reset_compile, torch_log_messages
from course.core.harness import Rule, Tracer, capture_error, capture_rules, check, root_cause
from course.core.runtime import runtime
from course.lessons.graph_cache.cache import GraphCache
from course.lessons.real_model import chat
from course.lessons.real_model.decode import StaticDecoder, graph_cached, model_backend
from course.lessons.real_model.generate import forced_logits, greedy, tolerance
from course.lessons.real_model.model import build_model, bytes_per_token
from course.lessons.real_model.reduce_fixed import (cache_sources, describe_sources,
                                                    static_input_report)
from course.lessons.real_model.roofline import floor_us
from course.lessons.what_breaks import find_static

_MODEL: dict = {}


def lab_model():
    """The tiny Llama every check uses (built once per session, seed 0)."""
    if "m" not in _MODEL:
        _MODEL["m"] = build_model("tiny")
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


# ======================== 06.4 the reduce-overhead step
REDUCE = "06.4 the reduce-overhead step"
# greedy tokens the check decodes (positions 0..7): enough to see a recompile, seconds on a CPU
TOKENS = 8
MAX_LEN_RO = 64
# the modes of torch.compile that record CUDA graphs
GRAPH_MODES = ("reduce-overhead", "max-autotune")
REDUCE_HINT = ["three things make reduce-overhead record one graph and keep it: addresses it can "
               "trust, a new step marked before each call, and a copy of what you keep",
               "mark each cache layer's keys, values and cumulative_length, decoder._arange, "
               "self.ids and self.pos with torch._dynamo.mark_static_address; compile decoder.step "
               "with mode=\"reduce-overhead\"; per token copy ids and pos into the buffers, call "
               "torch.compiler.cudagraph_mark_step_begin(), call the compiled step, clone",
               "a smaller example, one buffer and a function of it: buf = torch.zeros(4, "
               "device=dev); torch._dynamo.mark_static_address(buf); f = torch.compile(lambda x: x "
               "* 2, mode=\"reduce-overhead\"); per call: buf.copy_(new); "
               "torch.compiler.cudagraph_mark_step_begin(); y = f(buf).clone()"]
REDUCE_ANSWER = ("in __init__: for layer in self.cache.layers: for t in (layer.keys, layer.values, "
                 "layer.cumulative_length): torch._dynamo.mark_static_address(t); the same for "
                 "decoder._arange, self.ids and self.pos; self.compiled = "
                 "torch.compile(decoder.step, mode=\"reduce-overhead\", fullgraph=True). In step: "
                 "self.ids.copy_(ids); self.pos.copy_(pos); "
                 "torch.compiler.cudagraph_mark_step_begin(); return self.compiled(self.ids, "
                 "self.pos).clone()")


def unmarked_decoder(model, max_len: int = MAX_LEN_RO, batch: int = 1) -> StaticDecoder:
    """A :class:`StaticDecoder` whose KV cache for ``batch`` is allocated but not marked static, as
    transformers leaves a cache that a compiled prefill allocated (lesson 06, section 12)."""
    dec = StaticDecoder(model, max_len)
    for layer in dec.cache_for(batch).layers:
        for t in (layer.keys, layer.values, layer.cumulative_length):
            # what mark_static_address sets, and all it sets
            if hasattr(t, "_dynamo_static_input_type"):
                del t._dynamo_static_input_type
    return dec


def _storage(t) -> int:
    return t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) else -1


def graphs_asked(tracer) -> bool:
    """True when every ``torch.compile`` call the tracer saw asked for CUDA graphs (a graph mode or
    the option)."""
    asked = [e["kwargs"] for e in tracer.of("compile")]
    graphs = [c.get("mode") in GRAPH_MODES or (c.get("options") or {}).get("triton.cudagraphs")
              for c in asked]
    return bool(asked) and all(graphs)


def marks_before_calls(tracer) -> list:
    """For each call of the compiled step, how many ``cudagraph_mark_step_begin`` ran since the
    previous call."""
    out, marks = [], 0
    for e in tracer.events:
        if e["what"] == "mark":
            marks += 1
        elif e["what"] == "call":
            out.append(marks)
            marks = 0
    return out


@contextmanager
def watch_compile(on_gpu: bool | None = None):
    """``torch.compile`` and ``torch.compiler.cudagraph_mark_step_begin`` traced (a :class:`Tracer`:
    "compile", "mark", "call" events); both still work. Without a GPU the compile runs with
    ``backend="aot_eager"``."""
    on_gpu = runtime().on_gpu if on_gpu is None else on_gpu
    real_compile, real_mark = torch.compile, torch.compiler.cudagraph_mark_step_begin
    tracer = Tracer(streams=False)

    def counted(compiled):
        def call(*args, **kwargs):
            event = tracer.note("call")
            event["output"] = _storage(out := compiled(*args, **kwargs))
            return out
        return call

    def spy_compile(model=None, **kwargs):
        tracer.note("compile", kwargs=dict(kwargs))
        # CUDA graphs need CUDA: the same tracing and static-input analysis, no graphs
        if not on_gpu:
            kwargs = {k: v for k, v in kwargs.items() if k not in ("mode", "options", "backend")}
            kwargs["backend"] = "aot_eager"
        if model is None:  # used as a decorator: @torch.compile(mode=...)
            return lambda fn: counted(real_compile(fn, **kwargs))
        return counted(real_compile(model, **kwargs))

    def spy_mark():
        tracer.note("mark")
        real_mark()

    torch.compile, torch.compiler.cudagraph_mark_step_begin = spy_compile, spy_mark
    try:
        yield tracer
    finally:
        torch.compile, torch.compiler.cudagraph_mark_step_begin = real_compile, real_mark
        tracer.close()


def _recompile_reason(messages) -> str:
    for m in messages:
        if "Recompiling function" in m:
            hit = re.search(r"guard failure\(s\):\s*\n\s*-\s*(?:\d+/\d+:\s*)?(.+?)(?:\s{2,}#|\n|$)",
                            m)
            return hit.group(1).strip() if hit else m.splitlines()[0]
    return ""


def _static_problem(non_static) -> str:
    """The ✗ for inputs torch's static-input analysis found not static ('' when none)."""
    if not non_static:
        return ""
    cache = cache_sources(non_static)
    rest = [s for s in non_static if s not in cache]
    if cache:
        text = (f"not marked static: {describe_sources(cache)}. The step writes into them (the new "
                "K/V, the counter), and a CUDA graph cannot trust the address of an input that is "
                "not static (transformers' recipe, whose cache was not static, logged 'skipping "
                "cudagraphs due to mutated inputs (66 instances)' in the course's recorded GPU run "
                "and decoded without a graph). Mark each with torch._dynamo.mark_static_address "
                "before the first call")
        return text + (f"; not static either: {describe_sources(rest)}" if rest else "")
    return (f"the compiled step's inputs {describe_sources(rest)} are not static addresses: before "
            "each replay CUDA graphs copy every input that is not static into a buffer of their "
            "own. Pass the buffers you made once (self.ids, self.pos) and mark them, and "
            "decoder._arange, with torch._dynamo.mark_static_address")


def _reduce_run(cls, model, tracer, on_gpu: bool) -> dict:
    """Build ``cls`` and decode :data:`TOKENS` tokens with it beside the eager step: what each token
    showed."""
    step = cls(unmarked_decoder(model, MAX_LEN_RO, 1), batch=1)
    out = {"compiles": len(tracer.of("compile")), "tokens": [], "kept": True, "worst": (0.0, -1),
           "launches": None}
    if not graphs_asked(tracer):
        return out
    eager = StaticDecoder(model, MAX_LEN_RO)
    ids = torch.full((1, 1), 3, dtype=torch.long, device=eager.device)
    kept = None
    for p in range(TOKENS):
        pos = torch.full((1,), p, dtype=torch.long, device=eager.device)
        calls = len(tracer.of("call"))
        logits = step.step(ids, pos)
        token = {"logits": logits, "called": len(tracer.of("call")) > calls,
                 "own": _storage(logits) == (tracer.of("call") or [{}])[-1].get("output")}
        out["tokens"].append(token)
        if _returned_problem(token, model) or not token["called"] or token["own"]:
            return out
        want = eager.step(ids, pos)
        out["worst"] = max(out["worst"],
                           (((logits.float() - want).abs().max() / want.abs().max()).item(), p))
        kept = (logits, logits.clone()) if p == 0 else kept
        ids = logits.argmax(-1, keepdim=True)
    out["kept"] = torch.equal(*kept)
    if on_gpu:
        from course.core.profiling import launch_counts

        out["launches"] = launch_counts(lambda: step.step(ids, pos))["graph_launches"]
    return out


def _returned_problem(token, model) -> str:
    logits, vocab = token["logits"], model.config.vocab_size
    if isinstance(logits, torch.Tensor) and logits.shape == (1, vocab):
        return ""
    shape = tuple(getattr(logits, "shape", ()))
    return f"step must return the logits [1, {vocab}], got {type(logits).__name__} {shape}"


def _marks_problem(t) -> str:
    marks = marks_before_calls(t["watch"])
    if all(m == 1 for m in marks):
        return ""
    late = " (after the call, not before it)" if sum(marks) and marks[0] == 0 else ""
    return (f"torch.compiler.cudagraph_mark_step_begin() ran {len(t['watch'].of('mark'))} times "
            f"for {len(marks)} calls of the compiled step{late}: call it once per token, just "
            "before the compiled call. It tells torch's CUDA graphs that a new step begins, so the "
            "last step's outputs may be overwritten; without it torch guesses where a step begins, "
            "and once any code in the process has called it, it stops guessing")


def _skips_problem(t) -> str:
    skips = [m for m in t["msgs"] if "skipping cudagraphs" in m.lower()]
    return "" if not t["on_gpu"] or not (skips or t["counters"]["cudagraph_skips"]) else (
        f"torch skipped its CUDA graphs: {skips[:1]}")


def _last(t, key):
    return bool(t["run"]["tokens"]) and t["run"]["tokens"][-1][key]


REDUCE_RULES = [
    Rule("no_compile", "", lambda t: "" if t["run"]["compiles"] else (
        "your class never called torch.compile: compile decoder.step in __init__, with "
        "mode=\"reduce-overhead\"")),
    Rule("no_graphs", "", lambda t: "" if graphs_asked(t["watch"]) else (
        "torch.compile was called with "
        f"mode={t['watch'].of('compile')[-1]['kwargs'].get('mode')!r}: that mode records no CUDA "
        "graph, so every token still launches each kernel from the host. Compile with "
        "mode=\"reduce-overhead\"")),
    Rule("logits_shape", "",
         lambda t: t["run"]["tokens"] and _returned_problem(t["run"]["tokens"][-1], t["model"])),
    Rule("not_called", "", lambda t: "" if not t["run"]["tokens"] or _last(t, "called") else (
        "step() never called the compiled step: call the function torch.compile returned "
        "(self.compiled(self.ids, self.pos))")),
    Rule("own_output", "", lambda t: "" if not _last(t, "own") else (
        "step returned the compiled step's own output, not a copy: on a GPU it lives in the CUDA "
        "graph's memory, which later replays overwrite (transformers' recipe failed on such an "
        "output in the course's recorded GPU run: \"accessing tensor output of CUDAGraphs that has "
        "been overwritten by a subsequent run\"). Return a .clone() of it")),
    Rule("compile_in_step", "",
         lambda t: "" if len(t["watch"].of("compile")) == t["run"]["compiles"] else (
        "torch.compile ran inside step(): compile once, in __init__, and call the compiled "
        "function each token")),
    Rule("marks", "", _marks_problem),
    Rule("graph_breaks", "", lambda t: "" if not t["counters"]["graph_breaks"] else (
        f"the compiled step broke into pieces ({t['counters']['graph_breaks']} graph breaks): "
        "compile with fullgraph=True to see where")),
    Rule("recompiles", "", lambda t: "" if t["counters"]["unique_graphs"] == 1 else (
        f"dynamo compiled {t['counters']['unique_graphs']} graphs over {TOKENS} tokens (recompiled "
        f"on: {_recompile_reason(t['msgs']) or 'see TORCH_LOGS=recompiles'}): something the step "
        "depends on changed between tokens (a shape, or a Python number such as a position given "
        "as an int). Keep every input a device tensor of one shape: ids [1, 1] and pos [1]")),
    Rule("no_analysis", "", lambda t: "" if static_input_report(t["msgs"]) else (
        "torch logged no static-input analysis: was the compiled step ever called?")),
    Rule("not_static", "",
         lambda t: _static_problem(static_input_report(t["msgs"])[-1]["non_static"])),
    Rule("cudagraph_skips", "", _skips_problem),
    Rule("launches", "", lambda t: "" if not t["on_gpu"] or t["run"]["launches"] == 1 else (
        f"one token launched {t['run']['launches']:.0f} CUDA graphs (expected one: the step "
        "recorded as one graph, replayed)")),
    Rule("kept", "", lambda t: "" if t["run"]["kept"] else (
        "the logits returned for the first token changed when the next steps ran: return a copy "
        "(.clone()) the caller may keep")),
    Rule("logits", "", lambda t: "" if t["run"]["worst"][0] <= tolerance(t["model"].dtype) else (
        f"the logits at position {t['run']['worst'][1]} differ from the eager step's by "
        f"{t['run']['worst'][0]:.2e} of their largest value: does every step copy ids and pos into "
        "the buffers the compiled step reads (self.ids.copy_(ids), self.pos.copy_(pos))?")),
]


def check_reduce_overhead(cls) -> None:
    """06.4: ``cls(decoder, batch=1).step(ids, pos)`` is ``decoder.step`` under
    ``mode="reduce-overhead"``, fixed: its compile, marks and calls traced, torch's own logs and
    counters read, its logits against eager's."""
    on_gpu = runtime().on_gpu
    with exercise(REDUCE, hint=REDUCE_HINT, answer=REDUCE_ANSWER), torch.no_grad():
        model = lab_model()
        reset_compile()
        try:
            with torch_log_messages(cudagraph_static_inputs=True, recompiles=True, cudagraphs=True,
                                    perf_hints=True) as msgs, watch_compile(on_gpu) as watch:
                run = _reduce_run(cls, model, watch, on_gpu)
            counters = compile_counters()
        finally:
            reset_compile()
        check({"run": run, "watch": watch, "msgs": msgs, "counters": counters, "model": model,
               "on_gpu": on_gpu},
              REDUCE_RULES)


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
