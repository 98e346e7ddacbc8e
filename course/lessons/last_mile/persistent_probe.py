"""A GPU probe of the persistent step, bounded in time: ``COURSE_PATH=cuda python -m course.lessons.last_mile.persistent_probe``.

For each Llama shape (random weights, bfloat16, batch 1 at ``--position``): the five-kernel step with PDL captured in
one graph (:func:`~course.lessons.last_mile.decoder.graphed`) and the persistent step captured in one graph
(:class:`~course.lessons.last_mile.persistent_decoder.PersistentDecoder`), checked token for token against the
five-kernel step (``--tokens`` greedy tokens, logits within lesson 06's bfloat16 tolerance), then timed
interleaved (CUDA events, warm-up, median and IQR of ``--repeats``), each beside the shape's floor (every weight
read once at the measured copy bandwidth). On the first shape it also times the persistent kernel that loads
nothing across its barriers (``ahead=False``) and one with 16 warps, while time remains.

Bounded: a barrier that never opens ends itself (the kernel's spin limit sets an error flag, reported); a hang
anywhere else is ended by a watchdog (``--limit`` seconds: every thread's traceback printed, exit status 1).
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import sys
import time

SHAPES = ("tinyllama", "llama-3.2-1b", "smollm2-135m")


def _variants(model, max_len: int, first: bool) -> dict:
    """{name: (builder, decoder-or-None)}: what to time on this shape (the extras only on the first, in time)."""
    from course.lessons.last_mile.decoder import TritonDecoder
    from course.lessons.last_mile.persistent_decoder import PersistentDecoder

    out = {"five kernels + PDL": lambda: TritonDecoder(model, max_len, pdl=True),
           "persistent": lambda: PersistentDecoder(model, max_len)}
    if first:
        out["persistent, loads after the barrier"] = lambda: PersistentDecoder(model, max_len, ahead=False)
        out["persistent, 16 warps"] = lambda: PersistentDecoder(model, max_len, warps=16)
    return out


def probe_shape(name: str, position: int, tokens: int, repeats: int, bw: float, first: bool, deadline: float,
                log=print) -> list:
    """Rows ``{shape, variant, us, q1_us, q3_us, x_floor, launches, programs, ...}`` for one shape (GPU)."""
    import torch

    from course.core.hardware import release_memory
    from course.core.timing import time_interleaved
    from course.lessons.last_mile.decoder import graphed
    from course.lessons.last_mile.shapes import build_shape
    from course.lessons.real_model.decode import StaticDecoder
    from course.lessons.real_model.generate import check_variants
    from course.lessons.real_model.model import bytes_per_token
    from course.lessons.real_model.roofline import floor_us

    model = build_shape(name)
    max_len = -(-(position + tokens + 2) // 64) * 64
    args = StaticDecoder(model, max_len).example_args(1, position)
    floor = floor_us(bytes_per_token(model, 1, position), bw)
    steps, decs, info = {}, {}, {}
    for var, build in _variants(model, max_len, first).items():
        if var != "five kernels + PDL" and var != "persistent" and time.monotonic() > deadline:
            log(f"  {name}: {var}: skipped (time)")
            continue
        t0 = time.monotonic()
        try:
            dec = build()
            step = graphed(dec, *args)
            if hasattr(dec, "check"):
                step(*args)
                dec.check()  # a barrier that timed out in the warm-up or the first replay: no further steps
            steps[var] = step
            decs[var] = dec
            info[var] = {"first_call_s": time.monotonic() - t0}
            if hasattr(dec, "programs"):
                info[var].update(programs=dec.programs, sms=dec.sms, per_sm=dec.per_sm, regs=dec.n_regs,
                                 spills=dec.n_spills, warps=dec.warps)
            log(f"  {name}: {var}: built and captured in {info[var]['first_call_s']:.1f} s {info[var]}")
        except Exception as e:  # noqa: BLE001 - a variant that breaks is a row that says why
            info[var] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            log(f"  {name}: {var}: FAILED {info[var]['error']}")
    ref = steps.get("five kernels + PDL")
    rows = []
    if ref is not None:
        others = {v: s for v, s in steps.items() if v != "five kernels + PDL"}
        first_ids = torch.tensor([11], device=args[0].device)
        check = {r["variant"]: r for r in check_variants(others, ref, first_ids, tokens, model.dtype).rows} \
            if others else {}
        for v, dec in decs.items():
            if hasattr(dec, "check"):
                try:
                    dec.check()
                except RuntimeError as e:
                    info[v]["error"] = str(e)
                    steps.pop(v, None)
        with torch.no_grad():
            t = time_interleaved({v: (lambda s=s: s(*args)) for v, s in steps.items()}, clock="device", warmup=3,
                                 repeats=repeats, inner=5)
        for v, dec in decs.items():  # the timing replays too: a barrier that timed out there is a failed row
            if hasattr(dec, "check") and "error" not in info[v]:
                try:
                    dec.check()
                except RuntimeError as e:
                    info[v]["error"] = str(e)
        for v in info:
            tm, c = t.get(v), check.get(v, {})
            us = tm.us if tm and "error" not in info[v] else float("nan")
            rows.append({"shape": name, "variant": v, "us": us, "q1_us": tm.q1 * 1e6 if tm else float("nan"),
                         "q3_us": tm.q3 * 1e6 if tm else float("nan"), "floor_us": floor, "x_floor": us / floor,
                         "launches": getattr(decs.get(v), "kernels_per_token", float("nan")),
                         "tokens_equal": c.get("tokens_equal", v == "five kernels + PDL"),
                         "logits_ok": c.get("ok", v == "five kernels + PDL"),
                         "max_logit_diff": c.get("max_logit_diff", 0.0), **info[v]})
    else:
        rows.append({"shape": name, "variant": "five kernels + PDL", "error": info["five kernels + PDL"]})
    del steps, decs, model
    release_memory()
    return rows


def main(argv=None) -> int:
    """Run the probe (see the module doc); prints a table and one JSON line; 0 when every row is correct."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--position", type=int, default=32)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--limit", type=float, default=230.0, help="seconds before the watchdog ends the probe")
    a = p.parse_args(argv)
    faulthandler.dump_traceback_later(a.limit, exit=True)  # a C-level watchdog: fires even inside a hung CUDA call
    try:  # the watchdog is the probe's own: cancelled however main ends (a caller's process lives on)
        start = time.monotonic()
        import course

        course.header()
        from course.core.runtime import runtime

        if not runtime().on_gpu:
            print("persistent_probe needs a GPU (COURSE_PATH=cuda on a machine with one)")
            return 2
        import torch

        from course.lessons.real_model.roofline import copy_bandwidth_GBps

        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
        bw = copy_bandwidth_GBps()
        print(f"copy bandwidth {bw:.0f} GB/s")
        rows = []
        for i, name in enumerate(a.shapes):
            print(f"{name} (elapsed {time.monotonic() - start:.0f} s)")
            rows += probe_shape(name, a.position, a.tokens, a.repeats, bw, i == 0, start + 0.45 * a.limit)
        print(f"\n{'shape':14} {'variant':38} {'us':>8} {'IQR':>13} {'x floor':>8} {'launch':>6} {'tokens=':>7} ok")
        for r in rows:
            iqr = f"{r.get('q1_us', float('nan')):.0f}-{r.get('q3_us', float('nan')):.0f}"
            print(f"{r['shape']:14} {r['variant']:38} {r.get('us', float('nan')):8.1f} {iqr:>13} "
                  f"{r.get('x_floor', float('nan')):8.2f} {r.get('launches', float('nan')):6} "
                  f"{str(r.get('tokens_equal', '')):>7} {r.get('logits_ok', '')} {r.get('error', '')}")
        print("JSON " + json.dumps({"copy_bandwidth_GBps": bw, "position": a.position, "rows": rows}, default=str))
        print(f"probe done in {time.monotonic() - start:.0f} s")
        return 0 if all(r.get("logits_ok") and "error" not in r for r in rows) else 1
    finally:
        faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    sys.exit(main())
