"""Exercises 08.1 and 08.2's checks on the harness: the learner's calls traced on every rank, judged by rules.

08.1 (``tp_generate``) runs twice on every rank. First on a step without collectives (this rank's whole model),
so no rank can wait for one that never comes: its calls are traced, the ranks exchange their traces
(:func:`course.core.agree.exchange`) and judge them in lockstep, event k of every rank together; the first rule
broken is every rank's ✗. Then, once they agree, on the split step with its all-reduces, against TP=1.
08.2 (``split_layer``) is traced for every rank of 2 and 4 ranks in each process (nothing computed) and judged;
then the split fused step decodes a few tokens on every rank. :func:`check` launches either.
"""
from __future__ import annotations

import contextlib
import gc
import sys
import traceback
import warnings
from functools import partial

import torch

from course.core.agree import exchange
from course.core.capture import recover
from course.core.cell_workers import portable
from course.core.checks import CRASH, FAIL, PASS, TODO
from course.core.harness import Outcome, Rule, Tracer, agree, capture_error, first_line, judge, warmup_problem
from course.core.launch import WorkerError, WorkerTimeout, launch, plan
from course.core.runtime import graphs, runtime, synchronize
from course.lessons.last_mile.decoder import TritonDecoder, graphed
from course.lessons.real_model.generate import greedy
from course.lessons.real_model.model import build_model
from course.lessons.tensor_parallel.fused import FusedShardDecoder
from course.lessons.tensor_parallel.tp import HandShardedDecoder, first_token

EXCHANGE_S = 60.0  # a rank that does not bring its trace within this stops the others
STEP = "step(ids, position)"
LAZY = "Lazy set-up (NCCL's communicator and buffers, cuBLAS handles, first-use allocations)"


# ---------------------------------------------------------------- the launch, one outcome per function
def on_ranks(worker, fns, world_size: int = 2, timeout: float = 240.0, **kwargs) -> list:
    """Rank 0's :class:`Outcome` of ``worker`` (a check run on every rank) for each of ``fns``."""
    p = plan(world_size)
    try:
        return launch(worker, p.world_size, backend=p.backend, timeout=timeout, pg_timeout=3 * EXCHANGE_S,
                      fns=[portable(f) for f in fns], **kwargs)[0]
    except WorkerTimeout as e:
        lost = Outcome(FAIL, "timeout", f"the ranks did not all finish within {timeout:.0f} s (a rank waiting in a "
                       f"collective that another never joins?); every process was stopped.\n{e}")
    except WorkerError as e:
        lost = Outcome(CRASH, "crash", f"rank {e.first} stopped outside the watched calls: {e}")
    return [lost] * len(fns)


def check(worker, fn, **kwargs):
    """One exercise's check on every rank: its tokens, or its ✗ (or "not done yet") raised."""
    out = on_ranks(worker, [fn], **kwargs)[0]
    out.raise_()
    return out.detail.get("tokens")


# ---------------------------------------------------------------- 08.1: what tp_generate gets, watched
class Graph:
    """A learner's graph: its capture and its replays are events of the :class:`Watch`."""

    def __init__(self, graph, watch):
        self.graph, self.watch, self.steps = graph, watch, 0

    def capture_begin(self, *args, **kwargs):
        """Begin a capture (its step calls are counted)."""
        out = self.graph.capture_begin(*args, **kwargs)
        self.watch.begin(self)
        return out

    def capture_end(self):
        """End the capture."""
        out = self.graph.capture_end()
        self.watch.end(self)
        return out

    def replay(self):
        """Replay, the static inputs read before and after."""
        event = self.watch.before_replay(self, sys._getframe(1))
        out = self.graph.replay()
        self.watch.after_replay(event)
        return out

    def __getattr__(self, name):
        return getattr(self.graph, name)


class Watch:
    """The step and graph API one rank's ``tp_generate`` gets: each call an event of one :class:`Tracer`."""

    def __init__(self, cg, step, ids, position):
        self.cg, self._step, self.given, self.t = cg, step, (ids, position), Tracer(cg)
        self.made, self.open = [], None  # the graphs made; the one whose capture is under way
        self.static = self.code = None  # (ids, position, logits) of the first captured call; its caller's code
        self.names, self.alive = (), {t.data_ptr() for t in (ids, position)}
        self.captures = self.calls = self.replays = 0
        self.rebound = ""

    def step(self, ids, position):
        """The rank's step, each call an event (eager or captured)."""
        e = self.t.note("step", line=sys._getframe(1).f_lineno)
        e["what"] = "capture" if e["where"] == "capture" else "eager"
        if e["what"] == "capture":
            if self.open is None:
                self.begin(None)  # a capture begun outside the watched API
            self.calls += 1
            e.update(graph=self.captures, call=self.calls, order=self.t.order.problem or "")
        out = self._step(ids, position)
        if e["what"] == "capture" and self.static is None:
            frame = sys._getframe(1)
            self.static, self.code = (ids, position, out), frame.f_code
            self.names = tuple(k for k, v in frame.f_locals.items() if v is ids or v is position)
            e["fresh"] = [t.data_ptr() not in self.alive for t in (ids, position)]  # made inside the capture
        return out

    def CUDAGraph(self, *args, **kwargs):  # noqa: N802 - torch.cuda's name
        """A watched graph."""
        g = Graph(self.cg.CUDAGraph(*args, **kwargs), self)
        self.made.append(g)
        return g

    @contextlib.contextmanager
    def graph(self, g, *args, **kwargs):
        """``cg.graph(g)``, the capture's step calls counted."""
        with self.cg.graph(g.graph if isinstance(g, Graph) else g, *args, **kwargs):
            self.begin(g)
            yield
        self.end(g)

    def begin(self, g) -> None:
        """A capture began: the tensors the learner holds now are not made inside it."""
        self.open, self.calls = g or True, 0
        self.captures += 1
        frame = sys._getframe(1)
        while frame.f_code.co_filename in (__file__, contextlib.__file__):
            frame = frame.f_back
        self.alive |= {v.data_ptr() for v in frame.f_locals.values() if isinstance(v, torch.Tensor)}

    def end(self, g) -> None:
        """A capture ended: its step calls, the static inputs' values."""
        if isinstance(g, Graph):
            g.steps = self.calls
        self.open = None
        self.t.events.append({"what": "end", "graph": self.captures, "steps": self.calls, **self.values()})

    def values(self) -> dict:
        """The values of the inputs the graph reads (the first captured call's), read now (outside a capture)."""
        ids, pos = self.static[:2] if self.static else self.given
        return {"ids": ids.reshape(-1).tolist(), "position": pos.reshape(-1).tolist()}

    def before_replay(self, g, frame) -> dict:
        """A replay is next: its number, its graph's step calls, the inputs; a learner's name rebound."""
        self.replays += 1
        if self.static and not self.rebound and frame.f_code is self.code:
            self.rebound = next((n for n in self.names if frame.f_locals.get(n) is not None
                                 and not any(frame.f_locals[n] is a for a in self.static[:2])), "")
        e = {"what": "replay", "n": self.replays, "steps": g.steps, "rebound": self.rebound, **self.values()}
        self.t.events.append(e)
        return e

    def after_replay(self, e) -> None:
        """The replay ran: the inputs now, and the graph's token."""
        after = self.values()
        e.update(ids_after=after["ids"], position_after=after["position"],
                 token=self.static[2].argmax(-1).reshape(-1).tolist() if self.static else None)

    def __getattr__(self, name):
        return getattr(self.cg, name)

    def close(self, stream) -> None:
        """No capture left under way, the stream back, failed graphs kept, the device usable."""
        self.t.close()
        if isinstance(self.open, Graph) and runtime().on_gpu:
            with contextlib.suppress(Exception), self.cg.stream(self.cg.current_stream()):
                self.open.graph.capture_end()  # capture_begin without its end: the learner's code raised
        if not runtime().on_gpu:
            from course.sim.graph import end_all_captures  # the simulator's own: imported on its path only
            end_all_captures()
        self.cg.set_stream(stream)
        if runtime().on_gpu:
            for g in self.made:
                recover(graph=g.graph)  # kept alive: torch's allocators may still call into a failed one
            recover()
        self.made.clear()
        gc.collect()
        synchronize()


@contextlib.contextmanager
def gpu_synchronize(cg):
    """``torch.cuda.synchronize()`` taken as a GPU takes it, on the simulator too (refused inside a capture)."""
    if runtime().on_gpu:
        yield
        return
    saved, torch.cuda.synchronize = torch.cuda.synchronize, cg.synchronize
    try:
        yield
    finally:
        torch.cuda.synchronize = saved


def finished(out, n: int) -> dict:
    """The event of ``tp_generate`` returning ``out``: its tokens, or why their shape is wrong."""
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (1, n):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        return {"what": "done", "tokens": None,
                "shape": f"tp_generate must return the {n} tokens as a tensor [1, {n}], got {got}"}
    return {"what": "done", "tokens": [int(t) for t in out.reshape(-1).tolist()], "shape": ""}


def crashed(e: BaseException, code) -> dict:
    """The event of ``tp_generate`` raising ``e``: the rule it breaks, and what it says."""
    if isinstance(e, NotImplementedError):
        return {"what": "crash", "rule": "not_done", "message": str(e)}
    rule, why = capture_error(e)
    if rule:
        return {"what": "crash", "rule": {"host_read": "host_sync"}.get(rule, rule), "message": why}
    lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if f.filename == code.co_filename]
    where = f" (line {lines[-1]} of {code.co_name})" if lines else ""
    return {"what": "crash", "rule": "crash", "message": first_line(e)[:300] + where}


def run_generate(ctx, fn, step, first, n_tokens: int) -> list:
    """``fn`` run once on this rank with ``step``: its events, the last ``done`` or ``crash``."""
    cg = graphs()
    ids, position = first.view(1, 1).clone(), torch.zeros(1, dtype=torch.long, device=first.device)
    stream, watch = cg.current_stream(), Watch(cg, step, ids, position)
    try:
        with torch.no_grad(), warnings.catch_warnings(), gpu_synchronize(cg):
            warnings.filterwarnings("ignore", message=".*CUDA Graph is empty.*")
            event = finished(fn(ctx, watch.step, ids, position, n_tokens, watch), n_tokens)
    except Exception as e:  # noqa: BLE001 - the learner's error becomes the trace's last event
        event = crashed(e, fn.__code__)
    finally:
        watch.close(stream)
    return watch.t.events + [dict(event, replays=watch.replays)]


# ---------------------------------------------------------------- 08.1's rules
TITLES = {
    "warm_up": "the warm-up before the capture breaks torch's rule",
    "warm_up_one_rank": "the warm-up ran on some ranks only",
    "warm_up_count": "the ranks ran different numbers of warm-up steps",
    "capture_one_rank": "one rank captured the step while another ran it eagerly",
    "branch": "the ranks captured different graphs",
    "one_rank": "not every rank replays",
    "drift": "the ranks' tokens drift apart",
    "no_graph": "no graph: the tokens came from eager steps",
    "eager_after_capture": "the step ran eagerly after the capture",
    "graphs": "more than one graph captured",
    "replays": "the tokens did not come from one replay per token",
    "host_sync": "a host sync inside the capture",
    "host_copy": "a host copy inside the capture",
    "crash": "a rank raised an error",
    "rebound": "a static input rebound to a new tensor",
    "no_copy": "the next token never reached the static input ids",
    "no_advance": "the position never advanced",
    "no_clone": "the returned tokens alias the graph's output",
    "shape": "tp_generate returned the wrong shape",
    "reset": "the warm-up decoded, and the static inputs were not put back",
    "early": "the static inputs changed before the first replay",
    "early_read": "each token was taken before the replay that computes it",
    "frozen": "the capture froze an input",
    "wrong": "the tokens differ from TP=1",
}


def nth(n: int) -> str:
    """1st, 2nd, 3rd, 4th..."""
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


class At:
    """One rank's trace at the lockstep point k: ``e`` its event k (its last when shorter), ``seen`` those before."""

    def __init__(self, events, k: int, n_tokens: int):
        k = min(k, len(events) - 1)
        self.e, self.seen, self.n = events[k], events[:k], n_tokens

    def of(self, *whats) -> list:
        """The events before ``e`` of kinds ``whats``."""
        return [e for e in self.seen if e["what"] in whats]

    @property
    def warm(self) -> list:
        """The eager step calls before the first capture."""
        first = next((i for i, e in enumerate(self.seen) if e["what"] in ("capture", "end")), len(self.seen))
        return [e for e in self.seen[:first] if e["what"] == "eager"]


def rule(name: str, test) -> Rule:
    """A rule of 08.1, titled from :data:`TITLES`."""
    return Rule(name, TITLES[name], test)


def _warm_up(a: At) -> str:
    if a.e["what"] != "capture" or a.of("capture", "end"):
        return ""  # judged at the first captured step call
    return warmup_problem([e["where"] for e in a.warm], STEP, LAZY) or a.e["order"]


def _graphs(a: At) -> str:
    e = a.e
    if e["what"] == "capture" and e["call"] == 1 and e["graph"] > 1:
        return (f"tp_generate began a {nth(e['graph'])} capture of the step: capture it once, in one graph per "
                "rank, and replay that graph for every token")
    if e["what"] == "end" and e["steps"] != 1:
        return (f"a capture holds no call of the step: call {STEP} inside the capture" if not e["steps"] else
                f"the capture calls the step {e['steps']} times: capture one step (and its next token) and "
                "replay it once per token")
    return ""


def _replays(a: At) -> str:
    e = a.e
    if e["what"] == "replay" and e["n"] > a.n:
        return f"tp_generate replayed the graph more than {a.n} times for {a.n} tokens: one replay per token"
    if e["what"] == "done" and a.of("end") and e["replays"] != a.n:
        return f"{e['replays']} replay(s) of the graph for {a.n} tokens: each token comes from one replay"
    return ""


def _no_graph(a: At) -> str:
    if a.e["what"] != "done" or a.of("end"):
        return ""
    return (f"tp_generate captured no graph: its {a.n} token(s) came from {len(a.of('eager'))} eager call(s) of the "
            "step")


PER_RANK = [  # judged on each rank's trace at each lockstep point
    rule("eager_after_capture", lambda a: a.e["what"] == "eager" and bool(a.of("capture", "end")) and (
        f"after the capture tp_generate called {STEP} eagerly: each token must come from a replay of the graph, "
        "not from the eager step")),
    rule("warm_up", _warm_up),
    rule("graphs", _graphs),
    rule("shape", lambda a: a.e["what"] == "done" and a.e["shape"]),
    rule("no_graph", _no_graph),
    rule("replays", _replays),
]


def _split(ats) -> tuple:
    """``(capturing ranks, eager ranks)`` where some ranks capture the step while others run it eagerly."""
    kinds = [a.e["what"] for a in ats]
    if set(kinds) != {"eager", "capture"}:
        return (), ()
    return [r for r, k in enumerate(kinds) if k == "capture"], [r for r, k in enumerate(kinds) if k == "eager"]


def _one_rank_warm(ats) -> str:
    cap, eag = _split(ats)
    if not cap or any(ats[r].warm for r in cap):
        return ""
    return (f"rank(s) {eag} ran the step eagerly while rank(s) {cap} began capturing it without any warm-up. Every "
            "rank must run the same warm-up (its all-reduces meet only when every rank runs them), then capture")


def _elsewhere(a: At) -> bool:
    """The eager call ``e`` is not a warm-up step: it comes from another line, or after a capture."""
    return a.e["line"] not in {e["line"] for e in a.warm} or bool(a.of("end"))


def _warm_count(ats) -> str:
    cap, eag = _split(ats)
    if not cap or any(_elsewhere(ats[r]) for r in eag):
        return ""
    return (f"rank(s) {eag} ran the warm-up step a {nth(len(ats[eag[0]].of('eager')) + 1)} time while rank(s) "
            f"{cap} began capturing after {sorted({len(ats[r].warm) for r in cap})} warm-up step(s). Every rank "
            "must run the same number of warm-up steps (nothing that depends on ctx.rank), then capture")


def _capture_one(ats) -> str:
    cap, eag = _split(ats)
    return cap and (f"rank(s) {cap} began capturing the step while rank(s) {eag} ran it eagerly (outside their "
                    "warm-up). Every rank must capture the same step and replay it: an eager all-reduce on one rank "
                    "never meets a captured one, which runs only at replay")


def _describe(r: int, e: dict) -> str:
    what = {"eager": "an eager step call", "capture": f"step call {e.get('call')} inside capture {e.get('graph')}",
            "end": f"the end of capture {e.get('graph')} ({e.get('steps')} step call(s))",
            "replay": f"replay {e.get('n')}", "done": "the return"}[e["what"]]
    return f"rank {r}: {what}"


def _kinds(ats, branch: bool) -> str:
    kinds = [a.e["what"] for a in ats]
    if len(set(kinds)) < 2 or ("capture" in kinds or {"end", "replay"} <= set(kinds)) != branch:
        return ""
    lines = "; ".join(_describe(r, a.e) for r, a in enumerate(ats))
    return lines + (". Every rank must capture the same code path (no branch on the rank inside the capture), so "
                    "that their graphs hold the same all-reduces" if branch else ". A graph that holds collectives "
                    "must be replayed on every rank, the same number of times (else its all-reduces wait forever "
                    "for the ranks that never come)")


def _same(ats, what: str, key) -> list:
    """Each rank's ``key`` of its event when every rank is at a ``what`` event, else []."""
    return [key(a.e) for a in ats] if all(a.e["what"] == what for a in ats) else []


def _drift(ats) -> str:
    inputs = _same(ats, "replay", lambda e: (e["ids"], e["position"]))
    if len({str(i) for i in inputs}) > 1:
        return (f"before replay {ats[0].e['n']} the static inputs differ, rank by rank: ids {[i for i, _ in inputs]}, "
                f"position {[p for _, p in inputs]}. Every rank must feed back the same next token (the argmax of "
                "the whole logits, computed identically on every rank) and advance the position alike")
    tokens = _same(ats, "done", lambda e: e["tokens"])
    return len({str(t) for t in tokens}) > 1 and (
        f"rank by rank, the tokens returned: {tokens}. Every rank must feed back the same next token: the argmax "
        "of the whole logits, computed identically on every rank")


def _branch_counts(ats) -> str:
    for what, key in (("capture", lambda e: (e["graph"], e["call"])), ("end", lambda e: (e["graph"], e["steps"]))):
        if len(set(_same(ats, what, key))) > 1:
            return "; ".join(_describe(r, a.e) for r, a in enumerate(ats))
    steps = _same(ats, "replay", lambda e: e["steps"])
    return len(set(steps)) > 1 and (f"each rank's graph holds {steps} step call(s) (rank by rank), so their "
                                    "collectives differ. Every rank must capture the same code path")


CROSS_FIRST = [rule("warm_up_one_rank", _one_rank_warm), rule("warm_up_count", _warm_count),
               rule("capture_one_rank", _capture_one), rule("branch", partial(_kinds, branch=True)),
               rule("one_rank", partial(_kinds, branch=False))]
CROSS_THEN = [rule("branch", _branch_counts), rule("drift", _drift),
              rule("one_rank", lambda ats: len(set(_same(ats, "done", lambda e: e["replays"]))) > 1 and (
                  f"the ranks replayed {_same(ats, 'done', lambda e: e['replays'])} time(s) (rank by rank)"))]
CROSS_THEN.insert(2, CROSS_THEN.pop())  # the replay counts before the tokens: a rank that replayed less drifts


def broken(view, rules):
    """``(rule, why)`` of the first of ``rules`` broken on ``view``, or None."""
    return next(((r, why) for r in rules for why in [r.test(view)] if why), None)


def _errors(ats) -> Outcome | None:
    bad = [r for r, a in enumerate(ats) if a.e["what"] == "crash"]
    if not bad:
        return None
    first = ats[bad[0]].e
    if first["rule"] == "not_done":
        return Outcome(TODO, "not_done", first["message"])
    every = len(bad) == len(ats) and all(ats[r].e["message"] == first["message"] for r in bad)
    who = "every rank" if every else f"rank {bad[0]}"
    return Outcome(FAIL, first["rule"], f"{TITLES[first['rule']]}: {who}: {first['message']}")


def lockstep(traces: list, n_tokens: int) -> Outcome | None:
    """The first rule broken at the same point of every rank's trace (event k of each, k = 0, 1, ...), or None."""
    for k in range(max(map(len, traces))):
        ats = [At(t, k, n_tokens) for t in traces]
        out = _errors(ats)
        found = out is None and broken(ats, CROSS_FIRST)
        if out is not None or found:
            return out or Outcome(FAIL, found[0].name, f"{found[0].title}: {found[1]}")
        per = [broken(a, PER_RANK) for a in ats]
        first = next((p for p in per if p), None)
        if first:
            ranks = [r for r, p in enumerate(per) if p == first]
            who = "every rank" if len(ranks) == len(ats) else f"rank(s) {ranks}"
            return Outcome(FAIL, first[0].name, f"{first[0].title}: {who}: {first[1]}")
        found = broken(ats, CROSS_THEN)
        if found:
            return Outcome(FAIL, found[0].name, f"{found[0].title}: {found[1]}")
    return None


class Run:
    """One rank's whole trace, for the rules that say why its tokens differ from TP=1's (``want``)."""

    def __init__(self, events: list, want: list, first: int):
        self.want, self.first = want, first
        self.tokens = events[-1].get("tokens")
        self.end = next((e for e in events if e["what"] == "end"), None)
        self.replays = [e for e in events if e["what"] == "replay"]
        self.fresh = next((e["fresh"] for e in events if "fresh" in e), [False, False])
        self.wrong = self.tokens != want and bool(self.replays)

    def inputs(self, which: str, when: str = "") -> list:
        """``which`` input's value (its first element) before each replay, or after with ``when="_after"``."""
        return [e[which + when][0] for e in self.replays if e.get(which + when)]


def _rebound(run: Run) -> str:
    e = next((e for e in run.replays if e["rebound"]), None)
    return run.wrong and e is not None and (
        f"before replay {e['n']}, `{e['rebound']}` named a new tensor, not the one the graph captured (an "
        f"assignment `{e['rebound']} = ...`): the graph still reads the tensor it saw at capture, which never changes")


def _frozen(run: Run) -> str:
    for i, name in enumerate(("ids", "position")):
        after = run.inputs(name, "_after")
        fixed = len(after) > 1 and len(set(after)) == 1
        written = any(b != a for b, a in zip(run.inputs(name), after))
        if run.wrong and fixed and (written or run.fresh[i]):
            what = f"at position {after[0]}" if name == "position" else f"token {after[0]}"
            return (f"every replay decoded {what}: the `{name}` the graph reads was fixed at capture (a Python "
                    "value, or a tensor made inside the capture), so nothing the loop does to it reaches the replays")
    return ""


def _changed(run: Run, e: dict) -> list:
    """What of the static inputs (those made before the capture) in ``e`` differs from the first token at 0."""
    out = [f"position held {e['position'][0]}"] if not run.fresh[1] and e["position"][0] != 0 else []
    return out + (["ids no longer held the first token"] if not run.fresh[0] and e["ids"][0] != run.first else [])


def _reset(run: Run) -> str:
    return run.wrong and run.end is not None and _changed(run, run.end) and _changed(run, run.replays[0]) and (
        f"when the capture ended, {' and '.join(_changed(run, run.end))} (tp_generate began with the first token in "
        "ids at position 0): the warm-up decoded, and the replays went on from where it stopped")


def _early(run: Run) -> str:
    return run.wrong and run.end is not None and not _changed(run, run.end) and _changed(run, run.replays[0]) and (
        f"before the first replay {' and '.join(_changed(run, run.replays[0]))}, though the capture ended with the "
        "first token at position 0: tp_generate changed them before the replay that decodes the first token")


def _early_read(run: Run) -> str:
    graph = [e["token"][0] for e in run.replays if e.get("token")]
    return run.wrong and len(graph) == len(run.tokens) > 1 and run.tokens != graph and run.tokens[1:] == graph[:-1] \
        and ("token k returned is what replay k-1 wrote into the graph's output (and token 0 what it held before "
             "any replay)")


def _no_copy(run: Run) -> str:
    ids = run.inputs("ids")
    return run.wrong and len(ids) > 1 and len(set(ids)) == 1 and (
        f"ids held {ids[0]} before every replay, so every replay decoded the first token again (at the next "
        "position): the graph's next token never reached the tensor it reads")


def _no_advance(run: Run) -> str:
    pos = run.inputs("position")
    return run.wrong and len(pos) > 1 and len(set(pos)) == 1 and (
        f"position held {pos[0]} before every replay: every token was decoded at the same position")


def _no_clone(run: Run) -> str:
    graph = [e["token"][0] for e in run.replays if e.get("token")]
    return run.wrong and len(graph) == len(run.tokens) > 1 and len(set(graph)) > 1 and set(run.tokens) == {
        graph[-1]} and (f"every token returned is the last one ({graph[-1]}), while the replays made {graph}: the list "
                        "held the graph's output tensor, which every replay overwrites")


def differ(got: list, want: list) -> str:
    """Where ``got`` first differs from TP=1's ``want`` ('' when it does not)."""
    at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    return "" if at is None else f"from token {at} on: {got[at:at + 4]} where TP=1 gives {want[at:at + 4]}"


def _wrong(run: Run) -> str:
    return differ(run.tokens, run.want)


TOKENS = [rule(n, t) for n, t in (("rebound", _rebound), ("frozen", _frozen), ("reset", _reset), ("early", _early),
                                  ("early_read", _early_read), ("no_copy", _no_copy),
                                  ("no_advance", _no_advance), ("no_clone", _no_clone), ("wrong", _wrong))]


def verdict(traces: list, n_tokens: int, want: list, first: int) -> Outcome:
    """Every rank's trace judged in lockstep, then why rank 0's tokens differ from TP=1's: one outcome."""
    out = lockstep(traces, n_tokens)
    if out is None:
        out = judge(Run(traces[0], want, first), TOKENS)
    return out if not out.ok else Outcome(PASS, detail={"tokens": traces[0][-1]["tokens"]})


def capture_worker(ctx, fns, n_tokens: int = 6, size="tiny") -> list:
    """Exercise 08.1 on every rank: each of ``fns`` traced without collectives, judged with every rank's trace,
    then run on the split step (see the module doc); one :class:`Outcome` per function, the same on every rank."""
    model = build_model(size, device=ctx.torch_device)
    first = first_token(ctx.torch_device, model.config.vocab_size)
    solo = HandShardedDecoder(model, 0, 1, max_len=64)  # this rank's whole model: no collective
    split = HandShardedDecoder(model, ctx.rank, ctx.world_size, max_len=64)
    want = greedy(solo.step, first, n_tokens)[0].tolist()  # TP=1
    del model
    gc.freeze()  # what is alive now stays: each collection after a run looks at the run's objects only
    try:
        return [judge_generate(ctx, fn.load() if hasattr(fn, "load") else fn, i, len(fns), solo, split, first, want)
                for i, fn in enumerate(fns)]
    finally:
        gc.unfreeze()


def judge_generate(ctx, fn, i: int, n: int, solo, split, first, want: list) -> Outcome:
    """One function of 08.1 on this rank: traced on ``solo``, judged with every rank's trace, then run on ``split``."""
    ctx.say(f"judging {fn.__name__} ({i + 1} of {n})")
    solo.reset()
    traces = exchange(run_generate(ctx, fn, solo.step, first, len(want)), timeout_s=EXCHANGE_S,
                      what="the trace of tp_generate")
    out = verdict(traces, len(want), want, int(first))
    if out.ok:  # every rank agreed: now with the all-reduces
        split.reset()
        out = agree(verdict([run_generate(ctx, fn, split.step, first, len(want))], len(want), want, int(first)),
                    timeout_s=EXCHANGE_S, what="tp_generate's tokens")
    return out


check_capture = partial(check, capture_worker)


# ---------------------------------------------------------------- 08.2: split_layer, traced for every rank
ORDER = ("qkv", "attend", "o_proj", "gate_up", "down")
PLACED = ["qkv", "attend", "o_proj", "all_reduce", "gate_up", "down", "all_reduce"]
DEFECTS = {
    "not_done": "split_layer still raises NotImplementedError",
    "error": "split_layer raised an error",
    "kernels": "the layer's five kernels do not run once each, in order",
    "layer": "a kernel reads another layer's weights",
    "branch": "the ranks call different collectives",
    "missing": "an all-reduce is missing",
    "misplaced": "an all-reduce is in the wrong place",
    "double": "the residual is added on more than one rank (counted once per rank)",
    "lost": "the residual is added on no rank",
    "wrong": "the tokens differ from TP=1",
}


class Kernels:
    """A stand-in for one rank's decoder: each call noted on the tracer (kernel, layer, residual), none run."""

    def __init__(self, tracer: Tracer, rank: int, world: int):
        self.t, self.rank, self.world = tracer, rank, world

    def qkv(self, layer, position):
        """Kernel 1 of ``layer``."""
        self.t.note("qkv", layer=layer)

    def attend(self, layer, position):
        """Kernel 2 of ``layer``."""
        self.t.note("attend", layer=layer)

    def o_proj(self, layer, residual=True):
        """Kernel 3 of ``layer``, and whether it adds the residual."""
        self.t.note("o_proj", layer=layer, residual=bool(residual))

    def gate_up(self, layer):
        """Kernel 4 of ``layer``."""
        self.t.note("gate_up", layer=layer)

    def down(self, layer, residual=True):
        """Kernel 5 of ``layer``, and whether it adds the residual."""
        self.t.note("down", layer=layer, residual=bool(residual))

    def all_reduce(self):
        """An all-reduce of x."""
        self.t.note("all_reduce")


class Split:
    """``fn``'s calls on every rank of ``world``, per layer (``ranks[r][layer]``: events), or the error it raised;
    ``label``: how a message names this world size ("" for the launch's own)."""

    def __init__(self, fn, world: int, label: str = "", layers: int = 3):
        self.world, self.label, self.error, self.ranks = world, label, None, []
        for rank in range(world):
            per = []
            try:
                for layer in range(layers):
                    with Tracer(streams=False) as t:
                        fn(Kernels(t, rank, world), layer, None)
                    per.append(t.events)
            except Exception as e:  # noqa: BLE001 - the learner's error: every rank names it
                self.error = self.error or (rank, e)
            self.ranks.append(per)

    def names(self, rank: int, layer: int) -> list:
        """The calls of ``rank`` in ``layer``, by name."""
        return [e["what"] for e in self.ranks[rank][layer]]

    def adders(self, layer: int, proj: str) -> list:
        """The ranks whose ``proj`` of ``layer`` adds the residual."""
        return [r for r in range(self.world) for e in self.ranks[r][layer] if e["what"] == proj and e["residual"]]


def _each_layer(test):
    """A rule's test run on every layer of rank 0 (the ranks call the same kernels: :func:`_branch` first)."""
    def per_layer(s: Split) -> str:
        return next((why for i in range(len(s.ranks[0])) for why in [test(s, i)] if why), "")
    return per_layer


def _branch(s: Split) -> str:
    for i in range(len(s.ranks[0])):
        calls = [s.names(r, i) for r in range(s.world)]
        if any(c != calls[0] for c in calls):
            return (f"{s.label}rank by rank, layer {i} calls {calls}. A collective completes only when every rank "
                    "reaches it: no branch on the rank around an all-reduce (a rank-dependent argument, such as "
                    "which rank adds the residual, is fine)")
    return ""


def _kernels(s: Split, i: int) -> str:
    kernels = [n for n in s.names(0, i) if n != "all_reduce"]
    return kernels != list(ORDER) and f"layer {i} runs {kernels}, want {list(ORDER)}"


def _layer(s: Split, i: int) -> str:
    e = next((e for e in s.ranks[0][i] if e.get("layer", i) != i), None)
    return e is not None and f"layer {i} runs {e['what']} on layer {e['layer']}'s weights"


def _missing(s: Split, i: int) -> str:
    n = s.names(0, i).count("all_reduce")
    return n < 2 and (f"layer {i} has {n}, and each of o_proj and down_proj leaves a partial sum on every rank that "
                      "must be summed before the next kernel reads x")


def _misplaced(s: Split, i: int) -> str:
    return s.names(0, i) != PLACED and (
        f"layer {i} runs {s.names(0, i)}; an all-reduce belongs right after each partial sum (o_proj, down), before "
        "the next kernel that reads x whole, and nowhere else (a second sum of whole values multiplies them by the "
        "ranks)")


def _residual(s: Split, i: int, many: bool) -> str:
    where = f" in layer {i}" if i else ""
    for proj in ("o_proj", "down"):
        adders = s.adders(i, proj)
        if many and len(adders) > 1:
            return (f"{s.label}{proj} adds it on ranks {adders}{where}, so the all-reduce sums it {len(adders)} "
                    "times; exactly one rank must add it")
        if not many and not adders:
            return f"{s.label}{proj} adds it on no rank{where}; exactly one rank must add it"
    return ""


SPLIT_RULES = [Rule(n, DEFECTS[n], t) for n, t in (
    ("branch", _branch), ("kernels", _each_layer(_kernels)), ("layer", _each_layer(_layer)),
    ("missing", _each_layer(_missing)), ("misplaced", _each_layer(_misplaced)),
    ("double", _each_layer(partial(_residual, many=True))), ("lost", _each_layer(partial(_residual, many=False))))]


def judge_split(fn, world: int) -> Outcome:
    """``fn``'s calls judged for every rank of ``world`` ranks, then of 4 (a defect 2 ranks hide shows at 4)."""
    for w in sorted({world, 4}, key=lambda w: w != world):
        s = Split(fn, w, "" if w == world else f"with {w} ranks, ")
        if s.error:
            rank, e = s.error
            if isinstance(e, NotImplementedError):
                return Outcome(TODO, "not_done", str(e))
            return Outcome(FAIL, "error", f"{DEFECTS['error']} on rank {rank}: {first_line(e)}")
        out = judge(s, SPLIT_RULES)
        if not out.ok:
            return out
    return Outcome(PASS)


def split_worker(ctx, fns, n_tokens: int = 4, size: str = "tiny") -> list:
    """Exercise 08.2 on every rank: each of ``fns`` traced and judged (agreed before anything runs), then run in
    the split fused step against lesson 07's step on the whole model; one :class:`Outcome` per function."""
    fns = [f.load() if hasattr(f, "load") else f for f in fns]
    verdicts = [agree(judge_split(fn, ctx.world_size), timeout_s=EXCHANGE_S, what="split_layer's trace")
                for fn in fns]
    if not any(v.ok for v in verdicts):
        return verdicts
    model = build_model(size, device=ctx.torch_device)
    first = first_token(ctx.torch_device, model.config.vocab_size)
    pos0 = torch.zeros(1, dtype=torch.long, device=first.device)
    run = (lambda d: graphed(d, first.view(1, 1), pos0)) if runtime().on_gpu else (lambda d: d.step)
    want = greedy(run(TritonDecoder(model, n_tokens + 8)), first, n_tokens)[0].tolist()  # TP=1: lesson 07's step
    out = []
    for fn, v in zip(fns, verdicts):
        if v.ok:
            dec = FusedShardDecoder(model, ctx.rank, ctx.world_size, None, "nccl", max_len=n_tokens + 8, layer=fn)
            got = greedy(run(dec), first, n_tokens)[0].tolist()
            del dec
            gc.collect()
            synchronize()
            why = differ(got, want)
            v = agree(Outcome(FAIL, "wrong", f"{DEFECTS['wrong']} {why}") if why else Outcome(
                PASS, detail={"tokens": got}), timeout_s=EXCHANGE_S, what="split_layer's tokens")
        out.append(v)
    return out


check_split_layer = partial(check, split_worker)
