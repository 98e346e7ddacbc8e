"""Lesson 04, a shape-keyed CUDA-graph cache for an inference engine (after InfiniLM's fused engine), and lab 3.

- :mod:`~course.lessons.graph_cache.buckets`: bucket presets (vLLM, SGLang, TensorRT-LLM) as data, padding math,
  a decode trace of varying batch sizes.
- :mod:`~course.lessons.graph_cache.backends`: record/replay one key with a CUDA graph (GPU) or the recording
  backend (simulator).
- :mod:`~course.lessons.graph_cache.cache`: :class:`GraphCache`, the engine: keys, capture on miss, replay on hit,
  buckets and padding, fallback, the statistics InfiniLM's engine reports (``get_stats()``).
- :mod:`~course.lessons.graph_cache.decoder`: a tiny TinyLlama-shaped decoder whose decode step the cache wraps.
- :mod:`~course.lessons.graph_cache.experiments`: the request trace, each variant in a fresh process (a GPU
  experiment); :mod:`~course.lessons.graph_cache.step`: the parts of the decode-step experiment, whose code stands in
  lesson 04's cell;
  :mod:`~course.lessons.graph_cache.diagnose_step`: why one step once read two different times (run by hand).
- :mod:`~course.lessons.graph_cache.faq`: the bookkeeping of the engine's FAQ experiments (memory per pool,
  fallbacks, a timing recipe against a correct one; their code stands in lesson 04's cells) and the trace replay
  the notebook runs live.
- :mod:`~course.lessons.graph_cache.lab`: lab 3's checks, run on the learner's own key function, buffers and cache.
- :mod:`~course.lessons.graph_cache.memory_probe`: what a cleared cache leaves reserved on a GPU, and which release
  gives it back (a probe run by hand: ``python3 -m course.lessons.graph_cache.memory_probe --json probe.json``);
  its bookkeeping (rows, segments by stream and pool, named streams and blocks) in
  :mod:`~course.lessons.graph_cache.memory_ledger`.
"""
from course.lessons.graph_cache.backends import CaptureFailed, CudaGraphBackend, RecordingBackend, default_backend
from course.lessons.graph_cache.buckets import PRESETS, bucket_sizes, decode_trace, next_bucket, padding_report
from course.lessons.graph_cache.cache import GraphCache, key_str

__all__ = ["CaptureFailed", "CudaGraphBackend", "GraphCache", "PRESETS", "RecordingBackend", "bucket_sizes",
           "decode_trace", "default_backend", "key_str", "next_bucket", "padding_report"]
