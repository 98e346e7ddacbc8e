"""Every link in every notebook resolves where a learner reads it: the workspace (`make lab`) and build/ (`course run`)."""
import shutil
from pathlib import Path

import nbformat
import pytest

from course.tools import catalog, links, render, workspace

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = [e.path for e in catalog.CATALOG if (ROOT / e.path).exists()]


def test_relative_targets_and_html_rewrites():
    assert links.relative_target("../CAPTURE_RULES.md#rules") == "../CAPTURE_RULES.md"
    assert links.relative_target("notebooks/02%20x.ipynb") == "notebooks/02 x.ipynb"
    for absolute in ("https://pytorch.org/docs", "#anchor", "mailto:a@b", "/files/x.md", "data:image/png;base64,"):
        assert links.relative_target(absolute) is None, absolute
    md = "see [a](<notebooks/02_x.ipynb#1.-The-recipe>) and [b](../R.md) and [c](https://x.org/y.ipynb)"
    assert links.links_in_text(md) == ["notebooks/02_x.ipynb", "../R.md"]
    assert links.as_html_links(md) == md.replace("02_x.ipynb", "02_x.html")
    assert links.links_in_text('<a href="../R.md">r</a> <a href="#top">t</a>', html=True) == ["../R.md"]


def test_every_notebook_links_the_rules_and_the_links_break_without_the_copy(tmp_path):
    """The check can fail: notebooks copied alone into a folder leave their link to the rules dangling."""
    rules = [p for p in SHIPPED if "../CAPTURE_RULES.md" in links.file_links(ROOT / p)]
    assert len(rules) >= 10, rules
    for rel in rules[:2]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    assert [t for _, t in links.broken_links(tmp_path)] == ["../CAPTURE_RULES.md"] * 2
    assert links.linked_files(ROOT, rules) == ["CAPTURE_RULES.md"]
    assert links.copy_linked(ROOT, rules[:2], tmp_path, html=True) == ["CAPTURE_RULES.md"]
    assert links.broken_links(tmp_path, suffixes=(".ipynb",)) == []
    copied = (tmp_path / "CAPTURE_RULES.md").read_text()
    assert copied == links.as_html_links((ROOT / "CAPTURE_RULES.md").read_text()) and ".html#" in copied


def test_every_link_resolves_in_the_workspace(tmp_path):
    """JupyterLab serves work/: `../CAPTURE_RULES.md` from work/notebooks/ must be work/CAPTURE_RULES.md, and the
    rules' own links to the lessons must reach the learner's copies."""
    dest = workspace.create(dest=tmp_path / "work", quiet=True)
    assert (dest / "CAPTURE_RULES.md").read_text() == (ROOT / "CAPTURE_RULES.md").read_text()
    assert links.broken_links(dest) == []
    checked = [p for p in dest.rglob("*.ipynb") if links.file_links(p)]
    assert len(checked) >= 10 and links.file_links(dest / "CAPTURE_RULES.md"), "the links were not found"


def test_every_link_resolves_in_build(tmp_path, monkeypatch):
    """`course run` writes executed notebooks and HTML under build/: the linked files sit beside both, and the
    rules copied into html/ link the lessons' pages. (Executing is skipped here: links do not depend on outputs.)"""
    pytest.importorskip("nbconvert")
    monkeypatch.setattr(render, "execute", lambda path, timeout=900, env=None: (nbformat.read(path, as_version=4),
                                                                                 None))
    assert render.main(out=str(tmp_path / "build"), jobs=1, answers=True) == 0  # one process: the stand-in applies
    for part, suffix in (("executed", ".ipynb"), ("html", ".html")):
        folder = tmp_path / "build" / part
        pages = sorted(folder.rglob(f"*{suffix}"))
        assert len(pages) == len(SHIPPED), (part, pages)
        assert links.broken_links(folder) == [], part
        assert all("../CAPTURE_RULES.md" in links.file_links(p) for p in pages
                   if "../CAPTURE_RULES.md" in links.file_links(ROOT / p.relative_to(folder).with_suffix(".ipynb")))
    rules = (tmp_path / "build" / "html" / "CAPTURE_RULES.md").read_text()
    assert ".html#" in rules and ".ipynb" not in rules.split("](<")[1].split(">")[0]
