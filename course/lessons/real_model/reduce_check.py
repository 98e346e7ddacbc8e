"""Exercise 06.4's check: the learner's own ``torch.compile(mode="reduce-overhead")`` decode step.

The learner writes ``MyReduceOverheadStep(decoder, batch=1)``: marks static what the step writes or reads by address,
compiles ``decoder.step`` with ``mode="reduce-overhead"``, and per token copies the inputs into its buffers, marks a
new step and returns a clone of the logits. :func:`check_reduce_overhead` runs it on the tiny Llama (float32) for
:data:`TOKENS` greedy tokens and reads what torch itself reports, with the same verdict on both paths:

- :func:`watch_compile` stands in for ``torch.compile`` and ``torch.compiler.cudagraph_mark_step_begin`` while the
  learner's class runs: it records the compile's arguments (the mode), each mark and each call of the compiled step
  and the address of its output. On a GPU the compile runs as written (inductor, CUDA graphs); without CUDA, where
  torch's CUDA graphs cannot exist, it compiles the same function with ``backend="aot_eager"``: dynamo's tracing and
  the static-input analysis that decides which inputs reduce-overhead may trust, without inductor and without graphs
  (what :func:`~course.lessons.real_model.reduce_fixed.static_input_diagnosis` uses). The learner writes the real
  call; the check, not the learner, picks what runs here, so the code that passes here is the code a GPU runs.
- torch's counters and logs: graphs dynamo compiled over the tokens (a recompile names its guard), the inputs its
  static-input analysis found not static (the KV cache's tensors among them: the "mutated inputs" of transformers'
  recorded recipe), and on a GPU also "skipping cudagraphs" and the CUDA graph launches of a token (profiler);
- the outputs: a returned tensor that is the compiled step's own output (no clone: on a GPU the next replay
  overwrites it), the first token's logits after the next steps ran, every token's logits against the eager step.

:func:`unmarked_decoder` hands the class a decoder whose KV cache is allocated but not marked static, as
transformers leaves a cache that a compiled prefill allocated (section 12's diagnosis): the marks are the learner's.
"""
from __future__ import annotations

import contextlib
import re

import torch

from course.core.checks import exercise
from course.core.compiled import compile_counters, reset_compile, torch_log_messages
from course.core.runtime import runtime
from course.lessons.real_model.decode import StaticDecoder
from course.lessons.real_model.generate import tolerance
from course.lessons.real_model.lab import lab_model
from course.lessons.real_model.reduce_fixed import cache_sources, describe_sources, static_input_report

NAME = "06.4 the reduce-overhead step"
TOKENS = 8  # greedy tokens the check decodes (positions 0..7): enough to see a recompile, seconds on a CPU
MAX_LEN = 64
FIRST = 3  # the first token
GRAPH_MODES = ("reduce-overhead", "max-autotune")  # the modes of torch.compile that record CUDA graphs
HINT = ["three things make reduce-overhead record one graph and keep it: addresses it can trust, a new step marked "
        "before each call, and a copy of what you keep",
        "mark each cache layer's keys, values and cumulative_length, decoder._arange, self.ids and self.pos with "
        "torch._dynamo.mark_static_address; compile decoder.step with mode=\"reduce-overhead\"; per token copy ids "
        "and pos into the buffers, call torch.compiler.cudagraph_mark_step_begin(), call the compiled step, clone",
        "a smaller example, one buffer and a function of it: buf = torch.zeros(4, device=dev); "
        "torch._dynamo.mark_static_address(buf); f = torch.compile(lambda x: x * 2, mode=\"reduce-overhead\"); per "
        "call: buf.copy_(new); torch.compiler.cudagraph_mark_step_begin(); y = f(buf).clone()"]
ANSWER = ("in __init__: for layer in self.cache.layers: for t in (layer.keys, layer.values, layer.cumulative_length): "
          "torch._dynamo.mark_static_address(t); the same for decoder._arange, self.ids and self.pos; self.compiled = "
          "torch.compile(decoder.step, mode=\"reduce-overhead\", fullgraph=True). In step: self.ids.copy_(ids); "
          "self.pos.copy_(pos); torch.compiler.cudagraph_mark_step_begin(); return self.compiled(self.ids, "
          "self.pos).clone()")


def unmarked_decoder(model, max_len: int = MAX_LEN, batch: int = 1) -> StaticDecoder:
    """A :class:`StaticDecoder` whose KV cache for ``batch`` is allocated but not marked static.

    transformers marks a cache static when it allocates it eagerly, but not when a compiled prefill allocates it
    (``mark_static_address`` is skipped while dynamo traces): the case section 12 diagnoses. This decoder is in that
    state, so a compiled step over it sees its ``keys``, ``values`` and ``cumulative_length`` as ordinary inputs until
    someone marks them.
    """
    dec = StaticDecoder(model, max_len)
    for layer in dec.cache_for(batch).layers:
        for t in (layer.keys, layer.values, layer.cumulative_length):
            if hasattr(t, "_dynamo_static_input_type"):  # what mark_static_address sets, and all it sets
                del t._dynamo_static_input_type
    return dec


def _storage(t) -> int:
    return t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) else -1


class CompileWatch:
    """What :func:`watch_compile` saw: ``compiles`` (each call's keyword arguments), ``events`` ("mark" or "call",
    in order) and ``outputs`` (the storage address of each compiled call's output)."""

    def __init__(self):
        self.compiles, self.events, self.outputs = [], [], []

    def graphs_asked(self) -> bool:
        """True when every ``torch.compile`` call asked for CUDA graphs (a mode of :data:`GRAPH_MODES`, or the
        option ``triton.cudagraphs``)."""
        return bool(self.compiles) and all(c.get("mode") in GRAPH_MODES
                                           or (c.get("options") or {}).get("triton.cudagraphs")
                                           for c in self.compiles)

    def marks_before_calls(self) -> list:
        """For each call of the compiled step, how many marks ran since the previous call."""
        out, marks = [], 0
        for e in self.events:
            if e == "mark":
                marks += 1
            else:
                out.append(marks)
                marks = 0
        return out


@contextlib.contextmanager
def watch_compile(on_gpu: bool | None = None):
    """Stand in for ``torch.compile`` and ``torch.compiler.cudagraph_mark_step_begin``; yields a :class:`CompileWatch`.

    Both still do their work. ``torch.compile`` runs as called on a GPU (``on_gpu``: the course's runtime when None);
    without one it compiles with ``backend="aot_eager"`` and no mode (CUDA graphs need CUDA; the tracing and the
    static-input analysis are the same). The compiled function is wrapped so that each call and its output's address
    are recorded. Both are put back on exit.
    """
    on_gpu = runtime().on_gpu if on_gpu is None else on_gpu
    watch = CompileWatch()
    real_compile, real_mark = torch.compile, torch.compiler.cudagraph_mark_step_begin

    def counted(compiled):
        def call(*args, **kwargs):
            watch.events.append("call")
            out = compiled(*args, **kwargs)
            watch.outputs.append(_storage(out))
            return out
        return call

    def spy_compile(model=None, **kwargs):
        watch.compiles.append(dict(kwargs))
        if not on_gpu:
            kwargs = {k: v for k, v in kwargs.items() if k not in ("mode", "options", "backend")}
            kwargs["backend"] = "aot_eager"
        if model is None:  # used as a decorator: @torch.compile(mode=...)
            return lambda fn: counted(real_compile(fn, **kwargs))
        return counted(real_compile(model, **kwargs))

    def spy_mark():
        watch.events.append("mark")
        real_mark()

    torch.compile, torch.compiler.cudagraph_mark_step_begin = spy_compile, spy_mark
    try:
        yield watch
    finally:
        torch.compile, torch.compiler.cudagraph_mark_step_begin = real_compile, real_mark


def _recompile_reason(messages) -> str:
    for m in messages:
        if "Recompiling function" in m:
            hit = re.search(r"guard failure\(s\):\s*\n\s*-\s*(?:\d+/\d+:\s*)?(.+?)(?:\s{2,}#|\n|$)", m)
            return hit.group(1).strip() if hit else m.splitlines()[0]
    return ""


def _static_problem(non_static) -> str:
    """The ✗ for inputs torch's static-input analysis found not static ('' when none)."""
    if not non_static:
        return ""
    cache = cache_sources(non_static)
    rest = [s for s in non_static if s not in cache]
    if cache:
        text = (f"not marked static: {describe_sources(cache)}. The step writes into them (the new K/V, the counter), "
                "and a CUDA graph cannot trust the address of an input that is not static (transformers' recipe, "
                "whose cache was not static, logged 'skipping cudagraphs due to mutated inputs (66 instances)' in "
                "the course's recorded GPU run and decoded without a graph). Mark each with "
                "torch._dynamo.mark_static_address before the first call")
        if rest:
            text += f"; not static either: {describe_sources(rest)}"
        return text
    return (f"the compiled step's inputs {describe_sources(rest)} are not static addresses: before each replay CUDA "
            "graphs copy every input that is not static into a buffer of their own. Pass the buffers you made once "
            "(self.ids, self.pos) and mark them, and decoder._arange, with torch._dynamo.mark_static_address")


def _run(cls, model, watch, on_gpu: bool) -> dict:
    """Build ``cls``, decode :data:`TOKENS` tokens with it and with eager in lockstep; checks made on the way."""
    step = cls(unmarked_decoder(model, MAX_LEN, 1), batch=1)
    assert watch.compiles, ("your class never called torch.compile: compile decoder.step in __init__, with "
                            "mode=\"reduce-overhead\"")
    assert watch.graphs_asked(), (f"torch.compile was called with mode={watch.compiles[-1].get('mode')!r}: that mode "
                                  "records no CUDA graph, so every token still launches each kernel from the host. "
                                  "Compile with mode=\"reduce-overhead\"")
    n_compiles = len(watch.compiles)
    eager = StaticDecoder(model, MAX_LEN)
    ids = torch.full((1, 1), FIRST, dtype=torch.long, device=eager.device)
    kept = kept_copy = None
    worst = (0.0, -1)
    for p in range(TOKENS):
        pos = torch.full((1,), p, dtype=torch.long, device=eager.device)
        calls = len(watch.outputs)
        logits = step.step(ids, pos)
        assert isinstance(logits, torch.Tensor) and logits.shape == (1, model.config.vocab_size), \
            f"step must return the logits [1, {model.config.vocab_size}], got {type(logits).__name__} " \
            f"{tuple(getattr(logits, 'shape', ()))}"
        assert len(watch.outputs) > calls, ("step() never called the compiled step: call the function torch.compile "
                                            "returned (self.compiled(self.ids, self.pos))")
        assert _storage(logits) != watch.outputs[-1], (
            "step returned the compiled step's own output, not a copy: on a GPU it lives in the CUDA graph's memory, "
            "which later replays overwrite (transformers' recipe failed on such an output in the course's "
            "recorded GPU run: \"accessing tensor output of CUDAGraphs that has been overwritten by a subsequent "
            "run\"). Return a .clone() of it")
        want = eager.step(ids, pos)
        diff = ((logits.float() - want).abs().max() / want.abs().max()).item()
        worst = max(worst, (diff, p))
        if p == 0:
            kept, kept_copy = logits, logits.clone()
        ids = logits.argmax(-1, keepdim=True)
    launches = None
    if on_gpu:
        from course.core.profiling import launch_counts

        launches = launch_counts(lambda: step.step(ids, pos))["graph_launches"]
    return {"compiles": n_compiles, "kept": torch.equal(kept, kept_copy), "worst": worst, "launches": launches}


def check_reduce_overhead(cls) -> None:
    """06.4: ``cls(decoder, batch=1).step(ids, pos)`` is ``decoder.step`` under ``mode="reduce-overhead"``, fixed.

    Runs on the tiny Llama for :data:`TOKENS` greedy tokens (see the module doc for what it watches): the compile
    asks for CUDA graphs and happens once; each step marks a new cudagraph step once, before its one compiled call,
    and returns a copy of the logits; dynamo compiles one graph for every position; torch's static-input analysis
    finds every input static; on a GPU torch skips no graph and a token is one CUDA graph launch; the first token's
    logits survive the next steps and every token's logits match the eager step's.
    """
    on_gpu = runtime().on_gpu
    with exercise(NAME, hint=HINT, answer=ANSWER), torch.no_grad():
        model = lab_model()
        reset_compile()
        try:
            with torch_log_messages(cudagraph_static_inputs=True, recompiles=True, cudagraphs=True,
                                    perf_hints=True) as msgs, watch_compile(on_gpu) as watch:
                got = _run(cls, model, watch, on_gpu)
            counters = compile_counters()
        finally:
            reset_compile()
        assert len(watch.compiles) == got["compiles"], (
            "torch.compile ran inside step(): compile once, in __init__, and call the compiled function each token")
        marks = watch.marks_before_calls()
        assert all(m == 1 for m in marks), (
            f"torch.compiler.cudagraph_mark_step_begin() ran {watch.events.count('mark')} times for {len(marks)} calls "
            f"of the compiled step{' (after the call, not before it)' if sum(marks) and marks[0] == 0 else ''}: call "
            "it once per token, just before the compiled call. It tells torch's CUDA graphs that a new step begins, so "
            "the last step's outputs may be overwritten; without it torch guesses where a step begins, and once any "
            "code in the process has called it, it stops guessing")
        graphs = counters["unique_graphs"]
        assert counters["graph_breaks"] == 0, (f"the compiled step broke into pieces ({counters['graph_breaks']} graph "
                                               "breaks): compile with fullgraph=True to see where")
        assert graphs == 1, (
            f"dynamo compiled {graphs} graphs over {TOKENS} tokens (recompiled on: "
            f"{_recompile_reason(msgs) or 'see TORCH_LOGS=recompiles'}): something the step depends on changed "
            "between tokens (a shape, or a Python number such as a position given as an int). Keep every input a "
            "device tensor of one shape: ids [1, 1] and pos [1]")
        report = static_input_report(msgs)
        assert report, "torch logged no static-input analysis: was the compiled step ever called?"
        problem = _static_problem(report[-1]["non_static"])
        assert not problem, problem
        if on_gpu:
            skips = [m for m in msgs if "skipping cudagraphs" in m.lower()]
            assert not skips and counters["cudagraph_skips"] == 0, f"torch skipped its CUDA graphs: {skips[:1]}"
            assert got["launches"] == 1, (f"one token launched {got['launches']:.0f} CUDA graphs (expected one: the "
                                          "step recorded as one graph, replayed)")
        assert got["kept"], ("the logits returned for the first token changed when the next steps ran: return a "
                             "copy (.clone()) the caller may keep")
        diff, p = got["worst"]
        assert diff <= tolerance(model.dtype), (
            f"the logits at position {p} differ from the eager step's by {diff:.2e} of their largest value: does "
            "every step copy ids and pos into the buffers the compiled step reads (self.ids.copy_(ids), "
            "self.pos.copy_(pos))?")
