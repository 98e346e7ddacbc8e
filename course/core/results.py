"""Plain results: rows of numbers with units and provenance.

Every experiment in the course returns a :class:`Result`. Notebooks print and plot
them; ``python -m course bench`` saves GPU ones as reference data.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json

from course.core.provenance import describe, provenance


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
        return (f"recorded on {describe(p)} on {p.get('date')} "
                "(reference data from `python -m course bench`; this machine has no usable GPU)")

    def table(self, max_rows: int = 40) -> str:
        """A plain-text table with units in the header."""
        heads = [f"{c} [{u}]" if u else c for c, u in self.columns.items()]
        fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)
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
            raise ValueError(f"reference data {d.get('name')!r} was edited by hand (checksum mismatch). "
                             "Reference data is only written by `python -m course bench` on a GPU: "
                             "restore it with git or re-run the bench.")
        return res
