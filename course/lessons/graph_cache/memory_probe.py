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

MiB = 2**20
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


class Ledger:
    """The rows of one run: ``step(name)`` reads ``read()`` -> (reserved, allocated) bytes and notes
    the change; ``split`` (a step's ``{"stream/pool": bytes}``) says where each row's memory
    lies."""

    def __init__(self, cache: str, workspaces: str, read, split=None, inputs: str = "kept"):
        self.cache, self.workspaces, self.inputs = cache, workspaces, inputs
        self.read, self.split, self.rows = read, split, []

    def step(self, step: str, what: str = "") -> dict:
        """Append and return the row of ``step``: reserved and allocated MiB, the MiB freed
        since."""
        reserved, allocated = self.read()
        prev = self.rows[-1]["reserved_MiB"] if self.rows else reserved / MiB
        row = {"cache": self.cache, "workspaces": self.workspaces, "inputs": self.inputs,
               "step": step, "what": what, "reserved_MiB": reserved / MiB,
               "allocated_MiB": allocated / MiB, "freed_MiB": prev - reserved / MiB}
        if self.split is not None:
            row["where_MiB"] = {k: v / MiB for k, v in self.split().items()}
        self.rows.append(row)
        return row


def format_rows(rows) -> str:
    """The rows as a fixed-width table (a line per step; an indented one: where its MiB lie)."""
    head = (f"{'cache':<11} {'workspaces':<10} {'inputs':<8} {'step':<34} {'reserved':>9} "
            f"{'allocated':>9} {'freed':>7}  what")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['cache']:<11} {r['workspaces']:<10} {r.get('inputs', 'kept'):<8} "
                     f"{r['step']:<34} {r['reserved_MiB']:>9.1f} {r['allocated_MiB']:>9.1f} "
                     f"{r['freed_MiB']:>7.1f}  {r['what']}")
        if r.get("where_MiB"):
            where = ", ".join(f"{k} {v:.1f}" for k, v in r["where_MiB"].items())
            lines.append(" " * 12 + "in: " + where)
    return "\n".join(lines)


def held_and_kept(rows, baseline: str = "weight", before: str = "settled, before the clear",
                  after: str = "gc + synchronize + empty_cache") -> dict:
    """The run in the terms of a caller whose baseline is taken after ``baseline`` (the weight
    allocated first): ``{"held_MiB"}`` reserved before the clear above it, ``{"kept_MiB"}`` still
    reserved above it after the clear."""
    at = {r["step"]: r["reserved_MiB"] for r in rows}
    return {"held_MiB": at[before] - at[baseline], "kept_MiB": at[after] - at[baseline]}


def pool_kind(pool) -> str:
    """``"ordinary"`` for the allocator's own memory (no pool or pool id (0, 0)), else ``"pool (a,
    b)"``."""
    pool = tuple(pool) if isinstance(pool, (tuple, list)) else pool
    return "ordinary" if not pool or pool == (0, 0) else f"pool {pool}"


def by_stream_pool(snapshot, streams: dict) -> dict:
    """``{"<stream name>/<pool kind>": reserved bytes}`` of a ``torch.cuda.memory_snapshot()``,
    largest first."""
    out: dict = {}
    for seg in snapshot:
        name = streams.get(seg.get("stream"), f"stream {seg.get('stream')}")
        key = f"{name}/{pool_kind(seg.get('segment_pool_id'))}"
        out[key] = out.get(key, 0) + seg["total_size"]
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _frames(block, n: int = 6) -> list:
    """The allocating frames of a snapshot block, innermost first, without the allocator's own
    frames."""
    out = []
    for f in block.get("frames") or []:
        name, file = f.get("name", ""), f.get("filename", "")
        if "CachingAllocator" in name or "c10::" in name or "??" in name:
            continue
        out.append(f"{name} ({os.path.basename(file)}:{f.get('line', 0)})")
        if len(out) == n:
            break
    return out


def name_block(address, size: int, frames: list, known: dict,
               workspace_bytes: int | None = None) -> str:
    """What a live block is: ``known[address]`` (a tensor the probe named), "cuBLAS workspace" (a
    cuBLAS frame allocated it, or, unnamed, it has exactly ``workspace_bytes``), "made in the
    forward (no tensor)", or "?"."""
    if address in known:
        return known[address]
    if any("blas" in f.lower() for f in frames):
        return "cuBLAS workspace"
    if workspace_bytes and size == workspace_bytes:
        return "cuBLAS workspace (by its size)"
    return "made in the forward (no tensor)" if any("<lambda>" in f for f in frames) else "?"


def snapshot_summary(snapshot, known: dict, streams: dict,
                     workspace_bytes: int | None = None) -> list:
    """One dict per reserved segment of ``torch.cuda.memory_snapshot()``: stream, pool, sizes, its
    live blocks.

    ``known``: data pointer -> name of a tensor the probe made; ``streams``: stream handle -> name.
    Each live block is named by :func:`name_block`.
    """
    segs = []
    for seg in snapshot:
        blocks = []
        for b in seg.get("blocks", []):
            if b.get("state") != "active_allocated":
                continue
            frames = _frames(b)
            blocks.append({"size_MiB": b["size"] / MiB, "frames": frames,
                           "name": name_block(b.get("address"), b["size"], frames, known,
                                              workspace_bytes)})
        pool = seg.get("segment_pool_id")
        segs.append({"stream": streams.get(seg.get("stream"), f"stream {seg.get('stream')}"),
                     "pool": list(pool) if isinstance(pool, (tuple, list)) else pool,
                     "private_pool": pool_kind(pool) != "ordinary",
                     "total_MiB": seg["total_size"] / MiB,
                     "allocated_MiB": seg.get("allocated_size", 0) / MiB,
                     "live_blocks": blocks})
    return segs


def format_segments(segments) -> list:
    """One line per segment: its size, stream, pool and live blocks (name and MiB)."""
    lines = []
    for seg in segments:
        names = ", ".join(f"{b['name']} "
                          f"{b['size_MiB']:.1f}" for b in seg["live_blocks"]) or "no live block"
        lines.append(f"  {seg['total_MiB']:7.1f} MiB  stream {seg['stream']:<28} pool "
                     f"{seg['pool']}  live: {names}")
    return lines


class StreamNames:
    """Stream handle -> name: "default", "capture", and every ``torch.cuda.Stream()`` made while
    installed, numbered in order with the step it was made in (``context``), e.g. "side 2 (call,
    batch 512)"."""

    def __init__(self):
        self.names: dict = {}
        self.context = ""
        self._made = 0
        self._restore = None

    def name(self, stream, name: str) -> None:
        """Name a stream (a ``torch.cuda.Stream``) or a raw handle."""
        self.names[getattr(stream, "cuda_stream", stream)] = name

    def made(self, handle) -> str:
        """Note a stream just made; returns the name it got."""
        self._made += 1
        name = f"side {self._made}" + (f" ({self.context})" if self.context else "")
        self.names.setdefault(handle, name)
        return self.names[handle]

    def install(self, torch) -> None:
        """Replace ``torch.cuda.Stream`` by a subclass that reports each new stream to :meth:`made`
        (GPU); streams torch only wraps (``current_stream()`` passes ``stream_id``) are not new and
        are not counted."""
        base, names = torch.cuda.Stream, self

        class NamedStream(base):
            def __new__(cls, *args, **kwargs):
                s = super().__new__(cls, *args, **kwargs)
                if "stream_id" not in kwargs:  # new, not one torch wraps (current_stream())
                    names.made(s.cuda_stream)
                return s

        torch.cuda.Stream = NamedStream
        self._restore = (torch.cuda, base)

    def uninstall(self) -> None:
        """Put ``torch.cuda.Stream`` back as :meth:`install` found it (the names stay)."""
        if self._restore is not None:
            module, base = self._restore
            module.Stream = base
            self._restore = None


def workspace_facts() -> dict:
    """What a fresh side stream's first product keeps allocated beyond its output, and what
    ``torch._C._cuda_clearCublasWorkspaces()`` then gives back (GPU): for ``a @ b`` (cuBLAS) and for
    ``torch.addmm(bias, a, b)`` (with a bias torch takes cuBLASLt's path), each in float32 and
    bfloat16.

    ``{"<op> <dtype>": {"kept_MiB", "left_after_release_MiB"}}``: a kept workspace the release does
    not free (e.g. cuBLASLt's) shows up as ``left_after_release_MiB`` > 0.
    """
    facts = {}
    ops = {"mm": lambda a, b, c: a @ b, "addmm with bias": lambda a, b, c: torch.addmm(c, a, b)}
    for dtype in (torch.float32, torch.bfloat16):
        for op_name, op in ops.items():
            torch._C._cuda_clearCublasWorkspaces()
            torch.cuda.synchronize()
            a, b = (torch.randn(64, 64, device="cuda", dtype=dtype) for _ in range(2))
            c = torch.randn(64, device="cuda", dtype=dtype)
            base = torch.cuda.memory_allocated()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                y = op(a, b, c)
            torch.cuda.current_stream().wait_stream(s)
            torch.cuda.synchronize()
            kept = torch.cuda.memory_allocated() - base - y.untyped_storage().nbytes()
            del y
            torch._C._cuda_clearCublasWorkspaces()
            torch.cuda.synchronize()
            left = torch.cuda.memory_allocated() - base
            name = f"{op_name} {str(dtype).replace('torch.', '')}"
            facts[name] = {"kept_MiB": kept / MiB, "left_after_release_MiB": left / MiB}
    return facts


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
                 if not ln.startswith(("lab.check_", "course.header("))]
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
