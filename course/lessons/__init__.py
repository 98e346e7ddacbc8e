"""One module (or small package) per lesson, named for the lesson's idea.

- 01 :mod:`~course.lessons.launch_overhead`: launch cost vs kernel time, the size sweep, the timeline.
- 02 :mod:`~course.lessons.capture_replay`: capture and replay with ``torch.cuda.CUDAGraph``.
- 02/03 :mod:`~course.lessons.reduce_overhead`: the graphs ``torch.compile(mode="reduce-overhead")`` makes.
- 03 :mod:`~course.lessons.what_breaks`: the capture-hazard finder, its zoo and its experiments.
- 04 :mod:`~course.lessons.graph_cache`: a shape-keyed graph cache for an inference engine.
- 05 :mod:`~course.lessons.sharding`: a sharded embedding table, captured over several GPUs.
- 06 :mod:`~course.lessons.real_model`: a real model's decode step (transformers' Llama), captured and fused.
- 07 :mod:`~course.lessons.last_mile`: that step as five fused Triton kernels per layer, with PDL.
"""
