"""The toolkit every lesson uses.

- :mod:`~course.core.runtime`: the one runtime decision (GPU, or the Numba CUDA simulator).
- :mod:`~course.core.timing`: warmed-up, repeated timings (CUDA events, host clock, graph replay).
- :mod:`~course.core.results` and :mod:`~course.core.provenance`: results with units and provenance.
- :mod:`~course.core.reference`: registered experiments and the reference data ``course bench``
  records.
- :mod:`~course.core.plots`: captions and plot helpers; :mod:`~course.core.checks`: exercise checks.
- :mod:`~course.core.text`: reasons for tables, shortened at a sentence's end; torch's log messages
  condensed.
- :mod:`~course.core.capture` and :mod:`~course.core.blocking`: trial captures, GPU sleeps,
  host-blocking tests.
- :mod:`~course.core.profiling`: the one launch counter (graph launches, kernel launches, GPU
  kernels per call).
- :mod:`~course.core.compiled`: torch.compile's state: its log messages, its counters, a cold start.
- :mod:`~course.core.launch` and :mod:`~course.core.cell_workers`: N worker processes (NCCL on 2+
  GPUs, else gloo CPU processes) under a hard time limit; a worker written in a notebook cell sent
  to them as source.
- :mod:`~course.core.hardware`: the GPU's memory facts, and releasing memory nothing holds;
  :mod:`~course.core.isolate`: one-off processes.
"""
