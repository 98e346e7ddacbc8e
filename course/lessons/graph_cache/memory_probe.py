"""What a cleared graph cache leaves reserved on a GPU, and which release gives it back (a probe,
run by hand: ``python3 -m course.lessons.graph_cache.memory_probe --json probe.json``; it refuses,
exit 2, on the simulator path).

The scenario: the buckets 256, 512 and 1024 of a ``width``-wide ``relu(t @ w) @ w`` through a cache
(lab 3's answer ``MyGraphCache``, read from its answer cells, or :class:`GraphCache`), the weight
allocated first; then ``clear_cache()``, a collection, a synchronize and ``empty_cache()``; then
each release a candidate needs, one at a time (the pool handle, torch's cuBLAS workspaces, the
caller's inputs, the cache object, the weight). Each run is in a fresh process, and says per step
the memory reserved and allocated and where it lies (the allocator's segments by stream and pool),
and names every live block (the weight, the caller's inputs, the cache's static inputs and outputs,
a cuBLAS workspace, what the forward made). Its options: the backend's workspace release kept or
switched off (``workspaces``), the forward run eagerly after the captures (``after="eager"``), and
the caller's inputs kept in a list or made in each call and dropped (``inputs="per_call"``, issue
44's scenario).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

import torch

from course.core import hardware
from course.core.capture import require_gpu
from course.core.isolate import run_isolated
from course.core.runtime import CourseEnvironmentError, runtime
from course.lessons.graph_cache.cache import GraphCache
from course.lessons.graph_cache.memory_ledger import (MiB, Ledger, StreamNames, by_stream_pool,
                                                      format_rows, format_segments, held_and_kept,
                                                      snapshot_summary, workspace_facts)

ROOT = Path(__file__).resolve().parents[3]
LAB3 = ROOT / "solutions" / "lab3_graph_cache.ipynb"
CACHES = ("answer", "GraphCache")
WORKSPACES = ("released", "kept")
AFTER = ("nothing", "eager")  # after the last capture: nothing, or the forward run eagerly
INPUTS = ("kept", "per_call")  # the caller's inputs: kept in a list, or made per call and dropped
# the runs of a plain probe: (cache, workspaces, after, inputs); each in its own process
RUNS = (("answer", "released", "nothing", "kept"), ("answer", "released", "eager", "kept"),
        ("answer", "kept", "nothing", "kept"), ("answer", "released", "nothing", "per_call"),
        ("answer", "kept", "nothing", "per_call"), ("GraphCache", "released", "nothing", "kept"),
        ("GraphCache", "kept", "nothing", "kept"))


def answer_cache_class(path=LAB3):
    """Lab 3's ``MyGraphCache`` from the answer version: its setup and answer cells run without
    their checks."""
    nb = json.loads(Path(path).read_text(encoding="utf-8"))
    ns = {"__name__": "__lab3_answer__"}
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        src = "".join(cell["source"])
        lines = [ln for ln in src.splitlines()
                 if not ln.startswith(("checks.check_", "cache_checks.check_", "course.header("))]
        code = compile("\n".join(lines), f"{Path(path).name}#answer", "exec")
        exec(code, ns)  # noqa: S102 - the course's own answer
        if "MyGraphCache" in ns:
            return ns["MyGraphCache"]
    raise RuntimeError(f"{Path(path).name} defines no MyGraphCache: the probe follows lab 3's "
                       "answer cells")


def _settle():
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved(), torch.cuda.memory_allocated()


def _drop_pool(state):
    backend = state["cache"].backend
    state["pool"] = None
    backend._pool = None  # noqa: SLF001 - on purpose: does the handle hold memory?


def _drop_workspaces(state):
    torch._C._cuda_clearCublasWorkspaces()


def _drop_inputs(state):
    state["inputs"].clear()


def _drop_cache(state):
    state.pop("cache", None)


def _drop_weight(state):
    state.pop("weight", None)
    state.pop("forward", None)


# the releases tried after the clear, in order: (row name, what it does)
RELEASES = [("drop the pool handle", _drop_pool), ("drop cuBLAS workspaces", _drop_workspaces),
            ("drop the caller's inputs", _drop_inputs), ("drop the cache object", _drop_cache),
            ("drop the weight", _drop_weight)]


def release_table(rows) -> list:
    """``[{"cache", "workspaces", "release", "freed_MiB"}]``: what the clear and each release after
    it gave back."""
    keep = ("clear_cache()", "gc + synchronize + empty_cache") + tuple(n for n, _ in RELEASES)
    return [{"cache": r["cache"], "workspaces": r["workspaces"], "inputs": r.get("inputs", "kept"),
             "release": r["step"], "freed_MiB": r["freed_MiB"]} for r in rows if r["step"] in keep]


def cache_tensors(cache) -> dict:
    """data pointer -> name of each static input and static output a cache holds (lab 3's entries or
    GraphCache's)."""
    named = {}
    entries = getattr(cache, "entries", None)
    if entries is None:  # GraphCache: Entry(inputs, recorded.output)
        held = cache._entries.items()  # noqa: SLF001 - the probe names what the cache holds
        entries = {k: {"static": e.inputs, "output": getattr(e.recorded, "output", None),
                       "bucket": e.bucket} for k, e in held}
    for key, e in entries.items():
        tensors = [t for t in e.get("static") or () if isinstance(t, torch.Tensor)]
        rows = e.get("bucket") or (tensors[0].shape[0] if tensors else "?")
        for t in e.get("static") or ():
            if isinstance(t, torch.Tensor):
                named[t.data_ptr()] = f"cache's static input (bucket {rows})"
        outs = e.get("output")
        for t in (outs if isinstance(outs, (tuple, list)) else [outs]):
            if isinstance(t, torch.Tensor):
                named[t.data_ptr()] = f"cache's static output (bucket {rows})"
    return named


def run_one(cache: str = "answer", workspaces: str = "released", after: str = "nothing",
            inputs: str = "kept", width: int = 2048, buckets=(256, 512, 1024),
            stacks: str = "python") -> dict:
    """The scenario for one cache in this process (GPU): rows (each with where its reserved memory
    lies), the live blocks at the main steps, and facts.

    ``after="eager"``: the forward also runs eagerly after the last capture, on the default stream
    and on a side stream (those streams then hold cuBLAS workspaces at the clear);
    ``inputs="per_call"``: each call's input is made in the call and dropped after it.
    """
    require_gpu("the graph cache memory probe (it reads a GPU's caching allocator)")
    if cache not in CACHES or workspaces not in WORKSPACES or after not in AFTER \
            or inputs not in INPUTS:
        raise ValueError(f"cache must be one of {CACHES}, workspaces one of {WORKSPACES}, after "
                         f"one of {AFTER} and inputs one of {INPUTS}, got {cache!r}, "
                         f"{workspaces!r}, {after!r}, {inputs!r}")
    streams = StreamNames()
    streams.install(torch)
    release = hardware.release_blas_workspaces
    try:
        return _scenario(streams, cache, workspaces, after, inputs, width, buckets, stacks)
    finally:  # this process may go on (a test): torch, the release, the history as they were
        streams.uninstall()
        hardware.release_blas_workspaces = release
        torch.cuda.memory._record_memory_history(enabled=None)


def _scenario(streams, cache, workspaces, after, inputs, width, buckets, stacks) -> dict:
    streams.name(torch.cuda.default_stream(), "default")
    streams.context = "workspace facts"
    ws = workspace_facts()  # first: it tells one workspace's size, to name blocks by their size
    ws_bytes = round(ws["mm float32"]["kept_MiB"] * MiB) or None
    if workspaces == "kept":
        hardware.release_blas_workspaces = lambda: False  # the old backend: torch keeps them all
    torch.cuda.memory._record_memory_history(max_entries=200000, stacks=stacks)
    known: dict = {}
    snaps: dict = {}

    def look(step):
        snaps[step] = snapshot_summary(torch.cuda.memory_snapshot(), known, streams.names, ws_bytes)

    led = Ledger(cache, workspaces, _settle, inputs=inputs,
                 split=lambda: by_stream_pool(torch.cuda.memory_snapshot(), streams.names))
    streams.context = ""
    led.step("start", "after the workspace facts (released)")
    weight = torch.randn(width, width, device="cuda")
    known[weight.data_ptr()] = "weight"
    state = {"weight": weight}
    state["forward"] = lambda t: torch.relu(t @ state["weight"]) @ state["weight"]  # the weight
    del weight
    led.step("weight", f"{width}x{width} float32 (the baseline)")
    fwd = state["forward"]
    cls = answer_cache_class() if cache == "answer" else GraphCache
    state["cache"] = cls(fwd, buckets=list(buckets))
    made = lambda b: torch.randn(b, width, device="cuda")  # noqa: E731 - a caller's input
    state["inputs"] = [made(b) for b in buckets] if inputs == "kept" else []
    known.update({t.data_ptr(): f"caller's input {tuple(t.shape)}" for t in state["inputs"]})
    for k, b in enumerate(buckets):
        streams.context = f"call, batch {b}"
        state["cache"](state["inputs"][k] if state["inputs"] else made(b))
        cap = getattr(torch.cuda.graph, "default_capture_stream", None)
        if cap is not None:
            streams.name(cap, "capture")
        known.update(cache_tensors(state["cache"]))
        led.step(f"call, batch {b}", "a miss: warm-up, capture, replay")
    if after == "eager":
        streams.context = "eager after the captures"
        x = state["inputs"][-1] if state["inputs"] else made(buckets[-1])
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fwd(x)
        torch.cuda.current_stream().wait_stream(side)
        fwd(x)
        del x
        led.step("eager forward after the "
                 "captures", "default stream and a side stream, outputs dropped")
    streams.context = ""
    state["pool"] = state["cache"].backend._pool  # noqa: SLF001
    pool = state["pool"]
    pool_id = tuple(pool) if isinstance(pool, (tuple, list)) else pool
    pool_bytes = sum(s["total_size"] for s in torch.cuda.memory_snapshot()
                     if tuple(s.get("segment_pool_id") or ()) == pool_id)
    led.step("settled, before the clear", f"the graphs' pool: {pool_bytes / MiB:.1f} MiB")
    look("settled, before the clear")
    state["cache"].clear_cache()
    led.step("clear_cache()", "as the cache does it")
    led.step("gc + synchronize + empty_cache")
    look("after the clear")
    del fwd
    for name, release in RELEASES:
        release(state)
        led.step(name)
    look("after every release")
    facts = {"torch": torch.__version__, "cuda": torch.version.cuda,
             "device": torch.cuda.get_device_name(0), "pool_handle": repr(pool),
             "pool_MiB_before_clear": pool_bytes / MiB, "after": after, "inputs": inputs,
             "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
             "CUBLASLT_WORKSPACE_SIZE": os.environ.get("CUBLASLT_WORKSPACE_SIZE"), "width": width,
             "buckets": list(buckets), "workspace_facts": ws,
             "streams": sorted(streams.names.values())}
    return {"rows": led.rows, "segments": snaps["after the "
                                                "clear"], "snapshots": snaps, "facts": facts,
            "summary": held_and_kept(led.rows)}


def probe(runs=RUNS, timeout: float = 90, **kw) -> dict:
    """:func:`run_one` for each ``(cache, workspaces, after, inputs)`` of ``runs``, each in a fresh
    process (GPU)."""
    require_gpu("the graph cache memory probe (it reads a GPU's caching allocator)")
    out = [run_isolated("course.lessons.graph_cache.memory_probe", "run_one", timeout=timeout,
                        cache=c, workspaces=w, after=a, inputs=i, **kw) for c, w, a, i in runs]
    rows = [r for run in out for r in run["rows"]]
    return {"runs": out, "rows": rows, "releases": release_table(rows)}


def report(res) -> str:
    """The probe's printout: the table, then per run its summary, the workspace facts and the live
    blocks."""
    lines = [format_rows(res["rows"])]
    for run in res["runs"]:
        f, s = run["facts"], run["summary"]
        first = run["rows"][0]
        lines.append(f"\n{first['cache']}, workspaces {first['workspaces']}, after the captures: "
                     f"{f['after']}, inputs {f.get('inputs', 'kept')} (torch {f['torch']}, "
                     f"{f['device']}): above the baseline (weight allocated), {s['held_MiB']:.1f} "
                     f"MiB held before the clear, {s['kept_MiB']:.1f} MiB kept after it")
        lines.append("  a fresh stream's first product keeps: " + "; ".join(
            f"{k} {v['kept_MiB']:.2f} MiB ({v['left_after_release_MiB']:.2f} left after the "
            "release)"
            for k, v in f["workspace_facts"].items()))
        for step, segs in run["snapshots"].items():
            lines.append(f"  segments reserved, {step}:")
            lines.extend(format_segments(segs))
    return "\n".join(lines)


def main(argv=None) -> int:
    """The command line: the report on stdout, everything as JSON at ``--json``; exit 2 on the
    simulator path."""
    ap = argparse.ArgumentParser(prog="python3 -m course.lessons.graph_cache.memory_probe",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True, help="where to write the rows, segments and facts")
    ap.add_argument("--runs", default=",".join(":".join(r) for r in RUNS),
                    help="comma-separated cache:workspaces:after[:inputs] (answer|GraphCache : "
                         "released|kept : nothing|eager [: kept|per_call])")
    ap.add_argument("--stacks", default="python", choices=("python", "all"),
                    help="frames recorded per allocation (all: C++ too, slower to symbolize)")
    ap.add_argument("--timeout", type=float, default=90, help="seconds per run (its own process)")
    args = ap.parse_args(argv)
    runs = [tuple(r.split(":")) for r in args.runs.split(",")]
    runs = [r + ("kept",) if len(r) == 3 else r for r in runs]
    bad = [r for r in runs if len(r) != 4 or r[0] not in CACHES or r[1] not in WORKSPACES
           or r[2] not in AFTER or r[3] not in INPUTS]
    if bad:
        ap.error(f"--runs: {bad} are not cache:workspaces:after[:inputs] with cache in {CACHES}, "
                 f"workspaces in {WORKSPACES}, after in {AFTER}, inputs in {INPUTS}")
    try:
        res = probe(runs=runs, timeout=args.timeout, stacks=args.stacks)
    except CourseEnvironmentError:
        print("memory_probe: refused: it measures a GPU's caching allocator, and this machine "
              f"runs the simulator path ({runtime().reason}) Run it where torch sees an NVIDIA GPU "
              "(COURSE_PATH=cuda makes the course "
              "use it or say why it cannot).", file=sys.stderr)
        return 2
    print(report(res))
    Path(args.json).write_text(json.dumps(res, indent=1, default=str), encoding="utf-8")
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
