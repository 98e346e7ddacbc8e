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


# ----------------------------------------------------------------------------- the text names its real sources
# A learner has no "seeds" and no "issue": the course's text names its real sources (InfiniCore's embedding test,
# InfiniLM's fused inference engine, PyTorch's DTensor test, a CUDA Graph lesson) and never how it was made.
# The pattern is the repository's before-stop check's.
MAKING_OF = r"\bthe seeds?('s|')?(?=\W)|\bseeds'|shared/seeds|\bthe issue\b"
NOTEBOOKS = sorted(p for d in ("notebooks", "labs", "solutions") for p in (ROOT / d).glob("*.ipynb"))


def making_of(text: str) -> list:
    """The words of ``text`` that speak of how the course was made (see :data:`MAKING_OF`)."""
    import re

    return [m.group(0) for m in re.finditer(MAKING_OF, text, re.I)]


def test_making_of_catches_its_words_and_spares_random_seeds():
    for bad in ("the seeds' test", "The seed's FAQ", "as the seeds say", "see shared/seeds/003",
                "the issue that asked", "the seed, then", "seeds' embedding"):
        assert making_of(bad), bad
    for fine in ("torch.manual_seed(0)", "seeded random weights", "from a fixed seed", "same weights (same seed)",
                 "reads its seed and offset", "an issue with", "issued back to back"):
        assert not making_of(fine), fine


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_notebook_text_names_real_sources(path):
    import json

    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    found = {i: making_of("".join(c["source"])) for i, c in enumerate(cells)}
    found = {i: words for i, words in found.items() if words}
    assert not found, (f"{path.relative_to(ROOT)}: cells {found} speak of 'the seed(s)' or 'the issue': name the real "
                       "source (InfiniCore's embedding test, InfiniLM's fused engine, PyTorch's DTensor test, the CUDA "
                       "Graph lesson)")
