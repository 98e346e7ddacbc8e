"""Lesson 07: the last mile to the floor: a few fused Triton kernels per layer, a CUDA graph, PDL,
then one persistent kernel per token.

The idea:

- :mod:`.kernels`: the decode step as five Triton kernels per layer (PDL calls in every one), made
  of :mod:`.chunks`' matrix-vector product; :mod:`.decoder`: :class:`~.decoder.TritonDecoder`
  launches them on the model's own weights, static buffers and KV cache, the step captured;
  :mod:`.split`: split-K and split-KV, two of the last mile's options. Triton comes through
  :mod:`course.core.triton_path` (compiled on the GPU, interpreted on a laptop).
- :mod:`.persistent`: the whole step as one kernel, its stages separated by grid barriers
  (:func:`~.persistent.grid_sync`); :mod:`.persistent_decoder` launches it (resident programs
  only) with the launch shapes :mod:`.persistent_tuning` reads from the search's recording;
  :mod:`.coop` runs it on a laptop (programs as co-operating threads, reads checked against
  writes).
- :mod:`.shapes`: other Llama shapes (SmolLM2-135M's, Llama-3.2-1B's, a tiny tied one).

Its checks: :mod:`.checks` (07.1 a fused RMSNorm + GEMV, 07.2 PDL's saving predicted, 07.3 a grid
barrier placed). Its recordings: :mod:`.waterfall` ("last_mile_waterfall"), :mod:`.sweeps`
("last_mile_positions", "last_mile_shapes"), :mod:`.timeline` (the rows of the notebook's
"last_mile_timeline"), :mod:`.bench` ("last_mile_persistent_search", and a GPU probe of the
persistent step); :mod:`.lesson` draws them.
"""
