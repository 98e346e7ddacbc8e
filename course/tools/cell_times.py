"""Time every cell of a notebook, live: ``python -m course.tools.cell_times NOTEBOOK [--json FILE]
[--root DIR]``.

Runs the notebook in a fresh kernel (nbclient; this checkout first on the kernel's ``PYTHONPATH``)
and prints one line per cell as it finishes: its index, seconds, and its first line, with the long
experiments' own progress lines (stdout) shown under the cell that printed them. Then the total and
the slowest cells. Use it before and after a change to see where a notebook's live time goes
(``COURSE_FULL=1`` in the environment runs the heavy experiments too). Nothing is written to the
notebook.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROGRESS = re.compile(r"\[\d+/\d+\]|done in|timing \d+ variants|counting graph")


def _first_line(src: str) -> str:
    lines = [line for line in src.splitlines() if line.strip()]
    return (lines[0] if lines else "")[:70]


def time_cells(path, timeout: float = 600.0, log=print, show_output: bool = True, root=None) -> list:
    """Execute the notebook at ``path``: ``[{"cell", "seconds", "first_line"}]`` per code cell.
    ``root``: the checkout the kernel imports (an older one times the notebook as it was); ``log``
    gets a line per cell; a failing cell's error is raised after it is logged."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(str(path), as_version=4)
    rows, start = [], {}

    def on_start(cell, cell_index, **_):
        start[cell_index] = time.perf_counter()

    def on_done(cell, cell_index, **_):
        if cell.cell_type != "code":
            return
        sec = time.perf_counter() - start.get(cell_index, time.perf_counter())
        rows.append({"cell": cell_index, "seconds": sec, "first_line": _first_line(cell.source)})
        log(f"cell {cell_index:3d}  {sec:7.1f} s  {_first_line(cell.source)}")
        if show_output:
            for out in cell.get("outputs", []):
                for line in str(out.get("text", "")).splitlines():
                    if PROGRESS.search(line):
                        log(f"            {line[:110]}")

    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = str(root or ROOT) + (os.pathsep + env_path if env_path else "")
    try:
        client = NotebookClient(nb, timeout=timeout, kernel_name="python3", on_cell_start=on_start,
                                on_cell_executed=on_done, resources={"metadata": {"path": str(Path(path).parent)}})
        t0 = time.perf_counter()
        client.execute()
    finally:
        os.environ["PYTHONPATH"] = env_path
        if not env_path:
            del os.environ["PYTHONPATH"]
    total = time.perf_counter() - t0
    log(f"total {total:.1f} s over {len(rows)} code cells "
        "(kernel start-up included in the total only)")
    for r in sorted(rows, key=lambda r: -r["seconds"])[:5]:
        log(f"  slowest: cell {r['cell']:3d} {r['seconds']:7.1f} s  {r['first_line']}")
    return rows


def main(argv=None) -> int:
    """Command line: time each cell of one notebook; ``--json FILE`` also writes the rows."""
    ap = argparse.ArgumentParser(prog="python -m course.tools.cell_times", description=__doc__.splitlines()[0])
    ap.add_argument("notebook")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per cell (default 600)")
    ap.add_argument("--json", help="also write the per-cell times to this file")
    ap.add_argument("--root", help="checkout whose `course` the kernel imports (default: this one)")
    args = ap.parse_args(argv)
    rows = time_cells(args.notebook, timeout=args.timeout, root=args.root)
    if args.json:
        Path(args.json).write_text(json.dumps({"notebook": args.notebook, "full": os.environ.get("COURSE_FULL", ""),
                                               "cells": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
