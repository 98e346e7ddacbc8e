"""The profiler's timeline of the Triton step, without and with programmatic dependent launch (PDL).

:func:`timeline_experiment` ("last_mile_timeline") captures the step of
:class:`~course.lessons.last_mile.decoder.TritonDecoder` in a CUDA graph twice (``pdl=False`` and
``pdl=True``), replays each under ``torch.profiler`` and keeps, for every kernel of one replay, its name
and its start and end on the GPU (microseconds from the replay's first kernel): numbers, so a laptop
plots the same picture from reference data (:func:`~course.lessons.last_mile.lesson.plot_timeline`).

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

from course.core.capture import require_gpu
from course.core.reference import experiment
from course.core.results import Result

VARIANTS = {False: "Triton", True: "Triton + PDL"}
SHORT = {"embed": "embed", "norm_qkv_rope": "qkv", "attention": "attn", "proj_residual": "proj",
         "norm_gate_up": "gate_up", "norm_lm_head": "lm_head"}


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


@experiment("last_mile_timeline", gpu_only=True, quick={"size": "tiny"})
def timeline_experiment(size: str = "tinyllama", position: int = 32, max_len: int = 256, log=print) -> Result:
    """Per-kernel start and end of one replay of the captured Triton step, without and with PDL (GPU)."""
    require_gpu("profiling the Triton step's timeline")
    import torch

    from course.core.capture import graph as capture_graph, warm_up
    from course.lessons.last_mile.decoder import TritonDecoder
    from course.lessons.real_model.decode import StaticDecoder
    from course.lessons.real_model.model import build_model, size_of

    model = build_model(size)
    args = StaticDecoder(model, max_len).example_args(1, position)
    rows, spans = [], {}
    for pdl, variant in VARIANTS.items():
        log(f"last_mile_timeline: {variant}: capturing and profiling one replay")
        dec = TritonDecoder(model, max_len, pdl=pdl)
        warm_up(lambda: dec.step(*args), 2)
        g = torch.cuda.CUDAGraph()
        with capture_graph(g):
            dec.step(*args)
        for _ in range(3):
            g.replay()
        events = kernel_events(g.replay)
        t0 = events[0][1]
        mine = [{"variant": variant, "index": i, "layer": layer_of(i, 5), "kernel": SHORT.get(n, n),
                 "start_us": s - t0, "end_us": e - t0} for i, (n, s, e) in enumerate(events)]
        mine[-1]["layer"] = dec.L  # lm_head after the last layer
        rows += mine
        spans[variant] = (mine[-1]["end_us"], gaps(mine))
        del g
    s = size_of(model)
    res = Result("last_mile_timeline",
                 f"LlamaForCausalLM, {s.name} shape ({s.dtype}): one replay of the captured Triton step at position "
                 f"{position}, every kernel's start and end on the GPU (profiler), without and with PDL",
                 {"variant": "", "index": "", "layer": "", "kernel": "", "start_us": "us", "end_us": "us"}, rows,
                 params={"size": size, "position": position, "max_len": max_len, "torch": torch.__version__})
    for variant, (span, g) in spans.items():
        res.add_summary(f"{variant}: span", span, "us")
        res.add_summary(f"{variant}: kernels", len(g) + 1, "count")
        res.add_summary(f"{variant}: mean gap", sum(g) / len(g), "us")
        res.add_summary(f"{variant}: idle between kernels", sum(x for x in g if x > 0), "us")
    return res
