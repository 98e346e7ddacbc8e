"""Which exercises a notebook declares, read from its source (no kernel): its ``exercise(...)`` calls and the calls
of the course's own check functions (``lab.check_key`` ...), with their names resolved from string literals,
module-level constants and parameter defaults; and every exercise's registered hints and answer
(:func:`registered_hints`), for the test that holds the staged-hint rule for all of them.
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

def _called(node) -> str | None:
    return getattr(node.func, "id", getattr(node.func, "attr", None)) if isinstance(node, ast.Call) else None


def _literal_exercises(tree, consts=None) -> list:
    """The names of the ``exercise(NAME)`` calls under ``tree``, in order of appearance.

    ``NAME`` is a string literal, a module-level string constant of ``consts`` (``NAME = "06.4 ..."``), or a parameter
    of the function around the call whose default is a string (``def check(fn, name="07.1 ...")``).
    """
    consts = dict(consts or {})
    if isinstance(tree, ast.FunctionDef):
        args = tree.args.args + tree.args.kwonlyargs
        defaults = [None] * (len(tree.args.args) - len(tree.args.defaults)) + list(tree.args.defaults) \
            + list(tree.args.kw_defaults)
        consts.update({a.arg: d.value for a, d in zip(args, defaults)
                       if isinstance(d, ast.Constant) and isinstance(d.value, str)})
    found = []
    for n in ast.walk(tree):
        if _called(n) != "exercise" or not n.args:
            continue
        arg = n.args[0]
        name = arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else (
            consts.get(arg.id) if isinstance(arg, ast.Name) else None)
        if name is not None:
            found.append((n.lineno, n.col_offset, name))
    return [name for *_, name in sorted(found)]


def module_constants(tree) -> dict:
    """The module-level string constants of ``tree`` (``NAME = "..."``): name -> value."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            out.update({t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)})
    return out


@functools.lru_cache(maxsize=1)
def course_checks() -> dict:
    """Function name -> exercise names, for the course's functions that run checks (``lab.check_key`` ...).

    A notebook that calls one of them declares its exercises as surely as one that calls ``exercise("...")``.
    """
    found = {}
    for path in sorted(Path(__file__).resolve().parents[1].rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        consts = module_constants(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and (names := _literal_exercises(node, consts)):
                known = found.setdefault(node.name, [])
                known += [n for n in names if n not in known]
    return found


def exercise_names(nb) -> list:
    """The names of the exercises a notebook declares, in order (see :func:`exercise_cells`)."""
    return list(exercise_cells(nb))


def exercise_cells(nb) -> dict:
    """Exercise name -> index of the first code cell that contains its check.

    A check is an ``exercise("...")`` call, or a call of a course function that runs one (:func:`course_checks`,
    unless the notebook defines a function of that name itself).
    """
    trees = {}
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            try:
                trees[i] = ast.parse(cell.source)
            except SyntaxError:
                continue
    own = {n.name for t in trees.values() for n in ast.walk(t) if isinstance(n, ast.FunctionDef)}
    known = {k: v for k, v in course_checks().items() if k not in own}
    found = {}
    for i, tree in trees.items():
        names = _literal_exercises(tree)
        calls = sorted((n for n in ast.walk(tree) if _called(n) in known), key=lambda n: (n.lineno, n.col_offset))
        names += [name for n in calls for name in known[_called(n)]]
        for name in names:
            found.setdefault(name, i)
    return found


COMPUTED = "<computed when the check runs>"  # an answer given as an expression, not a literal
MIN_QUOTE = 20  # shorter answer lines (`g.replay()`, `except Exception:`) are idioms, not the answer


def quoted_lines(stage: str, lines) -> list:
    """The answer's code ``lines`` (comments stripped, at least :data:`MIN_QUOTE` characters) that hint ``stage``
    quotes word for word, whitespace aside. A stage that quotes two or more gives the answer away."""
    def norm(text):
        return " ".join(text.split())

    text = norm(stage)
    out = []
    for line in lines:
        code = norm(line.split("  #")[0].split(" # ")[0])
        if len(code) >= MIN_QUOTE and code in text and code not in out:
            out.append(code)
    return out


def _values(tree) -> dict:
    """The module-level assignments of ``tree`` whose value is a literal (a string, a list...): name -> value."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            try:
                value = ast.literal_eval(node.value)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                continue
            out.update({t.id: value for t in node.targets if isinstance(t, ast.Name)})
    return out


def _value(node, consts: dict):
    if node is None:
        return None
    if isinstance(node, ast.Name):
        return consts.get(node.id)
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None


def _registered(tree, where: str) -> list:
    consts = _values(tree)
    out = []
    scopes = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)] + [tree]
    seen = set()
    for scope in scopes:
        names = _literal_exercises(scope, {k: v for k, v in consts.items() if isinstance(v, str)})
        calls = sorted((n for n in ast.walk(scope) if _called(n) == "exercise" and n.args and id(n) not in seen),
                       key=lambda n: (n.lineno, n.col_offset))
        for name, call in zip(names, calls):
            seen.add(id(call))
            kw = {k.arg: k.value for k in call.keywords}
            hint = _value(kw.get("hint", call.args[1] if len(call.args) > 1 else None), consts)
            node = kw.get("answer", call.args[2] if len(call.args) > 2 else None)
            answer = _value(node, consts)
            if answer is None and node is not None:
                answer = COMPUTED
            out.append({"name": name, "hint": hint, "answer": answer, "where": f"{where}:{call.lineno}"})
    return out


def registered_hints(root=None) -> dict:
    """Every exercise of the course -> ``{"hint", "answer", "where"}``, read from the source of each ``exercise(...)``
    call (in ``course/`` and in the answer versions' cells, ``solutions/``); a hint that is not a literal or a
    module-level constant reads as None, an answer computed by an expression as :data:`COMPUTED`."""
    root = Path(root) if root is not None else Path(__file__).resolve().parents[2]
    found = {}
    for path in sorted((root / "course").rglob("*.py")):
        for e in _registered(ast.parse(path.read_text(encoding="utf-8")), str(path.relative_to(root))):
            found.setdefault(e["name"], e)
    for path in sorted((root / "solutions").glob("*.ipynb")):
        import nbformat

        nb = nbformat.read(path, as_version=4)
        for i, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            try:
                tree = ast.parse(cell.source)
            except SyntaxError:
                continue
            for e in _registered(tree, f"{path.relative_to(root)} cell {i}"):
                found.setdefault(e["name"], e)
    return found


def check_cells(nb) -> dict:
    """Exercise name -> index of the code cell that runs its check: a ``with exercise(...)`` outside any function, or
    a call of a function that holds one (the course's, or one the notebook defines)."""
    trees = {}
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            try:
                trees[i] = ast.parse(cell.source)
            except SyntaxError:
                continue
    own = {}
    for tree in trees.values():
        consts = {k: v for k, v in _values(tree).items() if isinstance(v, str)}
        for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
            if names := _literal_exercises(fn, consts):
                own[fn.name] = names
    known = {**{k: v for k, v in course_checks().items() if k not in own}, **own}
    found = {}
    for i, tree in trees.items():
        inside = {id(n) for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef) for n in ast.walk(fn)}
        calls = sorted((n for n in ast.walk(tree) if isinstance(n, ast.Call) and id(n) not in inside),
                       key=lambda n: (n.lineno, n.col_offset))
        for n in calls:
            names = [n.args[0].value] if _called(n) == "exercise" and n.args and isinstance(n.args[0], ast.Constant) \
                else known.get(_called(n), [])
            for name in names:
                found.setdefault(name, i)
    return found


def answer_lines(nb) -> dict:
    """Exercise name -> the code lines of its answer: the ``### BEGIN SOLUTION`` blocks in the cells after the previous
    check's cell, up to and including its own (:func:`check_cells`); exercises with none are left out."""
    out, last = {}, -1
    for name, i in sorted(check_cells(nb).items(), key=lambda kv: kv[1]):
        lines = []
        for cell in nb.cells[last + 1:i + 1]:
            if cell.cell_type != "code":
                continue
            inside = False
            for line in cell.source.splitlines():
                mark = line.strip()
                if mark.startswith("### BEGIN SOLUTION"):
                    inside = True
                elif mark.startswith("### END SOLUTION"):
                    inside = False
                elif inside and mark:
                    lines.append(mark)
        if lines:
            out[name] = lines
        last = max(last, i)
    return out
