"""The shape of `course/`: folders that name the parts of the course, no import cycles, small modules."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "course"
MAX_LINES = 400
PARTS = ("core", "sim", "lessons", "embedding", "tools")


def module_name(path: Path) -> str:
    """``course/core/timing.py`` -> ``course.core.timing``; a package's ``__init__`` -> the package."""
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def imports_of(path: Path, known: set) -> set:
    """Every course module that ``path`` imports, at module level or inside a function."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            # the deepest known module this import names (``course.embedding.swap`` before ``course.embedding``)
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def import_graph() -> dict:
    mods = modules()
    known = set(mods)
    return {m: imports_of(p, known) for m, p in mods.items()}


def find_cycle(graph: dict):
    """One import cycle as a list of modules, or None. A package's ``__init__`` may re-export its submodules, but
    then no submodule may import the package itself (``from pkg import sibling`` runs ``pkg/__init__`` first):
    import the sibling module directly (``import pkg.sibling as sibling``)."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == "open":
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = "done"
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_find_cycle_can_fail():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_in_course():
    graph = import_graph()
    assert "course.core.timing" in graph and graph["course.embedding.bench"], "the import graph was not read"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_toolkit_imports_no_lesson():
    """The toolkit is what every lesson uses: it must not depend on a lesson, the embedding labs or the tools."""
    graph = import_graph()
    toolkit = ("course.core", "course.sim")
    bad = {m: sorted(n for n in deps if not n.startswith(toolkit) and n != "course")
           for m, deps in graph.items() if m.startswith(toolkit)}
    assert not {m: d for m, d in bad.items() if d}, bad


@pytest.mark.parametrize("path", sorted(PKG.rglob("*.py")), ids=lambda p: str(p.relative_to(PKG)))
def test_module_is_small(path):
    n = len(path.read_text().splitlines())
    assert n <= MAX_LINES, f"{path.relative_to(PKG.parent)} has {n} lines (limit {MAX_LINES}): split it by idea"


def test_folders_name_the_parts_of_the_course():
    for part in PARTS:
        init = PKG / part / "__init__.py"
        assert init.exists(), f"course/{part}/ is missing"
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc.splitlines()) >= 1, f"course/{part}/__init__.py needs a docstring that maps the folder"
    loose = sorted(p.name for p in PKG.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert not loose, f"modules outside the course's parts: {loose}"
