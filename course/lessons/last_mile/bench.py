"""The persistent step's recordings: its launch shapes searched on the GPU it runs on
("last_mile_persistent_search"), and a bounded GPU probe of it on several Llama shapes
(``COURSE_PATH=cuda python -m course.lessons.last_mile.bench``).

Both go through :func:`measure`: each persistent decoder built, captured in a graph, checked
token for token against the five-kernel step with PDL (greedy tokens, logits within bfloat16's
tolerance) and for a barrier that never opened, then timed interleaved with that step (CUDA
events). The search times :data:`~.persistent_tuning.CANDIDATES` on TinyLlama's shape, and its
recording chooses the shapes the decoder takes on that GPU (:func:`~.persistent_tuning.choose`):
the figures are read, never typed. The probe times the default shapes on each shape, and on the
first also the kernel that loads nothing across its barriers (``ahead=False``) and one with 16
warps while time remains; a watchdog ends a hang (every thread's traceback printed, exit 1).
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import sys
import time

import torch

import course
from course.core.capture import require_gpu
from course.core.hardware import release_memory
from course.core.reference import experiment
from course.core.results import Result
from course.core.timing import time_interleaved
from course.core.triton_path import interpreting
from course.lessons.last_mile.decoder import TritonDecoder, graphed, sizes
from course.lessons.last_mile.persistent_decoder import PersistentDecoder, persistent_config
from course.lessons.last_mile.persistent_tuning import CANDIDATES, DEFAULT, NAME, choose, shapes_for
from course.lessons.last_mile.shapes import SHAPES, build_shape
from course.lessons.real_model.decode import StaticDecoder
from course.lessons.real_model.generate import check_variants
from course.lessons.real_model.model import build_model, bytes_per_token
from course.lessons.real_model.roofline import copy_bandwidth_GBps, floor_us

NAN = float("nan")
FIVE = "five kernels + PDL"
COLUMNS = {"candidate": "", "status": "", "warps": "count", "programs": "count",
           "registers": "count", "spills": "count", "shapes": "", "us": "us", "q1_us": "us",
           "q3_us": "us", "floor_us": "us", "x_floor": "x", "vs_defaults": "x", "correct": "",
           "max_logit_diff": "fraction"}
PROBE_SHAPES = ("tinyllama", "llama-3.2-1b", "smollm2-135m")


def _describe(config) -> str:
    stages = {s: getattr(config, s) for s in ("qkv", "o", "gate_up", "down", "lm_head")}
    return ", ".join(f"{s} {c.rows}x{c.block_k}/{c.depth}" for s, c in stages.items())


def build(model, max_len: int, candidate: str) -> PersistentDecoder:
    """The persistent decoder of ``candidate`` for ``model`` (ValueError where its programs cannot
    all be resident)."""
    warps, per_sm, stages = CANDIDATES[candidate]
    h, i, v, _, _, d = sizes(model.config)
    cfg = persistent_config(h, i, d, v, interpret=interpreting())
    if not interpreting():
        cfg = shapes_for(cfg, stages, model.config)
    return PersistentDecoder(model, max_len, config=cfg, warps=warps, programs_per_sm=per_sm,
                             tuned=False)


def measure(model, max_len: int, args, builds: dict, n_tokens: int, repeats: int, log=print,
            deadline: float = float("inf")) -> list:
    """Rows ``{candidate, status, warps, ..., us, q1_us, q3_us, correct, max_logit_diff}``: the
    five-kernel step with PDL, then each of ``builds`` (``{name: () -> PersistentDecoder}``) built,
    captured and checked against it, all timed interleaved (see the module doc); a build that
    fails or starts after ``deadline`` (``time.monotonic()``) is a row that says why."""
    ref = graphed(TritonDecoder(model, max_len, pdl=True), *args)
    steps, decs, info = {}, {}, {}
    for name, make in builds.items():
        t0 = time.monotonic()
        if t0 > deadline:
            info[name] = {"status": "skipped: out of time"}
            continue
        try:
            dec = make()
            step = graphed(dec, *args)
            step(*args)
            dec.check()  # a barrier that timed out in the warm-up or the first replay
            steps[name], decs[name] = step, dec
            info[name] = {"status": "ok", "warps": dec.warps, "programs": dec.programs,
                          "registers": dec.n_regs, "spills": dec.n_spills,
                          "shapes": _describe(dec.config)}
            log(f"{name}: {dec.programs} programs of {dec.warps} warps, {dec.n_regs} registers, "
                f"{dec.n_spills} spilled; built and captured in {time.monotonic() - t0:.1f} s")
        except Exception as e:  # noqa: BLE001 - a variant that cannot run is a row that says why
            info[name] = {"status": f"{type(e).__name__}: {str(e)[:200]}"}
            log(f"{name}: {info[name]['status']}")
    first = torch.tensor([11], device=args[0].device)
    checked = {r["variant"]: r for r in check_variants(steps, ref, first, n_tokens,
                                                       model.dtype).rows} if steps else {}
    with torch.no_grad():
        t = time_interleaved({FIVE: lambda: ref(*args),
                              **{n: (lambda s=s: s(*args)) for n, s in steps.items()}},
                             clock="device", warmup=3, repeats=repeats, inner=5)
    for name, dec in decs.items():  # the timing replays too: a barrier that timed out fails its row
        try:
            dec.check()
        except RuntimeError as e:
            info[name]["status"] = str(e)[:200]
    rows = []
    for name in (FIVE, *builds):
        tm, c = t.get(name), checked.get(name, {})
        row = {k: NAN for k in COLUMNS}
        row.update(candidate=name, status="ok", shapes="", correct=True, max_logit_diff=0.0)
        row.update(info.get(name, {}))
        if tm is not None and row["status"] == "ok":
            row.update(us=tm.us, q1_us=tm.q1 * 1e6, q3_us=tm.q3 * 1e6)
        if name != FIVE:
            row.update(correct=bool(c.get("ok", False)),
                       max_logit_diff=c.get("max_logit_diff", NAN))
        rows.append(row)
    del steps, decs, ref
    release_memory()
    return rows


@experiment(NAME, gpu_only=True, quick={"size": "tiny", "repeats": 3, "n_tokens": 4,
                                         "candidates": (DEFAULT, "2 programs per SM, 4 warps")})
def search_experiment(size: str = "tinyllama", position: int = 32, repeats: int = 12,
                      n_tokens: int = 16, candidates=tuple(CANDIDATES), log=print) -> Result:
    """Every candidate's persistent step against the five-kernel step (see the module doc)."""
    require_gpu("searching the persistent step's launch shapes")
    model = build_shape(size) if size in SHAPES else build_model(size)
    max_len = -(-(position + n_tokens + 2) // 64) * 64
    args = StaticDecoder(model, max_len).example_args(1, position)
    floor = floor_us(bytes_per_token(model, 1, position), copy_bandwidth_GBps())
    rows = measure(model, max_len, args, {n: (lambda n=n: build(model, max_len, n))
                                          for n in candidates}, n_tokens, repeats,
                   log=lambda m: log(f"{NAME}: {m}"))
    base = next((r["us"] for r in rows if r["candidate"] == DEFAULT), NAN)
    for r in rows:
        r.update(floor_us=floor, x_floor=r["us"] / floor, vs_defaults=base / r["us"])
    res = Result(NAME, f"The persistent step's launch shapes on LlamaForCausalLM, {size} shape "
                       f"(random weights, {str(model.dtype).replace('torch.', '')}), batch 1 at "
                       f"position {position}: each candidate captured in a graph, timed "
                       "interleaved with the five-kernel step (CUDA events)", COLUMNS, rows,
                 params={"size": size, "position": position, "repeats": repeats,
                         "n_tokens": n_tokens, "candidates": list(candidates),
                         "torch": torch.__version__})
    res.add_summary("chosen", choose(res) or DEFAULT, "")
    res.add_summary("floor_us", floor, "us")
    return res


def probe_shape(name: str, position: int, tokens: int, repeats: int, bw: float, first: bool,
                deadline: float, log=print) -> list:
    """:func:`measure`'s rows for the persistent step on the shape ``name`` (GPU), with ``shape``,
    ``launches`` and ``x_floor``; the extra variants only when ``first``."""
    model = build_shape(name)
    max_len = -(-(position + tokens + 2) // 64) * 64
    args = StaticDecoder(model, max_len).example_args(1, position)
    floor = floor_us(bytes_per_token(model, 1, position), bw)
    builds = {"persistent": lambda: PersistentDecoder(model, max_len)}
    if first:
        builds["persistent, loads after the barrier"] = \
            lambda: PersistentDecoder(model, max_len, ahead=False)
        builds["persistent, 16 warps"] = lambda: PersistentDecoder(model, max_len, warps=16)
    rows = measure(model, max_len, args, builds, tokens, repeats, deadline=deadline,
                   log=lambda m: log(f"  {name}: {m}"))
    for r in rows:
        r.update(shape=name, floor_us=floor, x_floor=r["us"] / floor,
                 launches=NAN if r["candidate"] == FIVE else 1)
    del model
    release_memory()
    return rows


def main(argv=None) -> int:
    """The probe (see the module doc): a table and one JSON line; 0 when every row is correct."""
    p = argparse.ArgumentParser(description="A bounded GPU probe of the persistent step")
    p.add_argument("--shapes", nargs="+", default=list(PROBE_SHAPES))
    p.add_argument("--position", type=int, default=32)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--limit", type=float, default=230.0, help="seconds before the watchdog fires")
    a = p.parse_args(argv)
    faulthandler.dump_traceback_later(a.limit, exit=True)  # fires even inside a hung CUDA call
    try:  # the watchdog is the probe's own: cancelled however main ends (a caller lives on)
        start = time.monotonic()
        course.header()
        if not course.runtime().on_gpu:
            print("the probe needs a GPU (COURSE_PATH=cuda on a machine with one)")
            return 2
        bw = copy_bandwidth_GBps()
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, copy bandwidth "
              f"{bw:.0f} GB/s")
        rows = []
        for i, name in enumerate(a.shapes):
            print(f"{name} (elapsed {time.monotonic() - start:.0f} s)")
            rows += probe_shape(name, a.position, a.tokens, a.repeats, bw, i == 0,
                                start + 0.45 * a.limit)
        for r in rows:
            print(f"{r['shape']:14} {r['candidate']:36} {r['us']:8.1f} us ({r['q1_us']:.0f}-"
                  f"{r['q3_us']:.0f}) {r['x_floor']:5.2f}x floor {r['launches']:4} launches "
                  f"correct={r['correct']} {'' if r['status'] == 'ok' else r['status']}")
        print("JSON " + json.dumps({"copy_bandwidth_GBps": bw, "position": a.position,
                                    "rows": rows}, default=str))
        print(f"probe done in {time.monotonic() - start:.0f} s")
        return 0 if all(r["correct"] and r["status"] == "ok" for r in rows) else 1
    finally:
        faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    sys.exit(main())
