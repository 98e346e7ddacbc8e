"""Notebook 05's helpers: the eager part and the bucket demo run on every rank, the figures and
sentences.

- :func:`lesson_worker` (every rank, one launch by :func:`run_lesson`): who holds what, DTensor's
  row-wise lookup against the hand-written one (Numba and ``F.embedding``), bad inputs refused on
  every rank, the DTensor test.
- :func:`bucket_worker`, :func:`bucket_demo`: data-parallel ranks that agree on a bucket finish;
  ranks that do not are stopped by the launcher's time limit.
- :func:`recorded`: a multi-GPU experiment's result, or None and how to record it; sentences and
  plots computed from the results (never typed).
"""
from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist
from matplotlib.patches import Patch

import course.core.plots as plots
from course.core.launch import WorkerError, WorkerTimeout, device_mesh, launch, plan
from course.core.reference import available, get, heavy, reference_path, run
from course.core.timing import eager_versus
from course.lessons.sharding.bench import dtensor_result, dtensor_worker, full_table, same_ids
from course.lessons.sharding.layouts import chunk_bounds, shard_embedding
from course.lessons.sharding.vocab_parallel import (IMPLS, agree_bucket, bucket_step, local_rows,
                                                    masked_lookup, pick_bucket,
                                                    vocab_parallel_embedding)


def lesson_worker(ctx, num_embeddings: int = 16, embedding_dim: int = 8, ids_shape=(2, 5),
                  dtensor: bool = True) -> dict:
    """Notebook 05's eager part on this rank (tiny sizes: the Numba kernel runs on the simulator on
    CPUs).

    ``dtensor=True`` also runs :func:`dtensor_worker` (the DTensor test's cases) in the same
    processes.
    """
    from torch.distributed.tensor import DTensor, Replicate  # on use: it slows a rank's start

    dev = ctx.torch_device
    mesh = device_mesh(ctx)
    weight = full_table(num_embeddings, embedding_dim, dev)
    ids = same_ids(ids_shape, num_embeddings, dev)
    expected = torch.nn.functional.embedding(ids, weight)
    res = {"rank": ctx.rank, "ids": ids.cpu().tolist()}
    # DTensor row-wise, and what this rank holds before the all-reduce
    emb = torch.nn.Embedding(num_embeddings, embedding_dim, device=dev)
    emb.weight = torch.nn.Parameter(weight.clone())
    row = shard_embedding(emb, mesh, 0)
    part = row(DTensor.from_local(ids, mesh, [Replicate()], run_check=False))
    local_part = part.to_local()
    res["dtensor_local_nonzero_rows"] = int((local_part != 0).any(-1).sum())
    dt_full = part.full_tensor()
    res["dtensor_equal_local"] = bool(torch.equal(dt_full, expected))
    # the hand-written vocab-parallel lookup, with the course's Numba kernel and with F.embedding
    shard, start = local_rows(weight, ctx.rank, ctx.world_size)
    res["shard_rows"] = (start, start + shard.shape[0])
    partial = masked_lookup(ids, shard, start, "numba")
    res["masked_positions"] = int((partial == 0).all(-1).sum())
    for impl in IMPLS:
        got = vocab_parallel_embedding(ids, shard, start, num_embeddings=num_embeddings, impl=impl)
        res[f"{impl}_equal_dtensor"] = bool(torch.equal(got, dt_full))
    # bad inputs: every rank gets the same clear error naming the rank at fault, and nobody hangs
    errors = {}
    bad_ids = ids.clone()
    if ctx.rank == ctx.world_size - 1:
        bad_ids[0, 0] = num_embeddings + 3
    try:
        vocab_parallel_embedding(bad_ids, shard, start, num_embeddings=num_embeddings)
    except ValueError as e:
        errors["out_of_range"] = str(e)
    try:
        local_rows(full_table(num_embeddings + 1, embedding_dim, dev), ctx.rank, ctx.world_size)
    except ValueError as e:
        errors["rows_not_divisible"] = str(e)
    mixed = shard.double() if ctx.rank == 0 else shard
    try:
        vocab_parallel_embedding(ids, mixed, start, num_embeddings=num_embeddings, impl="torch")
    except ValueError as e:
        errors["mismatched_dtypes"] = str(e)
    res["errors"] = errors
    if dtensor:
        res["dtensor"] = dtensor_worker(ctx, mesh=mesh)
    dist.barrier()
    return res


def bucket_worker(ctx, agree: bool, buckets=(8, 16), dim: int = 4, serve_s: float = 3600.0) -> dict:
    """Data-parallel ranks: each holds its own number of tokens; each bucket's step
    (:func:`bucket_step`) ends in collectives over all the ranks (as an expert-parallel layer's
    all-to-all would).

    ``agree=False``: each rank runs its own bucket's step, then (like a serving engine) stays up
    waiting for the next request for ``serve_s`` seconds. The rank with the bigger bucket waits in a
    collective nobody else joins: forever, until the launcher's time limit kills the run.
    ``agree=True``: the ranks all-gather their picks first (:func:`agree_bucket`) and all run the
    largest.
    """
    n_tokens = 5 + 6 * (ctx.rank % 2)  # even ranks: 5 tokens (bucket 8), odd: 11 (bucket 16)
    own = pick_bucket(n_tokens, buckets)
    bucket = agree_bucket(n_tokens, buckets, device=ctx.torch_device) if agree else own
    x = torch.ones(bucket, dim, device=ctx.torch_device)
    bucket_step(x, say=ctx.say)
    if not agree:
        ctx.say(f"finished its bucket-{bucket} step; the engine waits for the next request")
        time.sleep(serve_s)
    return {"rank": ctx.rank, "tokens": n_tokens, "own_bucket": own, "bucket": bucket,
            "sum": float(x[0, 0])}


def run_lesson(world_size: int | None = None, timeout: float = 150.0, backend: str | None = None,
               **kwargs) -> dict:
    """Start the workers once: ownership, DTensor vs vocab-parallel (Numba, F.embedding), bad
    inputs, the cases of PyTorch's DTensor test."""
    p = plan(world_size, backend)
    t0 = time.perf_counter()
    ranks = launch(lesson_worker, p.world_size, backend=p.backend, timeout=timeout, **kwargs)
    seconds = time.perf_counter() - t0
    return {"plan": p, "ranks": ranks, "seconds": seconds,
            "dtensor": dtensor_result([r["dtensor"] for r in ranks], p)}


def bucket_demo(timeout: float = 12.0, world_size: int = 2) -> dict:
    """Run :func:`bucket_worker` with and without agreement, on CPU processes.

    Without agreement one rank waits in a collective the others never join; the launcher's time
    limit (``timeout`` seconds) kills the run and names that rank. Returns both outcomes.
    """
    agreed = launch(bucket_worker, world_size, backend="gloo", timeout=max(60.0, timeout),
                    agree=True)
    t0 = time.perf_counter()
    try:
        launch(bucket_worker, world_size, backend="gloo", timeout=timeout, pg_timeout=10 * timeout,
               agree=False)
        outcome, ranks, kind = "finished (unexpected: the ranks' collectives differ)", [], None
    except WorkerTimeout as e:
        outcome, ranks, kind = f"stopped by the time limit: {e}", list(e.ranks), type(e).__name__
    except WorkerError as e:
        outcome, ranks, kind = f"failed: {e}", list(e.ranks), type(e).__name__
    return {"agreed": agreed, "disagree_outcome": outcome, "disagree_stuck_ranks": ranks,
            "disagree_error": kind, "disagree_seconds": time.perf_counter() - t0,
            "timeout": timeout}


def recorded(name: str, recording: bool = False):
    """A multi-GPU experiment's result: live where this machine can run it (the recording, with
    ``recording``, unless ``COURSE_FULL=1``), the recording elsewhere, or None with a line that says
    how to record it."""
    if not available(name):
        print(f"{name}: not recorded yet: run `python -m course bench {name}` on a machine with "
              f"{get(name).gpus}+ GPUs (this machine cannot run it live).")
        return None
    return heavy(name) if recording and reference_path(name).exists() else run(name)


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
        lines.append("Numba vocab-parallel replay vs F.embedding vocab-parallel replay (same "
                     "table): "
                     + _versus(by["vocab_numba"], by["vocab_torch"], "replay"))
    lines.append(f"how: {timing_method(res)}")
    return "\n".join(lines)


OLD_TIMING = ("recorded before the aligned timing: each rank timed itself alone and rank 0's "
              "events are shown, so a collective's time includes however long rank 0 waited for "
              "the other rank in each repeat (rank skew)")


def timing_method(res) -> str:
    """How ``res``'s times were taken, from its params (or, for a result recorded before that was
    stored, the old per-rank method and why it can read high)."""
    return res.params.get("timing", OLD_TIMING)


def _versus(a: dict, b: dict, col: str) -> str:
    """``a`` vs ``b`` on column ``col`` (median and IQR each): their ratio, or noise when the IQRs
    overlap."""
    noise = not (a[f"{col}_q1_us"] > b[f"{col}_q3_us"] or b[f"{col}_q1_us"] > a[f"{col}_q3_us"])
    return (f"{a[col + '_us']:.1f} us (IQR {a[col + '_q1_us']:.1f}-{a[col + '_q3_us']:.1f}) vs "
            f"{b[col + '_us']:.1f} us (IQR {b[col + '_q1_us']:.1f}-{b[col + '_q3_us']:.1f}): "
            + ("inside the spread, noise" if noise else f"{a[col + '_us'] / b[col + '_us']:.2f}x"))


def same_step(first, second, variant: str = "dtensor_rowwise", world_size: int = 2) -> str:
    """Two results that both time ``variant`` at ``world_size``: their replay figures side by side,
    and whether they agree (IQRs overlap) or, if not, why they may differ (method, runs). '' when
    either lacks that row."""
    if first is None or second is None:
        return ""
    rows = [next((r for r in res.rows if (r["variant"], r["world_size"]) == (variant, world_size)),
                 None) for res in (first, second)]
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
                   "`python -m course bench sharding_capture sharding_capture_world_sizes` on 2 "
                   "GPUs")
    if first.provenance.get("date") != second.provenance.get("date") or first.live != second.live:
        why.append("they come from different runs")
    if not why:
        why.append("same method and run, separate worker launches: the difference is run-to-run "
                   "variation between launches, larger than either spread")
    return head + ". They differ beyond the spreads: " + "; ".join(why) + "."


def plot_world_sizes(live, graphs=None):
    """Left: eager time (and replay, from ``graphs``) against world size; right: bytes per rank.
    Returns the figure."""
    fig, (ax_t, ax_b) = plots.figure(2, width=5.5, height=3.8)
    sizes = live.column("world_size")
    ax_t.plot(sizes, live.column("eager_us"), "o-",
              label=f"eager, {live.params.get('backend')} (live)")
    if graphs is not None:
        for v in sorted({r["variant"] for r in graphs.rows}):
            xs = graphs.column("world_size", variant=v)
            ax_t.plot(xs, graphs.column("eager_us", variant=v), "s--", label=f"{v} eager (GPUs)")
            ax_t.plot(xs, graphs.column("replay_us", variant=v), "^-", label=f"{v} replay (GPUs)")
    ax_t.set(xlabel="world size [ranks]", ylabel="time per lookup [us]", yscale="log", xscale="log",
             xticks=sizes)
    ax_t.set_xticklabels([str(s) for s in sizes])
    ax_t.legend(fontsize=7)
    for col, lab in (("rowwise_lookup_bytes", "row-wise lookup"), ("allreduce_bytes",
                                                                   "all-reduce sent"),
                     ("colwise_lookup_bytes", "column-wise lookup"), ("allgather_bytes",
                                                                      "all-gather sent")):
        ax_b.plot(sizes, live.column(col), "o-", label=lab)
    ax_b.set(xlabel="world size [ranks]", ylabel="bytes per rank [B]", xscale="log", xticks=sizes)
    ax_b.set_xticklabels([str(s) for s in sizes])
    ax_b.legend(fontsize=7)
    plots.caption(fig, *([live] + ([graphs] if graphs is not None else [])))
    return fig


def plot_cost(res):
    """Eager time against ids per step (one line per width), and lookup vs all-reduce bytes. Returns
    the figure."""
    fig, (ax_t, ax_b) = plots.figure(2, width=5.5, height=3.8)
    for d in sorted(set(res.column("dim"))):
        ax_t.plot(res.column("ids", dim=d), res.column("eager_us", dim=d), "o-",
                  label=f"{d} columns")
        ax_b.plot(res.column("rowwise_lookup_bytes", dim=d), res.column("allreduce_bytes", dim=d),
                  "o-", label=f"{d} columns")
    ax_t.set(xlabel="ids per step", ylabel="eager lookup + all-reduce [us]", xscale="log",
             yscale="log")
    ax_b.set(xlabel="local lookup bytes per rank [B]", ylabel="all-reduce bytes sent per rank [B]",
             xscale="log", yscale="log")
    ax_t.legend(fontsize=7)
    ax_b.legend(fontsize=7)
    plots.caption(fig, res)
    return fig


def plot_ownership(num_embeddings: int, embedding_dim: int, world_size: int, ids=None):
    """The table drawn twice, coloured by the rank that holds each cell: row-wise and column-wise.
    Returns the figure.

    Rows that ``ids`` look up are marked with a dot on the row-wise panel: a rank looks up the dots
    in its colour and writes zero rows (masks) for the others.
    """
    fig, (ax_r, ax_c) = plots.figure(2, width=4.0, height=4.0)
    row_owner = np.zeros((num_embeddings, embedding_dim))
    for r, (a, b) in enumerate(chunk_bounds(num_embeddings, world_size)):
        row_owner[a:b, :] = r
    col_owner = np.zeros((num_embeddings, embedding_dim))
    for r, (a, b) in enumerate(chunk_bounds(embedding_dim, world_size)):
        col_owner[:, a:b] = r
    for ax, owner, title in ((ax_r, row_owner, "row-wise Shard(0)"), (ax_c, col_owner,
                                                                      "column-wise Shard(1)")):
        im = ax.imshow(owner, cmap="tab10", vmin=0, vmax=9, aspect="auto", interpolation="nearest")
        ax.set(title=title, xlabel="column", ylabel="row (token id)")
    if ids is not None:
        looked = sorted({int(i) for i in np.asarray(ids).reshape(-1)})
        ax_r.scatter([embedding_dim / 2 - 0.5] * len(looked), looked, c="k", s=12,
                     label="ids looked up")
        ax_r.legend(fontsize=7, loc="lower right")
    handles = [Patch(color=im.cmap(im.norm(r))) for r in range(world_size)]
    ax_c.legend(handles, [f"rank {r}" for r in range(world_size)], fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig
