"""One module (or small package) per lesson, named for the lesson's idea.

- 01 :mod:`~course.lessons.launch_overhead`: launch cost vs kernel time, the size sweep, the timeline.
- 02 :mod:`~course.lessons.capture_replay`: capture and replay with ``torch.cuda.CUDAGraph``, the
  graphs ``torch.compile(mode="reduce-overhead")`` makes (each lesson package: its idea module,
  ``checks`` and ``bench``).
- 03 :mod:`~course.lessons.what_breaks`: the capture-hazard finder, its zoo and its experiments.
- 04 and lab 3 :mod:`~course.lessons.graph_cache`: a shape-keyed graph cache for an inference engine.
- 05 :mod:`~course.lessons.sharding`: a sharded embedding table, captured over several GPUs.
- 06 and lab 4 :mod:`~course.lessons.real_model`: transformers' Llama in TinyLlama's shape, its decode step captured,
  the roofline under it.
- 07 :mod:`~course.lessons.last_mile`: that step as five fused Triton kernels per layer, with PDL.

Which of these modules register the experiments each notebook shows is listed in the course map,
:mod:`course.tools.catalog`.
"""
