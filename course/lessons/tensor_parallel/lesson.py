"""Notebook 08's helpers: the layout table, the correctness launch, GPU figures or why there are none, sentences.

- :func:`layout`: which heads, KV heads and MLP rows each rank keeps, and the bytes it reads per token.
- :func:`run_tokens`: one launch of :func:`~course.lessons.tensor_parallel.workers.tokens_worker` (NCCL on 2+ GPUs
  with TinyLlama's shape in bf16; else gloo CPU processes with the tiny model in fp32), every rank's findings.
- :func:`tokens_report`, :func:`recorded`, :func:`timing_summary`, :func:`plot_scaling`: sentences and figures
  computed from the results (never typed).
"""
from __future__ import annotations

import time

import course.core.plots as plots
from course.core.reference import available, get, heavy, reference_path, run
from course.core.results import Result
from course.core.timing import eager_versus
from course.core.launch import launch, plan
from course.lessons.tensor_parallel.experiments import layout_bytes, scaling
from course.lessons.tensor_parallel.shard import head_plan, mlp_rows, predicted_all_reduces


def layout(size, worlds=(1, 2, 4, 8)) -> Result:
    """Rank 0's share at each world size: query heads, KV heads (replicated or not), MLP rows, bytes per token."""
    from course.lessons.real_model.model import _size

    s = _size(size)
    rows = []
    for w in worlds:
        p, (a, b) = head_plan(s.heads, s.kv_heads, w, 0), mlp_rows(s.intermediate, w, 0)
        rows.append({"world_size": w, "q_heads": p.n_q, "kv_heads": p.n_kv,
                     "kv": "replicated" if p.replicated_kv else ("whole" if w == 1 else "split"), "mlp_rows": b - a,
                     "bytes_per_token": layout_bytes(s, w), "all_reduces": predicted_all_reduces(s.layers, w)})
    cols = {"world_size": "ranks", "q_heads": "per rank", "kv_heads": "per rank", "kv": "", "mlp_rows": "per rank",
            "bytes_per_token": "B per rank", "all_reduces": "per token"}
    return Result("tp_layout", f"{s.name} ({s.heads} query heads, {s.kv_heads} KV heads, {s.layers} layers) split "
                  "by hand: rank 0's share", cols, rows, params={"size": s.name})


def run_tokens(variants=("hand", "dtensor"), world_size: int | None = None, n_tokens: int = 64,
               timeout: float = 300.0, size=None) -> dict:
    """Decode ``n_tokens`` greedily on every rank, TP=1 against each variant, eager and captured (one launch).
    ``size``: the model (default: TinyLlama's shape in bf16 over NCCL, the tiny one in fp32 on CPU processes)."""
    from course.lessons.tensor_parallel.workers import tokens_worker

    p = plan(world_size)
    size = size or ("tinyllama" if p.backend == "nccl" else "tiny")
    t0 = time.perf_counter()
    ranks = launch(tokens_worker, p.world_size, backend=p.backend, timeout=timeout, variants=tuple(variants),
                   size=size, n_tokens=n_tokens, max_len=n_tokens + 8)
    return {"plan": p, "size": size, "ranks": ranks, "seconds": time.perf_counter() - t0, "variants": variants}


def tokens_report(run_: dict) -> str:
    """One line per variant: tokens against TP=1 (eager, captured), logit differences, ranks agreeing, counts."""
    lines = []
    for i, v in enumerate(run_["variants"]):
        r = run_["ranks"][0][i]
        agree = all(rank[i]["ranks_agree"] for rank in run_["ranks"])
        cap = (r["capture_skipped"] if "capture_skipped" in r else
               f"captured tokens {'==' if r['captured'] == r['tp1'] else '!='} TP=1, "
               f"logits within {r['captured_logit_diff']:.1e}; all-reduces in the graph: {r['graph_all_reduces']}")
        lines.append(f"{v:>8} x{run_['plan'].world_size} ({r['dtype']}): eager tokens "
                     f"{'==' if r['eager'] == r['tp1'] else '!='} TP=1, logits within {r['eager_logit_diff']:.1e} "
                     f"(tolerance {r['tolerance']:.0e}); {cap}; every rank the same tokens: {agree}; collectives in "
                     f"one eager step: {r['eager_collectives']}")
    return "\n".join(lines)


def recorded(name: str):
    """A multi-GPU experiment's result: the recording when there is one (live on enough GPUs with ``COURSE_FULL=1``,
    :func:`course.core.reference.heavy`), live when there is none and this machine can run it, else None with a
    printed line that says how to record it."""
    if not available(name):
        print(f"{name}: not recorded yet: run `python -m course bench {name}` on a machine with {get(name).gpus}+ "
              "GPUs (this machine cannot run it live).")
        return None
    return heavy(name) if reference_path(name).exists() else run(name)


def timing_summary(res) -> str:
    """Sentences about the timing table, computed from it: eager vs graph per row, counts, the floor, scaling."""
    if res is None:
        return "No multi-GPU figures on this machine yet (see above)."
    lines = [res.caption()]
    for r in res.rows:
        lines.append(f"{r['variant']:>9} TP={r['world_size']}: {eager_versus(r, 'graph', ',.0f')}"
                     + f"; all-reduces eager/graph/predicted {r['all_reduces_eager']}/{r['all_reduces_graph']}/"
                     f"{r['all_reduces_predicted']}; floor {r['floor_us']:,.0f} us ({r['weights_us']:,.0f} weights + "
                     f"{r['collectives_us']:,.0f} all-reduces): the floor is {r['floor_us'] / r['graph_us']:.0%} of the graph's "
                     f"time (the graph {r['graph_us'] / r['floor_us']:.1f}x the floor)")
        lines.append(f"{'':>9} where the time goes: {max(r['eager_us'] - r['graph_us'], 0):,.0f} us of host work per "
                     f"token removed by the graph ({max(r['eager_us'] - r['graph_us'], 0) / r['eager_us']:.0%} of "
                     f"eager), {max(r['graph_us'] - r['floor_us'], 0):,.0f} us still above the floor in the graph")
    by = {(r["variant"], r["world_size"]): r for r in res.rows}
    for v in sorted({r["variant"] for r in res.rows}):
        for s in scaling(res, v)[1:]:
            one, k = by[(v, 1)], by[(v, s["world_size"])]
            apart = k["graph_q1_us"] > one["graph_q3_us"] or one["graph_q1_us"] > k["graph_q3_us"]
            lines.append(f"{v} graph, scaling TP=1 time / TP={s['world_size']} time: {s['speedup_vs_tp1']:.2f}x"
                         + ("" if apart else " (the IQRs overlap: noise)")
                         + f"; the floor predicts {s['floor_speedup']:.2f}x")
    lines += floor_reading(res)
    lines.append(f"how: {res.params.get('timing', 'not recorded')}")
    return "\n".join(lines)


def plot_scaling(res):
    """Per variant: graph time per token against world size, and the floor's prediction."""
    fig, (ax,) = plots.figure(1, width=6.0, height=3.8)
    for v in sorted({r["variant"] for r in res.rows}):
        rows = sorted((r for r in res.rows if r["variant"] == v), key=lambda r: r["world_size"])
        ax.plot([r["world_size"] for r in rows], [r["graph_us"] for r in rows], "o-", label=f"{v}: graph")
    rows = sorted((r for r in res.rows if r["variant"] == "hand"), key=lambda r: r["world_size"])
    ax.plot([r["world_size"] for r in rows], [r["floor_us"] for r in rows], "k--", label="floor (hand layout)")
    ax.set_xlabel("ranks (GPUs)")
    ax.set_ylabel("us per token (slowest rank)")
    ax.set_xticks(sorted({r["world_size"] for r in res.rows}))
    ax.legend(fontsize=8)
    plots.caption(fig, res)
    return fig


def floor_reading(res) -> list:
    """What the floor's two terms say about splitting, per world size (of the hand split): the weight time saved
    against the all-reduces' latency added, and so whether the floor itself predicts a faster split."""
    rows = {r["world_size"]: r for r in res.rows if r["variant"] == "hand"}
    if 1 not in rows:
        return []
    out = []
    for w, r in sorted(rows.items()):
        if w == 1:
            continue
        saved, added = rows[1]["weights_us"] - r["weights_us"], r["collectives_us"]
        verdict = "faster" if saved > added else "slower"
        out.append(f"floor at TP={w}: {saved:,.0f} us of weight reading saved per token, {added:,.0f} us of "
                   f"all-reduce latency added ({r['all_reduces_predicted']} x {r['all_reduce_us']:.1f} us): the "
                   f"floor predicts the split {verdict} than one GPU at batch 1")
    return out
