"""Lesson 07's kernels beyond the waterfall's one point: other positions, other Llama shapes (GPU experiments).

- "last_mile_positions" (:func:`positions_experiment`): the TinyLlama-shaped model at positions 32, 512 and
  2048, the Triton step without and with each of the last mile's options (:data:`VARIANTS`), interleaved per
  position, beside the floor (which grows with the KV cache read), and attention's share of the step's kernel
  time (profiler, the step without PDL, so that no kernel's time includes a wait for the one before).
- "last_mile_shapes" (:func:`shapes_experiment`): the same variants and the persistent step (one launch per
  token, :mod:`~course.lessons.last_mile.persistent`) on TinyLlama's, SmolLM2-135M's and Llama-3.2-1B's shapes
  (:mod:`~course.lessons.last_mile.shapes`, random weights): one step at position 32, and the mean step of a
  run over positions 32 to 160 (128 steps, each its own replay), beside each model's floor; greedy tokens and
  logits against transformers' eager step.

- "last_mile_public_workload" (:func:`public_workload_experiment`): the workload of a public study (:data:`PUBLIC`):
  Llama-3.2-1B's shape at batch 1, ``prompt`` positions filled, then ``steps`` dependent greedy steps timed (each token
  the argmax of the step before, chosen on the device: :class:`~course.lessons.last_mile.loop.TokenLoop`), TinyLlama's
  and SmolLM2's shapes beside it: the step before issue 43's changes and with each of them (:data:`PUBLIC_VARIANTS`),
  then every step in one graph; one step at ``prompt`` too; the tokens of every variant against the first's; the
  study's own figures for the GPU the recording ran on are cited.

Every variant is the step captured in one CUDA graph with PDL, replayed by hand
(:func:`~course.lessons.last_mile.decoder.graphed`).
"""
from __future__ import annotations

from course.core.capture import require_gpu
from course.core.reference import experiment
from course.core.results import Result
from course.lessons.last_mile.waterfall import LAST_MILE

NAN = float("nan")
VARIANTS = {"Triton + PDL": {}, **LAST_MILE}
PERSISTENT = "persistent"  # the persistent step (one launch per token), beside the variants in last_mile_shapes
COLUMNS = {"shape": "", "positions": "", "variant": "", "status": "", "us": "us", "q1_us": "us", "q3_us": "us",
           "floor_us": "us", "x_floor": "x", "attention_share": "fraction", "first_call_s": "s", "correct": "",
           "max_logit_diff": "fraction", "launches_per_token": "count"}


def row(shape: str, positions: str, variant: str, timing, floor: float, **extra) -> dict:
    """One row: a variant's median and IQR per step (us), its floor and ratio; ``extra`` fills the other columns."""
    us = timing.us if timing else NAN
    out = {k: NAN for k in COLUMNS}
    out.update({"shape": shape, "positions": positions, "variant": variant, "status": "ok" if timing else "",
                "us": us, "q1_us": timing.q1 * 1e6 if timing else NAN, "q3_us": timing.q3 * 1e6 if timing else NAN,
                "floor_us": floor, "x_floor": us / floor, "correct": ""})
    out.update(extra)
    return out


def attention_share(events: list) -> float:
    """Attention kernels' share of the kernels' summed time, from :func:`~.timeline.kernel_events`'s events."""
    total = sum(e - s for _, s, e in events)
    att = sum(e - s for n, s, e in events if n.startswith("attention"))
    return att / total if total > 0 else NAN


def _steps(model, max_len: int, args, log, tag: str, persistent: bool = False) -> tuple:
    """``({variant: graphed step}, {variant: first-call seconds or the failure}, {variant: launches per token})`` for
    :data:`VARIANTS` (and :data:`PERSISTENT` if ``persistent``)."""
    from course.lessons.last_mile.decoder import TritonDecoder, config_for, graphed
    from course.lessons.last_mile.persistent_decoder import PersistentDecoder
    from course.lessons.real_model.bench import _reason, first_call

    steps, first, launches = {}, {}, {}
    builds = {name: (lambda opts=opts: TritonDecoder(model, max_len, pdl=True, config=config_for(model, **opts)))
              for name, opts in VARIANTS.items()}
    if persistent:
        builds[PERSISTENT] = lambda: PersistentDecoder(model, max_len)
    for name, build in builds.items():
        log(f"{tag}: {name}: building, capturing ...")
        try:
            dec = build()
            launches[name] = dec.kernels_per_token
            fn = graphed(dec, *args)
            first[name] = first_call(fn, args)[0]
            steps[name] = fn
        except Exception as e:  # noqa: BLE001 - a variant that breaks is a row that says why
            first[name] = _reason(e)
            log(f"{tag}: {name}: {first[name]}")
    return steps, first, launches


@experiment("last_mile_positions", gpu_only=True, quick={"size": "tiny", "positions": (3, 40), "repeats": 3})
def positions_experiment(size: str = "tinyllama", positions=(32, 128, 256, 512, 2048), repeats: int = 15,
                         log=print) -> Result:
    """The Triton step's variants at several positions (see the module doc), interleaved per position."""
    require_gpu("timing the Triton step at several positions")
    import torch

    from course.lessons.last_mile.decoder import TritonDecoder, config_for, graphed
    from course.lessons.last_mile.shapes import SHAPES, build_shape
    from course.lessons.last_mile.timeline import kernel_events
    from course.lessons.real_model.decode import StaticDecoder
    from course.lessons.real_model.model import build_model, bytes_per_token
    from course.lessons.real_model.roofline import copy_bandwidth_GBps, floor_us
    from course.core.timing import time_interleaved

    positions = sorted(set(int(p) for p in positions))
    model = build_shape(size) if size in SHAPES else build_model(size)
    max_len = -(-(positions[-1] + 1) // 64) * 64
    bw = copy_bandwidth_GBps()
    ex = StaticDecoder(model, max_len)  # only for its example inputs
    steps, first, _ = _steps(model, max_len, ex.example_args(1, 0), log, "last_mile_positions")
    try:  # without PDL: each kernel's time is its own
        plain = graphed(TritonDecoder(model, max_len, config=config_for(model, split_k=True, packed=True,
                                                                        split_kv=True)), *ex.example_args(1, 0))
    except Exception as e:  # noqa: BLE001 - the share is evidence, not the measurement
        plain = None
        log(f"last_mile_positions: no profile of attention's share: {type(e).__name__}: {e}")
    rows = []
    for p in positions:
        args = ex.example_args(1, p, seed=p)
        floor = floor_us(bytes_per_token(model, 1, p), bw)
        log(f"last_mile_positions: position {p}: measuring {list(steps)} interleaved ({repeats} repeats)")
        with torch.no_grad():
            t = time_interleaved({n: (lambda fn=fn: fn(*args)) for n, fn in steps.items()}, clock="device",
                                 warmup=3, repeats=repeats, inner=5)
        share = attention_share(kernel_events(lambda: plain(*args))) if plain else NAN
        for name in VARIANTS:
            ok = name in steps
            rows.append(row(size, str(p), name, t.get(name), floor, status="ok" if ok else first[name],
                            first_call_s=first[name] if ok else NAN,
                            attention_share=share if name == "+ split-KV attention" else NAN))
        rows.append(row(size, str(p), "floor", None, floor, status="computed", x_floor=1.0, us=floor))
    res = Result("last_mile_positions",
                 f"LlamaForCausalLM, {size} shape, random weights, batch 1: the Triton step (PDL, one graph) at "
                 f"positions {positions}, variants interleaved per position (CUDA events); attention's share of the "
                 "kernels' time from the profiler (the last variant, without PDL)", COLUMNS, rows,
                 params={"size": size, "positions": positions, "repeats": repeats, "max_len": max_len,
                         "torch": torch.__version__})
    res.add_summary("copy_bandwidth_GBps", bw, "GB/s")
    return res


@experiment("last_mile_shapes", gpu_only=True,
            quick={"shapes": ("tiny-tied",), "position": 3, "run": 8, "repeats": 3, "n_tokens": 4})
def shapes_experiment(shapes=("tinyllama", "smollm2-135m", "llama-3.2-1b"), position: int = 32, run: int = 128,
                      repeats: int = 10, n_tokens: int = 16, log=print) -> Result:
    """The Triton step's variants on other Llama shapes (see the module doc), interleaved per shape."""
    require_gpu("timing the Triton step on other Llama shapes")
    import torch

    from course.core.hardware import release_memory
    from course.core.timing import time_interleaved
    from course.lessons.last_mile.shapes import build_shape
    from course.lessons.real_model.decode import StaticDecoder
    from course.lessons.real_model.generate import check_variants
    from course.lessons.real_model.model import bytes_per_token
    from course.lessons.real_model.roofline import copy_bandwidth_GBps, floor_us

    bw = copy_bandwidth_GBps()
    rows = []
    max_len = -(-(position + run + 1) // 64) * 64
    for shape in shapes:
        model = build_shape(shape)
        eager = StaticDecoder(model, max_len)
        args = eager.example_args(1, position)
        steps, first, launches = _steps(model, max_len, args, log, f"last_mile_shapes: {shape}", persistent=True)
        log(f"last_mile_shapes: {shape}: one step at {position}, and {run} steps from {position}, interleaved")
        ids = args[0]
        poss = [torch.tensor([p], device=ids.device) for p in range(position, position + run)]
        with torch.no_grad():
            one = time_interleaved({n: (lambda fn=fn: fn(*args)) for n, fn in steps.items()}, clock="device",
                                   warmup=3, repeats=repeats, inner=5)
            seq = time_interleaved({n: (lambda fn=fn: [fn(ids, p) for p in poss]) for n, fn in steps.items()},
                                   clock="device", warmup=1, repeats=repeats, inner=1)
        log(f"last_mile_shapes: {shape}: {n_tokens} greedy tokens of every variant against eager")
        first_ids = torch.tensor([11], device=ids.device)
        check = {r["variant"]: r for r in check_variants(steps, eager.step, first_ids, n_tokens, model.dtype).rows} \
            if steps else {}
        span = f"{position}-{position + run}"
        mid = floor_us(bytes_per_token(model, 1, position + run // 2), bw)  # the KV read grows by one position a step
        floor = floor_us(bytes_per_token(model, 1, position), bw)
        for name in [*VARIANTS, PERSISTENT]:
            ok = name in steps
            c = check.get(name, {})
            extra = {"status": "ok" if ok else first[name], "first_call_s": first[name] if ok else NAN,
                     "correct": c.get("ok", ""), "max_logit_diff": c.get("max_logit_diff", NAN),
                     "launches_per_token": launches.get(name, NAN)}
            rows.append(row(shape, str(position), name, one.get(name), floor, **extra))
            seq_t = seq.get(name)
            per = _per_step(seq_t, run)
            rows.append(row(shape, span, name, per, mid, **extra))
        rows.append(row(shape, str(position), "floor", None, floor, status="computed", x_floor=1.0, us=floor))
        rows.append(row(shape, span, "floor", None, mid, status="computed", x_floor=1.0, us=mid))
        del steps, eager, model
        release_memory()
    res = Result("last_mile_shapes",
                 f"LlamaForCausalLM in other Llama shapes, random weights, batch 1: the Triton step (PDL, one graph) "
                 f"at position {position}, and per step over positions {position} to {position + run} (CUDA events, "
                 "variants interleaved per shape), beside each model's floor", COLUMNS, rows,
                 params={"shapes": list(shapes), "position": position, "run": run, "repeats": repeats,
                         "n_tokens": n_tokens, "torch": torch.__version__})
    res.add_summary("copy_bandwidth_GBps", bw, "GB/s")
    from course.lessons.last_mile.persistent_tuning import chosen

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    res.add_summary("persistent_shapes", chosen(gpu), "")
    return res


def _per_step(timing, n: int):
    """A run's :class:`~course.core.timing.Timing` divided by its ``n`` steps (None stays None)."""
    import dataclasses

    if timing is None:
        return None
    return dataclasses.replace(timing, median=timing.median / n, q1=timing.q1 / n, q3=timing.q3 / n,
                               min=timing.min / n, max=timing.max / n)


def split_kv_from(result, split: str = "+ split-KV attention", plain: str = "+ packed weights"):
    """The smallest position of a ``last_mile_positions`` result at which ``split`` beats ``plain`` beyond the spread
    (its third quartile below the other's first), or None where it never does: the threshold
    :func:`~course.lessons.last_mile.decoder.config_for` takes as ``split_kv_from`` (read from a recording, not typed)."""
    by = {}
    for r in result.rows:
        by.setdefault(int(r["positions"]), {})[r["variant"]] = r
    for p in sorted(by):
        a, b = by[p].get(split), by[p].get(plain)
        if a and b and a["q3_us"] == a["q3_us"] and b["q1_us"] == b["q1_us"] and a["q3_us"] < b["q1_us"]:
            return p
    return None


# The public study's figures for Llama-3.2-1B (bf16, batch 1, 32-token prompt, 127 dependent steps timed), µs per
# step on each GPU it ran on: cited, not measured here; a recording shows those of the GPU it was made on.
PUBLIC = {"H200": {"public: CUDA graphs + PDL": 794.74, "public: megakernel (Hazy)": 759.83},
          "H100": {"public: CUDA graphs + PDL": 979.51, "public: megakernel (Hazy)": 972.78}}
PUBLIC_SOURCE = "msaroufim/megakernels-vs-cuda-graphs, llama/docs/RESULTS.md (µs/step, mean of process means)"
PUBLIC_VARIANTS = ("Triton + PDL", "+ loads before the wait", "+ attention ahead")
LOOP = "+ all steps in one graph"  # the last variant's step, every dependent step in one replay
PUBLIC_COLUMNS = {"shape": "", "positions": "", "variant": "", "status": "", "us": "us", "q1_us": "us",
                  "q3_us": "us", "floor_us": "us", "x_floor": "x", "tokens_equal": "", "launches_per_token": "count",
                  "tokens_per_replay": "count", "source": ""}


@experiment("last_mile_public_workload", gpu_only=True,
            quick={"shapes": ("tiny-tied",), "prompt": 4, "steps": 6, "repeats": 3})
def public_workload_experiment(shapes=("llama-3.2-1b", "tinyllama", "smollm2-135m"), prompt: int = 32,
                               steps: int = 127, repeats: int = 10, log=print) -> Result:
    """The public study's workload on the course's step (see the module doc), variants interleaved per shape."""
    require_gpu("timing the public decode workload")
    import torch

    from course.core.hardware import release_memory
    from course.core.timing import time_interleaved
    from course.lessons.last_mile.decoder import TritonDecoder, config_for, graphed
    from course.lessons.last_mile.loop import TokenLoop
    from course.lessons.last_mile.shapes import build_shape
    from course.lessons.real_model.decode import StaticDecoder
    from course.lessons.real_model.bench import _reason
    from course.lessons.real_model.model import bytes_per_token
    from course.lessons.real_model.roofline import copy_bandwidth_GBps, floor_us

    bw = copy_bandwidth_GBps()
    max_len = -(-(prompt + steps + 1) // 64) * 64
    span = f"{prompt}+{steps}"
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    gpu = next((g for g in PUBLIC if g in name), None)  # the study's figures for this GPU, if it ran on one
    rows = []
    for shape in shapes:
        model = build_shape(shape)
        args = StaticDecoder(model, max_len).example_args(1, prompt)
        ids = torch.randint(3, model.config.vocab_size, (prompt,), generator=torch.Generator().manual_seed(0))
        one, loops, failed, first = {}, {}, {}, None
        for name in (*PUBLIC_VARIANTS, LOOP):
            log(f"last_mile_public_workload: {shape}: {name}: building, filling {prompt} positions, capturing")
            try:
                if name == LOOP:  # the last variant's decoder, every step in one graph
                    loops[name] = TokenLoop(loops[PUBLIC_VARIANTS[-1]].dec, steps)
                    continue
                dec = TritonDecoder(model, max_len, pdl=True, config=config_for(model, **VARIANTS[name]))
                with torch.no_grad():
                    for t in range(prompt):  # the prompt's keys and values, one step a position
                        logits = dec.step(ids[t].view(1, 1).to(dec.device), torch.tensor([t], device=dec.device))
                first = int(logits.argmax()) if first is None else first  # every variant starts from one token
                one[name] = graphed(dec, *args)
                loops[name] = TokenLoop(dec, 1)
            except Exception as e:  # noqa: BLE001 - a variant that breaks is a row that says why
                failed[name] = _reason(e)
                log(f"last_mile_public_workload: {shape}: {name}: {failed[name]}")
        log(f"last_mile_public_workload: {shape}: one step at {prompt}, and {steps} dependent steps, interleaved")

        def sequence(lp):
            lp.start(first, prompt)
            for _ in range(steps // lp.n):
                lp.replay()

        with torch.no_grad():
            t1 = time_interleaved({n: (lambda fn=fn: fn(*args)) for n, fn in one.items()}, clock="device",
                                  warmup=3, repeats=repeats, inner=5)
            tn = time_interleaved({n: (lambda lp=lp: sequence(lp)) for n, lp in loops.items()}, clock="device",
                                  warmup=1, repeats=repeats, inner=1)
            tokens = {n: lp.run(first, prompt, steps) for n, lp in loops.items()}
        base = next(iter(tokens.values()), None)
        floor = floor_us(bytes_per_token(model, 1, prompt), bw)
        mid = floor_us(bytes_per_token(model, 1, prompt + steps // 2), bw)
        for name, lp in loops.items():
            extra = {"tokens_equal": bool(torch.equal(tokens[name], base)), "launches_per_token": lp.kernels_per_token,
                     "source": "measured"}
            if name in one:
                rows.append(_public_row(shape, str(prompt), name, t1[name], floor, tokens_per_replay=1,
                                        **{**extra, "launches_per_token": lp.dec.kernels_per_token}))
            rows.append(_public_row(shape, span, name, _per_step(tn[name], steps), mid, tokens_per_replay=lp.n,
                                    **extra))
        rows += [_public_row(shape, span, n, None, mid, status=why) for n, why in failed.items()]
        rows.append(_public_row(shape, str(prompt), "floor", None, floor, status="computed", us=floor, x_floor=1.0))
        rows.append(_public_row(shape, span, "floor", None, mid, status="computed", us=mid, x_floor=1.0))
        if shape == "llama-3.2-1b" and (prompt, steps) == (32, 127) and gpu:
            rows += [_public_row(shape, span, n, None, mid, status="cited", us=us, x_floor=us / mid,
                                 source=f"{PUBLIC_SOURCE}, {gpu}") for n, us in PUBLIC[gpu].items()]
        del one, loops, model
        release_memory()
    res = Result("last_mile_public_workload",
                 f"A public study's decode workload: LlamaForCausalLM shapes, random weights, bf16, batch 1, {prompt} "
                 f"positions filled, then {steps} dependent greedy steps (argmax on the device) per run, µs per step "
                 "(median and IQR of runs, CUDA events, variants interleaved per shape), and one step at position "
                 f"{prompt}; the study's own figures cited", PUBLIC_COLUMNS, rows,
                 params={"shapes": list(shapes), "prompt": prompt, "steps": steps, "repeats": repeats,
                         "max_len": max_len, "torch": torch.__version__})
    res.add_summary("copy_bandwidth_GBps", bw, "GB/s")
    res.add_summary("public_source", PUBLIC_SOURCE, "")
    return res


def _public_row(shape: str, positions: str, variant: str, timing, floor: float, **extra) -> dict:
    """One row of ``last_mile_public_workload`` (:data:`PUBLIC_COLUMNS`)."""
    out = {k: v for k, v in row(shape, positions, variant, timing, floor).items() if k in PUBLIC_COLUMNS}
    out.update({"tokens_equal": "", "launches_per_token": NAN, "tokens_per_replay": NAN, "source": ""})
    out.update(extra)
    return out
