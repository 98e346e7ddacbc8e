"""Lesson 05, a sharded embedding table: PyTorch's DTensor sharded-embedding test, vocab-parallel by hand, capture
on GPUs, and why data-parallel ranks must replay the same graph.

- worker processes come from the launcher lessons 05 and 08 share, :mod:`~course.core.launch` (NCCL on 2+ GPUs,
  else gloo on the CPU; hard time limit; errors that name the rank), re-exported here; a worker written in a
  notebook cell travels to the processes as source (:mod:`~course.core.cell_workers`).
- :mod:`~course.lessons.sharding.layouts`: row-wise / column-wise DTensor embeddings (PyTorch's DTensor test),
  who holds which rows and columns, what each collective moves.
- :mod:`~course.lessons.sharding.vocab_parallel`: mask, local lookup (the course's Numba kernel),
  zero rows, all-reduce; the eager guard that refuses bad input on every rank.
- :mod:`~course.lessons.sharding.workers`: what each worker process runs (spawned processes import it).
- :mod:`~course.lessons.sharding.graphs`: the lookups captured in CUDA graphs on 2+ GPUs, eager vs replay.
- :mod:`~course.lessons.sharding.experiments`: the DTensor test's experiment, and the bookkeeping of the experiments
  written in notebook 05's cells.
"""
from course.core.launch import Context, Plan, WorkerError, WorkerTimeout, launch, plan
from course.lessons.sharding.layouts import LAYOUTS, DTENSOR_CASES, chunk_bounds, comm_bytes, ownership, shard_embedding
from course.lessons.sharding.vocab_parallel import (check_inputs, local_rows, masked_lookup, shard_bounds,
                                                    vocab_parallel_embedding)
from course.lessons.sharding.workers import agree_bucket, bucket_step, pick_bucket
from course.lessons.sharding.graphs import VARIANTS, capture_graph, make_step
from course.lessons.sharding.lesson import (bucket_demo, capture_summary, load_or_explain, plot_cost,
                                            plot_ownership, plot_world_sizes, run_lesson, same_step, timing_method)

__all__ = ["Context", "LAYOUTS", "Plan", "DTENSOR_CASES", "VARIANTS", "WorkerError", "WorkerTimeout", "agree_bucket",
           "bucket_demo", "bucket_step", "capture_graph", "capture_summary", "check_inputs", "chunk_bounds",
           "comm_bytes", "launch", "load_or_explain", "local_rows", "make_step", "masked_lookup", "ownership",
           "pick_bucket", "plan", "plot_cost", "plot_ownership", "plot_world_sizes", "run_lesson", "same_step",
           "shard_bounds", "shard_embedding", "timing_method", "vocab_parallel_embedding"]
