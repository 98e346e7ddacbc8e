"""The course's one check harness: trace the learner's calls, judge the trace by named rules, one outcome.

A check (1) runs the learner's code with a :class:`Tracer` watching the calls that matter (where each ran: inside
a capture, on a side stream, on the default stream; the collector's state; which stream waited for which),
(2) judges the trace by a list of :class:`Rule` (a name, the ✗'s title, what it looks for) and (3) ends in one
:class:`Outcome`. A broken rule is raised as a :class:`Defect` inside ``exercise(...)``, which prints its ✗;
ranks agree on one outcome through :func:`agree`. No message is ever parsed: the rule's name travels with it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
from typing import Callable

from course.core.capture import collector_paused, reset_rng_capture_state
from course.core.checks import CRASH, FAIL, PASS, SKIP, TODO
from course.core.runtime import graphs
from course.core.stream_order import StreamOrder

SIDE_RECIPE = ("s = cg.Stream(); s.wait_stream(cg.current_stream()); with cg.stream(s): ...; "
               "cg.current_stream().wait_stream(s)")
LAZY = "Lazy set-up (cuBLAS handles, first-use allocations)"
HOST_READ = ("a host read or a wait inside the capture (.item(), int(), .tolist(), print of a tensor, a "
             "synchronize): the capture records GPU work and cannot stop to hand a value to Python, so CUDA "
             "refuses it (\"operation not permitted when stream is capturing\"). Keep values on the device "
             "(argmax(-1, keepdim=True)) and read them only after the replays")
HOST_COPY = ("a copy between host and device inside the capture (torch.tensor(...), .cpu(), .to() of a host "
             "tensor, a Python number copied into a tensor): make every buffer before the capture, on the "
             "device, and change it with copy_(), fill_() or add_() of device values")
_READ_KEYS = ("operation not permitted when stream is capturing", "previous error during capture")
_COPY_KEYS = ("Cannot copy between CPU and CUDA",)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One check's result: ``status`` (pass, fail, todo, crash, skip), the ``rule`` that decided it, its ``message``
    and ``detail`` (data for tests and for the ranks' agreement)."""

    status: str
    rule: str = ""
    message: str = ""
    detail: dict = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True for a pass or a skip."""
        return self.status in (PASS, SKIP)

    def raise_(self) -> None:
        """Raise what ``exercise`` turns back into this outcome; nothing for a pass or a skip."""
        if self.status == TODO:
            raise NotImplementedError(self.message)
        if self.status in (FAIL, CRASH):
            raise Defect(self.rule, self.message, **self.detail)


class Defect(AssertionError):
    """A broken rule inside ``exercise(...)``: its ✗ is the message, and ``rule`` names the rule."""

    def __init__(self, rule: str, message: str, **detail):
        super().__init__(message)
        self.rule, self.detail = rule, detail


@dataclasses.dataclass(frozen=True)
class Rule:
    """A named rule: ``test(trace)`` returns why it is broken ('' or None when kept); the ✗ is ``title: why``."""

    name: str
    title: str
    test: Callable


def expect(name: str, ok: Callable, message) -> Rule:
    """A rule kept while ``ok(trace)`` is true; its ✗ is ``message`` (a string, or ``f(trace)``)."""
    return Rule(name, "", lambda t: "" if ok(t) else (message(t) if callable(message) else message))


def judge(trace, rules) -> Outcome:
    """The first broken rule of ``rules`` on ``trace`` as a failed :class:`Outcome`, else a pass."""
    for rule in rules:
        why = rule.test(trace)
        if why:
            return Outcome(FAIL, rule.name, f"{rule.title}: {why}" if rule.title else why)
    return Outcome(PASS)


def check(trace, rules) -> None:
    """Raise the :class:`Defect` of the first broken rule (:func:`judge`), if any."""
    judge(trace, rules).raise_()


def outcome_of(fn, *args, **kwargs) -> tuple:
    """``(Outcome, result)`` of calling ``fn``: a :class:`Defect` or AssertionError fails, NotImplementedError is
    "not done yet", any other error a crash (type, first line)."""
    try:
        result = fn(*args, **kwargs)
    except NotImplementedError as e:
        return Outcome(TODO, "not_done", str(e)), None
    except Defect as e:
        return Outcome(FAIL, e.rule, str(e), e.detail), None
    except AssertionError as e:
        return Outcome(FAIL, "", str(e)), None
    except Exception as e:  # noqa: BLE001 - the learner's error becomes a named outcome
        return Outcome(CRASH, capture_error(e)[0] or "crash", first_line(e)), None
    return Outcome(PASS), result


def agree(outcome: Outcome, group=None, timeout_s: float = 20.0, what: str = "the check") -> Outcome:
    """The ranks' one outcome: every rank's exchanged (:func:`course.core.agree.exchange`); the first that is not
    a pass, in rank order, naming its rank(s), is every rank's."""
    from course.core.agree import exchange

    every = exchange(outcome, group=group, timeout_s=timeout_s, what=what)
    bad = [(r, o) for r, o in enumerate(every) if not o.ok]
    if not bad:
        return every[0]
    first = bad[0][1]
    ranks = [r for r, o in bad if (o.rule, o.message) == (first.rule, first.message)]
    who = "every rank" if len(ranks) == len(every) else f"rank(s) {ranks}"
    return dataclasses.replace(first, detail={**first.detail, "ranks": ranks, "who": who})


# ---------------------------------------------------------------- errors
def root_cause(error: BaseException) -> BaseException:
    """The first error of a chain: the one raised while capturing, not the one ending the capture after it."""
    while error.__context__ is not None and error.__context__ is not error:
        error = error.__context__
    return error


def first_line(error: BaseException) -> str:
    """``Type: first line of the message``."""
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"


def capture_error(error: BaseException) -> tuple:
    """``(rule, message)`` for an error a capture raised because of a host read or a host copy, else ``("", "")``."""
    chain, e = [], error
    while e is not None and len(chain) < 6:
        chain.append(str(e))
        e = e.__context__
    text = " | ".join(chain)
    if any(k in text for k in _COPY_KEYS):
        return "host_copy", HOST_COPY
    if any(k in text for k in _READ_KEYS):
        return "host_read", HOST_READ
    return "", ""


# ---------------------------------------------------------------- the tracer
def where(cg) -> str:
    """Where a call runs now: "capture", "side" (a side stream) or "default" (the default stream)."""
    if cg.is_current_stream_capturing():
        return "capture"
    return "default" if cg.current_stream() == cg.default_stream() else "side"


class Tracer:
    """The learner's watched calls, in order, and the streams' order, until :meth:`close` (or the ``with``'s end).

    Each :meth:`note` is an event ``{"what", "where", "gc", ...}``; :meth:`wrap` and :meth:`hook` note every call
    of a function or a module's forward."""

    def __init__(self, cg=None, streams: bool = True):
        from course.core.runtime import graphs

        self.cg = cg if cg is not None else graphs()
        self.events: list = []
        self.order = StreamOrder(self.cg) if streams else None
        self._handles: list = []

    def note(self, what: str = "call", **data) -> dict:
        """Record one call of ``what`` now (where it runs, the collector's state, ``data``)."""
        here = where(self.cg)
        if self.order is not None:
            self.order.work(here == "capture")
        event = {"what": what, "where": here, "gc": gc.isenabled(), **data}
        self.events.append(event)
        return event

    def wrap(self, fn, what: str | None = None):
        """``fn``, each call noted first; the call inside a capture keeps its arguments and output."""
        name = what or getattr(fn, "__name__", "fn")

        def watched(*args, **kwargs):
            event = self.note(name)
            out = fn(*args, **kwargs)
            if event["where"] == "capture":
                event.update(args=args, output=out)
            return out

        watched.__name__ = name
        return watched

    def hook(self, module, what="forward", **read) -> None:
        """Note every forward of ``module``; ``read`` maps a field to ``f(args, kwargs)`` kept with
        it; ``what`` is the calls' name, or ``what(args, kwargs)`` names each one."""
        def pre(mod, args, kwargs):
            name = what(args, kwargs) if callable(what) else what
            self.note(name, **{k: f(args, kwargs) for k, f in read.items()})

        self._handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))

    def of(self, what: str | None = None) -> list:
        """The events of ``what`` (all when None)."""
        return [e for e in self.events if what is None or e["what"] == what]

    def captured(self, what: str | None = None) -> bool:
        """True once a call of ``what`` ran inside a capture."""
        return any(e["where"] == "capture" for e in self.of(what))

    def close(self) -> None:
        """Stop watching: hooks removed, the streams' patches put back (the verdicts stay)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self.order is not None:
            self.order.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------- the capture rules every lesson shares
def warmup_problem(before, what: str, lazy: str = LAZY) -> str:
    """Why the warm-up breaks torch's rule ('' when it keeps it): ``before`` lists where each call of ``what`` (as
    the learner calls it: "one_token()") ran before the capture."""
    before = list(before)
    if "side" in before:
        return ""
    what_ran = "the warm-up ran on the default stream" if before else "no warm-up ran"
    return (f"{what_ran} before the capture: run {what} once or twice on a side stream first ({SIDE_RECIPE}). "
            f"{lazy} must not happen inside a capture, and torch's rule is a side stream")


def _before_capture(tracer: Tracer, what) -> list:
    events = tracer.of(what)
    first = next((i for i, e in enumerate(events) if e["where"] == "capture"), len(events))
    return [e["where"] for e in events[:first]]


def capture_rules(what: str, call: str, lazy: str = LAZY) -> list:
    """The rules of every capture of the watched ``what`` (called as ``call``): it ran inside a capture, after a
    warm-up on a side stream, forked and joined, with the collector paused."""
    return [
        Rule("not_captured", "", lambda t: "" if t.captured(what) else (
            f"{call} never ran inside a capture: call it inside `with cg.graph(g):` (cg = course.graphs())")),
        Rule("warm_up", "", lambda t: warmup_problem(_before_capture(t, what), call, lazy)),
        Rule("stream_order", "", lambda t: t.order.problem if t.order is not None else ""),
        Rule("collector", "", lambda t: "" if not any(e["gc"] for e in t.of(what) if e["where"] == "capture") else (
            "the garbage collector was on during your capture: a graph it frees in the middle of a capture breaks "
            "that capture (lesson 03, 'A graph freed during another capture'). Capture inside collector_paused()")),
    ]


@contextlib.contextmanager
def restored():
    """However the learner's capture ends, the notebook goes on: the current stream put back, no
    simulated capture left under way, a GPU's random generators out of capture mode; garbage
    collected first and the collector off meanwhile (a graph freed inside a capture breaks it)."""
    gc.collect()
    cg = graphs()
    before = cg.current_stream()
    try:
        with collector_paused():
            yield
    except BaseException:
        if getattr(cg, "SIMULATED", False):
            from course.sim.graph import end_all_captures  # the simulator's, on its path only

            end_all_captures()
        else:
            with contextlib.suppress(RuntimeError):
                cg.synchronize()
            reset_rng_capture_state()
        raise
    finally:
        cg.set_stream(before)
