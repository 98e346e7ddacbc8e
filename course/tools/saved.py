"""The idea in the cell (d2l's ``#@save``): a notebook cell that teaches code defines it, and the
course keeps it.

A cell whose first line is ``#@save course.lessons.NAME.MODULE`` defines functions, classes or
constants that the named module holds too, to the letter. :func:`differences` lists every definition
that drifted, so a test can hold the notebook and the module equal; later cells and the course's
checks then run the same code.
"""
from __future__ import annotations

import ast
import importlib.util
import json
import textwrap
from pathlib import Path

MARK = "#@save"


def saved_cells(notebook) -> list:
    """``(cell index, module name, source)`` of every ``#@save`` cell of ``notebook`` (a path)."""
    cells = json.loads(Path(notebook).read_text(encoding="utf-8"))["cells"]
    out = []
    for i, c in enumerate(cells):
        src = "".join(c["source"]) if c["cell_type"] == "code" else ""
        first = src.split("\n", 1)[0].strip()
        if first.startswith(MARK):
            out.append((i, first[len(MARK):].strip(), src.split("\n", 1)[1] if "\n" in src else ""))
    return out


def definitions(source: str) -> dict:
    """Top-level name -> its source text (functions, classes, and assignments to one name),
    decorators included."""
    tree = ast.parse(source)
    lines = source.splitlines()
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name, start = node.name, min([d.lineno for d in node.decorator_list] + [node.lineno])
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            if not isinstance(target, ast.Name):
                continue
            name, start = target.id, node.lineno
        else:
            continue
        out[name] = textwrap.dedent("\n".join(lines[start - 1:node.end_lineno])).rstrip()
    return out


def differences(notebook) -> list:
    """One line per ``#@save`` definition of ``notebook`` that its module lacks or holds otherwise.
    """
    problems = []
    for i, module, src in saved_cells(notebook):
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin is None:
            problems.append(f"{Path(notebook).name} cell {i}: no module {module}")
            continue
        kept = definitions(Path(spec.origin).read_text(encoding="utf-8"))
        for name, text in definitions(src).items():
            if kept.get(name) != text:
                what = "lacks" if name not in kept else "holds another version of"
                problems.append(f"{Path(notebook).name} cell {i}: {module} {what} {name}")
    return problems
