"""Lesson 08, tensor parallel and captured: lesson 06's model split over ranks, one CUDA graph per
rank with its all-reduces inside.

- :mod:`~course.lessons.tensor_parallel.tp`: the split, by hand (plain tensors, an explicit
  all-reduce after o_proj and down_proj) and with ``parallelize_module``.
- :mod:`~course.lessons.tensor_parallel.fused`, :mod:`~course.lessons.tensor_parallel.allreduce`:
  lesson 07's fused step on each rank's share, its all-reduces between kernels (NCCL, or symmetric
  memory's one-/two-shot).
- :mod:`~course.lessons.tensor_parallel.checks`: exercises 08.1 and 08.2's checks, on the course's
  harness (08.1's trace in :mod:`~course.lessons.tensor_parallel.watch`, its rules in
  :mod:`~course.lessons.tensor_parallel.rules`).
- :mod:`~course.lessons.tensor_parallel.bench`: the recordings (``tp_decode``, ``tp_fused_decode``):
  counting, the floor per rank, the rows.
- :mod:`~course.lessons.tensor_parallel.lesson`: the notebook's launches, prediction, sentences and
  plot.
- :mod:`~course.lessons.tensor_parallel.fused_probe`: one GPU's part of ``tp_fused_decode``, from
  the command line.
"""
from course.lessons.tensor_parallel.bench import (all_reduces, eager_collectives, floor_us,
                                                  graph_collectives, layout_bytes, scaling,
                                                  tp_result)
from course.lessons.tensor_parallel.lesson import (floor_reading, layout, plot_scaling, recorded,
                                                   run_tokens, split_tokens, timing_summary,
                                                   tokens_report)
from course.lessons.tensor_parallel.tp import (DTensorDecoder, HandShardedDecoder, head_plan,
                                               parallelize, predicted_all_reduces, tp_plan)

__all__ = ["DTensorDecoder", "HandShardedDecoder", "all_reduces", "eager_collectives",
           "floor_reading", "floor_us", "graph_collectives", "head_plan", "layout", "layout_bytes",
           "parallelize", "plot_scaling", "predicted_all_reduces", "recorded", "run_tokens",
           "scaling", "split_tokens", "timing_summary", "tokens_report", "tp_plan", "tp_result"]
