"""Plot helpers: every figure carries the provenance of its numbers underneath."""
from __future__ import annotations

import textwrap


def _plt():
    import matplotlib.pyplot as plt
    return plt


def figure(ncols: int = 1, width: float = 6.0, height: float = 4.0):
    """A figure with ``ncols`` side-by-side axes; returns (fig, axes list)."""
    plt = _plt()
    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return fig, list(axes[0])


class Caption(str):
    """The caption text: a str that a notebook does not echo as a stray ``Out[n]`` (it is on the
    figure)."""

    def _ipython_display_(self):
        """Show nothing: the caption is already drawn under the figure."""


def caption(fig, *results, extra: str = "") -> str:
    """Write each result's provenance under the figure (and return the text, as a :class:`Caption`).
    """
    lines = []
    for r in results:
        c = r.caption()
        if c not in lines:
            lines.append(c)
    if extra:
        lines.append(extra)
    text = "\n".join(textwrap.fill(l, 130) for l in lines)
    fig.tight_layout()
    fig.text(0.01, -0.01, text, ha="left", va="top", fontsize=7.5, color="0.3")
    return Caption(text)


def lines(ax, result, x: str, y: str, *, by: str | None = None, label: str | None = None,
          logx: bool = True, logy: bool = True, **kw) -> None:
    """Plot column ``y`` against ``x`` (one line per value of ``by``), labelled with units."""
    groups = [None] if by is None else sorted({r[by] for r in result.rows}, key=str)
    for g in groups:
        rows = [r for r in result.rows if by is None or r[by] == g]
        rows.sort(key=lambda r: r[x])
        lab = label if g is None else f"{label + ': ' if label else ''}{g}"
        ax.plot([r[x] for r in rows], [r[y] for r in rows], marker="o", ms=3, label=lab, **kw)
    if logx:
        ax.set_xscale("log")
    if logy:
        ax.set_yscale("log")
    ux, uy = result.columns.get(x, ""), result.columns.get(y, "")
    ax.set_xlabel(f"{x} [{ux}]" if ux else x)
    ax.set_ylabel(f"{y} [{uy}]" if uy else y)
    ax.grid(True, which="both", alpha=0.3)


def human_bytes(n) -> str:
    """64 -> '64 B', 65536 -> '64 KiB', 67108864 -> '64 MiB'."""
    if n is None:
        return "none"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if float(n).is_integer() else f"{n:.1f} {unit}"
        n = n / 1024
    return str(n)


def number(v: float) -> str:
    """A value as a person writes it: 2430 -> '2430', 3.14159 -> '3.14', 0.01234 -> '0.0123' (never
    '2.43e+03')."""
    a = abs(v)
    if a >= 100 or v == 0:
        return f"{v:.0f}"
    if a >= 1:
        return f"{v:.3g}" if a < 10 else f"{v:.1f}"
    return f"{v:.3g}"


def bars(ax, labels, values, unit: str, *, errors=None, title: str = "", log: bool = False) -> None:
    """Horizontal bars with the value written at the end of each bar."""
    ys = range(len(labels))
    ax.barh(list(ys), values, xerr=errors, color="tab:blue", alpha=0.8)
    ax.set_yticks(list(ys), labels)
    ax.invert_yaxis()
    if log:
        ax.set_xscale("log")
    for yv, v in zip(ys, values):
        ax.text(v, yv, f" {number(v)} {unit}", va="center", fontsize=8)
    ax.set_xlabel(unit)
    if title:
        ax.set_title(title)


def timeline(ax, rows, *, lane: str = "lane", start: str = "start_us", dur: str = "dur_us",
             name: str = "name", title: str = "", highlight=None) -> None:
    """A Gantt chart: one horizontal lane per value of ``lane`` (e.g. CPU, GPU).

    ``highlight(row) -> bool`` marks rows to stand out (drawn in red, at least 0.5% of the span
    wide), so a 2 us kernel next to a 50 ms sleep on the same lane is still seen.
    """
    lanes = []
    for r in rows:
        if r[lane] not in lanes:
            lanes.append(r[lane])
    colours = {l: c for l, c in zip(lanes, ["tab:orange", "tab:green", "tab:blue", "tab:purple", "tab:brown"])}
    span = (max((r[start] + r[dur] for r in rows), default=1.0) - min((r[start] for r in rows), default=0.0)) or 1.0
    for r in rows:
        y = lanes.index(r[lane])
        hot = bool(highlight and highlight(r))
        width = max(r[dur], 0.005 * span if hot else 0.05)
        ax.broken_barh([(r[start], width)], (y - 0.35, 0.7), color="tab:red" if hot else colours[r[lane]],
                       alpha=1.0 if hot else 0.85, zorder=3 if hot else 2)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.invert_yaxis()
    ax.set_xlabel("time [us]")
    ax.grid(True, axis="x", alpha=0.3)
    if title:
        ax.set_title(title)
