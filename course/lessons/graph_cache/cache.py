"""GraphCache: record a CUDA graph per input shape, replay it on later calls.

After the graph cache of InfiniLM's fused inference engine (``FusedInferEngine``): a graph recorded
per input shape, the same statistics (``get_stats()``) and switches (``set_fusion_enabled``,
``clear_cache()``).

``cache = GraphCache(forward, buckets=[1, 2, 4, 8])`` wraps a forward callable:

- the **key** of a call is the shape, dtype and device of each tensor argument (with the batch
  dimension replaced by its bucket) and the value of each other argument;
- a **miss** warms the forward up (``warmup_iters``, default 1 like InfiniLM's
  ``warmup_iterations``), captures it on static input buffers of the bucket's size, and replays; a
  **hit** copies the caller's tensors into the static inputs (padding rows filled with
  ``pad_value``), replays, and returns the outputs sliced back to the real batch, cloned
  (``copy_outputs=True``) or as views of the static outputs (``copy_outputs=False``: zero-copy
  views, valid only until the next call: the next replay of the same key overwrites them, and so can
  a replay of another key, since the graphs share one memory pool in which a graph's temporaries may
  reuse memory that holds another graph's output);
- a batch above the largest bucket runs eager (so does a call without tensor arguments, or with zero
  rows); a key whose capture fails runs eager from then on, with the reason kept in
  :meth:`GraphCache.get_stats`;
- ``fusion=True`` captures the forward compiled by ``torch.compile`` (default mode: no CUDA graphs
  of its own) instead of the eager kernels, like InfiniLM's "fusion" mode; a key whose fused capture
  fails falls back to capturing the eager kernels, then to eager.

The forward may run more than once on a miss (warm-up, capture, first replay): it must give the
same result when run again on the same inputs (a decode step that writes its KV entry and then
reads it is fine). The backend (:mod:`~course.lessons.graph_cache.backends`) is a real CUDA graph on
the GPU path and a recording backend on the simulator path; keys, padding and counts are identical.
"""
from __future__ import annotations

import dataclasses
import gc

import torch

from course.core.text import condense
from course.lessons.graph_cache.backends import CaptureFailed, default_backend
from course.lessons.graph_cache.buckets import next_bucket


@dataclasses.dataclass
class Entry:
    """One key of the cache: how it runs ("fusion", "graph_replay" or "eager") and its recording."""

    key: tuple
    mode: str
    bucket: int | None
    inputs: list | None = None  # static input buffers (tensors) or plain values
    recorded: object = None  # backends.Recorded
    # why this key runs eager, or why its fused capture fell back to the eager kernels
    reason: str = ""


def key_str(key) -> str:
    """A short readable form of a key: 'int64[8] float32[8,64] 3'."""
    parts = []
    for kind, *rest in key:
        if kind == "tensor":
            shape, dtype, _ = rest
            parts.append(f"{str(dtype).replace('torch.', '')}[{','.join(str(s) for s in shape)}]")
        else:
            parts.append(repr(rest[-1]))
    return " ".join(parts)


class CacheBase:
    """A graph cache's keys, static inputs, recordings, statistics and switches: everything of
    :class:`GraphCache` but its call."""

    def __init__(self, fn, *, buckets=None, batch_dim: int = 0, batched=None, pad_value=0,
                 warmup_iters: int = 1, copy_outputs: bool = True, fusion: bool = False, fused=None,
                 enabled: bool = True, backend=None, pools: str = "shared"):
        if not callable(fn):
            raise TypeError(f"GraphCache wraps a callable forward, got {type(fn).__name__}")
        sizes = sorted(set(buckets or []))
        if any(not isinstance(s, int) or s < 1 for s in sizes):
            raise ValueError(f"buckets must be positive ints (batch sizes), got {buckets!r}")
        if warmup_iters < 0:
            raise ValueError(f"warmup_iters must be >= 0, got {warmup_iters}")
        self.fn, self.sizes, self.batch_dim, self.batched = fn, sizes, batch_dim, batched
        self.pad_value, self.warmup_iters, self.copy_outputs = pad_value, warmup_iters, copy_outputs
        self.fusion, self._fused, self._compiled = fusion, fused, None
        self.enabled = enabled
        self.backend = backend or default_backend(pools)
        self._entries: dict = {}
        self.reset_stats()

    # ------------------------------------------------------------------ keys and padding
    def _is_batched(self, i: int, a) -> bool:
        return isinstance(a, torch.Tensor) and (self.batched is None or i in self.batched)

    def key_of(self, args) -> tuple:
        """(key, batch size, bucket) of a call; bucket None: above the largest bucket, run eager."""
        if isinstance(self.pad_value, (tuple, list)) and len(self.pad_value) != len(args):
            raise ValueError(f"pad_value has {len(self.pad_value)} entries but the call has "
                             f"{len(args)} arguments: give one per argument (any value for a "
                             "non-tensor one), or a single number.")
        n = None
        for i, a in enumerate(args):
            if self._is_batched(i, a):
                if a.dim() <= self.batch_dim:
                    raise ValueError(f"argument {i} has shape {tuple(a.shape)}: no batch "
                                     f"dimension {self.batch_dim}. Pass batched=(indices of the "
                                     "batched tensor arguments) to GraphCache.")
                size = a.shape[self.batch_dim]
                if n is None:
                    n = size
                elif size != n:
                    raise ValueError(f"argument {i} has batch size {size}, but an earlier tensor "
                                     f"argument has {n}: all batched arguments must share the "
                                     "batch dimension. Pass batched=(...) to name the batched "
                                     "ones.")
        bucket = next_bucket(n, self.sizes) if n else n
        parts = []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                shape = list(a.shape)
                if self._is_batched(i, a) and bucket is not None:
                    shape[self.batch_dim] = bucket
                # torch objects: hashable, no str() per call
                parts.append(("tensor", tuple(shape), a.dtype, a.device))
            else:
                try:
                    hash(a)
                except TypeError:
                    raise TypeError(f"argument {i} ({type(a).__name__}) is not hashable, so it "
                                    "cannot be part of a cache key: pass tensors, numbers, strings "
                                    "or tuples.") from None
                # the type too: True == 1, but not as a key here
                parts.append(("value", type(a).__name__, a))
        return tuple(parts), n, bucket

    def _pad_for(self, i: int):
        return self.pad_value[i] if isinstance(self.pad_value, (tuple, list)) else self.pad_value

    def _static_inputs(self, args, bucket) -> list:
        out = []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                shape = list(a.shape)
                if self._is_batched(i, a):
                    shape[self.batch_dim] = bucket
                out.append(torch.empty(shape, dtype=a.dtype, device=a.device))
            else:
                out.append(a)
        return out

    def _fill(self, static, args, n: int, bucket: int) -> None:
        """Copy the caller's tensors into the static inputs; fill the padding rows with
        ``pad_value``."""
        for i, (s, a) in enumerate(zip(static, args)):
            if not isinstance(a, torch.Tensor):
                continue
            if self._is_batched(i, a):
                s.narrow(self.batch_dim, 0, n).copy_(a)
                if bucket > n:
                    s.narrow(self.batch_dim, n, bucket - n).fill_(self._pad_for(i))
            else:
                s.copy_(a)

    def _outputs(self, out, n: int, bucket: int):
        if isinstance(out, torch.Tensor):
            if bucket != n and out.dim() > self.batch_dim and out.shape[self.batch_dim] == bucket:
                out = out.narrow(self.batch_dim, 0, n)
            return out.clone() if self.copy_outputs else out
        if isinstance(out, (tuple, list)):
            return type(out)(self._outputs(o, n, bucket) for o in out)
        if isinstance(out, dict):
            return {k: self._outputs(v, n, bucket) for k, v in out.items()}
        return out

    # ------------------------------------------------------------------ recording
    def _fused_fn(self):
        if self._fused is not None:
            return self._fused
        if self._compiled is None:
            if self.backend.name == "recording":
                # no compiler on the simulator path: the same kernels, counted as fused
                self._compiled = self.fn
            else:
                        # default mode: fused kernels, no CUDA graphs of its own
                        self._compiled = torch.compile(self.fn)
        return self._compiled

    def _record(self, key, args, n: int, bucket: int) -> Entry:
        static = self._static_inputs(args, bucket)
        self._fill(static, args, n, bucket)
        modes = ("fusion", "graph_replay") if self.fusion else ("graph_replay",)
        reason = ""
        for mode in modes:
            fn = self._fused_fn() if mode == "fusion" else self.fn
            self.fusion_attempts += mode == "fusion"
            # a compiled forward recompiles on its second call when its first changed what its
            # guards read (a decoder's KV cache made on first use): inside a capture that fails
            # ("operation not permitted when stream is capturing"), so fusion warms up twice
            warm = max(self.warmup_iters, 2) if mode == "fusion" else self.warmup_iters
            try:
                rec = self.backend.capture(fn, static, warmup=warm)
            except CaptureFailed as e:
                reason = e.reason
                self.fusion_fallbacks += mode == "fusion"
                continue
            except Exception as e:  # noqa: BLE001 - the compiled forward failed: the eager kernels
                if mode != "fusion":
                    # the forward itself is broken: that is the caller's error, not a fallback
                    raise
                why = condense(str(e), 1, 200)
                reason = f"the compiled forward failed: {type(e).__name__}: {why}"
                self.fusion_fallbacks += 1
                continue
            self.fusion_successes += mode == "fusion"
            self.recordings += 1
            # reason: why fusion fell back, if it did
            return Entry(key, mode, bucket, static, rec, reason=reason)
        return Entry(key, "eager", bucket, reason=reason)

    def warmup(self, sizes, make_args, order: str = "largest_first") -> list:
        """Record the buckets of ``sizes`` ahead of traffic (``make_args(size)`` builds example
        arguments).

        ``order="largest_first"`` (what vLLM, SGLang and TensorRT-LLM do) lets smaller graphs reuse
        the shared pool's memory; "smallest_first" is there to measure the difference. Returns one
        dict per recorded bucket (size, mode, capture_ms, memory_bytes). Prewarming counts as
        recordings, not misses.
        """
        if order not in ("largest_first", "smallest_first"):
            raise ValueError(f"order must be 'largest_first' or 'smallest_first', got {order!r}")
        buckets = {next_bucket(s, self.sizes) for s in sizes} - {None}
        done = []
        for b in sorted(buckets, reverse=order == "largest_first"):
            args = tuple(make_args(b))
            key, n, bucket = self.key_of(args)
            if key in self._entries:
                continue
            entry = self._entries[key] = self._record(key, args, n, bucket)
            rec = entry.recorded
            done.append({"size": b, "mode": entry.mode,
                         "capture_ms": rec.capture_ms if rec else 0.0,
                         "memory_bytes": rec.memory_bytes if rec else 0, "reason": entry.reason})
        return done

    # -------------------------------------------------------------- the API of InfiniLM's engine
    def get_stats(self) -> dict:
        """InfiniLM's statistics (same keys) plus padding waste, capture time, graph memory and
        fallback reasons.

        ``fallback_reasons`` maps a key to why it runs eager (mode "eager") or why its fused capture
        fell back to the eager kernels (mode "graph_replay"). ``fusion_scheduler_available`` is True
        where "fusion" really compiles (the GPU path, or a ``fused=`` forward was given); on the
        recording backend without one, fusion mode runs the same kernels.
        """
        modes = {key_str(k): e.mode for k, e in self._entries.items()}
        held = [e for e in self._entries.values() if e.recorded is not None]
        computed = self.real_rows + self.padded_rows
        return {
            "enabled": self.enabled, "fusion_enabled": self.fusion, "backend": self.backend.name,
            "fusion_scheduler_available": self.backend.name != "recording"
            or self._fused is not None,
            "cache_size": sum(e.mode != "eager" for e in self._entries.values()),
            "cache_hits": self.cache_hits, "cache_misses": self.cache_misses,
            "recordings": self.recordings,
            "fusion_attempts": self.fusion_attempts, "fusion_successes": self.fusion_successes,
            "fusion_fallbacks": self.fusion_fallbacks, "cached_shapes": list(modes),
            "fusion_modes": modes,
            "calls": self.calls, "eager_calls": self.eager_calls,
            "above_largest_bucket": self.above_largest,
            "fallback_reasons": {key_str(e.key): e.reason for e in self._entries.values()
                                 if e.reason},
            "buckets": list(self.sizes),
            "real_rows": self.real_rows, "padded_rows": self.padded_rows,
            "padding_waste": self.padded_rows / computed if computed else 0.0,
            "capture_ms": {key_str(e.key): e.recorded.capture_ms for e in held},
            "graph_memory_bytes": sum(e.recorded.memory_bytes for e in held),
        }

    def hit_rate(self) -> float:
        """InfiniLM's formula: cache_hits / (cache_hits + cache_misses); 0 before any call. Eager
        calls are neither."""
        total = self.cache_hits + self.cache_misses
        return self.cache_hits / total if total else 0.0

    def set_enabled(self, enabled: bool) -> None:
        """Turn the cache on or off (off: every call runs the forward eagerly; recorded graphs are
        kept)."""
        self.enabled = bool(enabled)

    def set_fusion_enabled(self, enabled: bool) -> None:
        """InfiniLM's switch: capture the compiled forward ("fusion") for keys recorded from now
        on."""
        self.fusion = bool(enabled)

    def reset_stats(self) -> None:
        """Zero the counters (the recorded graphs stay)."""
        self.calls = self.cache_hits = self.cache_misses = self.recordings = self.eager_calls = 0
        self.fusion_attempts = self.fusion_successes = self.fusion_fallbacks = 0
        self.above_largest = 0
        self.real_rows = self.padded_rows = 0

    def clear_cache(self) -> dict:
        """Drop every recorded key and free the graphs' memory; returns the memory reserved before
        and after."""
        before = self.backend.memory_reserved()
        self._entries.clear()
        self.backend.reset_pool()
        gc.collect()
        if self.backend.name != "recording":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        after = self.backend.memory_reserved()
        return {"before_bytes": before, "after_bytes": after, "freed_bytes": before - after}

    def __repr__(self) -> str:
        s = self.get_stats()
        return (f"GraphCache({s['backend']}, {s['cache_size']} graphs, hits {s['cache_hits']}, "
                f"misses {s['cache_misses']}, eager calls {s['eager_calls']}, "
                f"buckets {self.sizes or 'exact'})")


class GraphCache(CacheBase):
    """A shape-keyed CUDA-graph cache around ``fn`` (the module docstring says how it behaves)."""

    def __call__(self, *args):
        """The forward: replayed on a hit, recorded on a miss, eager when off, too large or fallen
        back."""
        self.calls += 1
        if not self.enabled:
            self.eager_calls += 1
            return self.fn(*args)
        key, n, bucket = self.key_of(args)
        if bucket is None or not n:  # above the largest bucket, or no batch (no tensor, zero rows)
            self.eager_calls += 1
            self.above_largest += bucket is None and bool(n)
            return self.fn(*args)
        entry = self._entries.get(key)
        if entry is None:
            self.cache_misses += 1
            entry = self._entries[key] = self._record(key, args, n, bucket)
        elif entry.mode != "eager":
            self.cache_hits += 1
            self._fill(entry.inputs, args, n, bucket)
        if entry.mode == "eager":
            self.eager_calls += 1
            return self.fn(*args)
        entry.recorded.replay()
        self.real_rows += n
        self.padded_rows += bucket - n
        return self._outputs(entry.recorded.output, n, bucket)
