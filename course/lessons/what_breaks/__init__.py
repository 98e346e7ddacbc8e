"""Lesson 03, what breaks capture: the hazard finder, apart from its zoo and its experiments.

- :mod:`~course.lessons.what_breaks.rules`: what the finder reports, why, and the fix.
- :mod:`~course.lessons.what_breaks.static`: the static finder (reads the source; runs anywhere).
- :mod:`~course.lessons.what_breaks.dynamic`: the dynamic finder (runs the function on a GPU).
- :mod:`~course.lessons.what_breaks.zoo`: hazards and their fixes, one small function each.
- :mod:`~course.lessons.what_breaks.experiments`: the zoo under the finder, the event-test fallacy.
- :mod:`~course.lessons.what_breaks.numba_zoo`: the Numba hazards.
- :mod:`~course.lessons.what_breaks.recovery`: after each kind of failed capture, does the next one work?

``from course.lessons import what_breaks as finder`` gives the finder's API below.
"""
from course.lessons.what_breaks.dynamic import (DynamicReport, HazardReport, blocking_with_line, find_dynamic,
                                                find_hazards, is_library_file, sync_debug_events, user_frame,
                                                waiting_line)
from course.lessons.what_breaks.rules import RULES, Rule
from course.lessons.what_breaks.static import Finding, find_static

__all__ = ["DynamicReport", "Finding", "HazardReport", "RULES", "Rule", "blocking_with_line", "find_dynamic",
           "find_hazards", "find_static", "is_library_file", "sync_debug_events", "user_frame", "waiting_line"]
