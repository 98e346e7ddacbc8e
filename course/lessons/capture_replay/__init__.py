"""Lesson 02, capture and replay with CUDA graphs.

- :mod:`~course.lessons.capture_replay.replay`: the idea: the recipe, a training step captured
  whole, part of a
  model graphed, two streams forked and joined, and the models the lesson captures.
- :mod:`~course.lessons.capture_replay.checks`: the checks of exercises 02.1 to 02.8.
- :mod:`~course.lessons.capture_replay.bench`: the recordings' tables (their code stands in lesson
  02's cells)
  and the replay-launch experiment's pieces.
"""
