"""Lesson 07's checks on the course's harness (:mod:`course.core.harness`): what the learner's code
did, judged by named rules, one outcome, in the same words on the laptop and on the GPU.

- 07.1 :func:`check_rms_gemv`: ``rms_gemv`` on two shapes that are not multiples of the blocks,
  with a large ``eps``; a wrong result is named by the wrong version it matches (:data:`WRONG`).
- 07.2 :func:`check_gap_prediction`: the idle time between the kernels without PDL, summed.
- 07.3 :func:`check_two_stage`: ``two_stage`` run by co-operating programs under Triton's
  interpreter (:mod:`.coop`) in both of its schedules, twice each on the same barrier words, every
  launch judged by :data:`BARRIER_RULES`. On a GPU that runs in a subprocess, then the kernel is
  compiled for real in another, with a time limit (a barrier that never opens hangs the GPU).
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import types

import torch

import course
from course.core.checks import FAIL, PASS, exercise
from course.core.harness import Defect, Outcome, Rule, check, outcome_of
from course.core.triton_path import interpreting
from course.lessons.last_mile import coop
from course.lessons.last_mile.timeline import gaps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(course.__file__)))
SHAPE_KEY = "Cannot make_shape_compatible"


def source_of(kernel, todo: str) -> str:
    """The source of the learner's ``kernel``; "not done yet" (``todo``) while it raises
    NotImplementedError."""
    src = inspect.getsource(getattr(kernel, "fn", kernel))
    if "NotImplementedError" in src:
        raise NotImplementedError(todo)
    return src


def _shape_error(error) -> str:
    """Triton's refusal of two tiles whose shapes do not combine, in its words, from ``error``'s
    chain ('' if none): the same words compiled (in a CompilationError) and interpreted."""
    found, seen = "", 0
    while error is not None and seen < 8:
        for line in str(error).splitlines():
            if SHAPE_KEY in line:
                found = line[line.index(SHAPE_KEY):].strip()
        error, seen = error.__cause__ or error.__context__, seen + 1
    return found


@contextlib.contextmanager
def tile_shapes():
    """Triton's refusal of two tiles whose shapes do not combine, as the rule "tile_shape"'s ✗."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - only Triton's shape refusal is named here
        why = _shape_error(e)
        if not why:
            raise
        raise Defect("tile_shape", f"a tile of the wrong shape: Triton cannot combine two of your "
                                   f"tiles ({why}). A load's tile has the shape of its offsets: "
                                   "compare the shapes of the tiles each line combines") from e


# ---------------------------------------------------------------- 07.1 a fused RMSNorm + GEMV
SHAPES = ((24, 80, 16, 32), (16, 64, 8, 64))  # (N, K, BLOCK_N, BLOCK_K): not multiples of blocks
EPS = 0.25  # large on purpose: a kernel that forgets eps is off by far more than rounding
# the wrong versions a result is named by: (rule, the ✗, rms_gemv_reference's keywords)
WRONG = (("no_norm", "x is not normalized (no RMSNorm at all: neither 1/RMS nor nw)",
          {"norm": False, "weight": False}),
         ("no_rms", "x is multiplied by nw but not divided by its RMS", {"norm": False}),
         ("no_weight", "the norm weight nw is not applied", {"weight": False}),
         ("no_eps", "eps is missing from the square root", {"use_eps": False}),
         ("mean_over_block", "the mean divides by the block width, not by K (sum / BLOCK_K)",
          {"count": "BLOCK_K"}))


def rms_gemv_reference(x, nw, w, eps: float, *, norm: bool = True, weight: bool = True,
                       use_eps: bool = True, count=None):
    """``w @ (nw * x * rsqrt(mean(x^2) + eps))`` in float64; its keywords make wrong versions."""
    x, nw, w = x.double(), nw.double(), w.double()
    mean = (x * x).sum() / (count or x.numel())
    n = x * torch.rsqrt(mean + (eps if use_eps else 0.0)) if norm else x
    return w @ (n * nw if weight else n)


@dataclasses.dataclass
class GemvRun:
    """One run of the learner's ``rms_gemv`` on one shape: its inputs and its output ``got``."""

    n: int
    k: int
    bn: int
    bk: int
    x: torch.Tensor
    nw: torch.Tensor
    w: torch.Tensor
    got: torch.Tensor

    def matches(self, **kw) -> bool:
        """True when ``got`` is :func:`rms_gemv_reference`'s result with ``kw``."""
        kw = {**kw, "count": self.bk} if kw.get("count") == "BLOCK_K" else kw
        want = rms_gemv_reference(self.x, self.nw, self.w, EPS, **kw)
        return torch.allclose(self.got.double(), want, rtol=1e-4, atol=1e-5)

    @property
    def where(self) -> str:
        """The shape, as the ✗ names it."""
        return f"[{self.n} x {self.k}], BLOCK_N={self.bn}, BLOCK_K={self.bk}"


def _unwritten(r: GemvRun) -> str:
    bad = int(r.got.isnan().sum())
    return bad and (f"[{r.n} x {r.k}], BLOCK_N={r.bn}: {bad} of the {r.n} outputs were never "
                    "written: does every program store its rows (mask rows < N)?")


def _differs(r: GemvRun) -> str:
    want = rms_gemv_reference(r.x, r.nw, r.w, EPS)
    d = float((r.got.double() - want).abs().max())
    return not r.matches() and (f"{r.where}: largest difference {d:.3g} (outputs of size "
                                f"~{float(want.abs().max()):.2g})")


GEMV_RULES = [Rule("unwritten", "", _unwritten),
              *[Rule(rule, "", lambda r, why=why, kw=kw: not r.matches() and r.matches(**kw)
                     and f"{r.where}: {why}") for rule, why, kw in WRONG],
              Rule("wrong", "", _differs)]


def check_rms_gemv(kernel, name: str = "07.1 a fused RMSNorm + GEMV") -> None:
    """07.1: the learner's ``rms_gemv`` on :data:`SHAPES`, judged by :data:`GEMV_RULES`."""
    with exercise(name, hint=[
            "one program owns BLOCK_N rows: first the sum of x*x over all K (a loop over chunks), "
            "then the product, chunk by chunk, with the normalized chunk",
            "in rms_gemv: rstd = 1 / sqrt(mean of x*x + eps), with the mean over K (not over a "
            "block); every load is masked with c < K (and rows < N for w)",
            "a smaller example, in plain torch: rstd = 1 / torch.sqrt((x * x).sum() / K + eps); "
            "y = w @ (nw * x * rstd)"],
            answer="rstd = 1 / tl.sqrt(tl.sum(acc) / K + eps); n = tl.load(nw_ptr + c) * x * rstd; "
                   "acc += tl.load(w_ptr + rows[:, None] * K + c[None, :], mask=...) * n[None, :]; "
                   "tl.store(y_ptr + rows, tl.sum(acc, axis=1), mask=rows < N)"):
        source_of(kernel, "write the body of rms_gemv first")
        dev = course.device()
        g = torch.Generator().manual_seed(7)
        for n, k, bn, bk in SHAPES:
            x, nw = torch.randn(k, generator=g), 1.0 + 0.5 * torch.randn(k, generator=g)
            w = torch.randn(n, k, generator=g) / k ** 0.5
            y = torch.full((n,), float("nan"), device=dev)
            with tile_shapes():
                kernel[(-(-n // bn),)](x.to(dev), nw.to(dev), w.to(dev), y, n, k, EPS,
                                       BLOCK_N=bn, BLOCK_K=bk)
            check(GemvRun(n, k, bn, bk, x, nw, w, y.cpu()), GEMV_RULES)


# ---------------------------------------------------------------- 07.2 predict what PDL saves
def idle_between_kernels(timeline, variant: str = "Triton") -> float:
    """Sum of the positive gaps between consecutive kernels of ``variant`` in a timeline (us)."""
    rows = sorted((r for r in timeline.rows if r["variant"] == variant), key=lambda r: r["index"])
    if not rows:
        have = sorted({r["variant"] for r in timeline.rows})
        raise ValueError(f"the timeline has no rows of {variant!r}; it has {have}")
    return sum(g for g in gaps(rows) if g > 0)


def _gap_sum(said_want) -> str:
    said, want = said_want
    ok = said is not None and abs(said - want) <= 1e-6 * max(1.0, abs(want))
    return not ok and f"you said {said}, the timeline's rows give {want:.2f} us"


GAP_RULES = [Rule("sum_of_gaps", "", _gap_sum)]


def check_gap_prediction(fn, timeline, name: str = "07.2 predict what PDL saves") -> None:
    """07.2: the learner's ``fn(timeline)``, the idle time between the kernels without PDL (us)."""
    with exercise(name, hint=[
            "the GPU idles between two kernels when the next one starts after the previous one "
            "ended",
            "in your function: take the rows of variant 'Triton' in order of 'index'; the idle "
            "time before a kernel is its start_us minus the previous kernel's end_us, when that "
            "is positive",
            "a smaller example: kernels at 0-5, 7-9 and 8-12 us idle 2 us (7 - 5), then none "
            "(8 < 9): 2 us in all"],
            answer="sum(max(0, b['start_us'] - a['end_us']) for a, b in zip(rows, rows[1:]))"):
        check((fn(timeline), idle_between_kernels(timeline)), GAP_RULES)


# ---------------------------------------------------------------- 07.3 two stages, one barrier
N, BLOCK, PROGRAMS = 32, 8, 4
SECOND = " (on the second launch: the barrier words as the first left them)"
DEADLOCK = ("every program waits for an arrival that never comes (a deadlock, stopped {how}). The "
            "count it waits for must be the number of programs (tl.num_programs(0)), and every "
            "program must arrive")


def inputs(seed: int = 0) -> tuple:
    """``(x, w1, w2)`` float32 on the CPU, seeded."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(N, generator=g), torch.randn(N, N, generator=g) / N ** 0.5,
            torch.randn(N, N, generator=g))


def _diff(y, x, w1, w2) -> str:
    want = w2.double() @ (w1.double() @ x.double())
    d, size = (y.double() - want).abs().max(), float(want.abs().max())
    return "" if d <= 1e-4 * max(1.0, size) else \
        f"largest difference {float(d):.3g} (values of size ~{size:.2g})"


@dataclasses.dataclass
class Launch:
    """One launch of the learner's ``two_stage``: what :data:`BARRIER_RULES` judge."""

    index: int  # 0: on fresh barrier words; 1: on the words the launch before left
    schedule: str  # coop's schedule ("turns", "ahead"), or "gpu" (compiled)
    diff: str  # how y differs from W2 @ (W1 @ x); '' when right
    flag: int  # the barrier's error flag after the launch (a spin limit ran out)
    start: list  # the barrier words the launch began with
    trace: object = None  # what the co-operating programs did (a coop.Trace; None on the GPU)

    @property
    def race(self):
        """The first unordered pair of accesses to h, or None."""
        return next((r for r in self.trace.races if r.buffer == "h"), None) if self.trace else None

    @property
    def tail(self) -> str:
        """Where the ✗ was seen, unless on the first launch under the interpreter."""
        return (" (compiled, on the GPU)" if self.schedule == "gpu" else "") + \
            (SECOND if self.index else "")


def _deadlock(l: Launch) -> str:
    if l.trace is not None and l.trace.deadlock:
        how = "when every program was spinning and nothing changed"
    elif l.flag:
        how = "on the GPU by its spin limit" if l.schedule == "gpu" else "by its spin limit"
    else:
        return ""
    return DEADLOCK.format(how=how) + l.tail


def _raced(when, text, tail: bool = True):
    """A rule's test: the first race on h where ``when(launch)``, ``text(launch)`` after it."""
    return lambda l: l.race is not None and when(l) and f"{l.race}{text(l)}{l.tail * tail}"


def _late_weights(l: Launch) -> str:
    first = [f for f, _ in l.trace.reads.get("w2", []) if f is not None] if l.trace else []
    return bool(first) and all(f > 0 for f in first) and (
        "while the programs wait at the barrier, nothing is being read from memory. Issue W2's "
        "loads before the barrier")


BARRIER_RULES = [
    Rule("deadlock", "the barrier never opens", _deadlock),
    Rule("no_barrier", "no barrier between the stages", _raced(
        lambda l: not any(l.trace.atomics),
        lambda l: ". Stage 2 reads every row of h; wait for all programs first")),
    Rule("early_read", "h was loaded before the wait", _raced(
        lambda l: l.race.atomics == 0,
        lambda l: ". h is written by stage 1 (an activation): load it only after the barrier; "
                  "only weights, which nothing writes, may be loaded before it")),
    Rule("not_reset", "the barrier works once, not on the next launch", _raced(
        lambda l: l.index == 1,
        lambda l: f"{SECOND[:-1]}, {l.start}). Whatever a barrier counts must be ready for the "
                  "next launch when it opens", tail=False)),
    Rule("no_wait", "the barrier does not wait", _raced(
        lambda l: l.schedule == "ahead",
        lambda l: f" (program {l.race.reader} ran ahead of the others). A program that arrives "
                  "early must wait until every program has arrived, however the programs are "
                  "scheduled: one look at the count is not a wait")),
    Rule("leaky_barrier", "the barrier let a program through before every write of h was ordered "
                          "before it", _raced(
        lambda l: True,
        lambda l: ". Is its count smaller than the number of programs, or does an atomic lack "
                  "sem='release' (arrive) or sem='acquire' (wait)?")),
    Rule("wrong", "y is wrong (no race found)", lambda l: l.diff and l.diff + l.tail),
    Rule("late_weights", "y is right, but W2 is loaded only after the wait", _late_weights),
]


def _launches(kernel, device=None, spin: int = 500):
    """Each :class:`Launch` of ``kernel`` in the order judged: interpreted, the first launch in
    each of coop's schedules, then the second on the barrier words the first left; or compiled on
    ``device``, two launches."""
    x, w1, w2 = (t.to(device) for t in inputs()) if device else inputs()
    schedules = ("gpu",) if device else coop.SCHEDULES
    bars = {s: torch.zeros(4, dtype=torch.int32, device=device) for s in schedules}
    for index in range(2):
        for schedule, bar in bars.items():
            start, trace = bar.tolist(), None
            h, y = (torch.full((N,), float("nan"), device=device) for _ in range(2))
            if device:
                kernel[(PROGRAMS,)](x, w1, h, w2, y, bar, spin, N=N, BLOCK=BLOCK)
                torch.cuda.synchronize()
            else:
                trace = coop.run(kernel, PROGRAMS, x, w1, h, w2, y, bar, spin, schedule=schedule,
                                 watch={"h": h, "w2": w2}, N=N, BLOCK=BLOCK)
            yield Launch(index, schedule, _diff(y.cpu(), *inputs()), int(bar[2]), start, trace)


def _judge_launches(kernel, device=None) -> None:
    with tile_shapes():
        for launch in _launches(kernel, device, spin=1 << 20 if device else 500):
            check(launch, BARRIER_RULES)


def two_stage_outcome(kernel, device=None) -> Outcome:
    """07.3's one outcome for ``kernel``: interpreted (the laptop's check, the GPU's first half),
    or compiled on ``device``."""
    return outcome_of(_judge_launches, kernel, device)[0]


def kernel_source(kernel) -> str:
    """The kernel's source, after that of each jit function of its own notebook or module it
    calls (a ``grid_sync`` of the learner's): what it needs to run on its own."""
    fn = kernel.fn
    helpers = [v.fn for n in fn.__code__.co_names
               if isinstance(getattr(v := fn.__globals__.get(n), "fn", None), types.FunctionType)
               and v.fn.__module__ == fn.__module__]
    return "\n\n".join(textwrap.dedent(inspect.getsource(f)) for f in (*helpers, fn))


def judge_source(src: str, name: str, path: str = "sim", timeout: float = 120.0) -> Outcome:
    """07.3's outcome for kernel ``name`` of ``src`` (:func:`kernel_source`) run on its own in a
    subprocess: ``path="sim"`` interpreted, ``"cuda"`` compiled, ended after ``timeout`` s."""
    env = {**os.environ, "COURSE_PATH": path,
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    env.pop("TRITON_INTERPRET", None)
    device = "cuda" if path == "cuda" else None
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "learner_kernel.py"), "w") as f:
            f.write("import triton\nimport triton.language as tl\ntr = triton\n"
                    "from course.lessons.last_mile.persistent import grid_sync\n\n" + src)
        code = (f"import sys, json, dataclasses; sys.path.insert(0, {tmp!r})\n"
                "import course; course.header()\nimport learner_kernel\n"
                "from course.lessons.last_mile.checks import two_stage_outcome\n"
                f"o = two_stage_outcome(learner_kernel.{name}, device={device!r})\n"
                "print('OUTCOME', json.dumps(dataclasses.asdict(o), default=str))")
        try:
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                 env=env, timeout=timeout)
        except subprocess.TimeoutExpired:
            how = f"on the GPU after {timeout:.0f} s, the process ended"
            return Outcome(FAIL, "deadlock", "the barrier never opens: " + DEADLOCK.format(how=how))
    for line in out.stdout.splitlines():
        if line.startswith("OUTCOME "):
            return Outcome(**json.loads(line[8:]))
    raise RuntimeError("the kernel could not run on its own (it may use only triton, tr, tl and "
                       f"grid_sync): {out.stderr.strip()[-800:]}")


def check_two_stage(kernel, name: str = "07.3 two stages, one launch, one barrier") -> None:
    """07.3: the learner's ``two_stage`` kernel, judged as the module doc says."""
    with exercise(name, hint=[
            "a program may read what another program wrote only after a grid barrier that every "
            "program reaches; what nobody writes during the launch (the weights) may be loaded "
            "before it",
            "in two_stage, between stage 1's store and stage 2's product: for each tensor stage 2 "
            "reads, ask whether another program writes it during this launch, and so where its "
            "load may stand",
            "a smaller example, two programs: program 0 stores a[0], program 1 stores a[1]; each "
            "then needs a[0] + a[1]: store, arrive at the barrier, wait until 2 have arrived, then "
            "load a"],
            answer="w2 = tl.load(w2_ptr + rows[:, None] * N + cols[None, :]); grid_sync(bar_ptr, "
                   "tl.num_programs(0), spin); h = tl.load(h_ptr + cols)"):
        source_of(kernel, "write the part of two_stage between the two stages first")
        if interpreting():
            outcome = two_stage_outcome(kernel)
        else:
            src, fn_name = kernel_source(kernel), kernel.fn.__name__
            outcome = judge_source(src, fn_name, "sim")
            if outcome.status == PASS or outcome.rule == "late_weights":
                gpu = judge_source(src, fn_name, "cuda", timeout=90.0)
                outcome = outcome if gpu.ok else gpu
        outcome.raise_()
