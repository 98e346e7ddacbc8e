"""Experiments whose code stands in a notebook cell (tagged ``experiment`` in the answer version),
and the one place that reads them out of it.

Running the cell registers the function; ``reference.run(name)`` then measures it live on a GPU (or
loads the recording on a laptop). ``course bench`` and the tests read the same cell (:func:`load`),
so the recording and the cell are one source; a definition made in the notebook wins over the
file's.
"""
from __future__ import annotations

import contextlib
import json
import linecache
import sys
import types
from pathlib import Path

TAG = "experiment"


def tagged_cells(path) -> list:
    """``[(index, source), ...]``: the code cells of the notebook at ``path`` tagged :data:`TAG`, in
    order."""
    nb = json.loads(Path(path).read_text(encoding="utf-8"))
    out = []
    for i, cell in enumerate(nb.get("cells", [])):
        tags = cell.get("metadata", {}).get("tags", [])
        if cell.get("cell_type") == "code" and TAG in tags:
            src = cell["source"]
            out.append((i, "".join(src) if isinstance(src, list) else src))
    return out


def module_name(path) -> str:
    """The name the cells of ``path`` run under: ``course_cells.<notebook stem>`` (a module of its
    own)."""
    stem = Path(path).stem.replace("-", "_")
    return f"course_cells.nb_{stem}"


def load(path, guard=contextlib.nullcontext) -> types.ModuleType:
    """Run the tagged cells of the notebook at ``path`` in a fresh module (each cell's lines in
    :mod:`linecache`, each under ``guard()``); return it. A failing cell names the notebook and
    cell."""
    path = Path(path)
    mod = types.ModuleType(module_name(path))
    mod.__file__ = str(path)
    sys.modules[mod.__name__] = mod
    for index, src in tagged_cells(path):
        filename = f"{path}#cell{index}"
        linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
        try:
            code = compile(src, filename, "exec")
            with guard():
                exec(code, mod.__dict__)  # noqa: S102 - the course's own answer version, by design
        except Exception as e:
            raise RuntimeError(f"the experiment cell {index} of {path.name} failed to load: "
                               f"{type(e).__name__}: {e}") from e
    return mod
