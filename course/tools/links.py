"""The notebooks' relative links resolve wherever the learner reads them: in ``work/`` and in
``build/``.

Every lesson links ``../CAPTURE_RULES.md``, a path relative to the notebook. JupyterLab started by
``make lab`` serves ``work/``, so the file must be there too (else ``/files/CAPTURE_RULES.md`` is a
404); the same holds for ``build/executed/`` and ``build/html/`` written by ``python -m course
run``. :func:`copy_linked` puts every file the notebooks link to beside the copies; in an HTML
folder it rewrites the copied Markdown's links to notebooks into links to their ``.html`` pages.
:func:`broken_links` lists what still does not resolve (the tests run it on both places).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from urllib.parse import unquote

# Markdown links: [text](<target with spaces>) or [text](target); HTML: href="target" / src="target"
_MD = re.compile(r"\]\(\s*(?:<([^>]+)>|([^)\s]+))")
_HTML = re.compile(r"""(?:href|src)\s*=\s*["']([^"']+)["']""")


def relative_target(link: str) -> str | None:
    """The file part of a relative link (``../X.md#a`` -> ``../X.md``); None for a URL, an anchor or
    ``mailto:``."""
    link = link.strip()
    if not link or link.startswith(("#", "/", "data:")) or re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", link):
        return None
    path = unquote(link.split("#", 1)[0].split("?", 1)[0])
    return path or None


def links_in_text(text: str, html: bool = False) -> list:
    """The relative link targets in Markdown (or, with ``html``, HTML) ``text``, in order, each
    once."""
    found = [m.group(1) for m in _HTML.finditer(text)] if html else \
        [m.group(1) or m.group(2) for m in _MD.finditer(text)] + [m.group(1) for m in _HTML.finditer(text)]
    return list(dict.fromkeys(t for t in map(relative_target, found) if t))


def file_links(path) -> list:
    """The relative link targets of one file: a notebook's Markdown cells, a ``.md`` or an ``.html``
    file."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".ipynb":
        cells = json.loads(text).get("cells", [])
        text = "\n".join("".join(c.get("source", "")) for c in cells if c.get("cell_type") == "markdown")
    return links_in_text(text, html=path.suffix in (".html", ".htm"))


def linked_files(root, rels) -> list:
    """The files (relative to ``root``) that the notebooks ``rels`` (relative to ``root``) link to,
    notebooks left out (they are copied as notebooks), each once; a link that leaves ``root`` is
    skipped."""
    root = Path(root).resolve()
    out = []
    for rel in rels:
        for target in file_links(root / rel):
            p = (root / rel).parent.joinpath(target).resolve()
            if p.suffix == ".ipynb" or not p.is_file() or root not in p.parents:
                continue
            out.append(str(p.relative_to(root)))
    return list(dict.fromkeys(out))


def as_html_links(text: str) -> str:
    """Markdown ``text`` with its relative links to ``.ipynb`` notebooks pointed at their ``.html``
    pages."""
    def fix(m):
        whole, target = m.group(0), m.group(1) or m.group(2)
        if relative_target(target) and relative_target(target).endswith(".ipynb"):
            return whole.replace(".ipynb", ".html", 1)
        return whole
    return _MD.sub(fix, text)


def copy_linked(root, rels, dest, html: bool = False) -> list:
    """Copy into ``dest`` every file the notebooks ``rels`` link to, at the same place relative to
    them.

    With ``html`` (a folder of ``.html`` pages), a copied Markdown file's links to notebooks point
    at their pages. Returns the copied paths (relative to ``dest``). The files are the course's, not
    the learner's: they are refreshed on every call.
    """
    root, dest = Path(root), Path(dest)
    copied = []
    for rel in linked_files(root, rels):
        text = (root / rel).read_bytes()
        if html and rel.endswith(".md"):
            text = as_html_links(text.decode("utf-8")).encode("utf-8")
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).write_bytes(text)
        copied.append(rel)
    return copied


def broken_links(folder, suffixes=(".ipynb", ".md", ".html")) -> list:
    """Every relative link under ``folder`` (in files with these suffixes) whose target does not
    exist there, as ``(file relative to folder, link target)``; checkpoints and hidden folders are
    skipped."""
    folder = Path(folder)
    bad = []
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder)
        if path.suffix not in suffixes or not path.is_file() or any(p.startswith(".") for p in rel.parts):
            continue
        for target in file_links(path):
            if not path.parent.joinpath(target).exists():
                bad.append((str(rel), target))
    return bad
