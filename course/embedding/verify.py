"""``python -m course verify-embedding --impl cpu-copy|device``: can this embedding be captured?

InfiniCore's ``test_embedding_graph_recording.py`` checks, each able to fail for the right reason:
the input; a capture of one forward; a replay on new ids against ``F.embedding``; device-resident
ids with no device-to-host copy in the profiler; asynchrony by :mod:`course.core.blocking`
(InfiniCore's event test printed and explained); a ✓/✗ summary. Exit 0 when all pass, 1 when one
fails, 2 on the simulator.
"""
from __future__ import annotations

import dataclasses
import warnings

import torch
import torch.nn.functional as F

LINE = "=" * 64
TITLES = {"capture": "CUDA graph capture", "replay": "replay with new "
                                                     "ids", "device_input": "device-resident ids",
          "async": "asynchronous call"}


@dataclasses.dataclass
class Check:
    """One check of the report."""

    key: str
    passed: bool
    lines: list

    @property
    def title(self) -> str:
        """Human title of the check."""
        return TITLES[self.key]


def _mark(ok) -> str:
    return "✓" if ok else "✗"


def run_checks(impl: str, *, log=print) -> list:
    """Run checks 1-5 on the GPU for ``impl`` ("cpu-copy" or "device"), printing as it goes; returns
    the Checks."""
    from course import embedding as E
    from course.core.blocking import event_complete_right_after, host_blocking
    from course.core.capture import require_gpu, try_capture
    from course.embedding.swap import SwapEmbedding, _check_impl, count_device_to_host_copies
    from course.core.timing import time_device

    _check_impl(impl)
    require_gpu("verify-embedding's capture checks")
    gen = torch.Generator().manual_seed(0)
    dev = torch.device("cuda")
    emb = SwapEmbedding(1000, 128, impl=impl, generator=gen)
    static_ids = torch.randint(0, 1000, (4, 32), generator=gen).to(dev)
    checks = []

    log("1. Input")
    log(f"   - shape: {list(static_ids.shape)}   device: "
        f"{static_ids.device}   dtype: {static_ids.dtype}")
    log(f"   - table: {list(emb.weight.shape)} {emb.weight.dtype}; impl: {impl}")

    log("2. CUDA graph capture (torch.cuda.graph around one forward call)")
    with warnings.catch_warnings():  # "The CUDA Graph is empty" after a failed capture: reported below instead
        warnings.simplefilter("ignore", UserWarning)
        outcome = try_capture(lambda: emb(static_ids))
    if outcome.ok:
        lines = ["captured: every operation of the forward was recorded into the graph"]
    else:
        lines = [f"capture failed: {outcome.error_type}: {outcome.error}"]
        if impl == "cpu-copy":
            lines.append("why: the forward copies the ids to the host "
                         "(ids.to('cpu')); a device-to-host copy makes the host "
                         "wait for the GPU, and a capture records GPU work without running it")
    checks.append(Check("capture", outcome.ok, lines))
    for ln in lines:
        log(f"   {_mark(outcome.ok)} {ln}")

    log("3. Replay with new ids written into the static input")
    if outcome.ok:
        ok, lines = True, []
        for trial in range(2):
            new = torch.randint(0, 1000, (4, 32), generator=gen).to(dev)
            static_ids.copy_(new)
            outcome.graph.replay()
            torch.cuda.synchronize()
            same = torch.equal(outcome.output, F.embedding(new, emb.weight))
            ok &= same
            lines.append(f"replay {trial + 1}: output {'matches' if same else 'DOES NOT match'} "
                         "F.embedding for the new ids")
        try:
            E.check_errors()
        except E.EmbeddingIndexError as e:
            ok = False
            lines.append(f"the error flag reports bad ids: {e}")
    else:
        ok, lines = False, ["not run: nothing was captured"]
    checks.append(Check("replay", ok, lines))
    for ln in lines:
        log(f"   {_mark(ok)} {ln}")

    # Measured now, printed as check 5: before check 4 starts the profiler, so its state cannot
    # affect them.
    rep = host_blocking(lambda: emb(static_ids), sleep_ms=50)
    complete = event_complete_right_after(lambda: emb(static_ids))
    launch = time_device(lambda: emb(static_ids), warmup=3, repeats=10, inner=10)
    kernel_us = None
    if outcome.ok:
        from course.core.timing import graph_time
        kernel_us = graph_time(lambda: emb(static_ids), calls=20, repeats=5).us

    log("4. Device-resident ids")
    small = SwapEmbedding(100, 64, impl=impl, generator=gen)
    ids = torch.tensor([[1, 2, 3, 4, 5]], device=dev)
    out = small(ids)
    torch.cuda.synchronize()
    right = torch.equal(out, F.embedding(ids, small.weight))
    try:
        copies = count_device_to_host_copies(lambda: small(ids))
        seen = f"device-to-host copies during the call (torch.profiler): {copies}"
    except Exception as e:  # noqa: BLE001 - a broken profiler must not hide the other checks
        copies, seen = None, f"profiler unavailable ({type(e).__name__}: {e})"
    ok = right and out.device.type == "cuda" and copies == 0
    lines = [f"input on {ids.device}, output on {out.device}, shape {list(out.shape)}, "
             f"{'matches' if right else 'DOES NOT match'} F.embedding", seen]
    if copies:
        lines.append("the ids made a round trip through the "
                     "host: the call cannot run ahead of the GPU")
    checks.append(Check("device_input", ok, lines))
    marks = [right and out.device.type == "cuda", copies == 0] + [False] * (len(lines) - 2)
    # each line marked by what it says (a match is a ✓ even when copies fail)
    for ln, good in zip(lines, marks):
        log(f"   {_mark(good)} {ln}")

    log("5. Asynchrony")
    ok = rep.blocked is False
    lines = ["robust test: 50 ms of GPU work queued first; the call returned after "
             f"{rep.host_return_ms:.2f} ms, the GPU finished after {rep.gpu_busy_ms:.2f} ms -> "
             + ("the call did not wait for the "
                "GPU" if ok else "the call WAITED for the GPU (a sync)")]
    checks.append(Check("async", ok, lines))
    log(f"   {_mark(ok)} {lines[0]}")
    log("   (info) InfiniCore's test: an event recorded right "
        f"after the call is already complete: {complete}.")
    work = (f"the GPU work itself takes {kernel_us:.1f} us per call (CUDA-graph replay of 20 calls)"
            if kernel_us is not None else "the GPU work itself is a few "
                                          "small copies and one small kernel")
    log(f"          Not evidence either way: back-to-back eager calls take {launch.us:.1f} us each "
        f"(CUDA events), while {work}. When the host needs longer to launch than the GPU needs to "
        "run, the event is complete right after the call whether or not the call synchronized.")
    torch.cuda.synchronize()
    return checks


def summary(checks: list, *, log=print) -> int:
    """Print the ✓/✗ summary; return 0 if every check passed, else 1."""
    log(LINE)
    log("Summary")
    for c in checks:
        log(f"   {c.title:<22} {_mark(c.passed)} {'pass' if c.passed else 'FAIL'}")
    failed = [c.title for c in checks if not c.passed]
    log(LINE)
    if failed:
        log(f"✗ {len(failed)} check(s) failed ({', '.join(failed)}): "
            "this embedding does not fully support CUDA graph capture.")
    else:
        log("✓ all checks passed: this embedding can be captured and replayed.")
    log(LINE)
    return 1 if failed else 0


def _simulator_report(impl: str, log=print) -> int:
    from course import embedding as E
    from course.embedding.swap import SwapEmbedding
    from course.core.runtime import runtime

    rt = runtime()
    emb = SwapEmbedding(11, 8, impl=impl, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, 11, (2, 3), generator=torch.Generator().manual_seed(1))
    log("1. Input")
    log(f"   - shape: {list(ids.shape)}   device: {ids.device}   dtype: "
        f"{ids.dtype} (tiny: the simulator runs every thread in Python)")
    E.reset_errors()  # this forward's errors only, not what an earlier lookup left in the flag
    right = torch.equal(emb(ids), F.embedding(ids, emb.weight))
    E.check_errors()
    log(f"   {_mark(right)} the {impl} forward matches F.embedding on the Numba CUDA simulator")
    log(LINE)
    log("✗ Checks 2-5 (capture, replay, device-resident ids, asynchrony) "
        f"need a real GPU, and this machine runs the simulator: {rt.reason}")
    for fix in rt.fixes:
        log(f"  to use a GPU: {fix}")
    log("  The recorded GPU results are in the lab: solutions/lab2_embedding_swap.ipynb "
        "(course.core.reference.run('embedding_verify')).")
    log(LINE)
    return 2


def main(impl: str) -> int:
    """The CLI: print the report for ``impl``; exit 0 only if all checks pass (2: needs a GPU, 3:
    could not run)."""
    from course.core.runtime import runtime

    print(LINE)
    print(f"Embedding CUDA-graph capture report: impl={impl}")
    print(LINE)
    try:
        if not runtime().on_gpu:
            return _simulator_report(impl)
        return summary(run_checks(impl))
    except Exception as e:  # noqa: BLE001 - a report, never a traceback
        print(f"✗ verify-embedding could not finish: {type(e).__name__}: {e}")
        print("  Run `python -m course doctor` to check the environment.")
        return 3
