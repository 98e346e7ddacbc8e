"""Lesson 06 and lab 4: a real model's decode step (transformers' Llama, TinyLlama's shape),
captured.

The ideas: :mod:`.model`, :mod:`.decode` (the naive, the capturable, the graph-cached step),
:mod:`.generate` (greedy decoding, the correctness check), :mod:`.roofline`, :mod:`.gemv` and
:mod:`.projections` (the batch-1 GEMV, stacked products), :mod:`.handgraph` (the token loop by
hand),
:mod:`.reduce_fixed` (reduce-overhead made to work), :mod:`.checkpoint` and :mod:`.chat` (a trained
Llama answering). The checks: :mod:`.checks`. The recordings: :mod:`.bench` and :mod:`.hf_path`;
:mod:`.lesson` draws the notebook's figures.
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
