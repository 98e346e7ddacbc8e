"""The profiler's timeline of the Triton step, without and with programmatic dependent launch (PDL).

The experiment "last_mile_timeline" (its code stands in lesson 07's cell, :mod:`course.core.cells`) captures the
step of :class:`~course.lessons.last_mile.decoder.TritonDecoder` in a CUDA graph twice (``pdl=False`` and
``pdl=True``), replays each under ``torch.profiler`` (:func:`kernel_events`) and keeps, for every kernel of one
replay, its name and its start and end on the GPU (microseconds from the replay's first kernel,
:func:`timeline_rows`): numbers, so a laptop plots the same picture from reference data
(:func:`~course.lessons.last_mile.lesson.plot_timeline`). :func:`timeline_result` makes the table.

Read it with :func:`gaps`: the time from one kernel's end to the next one's start. Without PDL each
kernel starts only after the one before has ended (a gap of a fraction of a microsecond, the GPU's own
launch of the next graph node). With PDL the next kernel's programs start while the previous kernel still
runs (a negative gap: an overlap), load their first weights, and wait at ``gdc_wait()`` for it to finish;
its own duration then includes that wait, so the step's span, not the kernels' durations, is what to compare.
"""
from __future__ import annotations

import json
import os
import tempfile

from course.core.results import Result

VARIANTS = {False: "Triton", True: "Triton + PDL"}
SHORT = {"persistent_step": "persistent", "embed": "embed", "norm_qkv_rope": "qkv", "attention": "attn", "proj_residual": "proj",
         "norm_gate_up": "gate_up", "norm_lm_head": "lm_head", "proj_residual_split": "proj", "attention_split": "attn"}


def kernel_events(fn) -> list:
    """``[(name, start_us, end_us)]`` of the GPU kernels one call of ``fn`` runs, in start order (profiler)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"]
    events.sort(key=lambda e: e["ts"])
    return [(e["name"], float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events]


def gaps(rows: list) -> list:
    """Start of each kernel minus the end of the one before it (us), for rows of one variant in start order."""
    return [b["start_us"] - a["end_us"] for a, b in zip(rows, rows[1:])]


def layer_of(index: int, per_layer: int = 5) -> int:
    """The layer a kernel of the step belongs to (-1: the embedding before the layers; the last: lm_head's)."""
    return -1 if index == 0 else (index - 1) // per_layer


def timeline_rows(variant: str, events: list, last_layer: int) -> list:
    """The rows of one profiled replay: ``events`` from :func:`kernel_events`, times made relative to the first kernel.

    Each row: ``variant``, ``index`` (start order), ``layer`` (:func:`layer_of`; the last kernel, lm_head's, gets
    ``last_layer``), ``kernel`` (a short name, :data:`SHORT`), ``start_us`` and ``end_us``.
    """
    if not events:
        raise ValueError(f"{variant}: the profiler saw no kernel in the replay: was the step captured on the GPU?")
    t0 = events[0][1]
    rows = [{"variant": variant, "index": i, "layer": layer_of(i, 5), "kernel": SHORT.get(n, n),
             "start_us": s - t0, "end_us": e - t0} for i, (n, s, e) in enumerate(events)]
    rows[-1]["layer"] = last_layer  # lm_head after the last layer
    return rows


def timeline_result(rows: list, model, **params) -> Result:
    """The ``last_mile_timeline`` table from :func:`timeline_rows` of each variant, in order.

    Summary per variant: the step's span (the last kernel's end), its kernels, the mean gap between consecutive
    kernels and the idle time between them (the positive gaps). ``params`` (``size``, ``position``, ``max_len``)
    are kept with torch's version.
    """
    import torch

    from course.lessons.real_model.model import size_of

    by_variant = {}
    for r in rows:
        by_variant.setdefault(r["variant"], []).append(r)
    s = size_of(model)
    res = Result("last_mile_timeline",
                 f"LlamaForCausalLM, {s.name} shape ({s.dtype}): one replay of the captured Triton step at position "
                 f"{params.get('position')}, every kernel's start and end on the GPU (profiler), without and with PDL",
                 {"variant": "", "index": "", "layer": "", "kernel": "", "start_us": "us", "end_us": "us"}, rows,
                 params={**params, "torch": torch.__version__})
    for variant, mine in by_variant.items():
        g = gaps(mine)
        res.add_summary(f"{variant}: span", mine[-1]["end_us"], "us")
        res.add_summary(f"{variant}: kernels", len(g) + 1, "count")
        res.add_summary(f"{variant}: mean gap", sum(g) / len(g) if g else 0.0, "us")
        res.add_summary(f"{variant}: idle between kernels", sum(x for x in g if x > 0), "us")
    return res
