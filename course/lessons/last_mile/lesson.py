"""What lesson 07's notebook draws (the waterfall of decode steps, the timelines), and what its
kernel cells stand on where Triton is missing."""
from __future__ import annotations

import types

NO_TRITON = types.SimpleNamespace(jit=lambda fn: fn, constexpr=None)  # `tr` and `tl` sans Triton:
# the notebook's kernel cells still define their kernels, which never run there
KERNEL_COLORS = {"embed": "0.6", "qkv": "tab:blue", "attn": "tab:purple", "proj": "tab:orange",
                 "gate_up": "tab:green", "lm_head": "tab:red", "persistent": "tab:cyan"}


def plot_waterfall(ax, result) -> None:
    """One bar per row of a ``last_mile_waterfall`` result (us per token, log scale), labelled
    with x the floor."""
    rows = [r for r in result.rows if r["us"] == r["us"]]
    names = [r["variant"] for r in rows]
    colors = ["0.35" if r["variant"] == "floor" else "tab:red" if not r["correct"] else "tab:blue"
              for r in rows]
    ax.bar(range(len(rows)), [r["us"] for r in rows], color=colors)
    for i, r in enumerate(rows):
        ax.text(i, r["us"], f"{r['us']:.0f} us\n{r['x_floor']:.2f}x", ha="center", va="bottom",
                fontsize=8)
    ax.set_yscale("log")
    ax.set_xticks(range(len(rows)), names, fontsize=8, rotation=20)
    ax.set_ylabel("time per token [us] (log)")
    ax.grid(alpha=0.3, axis="y")


def plot_timeline(ax, result, last_index: int = 10) -> None:
    """Kernels ``0..last_index`` of each variant of a ``last_mile_timeline`` result as bars on the
    GPU's clock: one lane per variant, a bar from a kernel's start to its end, coloured by kind
    (:data:`KERNEL_COLORS`), so the lanes show the gaps PDL closes and the overlap it makes."""
    variants = list(dict.fromkeys(r["variant"] for r in result.rows))
    many = [r["end_us"] for r in result.rows if 0 < r["index"] <= last_index]
    right = max(many) * 1.08 if many else None  # one kernel's lane (persistent) runs off the edge
    labelled = set()
    for lane, v in enumerate(variants):
        rows = [r for r in result.rows if r["variant"] == v and r["index"] <= last_index]
        for r in rows:
            y = lane + (0.17 if r["index"] % 2 else -0.17)  # alternate: overlapping bars show
            kind = r["kernel"]
            ax.barh(y, r["end_us"] - r["start_us"], left=r["start_us"], height=0.3,
                    color=KERNEL_COLORS.get(kind, "0.5"), edgecolor="k", linewidth=0.3,
                    label=None if kind in labelled else kind)
            labelled.add(kind)
        end = max(r["end_us"] for r in rows)
        what = "1 kernel (the whole step)" if len(rows) == 1 else f"{len(rows)} kernels"
        ax.text(min(end, right or end), lane - 0.36, f"{what} ends at {end:.1f} us", fontsize=8,
                ha="right", va="bottom")
    if right:
        ax.set_xlim(0, right)
    ax.set_yticks(range(len(variants)), variants)
    ax.invert_yaxis()
    ax.set_xlabel("time from the step's first kernel [us] (GPU clock)")
    ax.legend(fontsize=7, ncol=6, loc="upper center", bbox_to_anchor=(0.5, -0.22))
    ax.grid(alpha=0.3, axis="x")
