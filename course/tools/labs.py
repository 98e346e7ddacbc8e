"""Instructor tools: generate labs/ from solutions/, and check a learner's notebook.

``solutions/*.ipynb`` are the source. In code cells, the regions between
``### BEGIN SOLUTION`` and ``### END SOLUTION`` (nbgrader's markers) are the answers;
:func:`strip_solutions` replaces each with ``# YOUR CODE HERE`` and a
``raise NotImplementedError(...)`` at the same indentation. In Markdown cells,
``<!-- BEGIN SOLUTION -->`` ... ``<!-- END SOLUTION -->`` becomes "*Your answer here.*".
Cells tagged ``solution-only`` are left out of the lab. ``python -m course build-labs``
writes ``labs/``; ``--check`` only compares and names the files that are out of sync.

``python -m course check labs/NAME.ipynb`` runs a notebook in a fresh kernel with
``COURSE_CHECK_LOG`` set (see :mod:`course.core.checks`) and prints, for every exercise the
notebook contains, whether its check passed, failed (with the hint) or is not done yet.
"""
from __future__ import annotations

import ast
import json
import os
import re
import tempfile
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
    """Replace ``<!-- BEGIN SOLUTION -->`` ... ``<!-- END SOLUTION -->`` in Markdown with a placeholder."""
    pattern = re.compile(re.escape(MD_BEGIN) + r".*?" + re.escape(MD_END), re.S)
    text = pattern.sub(MD_PLACEHOLDER, source)
    if MD_BEGIN in text or MD_END in text:
        raise SolutionMarkerError("unbalanced Markdown solution markers")
    return text


def make_lab(nb):
    """The lab version of a solution notebook (a new notebook; outputs cleared)."""
    lab = nbformat.from_dict(json.loads(json.dumps(nb)))
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
    lab.cells = cells
    return lab


def _render(nb) -> str:
    return nbformat.writes(nb) + "\n"


def build_labs(check: bool = False, *, root=None) -> int:
    """Regenerate ``labs/`` from ``solutions/`` (or, with ``check``, only compare).

    Returns 0 when everything is (now) in sync; with ``check``, 1 when a lab differs
    from what its solution generates, is missing, or has no solution (each is named);
    2 when a solution has broken markers.
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
            text = _render(make_lab(nbformat.read(src, as_version=4)))
        except SolutionMarkerError as e:
            print(f"build-labs: {src.relative_to(root)}: {e}")
            return 2
        dest = lab_dir / src.name
        current = dest.read_text(encoding="utf-8") if dest.exists() else None
        if current == text:
            print(f"build-labs: {dest.relative_to(root)} is in sync")
            continue
        if check:
            why = "is missing" if current is None else "is out of sync with"
            print(f"build-labs: {dest.relative_to(root)} {why} {src.relative_to(root)}")
            stale.append(dest)
        else:
            lab_dir.mkdir(exist_ok=True)
            dest.write_text(text, encoding="utf-8")
            print(f"build-labs: wrote {dest.relative_to(root)}")
    orphans = sorted(p for p in lab_dir.glob("*.ipynb") if not (sol_dir / p.name).exists())
    for p in orphans:
        print(f"build-labs: {p.relative_to(root)} has no source in solutions/ (delete it or add its solution)")
    if check and (stale or orphans):
        print("build-labs: run `python -m course build-labs` to regenerate labs/ from solutions/.")
        return 1
    return 0


# --------------------------------------------------------------------------- checking a notebook

def exercise_names(nb) -> list:
    """The names of the ``exercise("...")`` checks a notebook's code cells contain, in order."""
    names = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        try:
            tree = ast.parse(cell.source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "exercise"
                    and node.args and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, str) and node.args[0].value not in names):
                names.append(node.args[0].value)
    return names


def _cell_errors(nb) -> list:
    errors = []
    for i, cell in enumerate(nb.cells):
        for o in cell.get("outputs", []):
            if o.get("output_type") == "error":
                errors.append((i, o.get("ename", "Error"), o.get("evalue", "")))
    return errors


def check_notebook(path, timeout: int = 600) -> int:
    """Run the notebook at ``path`` in a fresh kernel and report each exercise's check.

    Every cell runs (errors are collected, not fatal; a cell that runs longer than
    ``timeout`` seconds is interrupted). Prints ✓ / ✗ (with its hint) / "not done yet" /
    "not reached" per exercise and lists cells that raised outside any check.
    Returns 0 only if every check passed and no cell raised; 1 otherwise; 2 if the file
    cannot be read.
    """
    from nbclient import NotebookClient

    from course.core.checks import ENV_LOG, FAIL, PASS, TODO

    path = Path(path)
    try:
        nb = nbformat.read(path, as_version=4)
    except Exception as e:  # noqa: BLE001 - OSError, bad JSON, schema errors: all "cannot read"
        print(f"check: cannot read {path}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        return 2
    expected = exercise_names(nb)
    fd, log_path = tempfile.mkstemp(prefix="course-check-", suffix=".jsonl")
    os.close(fd)
    old = os.environ.get(ENV_LOG)
    os.environ[ENV_LOG] = log_path
    print(f"check: running {path} in a fresh kernel (up to {timeout} s per cell) ...")
    try:
        client = NotebookClient(nb, timeout=timeout, allow_errors=True, interrupt_on_timeout=True,
                                kernel_name="python3", resources={"metadata": {"path": str(path.parent.resolve())}})
        client.execute()
        entries = [json.loads(l) for l in Path(log_path).read_text(encoding="utf-8").splitlines() if l.strip()]
    except Exception as e:  # noqa: BLE001 - report, do not crash
        print(f"check: the notebook could not be run: {type(e).__name__}: {e}")
        return 1
    finally:
        if old is None:
            os.environ.pop(ENV_LOG, None)
        else:
            os.environ[ENV_LOG] = old
        Path(log_path).unlink(missing_ok=True)

    outcome = {}
    for e in entries:  # the last outcome of each check wins (a cell re-run)
        outcome[e["name"]] = e
    names = expected + [n for n in outcome if n not in expected]
    counts = {PASS: 0, FAIL: 0, TODO: 0, "missing": 0}
    print()
    for name in names:
        e = outcome.get(name)
        if e is None:
            counts["missing"] += 1
            print(f"  ? {name}: not reached (an earlier cell stopped before this check ran)")
        elif e["status"] == PASS:
            counts[PASS] += 1
            print(f"  ✓ {name}")
        elif e["status"] == TODO:
            counts[TODO] += 1
            print(f"  … {name}: not done yet")
        else:
            counts[FAIL] += 1
            print(f"  ✗ {name}: {e['message']}")
            if e.get("hint"):
                print(f"      hint: {e['hint']}")
    failed_names = {n for n, e in outcome.items() if e["status"] == FAIL}
    stray = []
    for i, ename, evalue in _cell_errors(nb):
        if ename == "ExerciseFailed" and any(evalue.startswith(f"{n}:") for n in failed_names):
            continue  # already reported above
        stray.append((i, ename, evalue))
    for i, ename, evalue in stray:
        kind = "timed out" if ename == "KeyboardInterrupt" else f"raised {ename}"
        print(f"  ✗ cell {i} {kind}: {evalue.splitlines()[0] if evalue else ''}")
    total = len(names)
    print()
    print(f"check: {counts[PASS]}/{total} passed, {counts[FAIL]} failed, {counts[TODO]} not done yet"
          + (f", {counts['missing']} not reached" if counts["missing"] else "")
          + (f", {len(stray)} cell error(s)" if stray else ""))
    ok = total > 0 and counts[PASS] == total and not stray
    if total == 0:
        print("check: this notebook has no exercise checks.")
        ok = not stray
    return 0 if ok else 1
