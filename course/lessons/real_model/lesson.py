"""What lesson 06's notebook needs beyond the package: GPU results that may not be recorded yet, and its plots."""
from __future__ import annotations

from course.lessons.real_model.roofline import PARTS

COLORS = {"floor": "0.35", "fused above floor": "tab:green", "removed by fusion": "tab:orange",
          "removed by graphs": "tab:red", "above floor, not split": "tab:purple"}


def gpu_result(name: str, **params):
    """``reference.heavy(name)``, or None with a printed note when it cannot run here and no reference exists.

    These experiments take minutes (compiles, transformers' own path), so on the GPU path they run live only
    with ``COURSE_FULL=1`` and otherwise show the recorded result, captioned as such (:func:`reference.heavy`).
    Where the reference file is not recorded yet (``python -m course bench`` on a GPU writes it), the cell
    says that it awaits its first recording, and the notebook goes on.
    """
    from course.core import reference

    try:
        return reference.heavy(name, **params)
    except FileNotFoundError:
        print(f"reference data not recorded yet for {name!r} (it awaits its first recording): on a GPU, "
              f"`python -m course bench {name}` records it; the cells that show it are skipped until then.")
        return None


def plot_split(ax, parts: dict) -> None:
    """Stacked bars, one per variant, of :func:`~course.lessons.real_model.roofline.split`'s parts (us per token).

    A variant measured but not split (transformers' own path) may come as ``{"floor": f, "above floor, not
    split": t - f}``. A negative part (a variant slower than the one it should improve on) is drawn as zero and
    named in the bar's label, so the chart never hides it.
    """
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
        total = sum(u for u in parts[v].values() if u is not None)  # the variant's own time, negative parts too
        ax.text(i, bottom, f"{total:.0f} us" + ("\n(" + ", ".join(odd) + ")" if odd else ""), ha="center",
                va="bottom", fontsize=8)
    ax.set_xticks(range(len(names)), [n if len(n) <= 22 else n[:21] + "…" for n in names], fontsize=8)
    ax.set_ylabel("time per token [us]")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
