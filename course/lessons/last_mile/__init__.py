"""Lesson 07: the last mile to the floor: a few fused Triton kernels per layer, a CUDA graph, PDL.

- :mod:`~course.lessons.last_mile.kernels`: the decode step of lesson 06's Llama as five Triton kernels per
  layer (RMSNorm + q/k/v + RoPE + KV write; attention; o_proj + residual; RMSNorm + gate/up + SiLU;
  down_proj + residual), PDL calls in every one. Needs Triton (imported through
  :mod:`course.core.triton_path`: compiled on the GPU, interpreted on a laptop).
- :mod:`~course.lessons.last_mile.chunks`: the chunked matrix-vector product every stage is made of.
- :mod:`~course.lessons.last_mile.decoder`: :class:`TritonDecoder`, the step that launches them on the
  model's own weights, with static buffers and a static KV cache; its launch shapes; the step captured.
- :mod:`~course.lessons.last_mile.split`: down_proj split over its columns (split-K) and attention split over
  positions (flash-decoding), the last program of each output summing the parts: two of the last mile's options
  (:func:`~course.lessons.last_mile.decoder.config_for`; the third, packed weights, is in the kernels).
- :mod:`~course.lessons.last_mile.shapes`: other Llama shapes (SmolLM2-135M's, Llama-3.2-1B's, a tiny tied one).
- :mod:`~course.lessons.last_mile.waterfall`: the registered GPU experiment "last_mile_waterfall", eager to
  the floor in one interleaved run.
- :mod:`~course.lessons.last_mile.sweeps`: "last_mile_positions" and "last_mile_shapes", the step at positions up to
  2048 and on the other shapes, beside their floors.
- :mod:`~course.lessons.last_mile.timeline`: "last_mile_timeline", every kernel's start and end, without and
  with PDL.
- :mod:`~course.lessons.last_mile.persistent`: past the graph: the whole step as one persistent kernel, its stages
  separated by grid barriers (:func:`~course.lessons.last_mile.persistent.grid_sync`), each stage's first weights
  loaded before the barrier ahead of it; :mod:`~course.lessons.last_mile.persistent_decoder` launches it (resident
  programs only); :mod:`~course.lessons.last_mile.coop` runs it on a laptop (programs as co-operating threads under
  Triton's interpreter, reads checked against writes); :mod:`~course.lessons.last_mile.persistent_probe`: a bounded
  GPU probe of it against the five-kernel step.
- :mod:`~course.lessons.last_mile.barrier_lab`: exercise 07.3's check (two stages, one launch, one barrier).
- :mod:`~course.lessons.last_mile.lab`: the notebook's checks (a fused RMSNorm + GEMV, a prediction).
- :mod:`~course.lessons.last_mile.lesson`: the notebook's plots.
"""
