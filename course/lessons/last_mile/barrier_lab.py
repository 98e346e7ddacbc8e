"""Lesson 07's exercise on the persistent step (07.3): two stages in one launch, one grid barrier between them.

The learner's Triton kernel ``two_stage(x_ptr, w1_ptr, h_ptr, w2_ptr, y_ptr, bar_ptr, spin, N, BLOCK)`` computes
``h = W1 @ x`` (stage 1: each of :data:`PROGRAMS` programs owns ``BLOCK`` rows of h), then ``y = W2 @ h`` (stage 2:
each row of y needs all of h, so every program reads rows the others wrote). :func:`check_two_stage` runs it:

- under Triton's interpreter as co-operating programs (:mod:`.coop`), twice on the same barrier words (a barrier
  must serve the next launch too), watching who reads h and W2 when; this is the verdict on both paths (on a GPU
  it runs in a subprocess with the interpreter, :func:`judge_source`);
- on a GPU also compiled, for real, in a subprocess with a time limit (a barrier that never opens hangs the
  GPU there, so the subprocess is ended and the deadlock named).

Each wrong version is named (:data:`VERDICTS`): no barrier; a barrier that never opens (its count is not the
number of programs, or a program never arrives: a deadlock, stopped); a barrier that lets a program through
before every write of h is ordered before it (a count smaller than the grid, an atomic without release/acquire);
h loaded before the wait; W2 loaded only after the wait (correct, and slower: memory idles while the programs
wait).
"""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import tempfile
import textwrap

import torch

from course.core.checks import exercise

N, BLOCK, PROGRAMS = 32, 8, 4
NAME = "07.3 two stages, one launch, one barrier"
VERDICTS = {
    "deadlock": "the barrier never opens: every program waits for an arrival that never comes (a deadlock, stopped "
                "{how}). The count it waits for must be the number of programs (tl.num_programs(0)), and every "
                "program must arrive",
    "no barrier": "no barrier between the stages: {race}. Stage 2 reads every row of h; wait for all programs first",
    "early read": "h was loaded before the wait: {race}. h is written by stage 1 (an activation): load it only "
                  "after the barrier; only weights, which nothing writes, may be loaded before it",
    "leaky barrier": "the barrier let a program through before every write of h was ordered before it: {race}. Is "
                     "its count smaller than the number of programs, or does an atomic lack sem='release' (arrive) "
                     "or sem='acquire' (wait)?",
    "late weights": "y is right, but W2 is loaded only after the wait: while the programs wait at the barrier, "
                    "nothing is being read from memory. Issue W2's loads before the barrier",
    "wrong": "y is wrong (no race found): {diff}",
}
SOURCE_NAMES = ("triton", "tr", "tl", "grid_sync")  # what a kernel may use when it runs on its own (subprocesses)


def inputs(seed: int = 0) -> tuple:
    """``(x, w1, w2)`` float32 on the CPU, seeded."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, generator=g), torch.randn(N, N, generator=g) / N ** 0.5, torch.randn(N, N, generator=g)


def _diff(y, x, w1, w2) -> str:
    want = w2.double() @ (w1.double() @ x.double())
    d = (y.double() - want).abs().max()
    return "" if d <= 1e-4 * max(1.0, float(want.abs().max())) else \
        f"largest difference {float(d):.3g} (values of size ~{float(want.abs().max()):.2g})"


def judge(kernel) -> dict:
    """The verdict on ``kernel`` under the interpreter (:mod:`.coop`): ``{"verdict": key of VERDICTS or "ok",
    "message": ...}``; the laptop's check, and the GPU check's first half."""
    from course.lessons.last_mile import coop

    x, w1, w2 = inputs()
    bar = torch.zeros(4, dtype=torch.int32)
    for launch in range(2):  # the second launch finds the barrier words as the first left them
        h, y = torch.full((N,), float("nan")), torch.full((N,), float("nan"))
        trace = coop.run(kernel, PROGRAMS, x, w1, h, w2, y, bar, 500, watch={"h": h, "w2": w2}, N=N, BLOCK=BLOCK)
        verdict = _verdict(trace, bar, y, x, w1, w2, launch)
        if verdict["verdict"] != "ok":
            return verdict
    return verdict


def _verdict(trace, bar, y, x, w1, w2, launch: int) -> dict:
    """Name what ``trace`` (one launch) shows, in order: deadlock, a race on h, a wrong y, W2 loaded late."""
    which = "" if launch == 0 else " (on the second launch: the barrier words as the first left them)"
    if trace.deadlock or int(bar[2]):
        how = "when every program was spinning and nothing changed" if trace.deadlock else "by its spin limit"
        return {"verdict": "deadlock", "message": VERDICTS["deadlock"].format(how=how) + which}
    races = [r for r in trace.races if r.buffer == "h"]
    if races:
        r = races[0]
        key = "no barrier" if not any(trace.atomics) else "early read" if r.atomics == 0 else "leaky barrier"
        return {"verdict": key, "message": VERDICTS[key].format(race=str(r)) + which}
    diff = _diff(y, x, w1, w2)
    if diff:
        return {"verdict": "wrong", "message": VERDICTS["wrong"].format(diff=diff) + which}
    first = [f for f, _ in trace.reads.get("w2", []) if f is not None]
    if first and all(f > 0 for f in first):
        return {"verdict": "late weights", "message": VERDICTS["late weights"]}
    return {"verdict": "ok", "message": ""}


def judge_source(src: str, name: str, path: str = "sim", timeout: float = 120.0) -> dict:
    """Run ``src`` (a ``@triton.jit`` kernel's source, named ``name``) on its own in a subprocess: ``path="sim"``
    judges it under the interpreter (:func:`judge`), ``"cuda"`` runs it compiled on the GPU for real (y and the
    barrier's words after two launches), ended after ``timeout`` seconds (then: a deadlock)."""
    env = {**os.environ, "COURSE_PATH": path, "PYTHONPATH": os.pathsep.join([_root(), os.environ.get("PYTHONPATH",
                                                                                                    "")])}
    env.pop("TRITON_INTERPRET", None)
    with tempfile.TemporaryDirectory() as tmp:
        mod = os.path.join(tmp, "learner_kernel.py")
        with open(mod, "w") as f:
            f.write("import triton\nimport triton.language as tl\ntr = triton\n"
                    "from course.lessons.last_mile.persistent import grid_sync\n\n" + textwrap.dedent(src))
        code = (f"import sys, json; sys.path.insert(0, {tmp!r}); import course; course.header()\n"
                "from course.lessons.last_mile import barrier_lab as B\n"
                f"print('VERDICT', json.dumps(B._in_subprocess({name!r}, {path!r})))")
        try:
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                                 timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"verdict": "deadlock", "message": VERDICTS["deadlock"].format(
                how=f"on the GPU after {timeout:.0f} s, the process ended")}
    for line in out.stdout.splitlines():
        if line.startswith("VERDICT "):
            return json.loads(line[8:])
    raise RuntimeError(f"the kernel could not run on its own (it may use only {', '.join(SOURCE_NAMES)}): "
                       f"{out.stderr.strip()[-800:]}")


def _in_subprocess(name: str, path: str) -> dict:
    """Inside :func:`judge_source`'s subprocess: the verdict on the kernel of ``learner_kernel.py``."""
    import learner_kernel

    kernel = getattr(learner_kernel, name)
    if path == "sim":
        return judge(kernel)
    x, w1, w2 = (t.cuda() for t in inputs())
    bar = torch.zeros(4, dtype=torch.int32, device="cuda")
    for launch in range(2):
        h, y = torch.full((N,), float("nan"), device="cuda"), torch.full((N,), float("nan"), device="cuda")
        kernel[(PROGRAMS,)](x, w1, h, w2, y, bar, 1 << 20, N=N, BLOCK=BLOCK)
        torch.cuda.synchronize()
        if int(bar[2]):
            return {"verdict": "deadlock", "message": VERDICTS["deadlock"].format(how="on the GPU by its spin limit")}
        diff = _diff(y.cpu(), *inputs())
        if diff:
            return {"verdict": "wrong", "message": VERDICTS["wrong"].format(diff=diff) + f" (GPU, launch {launch})"}
    return {"verdict": "ok", "message": ""}


def _root() -> str:
    import course

    return os.path.dirname(os.path.dirname(os.path.abspath(course.__file__)))


def check_two_stage(kernel, name: str = NAME) -> None:
    """07.3: the learner's ``two_stage`` kernel, judged as the module doc says; a ✗ names the defect."""
    from course.core.triton_path import interpreting

    with exercise(name, hint=[
                "a program may read what another program wrote only after a grid barrier that every program "
                "reaches; what nobody writes during the launch (the weights) may be loaded before it",
                "in two_stage, between stage 1's store of h and stage 2: load W2's rows first, then call "
                "grid_sync(bar_ptr, tl.num_programs(0), spin), then load h (all N values)",
                "a smaller example, two programs: program 0 stores a[0], program 1 stores a[1]; each then needs "
                "a[0] + a[1]: store, arrive at the barrier, wait until 2 have arrived, then load a"],
            answer="w2 = tl.load(w2_ptr + rows[:, None] * N + cols[None, :]); grid_sync(bar_ptr, tl.num_programs(0), "
                   "spin); h = tl.load(h_ptr + cols)"):
        fn = getattr(kernel, "fn", kernel)
        src = inspect.getsource(fn)
        if "NotImplementedError" in src:
            raise NotImplementedError("write the part of two_stage between the two stages first")
        if interpreting():
            v = judge(kernel)
        else:
            v = judge_source(src, fn.__name__, "sim")
            if v["verdict"] in ("ok", "late weights"):
                gpu = judge_source(src, fn.__name__, "cuda", timeout=90.0)
                v = gpu if gpu["verdict"] != "ok" else v
        assert v["verdict"] == "ok", v["message"]
