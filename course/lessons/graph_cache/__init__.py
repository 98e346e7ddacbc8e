"""Lesson 04 and lab 3, a shape-keyed CUDA-graph cache for an inference engine (after InfiniLM's
fused engine).

- :mod:`~course.lessons.graph_cache.cache`: the idea: :class:`GraphCache`: keys, capture on a miss,
  replay on a hit, buckets and padding, fallback, the statistics InfiniLM's engine reports.
- :mod:`~course.lessons.graph_cache.backends`: record and replay one key with a CUDA graph (GPU) or
  the simulator's graphs; :mod:`~course.lessons.graph_cache.buckets`: the engines' bucket presets as
  data, padding arithmetic, a decode trace; :mod:`~course.lessons.graph_cache.decoder`: a tiny
  TinyLlama-shaped decoder whose decode step the cache wraps.
- :mod:`~course.lessons.graph_cache.checks`: the checks of exercises 04.1, 04.2 and lab 3.
- :mod:`~course.lessons.graph_cache.bench`: the recordings (the FAQ's, the decode step's and the
  trace's experiments).
- :mod:`~course.lessons.graph_cache.memory_probe`: what a cleared cache leaves reserved on a GPU
  (run by hand).
"""
from course.lessons.graph_cache.backends import (CaptureFailed, CudaGraphBackend, RecordingBackend,
                                                 default_backend)
from course.lessons.graph_cache.buckets import (PRESETS, bucket_sizes, decode_trace, next_bucket,
                                                padding_report)
from course.lessons.graph_cache.cache import GraphCache, key_str

__all__ = ["CaptureFailed", "CudaGraphBackend", "GraphCache", "PRESETS", "RecordingBackend",
           "bucket_sizes", "decode_trace", "default_backend", "key_str", "next_bucket",
           "padding_report"]
