"""The persistent step's launch shapes, searched on the GPU it runs on ("last_mile_persistent_search").

One program per SM walks every stage's tiles in turn, so what keeps the memory system busy is what one program
has in flight: its tile's rows times the columns per chunk times the chunks in flight, over its warps. The
default shapes (:func:`~course.lessons.last_mile.persistent_decoder.persistent_config`) are a first guess; this
experiment times a few others on TinyLlama's shape (random weights, batch 1), each captured in a graph,
interleaved with the five-kernel step (PDL) as the yardstick, each checked against it (greedy tokens and logits
within bfloat16's tolerance) and for a barrier that never opened.

The recording then chooses: :func:`~.persistent_tuning.tuned` gives the fastest candidate's shapes to the persistent decoder on the GPU
the recording was made on, and only when that candidate beats the defaults beyond the spread (its third quartile
below the defaults' first) and was correct; anywhere else the defaults stand. The figures are read, never typed.
"""
from __future__ import annotations

from course.core.capture import require_gpu
from course.core.reference import experiment
from course.core.results import Result
from course.lessons.last_mile.persistent_tuning import CANDIDATES, DEFAULT, NAME, choose, shapes_for

NAN = float("nan")
COLUMNS = {"candidate": "", "status": "", "warps": "count", "programs": "count", "registers": "count",
           "spills": "count", "shapes": "", "us": "us", "q1_us": "us", "q3_us": "us", "floor_us": "us",
           "x_floor": "x", "vs_defaults": "x", "correct": "", "max_logit_diff": "fraction"}


def _describe(config) -> str:
    return ", ".join(f"{s} {getattr(config, s).rows}x{getattr(config, s).block_k}/{getattr(config, s).depth}"
                     for s in ("qkv", "o", "gate_up", "down", "lm_head"))


def build(model, max_len: int, candidate: str):
    """The :class:`~course.lessons.last_mile.persistent_decoder.PersistentDecoder` of ``candidate`` for ``model``
    (raises ValueError where its programs cannot all be resident)."""
    from course.lessons.last_mile.decoder import sizes
    from course.lessons.last_mile.persistent_decoder import PersistentDecoder, persistent_config
    from course.core.triton_path import interpreting

    warps, per_sm, stages = CANDIDATES[candidate]
    h, i, v, _, _, d = sizes(model.config)
    interp = interpreting()
    cfg = persistent_config(h, i, d, v, interpret=interp)
    if not interp:
        cfg = shapes_for(cfg, stages, model.config)
    return PersistentDecoder(model, max_len, config=cfg, warps=warps, programs_per_sm=per_sm, tuned=False)


@experiment(NAME, gpu_only=True, quick={"size": "tiny", "repeats": 3, "n_tokens": 4,
                                         "candidates": (DEFAULT, "2 programs per SM, 4 warps")})
def search_experiment(size: str = "tinyllama", position: int = 32, repeats: int = 12, n_tokens: int = 16,
                      candidates=tuple(CANDIDATES), log=print) -> Result:
    """Every candidate's persistent step against the five-kernel step (see the module doc)."""
    require_gpu("searching the persistent step's launch shapes")
    import time

    import torch

    from course.core.hardware import release_memory
    from course.core.timing import time_interleaved
    from course.lessons.last_mile.decoder import TritonDecoder, graphed
    from course.lessons.last_mile.shapes import SHAPES, build_shape
    from course.lessons.real_model.decode import StaticDecoder
    from course.lessons.real_model.generate import check_variants
    from course.lessons.real_model.model import build_model, bytes_per_token
    from course.lessons.real_model.roofline import copy_bandwidth_GBps, floor_us

    model = build_shape(size) if size in SHAPES else build_model(size)
    max_len = -(-(position + n_tokens + 2) // 64) * 64
    args = StaticDecoder(model, max_len).example_args(1, position)
    floor = floor_us(bytes_per_token(model, 1, position), copy_bandwidth_GBps())
    ref = graphed(TritonDecoder(model, max_len, pdl=True), *args)
    steps, decs, info = {}, {}, {}
    for name in candidates:
        t0 = time.monotonic()
        try:
            dec = build(model, max_len, name)
            step = graphed(dec, *args)
            step(*args)
            dec.check()
            steps[name], decs[name] = step, dec
            info[name] = {"status": "ok", "warps": dec.warps, "programs": dec.programs, "registers": dec.n_regs,
                          "spills": dec.n_spills, "shapes": _describe(dec.config)}
            log(f"{NAME}: {name}: {dec.programs} programs of {dec.warps} warps, {dec.n_regs} registers, "
                f"{dec.n_spills} spilled; built and captured in {time.monotonic() - t0:.1f} s")
        except Exception as e:  # noqa: BLE001 - a candidate that cannot run is a row that says why
            info[name] = {"status": f"{type(e).__name__}: {str(e)[:200]}"}
            log(f"{NAME}: {name}: {info[name]['status']}")
    first = torch.tensor([11], device=args[0].device)
    checked = {r["variant"]: r for r in check_variants(steps, ref, first, n_tokens, model.dtype).rows} if steps else {}
    with torch.no_grad():
        t = time_interleaved({"five kernels + PDL": lambda: ref(*args),
                              **{n: (lambda s=s: s(*args)) for n, s in steps.items()}},
                             clock="device", warmup=3, repeats=repeats, inner=5)
    for name, dec in decs.items():
        try:
            dec.check()
        except RuntimeError as e:
            info[name]["status"] = str(e)[:200]
    base = t.get(DEFAULT)
    rows = []
    for name in ("five kernels + PDL", *candidates):
        tm, c = t.get(name), checked.get(name, {})
        row = {k: NAN for k in COLUMNS}
        row.update(candidate=name, status="ok", shapes="", correct=True, max_logit_diff=0.0)
        row.update(info.get(name, {}))
        if tm is not None and row["status"] == "ok":
            row.update(us=tm.us, q1_us=tm.q1 * 1e6, q3_us=tm.q3 * 1e6, x_floor=tm.us / floor,
                       vs_defaults=base.us / tm.us if base else NAN)
        if name != "five kernels + PDL":
            row.update(correct=bool(c.get("ok", False)), max_logit_diff=c.get("max_logit_diff", NAN))
        row["floor_us"] = floor
        rows.append(row)
    res = Result(NAME, f"The persistent step's launch shapes on LlamaForCausalLM, {size} shape (random weights, "
                       f"{str(model.dtype).replace('torch.', '')}), batch 1 at position {position}: each candidate "
                       "captured in a graph, timed interleaved with the five-kernel step (CUDA events)", COLUMNS, rows,
                 params={"size": size, "position": position, "repeats": repeats, "n_tokens": n_tokens,
                         "candidates": list(candidates), "torch": torch.__version__})
    best = choose(res)
    res.add_summary("chosen", best or DEFAULT, "")
    res.add_summary("floor_us", floor, "us")
    del steps, decs, ref, model
    release_memory()
    return res


