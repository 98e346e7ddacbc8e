"""Lesson 05, a sharded embedding table: the seeds' DTensor test, vocab-parallel by hand, capture on GPUs.

- :mod:`~course.lessons.sharding.launch`: start N worker processes (NCCL on 2+ GPUs, else gloo on the
  CPU), collect their results, hard time limit, errors that name the rank.
- :mod:`~course.lessons.sharding.layouts`: row-wise / column-wise DTensor embeddings (the seed's test),
  who holds which rows and columns, what each collective moves.
- :mod:`~course.lessons.sharding.vocab_parallel`: mask, local lookup (the course's Numba kernel),
  zero rows, all-reduce; the eager guard that refuses bad input on every rank.
- :mod:`~course.lessons.sharding.workers`: what each worker process runs (spawned processes import it).
- :mod:`~course.lessons.sharding.graphs`: the lookups captured in CUDA graphs on 2+ GPUs, eager vs replay.
- :mod:`~course.lessons.sharding.experiments`: the registered experiments behind notebook 05.
"""
