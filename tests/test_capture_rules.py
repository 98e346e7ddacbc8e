"""CAPTURE_RULES.md: every rule links a lesson cell that exists and a source; every lesson and the README link the page."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from course.tools import catalog

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "CAPTURE_RULES.md"
SOURCES = {"PyTorch": "https://pytorch.org/docs/stable/notes/cuda.html#cuda-graphs",
           "NVIDIA": "https://docs.nvidia.com/cuda/cuda-c-programming-guide/index.html#cuda-graphs",
           "gpt-fast": "https://github.com/pytorch-labs/gpt-fast"}
TOPICS = ("warm up", "static memory", "freezes", "refused", "pools", "streams", "random", "optimizers", "autocast",
          "collectives", "freed during a capture")
LINK = re.compile(r"\]\(<([^>#]+\.ipynb)#([^>]+)>\)")


def anchor(heading: str) -> str:
    """The anchor JupyterLab gives a markdown heading: its text without markup, spaces turned into '-'."""
    return re.sub(r"^#+\s*", "", heading).replace("`", "").strip().replace(" ", "-")


def headings(path: Path) -> set:
    """The anchors of every markdown heading of a notebook."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    return {anchor(line) for c in nb["cells"] if c["cell_type"] == "markdown"
            for line in "".join(c["source"]).splitlines() if re.match(r"^#{1,6} ", line)}


def rules() -> dict:
    """Section title -> its text, for every section of the page."""
    parts = re.split(r"^## ", PAGE.read_text(encoding="utf-8"), flags=re.M)[1:]
    return {p.splitlines()[0]: p for p in parts}


def test_the_page_names_its_sources_and_covers_every_topic():
    text = PAGE.read_text(encoding="utf-8")
    for name, url in SOURCES.items():
        assert "[" in text and url in text, f"CAPTURE_RULES.md must link {name}: {url}"
    titles = " ".join(rules()).lower()
    missing = [t for t in TOPICS if t not in titles]
    assert not missing, f"rules missing from CAPTURE_RULES.md's section titles: {missing}"


@pytest.mark.parametrize("title", list(rules()), ids=lambda t: t[:40])
def test_every_rule_links_a_lesson_cell_and_a_source(title):
    body = rules()[title]
    links = LINK.findall(body)
    assert links, f"rule {title!r} links no lesson cell"
    sources = re.search(r"^- Sources: (.+)", body, re.M | re.S)
    assert sources and any(name in sources.group(1) for name in SOURCES), f"rule {title!r} names no source"


LINKS = sorted(set(LINK.findall(PAGE.read_text(encoding="utf-8"))))


@pytest.mark.parametrize("path,target", LINKS, ids=[f"{p}#{a[:30]}" for p, a in LINKS])
def test_every_lesson_link_points_at_an_existing_heading(path, target):
    notebook = ROOT / path
    assert notebook.exists(), f"CAPTURE_RULES.md links {path}, which does not exist"
    assert target in headings(notebook), (f"CAPTURE_RULES.md links {path}#{target}: no such heading there (headings: "
                                          f"{sorted(headings(notebook))})")


def test_the_heading_check_can_fail():
    assert anchor("## 2. Static inputs: new data goes in with `copy_`") == "2.-Static-inputs:-new-data-goes-in-with-copy_"
    assert "1.-The-recipe:-warm-up,-capture,-replay" in headings(ROOT / "notebooks" / "02_capture_and_replay.ipynb")
    assert "no-such-heading" not in headings(ROOT / "notebooks" / "02_capture_and_replay.ipynb")
    assert LINK.findall("[x](<labs/lab3_graph_cache.ipynb#Step-1:-the-key>)") == [("labs/lab3_graph_cache.ipynb",
                                                                                  "Step-1:-the-key")]


LESSONS = [ROOT / e.path for e in catalog.CATALOG if re.match(r"(notebooks|solutions)/\d\d_", e.path)]


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_lesson_links_the_page_at_the_top(path):
    nb = json.loads(path.read_text(encoding="utf-8"))
    first = next("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    assert "](../CAPTURE_RULES.md)" in first, f"{path.name}: link ../CAPTURE_RULES.md in the first markdown cell"


def test_lessons_found_and_the_readme_course_map_links_the_page():
    assert len([p for p in LESSONS if p.parent.name == "notebooks"]) == 9 and len(LESSONS) == 17, LESSONS
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    course_map = readme[readme.index("## Course map"):readme.index("## Command line")]
    assert "](CAPTURE_RULES.md)" in course_map, "the README's course map must link CAPTURE_RULES.md"
