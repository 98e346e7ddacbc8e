"""What lesson 06's notebook needs beyond the package: GPU results that may not be recorded yet, and its plots."""
from __future__ import annotations

from course.lessons.real_model.roofline import PARTS

COLORS = {"floor": "0.35", "fused above floor": "tab:green", "removed by fusion": "tab:orange",
          "removed by graphs": "tab:red"}


def gpu_result(name: str, **params):
    """``reference.run(name)``, or None with a printed note when this machine cannot run it and no reference exists.

    On the GPU path the experiment runs live (errors are raised as usual). On the simulator path the
    reference file may not be recorded yet (``python -m course bench`` on a GPU writes it): then the cell
    says so and the notebook goes on.
    """
    from course.core import reference

    try:
        return reference.run(name, **params)
    except FileNotFoundError:
        print(f"reference data not recorded yet for {name!r}: on a GPU, `python -m course bench {name}` records "
              "it; the cells that show it are skipped until then.")
        return None


def plot_split(ax, parts: dict) -> None:
    """Stacked bars, one per variant, of :func:`~course.lessons.real_model.roofline.split`'s parts (us per token).

    A negative part (a variant slower than the one it should improve on) is drawn as zero and named in
    the bar's label, so the chart never hides it.
    """
    names = list(parts)
    for i, v in enumerate(names):
        bottom, odd = 0.0, []
        for p in PARTS:
            us = parts[v].get(p)
            if us is None:
                continue
            if us < 0:
                odd.append(f"{p} {us:.0f} us")
                continue
            ax.bar(i, us, bottom=bottom, color=COLORS[p], label=p if i == 0 else None)
            bottom += us
        ax.text(i, bottom, f"{bottom:.0f} us" + ("\n(" + ", ".join(odd) + ")" if odd else ""), ha="center",
                va="bottom", fontsize=8)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("time per token [us]")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
