"""Lesson 06's check 06.4: the reduce-overhead step records one graph and keeps it, traced on
the harness (:mod:`course.core.harness`).
"""
from __future__ import annotations

import re
from contextlib import contextmanager

import torch

from course.core.checks import exercise
from course.core.compiled import compile_counters, reset_compile, torch_log_messages
from course.core.harness import Rule, Tracer, check
from course.core.runtime import runtime
from course.lessons.real_model.decode import StaticDecoder
from course.lessons.real_model.generate import tolerance
from course.lessons.real_model.reduce_fixed import (cache_sources, describe_sources,
                                                    static_input_report)
from course.lessons.real_model.checks import _storage, lab_model


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
