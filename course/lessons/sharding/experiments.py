"""Lesson 05's experiments and their bookkeeping (each starts its own worker processes and returns a Result).

Live everywhere (NCCL on 2+ GPUs, else gloo with CPU processes):

- ``sharding_dtensor_test`` (:func:`dtensor_experiment`): the cases of PyTorch's DTensor sharded-embedding test
  and their communication counts;
- ``sharding_cost``: ids per step and table width swept, eager time, bytes of the lookup vs bytes of the all-reduce;
- ``sharding_world_sizes``: the same lookup at world sizes 2, 4, 8 (gloo: CPU processes; NCCL: as many GPUs as the
  machine has). Both are written in lesson 05's cells (:mod:`course.core.cells`; their per-rank worker travels to
  the processes as source, :mod:`~course.lessons.sharding.cell_workers`); this module keeps their bookkeeping
  (:func:`sweep_result`).

Multi-GPU only (``gpus=2``; recorded by ``python -m course bench`` on a machine with 2+ GPUs):

- ``sharding_capture`` (:func:`capture_experiment`): both DTensor layouts and the hand-written lookup
  (``F.embedding`` and Numba) captured and replayed on 2 GPUs, eager vs replay, plus bucket agreement;
- ``sharding_capture_world_sizes`` (:func:`capture_world_sizes_experiment`): eager vs replay at every
  world size in 2, 4, 8 that the machine reaches.
"""
from __future__ import annotations

from course.core.provenance import provenance
from course.core.reference import experiment
from course.core.results import Result
from course.core.runtime import gpu_count
import course.lessons.sharding.graphs as G
import course.lessons.sharding.workers as W
from course.lessons.sharding.launch import launch, plan

WORLD_SIZES = (2, 4, 8)


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


def _capture_result(name, title, out, p, params) -> Result:
    rows = out[0]["rows"]
    cols = {"world_size": "ranks", "variant": "", "eager_us": "us", "eager_q1_us": "us", "eager_q3_us": "us",
            "replay_us": "us", "replay_q1_us": "us", "replay_q3_us": "us", "speedup": "x", "replay_correct": "",
            "ids": "ids/step", "dim": "columns", "output_bytes": "B", "allreduce_bytes": "B", "allgather_bytes": "B"}
    rows = [{k: r[k] for k in cols} for r in rows]
    res = Result(name, title, cols, rows, provenance=run_provenance(p), params={**params, "timing": G.TIMING})
    res.add_summary("all_replays_correct", all(r["replay_correct"] for r in rows))
    agreement = [a for o in out for a in o["agreement"]]
    res.add_summary("bucket_agreement_ok", all(a["correct"] for a in agreement) and bool(agreement))
    res.add_summary("bucket_agreement", agreement)
    return res


@experiment("sharding_capture", gpu_only=True, gpus=2, quick={"repeats": 5, "inner": 3})
def capture_experiment(ids_shape=(8, 16), num_embeddings: int = 32000, dim: int = 1024, repeats: int = 15,
                       inner: int = 10, timeout: float = 500.0) -> Result:
    """Both DTensor layouts and the hand-written lookup (F.embedding, Numba) captured on 2 GPUs: eager vs replay."""
    p = plan(2, "nccl")
    out = launch(G.capture_worker, 2, backend="nccl", timeout=timeout, sizes=(2,), ids_shape=tuple(ids_shape),
                 num_embeddings=num_embeddings, dim=dim, repeats=repeats, inner=inner)
    res = _capture_result("sharding_capture", "Sharded lookup on 2 GPUs: eager vs CUDA-graph replay (rank 0)", out, p,
                          {"ids_shape": tuple(ids_shape), "num_embeddings": num_embeddings, "dim": dim})
    rep = {r["variant"]: r for r in res.rows}
    res.add_summary("rowwise_replay_us", rep["dtensor_rowwise"]["replay_us"], "us")
    res.add_summary("rowwise_speedup", rep["dtensor_rowwise"]["speedup"], "x")
    res.add_summary("numba_over_torch_replay", rep["vocab_numba"]["replay_us"] / rep["vocab_torch"]["replay_us"], "x")
    return res


@experiment("sharding_capture_world_sizes", gpu_only=True, gpus=2, quick={"repeats": 5, "inner": 3})
def capture_world_sizes_experiment(sizes=WORLD_SIZES, variants=("dtensor_rowwise", "vocab_torch"), ids_shape=(8, 16),
                                   num_embeddings: int = 32000, dim: int = 1024, repeats: int = 15, inner: int = 10,
                                   timeout: float = 580.0) -> Result:
    """Eager vs replay at each world size in ``sizes`` this machine reaches (one process per GPU)."""
    n = gpu_count()
    reach = [s for s in sizes if s <= n]
    if not reach:
        raise ValueError(f"none of the world sizes {tuple(sizes)} fits this machine's {n} GPUs")
    p = plan(max(reach), "nccl")
    out = launch(G.capture_worker, p.world_size, backend="nccl", timeout=timeout, sizes=tuple(reach),
                 variants=tuple(variants), ids_shape=tuple(ids_shape), num_embeddings=num_embeddings, dim=dim,
                 repeats=repeats, inner=inner, buckets=False)
    res = _capture_result("sharding_capture_world_sizes", "Sharded lookup vs world size: eager vs replay (rank 0)",
                          out, p, {"sizes": tuple(reach), "not_reached": tuple(s for s in sizes if s not in reach),
                                   "ids_shape": tuple(ids_shape), "num_embeddings": num_embeddings, "dim": dim})
    res.summary.pop("bucket_agreement_ok")
    res.summary.pop("bucket_agreement")
    return res
