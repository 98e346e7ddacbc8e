"""What a cleared graph cache leaves reserved on a GPU, and which release gives it back (a probe, run by hand).

The scenario: the buckets 256, 512 and 1024 of a ``width``-wide ``relu(t @ w) @ w`` through a cache, then
``clear_cache()``, a collection, a synchronize and ``empty_cache()``. It runs for lab 3's answer cache
(``MyGraphCache``, read from ``solutions/lab3_graph_cache.ipynb``: its setup and answer cells, without their checks)
and for the course's :class:`~course.lessons.graph_cache.cache.GraphCache`, each in a fresh process, each twice: with
the backend as it is (it drops torch's cuBLAS workspaces before each capture and at ``reset_pool()``:
:func:`course.core.hardware.release_blas_workspaces`) and with that release switched off (``workspaces="kept"``).

Each step's row holds ``torch.cuda.memory_reserved()`` and ``memory_allocated()`` (MiB) and what the step freed.
After the clear, the releases the candidates need are tried one at a time, each followed by a collection, a
synchronize and ``empty_cache()``: the backend's pool handle dropped, torch's cuBLAS workspaces dropped
(``torch._C._cuda_clearCublasWorkspaces()``), the caller's inputs dropped, the cleared cache object dropped, the
weight dropped; so the table says which release gives back how many MiB. The allocator's snapshot, taken right after
the clear, lists every segment still reserved (its stream, its pool, its size) and every live block with the frames
that allocated it (memory history recorded from the start), each block named when it is a known tensor or allocated
by cuBLAS.

``python3 -m course.lessons.graph_cache.memory_probe --json probe.json`` prints the table and writes everything as
JSON. It needs a GPU: on the simulator path it refuses (exit 2) and says so.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

MiB = 2**20
ROOT = Path(__file__).resolve().parents[3]
LAB3 = ROOT / "solutions" / "lab3_graph_cache.ipynb"
CACHES = ("answer", "GraphCache")
WORKSPACES = ("released", "kept")


class Ledger:
    """The rows of one run: ``step(name)`` reads ``read()`` -> (reserved, allocated) bytes and notes the change."""

    def __init__(self, cache: str, workspaces: str, read):
        self.cache, self.workspaces, self.read, self.rows = cache, workspaces, read, []

    def step(self, step: str, what: str = "") -> dict:
        """Append and return the row of ``step``: reserved and allocated MiB, and the MiB freed since the last row."""
        reserved, allocated = self.read()
        prev = self.rows[-1]["reserved_MiB"] if self.rows else reserved / MiB
        row = {"cache": self.cache, "workspaces": self.workspaces, "step": step, "what": what,
               "reserved_MiB": reserved / MiB, "allocated_MiB": allocated / MiB, "freed_MiB": prev - reserved / MiB}
        self.rows.append(row)
        return row


def format_rows(rows) -> str:
    """The rows as a fixed-width table (one line per step)."""
    head = f"{'cache':<11} {'workspaces':<10} {'step':<34} {'reserved':>9} {'allocated':>9} {'freed':>7}  what"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['cache']:<11} {r['workspaces']:<10} {r['step']:<34} {r['reserved_MiB']:>9.1f} "
                     f"{r['allocated_MiB']:>9.1f} {r['freed_MiB']:>7.1f}  {r['what']}")
    return "\n".join(lines)


def release_table(rows) -> list:
    """``[{"cache", "workspaces", "release", "freed_MiB"}]``: what the clear and each release after it gave back."""
    keep = ("clear_cache()", "gc + synchronize + empty_cache") + tuple(n for n, _ in RELEASES)
    return [{"cache": r["cache"], "workspaces": r["workspaces"], "release": r["step"], "freed_MiB": r["freed_MiB"]}
            for r in rows if r["step"] in keep]


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


def _now():
    import torch

    return torch.cuda.memory_reserved(), torch.cuda.memory_allocated()


def _frames(block, n: int = 6) -> list:
    """The allocating frames of a snapshot block, innermost first, without the allocator's own frames."""
    out = []
    for f in block.get("frames") or []:
        name, file = f.get("name", ""), f.get("filename", "")
        if "CachingAllocator" in name or "c10::" in name or "??" in name:
            continue
        out.append(f"{name} ({os.path.basename(file)}:{f.get('line', 0)})")
        if len(out) == n:
            break
    return out


def snapshot_summary(snapshot, known: dict, streams: dict) -> list:
    """One dict per reserved segment of ``torch.cuda.memory_snapshot()``: stream, pool, sizes, its live blocks.

    ``known``: data pointer -> name of a tensor the probe made; ``streams``: stream handle -> name. A live block is
    named by ``known``, else "cuBLAS workspace" when a frame that allocated it is cuBLAS's, else "?".
    """
    segs = []
    for seg in snapshot:
        blocks = []
        for b in seg.get("blocks", []):
            if b.get("state") != "active_allocated":
                continue
            frames = _frames(b)
            name = known.get(b.get("address"))
            if name is None and any("blas" in f.lower() for f in frames):
                name = "cuBLAS workspace"
            elif name is None:  # Python frames only: what the forward allocated and nothing references is a workspace
                name = "made in the forward (no tensor)" if any("<lambda>" in f for f in frames) else "?"
            blocks.append({"size_MiB": b["size"] / MiB, "name": name, "frames": frames})
        pool = seg.get("segment_pool_id")
        segs.append({"stream": streams.get(seg.get("stream"), f"stream {seg.get('stream')}"),
                     "pool": list(pool) if isinstance(pool, (tuple, list)) else pool,
                     "private_pool": bool(pool) and tuple(pool) != (0, 0),
                     "total_MiB": seg["total_size"] / MiB, "allocated_MiB": seg.get("allocated_size", 0) / MiB,
                     "live_blocks": blocks})
    return segs


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


def run_one(cache: str = "answer", workspaces: str = "released", width: int = 2048, buckets=(256, 512, 1024),
            stacks: str = "python") -> dict:
    """The scenario for one cache (``"answer"`` or ``"GraphCache"``) in this process; rows, segments, facts (GPU)."""
    from course.core.capture import require_gpu

    require_gpu("the graph cache memory probe (it reads a GPU's caching allocator)")
    if cache not in CACHES or workspaces not in WORKSPACES:
        raise ValueError(f"cache must be one of {CACHES} and workspaces one of {WORKSPACES}, "
                         f"got {cache!r}, {workspaces!r}")
    import torch

    from course.core import hardware
    from course.lessons.graph_cache import GraphCache

    if workspaces == "kept":
        hardware.release_blas_workspaces = lambda: False  # the backend as it was: torch keeps every workspace
    torch.cuda.memory._record_memory_history(max_entries=200000, stacks=stacks)
    led = Ledger(cache, workspaces, _settle)
    led.step("start")
    weight = torch.randn(width, width, device="cuda")
    state = {"weight": weight}
    state["forward"] = lambda t: torch.relu(t @ state["weight"]) @ state["weight"]  # the state holds the weight
    del weight
    led.step("weight", f"{width}x{width} float32")
    fwd = state["forward"]
    cls = answer_cache_class() if cache == "answer" else None
    state["cache"] = cls(fwd, buckets=list(buckets)) if cls else GraphCache(fwd, buckets=list(buckets))
    state["inputs"] = [torch.randn(b, width, device="cuda") for b in buckets]
    for x in state["inputs"]:
        state["cache"](x)
        led.step(f"call, batch {x.shape[0]}", "a miss: warm-up, capture, replay")
    state["pool"] = state["cache"].backend._pool  # noqa: SLF001
    pool = state["pool"]
    pool_id = tuple(pool) if isinstance(pool, (tuple, list)) else pool
    pool_bytes = sum(s["total_size"] for s in torch.cuda.memory_snapshot()
                     if tuple(s.get("segment_pool_id") or ()) == pool_id)
    led.step("settled, before the clear", f"the graphs' pool: {pool_bytes / MiB:.1f} MiB")
    state["cache"].clear_cache()
    led.step("clear_cache()", "as the cache does it")
    led.step("gc + synchronize + empty_cache")
    known = {t.data_ptr(): f"caller's input {tuple(t.shape)}" for t in state["inputs"]}
    known[state["weight"].data_ptr()] = "weight"
    streams = {torch.cuda.default_stream().cuda_stream: "default"}
    cap = getattr(torch.cuda.graph, "default_capture_stream", None)
    if cap is not None:
        streams[cap.cuda_stream] = "capture"
    segments = snapshot_summary(torch.cuda.memory_snapshot(), known, streams)
    del fwd
    for name, release in RELEASES:
        release(state)
        led.step(name)
    torch.cuda.memory._record_memory_history(enabled=None)
    facts = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0), "pool_handle": repr(pool),
             "pool_MiB_before_clear": pool_bytes / MiB, "CUBLAS_WORKSPACE_CONFIG": os.environ.get(
                 "CUBLAS_WORKSPACE_CONFIG"), "width": width, "buckets": list(buckets)}
    return {"rows": led.rows, "segments": segments, "facts": facts}


def probe(caches=CACHES, workspaces=WORKSPACES, timeout: float = 100, **kw) -> dict:
    """:func:`run_one` for each cache and workspace setting, each in a fresh process (GPU); ``{"runs": [...]}``."""
    from course.core.capture import require_gpu
    from course.core.isolate import run_isolated

    require_gpu("the graph cache memory probe (it reads a GPU's caching allocator)")
    runs = [run_isolated("course.lessons.graph_cache.memory_probe", "run_one", timeout=timeout, cache=c, workspaces=w, **kw)
            for c in caches for w in workspaces]
    rows = [r for run in runs for r in run["rows"]]
    return {"runs": runs, "rows": rows, "releases": release_table(rows)}


def main(argv=None) -> int:
    """The command line: the table on stdout, everything as JSON at ``--json``; exit 2 on the simulator path."""
    ap = argparse.ArgumentParser(prog="python3 -m course.lessons.graph_cache.memory_probe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True, help="where to write the rows, segments and facts")
    ap.add_argument("--caches", default=",".join(CACHES), help="comma-separated: answer, GraphCache")
    ap.add_argument("--workspaces", default=",".join(WORKSPACES), help="comma-separated: released, kept")
    ap.add_argument("--stacks", default="python", choices=("python", "all"),
                    help="frames recorded per allocation (all: C++ too, slower to symbolize)")
    ap.add_argument("--timeout", type=float, default=100, help="seconds per run (each in its own process)")
    args = ap.parse_args(argv)
    from course.core.runtime import CourseEnvironmentError

    try:
        res = probe(caches=tuple(args.caches.split(",")), workspaces=tuple(args.workspaces.split(",")),
                    timeout=args.timeout, stacks=args.stacks)
    except CourseEnvironmentError:
        from course.core.runtime import runtime

        print(f"memory_probe: refused: it measures a GPU's caching allocator, and this machine runs the simulator "
              f"path ({runtime().reason}) Run it where torch sees an NVIDIA GPU (COURSE_PATH=cuda makes the course "
              "use it or say why it cannot).", file=sys.stderr)
        return 2
    print(format_rows(res["rows"]))
    for run in res["runs"]:
        r0 = run["rows"][0]
        print(f"\n{r0['cache']}, workspaces {r0['workspaces']}: segments reserved right after the clear")
        for seg in run["segments"]:
            names = ", ".join(f"{b['name']} {b['size_MiB']:.1f}" for b in seg["live_blocks"]) or "no live block"
            print(f"  {seg['total_MiB']:7.1f} MiB  stream {seg['stream']:<8} pool {seg['pool']}  live: {names}")
    Path(args.json).write_text(json.dumps(res, indent=1, default=str), encoding="utf-8")
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
