"""Lesson 08's numbers: the floor per rank, one timing row per (world size, variant), and the Result.

The timing experiment itself (``tp_decode``, ``gpus=2``) is written in lesson 08's cells: its per-rank worker
measures, on every rank of each world size, the eager step and the replay of its graph with
:func:`course.core.timing.time_ranks` (aligned starts, each repeat counted as its slowest rank, as lesson 05 times
collectives), counts the all-reduces of one eager step and of one replay, and measures what the floor needs: this
GPU's copy rate and one captured all-reduce. This module keeps the arithmetic and the bookkeeping:

- :func:`layout_bytes`: bytes one batch-1 step reads per rank for a model size split over ``world`` ranks
  (the hand-sharded layout; replicated KV heads counted);
- :func:`floor_us`: weight bytes over the measured copy rate, plus the measured all-reduce latency times the count;
- :func:`timing_row`, :func:`tp_result`: the rows and the Result ``course bench`` records ("Nx <GPU>").
"""
from __future__ import annotations

from course.core.results import Result
from course.lessons.tensor_parallel.shard import head_plan, mlp_rows, predicted_all_reduces

TIMING = ("every rank times the same back-to-back calls, each repeat starting aligned on all ranks (a one-element "
          "all-reduce first); a repeat counts as its slowest rank (course.core.timing.time_ranks)")


def layout_bytes(size, world: int, rank: int = 0) -> int:
    """Bytes one batch-1 decode step reads on ``rank`` of ``world`` (hand-sharded layout): its share of q/k/v, o,
    gate/up and down, the norms, the whole LM head, one row of the embedding table."""
    from course.lessons.real_model.model import _size

    s = _size(size)
    el = 2 if s.dtype == "bfloat16" else 4
    plan = head_plan(s.heads, s.kv_heads, world, rank)
    a, b = mlp_rows(s.intermediate, world, rank)
    d = s.head_dim
    per_layer = (plan.n_q + 2 * plan.n_kv) * d * s.hidden + s.hidden * plan.n_q * d + 3 * (b - a) * s.hidden \
        + 2 * s.hidden
    return el * (s.layers * per_layer + s.hidden + s.vocab * s.hidden + s.hidden)


def floor_us(weight_bytes: float, copy_GBps: float, all_reduce_us: float, all_reduces: int) -> dict:
    """The floor of one step per rank: ``weights_us`` (bytes over the copy rate) + ``collectives_us`` (the count
    times one all-reduce's latency) = ``floor_us``."""
    if copy_GBps <= 0 or weight_bytes < 0 or all_reduce_us < 0 or all_reduces < 0:
        raise ValueError(f"need a positive copy rate and non-negative bytes, latency and count; got {copy_GBps}, "
                         f"{weight_bytes}, {all_reduce_us}, {all_reduces}")
    w = weight_bytes / (copy_GBps * 1e9) * 1e6
    c = all_reduce_us * all_reduces
    return {"weights_us": w, "collectives_us": c, "floor_us": w + c}


def timing_row(world: int, variant: str, eager, replay, eager_count: int, graph_count: int, layers: int,
               weight_bytes: int, copy_GBps: float, all_reduce_us: float, logit_diff: float) -> dict:
    """One row: eager and replay Timings (slowest rank) in us, speedup, the all-reduces counted against the
    prediction, and the floor."""
    f = floor_us(weight_bytes, copy_GBps, all_reduce_us, predicted_all_reduces(layers, world))
    return {"world_size": world, "variant": variant, "eager_us": eager.median * 1e6, "eager_q1_us": eager.q1 * 1e6,
            "eager_q3_us": eager.q3 * 1e6, "graph_us": replay.median * 1e6, "graph_q1_us": replay.q1 * 1e6,
            "graph_q3_us": replay.q3 * 1e6, "speedup": eager.median / replay.median if replay.median else 0.0,
            "all_reduces_eager": eager_count, "all_reduces_graph": graph_count,
            "all_reduces_predicted": predicted_all_reduces(layers, world), "weight_bytes": weight_bytes,
            "copy_GBps": copy_GBps, "all_reduce_us": all_reduce_us, **f, "logit_diff": logit_diff}


COLUMNS = {"world_size": "ranks", "variant": "", "eager_us": "us", "eager_q1_us": "us", "eager_q3_us": "us",
           "graph_us": "us", "graph_q1_us": "us", "graph_q3_us": "us", "speedup": "x", "all_reduces_eager": "count",
           "all_reduces_graph": "count", "all_reduces_predicted": "count", "weight_bytes": "B", "copy_GBps": "GB/s",
           "all_reduce_us": "us", "weights_us": "us", "collectives_us": "us", "floor_us": "us", "logit_diff": "fraction"}


def tp_result(rows: list, p, params: dict) -> Result:
    """``tp_decode``'s Result from rank 0's rows; provenance "Nx <GPU>" from the plan ``p``."""
    from course.lessons.sharding.experiments import run_provenance

    res = Result("tp_decode", "Batch-1 decode split over ranks: eager vs one captured graph per rank (slowest rank)",
                 COLUMNS, [{k: r[k] for k in COLUMNS} for r in rows], provenance=run_provenance(p),
                 params={**params, "timing": TIMING})
    res.add_summary("all_reduces_as_predicted",
                    all(r["all_reduces_eager"] == r["all_reduces_graph"] == r["all_reduces_predicted"]
                        for r in rows if r["variant"] != "dtensor") and bool(rows))
    return res


def scaling(res, variant: str) -> list:
    """Per world size of ``variant``: graph time, speedup over TP=1's graph, and the speedup the floor predicts."""
    rows = {r["world_size"]: r for r in res.rows if r["variant"] == variant}
    if 1 not in rows:
        return []
    one = rows[1]
    return [{"world_size": w, "graph_us": r["graph_us"], "speedup_vs_tp1": one["graph_us"] / r["graph_us"],
             "floor_speedup": one["floor_us"] / r["floor_us"], "of_floor": r["floor_us"] / r["graph_us"]}
            for w, r in sorted(rows.items())]
