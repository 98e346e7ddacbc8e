"""Every public function and class in course/ has a docstring and is exercised by a test."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TESTS_TEXT = "\n".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))


def _public_defs():
    for path in sorted((ROOT / "course").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                yield str(path.relative_to(ROOT / "course")), node


DEFS = list(_public_defs())


def test_definitions_found_in_every_part():
    """The scan must reach every folder of the package (a glob that stops at the top finds nothing)."""
    parts = {m.split("/")[0] for m, _ in DEFS}
    assert {"core", "lessons", "embedding", "tools"} <= parts, parts
    assert len(DEFS) > 100, len(DEFS)


@pytest.mark.parametrize("module,node", DEFS, ids=[f"{m}:{n.name}" for m, n in DEFS])
def test_public_definition_has_docstring(module, node):
    assert ast.get_docstring(node), f"course/{module}: {node.name} needs a docstring"
    if isinstance(node, ast.ClassDef):
        for item in node.body:
            if isinstance(item, ast.FunctionDef) and not item.name.startswith("_"):
                assert ast.get_docstring(item), f"course/{module}: {node.name}.{item.name} needs a docstring"


@pytest.mark.parametrize("module,node", DEFS, ids=[f"{m}:{n.name}" for m, n in DEFS])
def test_public_definition_is_used_by_a_test(module, node):
    # experiments are registered and run through course.core.reference; their names count too
    names = {node.name}
    for dec in getattr(node, "decorator_list", []):
        if isinstance(dec, ast.Call) and dec.args and isinstance(dec.args[0], ast.Constant):
            names.add(str(dec.args[0].value))
    assert any(n in TESTS_TEXT for n in names), f"course/{module}: no test mentions {node.name}"
