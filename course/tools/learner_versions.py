"""``course build-labs``: the learner versions (``labs/``, the lessons in ``notebooks/``) built from
``solutions/``, the answer versions and the source.

In code cells each ``### BEGIN SOLUTION`` ... ``### END SOLUTION`` region becomes ``# YOUR CODE
HERE`` and a ``raise NotImplementedError(...)`` (:func:`strip_solutions`); in Markdown ``<!-- BEGIN
SOLUTION -->`` ... ``<!-- END SOLUTION -->`` becomes "*Your answer here.*"; cells tagged
``solution-only`` are left out; the first cell names the answer version (:func:`source_note`).
Solution and check cells get nbgrader metadata, so a teacher can release and autograde them.
``--check`` names files out of sync.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import nbformat

from course.tools.catalog import ROOT

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
MD_BEGIN, MD_END = "<!-- BEGIN SOLUTION -->", "<!-- END SOLUTION -->"
MD_PLACEHOLDER = "*Your answer here.*"
DROP_TAG = "solution-only"


class SolutionMarkerError(ValueError):
    """Unbalanced or misplaced solution markers."""


def _enclosing_function(lines: list, index: int, indent: int):
    """Name of the closest ``def`` above ``index`` that is indented less than ``indent``."""
    for line in reversed(lines[:index]):
        m = re.match(r"(\s*)(?:async\s+)?def\s+(\w+)", line)
        if m and len(m.group(1)) < indent:
            return m.group(2)
    return None


def strip_solutions(source: str) -> str:
    """Replace every ``### BEGIN SOLUTION`` ... ``### END SOLUTION`` region of a code cell.

    The replacement keeps the BEGIN marker's indentation::

        # YOUR CODE HERE
        raise NotImplementedError("build_kernel(): your code goes here")

    Raises :class:`SolutionMarkerError` for an END without BEGIN, a nested BEGIN, or a
    BEGIN that is never closed.
    """
    lines = source.split("\n")
    out, start = [], None
    for i, line in enumerate(lines):
        stripped = line.strip()
        if stripped.startswith(BEGIN):
            if start is not None:
                raise SolutionMarkerError(f"line {i + 1}: '{BEGIN}' inside another solution region")
            start = i
            indent = line[: len(line) - len(line.lstrip())]
            where = _enclosing_function(lines, i, len(indent))
            what = f"{where}(): your code goes here" if where else "your code goes here"
            out.append(f"{indent}# YOUR CODE HERE")
            out.append(f"{indent}raise NotImplementedError({what!r})")
        elif stripped.startswith(END):
            if start is None:
                raise SolutionMarkerError(f"line {i + 1}: '{END}' without a '{BEGIN}' before it")
            start = None
        elif start is None:
            out.append(line)
    if start is not None:
        raise SolutionMarkerError(f"line {start + 1}: '{BEGIN}' is never closed by '{END}'")
    return "\n".join(out)


def strip_markdown(source: str) -> str:
    """Replace ``<!-- BEGIN SOLUTION -->`` ... ``<!-- END SOLUTION -->`` in Markdown with a
    placeholder."""
    pattern = re.compile(re.escape(MD_BEGIN) + r".*?" + re.escape(MD_END), re.S)
    text = pattern.sub(MD_PLACEHOLDER, source)
    if MD_BEGIN in text or MD_END in text:
        raise SolutionMarkerError("unbalanced Markdown solution markers")
    return text


CHECK_TAG = "check"


def _grade_id(cell, i: int) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "-", str(cell.get("id") or f"cell-{i}"))


def is_check_cell(cell) -> bool:
    """True for a code cell that runs a check: a top-level ``with exercise(...)``, or tagged
    ``check``."""
    if cell.cell_type != "code":
        return False
    if CHECK_TAG in cell.get("metadata", {}).get("tags", []):
        return True
    return bool(re.search(r"^with\s+(?:\w+\.)*exercise\(", cell.source, re.M))


def with_nbgrader(nb):
    """A copy of ``nb`` whose cells carry nbgrader metadata (schema 3).

    A code cell with a solution region is a ``solution`` cell; a check cell (:func:`is_check_cell`)
    is a locked ``grade`` cell worth 1 point (or the ``points`` it already has); other cells carry
    no nbgrader metadata.
    """
    out = nbformat.from_dict(json.loads(json.dumps(nb)))
    for i, cell in enumerate(out.cells):
        old = cell.metadata.pop("nbgrader", {})
        meta = {"grade": False, "grade_id": _grade_id(cell, i), "locked": False, "schema_version": 3,
                "solution": False, "task": False}
        if cell.cell_type == "code" and BEGIN in cell.source:
            meta["solution"] = True
        elif is_check_cell(cell):
            meta.update(grade=True, locked=True, points=old.get("points", 1))
        else:
            continue
        cell.metadata["nbgrader"] = meta
    return out


def source_note(source: str) -> str:
    """The line a learner version's first cell ends with: the answer version it comes from, and
    where edits go."""
    return (f"*This is the learner version of `{source}` (the answer version), generated from it "
            f"by `python -m course build-labs`: a change to this notebook goes into `{source}`, "
            "then regenerate. Your own work goes into your copy in `work/` (`make lab`).*")


def make_lab(nb, source: str | None = None):
    """The lab version of a solution notebook (a new notebook; outputs cleared; nbgrader metadata
    kept).

    With ``source`` (the solution's path, e.g. ``solutions/lab1_embedding_kernel.ipynb``) the first
    cell ends with :func:`source_note` (a Markdown cell is added first when the notebook starts with
    code).
    """
    lab = with_nbgrader(nb)
    cells = []
    for i, cell in enumerate(lab.cells):
        if DROP_TAG in cell.get("metadata", {}).get("tags", []):
            continue
        try:
            if cell.cell_type == "code":
                cell.source = strip_solutions(cell.source)
                cell.outputs, cell.execution_count = [], None
            elif cell.cell_type == "markdown":
                cell.source = strip_markdown(cell.source)
        except SolutionMarkerError as e:
            raise SolutionMarkerError(f"cell {i} (id {cell.get('id')}): {e}") from None
        cells.append(cell)
    if source:
        note = source_note(source)
        if cells and cells[0].cell_type == "markdown":
            cells[0].source = cells[0].source.rstrip("\n") + "\n\n" + note
        else:
            first = nbformat.v4.new_markdown_cell(note)
            # fixed: a rebuilt notebook must be byte-for-byte the same
            first["id"] = "learner-version"
            cells.insert(0, first)
    lab.cells = cells
    return lab


def _render(nb) -> str:
    return nbformat.writes(nb) + "\n"


def target(root, src) -> Path:
    """Where a solution notebook's learner version goes: labs/ for ``lab*``, notebooks/ for a
    lesson."""
    return Path(root) / ("labs" if Path(src).name.startswith("lab") else "notebooks") / Path(src).name


def build_labs(check: bool = False, *, root=None) -> int:
    """Regenerate ``labs/`` and the lessons from ``solutions/`` (or, with ``check``, only compare).

    Also writes the nbgrader metadata into the solutions themselves. Returns 0 when everything
    is (now) in sync; with ``check``, 1 when a generated notebook differs from what its solution
    generates, is missing, a lab has no solution, or a solution lacks its nbgrader metadata (each
    is named); 2 when a solution has broken markers.
    """
    root = Path(root) if root is not None else ROOT
    sol_dir, lab_dir = root / "solutions", root / "labs"
    sources = sorted(sol_dir.glob("*.ipynb"))
    if not sources:
        print(f"build-labs: no solution notebooks in {sol_dir}")
        return 2 if not check else 1
    stale = []
    for src in sources:
        try:
            sol = with_nbgrader(nbformat.read(src, as_version=4))
            text = _render(make_lab(sol, source=src.relative_to(root).as_posix()))
        except SolutionMarkerError as e:
            print(f"build-labs: {src.relative_to(root)}: {e}")
            return 2
        pairs = [(src, _render(sol), f"{src.relative_to(root)} lacks its nbgrader metadata"),
                 (target(root, src), text, None)]
        for dest, want, why_stale in pairs:
            current = dest.read_text(encoding="utf-8") if dest.exists() else None
            if current == want:
                if why_stale is None:
                    print(f"build-labs: {dest.relative_to(root)} is in sync")
                continue
            if check:
                why = why_stale or (f"{dest.relative_to(root)} "
                                    f"{'is missing' if current is None else 'is out of sync with'} "
                                    f"{src.relative_to(root)}")
                print(f"build-labs: {why}")
                stale.append(dest)
            else:
                dest.parent.mkdir(exist_ok=True)
                dest.write_text(want, encoding="utf-8")
                print(f"build-labs: wrote {dest.relative_to(root)}")
    orphans = sorted(p for p in lab_dir.glob("*.ipynb") if not (sol_dir / p.name).exists())
    for p in orphans:
        print(f"build-labs: {p.relative_to(root)} has no source in "
              "solutions/ (delete it or add its solution)")
    if check and (stale or orphans):
        print("build-labs: run `python -m course build-labs` "
              "to regenerate labs/ and lessons from solutions/.")
        return 1
    return 0
