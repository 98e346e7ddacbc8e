"""The memory probe's ledger (:mod:`.memory_probe`): the rows of a run, where the reserved memory
lies (the allocator's segments by stream and pool) and a name for every live block.
"""
from __future__ import annotations

import os

import torch

MiB = 2**20


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
