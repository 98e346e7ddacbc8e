"""``torch.compile(mode="reduce-overhead")`` on transformers' Llama: why its graphs were skipped,
fixed.

transformers' recipe lets the compiled prefill allocate the ``StaticCache``, unmarked, so the decode
graph mutates 3 tensors per layer that are not static: cudagraphs skips ("mutated inputs").
:func:`static_input_diagnosis` shows it on any machine; :class:`ReduceOverheadStep` is the fix: the
cache and buffers marked static, a step marked before each call, the output cloned, fixed shapes.
"""
from __future__ import annotations

import re

import torch
from transformers import CompileConfig, StaticCache

from course.core.compiled import torch_log_messages
from course.core.results import Result
from course.lessons.real_model.decode import StaticDecoder
from course.lessons.real_model.model import size_of

_STATIC = re.compile(r"Adding static input pos (\d+) for source (.+)")
_NON_STATIC = re.compile(r"Non-static input pos (\d+) for source (.+)")
_END = "static input indices metadata analysis"
_CACHE = re.compile(r"\.layers\[(\d+)\]\.(keys|values|cumulative_length)$")


def mark_static(decoder, batch: int = 1, extra=()) -> int:
    """Mark with ``mark_static_address`` every tensor the step mutates or reads by address (the
    cache's keys, values and counters, ``_arange``, ``extra``); how many."""
    cache = decoder.cache_for(batch)
    tensors = [t for layer in cache.layers for t in (layer.keys, layer.values,
                                                     layer.cumulative_length)]
    tensors += [decoder._arange, *extra]
    for t in tensors:
        torch._dynamo.mark_static_address(t)
    return len(tensors)


class ReduceOverheadStep:
    """``StaticDecoder.step`` under ``torch.compile(mode="reduce-overhead")``, fixed (see the module
    doc); ``backend="aot_eager"`` runs the same tracing without graphs, on any machine."""

    def __init__(self, model, max_len: int = 256, batch: int = 1, backend: str = "inductor",
                 mode: str = "reduce-overhead", fullgraph: bool = True):
        self.decoder = StaticDecoder(model, max_len)
        dev = self.decoder.device
        # fixed shapes, fixed addresses
        self.ids = torch.zeros((batch, 1), dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.marked = mark_static(self.decoder, batch, extra=(self.ids, self.pos))
        options = {"mode": mode} if backend == "inductor" else {}
        self.compiled = torch.compile(self.decoder.step, backend=backend, fullgraph=fullgraph,
                                      **options)

    def step(self, ids, position):
        """Logits ``[B, vocab]`` (float32, a clone) after ``ids`` at ``position``, by the compiled
        step."""
        self.ids.copy_(ids)
        self.pos.copy_(position)
        # a new step: the previous call's outputs may be overwritten
        torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad():
            # ours to keep: the next replay overwrites the output
            return self.compiled(self.ids, self.pos).clone()


def static_input_report(messages) -> list:
    """torch's static-input analysis per compiled graph, ``{"static": [...], "non_static": [...]}``,
    read from the ``cudagraph_static_inputs`` log ``messages``."""
    graphs, cur = [], {"static": [], "non_static": []}
    for m in messages:
        text = str(m)
        hit = _STATIC.search(text) or _NON_STATIC.search(text)
        if hit:
            cur["static" if text.lstrip().startswith("Adding")
                else "non_static"].append(hit.group(2).strip())
        elif _END in text:
            graphs.append(cur)
            cur = {"static": [], "non_static": []}
    if cur["static"] or cur["non_static"]:
        graphs.append(cur)
    return graphs


def cache_sources(sources) -> list:
    """The sources among ``sources`` that are KV-cache tensors (``keys``, ``values``,
    ``cumulative_length``)."""
    return [s for s in sources if _CACHE.search(s)]


def describe_sources(sources) -> str:
    """``sources`` in a line: the KV-cache tensors grouped by kind ("keys, values, cumulative_length
    of 22 layers"), the rest by their last name; "none" for an empty list."""
    if not sources:
        return "none"
    layers: dict = {}
    others = []
    for s in sources:
        m = _CACHE.search(s)
        if m:
            layers.setdefault(m.group(2), set()).add(int(m.group(1)))
        else:
            others.append(re.sub(r"^.*\[['\"]?([A-Za-z_][\w.]*)['\"]?\]$", r"\1", s).split(".")[-1])
    parts = []
    if layers:
        kinds = [k for k in ("keys", "values", "cumulative_length") if k in layers]
        n = len(set().union(*layers.values()))
        parts.append(f"{', '.join(kinds)} of {n} cache layer{'s' if n != 1 else ''} "
                     f"({sum(len(v) for v in layers.values())} tensors)")
    parts += sorted(set(others))
    return "; ".join(parts)


def _decode_report(run) -> dict:
    """Run ``run()`` with the static-input log on and return the last compiled graph's report."""
    with torch_log_messages(cudagraph_static_inputs=True) as msgs, torch.no_grad():
        run()
    graphs = static_input_report(msgs)
    return {"graphs": len(graphs), **(graphs[-1] if graphs else {"static": [], "non_static": []})}


def _auto_compile(model, prompt) -> None:
    """transformers' auto-compile: ``generate`` with a static cache compiles the decode step itself
    (here with aot_eager, on any device); the model's generation config and compiled call are put
    back afterwards."""
    gc, saved = model.generation_config, (model.generation_config.cache_implementation,
                                          model.generation_config.compile_config)
    config = CompileConfig(backend="aot_eager")
    config._compile_all_devices = True  # transformers' own switch: compile off CUDA too
    gc.cache_implementation, gc.compile_config = "static", config
    try:
        model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=2,
                       min_new_tokens=2,
                       do_sample=False)
    finally:
        gc.cache_implementation, gc.compile_config = saved
        for attr in ("_compiled_call", "_last_compile_config"):
            vars(model).pop(attr, None)


def static_input_diagnosis(model, max_len: int = 64) -> Result:
    """Which inputs of the decode graph keep their address (``backend="aot_eager"``, live):
    transformers' forward recipe, its auto-compile and :class:`ReduceOverheadStep`."""
    dev = next(model.parameters()).device
    torch._dynamo.reset()
    try:
        # as generate makes it: empty, lazy
        cache = StaticCache(config=model.config, max_cache_len=max_len)
        forward = torch.compile(model.forward, backend="aot_eager", fullgraph=True)
        prompt = torch.tensor([[5, 6, 7, 8]], device=dev)

        def hf():
            # the prefill allocates the cache
            forward(input_ids=prompt, past_key_values=cache, use_cache=True)
            one = torch.tensor([[9]], device=dev)
            forward(input_ids=one, past_key_values=cache, use_cache=True)  # one decode token

        fixed = ReduceOverheadStep(model, max_len, backend="aot_eager")
        args = fixed.decoder.example_args(1, 4)
        reports = {"HF: forward compiled (its recipe)": _decode_report(hf)}
        torch._dynamo.reset()
        auto = _decode_report(lambda: _auto_compile(model, prompt))
        reports["HF: auto-compile (its recipe)"] = auto
        torch._dynamo.reset()
        reports["reduce-overhead, fixed"] = _decode_report(lambda: fixed.step(*args))
    finally:
        torch._dynamo.reset()
    rows = []
    for name, r in reports.items():
        mutated = cache_sources(r["non_static"])
        rows.append({"variant": name, "graphs": r["graphs"], "static_inputs": len(r["static"]),
                     "non_static_inputs": len(r["non_static"]),
                     "non_static_cache_tensors": len(mutated),
                     "non_static": describe_sources(r["non_static"]),
                     "cudagraphs": (f"skipped: mutated inputs ({len(mutated)} instances)" if mutated
                                    else "can record: every mutated input is static")})
    s = size_of(model)
    return Result("real_model_static_inputs",
                  f"LlamaForCausalLM, {s.name} shape ({s.layers} layers), on {dev.type}: the "
                  "decode graph's inputs as torch's static-input analysis sees them (backend "
                  "aot_eager)",
                  {"variant": "", "graphs": "count", "static_inputs": "count",
                   "non_static_inputs": "count",
                   "non_static_cache_tensors": "count", "non_static": "", "cudagraphs": ""}, rows,
                  params={"layers": s.layers, "max_len": max_len, "torch": torch.__version__})
