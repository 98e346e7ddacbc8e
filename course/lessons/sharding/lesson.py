"""Notebook 05's helpers: run the eager part in worker processes, the bucket demo, and read the GPU figures.

- :func:`run_lesson`: one launch that runs :func:`~course.lessons.sharding.workers.lesson_worker` on every
  rank (the DTensor test's cases included) and returns each rank's findings.
- :func:`bucket_demo`: the rule every data-parallel engine lives by, shown safely on CPU processes: ranks with
  different batches that agree on the bucket finish; ranks that do not are stopped by the time limit.
- :func:`load_or_explain`: a registered experiment's result, or ``None`` with a printed reason when it
  needs more GPUs than this machine has and nobody recorded it yet.
- :func:`capture_summary`, :func:`same_step`, :func:`timing_method`, :func:`plot_world_sizes`, :func:`plot_cost`,
  :func:`plot_ownership`: sentences and figures computed from the results (never typed).
"""
from __future__ import annotations

import time

import course.core.plots as plots
from course.core.reference import get, run
from course.core.timing import eager_versus
import course.lessons.sharding.workers as W
from course.lessons.sharding.experiments import dtensor_result
from course.core.launch import WorkerError, WorkerTimeout, launch, plan


def run_lesson(world_size: int | None = None, timeout: float = 150.0, backend: str | None = None, **kwargs) -> dict:
    """Start the workers once: ownership, DTensor vs vocab-parallel (Numba, F.embedding), bad inputs, the cases of
    PyTorch's DTensor test."""
    p = plan(world_size, backend)
    t0 = time.perf_counter()
    ranks = launch(W.lesson_worker, p.world_size, backend=p.backend, timeout=timeout, **kwargs)
    seconds = time.perf_counter() - t0
    return {"plan": p, "ranks": ranks, "dtensor": dtensor_result([r["dtensor"] for r in ranks], p), "seconds": seconds}


def bucket_demo(timeout: float = 12.0, world_size: int = 2) -> dict:
    """Run :func:`~course.lessons.sharding.workers.bucket_worker` with and without agreement, on CPU processes.

    Without agreement one rank waits in a collective the others never join; the launcher's time
    limit (``timeout`` seconds) kills the run and names that rank. Returns both outcomes.
    """
    agreed = launch(W.bucket_worker, world_size, backend="gloo", timeout=max(60.0, timeout), agree=True)
    t0 = time.perf_counter()
    try:
        launch(W.bucket_worker, world_size, backend="gloo", timeout=timeout, pg_timeout=10 * timeout, agree=False)
        outcome, ranks, kind = "finished (unexpected: the ranks ran different collectives)", [], None
    except WorkerTimeout as e:
        outcome, ranks, kind = f"stopped by the time limit: {e}", list(e.ranks), type(e).__name__
    except WorkerError as e:
        outcome, ranks, kind = f"failed: {e}", list(e.ranks), type(e).__name__
    return {"agreed": agreed, "disagree_outcome": outcome, "disagree_stuck_ranks": ranks, "disagree_error": kind,
            "disagree_seconds": time.perf_counter() - t0, "timeout": timeout}


def load_or_explain(name: str, **params):
    """``reference.run(name)``, or None (printing why) when it needs GPUs this machine lacks and no data exists."""
    try:
        return run(name, **params)
    except FileNotFoundError as e:
        need = get(name).gpus
        print(f"{name}: needs {need} GPUs to run live, and its reference data has not been recorded yet.\n  {e}")
        return None


def capture_summary(res) -> str:
    """Sentences about the capture figures, computed from the result (rank 0's timings)."""
    if res is None:
        return "No capture figures on this machine yet (see above)."
    lines = [res.caption()]
    for r in res.rows:
        lines.append(f"{r['variant']:>16} on {r['world_size']} GPUs: {eager_versus(r, 'replay')}"
                     + ("" if r["replay_correct"] else "  REPLAY WRONG"))
    by = {r["variant"]: r for r in res.rows}
    if "numba_over_torch_replay" in res.summary and {"vocab_numba", "vocab_torch"} <= set(by):
        lines.append("Numba vocab-parallel replay vs F.embedding vocab-parallel replay (same table): "
                     + _versus(by["vocab_numba"], by["vocab_torch"], "replay"))
    lines.append(f"how: {timing_method(res)}")
    return "\n".join(lines)


OLD_TIMING = ("recorded before the aligned timing: each rank timed itself alone and rank 0's events are shown, so a "
              "collective's time includes however long rank 0 waited for the other rank in each repeat (rank skew)")


def timing_method(res) -> str:
    """How ``res``'s times were taken, from its params (or, for a result recorded before that was stored, the old
    per-rank method and why it can read high)."""
    return res.params.get("timing", OLD_TIMING)


def _versus(a: dict, b: dict, col: str) -> str:
    """``a`` vs ``b`` on column ``col`` (median and IQR each): their ratio, or noise when the IQRs overlap."""
    noise = not (a[f"{col}_q1_us"] > b[f"{col}_q3_us"] or b[f"{col}_q1_us"] > a[f"{col}_q3_us"])
    return (f"{a[col + '_us']:.1f} us (IQR {a[col + '_q1_us']:.1f}-{a[col + '_q3_us']:.1f}) vs "
            f"{b[col + '_us']:.1f} us (IQR {b[col + '_q1_us']:.1f}-{b[col + '_q3_us']:.1f}): "
            + ("inside the spread, noise" if noise else f"{a[col + '_us'] / b[col + '_us']:.2f}x"))


def same_step(first, second, variant: str = "dtensor_rowwise", world_size: int = 2) -> str:
    """Two results that both time ``variant`` at ``world_size``: their replay figures side by side, and whether they
    agree (IQRs overlap) or, if not, why they may differ (method, runs). '' when either lacks that row."""
    if first is None or second is None:
        return ""
    rows = [next((r for r in res.rows if r["variant"] == variant and r["world_size"] == world_size), None)
            for res in (first, second)]
    if None in rows:
        return ""
    a, b = rows
    head = (f"{variant} replay on {world_size} GPUs, the same step in two tables: [{first.name}] "
            f"{_versus(a, b, 'replay').replace(' vs ', f' vs [{second.name}] ', 1)}")
    if "noise" in head:
        return head + ": they agree."
    why = []
    if OLD_TIMING in (timing_method(first), timing_method(second)):
        why.append("at least one was timed per rank alone, so rank skew is in it: re-record with "
                   "`python -m course bench sharding_capture sharding_capture_world_sizes` on 2 GPUs")
    if first.provenance.get("date") != second.provenance.get("date") or first.live != second.live:
        why.append("they come from different runs")
    if not why:
        why.append("same method and run, separate worker launches: the difference is run-to-run variation "
                   "between launches, larger than either spread")
    return head + ". They differ beyond the spreads: " + "; ".join(why) + "."


def plot_world_sizes(live, graphs=None):
    """Left: eager time (and replay, from ``graphs``) against world size; right: bytes per rank. Returns the figure."""
    fig, (ax_t, ax_b) = plots.figure(2, width=5.5, height=3.8)
    sizes = live.column("world_size")
    ax_t.plot(sizes, live.column("eager_us"), "o-", label=f"eager, {live.params.get('backend')} (live)")
    if graphs is not None:
        for v in sorted({r["variant"] for r in graphs.rows}):
            xs = graphs.column("world_size", variant=v)
            ax_t.plot(xs, graphs.column("eager_us", variant=v), "s--", label=f"{v} eager (GPUs)")
            ax_t.plot(xs, graphs.column("replay_us", variant=v), "^-", label=f"{v} replay (GPUs)")
    ax_t.set(xlabel="world size [ranks]", ylabel="time per lookup [us]", yscale="log", xscale="log", xticks=sizes)
    ax_t.set_xticklabels([str(s) for s in sizes])
    ax_t.legend(fontsize=7)
    for col, lab in (("rowwise_lookup_bytes", "row-wise lookup"), ("allreduce_bytes", "all-reduce sent"),
                     ("colwise_lookup_bytes", "column-wise lookup"), ("allgather_bytes", "all-gather sent")):
        ax_b.plot(sizes, live.column(col), "o-", label=lab)
    ax_b.set(xlabel="world size [ranks]", ylabel="bytes per rank [B]", xscale="log", xticks=sizes)
    ax_b.set_xticklabels([str(s) for s in sizes])
    ax_b.legend(fontsize=7)
    plots.caption(fig, *([live] + ([graphs] if graphs is not None else [])))
    return fig


def plot_cost(res):
    """Eager time against ids per step (one line per width), and lookup vs all-reduce bytes. Returns the figure."""
    fig, (ax_t, ax_b) = plots.figure(2, width=5.5, height=3.8)
    for d in sorted(set(res.column("dim"))):
        ax_t.plot(res.column("ids", dim=d), res.column("eager_us", dim=d), "o-", label=f"{d} columns")
        ax_b.plot(res.column("rowwise_lookup_bytes", dim=d), res.column("allreduce_bytes", dim=d), "o-",
                  label=f"{d} columns")
    ax_t.set(xlabel="ids per step", ylabel="eager lookup + all-reduce [us]", xscale="log", yscale="log")
    ax_b.set(xlabel="local lookup bytes per rank [B]", ylabel="all-reduce bytes sent per rank [B]",
             xscale="log", yscale="log")
    ax_t.legend(fontsize=7)
    ax_b.legend(fontsize=7)
    plots.caption(fig, res)
    return fig


def plot_ownership(num_embeddings: int, embedding_dim: int, world_size: int, ids=None):
    """The table drawn twice, coloured by the rank that holds each cell: row-wise and column-wise. Returns the figure.

    Rows that ``ids`` look up are marked with a dot on the row-wise panel: a rank looks up the
    dots in its colour and writes zero rows (masks) for the others.
    """
    import numpy as np

    from course.lessons.sharding.layouts import chunk_bounds

    fig, (ax_r, ax_c) = plots.figure(2, width=4.0, height=4.0)
    row_owner = np.zeros((num_embeddings, embedding_dim))
    for r, (a, b) in enumerate(chunk_bounds(num_embeddings, world_size)):
        row_owner[a:b, :] = r
    col_owner = np.zeros((num_embeddings, embedding_dim))
    for r, (a, b) in enumerate(chunk_bounds(embedding_dim, world_size)):
        col_owner[:, a:b] = r
    for ax, owner, title in ((ax_r, row_owner, "row-wise Shard(0)"), (ax_c, col_owner, "column-wise Shard(1)")):
        im = ax.imshow(owner, cmap="tab10", vmin=0, vmax=9, aspect="auto", interpolation="nearest")
        ax.set(title=title, xlabel="column", ylabel="row (token id)")
    if ids is not None:
        looked = sorted({int(i) for i in np.asarray(ids).reshape(-1)})
        ax_r.scatter([embedding_dim / 2 - 0.5] * len(looked), looked, c="k", s=12, label="ids looked up")
        ax_r.legend(fontsize=7, loc="lower right")
    from matplotlib.patches import Patch

    handles = [Patch(color=im.cmap(im.norm(r))) for r in range(world_size)]
    ax_c.legend(handles, [f"rank {r}" for r in range(world_size)], fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig
