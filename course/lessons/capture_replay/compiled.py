"""torch.compile(mode="reduce-overhead"): the CUDA graphs torch.compile records for you (lesson 02,
section 7; lesson 03, section 5): the model it compiles, with one capture hazard or none, and the
tables of ``compile_new_shapes`` and ``compile_skip_reasons`` (their code stands in the cells)."""
from __future__ import annotations

import torch

from course.core.compiled import compile_counters
from course.core.results import Result
from course.core.text import clip, condense
from course.core.timing import speedup


class CompileNet:
    """Factory namespace for the small model compiled in the torch.compile experiments."""

    HAZARDS = ("none", "mutates_input", "cpu_tensor", "item")

    @staticmethod
    def build(hazard: str = "none", width: int = 256, depth: int = 6):
        """An MLP of ``depth`` Linear+ReLU layers whose forward carries ``hazard`` (one of
        :attr:`HAZARDS`)."""
        if hazard not in CompileNet.HAZARDS:
            raise ValueError(f"hazard must be one of {CompileNet.HAZARDS}")

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.layers = torch.nn.ModuleList(torch.nn.Linear(width,
                                                                  width) for _ in range(depth))

            def forward(self, x):
                if hazard == "mutates_input":
                    x.clamp_(-3.0, 3.0)  # an in-place update of an input
                h = x
                for i, layer in enumerate(self.layers):
                    h = torch.relu(layer(h))
                    if hazard == "item" and i == depth // 2:
                        h = h / h.abs().max().item()  # a host read: dynamo breaks the graph here
                if hazard == "cpu_tensor":
                    return h, h.mean().cpu()  # a device-to-host copy inside the compiled graph
                return h

        return Net().cuda()


def why_slower(row: dict) -> str:
    """A one-line reason, read off the row's own measurements, for compiled being slower than eager
    (or '')."""
    if row["compiled_us"] <= row["eager_us"]:
        return ""
    if not row["graph_launches"]:
        why = "no CUDA graph replayed: the compiled kernels are launched one by one"
        if row["cudagraph_skips"]:
            why += ", and torch.compile's wrapper (guards, input checks) adds host time on top"
        return why
    if row["graph_breaks"]:
        return (f"{row['graph_breaks']} graph break(s): the model runs as several pieces with "
                "Python between them, "
                "each piece its own graph or kernels")
    return ("a graph is replayed, but the host work around it (guards, copies into static inputs) "
            "costs more here")


def _recompile_reason(message: str) -> str:
    """'recompiled: tensor 'x' size mismatch ...' from dynamo's recompile message."""
    reasons = [line.strip().lstrip("- ").split(": ", 1)[-1] for line in message.splitlines()
               if line.strip().startswith("- ")]
    return "recompiled: " + "; ".join(reasons) if reasons else "recompiled"


def compile_skip_row(hazard: str, first_s: float, counts: dict, timings: dict, msgs: list) -> dict:
    """One ``compile_skip_reasons`` row, from the cell's measurements of one hazard's model, and
    torch's compile counters read now (:func:`course.core.compiled.compile_counters`, so call it
    right after the measurements).

    ``first_s``: the first call's seconds; ``counts``: :func:`course.core.profiling.launch_counts`
    of a steady call; ``timings``: ``{"compiled": Timing, "eager": Timing}`` (interleaved);
    ``msgs``: torch's log messages meanwhile.
    """
    c, e = timings["compiled"], timings["eager"]
    k = compile_counters()
    skips = [condense(m) for m in msgs if "skipping cudagraphs" in m]
    breaks = [condense(m) for m in msgs if "graph break" in m.lower()]
    parts = sorted({condense(m, 1) for m in msgs if "graph partitions" in m})
    row = {"hazard": hazard, "first_call_s": first_s, "compiled_us": c.us,
           "compiled_q1_us": c.q1 * 1e6, "compiled_q3_us": c.q3 * 1e6, "eager_us": e.us,
           "eager_q1_us": e.q1 * 1e6, "eager_q3_us": e.q3 * 1e6,
           "graph_launches": int(counts["graph_launches"]),
           "kernel_launches": int(counts["kernel_launches"]),
           "cudagraph_skips": k["cudagraph_skips"],
           "graph_breaks": max(k["graph_breaks"], len(breaks)),
           "skip_reason": skips[0] if skips else "",
           "graph_break_reason": breaks[0] if breaks else "",
           "partitions": " | ".join(parts)}
    row["difference_is_noise"] = speedup("eager", e, "compiled", c).noise
    row["why_slower"] = "" if row["difference_is_noise"] else why_slower(row)
    return row


def compile_skip_result(rows: list, hazards, width: int, depth: int, batch: int,
                        repeats: int) -> Result:
    """The ``compile_skip_reasons`` table from its rows (:func:`compile_skip_row`), with the
    experiment's parameters and torch's version; the clean model's eager / compiled ratio when the
    ``none`` row is there."""
    res = Result("compile_skip_reasons", 'torch.compile(mode="reduce-overhead"): what a hazard '
                                         'does to cudagraphs',
                 {"hazard": "", "first_call_s": "s", "compiled_us": "us", "compiled_q1_us": "us",
                  "compiled_q3_us": "us", "eager_us": "us", "eager_q1_us": "us",
                  "eager_q3_us": "us",
                  "graph_launches": "count", "kernel_launches": "count", "cudagraph_skips": "count",
                  "graph_breaks": "count", "skip_reason": "", "graph_break_reason": "",
                  "partitions": "",
                  "difference_is_noise": "", "why_slower": ""}, rows,
                 params={"hazards": list(hazards), "width": width, "depth": depth, "batch": batch,
                         "repeats": repeats,
                         "torch": torch.__version__})
    clean = [r for r in rows if r["hazard"] == "none"]
    if clean:
        res.add_summary("clean model: eager / "
                        "compiled", clean[0]["eager_us"] / clean[0]["compiled_us"], "x")
    return res


def shape_call_row(call: int, batch: int, new_shape: bool, seconds: float, before: dict,
                   after: dict,
                   messages: list) -> dict:
    """One ``compile_new_shapes`` row: a call of the compiled model, its time, and what it compiled
    and recorded.

    ``before``/``after``: :func:`course.core.compiled.compile_counters` around the call;
    ``messages``: what torch logged during it (recompiles, cudagraphs).
    """
    log = [_recompile_reason(m) for m in messages if m.startswith("Recompiling")]
    recorded = sum("Recording function" in m for m in messages)
    compiled_now = after["unique_graphs"] - before["unique_graphs"]
    if compiled_now and not log:
        log.append("compiled")
    if recorded:
        log.append(f"recorded {recorded} CUDA graph(s)")
    return {"call": call, "batch": batch, "new_shape": new_shape, "call_ms": seconds * 1e3,
            "graphs_compiled": compiled_now, "graphs_recorded": recorded,
            "log": clip(" | ".join(condense(l, 1) for l in log), 300)}


def new_shapes_result(rows: list, batches, calls_per_shape: int, width: int) -> Result:
    """The ``compile_new_shapes`` table from :func:`shape_call_row` rows: first calls, steady state,
    totals."""
    res = Result("compile_new_shapes", 'torch.compile(mode="reduce-overhead"): calling at new '
                                       'input shapes',
                 {"call": "count", "batch": "count", "new_shape": "", "call_ms": "ms",
                  "graphs_compiled": "count",
                  "graphs_recorded": "count", "log": ""}, rows,
                 params={"batches": list(batches), "calls_per_shape": calls_per_shape,
                         "width": width,
                         "torch": torch.__version__})
    firsts = [r for r in rows if r["new_shape"]]
    steady = [r["call_ms"] for r in rows
              if not r["new_shape"] and r["call"] % calls_per_shape == calls_per_shape - 1]
    res.add_summary("first call ever (compile + warm-up)", firsts[0]["call_ms"], "ms")
    if len(firsts) > 1:
        res.add_summary("first call at the second shape", firsts[1]["call_ms"], "ms")
    if len(firsts) > 2:
        res.add_summary("first call at the third shape", firsts[2]["call_ms"], "ms")
    if steady:
        res.add_summary("a steady-state call (last at each shape, "
                        "median)", sorted(steady)[len(steady) // 2], "ms")
    res.add_summary("dynamo compiles in total", sum(r["graphs_compiled"] for r in rows), "count")
    res.add_summary("CUDA graphs recorded in "
                    "total", sum(r["graphs_recorded"] for r in rows), "count")
    res.add_summary("distinct batch sizes", len(set(batches)), "count")
    return res
