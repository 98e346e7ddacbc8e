"""Lesson 01, launch overhead: the host's cost to issue a kernel against the GPU's time to run it.

- :mod:`~course.lessons.launch_overhead.launch`: the idea: time one op in a graph replay, sweep
  sizes in turns, find the crossover.
- :mod:`~course.lessons.launch_overhead.checks`: exercise 01's check.
- :mod:`~course.lessons.launch_overhead.bench`: the recordings' bookkeeping (``launch_costs``,
  ``launch_sweep``, ``launch_timeline``, ``cpu_dispatch``; their code stands in lesson 01's cells).
"""
