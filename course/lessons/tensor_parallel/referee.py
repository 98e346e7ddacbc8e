"""Exercise 08.1's referee: every rank says what it does next, the ranks compare, and a defect stops all of them.

The learner writes ``tp_generate(ctx, step, ids, position, n_tokens, cg)``: warm the step up on a side stream,
capture it (its all-reduces inside) in one graph per rank, and replay that graph in lockstep, one replay per token.
The check (:mod:`~.exercise`) hands it a watched step and graph API (:mod:`~.watch`) that call the :class:`Referee`
at every **event**: a step call (eager or inside a capture), the end of a capture, a replay, a crash, and the return.
Before the event's work runs, the ranks exchange their accounts of it over a gloo group with a short time limit
(:func:`course.core.agree.exchange`), so every rank sees the same list and :func:`judge` raises the same
:class:`CaptureDefect` on every rank, naming the ranks, before any collective that could wait forever:

- the warm-up: the course's one rule (:func:`course.core.warmup.warmup_problem`, lab 4.5's verdict: eager calls on a
  side stream, forked and joined, :mod:`course.lessons.stream_order`), the same on every rank and as many steps;
- the capture: one graph, one step in it, the same on every rank; no eager step after it;
- the replays: every rank, the same graph, the same static inputs, one replay per token;
- a rank that raised (its error, named on every rank, instead of the others' lost connection).

Each account also keeps what the tokens are diagnosed by (:meth:`Referee.diagnose`): the static inputs before each
replay, the graph's token after it, and whether ``tp_generate`` rebound ``ids`` or ``position``.
"""
from __future__ import annotations

import contextlib

from course.core.agree import exchange as agree_exchange, group_for
from course.core.warmup import warmup_problem, where

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
    "crash": "a rank raised an error",
    "rebound": "a static input rebound to a new tensor",
    "no_copy": "the next token never reached the static input ids",
    "no_advance": "the position never advanced",
    "no_clone": "the returned tokens alias the graph's output",
    "shape": "tp_generate returned the wrong shape",
    "wrong": "the tokens differ from TP=1",
    "not_done": "not done yet",
}
LAZY = "Lazy set-up (NCCL's communicator and buffers, cuBLAS handles, first-use allocations)"
STEP = "step(ids, position)"


class CaptureDefect(AssertionError):
    """A defect of the learner's capture, named by ``kind`` (a key of :data:`TITLES`); the same on every rank."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"{TITLES[kind]}: {message}")
        self.kind = kind


def _nth(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


class Referee:
    """One rank's account of the learner's calls, exchanged with the other ranks at every event."""

    def __init__(self, ctx, cg, n_tokens: int, timeout_s: float = 20.0, on_gpu: bool = False):
        from course.lessons.stream_order import StreamOrder

        self.ctx, self.cg, self.n_tokens, self.timeout_s, self.on_gpu = ctx, cg, n_tokens, timeout_s, on_gpu
        group_for(None, timeout_s)  # made now, outside any capture, on every rank alike
        self.aside = None if on_gpu else cg.Stream()  # the simulator records every op on a capturing stream
        self.start_stream = cg.current_stream()
        self.eager_where: list = []  # where each eager call ran, before the first capture
        self.eager_sites: set = set()
        self.eager_calls = self.replays = 0
        self.graphs: list = []  # graphs whose capture ended: their step counts
        self.capture = None  # the capture under way: {"graph": index, "calls": n, "args": (ids, position)}
        self.static = None  # (ids, position, logits, code, names) of the first step captured
        self.seen: list = []  # per replay: (ids values, position values)
        self.graph_tokens: list = []  # per replay: the graph's token (argmax of the captured logits)
        self.rebound = None
        self.order = StreamOrder(cg)

    # ------------------------------------------------------------------ the exchange
    def exchange(self, event: dict) -> list:
        """Every rank's ``event``, in rank order; raises the verdict of :func:`judge` on every rank alike."""
        aside = self.aside is not None and self.cg.is_current_stream_capturing()
        with self.cg.stream(self.aside) if aside else contextlib.nullcontext():
            events = agree_exchange(event, timeout_s=self.timeout_s, what="the same point of tp_generate")
        judge(events)
        return events

    # ------------------------------------------------------------------ the events
    def on_step(self, args, site) -> None:
        """A call of the step, before it runs: eager or inside a capture."""
        here = where(self.cg)
        if here != "capture":
            self.order.work(False)
            problem = None
            if self.graphs or self.capture:
                problem = ("eager_after_capture", f"after the capture tp_generate called {STEP} eagerly: each token "
                           "must come from a replay of the graph (graph.replay() per token), not from the eager step")
            self.exchange({"kind": "eager", "n": self.eager_calls + 1, "new_site": site not in self.eager_sites,
                           "graphs": len(self.graphs), "problem": problem})
            self.eager_calls += 1
            if not self.graphs:
                self.eager_where.append(here)
                self.eager_sites.add(site)
            return
        cap = self.capture if self.capture is not None else self.begin(None)
        cap["calls"] += 1
        problem = None
        if cap["calls"] == 1 and cap["graph"] == 1:
            self.order.work(True)
            why = warmup_problem(self.eager_where, STEP, LAZY) or self.order.problem
            problem = ("warm_up", why) if why else None
        elif cap["calls"] == 1:
            problem = ("graphs", f"tp_generate began a {_nth(cap['graph'])} capture of the step: capture it once, "
                       "in one graph per rank, and replay that graph for every token")
        self.exchange({"kind": "capture", "graph": cap["graph"], "call": cap["calls"], "eager": self.eager_calls,
                       "problem": problem})
        cap["args"] = cap["args"] or tuple(args)

    def begin(self, graph) -> dict:
        """A capture begins (no exchange: the step calls inside it are the events)."""
        self.capture = {"graph": len(self.graphs) + 1, "calls": 0, "args": None, "obj": graph}
        return self.capture

    def end(self, out=None) -> None:
        """A capture ended without error: every rank's graph must hold the same number of step calls."""
        cap, self.capture = self.capture, None
        if cap is None:
            return
        self.graphs.append(cap["calls"])
        problem = None
        if cap["calls"] == 0:
            problem = ("graphs", f"a capture holds no call of the step: call {STEP} inside `with cg.graph(graph):`")
        elif cap["calls"] > 1:
            problem = ("graphs", f"the capture calls the step {cap['calls']} times: capture one step (and its next "
                       "token) and replay it once per token")
        self.exchange({"kind": "end", "graph": cap["graph"], "steps": cap["calls"], "problem": problem})

    def keep_static(self, args, logits, frame) -> None:
        """The first captured step's inputs and output, and the learner's names for them (for :meth:`diagnose`)."""
        if self.static is None:
            names = {k for k, v in frame.f_locals.items() if any(v is a for a in args)}
            self.static = (args[0], args[1], logits, frame.f_code, names)

    def before_replay(self, steps: int, frame) -> None:
        """A replay, before it runs: every rank replays the same graph with the same static inputs."""
        self.replays += 1
        ids, pos = (self.static[0].reshape(-1).tolist(), self.static[1].reshape(-1).tolist()) if self.static \
            else (None, None)
        if self.static and self.rebound is None and frame.f_code is self.static[3]:
            for name in sorted(self.static[4]):
                v = frame.f_locals.get(name)
                if v is not None and not any(v is a for a in self.static[:2]):
                    self.rebound = (name, self.replays)
        self.seen.append((ids, pos))
        problem = None
        if self.replays > self.n_tokens:
            problem = ("replays", f"tp_generate replayed the graph more than {self.n_tokens} times for "
                       f"{self.n_tokens} tokens: replay it once per token")
        self.exchange({"kind": "replay", "n": self.replays, "steps": self.graphs[-1] if self.graphs else 0,
                       "ids": ids, "position": pos, "problem": problem})

    def after_replay(self) -> None:
        """The graph's token of this replay: the argmax of the logits the captured step writes."""
        if self.static is not None and self.static[2] is not None:
            self.graph_tokens.append(self.static[2].argmax(-1).reshape(-1).tolist())

    def crash(self, kind: str, message: str) -> None:
        """This rank raised (not an agreed verdict): tell the others, then raise the verdict every rank gets."""
        from course.core.agree import RankLost

        try:
            self.exchange({"kind": "crash", "defect": kind, "message": message, "problem": None})
        except RankLost:
            message += " (the other ranks did not answer)"
        raise CaptureDefect(kind, f"rank {self.ctx.rank}: {message}")  # when judge did not raise it already

    def done(self, tokens, shape_problem: str = "") -> list:
        """``tp_generate`` returned: the ranks' accounts must agree; every rank's tokens."""
        problem = ("shape", shape_problem) if shape_problem else None
        if problem is None and not self.graphs:
            problem = ("no_graph", f"tp_generate captured no graph: its {self.n_tokens} token(s) came from "
                       f"{self.eager_calls} eager call(s) of the step. Capture the step once, `with "
                       "cg.graph(graph):` (the graph made with cg.CUDAGraph()), then replay it for every token")
        elif problem is None and self.replays != self.n_tokens:
            problem = ("replays", f"{self.replays} replay(s) of the graph (made with cg.CUDAGraph()) for "
                       f"{self.n_tokens} tokens: each token must come from one replay, graph.replay() per token")
        events = self.exchange({"kind": "done", "replays": self.replays, "tokens": tokens, "problem": problem})
        return list(events[0]["tokens"])

    def diagnose(self, tokens: list, want: list):
        """Why ``tokens`` differ from ``want`` (TP=1), from what the replays saw: ``(kind, message)``."""
        if self.rebound:
            name, k = self.rebound
            fix = "position.add_(1)" if "pos" in name else f"{name}.copy_(nxt)"
            return ("rebound", f"before replay {k}, `{name}` named a new tensor, not the one the graph captured "
                    f"(an assignment `{name} = ...`): the graph still reads the tensor it saw at capture, which "
                    f"never changes. Write into that tensor instead: {fix}")
        ids = [s[0] for s in self.seen]
        pos = [s[1] for s in self.seen]
        if len(ids) > 1 and all(i == ids[0] for i in ids):
            return ("no_copy", f"ids held {ids[0]} before every replay, so every replay decoded the first token "
                    "again (at the next position). Copy each token into the tensor the graph reads before the next "
                    "replay: ids.copy_(nxt)")
        if len(pos) > 1 and all(p == pos[0] for p in pos):
            return ("no_advance", f"position held {pos[0]} before every replay: every token was decoded at the same "
                    "position. Advance it before the next replay: position.add_(1)")
        graph = [t[0] for t in self.graph_tokens if t]
        if len(graph) == len(tokens) > 1 and len(set(graph)) > 1 and all(t == graph[-1] for t in tokens):
            return ("no_clone", f"every token returned is the last one ({graph[-1]}), while the replays made "
                    f"{graph}: the list held the graph's output tensor, which every replay overwrites. Keep a "
                    "copy of each token: out.append(nxt.clone())")
        at = next((i for i, (a, b) in enumerate(zip(tokens, want)) if a != b), 0)
        return ("wrong", f"from token {at} on: {tokens[at:at + 4]} where TP=1 gives {want[at:at + 4]}")

    def close(self) -> None:
        """Put back what the watch changed (the stream order's patches, the current stream)."""
        self.order.close()


def _describe(r: int, e: dict) -> str:
    k = e["kind"]
    text = {"eager": lambda: f"an eager step call (its {_nth(e['n'])})",
            "capture": lambda: f"step call {e['call']} inside capture {e['graph']}",
            "end": lambda: f"the end of capture {e['graph']} ({e['steps']} step call(s))",
            "replay": lambda: f"replay {e['n']}", "done": lambda: f"return after {e['replays']} replay(s)",
            "crash": lambda: f"an error: {e['message']}"}[k]()
    return f"rank {r}: {text}"


def judge(events: list) -> None:
    """Raise :class:`CaptureDefect` when the ranks' accounts (one per rank) name a defect or disagree."""
    kinds = [e["kind"] for e in events]
    crashed = [r for r, k in enumerate(kinds) if k == "crash"]
    if crashed:
        r = crashed[0]
        if events[r]["defect"] == "not_done":
            raise CaptureDefect("not_done", events[r]["message"])
        same = all(events[c]["message"] == events[r]["message"] for c in crashed)
        who = "every rank" if same and len(crashed) == len(events) else f"rank {r}"
        others = [x for x in range(len(events)) if x not in crashed]
        tail = f" (rank(s) {others} stopped at the same time, waiting for it)" if others else ""
        raise CaptureDefect(events[r]["defect"], f"{who}: {events[r]['message']}{tail}")
    if set(kinds) == {"eager", "capture"}:
        cap = [r for r, k in enumerate(kinds) if k == "capture"]
        eag = [r for r, k in enumerate(kinds) if k == "eager"]
        counts = sorted({events[r]["eager"] for r in cap})
        if counts == [0]:
            raise CaptureDefect("warm_up_one_rank", f"rank(s) {eag} ran the step eagerly while rank(s) {cap} "
                                "began capturing it without any warm-up. Every rank must run the same warm-up (its "
                                "all-reduces meet only when every rank runs them), then capture")
        if not any(events[r]["new_site"] for r in eag) and not any(events[r]["graphs"] for r in eag):
            raise CaptureDefect("warm_up_count", f"rank(s) {eag} ran the warm-up step a "
                                f"{_nth(events[eag[0]]['n'])} time while rank(s) {cap} began capturing after "
                                f"{counts} warm-up step(s). Every rank must run the same number of warm-up steps "
                                "(nothing that depends on ctx.rank), then capture")
        raise CaptureDefect("capture_one_rank", f"rank(s) {cap} began capturing the step while rank(s) {eag} ran "
                            "it eagerly (outside their warm-up). Every rank must capture the same step and replay it: "
                            "an eager all-reduce on one rank never meets a captured one, which runs only at replay")
    if len(set(kinds)) > 1:
        lines = "; ".join(_describe(r, e) for r, e in enumerate(events))
        if "capture" in kinds or ("end" in kinds and "replay" in kinds):
            raise CaptureDefect("branch", f"{lines}. Every rank must capture the same code path (no branch on the "
                                "rank inside the capture), so that their graphs hold the same all-reduces")
        raise CaptureDefect("one_rank", f"{lines}. A graph that holds collectives must be replayed on every rank, "
                            "the same number of times (else its all-reduces wait forever for the ranks that never "
                            "come)")
    problems = [(r, e["problem"]) for r, e in enumerate(events) if e.get("problem")]
    if problems:
        kind, message = problems[0][1]
        ranks = [r for r, p in problems if p == problems[0][1]]
        who = "every rank" if len(ranks) == len(events) else f"rank(s) {ranks}"
        raise CaptureDefect(kind, f"{who}: {message}")
    kind = kinds[0]
    if kind in ("capture", "end") and len({(e["graph"], e.get("call"), e.get("steps")) for e in events}) > 1:
        raise CaptureDefect("branch", "; ".join(_describe(r, e) for r, e in enumerate(events)))
    if kind == "replay":
        if len({e["steps"] for e in events}) > 1:
            raise CaptureDefect("branch", f"each rank's graph holds {[e['steps'] for e in events]} step call(s) (rank "
                                "by rank), so their collectives differ. Every rank must capture the same code path")
        if len({(str(e["ids"]), str(e["position"])) for e in events}) > 1:
            raise CaptureDefect("drift", f"before replay {events[0]['n']} the static inputs differ, rank by rank: "
                                f"ids {[e['ids'] for e in events]}, position {[e['position'] for e in events]}. Every "
                                "rank must feed back the same next token (the argmax of the whole logits, computed "
                                "identically on every rank) and advance the position alike")
    if kind == "done":
        if len({e["replays"] for e in events}) > 1:
            raise CaptureDefect("one_rank", f"the ranks replayed {[e['replays'] for e in events]} time(s) (rank by "
                                "rank)")
        tokens = [e["tokens"] for e in events]
        if any(t != tokens[0] for t in tokens):
            raise CaptureDefect("drift", f"rank by rank, the tokens returned: {tokens}. Every rank must feed back the "
                                "same next token: the argmax of the whole logits, computed identically on every rank")
