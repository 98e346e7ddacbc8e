"""Exercise 08's check: the learner's per-rank capture, run on every rank, watched so no defect can hang.

The learner writes ``tp_generate(ctx, step, ids, position, n_tokens, cg)``: warm the step up, capture it (its
all-reduces inside) in one graph per rank, and replay it in lockstep to decode ``n_tokens`` greedy tokens. The check
(:func:`check_capture`) starts the ranks (NCCL on 2+ GPUs, else gloo CPU processes) and runs it there with:

- a **watched step** (:class:`WatchedStep`): it counts the calls made eagerly and inside a capture, and refuses, on
  every rank alike, a capture of the step (and so of its collectives) before the step ever ran eagerly: NCCL makes
  a group's communicator on its first collective, which a capture cannot do;
- a **watched graph API** (:class:`WatchedGraphs`, passed as ``cg``): before each replay, and once when
  ``tp_generate`` returns, every rank tells the others, over a separate gloo group with a time limit, what it is
  about to do (replay number ``k`` of a graph holding ``c`` steps; or "done after ``r`` replays", with its tokens).
  The ranks see the same list, so they all stop, with the same named ✗, before any mismatched collective runs:
  a rank that captured a different branch, a replay on some ranks only, tokens that drift apart. None of them
  can hang; the launch's own time limit bounds the rest.

The tokens are then compared with TP=1 (the same model whole on each rank). :data:`DEFECTS` names every ✗.
"""
from __future__ import annotations

import datetime

DEFECTS = {
    "not_warmed": "the step (and its all-reduces) was captured before it ever ran eagerly on this rank",
    "branch": "the ranks captured different graphs",
    "one_rank": "not every rank replays",
    "drift": "the ranks' tokens drift apart",
    "wrong": "the tokens differ from TP=1",
}


class CaptureDefect(AssertionError):
    """A defect of the learner's capture, named by ``kind`` (a key of :data:`DEFECTS`); the same on every rank."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"{DEFECTS[kind]}: {message}")
        self.kind = kind


class Referee:
    """Every rank's account of what it does next, exchanged over a gloo group with a time limit."""

    def __init__(self, ctx, timeout_s: float = 60.0):
        import torch.distributed as dist

        self.ctx = ctx
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.capture_calls = 0  # step calls inside the current capture
        self.eager_calls = 0
        self.replays = 0

    def exchange(self, event: tuple) -> list:
        """Every rank's ``event``, in rank order (one all-gather on the referee's group)."""
        import torch.distributed as dist

        out = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, event, group=self.group)
        return out

    def before_replay(self, graph_steps: int) -> None:
        """Called by every replay: the ranks must all be replaying, the same graph, at the same count."""
        self.replays += 1
        events = self.exchange(("replay", self.replays, graph_steps))
        if len(set(events)) > 1:
            judge(events)

    def done(self, tokens: list) -> list:
        """Called once ``tp_generate`` returned: every rank's tokens (after checking the ranks' accounts agree)."""
        events = self.exchange(("done", self.replays, tuple(tokens)))
        judge(events)
        return list(events[0][2])


def judge(events: list) -> None:
    """Raise :class:`CaptureDefect` when the ranks' accounts (one per rank) disagree; say which ranks and how."""
    kinds = [e[0] for e in events]
    if len(set(kinds)) > 1:
        replaying = [r for r, k in enumerate(kinds) if k == "replay"]
        finished = {r: e[1] for r, e in enumerate(events) if e[0] == "done"}
        raise CaptureDefect("one_rank", f"rank(s) {replaying} went on replaying while rank(s) {sorted(finished)} had "
                            f"finished after {sorted(set(finished.values()))} replay(s). A graph that holds "
                            "collectives must be replayed on every rank, the same number of times (else its "
                            "all-reduces wait forever for the ranks that never come)")
    if kinds[0] == "replay":
        steps = [e[2] for e in events]
        if len(set(steps)) > 1:
            raise CaptureDefect("branch", f"each rank's graph holds {steps} step call(s) (rank by rank), so their "
                                "collectives differ. Every rank must capture the same code path (no branch on the "
                                "rank inside the capture)")
        return
    replays = [e[1] for e in events]
    if len(set(replays)) > 1:
        raise CaptureDefect("one_rank", f"the ranks replayed {replays} time(s) (rank by rank)")
    tokens = [e[2] for e in events]
    if any(t != tokens[0] for t in tokens):
        at = next(i for i in range(min(map(len, tokens))) if len({t[i] for t in tokens}) > 1) \
            if min(map(len, tokens)) else 0
        raise CaptureDefect("drift", f"from token {at} on, rank by rank: {[list(t[at:at + 4]) for t in tokens]}. "
                            "Every rank must feed back the same next token: the argmax of the whole logits, "
                            "computed identically on every rank (or chosen on one rank and broadcast)")


class WatchedStep:
    """``step`` with its calls counted; refuses a capture before any eager call (see the module doc)."""

    def __init__(self, step, referee: Referee, cg):
        self.step, self.referee, self.cg = step, referee, cg

    def __call__(self, ids, position):
        if self.cg.is_current_stream_capturing():
            if self.referee.eager_calls == 0:
                raise CaptureDefect("not_warmed", "warm it up first (run it a few times on a side stream): NCCL "
                                    "makes a group's communicator, and buffers, on its first collective, which "
                                    "cannot happen inside a capture")
            self.referee.capture_calls += 1
        else:
            self.referee.eager_calls += 1
        return self.step(ids, position)


class WatchedGraph:
    """A graph whose replays go through the referee first."""

    def __init__(self, graph, referee: Referee):
        self.graph, self.referee, self.steps = graph, referee, None

    def capture_begin(self, *args, **kwargs):
        """Begin a capture (counts the step calls inside it)."""
        self.referee.capture_calls = 0
        return self.graph.capture_begin(*args, **kwargs)

    def capture_end(self):
        """End the capture; remember how many step calls it holds."""
        out = self.graph.capture_end()
        self.steps = self.referee.capture_calls
        return out

    def replay(self):
        """Check with every rank, then replay."""
        self.referee.before_replay(self.steps)
        return self.graph.replay()

    def __getattr__(self, name):
        return getattr(self.graph, name)


class WatchedGraphs:
    """The graph API (``course.graphs()``) with :class:`WatchedGraph` graphs; ``cg.graph(g)`` captures through them."""

    def __init__(self, cg, referee: Referee):
        self._cg, self._referee = cg, referee

    def CUDAGraph(self, *args, **kwargs):  # noqa: N802 - torch.cuda's name
        """A watched graph."""
        return WatchedGraph(self._cg.CUDAGraph(*args, **kwargs), self._referee)

    def graph(self, g, *args, **kwargs):
        """``cg.graph(g)`` on the inner graph, counting the step calls captured into ``g``."""
        return _Capture(self._cg, g, args, kwargs)

    def __getattr__(self, name):
        return getattr(self._cg, name)


class _Capture:
    def __init__(self, cg, g, args, kwargs):
        self.g = g
        inner = g.graph if isinstance(g, WatchedGraph) else g
        self.ctx = cg.graph(inner, *args, **kwargs)

    def __enter__(self):
        if isinstance(self.g, WatchedGraph):
            self.g.referee.capture_calls = 0
        return self.ctx.__enter__()

    def __exit__(self, *exc):
        out = self.ctx.__exit__(*exc)
        if isinstance(self.g, WatchedGraph):
            self.g.steps = self.g.referee.capture_calls
        return out
