"""Lesson 02, capture and replay with CUDA graphs.

- :mod:`~course.lessons.capture_replay.replay`: the idea: the recipe, a training step captured
  whole, part of a model graphed, two streams forked and joined.
- :mod:`~course.lessons.capture_replay.checks`: exercises 02.1-02.5;
  :mod:`~course.lessons.capture_replay.capture_checks`: 02.6-02.8 (the learner's captures).
- :mod:`~course.lessons.capture_replay.bench`: the recordings' tables (their code stands in the
  cells); :mod:`~course.lessons.capture_replay.driver`: the replay-launch experiment's pieces;
  :mod:`~course.lessons.capture_replay.compiled`: torch.compile's model and tables.
"""
