"""Lesson 05, a sharded embedding table: PyTorch's DTensor test, vocab-parallel by hand, capture on
GPUs, and why data-parallel ranks must replay the same graph.

- :mod:`~course.lessons.sharding.layouts`: row-wise and column-wise DTensor embeddings, who holds
  what.
- :mod:`~course.lessons.sharding.vocab_parallel`: mask, look up, zero rows, all-reduce; the guard
  that refuses bad input on every rank; the bucket every data-parallel rank agrees on.
- :mod:`~course.lessons.sharding.bench`: the recordings and what their ranks run (capture, replay,
  the sweeps).
- :mod:`~course.lessons.sharding.lesson`: the notebook's launches, sentences and plots.

Worker processes come from the launcher lessons 05 and 08 share (:mod:`course.core.launch`).
"""
from course.core.launch import Context, Plan, WorkerError, WorkerTimeout, launch, plan
from course.lessons.sharding.bench import VARIANTS, capture_graph, make_step
from course.lessons.sharding.layouts import (DTENSOR_CASES, LAYOUTS, chunk_bounds, comm_bytes,
                                             ownership, shard_embedding)
from course.lessons.sharding.lesson import (bucket_demo, capture_summary, plot_cost, plot_ownership,
                                            plot_world_sizes, recorded, run_lesson, same_step,
                                            timing_method)
from course.lessons.sharding.vocab_parallel import (agree_bucket, bucket_step, check_inputs,
                                                    local_rows, masked_lookup, pick_bucket,
                                                    shard_bounds, vocab_parallel_embedding)

__all__ = [
    "Context", "DTENSOR_CASES", "LAYOUTS", "Plan", "VARIANTS", "WorkerError", "WorkerTimeout",
    "agree_bucket", "bucket_demo", "bucket_step", "capture_graph", "capture_summary",
    "check_inputs", "chunk_bounds", "comm_bytes", "launch", "local_rows", "make_step",
    "masked_lookup", "ownership", "pick_bucket", "plan", "plot_cost", "plot_ownership",
    "plot_world_sizes", "recorded", "run_lesson", "same_step", "shard_bounds", "shard_embedding",
    "timing_method", "vocab_parallel_embedding"
]
