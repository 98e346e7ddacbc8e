"""An answer must not depend on a name the notebook rebinds (02.3 crashed on the GPU: `g` became a dict)."""
from __future__ import annotations

import ast
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))


def top_level_bindings(tree: ast.Module) -> dict:
    """Names a cell binds at top level (assignments, loops, with, imports, defs; inside if/try too), each with what
    binds it: ``"import torch"``-like for an import (the same module again is the same object), else ``None``."""
    names = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = None
        elif isinstance(node, ast.Import):
            for a in node.names:
                names[(a.asname or a.name).split(".")[0]] = f"import {a.name if a.asname else a.name.split('.')[0]}"
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                names[a.asname or a.name] = f"from {'.' * node.level}{node.module} import {a.name}"
        else:
            names.update((t.id, None) for t in ast.walk(node) if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store))
    return names


def rebound_names(nb) -> list:
    """(cell, function, name, cells binding it) for every global an answer function reads that two cells bind
    to what may be different objects (the same import in two cells binds the same object: not counted)."""
    cells = [(i, ast.parse(c.source), "BEGIN SOLUTION" in c.source)
             for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    binds: dict = {}
    how: dict = {}
    for i, tree, _ in cells:
        for name, what in top_level_bindings(tree).items():
            binds.setdefault(name, []).append(i)
            how.setdefault(name, set()).add(what)
    risky = {n for n, cs in binds.items() if len(cs) > 1 and (None in how[n] or len(how[n]) > 1)}
    found = []
    for i, tree, answer in cells:
        if not answer:
            continue
        for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef)):
            local = {a.arg for a in fn.args.args} | {t.id for t in ast.walk(fn)
                                                     if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store)}
            used = {t.id for t in ast.walk(fn) if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Load)} - local
            found += [(i, fn.name, u, binds[u]) for u in sorted(used) if u in risky]
    return found


def test_the_check_catches_the_02_3_crash():
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("g = make_graph()"),
        nbformat.v4.new_code_cell("e, g = RESULT.rows"),
        nbformat.v4.new_code_cell("def replay_with(x):\n    ### BEGIN SOLUTION\n    g.replay()\n    ### END SOLUTION"),
    ])
    assert rebound_names(nb) == [(2, "replay_with", "g", [0, 1])]


def test_the_same_import_in_two_cells_is_not_a_rebinding_and_a_different_one_is():
    same = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("import torch"), nbformat.v4.new_code_cell("import torch\nx = 1"),
        nbformat.v4.new_code_cell("def f():\n    ### BEGIN SOLUTION\n    return torch.zeros(1)\n    ### END SOLUTION")])
    assert rebound_names(same) == []
    other = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("from a import step"), nbformat.v4.new_code_cell("from b import step"),
        nbformat.v4.new_code_cell("def f():\n    ### BEGIN SOLUTION\n    return step()\n    ### END SOLUTION")])
    assert rebound_names(other) == [(2, "f", "step", [0, 1])]


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_answers_read_no_rebound_global(path):
    found = rebound_names(nbformat.read(path, as_version=4))
    assert not found, (f"{path.name}: an answer reads a global that two cells bind, so Run All can hand it the "
                       f"wrong object (cell, function, name, cells): {found}. Rename one of them.")
