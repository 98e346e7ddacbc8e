"""Lesson 08, tensor parallel and captured: lesson 06's model split over 2, 4 (or 8) ranks, one CUDA graph per rank
with its all-reduces inside.

- :mod:`~course.lessons.tensor_parallel.shard`: the model split by hand (plain tensors per rank, an explicit
  ``dist.all_reduce`` after ``o_proj`` and ``down_proj``; KV heads replicated when ranks outnumber them).
- :mod:`~course.lessons.tensor_parallel.dtensor_tp`: the same split with ``parallelize_module`` (DTensor).
- :mod:`~course.lessons.tensor_parallel.count`: all-reduces per token, counted in an eager step and in a graph.
- :mod:`~course.lessons.tensor_parallel.workers`: what each rank runs (the variants, the correctness run).
- :mod:`~course.lessons.tensor_parallel.referee`, :mod:`~course.lessons.tensor_parallel.watch`,
  :mod:`~course.lessons.tensor_parallel.exercise`: exercise 08.1's check: the learner's per-rank capture watched on
  every rank (each step call, capture and replay agreed before it runs), each defect a named ✗, none able to hang.
- :mod:`~course.lessons.tensor_parallel.fused`, :mod:`~course.lessons.tensor_parallel.allreduce`: lesson 07's fused
  Triton step on each rank's share, its all-reduces between kernels (NCCL, or symmetric memory's one-/two-shot).
- :mod:`~course.lessons.tensor_parallel.fused_exercise`: exercise 08.2's check (the residual and the all-reduces
  placed; traced on every rank, each wrong placement a named ✗).
- :mod:`~course.lessons.tensor_parallel.fused_bench`, :mod:`~course.lessons.tensor_parallel.fused_lesson`,
  :mod:`~course.lessons.tensor_parallel.fused_probe`: ``tp_fused_decode``'s measurements, the notebook's helpers
  and the prediction, one GPU's partial check.
- :mod:`~course.lessons.tensor_parallel.experiments`: the floor per rank, the timing rows, the Result.
- :mod:`~course.lessons.tensor_parallel.lesson`: notebook helpers (layout, correctness launch, sentences, plot).

Worker processes start with the launcher lessons 05 and 08 share (:mod:`course.core.launch`: NCCL on 2+ GPUs, else
gloo CPU processes, every run under a hard time limit).
"""
from course.lessons.tensor_parallel.count import all_reduces, eager_collectives, graph_collectives
from course.lessons.tensor_parallel.dtensor_tp import DTensorDecoder, parallelize, tp_plan
from course.lessons.tensor_parallel.exercise import check_capture, run_capture
from course.lessons.tensor_parallel.experiments import floor_us, layout_bytes, scaling, tp_result
from course.lessons.tensor_parallel.lesson import (floor_reading, layout, plot_scaling, recorded, run_tokens,
                                                   timing_summary, tokens_report)
from course.lessons.tensor_parallel.shard import HandShardedDecoder, head_plan, predicted_all_reduces

__all__ = ["DTensorDecoder", "HandShardedDecoder", "all_reduces", "check_capture", "eager_collectives", "floor_reading",
           "floor_us",
           "graph_collectives", "head_plan", "layout", "layout_bytes", "parallelize", "plot_scaling",
           "predicted_all_reduces", "recorded", "run_capture", "run_tokens", "scaling", "timing_summary",
           "tokens_report", "tp_plan", "tp_result"]
