"""Why did one eager decode step read 2180 us in the step table and 3562 us in the ratios of the same run? (GPU)

``python -m course.lessons.graph_cache.diagnose_step`` times the batch-1 eager step (CUDA events, 10 back-to-back
steps per repeat) in one process, again after each thing the old ``graph_cache_step`` did between its two
measurements, and prints one row per stage:

1. ``fresh``: the step alone, before anything else ran in the process;
2. ``after compiles``: after building the cache (graph_replay, fusion) and reduce-overhead (torch.compile state);
3. ``interleaved``: the same step taking turns with those variants (``time_interleaved``);
4. ``after profiler``: after one ``torch.profiler`` session with CUDA activities (``launch_counts``): CUPTI may
   stay attached and slow every later launch; run it once more with ``TEARDOWN_CUPTI=1`` in the environment;
5. ``interleaved after profiler``.

The stage whose median leaves the previous one's IQR is the cause. Nothing is recorded.
"""
from __future__ import annotations

from course.core.capture import require_gpu
from course.core.compiled import reset_compile
from course.core.profiling import launch_counts
from course.core.timing import time_device, time_interleaved
from course.lessons.graph_cache.cache import GraphCache
from course.lessons.graph_cache.decoder import DecoderConfig, TinyDecoder
from course.lessons.graph_cache.experiments import say


def step_timing_factors(repeats: int = 25, layers: int = 2) -> list:
    """The eager batch-1 step timed at each stage above, in one process: ``[{"stage", "us", "q1_us", "q3_us"}]``."""
    require_gpu("diagnosing the step timings")
    import torch

    model = TinyDecoder(DecoderConfig(layers=layers))
    args = model.example_args(1, 5)
    rows = []

    def note(stage, t):
        rows.append({"stage": stage, "us": t.us, "q1_us": t.q1 * 1e6, "q3_us": t.q3 * 1e6})
        say(f"{stage:28s} eager step {t.us:8.1f} us (IQR {t.q1 * 1e6:.1f}-{t.q3 * 1e6:.1f})")

    with torch.no_grad():
        eager = lambda: model.step(*args)  # noqa: E731
        note("fresh", time_device(eager, warmup=3, repeats=repeats, inner=10))
        reset_compile()
        replay, fused = GraphCache(model.step), GraphCache(model.step, fusion=True)
        replay(*args)
        fused(*args)
        reset_compile()
        ro = torch.compile(model, mode="reduce-overhead")
        for _ in range(3):
            ro(*args)
        note("after compiles", time_device(eager, warmup=3, repeats=repeats, inner=10))
        others = {"eager": eager, "replay": lambda: replay(*args), "fusion": lambda: fused(*args),
                  "reduce-overhead": lambda: ro(*args)}
        note("interleaved", time_interleaved(others, warmup=3, repeats=repeats, inner=10)["eager"])
        launch_counts(eager, calls=5)
        note("after profiler", time_device(eager, warmup=3, repeats=repeats, inner=10))
        note("interleaved after profiler", time_interleaved(others, warmup=3, repeats=repeats, inner=10)["eager"])
    reset_compile()
    return rows


if __name__ == "__main__":
    step_timing_factors()
