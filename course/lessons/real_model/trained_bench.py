"""The bookkeeping of lesson 06's ``trained_model_decode`` experiment (its code stands in the lesson's cell).

A trained Llama (``COURSE_MODEL``, default SmolLM2-135M-Instruct, in bfloat16) at batch 1, every way of running
its decode step: transformers' eager ``generate`` (dynamic cache, what a first script calls), the course's eager
step, graph-cached, the token loop captured by hand (:class:`~course.lessons.real_model.handgraph.GraphedDecode`),
fused and fused + GEMV, against the weight-read floor.

- :func:`build_steps`: every variant built and called once (compile and capture), a failure kept as a row;
- :func:`kernel_counts`: kernels per token of each step (the profiler, after all timing);
- :func:`generate_us`: transformers' eager ``generate`` per token (a long minus a short one: prefill cancels);
- :func:`trained_result`: the table, the floor and the ratios against eager ``generate``.
"""
from __future__ import annotations

import statistics

from course.core.results import Result
from course.core.timing import speedup
from course.lessons.real_model.experiments import FAST, _builders, _mode, _reason, _transformers_version, first_call
from course.lessons.real_model.handgraph import GraphedDecode
from course.lessons.real_model.decode import StaticDecoder

NAN = float("nan")
GENERATE = "transformers generate (eager)"
HAND = "hand-captured loop"


def build_steps(model, max_len: int, args, log=print) -> tuple:
    """``({name: step}, {name: row})``: eager, graph-cached, the hand-captured loop, fused, fused + GEMV, each called
    once on ``args`` (its first-call time kept); a variant that raises is a row whose status says why."""
    builders = _builders(model, max_len, autotune=False)
    builders = {"eager": builders.pop("eager"), "graph-cached": builders.pop("graph-cached"),
                HAND: lambda: GraphedDecode(StaticDecoder(model, max_len)).step, **builders}
    steps, rows = {}, {}
    for name, build in builders.items():
        log(f"trained_model_decode: {name}: building, first call (compile and capture for the fast ones) ...")
        try:
            fn = build()
            s, _ = first_call(fn, args)
            steps[name] = fn
            rows[name] = {"variant": name, "status": "ok", "mode": _mode(fn), "first_call_s": s}
            log(f"trained_model_decode: {name}: first call {s:.1f} s")
        except Exception as e:  # noqa: BLE001 - a variant that breaks is a finding, not a lost run
            rows[name] = {"variant": name, "status": _reason(e), "mode": "", "first_call_s": NAN}
            log(f"trained_model_decode: {name}: {rows[name]['status']}")
    return steps, rows


def kernel_counts(steps: dict, args) -> dict:
    """``{name: GPU kernels per call}`` of each step on ``args`` (profiler); a step the profiler fails on is left out."""
    from course.core.profiling import launch_counts

    out = {}
    for name, fn in steps.items():
        try:
            out[name] = launch_counts(lambda fn=fn: fn(*args), calls=3)["gpu_kernels"]
        except Exception:  # noqa: BLE001 - the kernel count is a bonus, never a lost row
            pass
    return out


def generate_us(model, prompt_len: int, repeats: int, n_short: int = 8, n_long: int = 40) -> list:
    """transformers' eager greedy ``generate`` (dynamic cache), microseconds per token, one value per repeat."""
    import torch

    from course.lessons.real_model.hf_path import _time_per_token

    prompt = torch.randint(3, model.config.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    return _time_per_token(model, prompt.to(model.device), n_short, n_long, repeats)


def trained_result(trained, rows: dict, timings: dict, gen_us: list, kernels: dict, check, floor: float,
                   bandwidth_GBps: float, **params) -> Result:
    """The ``trained_model_decode`` table: one row per variant (generate, the steps, the floor), its summary."""
    import torch

    c = trained.model.config
    out = []
    if gen_us:
        qs = statistics.quantiles(gen_us, n=4) if len(gen_us) >= 4 else (min(gen_us), 0, max(gen_us))
        out.append({"variant": GENERATE, "status": "ok", "mode": "dynamic cache", "first_call_s": NAN,
                    "us": statistics.median(gen_us), "q1_us": qs[0], "q3_us": qs[-1], "kernels_per_token": NAN,
                    "tokens_equal": "n/a", "max_logit_diff": NAN})
    checked = {r["variant"]: r for r in check.rows} if check is not None else {}
    for name, row in rows.items():
        tm, ck = timings.get(name), checked.get(name, {})
        out.append({**row, "us": tm.us if tm else NAN, "q1_us": tm.q1 * 1e6 if tm else NAN,
                    "q3_us": tm.q3 * 1e6 if tm else NAN, "kernels_per_token": kernels.get(name, NAN),
                    "tokens_equal": ck.get("tokens_equal", name == "eager"),
                    "max_logit_diff": ck.get("max_logit_diff", 0.0 if name == "eager" else NAN)})
    out.append({"variant": "floor", "status": "computed", "mode": "", "first_call_s": 0.0, "us": floor, "q1_us": floor,
                "q3_us": floor, "kernels_per_token": NAN, "tokens_equal": "n/a", "max_logit_diff": NAN})
    res = Result("trained_model_decode",
                 f"{trained.name} ({type(trained.model).__name__}, {c.num_hidden_layers} layers, hidden "
                 f"{c.hidden_size}, {str(trained.model.dtype).replace('torch.', '')}), trained weights, batch 1 at "
                 f"position {params.get('position')}: time per token (CUDA events)",
                 {"variant": "", "status": "", "mode": "", "us": "us", "q1_us": "us", "q3_us": "us",
                  "kernels_per_token": "count", "first_call_s": "s", "tokens_equal": "", "max_logit_diff": "fraction"},
                 out, params={**params, "model": trained.name, "torch": torch.__version__,
                              "transformers": _transformers_version()})
    res.add_summary("copy_bandwidth_GBps", bandwidth_GBps, "GB/s")
    res.add_summary("floor_us", floor, "us")
    gen = statistics.median(gen_us) if gen_us else None
    for name in (HAND, "graph-cached", "fused", FAST):
        if gen and name in timings:
            res.add_summary(f"generate / {name}", gen / timings[name].us, "x")
    if "eager" in timings and HAND in timings:
        res.add_summary("eager vs hand-captured", str(speedup("eager", timings["eager"], HAND, timings[HAND])), "")
    return res
