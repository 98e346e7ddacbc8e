"""Lesson 05's experiments and their bookkeeping (each starts its own worker processes and returns a Result).

Live everywhere (NCCL on 2+ GPUs, else gloo with CPU processes):

- ``sharding_dtensor_test`` (:func:`dtensor_experiment`): the cases of PyTorch's DTensor sharded-embedding test
  and their communication counts;
- ``sharding_cost``: ids per step and table width swept, eager time, bytes of the lookup vs bytes of the all-reduce;
- ``sharding_world_sizes``: the same lookup at world sizes 2, 4, 8 (gloo: CPU processes; NCCL: as many GPUs as the
  machine has). Both are written in lesson 05's cells (:mod:`course.core.cells`; their per-rank worker travels to
  the processes as source, :mod:`~course.core.cell_workers`); this module keeps their bookkeeping
  (:func:`sweep_result`).

Multi-GPU only (``gpus=2``; recorded by ``python -m course bench`` on a machine with 2+ GPUs):

- ``sharding_capture``: both DTensor layouts and the hand-written lookup (``F.embedding`` and Numba) captured and
  replayed on 2 GPUs, eager vs replay, plus bucket agreement;
- ``sharding_capture_world_sizes``: eager vs replay at every world size in 2, 4, 8 that the machine reaches.
  Both are written in lesson 05's cells, with their per-rank capture worker; bookkeeping: :func:`capture_result`.
"""
from __future__ import annotations

from course.core.provenance import provenance
from course.core.reference import experiment
from course.core.results import Result
import course.lessons.sharding.graphs as G
import course.lessons.sharding.workers as W
from course.core.launch import launch, plan

def run_provenance(p) -> dict:
    """Provenance for a multi-process run: "2x <GPU>" for NCCL, "N CPU processes (gloo) on <CPU>" for gloo."""
    prov = provenance(gpus=p.gpus)
    if p.backend == "gloo":
        prov["device"] = f"{p.world_size} CPU processes (gloo) on {prov['cpu']}"
        prov["driver"] = None
    return prov


def _checks(case: dict) -> dict:
    return {k: v for k, v in case.items() if k != "local_weight_shape"}


def dtensor_result(per_rank: list, p) -> Result:
    """The DTensor test's cases as a Result, from every rank's ``dtensor_worker`` output (the ranks must agree)."""
    first = per_rank[0]
    if any(list(map(_checks, o["cases"])) != list(map(_checks, first["cases"])) for o in per_rank):
        raise AssertionError("the ranks disagree on the DTensor test's checks: " + repr([o["cases"] for o in per_rank]))
    rows = []
    for i, c in enumerate(first["cases"]):
        shards = " | ".join("x".join(map(str, o["cases"][i]["local_weight_shape"])) for o in per_rank)
        rows.append({"case": i, "layout": c["layout"], "ids": "x".join(map(str, c["input_size"])),
                     "table": f"{c['num_embeddings']}x{c['embedding_dim']}",
                     "kwargs": ",".join(f"{k}={v}" for k, v in c["kwargs"].items()) or "-",
                     "forward_ok": c["forward_equal"], "grad_ok": c["grad_equal"],
                     "F.embedding_ok": c["functional_equal"], "fwd_comms": c["forward_comms"],
                     "bwd_comms": c["backward_comms"], "output": c["output_placement"],
                     "full_tensor": " ".join(f"{k}x{v}" for k, v in c["full_tensor_comms"].items()),
                     "shard_per_rank": shards})
    cols = {"case": "", "layout": "", "ids": "", "table": "rows x cols", "kwargs": "", "forward_ok": "",
            "grad_ok": "", "F.embedding_ok": "", "fwd_comms": "count", "bwd_comms": "count", "output": "",
            "full_tensor": "collective x count", "shard_per_rank": "rows x cols"}
    res = Result("sharding_dtensor_test",
                 f"PyTorch's DTensor sharded-embedding test, {p.backend} with {p.world_size} processes",
                 cols, rows, provenance=run_provenance(p), params={"backend": p.backend, "world_size": p.world_size})
    res.add_summary("cases_all_equal", all(r["forward_ok"] and r["grad_ok"] and r["F.embedding_ok"] for r in rows))
    res.add_summary("max_norm_error", first["max_norm_error"] or "")
    return res


@experiment("sharding_dtensor_test", gpu_only=False)
def dtensor_experiment(world_size: int | None = None, timeout: float = 120.0) -> Result:
    """PyTorch's DTensor test, live: every case on every rank; rank 0's view (all ranks must agree)."""
    p = plan(world_size)
    return dtensor_result(launch(W.dtensor_worker, p.world_size, backend=p.backend, timeout=timeout), p)


def sweep_result(name: str, title: str, rows: list, p, params: dict) -> Result:
    """A lookup sweep's Result (``sharding_cost``, ``sharding_world_sizes``): rank 0's rows from the cell's worker,
    provenance from the plan ``p`` (:func:`run_provenance`), the timing method and ``params`` in its params."""
    cols = {"world_size": "ranks", "ids": "ids/step", "dim": "columns", "eager_us": "us", "eager_q1_us": "us",
            "eager_q3_us": "us", "correct": "", "output_bytes": "B", "rowwise_lookup_bytes": "B",
            "colwise_lookup_bytes": "B", "allreduce_bytes": "B", "allgather_bytes": "B"}
    res = Result(name, title, cols, rows, provenance=run_provenance(p),
                 params={"backend": p.backend, "processes": p.world_size, "timing": G.TIMING, **params})
    res.add_summary("all_correct", all(r["correct"] for r in rows))
    return res


def capture_result(name: str, title: str, out: list, p, params: dict, buckets: bool = True) -> Result:
    """A capture experiment's Result from every rank's worker output (rank 0's rows; the bucket agreement of every
    rank when ``buckets``). ``sharding_capture`` (2 GPUs, every variant) also gets the row-wise replay time and
    speedup and the Numba-over-F.embedding replay ratio in its summary."""
    rows = out[0]["rows"]
    cols = {"world_size": "ranks", "variant": "", "eager_us": "us", "eager_q1_us": "us", "eager_q3_us": "us",
            "replay_us": "us", "replay_q1_us": "us", "replay_q3_us": "us", "speedup": "x", "replay_correct": "",
            "ids": "ids/step", "dim": "columns", "output_bytes": "B", "allreduce_bytes": "B", "allgather_bytes": "B"}
    rows = [{k: r[k] for k in cols} for r in rows]
    res = Result(name, title, cols, rows, provenance=run_provenance(p), params={**params, "timing": G.TIMING})
    res.add_summary("all_replays_correct", all(r["replay_correct"] for r in rows))
    if buckets:
        agreement = [a for o in out for a in o["agreement"]]
        res.add_summary("bucket_agreement_ok", all(a["correct"] for a in agreement) and bool(agreement))
        res.add_summary("bucket_agreement", agreement)
    rep = {r["variant"]: r for r in res.rows}
    if name == "sharding_capture":
        res.add_summary("rowwise_replay_us", rep["dtensor_rowwise"]["replay_us"], "us")
        res.add_summary("rowwise_speedup", rep["dtensor_rowwise"]["speedup"], "x")
        res.add_summary("numba_over_torch_replay",
                        rep["vocab_numba"]["replay_us"] / rep["vocab_torch"]["replay_us"], "x")
    return res
