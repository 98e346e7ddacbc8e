"""The course map: every notebook, lab and solution, in teaching order, and the modules that hold
its experiments.

Each lesson or lab entry names the modules whose ``@experiment`` functions it shows first
(``experiments``); :func:`experiment_modules` lists them all, and
:func:`course.core.reference.load_all` imports exactly those, failing loudly on one that no longer
exists.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class Entry:
    """One notebook of the course."""

    path: str  # relative to the repository root
    title: str
    kind: str  # "lesson", "lab" or "solution"
    summary: str
    experiments: tuple = ()  # modules that register the experiments this notebook shows first
    # its answer version has cells tagged "experiment" (course.core.cells)
    experiment_cells: bool = False

    @property
    def answer_version(self) -> str:
        """The answer version this notebook is generated from (itself, for an entry in solutions/).
        """
        return f"solutions/{Path(self.path).name}"


CATALOG = (
    Entry("notebooks/00_start_here.ipynb", "Start here", "lesson",
          "what the course is, the doctor's verdict, GPU path vs simulator path, the map"),
    Entry("notebooks/01_launch_overhead.ipynb", "Launch overhead", "lesson",
          "why small kernels make the GPU wait for the CPU: measured, swept, profiled",
          (), experiment_cells=True),
    Entry("notebooks/02_capture_and_replay.ipynb", "Capture and replay", "lesson",
          "CUDA graphs by hand: warm-up, static inputs, replay, "
          "what freezes, shared pools; your own captures",
          (), experiment_cells=True),
    Entry("notebooks/03_what_breaks_capture.ipynb", "What breaks capture", "lesson",
          "host syncs, device-to-host copies, .item(): a zoo of hazards and a finder",
          ("course.lessons.what_breaks.bench",), experiment_cells=True),
    Entry("notebooks/04_graph_cache.ipynb", "A shape-keyed CUDA-graph cache", "lesson",
          "InfiniLM's fused inference engine, as a graph cache for a tiny "
          "decoder: keys, buckets, fallbacks, its FAQ, vs reduce-overhead",
          ("course.lessons.graph_cache.bench",), experiment_cells=True),
    Entry("labs/lab1_embedding_kernel.ipynb", "Lab 1: an embedding kernel in Numba CUDA", "lab",
          "write the lookup kernel, then a faster one; checked against F.embedding",
          ("course.embedding.bench", "course.embedding.launch_cost", "course.embedding.access")),
    Entry("labs/lab2_embedding_swap.ipynb", "Lab 2: swap, capture, replay", "lab",
          "the CPU-copy embedding cannot be captured; the device kernel can"),
    Entry("labs/lab3_graph_cache.ipynb", "Lab 3: build a graph cache", "lab",
          "key, capture on miss, replay on hit, stats, "
          "buckets and padding, fallback, enable/clear"),
    Entry("notebooks/05_sharded_embedding.ipynb", "A sharded embedding table", "lesson",
          "PyTorch's DTensor sharded-embedding test, vocab-parallel with the Numba "
          "kernel, capture on 2 GPUs, data-parallel ranks must agree on the graph",
          ("course.lessons.sharding.bench",), experiment_cells=True),
    Entry("notebooks/06_real_model.ipynb", "A real model's decode step", "lesson",
          "transformers' Llama in TinyLlama's shape: the finder, the fixes, "
          "graph cache and fusion, correctness, the roofline, a batch sweep", experiment_cells=True),
    Entry("labs/lab4_real_model.ipynb", "Lab 4: capture a real model's decode step", "lab",
          "make the step capturable, wrap it in the graph "
          "cache, predict tokens/s, explain the gap per kernel"),
    Entry("notebooks/07_last_mile.ipynb", "The last mile to the floor", "lesson",
          "five fused Triton kernels per layer, PDL in the "
          "CUDA graph, the waterfall from eager to the floor",
          ("course.lessons.last_mile.waterfall", "course.lessons.last_mile.sweeps",
           "course.lessons.last_mile.bench"), experiment_cells=True),
    Entry("notebooks/08_tensor_parallel.ipynb", "Tensor parallel, captured", "lesson",
          "lesson 06's model split over 2 and 4 GPUs (parallelize_module, and by "
          "hand), all-reduces counted, one graph per rank with NCCL inside, the floor "
          "per rank; you write the per-rank capture; lesson 07's fused step on every "
          "rank (NCCL or symmetric-memory all-reduces), you place the residual and the "
          "all-reduces, when splitting pays (TinyLlama vs Llama-3.1-8B's shape)",
          (), experiment_cells=True),
)


def _answer_version(e: Entry) -> Entry:
    """The catalog entry of ``e``'s answer version (solutions/, generating ``e``)."""
    n = Path(e.path).stem.split("_")[0].removeprefix("lab")
    if e.kind == "lab":
        return Entry(e.answer_version, f"Lab {n} solution", "solution",
                     f"the reference answers for lab {n}")
    return Entry(e.answer_version, f"Lesson {n} with answers", "solution",
                 f"lesson {n} with its exercises answered; generates {e.path}")


CATALOG += tuple(sorted((_answer_version(e) for e in CATALOG if e.path != CATALOG[0].path),
                        key=lambda e: ("lab" in e.path, e.path)))  # every one but "Start here"


def entries(kind: str | None = None) -> list:
    """Catalog entries, optionally of one kind."""
    return [e for e in CATALOG if kind is None or e.kind == kind]


def all_notebooks_on_disk(root: Path = ROOT) -> list:
    """Every .ipynb under notebooks/, labs/ and solutions/ (what nbval must collect)."""
    out = []
    for d in ("notebooks", "labs", "solutions"):
        out += sorted(p for p in (root / d).glob("*.ipynb"))
    return out


def experiment_modules() -> tuple:
    """Every module the course map names as holding experiments, in teaching order, each once."""
    return tuple(dict.fromkeys(m for e in CATALOG for m in e.experiments))


def experiment_notebooks(root: Path = ROOT) -> tuple:
    """The answer versions whose cells define experiments (entries with ``experiment_cells``), in
    teaching order."""
    return tuple(dict.fromkeys(root / e.answer_version for e in CATALOG if e.experiment_cells))


def course_map() -> str:
    """The map as Markdown-ish text, for notebook 00 and the README."""
    lines = []
    for e in CATALOG:
        if e.kind != "solution":
            lines.append(f"- {e.path}: {e.title}: {e.summary}")
    return "\n".join(lines)
