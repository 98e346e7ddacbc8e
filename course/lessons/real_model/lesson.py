"""What lesson 06's notebook needs beyond the package: GPU results that may not be recorded yet, and
its plots (the stacked split of each variant's time, the roofline with both roofs)."""
from __future__ import annotations

from course.core import reference
from course.lessons.real_model.roofline import PARTS, ridge_point

COLORS = {"floor": "0.35", "fused above floor": "tab:green", "removed by fusion": "tab:orange",
          "removed by graphs": "tab:red", "above floor, not split": "tab:purple"}


def gpu_result(name: str, heavy: bool = True, **params):
    """``reference.heavy(name)`` (``reference.run`` when not ``heavy``), or None with a note when it
    cannot run here and awaits its first recording."""
    try:
        return reference.heavy(name, **params) if heavy else reference.run(name, **params)
    except FileNotFoundError:
        print(f"reference data not recorded yet for {name!r} (it awaits its first recording): on a "
              f"GPU, `python -m course bench {name}` records it; the cells that show it are "
              "skipped until then.")
        return None


def plot_split(ax, parts: dict) -> None:
    """Stacked bars of :func:`~course.lessons.real_model.roofline.split`'s parts per variant (us per
    token); a negative part is drawn as zero and named in its label."""
    names, labelled = list(parts), set()
    for i, v in enumerate(names):
        bottom, odd = 0.0, []
        for p in (*PARTS, "above floor, not split"):
            us = parts[v].get(p)
            if us is None:
                continue
            if us < 0:
                odd.append(f"{p} {us:.0f} us")
                continue
            ax.bar(i, us, bottom=bottom, color=COLORS[p], label=None if p in labelled else p)
            labelled.add(p)
            bottom += us
        # the variant's own time, negative parts too
        total = sum(u for u in parts[v].values() if u is not None)
        ax.text(i, bottom, f"{total:.0f} us" + ("\n(" + ", ".join(odd) + ")" if odd else ""),
                ha="center",
                va="bottom", fontsize=8)
    ax.set_xticks(range(len(names)), [n if len(n) <= 22 else n[:21] + "…" for n in names],
                  fontsize=8)
    ax.set_ylabel("time per token [us]")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")


def plot_roofline(ax, rows: list, bandwidth_GBps: float, tflops: float | None = None) -> None:
    """The decode step's roofline (log-log): the memory roof, the compute roof and the ridge point
    with ``tflops``, and each measured variant's points (``rows``: :func:`roofline_rows`)."""
    if not rows:
        raise ValueError("no rows to draw: pass roofline_rows(sweep, ...) of a sweep with floor "
                         "rows")
    xs = [r["flop_per_byte"] for r in rows]
    lo, hi = min(xs) / 2, max(xs) * 4
    if tflops:
        ridge = ridge_point(tflops, bandwidth_GBps)
        hi = max(hi, ridge * 4)
        ax.plot([lo, ridge, hi], [bandwidth_GBps * lo / 1e3, tflops, tflops], "k-", lw=1.5,
                label="roofs")
        ax.axvline(ridge, color="k", ls=":", lw=1)
        ax.text(ridge, tflops * 1.15, f"ridge {ridge:.0f} FLOP/byte", ha="center", fontsize=8)
    else:
        ax.plot([lo, hi], [bandwidth_GBps * lo / 1e3, bandwidth_GBps * hi / 1e3], "k-", lw=1.5,
                label="memory roof (compute roof: awaits its recording)")
    variants = sorted({v for r in rows for v in r["measured_us"]})
    for v in variants:
        pts = [(r["flop_per_byte"], r["flop"] / (r["measured_us"][v] * 1e-6) / 1e12) for r in rows
               if v in r["measured_us"]]
        ax.plot(*zip(*pts), "o-", ms=4, label=v)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity [FLOP per byte read]")
    ax.set_ylabel("TFLOP/s")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
