"""Exercises 08.1 and 08.2's checks on the harness: the learner's calls traced on every rank.

08.1 (``tp_generate``) runs twice on every rank: first on a step without collectives (the rank's
whole model), so no rank can wait for one that never comes; the ranks exchange their traces
(:mod:`.watch`, :func:`course.core.agree.exchange`) and judge them together (:mod:`.rules`). Once
they agree, it runs on the split step with its all-reduces, against TP=1. 08.2 (``split_layer``)
is traced for every rank of 2 and of 4 ranks (nothing computed) and judged, then decodes a few
tokens on every rank. :func:`check` launches either: one :class:`Outcome` per function.
"""
from __future__ import annotations

import gc
from functools import partial

import torch

from course.core.agree import exchange
from course.core.cell_workers import portable
from course.core.checks import CRASH, FAIL, PASS, TODO
from course.core.harness import Outcome, Rule, Tracer, agree, first_line, judge
from course.core.launch import WorkerError, WorkerTimeout, launch, plan
from course.core.runtime import runtime, synchronize
from course.lessons.last_mile.decoder import TritonDecoder, graphed
from course.lessons.real_model.generate import greedy
from course.lessons.real_model.model import build_model
from course.lessons.tensor_parallel.fused import FusedShardDecoder
from course.lessons.tensor_parallel.rules import differ, verdict
from course.lessons.tensor_parallel.tp import HandShardedDecoder, first_token
from course.lessons.tensor_parallel.watch import run_generate

EXCHANGE_S = 60.0  # a rank that does not bring its trace within this stops the others


# ---------------------------------------------------------------- the launch, one outcome each
def on_ranks(worker, fns, world_size: int = 2, timeout: float = 240.0, **kwargs) -> list:
    """Rank 0's :class:`Outcome` of ``worker`` (a check run on every rank) for each of ``fns``."""
    p = plan(world_size)
    try:
        return launch(worker, p.world_size, backend=p.backend, timeout=timeout,
                      pg_timeout=3 * EXCHANGE_S, fns=[portable(f) for f in fns], **kwargs)[0]
    except WorkerTimeout as e:
        lost = Outcome(FAIL, "timeout", f"the ranks did not all finish within {timeout:.0f} s (a "
                       "rank waiting in a collective that another never joins?); every process "
                       f"was stopped.\n{e}")
    except WorkerError as e:
        lost = Outcome(CRASH, "crash", f"rank {e.first} stopped outside the watched calls: {e}")
    return [lost] * len(fns)


def check(worker, fn, **kwargs):
    """One exercise's check on every rank: its tokens, or its ✗ (or "not done yet") raised."""
    out = on_ranks(worker, [fn], **kwargs)[0]
    out.raise_()
    return out.detail.get("tokens")


# ---------------------------------------------------------------- 08.1: tp_generate
def capture_worker(ctx, fns, n_tokens: int = 6, size="tiny") -> list:
    """Exercise 08.1 on every rank (see the module doc): one :class:`Outcome` per function of
    ``fns``, the same on every rank."""
    model = build_model(size, device=ctx.torch_device)
    first = first_token(ctx.torch_device, model.config.vocab_size)
    solo = HandShardedDecoder(model, 0, 1, max_len=64)  # this rank's whole model: no collective
    split = HandShardedDecoder(model, ctx.rank, ctx.world_size, max_len=64)
    want = greedy(solo.step, first, n_tokens)[0].tolist()  # TP=1
    del model
    gc.freeze()  # what is alive stays: each collection after a run looks at the run's objects
    try:
        return [judge_generate(ctx, getattr(fn, "load", lambda: fn)(), solo, split, first, want)
                for fn in fns]
    finally:
        gc.unfreeze()


def judge_generate(ctx, fn, solo, split, first, want: list) -> Outcome:
    """One ``tp_generate`` on this rank: traced on ``solo``, judged with every rank's trace, then
    run on ``split``."""
    ctx.say(f"judging {fn.__name__}")
    solo.reset()
    traces = exchange(run_generate(ctx, fn, solo.step, first, len(want)), timeout_s=EXCHANGE_S,
                      what="the trace of tp_generate")
    out = verdict(traces, len(want), want, int(first))
    if out.ok:  # every rank agreed: now with the all-reduces
        split.reset()
        trace = run_generate(ctx, fn, split.step, first, len(want))
        out = agree(verdict([trace], len(want), want, int(first)), timeout_s=EXCHANGE_S,
                    what="tp_generate's tokens")
    return out


check_capture = partial(check, capture_worker)


# ---------------------------------------------------------------- 08.2: split_layer, traced
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
    """A stand-in for one rank's decoder: each call noted on the tracer, nothing run."""

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
    """``fn``'s calls on every rank of ``world`` (``ranks[r][layer]``: events), or its error;
    ``label`` names this world size in a message ("" for the launch's own)."""

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
        return [r for r in range(self.world) for e in self.ranks[r][layer]
                if e["what"] == proj and e["residual"]]


def _each_layer(test):
    """A rule's test run on every layer of rank 0 (the ranks call alike: :func:`_branch`)."""
    def per_layer(s: Split) -> str:
        return next((why for i in range(len(s.ranks[0])) for why in [test(s, i)] if why), "")
    return per_layer


def _branch(s: Split) -> str:
    for i in range(len(s.ranks[0])):
        calls = [s.names(r, i) for r in range(s.world)]
        if any(c != calls[0] for c in calls):
            return (f"{s.label}rank by rank, layer {i} calls {calls}. A collective completes only "
                    "when every rank reaches it: no branch on the rank around an all-reduce (a "
                    "rank-dependent argument, such as which rank adds the residual, is fine)")
    return ""


def _kernels(s: Split, i: int) -> str:
    kernels = [n for n in s.names(0, i) if n != "all_reduce"]
    return kernels != list(ORDER) and f"layer {i} runs {kernels}, want {list(ORDER)}"


def _layer(s: Split, i: int) -> str:
    e = next((e for e in s.ranks[0][i] if e.get("layer", i) != i), None)
    return e is not None and f"layer {i} runs {e['what']} on layer {e['layer']}'s weights"


def _missing(s: Split, i: int) -> str:
    n = s.names(0, i).count("all_reduce")
    return n < 2 and (f"layer {i} has {n}, and each of o_proj and down_proj leaves a partial sum "
                      "on every rank that must be summed before the next kernel reads x")


def _misplaced(s: Split, i: int) -> str:
    return s.names(0, i) != PLACED and (
        f"layer {i} runs {s.names(0, i)}; an all-reduce belongs right after each partial sum "
        "(o_proj, down), before the next kernel that reads x whole, and nowhere else (a second sum "
        "of whole values multiplies them by the ranks)")


def _residual(s: Split, i: int, many: bool) -> str:
    where = f" in layer {i}" if i else ""
    for proj in ("o_proj", "down"):
        adders = s.adders(i, proj)
        if many and len(adders) > 1:
            return (f"{s.label}{proj} adds it on ranks {adders}{where}, so the all-reduce sums it "
                    f"{len(adders)} times; exactly one rank must add it")
        if not many and not adders:
            return f"{s.label}{proj} adds it on no rank{where}; exactly one rank must add it"
    return ""


SPLIT_RULES = [Rule(n, DEFECTS[n], t) for n, t in (
    ("branch", _branch), ("kernels", _each_layer(_kernels)), ("layer", _each_layer(_layer)),
    ("missing", _each_layer(_missing)), ("misplaced", _each_layer(_misplaced)),
    ("double", _each_layer(partial(_residual, many=True))),
    ("lost", _each_layer(partial(_residual, many=False))))]


def judge_split(fn, world: int) -> Outcome:
    """``fn``'s calls judged for every rank of ``world`` ranks, then of 4 (what 2 hide, 4 show)."""
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
    """Exercise 08.2 on every rank: each of ``fns`` traced and judged (agreed before anything runs),
    then run in the split fused step against lesson 07's step on the whole model."""
    fns = [getattr(f, "load", lambda: f)() for f in fns]
    verdicts = [agree(judge_split(fn, ctx.world_size), timeout_s=EXCHANGE_S,
                      what="split_layer's trace") for fn in fns]
    if not any(v.ok for v in verdicts):
        return verdicts
    model = build_model(size, device=ctx.torch_device)
    first = first_token(ctx.torch_device, model.config.vocab_size)
    pos0 = torch.zeros(1, dtype=torch.long, device=first.device)
    run = (lambda d: graphed(d, first.view(1, 1), pos0)) if runtime().on_gpu else (lambda d: d.step)
    want = greedy(run(TritonDecoder(model, n_tokens + 8)), first, n_tokens)[0].tolist()  # TP=1
    out = []
    for fn, v in zip(fns, verdicts):
        if v.ok:
            dec = FusedShardDecoder(model, ctx.rank, ctx.world_size, None, "nccl",
                                    max_len=n_tokens + 8, layer=fn)
            got = greedy(run(dec), first, n_tokens)[0].tolist()
            del dec
            gc.collect()
            synchronize()
            why = differ(got, want)
            v = agree(Outcome(FAIL, "wrong", f"{DEFECTS['wrong']} {why}") if why else
                      Outcome(PASS, detail={"tokens": got}), timeout_s=EXCHANGE_S,
                      what="split_layer's tokens")
        out.append(v)
    return out


check_split_layer = partial(check, split_worker)
