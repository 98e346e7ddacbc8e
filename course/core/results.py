"""Plain results: rows of numbers with units and provenance.

Every experiment in the course returns a :class:`Result`. Notebooks show them as HTML
tables (:meth:`Result.html`, their rich display) and plot them; the terminal prints
:meth:`Result.table`; ``python -m course bench`` saves GPU ones as reference data.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json

from course.core.provenance import describe, provenance
from course.core.text import tidy

# text cells wrap (long reasons become paragraphs, long words break) instead of widening the table
# past the page; a table still wider than its box scrolls inside it. Only styles JupyterLab's HTML
# sanitizer keeps.
TEXT_CELL = "text-align:left;white-space:normal;overflow-wrap:break-word"
# characters: a longer text cell gets room to be a paragraph (min-width), not a thin column
LONG_TEXT = 60
NUMBER_CELL = "text-align:right;white-space:nowrap"


class Html(str):
    """An HTML fragment that Jupyter shows rendered (``_repr_html_``) and the terminal as its text.
    """

    def _repr_html_(self) -> str:
        return str(self)


@dataclasses.dataclass
class Result:
    """Rows of measurements. ``columns`` maps each column to its unit ('' for labels)."""

    name: str
    title: str
    columns: dict
    rows: list
    provenance: dict = dataclasses.field(default_factory=provenance)
    summary: dict = dataclasses.field(default_factory=dict)  # name -> {"value": v, "unit": u}
    params: dict = dataclasses.field(default_factory=dict)
    source: str = "live"  # "live": measured in this process; "reference": loaded from course/reference

    def __post_init__(self):
        for i, row in enumerate(self.rows):
            missing = set(self.columns) - set(row)
            if missing:
                raise ValueError(f"row {i} of {self.name!r} lacks columns {sorted(missing)}")

    def column(self, name: str, **where) -> list:
        """The values of one column, optionally only rows matching ``where`` (col=value)."""
        if name not in self.columns:
            raise KeyError(f"{self.name!r} has no column {name!r}; it has {list(self.columns)}")
        return [r[name] for r in self.rows if all(r.get(k) == v for k, v in where.items())]

    def add_summary(self, key: str, value, unit: str = "") -> None:
        """Record a derived number (a ratio, a crossover size) with its unit."""
        self.summary[key] = {"value": value, "unit": unit}

    def value(self, key: str):
        """A summary value by name."""
        return self.summary[key]["value"]

    @property
    def live(self) -> bool:
        """True when measured in this process, False when loaded from reference data."""
        return self.source == "live"

    def caption(self) -> str:
        """'measured here on X ...' or 'recorded on X on DATE ...': printed beside every plot."""
        p = self.provenance
        if self.live:
            return f"measured here on {describe(p)}, {p.get('date')}"
        why = (self.source.partition(":")[2].strip() if self.source.startswith("reference:")
               else "this machine has no usable GPU")
        return f"recorded on {describe(p)} on {p.get('date')} (reference data from `python -m course bench`; {why})"

    def table(self, max_rows: int = 40) -> str:
        """A plain-text table with units in the header."""
        heads = [f"{c} [{u}]" if u else c for c, u in self.columns.items()]
        fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(tidy(v))
        body = [[fmt(r[c]) for c in self.columns] for r in self.rows[:max_rows]]
        widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(heads)]
        line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))
        out = [self.title, line(heads), line(["-" * w for w in widths])] + [line(b) for b in body]
        if len(self.rows) > max_rows:
            out.append(f"... {len(self.rows) - max_rows} more rows")
        for k, s in self.summary.items():
            out.append(f"{k}: {fmt(s['value'])} {s['unit']}".rstrip())
        out.append(f"({self.caption()})")
        return "\n".join(out)

    def __repr__(self) -> str:
        return self.table()

    def html(self, columns=None, max_rows: int = 60) -> "Html":
        """An HTML table (units in the header, numbers right-aligned, summary and caption below).

        ``columns`` picks and orders columns (default: all). Notebooks show a result as this
        table (its rich display); the terminal keeps :meth:`table`. Text cells wrap and are shown
        whole, tidied (:func:`course.core.text.tidy`): never cut mid-sentence, no dangling "Found
        from :".
        """
        import html as _h

        cols = list(columns) if columns is not None else list(self.columns)
        unknown = [c for c in cols if c not in self.columns]
        if unknown:
            raise KeyError(f"{self.name!r} has no column(s) {unknown}; it has {list(self.columns)}")
        fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(tidy(v))
        num = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
        style = lambda text, number: NUMBER_CELL if number else TEXT_CELL + (";min-width:16em;max-width:40em"
                                                                              if len(text) > LONG_TEXT else "")
        name = lambda c: _h.escape(c).replace("_", "_<wbr>")  # long snake_case headers may break after "_"
        head = "".join(f"<th>{name(c)}" + (f" [{_h.escape(self.columns[c])}]" if self.columns[c] else "") + "</th>"
                       for c in cols)
        body = []
        for r in self.rows[:max_rows]:
            cells = "".join(f"<td style='{style(fmt(r[c]), num(r[c]))}'>{_h.escape(fmt(r[c]))}</td>" for c in cols)
            body.append(f"<tr>{cells}</tr>")
        more = f"<p>... {len(self.rows) - max_rows} more rows</p>" if len(self.rows) > max_rows else ""
        summ = "".join(f"<li>{_h.escape(k)}: {_h.escape(fmt(v['value']))} "
                       f"{_h.escape(v['unit'])}</li>"
                       for k, v in self.summary.items())
        return Html(f"<div class='course-result' style='max-width:100%;overflow-x:auto'><b>{_h.escape(self.title)}</b>"
                    f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>{more}"
                    + (f"<ul>{summ}</ul>" if summ else "")
                    + f"<p style='color:#555;font-size:smaller'>({_h.escape(self.caption())})</p></div>")

    def _repr_html_(self) -> str:
        return str(self.html())

    # --- serialisation -------------------------------------------------
    def payload(self) -> dict:
        """Everything except the source flag and checksum."""
        return {k: getattr(self, k) for k in ("name", "title", "columns", "rows", "provenance", "summary", "params")}

    def checksum(self) -> str:
        """sha256 of the canonical payload: reference files carry it so edits are detected."""
        blob = json.dumps(self.payload(), sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.sha256(blob.encode()).hexdigest()

    def to_dict(self) -> dict:
        """A JSON-ready dict with the checksum."""
        d = self.payload()
        d["sha256"] = self.checksum()
        d["written_by"] = "python -m course bench"
        return d

    @classmethod
    def from_dict(cls, d: dict, source: str = "reference") -> "Result":
        """Inverse of :meth:`to_dict`; refuses data whose checksum does not match."""
        fields = {k: d[k] for k in ("name", "title", "columns", "rows", "provenance", "summary", "params")}
        res = cls(**fields, source=source)
        if d.get("sha256") != res.checksum():
            raise ValueError(f"reference data {d.get('name')!r} was edited by hand (checksum "
                             "mismatch). Reference data is only written by `python -m course "
                             "bench` on a GPU: restore it with git or re-run the bench.")
        return res
