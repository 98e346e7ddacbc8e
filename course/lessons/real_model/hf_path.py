"""transformers' own compiled decode path, as the library documents it, its log kept as data.

:data:`RECIPES`: ``model.forward`` compiled with ``mode="reduce-overhead"`` ("forward"), or nothing
compiled by hand ("auto": ``generate`` compiles its call); both with a static cache. A failure is a
row that says why; the model is put back as it was.
"""
from __future__ import annotations

import statistics
import time

import torch

from course.core.capture import recover
from course.core.compiled import reset_compile, torch_log_messages
from course.core.text import clip, condense
from course.lessons.real_model.reduce_fixed import describe_sources, static_input_report

LOG_FLAGS = ("skipping cudagraphs", "cudagraph", "overwritten", "recompil", "graph break")
RECIPES = {"forward": "HF: forward compiled", "auto": "HF: auto-compile"}


def _generate(model, prompt, n: int):
    with torch.no_grad():
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n,
                              min_new_tokens=n,
                              do_sample=False)


def time_per_token(model, prompt, n_short: int, n_long: int, repeats: int) -> list:
    """``generate``'s microseconds per token, one value per repeat: a long minus a short run, over
    their difference."""
    per = []
    for _ in range(repeats):
        times = {}
        for n in (n_short, n_long):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            _generate(model, prompt, n)
            end.record()
            end.synchronize()
            times[n] = start.elapsed_time(end) * 1e3
        per.append((times[n_long] - times[n_short]) / (n_long - n_short))
    return per


def _restore(model, own_forward: bool, saved_forward, saved_impl) -> None:
    if own_forward:
        model.forward = saved_forward
    else:
        vars(model).pop("forward", None)
    # generate's own compiled call (recipe "auto")
    for attr in ("_compiled_call", "_last_compile_config"):
        vars(model).pop(attr, None)
    model.generation_config.cache_implementation = saved_impl


def hf_compiled_row(model, recipe: str = "forward", n_short: int = 8, n_long: int = 40,
                    repeats: int = 3,
                    log=print) -> dict:
    """One row for one of transformers' compiled recipes (GPU): ``us`` per token (median, q1, q3),
    ``first_call_s``, ``tokens_equal``, ``status`` ("ok" or "FAILED: ..."), ``log``."""
    if recipe not in RECIPES:
        raise KeyError(f"unknown recipe {recipe!r}; choose one of {sorted(RECIPES)}")
    if not 0 < n_short < n_long:
        raise ValueError(f"need 0 < n_short < n_long, got {n_short}, {n_long}")
    reset_compile()
    own_forward = "forward" in vars(model)  # normally not: forward is the class's method
    saved_forward, saved_impl = model.forward, model.generation_config.cache_implementation
    prompt = torch.randint(3, model.config.vocab_size, (1, 4),
                           generator=torch.Generator().manual_seed(0))
    prompt = prompt.to(next(model.parameters()).device)
    nan = float("nan")
    row = {"variant": RECIPES[recipe], "status": "ok", "us": nan, "q1_us": nan, "q3_us": nan,
           "first_call_s": nan,
           "tokens_equal": False, "log": ""}
    with torch_log_messages(cudagraphs=True, perf_hints=True, recompiles=True,
                            cudagraph_static_inputs=True) as msgs:
        try:
            log(f"real_model: {row['variant']}: uncompiled generate for the reference tokens ...")
            want = _generate(model, prompt, n_long)
            model.generation_config.cache_implementation = "static"
            if recipe == "forward":
                model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
            log(f"real_model: {row['variant']}: compiling and recording (first generate) ...")
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            # the long one first: its static cache serves the shorter ones
            got = _generate(model, prompt, n_long)
            torch.cuda.synchronize()
            row["first_call_s"] = time.perf_counter() - t0
            row["tokens_equal"] = bool(got.shape == want.shape and torch.equal(got, want))
            log(f"real_model: {row['variant']}: first generate took {row['first_call_s']:.1f} s; "
                "measuring")
            per = time_per_token(model, prompt, n_short, n_long, repeats)
            qs = statistics.quantiles(per, n=4) if len(per) >= 4 else (min(per), 0, max(per))
            row.update(us=statistics.median(per), q1_us=qs[0], q3_us=qs[-1])
        except Exception as e:  # noqa: BLE001 - the library's failure is the finding
            row["status"] = f"FAILED: {type(e).__name__}: {clip(condense(str(e), 2), 300)}"
            log(f"real_model: {row['variant']}: {clip(row['status'], 160)}")
            try:
                recover()
            except Exception:  # noqa: BLE001 - best effort: leave CUDA usable for the next rows
                pass
        finally:
            _restore(model, own_forward, saved_forward, saved_impl)
            reset_compile()
    lines = [clip(condense(m, 1), 200) for m in msgs if any(f in m.lower() for f in LOG_FLAGS)]
    # the reasons first
    lines.sort(key=lambda l: not any(k in l.lower() for k in ("skipping", "overwritten")))
    graphs = static_input_report(msgs)
    # which inputs torch did not take as static, in the last graph it compiled (the decode step)
    if graphs:
        lines.insert(1, f"inputs not static: {describe_sources(graphs[-1]['non_static'])}")
    row["log"] = clip(" | ".join(dict.fromkeys(lines)), 600)
    return row
