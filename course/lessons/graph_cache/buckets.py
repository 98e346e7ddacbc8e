"""Batch-size buckets: the sizes real engines capture, stored as data with their source, and padding
math.

An engine that keeps one CUDA graph per batch size cannot capture every size, so it captures a
list of sizes and pads each batch up to the next one (:func:`next_bucket`); above the largest it
runs eager. :data:`PRESETS` holds the lists used by vLLM, SGLang and TensorRT-LLM;
:func:`bucket_sizes` expands one up to a maximum batch, :func:`padding_report` measures what a
list costs on a trace of batch sizes (padded rows, graphs needed, eager calls). Pure Python: it
runs the same on a laptop and on a GPU.
"""
from __future__ import annotations

import dataclasses
import random


@dataclasses.dataclass(frozen=True)
class Preset:
    """A bucket list: ``segments`` are (start, stop inclusive, step) runs; ``cap`` limits the
    largest size."""

    name: str
    segments: tuple
    source: str
    cap: str = ""  # how the engine limits the largest captured size, in words

    def sizes(self, max_size: int) -> list:
        """The sizes of this preset up to ``max_size`` (open-ended segments run up to it)."""
        out = set()
        for start, stop, step in self.segments:
            stop = max_size if stop is None else min(stop, max_size)
            out.update(range(start, stop + 1, step))
        return sorted(out)


PRESETS = {
    "vllm": Preset(
        "vllm", ((1, 2, 1), (4, 4, 1), (8, 248, 8), (256, None, 16)),
        "vLLM CompilationConfig.cudagraph_capture_sizes default: [1, 2, 4] + range(8, 256, 8) + "
        "range(256, max + 1, 16)",
        "max = min(2 * max_num_seqs, 512)"),
    "sglang": Preset(
        "sglang", ((1, 2, 1), (4, 4, 1), (8, 8, 1), (12, 12, 1), (16, 256, 8), (272, 496, 16),
                   (512, None, 32)),
        "SGLang cuda_graph_bs default: [1, 2, 4, 8, 12] + range(16, 257, 8) + range(272, 512, 16) "
        "+ range(512, max + 1, 32)",
        "max = cuda_graph_max_bs"),
    "trtllm": Preset(
        "trtllm", ((1, 2, 1), (4, 4, 1), (8, 128, 8), (192, None, 64)),
        "TensorRT-LLM cuda_graph_config batch sizes with padding enabled: 1, 2, 4, 8..128 step 8, "
        "then step 64",
        "max = cuda_graph_config.max_batch_size"),
}


def bucket_sizes(preset: str, max_size: int) -> list:
    """Sizes to capture for ``preset`` ("exact", "pow2" or a key of :data:`PRESETS`) up to
    ``max_size``.

    "exact" means no bucketing (every batch size gets its own graph): it returns ``[]``, which
    :class:`~course.lessons.graph_cache.cache.GraphCache` reads as "key on the exact size".
    """
    if not isinstance(max_size, int) or max_size < 1:
        raise ValueError(f"max_size must be a positive int, got {max_size!r}")
    if preset == "exact":
        return []
    if preset == "pow2":
        return [1 << i for i in range(max_size.bit_length()) if 1 << i <= max_size]
    if preset not in PRESETS:
        raise KeyError(f"unknown preset {preset!r}: use 'exact', 'pow2' or one of "
                       f"{sorted(PRESETS)}")
    return PRESETS[preset].sizes(max_size)


def next_bucket(n: int, sizes) -> int | None:
    """The smallest size in ``sizes`` that is >= ``n``; ``n`` itself when ``sizes`` is empty
    (exact); None above."""
    if n < 1:
        raise ValueError(f"a batch has at least one row, got {n}")
    if not sizes:
        return n
    for s in sorted(sizes):
        if s >= n:
            return s
    return None


def padding_report(trace, sizes) -> dict:
    """What a bucket list costs on a trace of batch sizes.

    Returns rows (real rows), padded_rows (rows added by padding), waste (padded / computed rows),
    graphs (distinct sizes the trace needs captured), eager_calls (batches above the largest size).
    """
    real = padded = eager = 0
    used = set()
    for n in trace:
        b = next_bucket(n, sizes)
        real += n
        if b is None:
            eager += 1
            continue
        used.add(b)
        padded += b - n
    computed = real + padded
    return {"rows": real, "padded_rows": padded, "waste": padded / computed if computed else 0.0,
            "graphs": len(used), "eager_calls": eager}


def decode_trace(steps: int = 300, max_batch: int = 64, mean_new: float = 1.5, mean_len: int = 30,
                 seed: int = 0) -> list:
    """Batch sizes of ``steps`` decode steps of a toy server: requests arrive, decode a while,
    leave.

    Each step a few requests arrive (Poisson-like, mean ``mean_new``) while the batch has room
    (``max_batch``); each request decodes for a random number of tokens (mean ``mean_len``).
    Deterministic for a seed; no GPU needed.
    """
    rng = random.Random(seed)
    active, trace = [], []
    for _ in range(steps):
        arrivals = sum(rng.random() < mean_new / 8 for _ in range(8))
        for _ in range(arrivals):
            if len(active) < max_batch:
                active.append(max(1, int(rng.expovariate(1.0 / mean_len))))
        if not active:
            active.append(max(1, int(rng.expovariate(1.0 / mean_len))))
        trace.append(len(active))
        active = [left - 1 for left in active if left > 1]
    return trace
