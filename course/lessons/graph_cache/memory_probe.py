"""What a cleared graph cache leaves reserved on a GPU, and which release gives it back (a probe, run by hand).

The scenario: the buckets 256, 512 and 1024 of a ``width``-wide ``relu(t @ w) @ w`` through a cache, then
``clear_cache()``, a collection, a synchronize and ``empty_cache()``. It runs for lab 3's answer cache
(``MyGraphCache``, read from ``solutions/lab3_graph_cache.ipynb``: its setup and answer cells, without their checks)
and for the course's :class:`~course.lessons.graph_cache.cache.GraphCache`, each in a fresh process: with the backend
as it is (it drops torch's cuBLAS workspaces before each capture and at ``reset_pool()``:
:func:`course.core.hardware.release_blas_workspaces`) and with that release switched off (``workspaces="kept"``).

Each step's row holds ``torch.cuda.memory_reserved()`` and ``memory_allocated()`` (MiB), what the step freed, and
where the reserved memory lies (the allocator's segments summed by stream and pool: "default", "capture", and each
side stream a cache made, named by the call that made it). After the clear, the releases the candidates need are
tried one at a time, each followed by a collection, a synchronize and ``empty_cache()``: the backend's pool handle
dropped, torch's cuBLAS workspaces dropped (``torch._C._cuda_clearCublasWorkspaces()``), the caller's inputs dropped,
the cleared cache object dropped, the weight dropped; so the table says which release gives back how many MiB. The
allocator's snapshot, before the clear, right after it and after every release, lists every segment reserved (stream,
pool, size) and every live block, named: the weight, the caller's inputs, the cache's static inputs and outputs, a
cuBLAS workspace (by its allocating frame, or by its size), or what the forward made. A run with ``after="eager"``
runs the forward eagerly after the last capture (default and side stream), as a caller checking results would. Each
run starts by measuring what a fresh stream's first ``mm`` and ``addmm`` (cuBLAS and cuBLASLt paths) keep and what
the workspace release gives back (:func:`~course.lessons.graph_cache.memory_ledger.workspace_facts`). The summary
line gives the run in a caller's terms: MiB held before the clear and kept after it, above the weight's row.

``python3 -m course.lessons.graph_cache.memory_probe --json probe.json`` prints the table and writes everything as
JSON (five runs, each in a fresh process; ``--runs`` picks others). It needs a GPU: on the simulator path it refuses
(exit 2) and says so.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

from course.lessons.graph_cache.memory_ledger import (MiB, Ledger, StreamNames, by_stream_pool,  # noqa: F401
                                                      format_rows, format_segments, held_and_kept, snapshot_summary,
                                                      workspace_facts)

ROOT = Path(__file__).resolve().parents[3]
LAB3 = ROOT / "solutions" / "lab3_graph_cache.ipynb"
CACHES = ("answer", "GraphCache")
WORKSPACES = ("released", "kept")
AFTER = ("nothing", "eager")  # after the last capture: nothing, or the forward run eagerly (default and side stream)
# the runs of a plain probe: (cache, workspaces, after); each in its own process
RUNS = (("answer", "released", "nothing"), ("answer", "released", "eager"), ("answer", "kept", "nothing"),
        ("GraphCache", "released", "nothing"), ("GraphCache", "kept", "nothing"))


def answer_cache_class(path=LAB3):
    """Lab 3's ``MyGraphCache`` from the answer version: its setup and answer cells run without their checks."""
    nb = json.loads(Path(path).read_text(encoding="utf-8"))
    ns = {"__name__": "__lab3_answer__"}
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        src = "".join(cell["source"])
        lines = [ln for ln in src.splitlines() if not ln.startswith(("lab.check_", "course.header("))]
        exec(compile("\n".join(lines), f"{Path(path).name}#answer", "exec"), ns)  # noqa: S102 - the course's answer
        if "MyGraphCache" in ns:
            return ns["MyGraphCache"]
    raise RuntimeError(f"{Path(path).name} defines no MyGraphCache: the probe follows lab 3's answer cells")


def _settle():
    import torch

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved(), torch.cuda.memory_allocated()


def _drop_pool(state):
    backend = state["cache"].backend
    state["pool"] = None
    backend._pool = None  # noqa: SLF001 - the probe reaches in on purpose: does the handle hold memory?


def _drop_workspaces(state):
    import torch

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
    """``[{"cache", "workspaces", "release", "freed_MiB"}]``: what the clear and each release after it gave back."""
    keep = ("clear_cache()", "gc + synchronize + empty_cache") + tuple(n for n, _ in RELEASES)
    return [{"cache": r["cache"], "workspaces": r["workspaces"], "release": r["step"], "freed_MiB": r["freed_MiB"]}
            for r in rows if r["step"] in keep]


def cache_tensors(cache) -> dict:
    """data pointer -> name of each static input and static output a cache holds (lab 3's entries or GraphCache's)."""
    import torch

    named = {}
    entries = getattr(cache, "entries", None)
    if entries is None:  # GraphCache: Entry(inputs, recorded.output)
        entries = {k: {"static": e.inputs, "output": getattr(e.recorded, "output", None), "bucket": e.bucket}
                   for k, e in cache._entries.items()}  # noqa: SLF001 - the probe names what the cache holds
    for key, e in entries.items():
        rows = e.get("bucket") or next((t.shape[0] for t in e.get("static") or () if isinstance(t, torch.Tensor)), "?")
        for t in e.get("static") or ():
            if isinstance(t, torch.Tensor):
                named[t.data_ptr()] = f"cache's static input (bucket {rows})"
        outs = e.get("output")
        for t in (outs if isinstance(outs, (tuple, list)) else [outs]):
            if isinstance(t, torch.Tensor):
                named[t.data_ptr()] = f"cache's static output (bucket {rows})"
    return named


def run_one(cache: str = "answer", workspaces: str = "released", after: str = "nothing", width: int = 2048,
            buckets=(256, 512, 1024), stacks: str = "python") -> dict:
    """The scenario for one cache (``"answer"`` or ``"GraphCache"``) in this process: rows (each with where its
    reserved memory lies, by stream and pool), the live blocks at the main steps, and facts (GPU).

    ``after="eager"`` runs the forward eagerly after the last capture, on the default stream and on a side stream,
    as a caller who checks the cache's results would: those streams then hold cuBLAS workspaces at the clear.
    """
    from course.core.capture import require_gpu

    require_gpu("the graph cache memory probe (it reads a GPU's caching allocator)")
    if cache not in CACHES or workspaces not in WORKSPACES or after not in AFTER:
        raise ValueError(f"cache must be one of {CACHES}, workspaces one of {WORKSPACES} and after one of {AFTER}, "
                         f"got {cache!r}, {workspaces!r}, {after!r}")
    import torch

    from course.core import hardware
    from course.lessons.graph_cache import GraphCache

    streams = StreamNames()
    streams.install(torch)
    release = hardware.release_blas_workspaces
    try:
        return _scenario(torch, hardware, GraphCache, streams, cache, workspaces, after, width, buckets, stacks)
    finally:  # this process may go on (a test): torch, the backend's release and the history as they were
        streams.uninstall()
        hardware.release_blas_workspaces = release
        torch.cuda.memory._record_memory_history(enabled=None)


def _scenario(torch, hardware, GraphCache, streams, cache, workspaces, after, width, buckets, stacks) -> dict:
    streams.name(torch.cuda.default_stream(), "default")
    streams.context = "workspace facts"
    ws = workspace_facts()  # first: it also tells the size of one workspace, to name blocks by their size
    ws_bytes = round(ws["mm float32"]["kept_MiB"] * MiB) or None
    if workspaces == "kept":
        hardware.release_blas_workspaces = lambda: False  # the backend as it was: torch keeps every workspace
    torch.cuda.memory._record_memory_history(max_entries=200000, stacks=stacks)
    known: dict = {}
    snaps: dict = {}

    def look(step):
        snaps[step] = snapshot_summary(torch.cuda.memory_snapshot(), known, streams.names, ws_bytes)

    led = Ledger(cache, workspaces, _settle, split=lambda: by_stream_pool(torch.cuda.memory_snapshot(), streams.names))
    streams.context = ""
    led.step("start", "after the workspace facts (released)")
    weight = torch.randn(width, width, device="cuda")
    known[weight.data_ptr()] = "weight"
    state = {"weight": weight}
    state["forward"] = lambda t: torch.relu(t @ state["weight"]) @ state["weight"]  # the state holds the weight
    del weight
    led.step("weight", f"{width}x{width} float32 (the baseline)")
    fwd = state["forward"]
    cls = answer_cache_class() if cache == "answer" else None
    state["cache"] = cls(fwd, buckets=list(buckets)) if cls else GraphCache(fwd, buckets=list(buckets))
    state["inputs"] = [torch.randn(b, width, device="cuda") for b in buckets]
    known.update({t.data_ptr(): f"caller's input {tuple(t.shape)}" for t in state["inputs"]})
    for x in state["inputs"]:
        streams.context = f"call, batch {x.shape[0]}"
        state["cache"](x)
        cap = getattr(torch.cuda.graph, "default_capture_stream", None)
        if cap is not None:
            streams.name(cap, "capture")
        known.update(cache_tensors(state["cache"]))
        led.step(f"call, batch {x.shape[0]}", "a miss: warm-up, capture, replay")
    if after == "eager":
        streams.context = "eager after the captures"
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fwd(state["inputs"][-1])
        torch.cuda.current_stream().wait_stream(side)
        fwd(state["inputs"][-1])
        led.step("eager forward after the captures", "default stream and a side stream, outputs dropped")
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
    facts = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(0),
             "pool_handle": repr(pool), "pool_MiB_before_clear": pool_bytes / MiB, "after": after,
             "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
             "CUBLASLT_WORKSPACE_SIZE": os.environ.get("CUBLASLT_WORKSPACE_SIZE"),
             "width": width, "buckets": list(buckets), "workspace_facts": ws, "streams": sorted(streams.names.values())}
    return {"rows": led.rows, "segments": snaps["after the clear"], "snapshots": snaps, "facts": facts,
            "summary": held_and_kept(led.rows)}


def probe(runs=RUNS, timeout: float = 90, **kw) -> dict:
    """:func:`run_one` for each ``(cache, workspaces, after)`` of ``runs``, each in a fresh process (GPU)."""
    from course.core.capture import require_gpu
    from course.core.isolate import run_isolated

    require_gpu("the graph cache memory probe (it reads a GPU's caching allocator)")
    out = [run_isolated("course.lessons.graph_cache.memory_probe", "run_one", timeout=timeout, cache=c, workspaces=w,
                        after=a, **kw) for c, w, a in runs]
    rows = [r for run in out for r in run["rows"]]
    return {"runs": out, "rows": rows, "releases": release_table(rows)}


def report(res) -> str:
    """The probe's printout: the table, then per run its summary, the workspace facts and the live blocks."""
    lines = [format_rows(res["rows"])]
    for run in res["runs"]:
        f, s = run["facts"], run["summary"]
        lines.append(f"\n{run['rows'][0]['cache']}, workspaces {run['rows'][0]['workspaces']}, after the captures: "
                     f"{f['after']} (torch {f['torch']}, {f['device']}): above the baseline (weight allocated), "
                     f"{s['held_MiB']:.1f} MiB held before the clear, {s['kept_MiB']:.1f} MiB kept after it")
        lines.append("  a fresh stream's first product keeps: " + "; ".join(
            f"{k} {v['kept_MiB']:.2f} MiB ({v['left_after_release_MiB']:.2f} left after the release)"
            for k, v in f["workspace_facts"].items()))
        for step, segs in run["snapshots"].items():
            lines.append(f"  segments reserved, {step}:")
            lines.extend(format_segments(segs))
    return "\n".join(lines)


def main(argv=None) -> int:
    """The command line: the report on stdout, everything as JSON at ``--json``; exit 2 on the simulator path."""
    ap = argparse.ArgumentParser(prog="python3 -m course.lessons.graph_cache.memory_probe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True, help="where to write the rows, segments and facts")
    ap.add_argument("--runs", default=",".join(":".join(r) for r in RUNS),
                    help="comma-separated cache:workspaces:after (answer|GraphCache : released|kept : nothing|eager)")
    ap.add_argument("--stacks", default="python", choices=("python", "all"),
                    help="frames recorded per allocation (all: C++ too, slower to symbolize)")
    ap.add_argument("--timeout", type=float, default=90, help="seconds per run (each in its own process)")
    args = ap.parse_args(argv)
    runs = [tuple(r.split(":")) for r in args.runs.split(",")]
    bad = [r for r in runs if len(r) != 3 or r[0] not in CACHES or r[1] not in WORKSPACES or r[2] not in AFTER]
    if bad:
        ap.error(f"--runs: {bad} are not cache:workspaces:after with cache in {CACHES}, workspaces in {WORKSPACES}, "
                 f"after in {AFTER}")
    from course.core.runtime import CourseEnvironmentError

    try:
        res = probe(runs=runs, timeout=args.timeout, stacks=args.stacks)
    except CourseEnvironmentError:
        from course.core.runtime import runtime

        print(f"memory_probe: refused: it measures a GPU's caching allocator, and this machine runs the simulator "
              f"path ({runtime().reason}) Run it where torch sees an NVIDIA GPU (COURSE_PATH=cuda makes the course "
              "use it or say why it cannot).", file=sys.stderr)
        return 2
    print(report(res))
    Path(args.json).write_text(json.dumps(res, indent=1, default=str), encoding="utf-8")
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
