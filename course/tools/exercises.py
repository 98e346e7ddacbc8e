"""Which exercises a notebook declares, read from its source (no kernel), and every exercise's hints
and answer.

A notebook declares an exercise by an ``exercise(NAME)`` call, or by calling a course function that
holds one (``lab.check_key``); NAME is a string literal, a module-level constant or a parameter's
default.
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[2]
COMPUTED = "<computed when the check runs>"  # an answer given as an expression, not a literal
# shorter answer lines (`g.replay()`, `except Exception:`) are idioms, not the answer
MIN_QUOTE = 20


def _called(node) -> str | None:
    return getattr(node.func, "id", getattr(node.func, "attr", None)) if isinstance(node, ast.Call) else None


def _trees(cells) -> dict:
    """Code-cell index -> its parsed source (cells that do not parse are left out)."""
    out = {}
    for i, cell in enumerate(cells):
        if cell.cell_type == "code":
            try:
                out[i] = ast.parse(cell.source)
            except SyntaxError:
                continue
    return out


def _values(tree) -> dict:
    """The module-level assignments of ``tree`` whose value is a literal (a string, a list...): name
    -> value."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            try:
                value = ast.literal_eval(node.value)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                continue
            out.update({t.id: value for t in node.targets if isinstance(t, ast.Name)})
    return out


def module_constants(tree) -> dict:
    """The module-level string constants of ``tree`` (``NAME = "..."``): name -> value."""
    return {k: v for k, v in _values(tree).items() if isinstance(v, str)}


def _value(node, consts: dict):
    """The literal ``node`` stands for (a constant's name read in ``consts``), else None."""
    if isinstance(node, ast.Name):
        return consts.get(node.id)
    try:
        return ast.literal_eval(node) if node is not None else None
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None


def exercise_calls(tree, consts=None) -> list:
    """``(name, call)`` of each ``exercise(NAME, ...)`` call under ``tree``, in order; NAME is a
    literal, a constant of ``consts`` or (``tree`` a function) a parameter's default, else ``name``
    is None (the source does not say)."""
    consts = dict(consts or {})
    if isinstance(tree, ast.FunctionDef):
        a = tree.args
        defaults = [None] * (len(a.args) - len(a.defaults)) + a.defaults + a.kw_defaults
        for arg, d in zip(a.args + a.kwonlyargs, defaults):
            if isinstance(v := _value(d, consts), str):
                consts[arg.arg] = v
    found = [(n, _value(n.args[0], consts)) for n in ast.walk(tree) if _called(n) == "exercise" and n.args]
    found.sort(key=lambda c: (c[0].lineno, c[0].col_offset))
    return [(name if isinstance(name, str) else None, n) for n, name in found]


def _functions(tree, consts) -> dict:
    """Function name -> the exercises it checks, for the functions of ``tree`` that hold
    ``exercise(...)``."""
    found = {}
    for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
        if names := [name for name, _ in exercise_calls(fn, consts) if name]:
            known = found.setdefault(fn.name, [])
            known += [n for n in names if n not in known]
    return found


@functools.lru_cache(maxsize=1)
def course_checks() -> dict:
    """Function name -> exercise names, for the course's functions that run checks
    (``lab.check_key`` ...).

    A notebook that calls one of them declares its exercises as surely as one that calls
    ``exercise("...")``."""
    found = {}
    for path in sorted((ROOT / "course").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for name, names in _functions(tree, module_constants(tree)).items():
            found.setdefault(name, [])
            found[name] += [n for n in names if n not in found[name]]
    return found


def _calls(tree, known: dict, outside_functions: bool = False) -> list:
    """The exercise names ``tree``'s calls check, in order: ``exercise("...")`` and calls of
    ``known`` functions."""
    inside = {id(n) for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef) for n in ast.walk(fn)} \
        if outside_functions else set()
    calls = sorted((n for n in ast.walk(tree) if isinstance(n, ast.Call) and id(n) not in inside),
                   key=lambda n: (n.lineno, n.col_offset))
    names = []
    for n in calls:
        if _called(n) == "exercise" and n.args and isinstance(n.args[0], ast.Constant):
            names.append(n.args[0].value)
        else:
            names += known.get(_called(n), [])
    return names


def exercise_cells(nb) -> dict:
    """Exercise name -> index of the first code cell that contains its check: an ``exercise(...)``
    call (in a function or not), or a call of a course function that runs one
    (:func:`course_checks`) that the notebook does not define itself."""
    trees = _trees(nb.cells)
    own = {n.name for t in trees.values() for n in ast.walk(t) if isinstance(n, ast.FunctionDef)}
    known = {k: v for k, v in course_checks().items() if k not in own}
    found = {}
    for i, tree in trees.items():
        for name in [name for name, _ in exercise_calls(tree) if name] + _calls(tree, known):
            found.setdefault(name, i)
    return found


def exercise_names(nb) -> list:
    """The names of the exercises a notebook declares, in order (see :func:`exercise_cells`)."""
    return list(exercise_cells(nb))


def check_cells(nb) -> dict:
    """Exercise name -> index of the code cell that runs its check: a ``with exercise(...)`` outside
    any function, or a call of a function that holds one (the course's, or one the notebook
    defines)."""
    trees = _trees(nb.cells)
    own = {}
    for tree in trees.values():
        own.update(_functions(tree, module_constants(tree)))
    known = {**{k: v for k, v in course_checks().items() if k not in own}, **own}
    found = {}
    for i, tree in trees.items():
        for name in _calls(tree, known, outside_functions=True):
            found.setdefault(name, i)
    return found


def answer_lines(nb) -> dict:
    """Exercise name -> the code lines of its answer: the ``### BEGIN SOLUTION`` blocks in the cells
    after the previous check's cell, up to and including its own (:func:`check_cells`); exercises
    with none are left out."""
    out, last = {}, -1
    for name, i in sorted(check_cells(nb).items(), key=lambda kv: kv[1]):
        lines = []
        for cell in nb.cells[last + 1:i + 1]:
            inside = False
            for line in cell.source.splitlines() if cell.cell_type == "code" else ():
                mark = line.strip()
                if mark.startswith(("### BEGIN SOLUTION", "### END SOLUTION")):
                    inside = mark.startswith("### BEGIN")
                elif inside and mark:
                    lines.append(mark)
        if lines:
            out[name] = lines
        last = max(last, i)
    return out


def quoted_lines(stage: str, lines) -> list:
    """The answer's code ``lines`` (comments stripped, at least :data:`MIN_QUOTE` characters) that
    hint ``stage`` quotes word for word, whitespace aside. A stage that quotes two or more gives the
    answer away."""
    def norm(text):
        return " ".join(text.split())

    text, out = norm(stage), []
    for line in lines:
        code = norm(line.split("  #")[0].split(" # ")[0])
        if len(code) >= MIN_QUOTE and code in text and code not in out:
            out.append(code)
    return out


def _registered(tree, where: str) -> list:
    """``{"name", "hint", "answer", "where"}`` of each ``exercise(...)`` call in ``tree``."""
    consts, out, seen = _values(tree), [], set()
    strings = {k: v for k, v in consts.items() if isinstance(v, str)}
    for scope in [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)] + [tree]:
        for name, call in exercise_calls(scope, strings):
            if name is None or id(call) in seen:
                continue
            seen.add(id(call))
            kw = {k.arg: k.value for k in call.keywords}
            hint = _value(kw.get("hint", call.args[1] if len(call.args) > 1 else None), consts)
            node = kw.get("answer", call.args[2] if len(call.args) > 2 else None)
            answer = _value(node, consts)
            answer = COMPUTED if answer is None and node is not None else answer
            out.append({"name": name, "hint": hint, "answer": answer, "where": f"{where}:{call.lineno}"})
    return out


def registered_hints(root=None) -> dict:
    """Every exercise of the course -> ``{"hint", "answer", "where"}``, read from the source of each
    ``exercise(...)`` call (in ``course/`` and in the answer versions' cells, ``solutions/``); a
    hint that is not a literal or a module-level constant reads as None, an answer computed by an
    expression as :data:`COMPUTED`."""
    root = Path(root) if root is not None else ROOT
    found = {}
    for path in sorted((root / "course").rglob("*.py")):
        for e in _registered(ast.parse(path.read_text(encoding="utf-8")), str(path.relative_to(root))):
            found.setdefault(e["name"], e)
    for path in sorted((root / "solutions").glob("*.ipynb")):
        for i, tree in _trees(nbformat.read(path, as_version=4).cells).items():
            for e in _registered(tree, f"{path.relative_to(root)} cell {i}"):
                found.setdefault(e["name"], e)
    return found
