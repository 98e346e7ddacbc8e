"""Exercise 08.1's rules: every rank's trace judged in lockstep, then why the tokens are not TP=1's.

:func:`lockstep` reads event k of every rank's trace together (:mod:`.watch`): an error on a rank,
ranks that disagree (a warm-up on some ranks only, a branch on the rank, a replay on one rank,
tokens that drift apart), then each rank's own rules; the first broken is every rank's ✗. When
every rank returned alike, :data:`TOKENS` say from the trace why the tokens differ from TP=1's.
"""
from __future__ import annotations

from functools import partial

from course.core.checks import FAIL, PASS, TODO
from course.core.harness import Outcome, Rule, judge, warmup_problem

STEP = "step(ids, position)"
LAZY = "Lazy set-up (NCCL's communicator and buffers, cuBLAS handles, first-use allocations)"


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


def rule(name: str, test) -> Rule:
    """A rule of 08.1, titled from :data:`TITLES`."""
    return Rule(name, TITLES[name], test)


class At:
    """One rank's trace at lockstep point k: ``e`` its event k (or its last), ``seen`` the ones
    before."""

    def __init__(self, events, k: int, n_tokens: int):
        k = min(k, len(events) - 1)
        self.e, self.seen, self.n = events[k], events[:k], n_tokens

    def of(self, *whats) -> list:
        """The events before ``e`` of kinds ``whats``."""
        return [e for e in self.seen if e["what"] in whats]

    @property
    def warm(self) -> list:
        """The eager step calls before the first capture."""
        caps = [i for i, e in enumerate(self.seen) if e["what"] in ("capture", "end")]
        return [e for e in self.seen[:caps[0] if caps else None] if e["what"] == "eager"]


def _eager_after(a: At) -> str:
    return a.e["what"] == "eager" and bool(a.of("capture", "end")) and (
        f"after the capture tp_generate called {STEP} eagerly: each token must come from a replay "
        "of the graph, not from the eager step")


def _warm_up(a: At) -> str:
    if a.e["what"] != "capture" or a.of("capture", "end"):
        return ""  # judged at the first captured step call
    return warmup_problem([e["where"] for e in a.warm], STEP, LAZY) or a.e["order"]


def _graphs(a: At) -> str:
    e = a.e
    if e["what"] == "capture" and e["call"] == 1 and e["graph"] > 1:
        return (f"tp_generate began a {nth(e['graph'])} capture of the step: capture it once, in "
                "one graph per rank, and replay that graph for every token")
    if e["what"] != "end" or e["steps"] == 1:
        return ""
    if not e["steps"]:
        return f"a capture holds no call of the step: call {STEP} inside the capture"
    return (f"the capture calls the step {e['steps']} times: capture one step (and its next "
            "token) and replay it once per token")


def _replays(a: At) -> str:
    e, n = a.e, a.n
    if e["what"] == "replay" and e["n"] > n:
        return f"tp_generate replayed the graph more than {n} times for {n} tokens: one per token"
    if e["what"] == "done" and a.of("end") and e["replays"] != n:
        return f"{e['replays']} replay(s) of the graph for {n} tokens: each token comes from one"
    return ""


def _no_graph(a: At) -> str:
    return a.e["what"] == "done" and not a.of("end") and (
        f"tp_generate captured no graph: its {a.n} token(s) came from {len(a.of('eager'))} eager "
        "call(s) of the step")


PER_RANK = [rule("eager_after_capture", _eager_after), rule("warm_up", _warm_up),
            rule("graphs", _graphs),
            rule("shape", lambda a: a.e["what"] == "done" and a.e["shape"]),
            rule("no_graph", _no_graph), rule("replays", _replays)]


def _split(ats) -> tuple:
    """``(capturing ranks, eager ranks)`` where some ranks capture the step, others run it."""
    kinds = [a.e["what"] for a in ats]
    if set(kinds) != {"eager", "capture"}:
        return (), ()
    return ([r for r, k in enumerate(kinds) if k == "capture"],
            [r for r, k in enumerate(kinds) if k == "eager"])


def _one_rank_warm(ats) -> str:
    cap, eag = _split(ats)
    return cap and not any(ats[r].warm for r in cap) and (
        f"rank(s) {eag} ran the step eagerly while rank(s) {cap} began capturing it without any "
        "warm-up. Every rank must run the same warm-up (its all-reduces meet only when every rank "
        "runs them), then capture")


def _elsewhere(a: At) -> bool:
    """The eager call ``e`` is no warm-up step: it comes from another line, or after a capture."""
    return a.e["line"] not in {e["line"] for e in a.warm} or bool(a.of("end"))


def _warm_count(ats) -> str:
    cap, eag = _split(ats)
    return cap and not any(_elsewhere(ats[r]) for r in eag) and (
        f"rank(s) {eag} ran the warm-up step a {nth(len(ats[eag[0]].of('eager')) + 1)} time while "
        f"rank(s) {cap} began capturing after {sorted({len(ats[r].warm) for r in cap})} warm-up "
        "step(s). Every rank must run the same number of warm-up steps (nothing that depends on "
        "ctx.rank), then capture")


def _capture_one(ats) -> str:
    cap, eag = _split(ats)
    return cap and (
        f"rank(s) {cap} began capturing the step while rank(s) {eag} ran it eagerly (outside "
        "their warm-up). Every rank must capture the same step and replay it: an eager all-reduce "
        "on one rank never meets a captured one, which runs only at replay")


def _describe(ats) -> str:
    what = {"eager": lambda e: "an eager step call", "replay": lambda e: f"replay {e['n']}",
            "capture": lambda e: f"step call {e['call']} inside capture {e['graph']}",
            "end": lambda e: f"the end of capture {e['graph']} ({e['steps']} step call(s))",
            "done": lambda e: "the return"}
    return "; ".join(f"rank {r}: {what[a.e['what']](a.e)}" for r, a in enumerate(ats))


BRANCH = (". Every rank must capture the same code path (no branch on the rank inside the "
          "capture), so that their graphs hold the same all-reduces")
ONE_RANK = (". A graph that holds collectives must be replayed on every rank, the same number of "
            "times (else its all-reduces wait forever for the ranks that never come)")


def _kinds(ats, branch: bool) -> str:
    kinds = {a.e["what"] for a in ats}
    if len(kinds) < 2 or ("capture" in kinds or {"end", "replay"} <= kinds) != branch:
        return ""
    return _describe(ats) + (BRANCH if branch else ONE_RANK)


def _same(ats, what: str, key) -> list:
    """Each rank's ``key`` of its event when every rank is at a ``what`` event, else []."""
    return [key(a.e) for a in ats] if all(a.e["what"] == what for a in ats) else []


def _branch_counts(ats) -> str:
    for what, key in (("capture", lambda e: (e["graph"], e["call"])),
                      ("end", lambda e: (e["graph"], e["steps"]))):
        if len(set(_same(ats, what, key))) > 1:
            return _describe(ats)
    steps = _same(ats, "replay", lambda e: e["steps"])
    return len(set(steps)) > 1 and (f"each rank's graph holds {steps} step call(s) (rank by "
                                    "rank), so their collectives differ. Every rank must capture "
                                    "the same code path")


def _replay_counts(ats) -> str:
    counts = _same(ats, "done", lambda e: e["replays"])
    return len(set(counts)) > 1 and f"the ranks replayed {counts} time(s) (rank by rank)"


def _drift(ats) -> str:
    inputs = _same(ats, "replay", lambda e: (e["ids"], e["position"]))
    if len({str(i) for i in inputs}) > 1:
        return (f"before replay {ats[0].e['n']} the static inputs differ, rank by rank: ids "
                f"{[i for i, _ in inputs]}, position {[p for _, p in inputs]}. Every rank must "
                "feed back the same next token (the argmax of the whole logits, computed "
                "identically on every rank) and advance the position alike")
    tokens = _same(ats, "done", lambda e: e["tokens"])
    return len({str(t) for t in tokens}) > 1 and (
        f"rank by rank, the tokens returned: {tokens}. Every rank must feed back the same next "
        "token: the argmax of the whole logits, computed identically on every rank")


CROSS_FIRST = [rule("warm_up_one_rank", _one_rank_warm), rule("warm_up_count", _warm_count),
               rule("capture_one_rank", _capture_one), rule("branch", partial(_kinds, branch=True)),
               rule("one_rank", partial(_kinds, branch=False))]
CROSS_THEN = [rule("branch", _branch_counts), rule("one_rank", _replay_counts),
              rule("drift", _drift)]


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
    alike = len(bad) == len(ats) and all(ats[r].e["message"] == first["message"] for r in bad)
    who = "every rank" if alike else f"rank {bad[0]}"
    return Outcome(FAIL, first["rule"], f"{TITLES[first['rule']]}: {who}: {first['message']}")


def lockstep(traces: list, n_tokens: int) -> Outcome | None:
    """The first rule broken at the same point of every rank's trace (event k of each), or None."""
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
    """One rank's whole trace, for the rules that say why its tokens differ from TP=1's."""

    def __init__(self, events: list, want: list, first: int):
        self.want, self.first = want, first
        self.tokens = events[-1].get("tokens")
        self.end = next((e for e in events if e["what"] == "end"), None)
        self.replays = [e for e in events if e["what"] == "replay"]
        self.fresh = next((e["fresh"] for e in events if "fresh" in e), [False, False])
        self.graph = [e["token"][0] for e in self.replays if e.get("token")]
        self.wrong = self.tokens != want and bool(self.replays)

    def inputs(self, which: str, when: str = "") -> list:
        """``which`` input's value before each replay (after, with ``when="_after"``)."""
        return [e[which + when][0] for e in self.replays if e.get(which + when)]

    def changed(self, e: dict) -> list:
        """What of the static inputs made before the capture differs in ``e`` from the start."""
        pos = e["position"][0]
        out = [f"position held {pos}"] if pos and not self.fresh[1] else []
        if not self.fresh[0] and e["ids"][0] != self.first:
            out.append("ids no longer held the first token")
        return out


def _rebound(run: Run) -> str:
    e = next((e for e in run.replays if e["rebound"]), None)
    return run.wrong and e is not None and (
        f"before replay {e['n']}, `{e['rebound']}` named a new tensor, not the one the graph "
        f"captured (an assignment `{e['rebound']} = ...`): the graph still reads the tensor it "
        "saw at capture, which never changes")


def _frozen(run: Run) -> str:
    for i, name in enumerate(("ids", "position")):
        after = run.inputs(name, "_after")
        written = any(b != a for b, a in zip(run.inputs(name), after))
        if run.wrong and len(after) > 1 and len(set(after)) == 1 and (written or run.fresh[i]):
            what = f"at position {after[0]}" if name == "position" else f"token {after[0]}"
            return (f"every replay decoded {what}: the `{name}` the graph reads was fixed at "
                    "capture (a Python value, or a tensor made inside the capture), so nothing the "
                    "loop does to it reaches the replays")
    return ""


def _reset(run: Run) -> str:
    ended = run.end is not None and run.changed(run.end)
    return run.wrong and ended and run.changed(run.replays[0]) and (
        f"when the capture ended, {' and '.join(ended)} (tp_generate began with the first token "
        "in ids at position 0): the warm-up decoded, and the replays went on from where it stopped")


def _early(run: Run) -> str:
    first = run.changed(run.replays[0]) if run.replays else []
    return run.wrong and run.end is not None and not run.changed(run.end) and first and (
        f"before the first replay {' and '.join(first)}, though the capture ended with the first "
        "token at position 0: tp_generate changed them before the replay that decodes the first "
        "token")


def _early_read(run: Run) -> str:
    t, g = run.tokens, run.graph
    return run.wrong and len(g) == len(t) > 1 and t != g and t[1:] == g[:-1] and (
        "token k returned is what replay k-1 wrote into the graph's output (and token 0 what it "
        "held before any replay)")


def _no_copy(run: Run) -> str:
    ids = run.inputs("ids")
    return run.wrong and len(ids) > 1 and len(set(ids)) == 1 and (
        f"ids held {ids[0]} before every replay, so every replay decoded the first token again "
        "(at the next position): the graph's next token never reached the tensor it reads")


def _no_advance(run: Run) -> str:
    pos = run.inputs("position")
    return run.wrong and len(pos) > 1 and len(set(pos)) == 1 and (
        f"position held {pos[0]} before every replay: every token was decoded at the same position")


def _no_clone(run: Run) -> str:
    g = run.graph
    return run.wrong and len(g) == len(run.tokens) > 1 < len(set(g)) and set(run.tokens) == {
        g[-1]} and (f"every token returned is the last one ({g[-1]}), while the replays made {g}: "
                    "the list held the graph's output tensor, which every replay overwrites")


def differ(got: list, want: list) -> str:
    """Where ``got`` first differs from TP=1's ``want`` ('' when it does not)."""
    at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    return "" if at is None else (f"from token {at} on: {got[at:at + 4]} where TP=1 gives "
                                  f"{want[at:at + 4]}")


TOKENS = [rule(n, t) for n, t in (
    ("rebound", _rebound), ("frozen", _frozen), ("reset", _reset), ("early", _early),
    ("early_read", _early_read), ("no_copy", _no_copy), ("no_advance", _no_advance),
    ("no_clone", _no_clone), ("wrong", lambda run: differ(run.tokens, run.want)))]


def verdict(traces: list, n_tokens: int, want: list, first: int) -> Outcome:
    """Every rank's trace judged in lockstep, then why rank 0's tokens differ from TP=1's."""
    out = lockstep(traces, n_tokens) or judge(Run(traces[0], want, first), TOKENS)
    return out if not out.ok else Outcome(PASS, detail={"tokens": traces[0][-1]["tokens"]})
