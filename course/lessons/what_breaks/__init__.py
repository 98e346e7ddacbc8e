"""Lesson 03, what breaks capture: the hazard finder, its zoo, its checks and its recordings.

- :mod:`~course.lessons.what_breaks.static`: the finder's rules and its static half (reads the
  source; runs anywhere); :mod:`~course.lessons.what_breaks.dynamic`: its dynamic half (runs the
  function on a GPU).
- :mod:`~course.lessons.what_breaks.zoo`: hazards and their fixes, one small function each
  (:mod:`~course.lessons.what_breaks.numba_zoo`: Numba's);
  :mod:`~course.lessons.what_breaks.suspects`: code the learner did not write
  (03.3-03.5); :mod:`~course.lessons.what_breaks.recovery`: after each kind of failed capture, does
  the next one work?
- :mod:`~course.lessons.what_breaks.checks`: the checks of exercises 03.1 to 03.5.
- :mod:`~course.lessons.what_breaks.bench`: the recordings (their code stands in lesson 03's cells).

``from course.lessons import what_breaks as finder`` gives the finder's API below.
"""
from course.lessons.what_breaks.dynamic import (DynamicReport, HazardReport, blocking_with_line,
                                                find_dynamic, find_hazards, is_library_file,
                                                sync_debug_events, user_frame, waiting_line)
from course.lessons.what_breaks.static import RULES, Finding, Rule, find_static

__all__ = ["DynamicReport", "Finding", "HazardReport", "RULES", "Rule", "blocking_with_line",
           "find_dynamic", "find_hazards", "find_static", "is_library_file", "sync_debug_events",
           "user_frame", "waiting_line"]
