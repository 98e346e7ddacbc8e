"""An exercise's answer: shown only when the learner asks for it, never when the teacher turned them
off.

``exercise(name, hint=[...], answer="...")`` keeps the answer apart from the staged hints; after the
last stage the hint says how to ask: ``course.show_answer("02.3")`` in the notebook (after the check
ran), or ``python -m course check --show-answer 02.3 NOTEBOOK`` (``COURSE_SHOW_ANSWER``, a JSON
list). ``COURSE_ANSWERS=off`` turns answers off (INSTRUCTOR.md).
"""
from __future__ import annotations

import json
import os

# JSON list of exercise names whose answer `course check --show-answer` asked for
ENV_SHOW = "COURSE_SHOW_ANSWER"
ENV_ANSWERS = "COURSE_ANSWERS"  # "off": the teacher turned answers off
_KNOWN: dict = {}  # exercise name -> its answer, remembered when its check runs in this session


def answers_off() -> bool:
    """True when the teacher turned answers off (``COURSE_ANSWERS`` is off, no, false or 0)."""
    return os.environ.get(ENV_ANSWERS, "").strip().lower() in ("off", "no", "false", "0")


def remember(name: str, answer: str) -> None:
    """Keep the answer of exercise ``name`` for :func:`show_answer` (its check is running)."""
    if answer:
        _KNOWN[name] = answer


def forget() -> None:
    """Forget every answer remembered in this session (with :func:`course.core.checks.reset`)."""
    _KNOWN.clear()


def requested(name: str) -> bool:
    """True when this run was asked to show the answer of ``name`` (``COURSE_SHOW_ANSWER``) and
    answers are on."""
    try:
        names = json.loads(os.environ.get(ENV_SHOW) or "[]")
    except ValueError:  # a bad value must never break the learner's notebook
        return False
    return not answers_off() and isinstance(names, list) and name in names


def match(query: str, names) -> list:
    """The exercise names ``query`` means: the one it equals, else every one that starts with it."""
    names = list(dict.fromkeys(names))
    query = str(query).strip()
    if query in names:
        return [query]
    return [n for n in names if query and n.startswith(query)]


def offer(name: str) -> str:
    """What the last hint stage adds: how to ask for the answer ("" when there is none to offer)."""
    if answers_off() or name not in _KNOWN:
        return ""
    return (" (that was the last hint. The answer, only if you want it: "
            f"course.show_answer({name!r}) in the notebook, or python -m "
            f"course check --show-answer {json.dumps(name)} NOTEBOOK)")


def show_answer(query: str) -> str | None:
    """Print and return the answer of the exercise ``query`` names (its name or the start of it).

    It must have been checked in this session (run its check cell first). Prints why instead, and
    returns None, when answers are off, no checked exercise has that name, or the name is ambiguous.
    """
    if answers_off():
        print("Answers are turned off for this course "
              "(COURSE_ANSWERS=off): the hints are all there is.")
        return None
    found = match(query, _KNOWN)
    if len(found) != 1:
        known = sorted(_KNOWN) or ["(none yet: run an exercise's check cell first)"]
        print(f"show_answer({query!r}): {'more than one' if found else 'no'} checked exercise "
              f"with an answer is called that; choose one of: {', '.join(found or known)}")
        return None
    print(f"answer to {found[0]}: {_KNOWN[found[0]]}")
    return _KNOWN[found[0]]
