"""Worker functions written in a notebook cell, sent to the worker processes as source.

A spawned process imports the function it runs by name, and a function defined in a notebook cell
(``__main__`` in the kernel, or the module :func:`course.core.cells.load` made for ``course bench``)
has no module a child can import. :func:`portable` therefore reads the function's source
(``inspect.getsource``: IPython and :mod:`course.core.cells` register every cell's lines with
:mod:`linecache`) and returns a :class:`CellWorker`, a small picklable object that each child runs:
it compiles the source under the cell's own file name and line numbers (so a traceback shows the
cell's lines), then calls the function. The cell as the learner last ran it is what every rank runs.

A child sees the function's source and nothing else from the cell, so a cell worker imports what it
uses inside its own body. :func:`portable` checks that before any process starts: a global name that
is neither imported in the body nor a builtin is refused with a message that names it.
"""
from __future__ import annotations

import builtins
import dataclasses
import dis
import inspect
import linecache
import sys
import textwrap
import types


@dataclasses.dataclass(frozen=True)
class CellWorker:
    """A worker function carried as source: ``name``, its ``source`` (padded to its line numbers),
    its file name."""

    name: str
    source: str
    filename: str

    def load(self):
        """The function, compiled from :attr:`source` in a fresh namespace (its lines registered
        for tracebacks)."""
        lines = self.source.splitlines(True)
        linecache.cache[self.filename] = (len(self.source), None, lines, self.filename)
        namespace = {"__name__": f"course_cell_worker_{self.name}"}
        exec(compile(self.source, self.filename, "exec"), namespace)  # noqa: S102 - a cell's
        return namespace[self.name]

    def __call__(self, ctx, **kwargs):
        return self.load()(ctx, **kwargs)


def importable(fn) -> bool:
    """True when a spawned child can import ``fn`` by name (a top-level function of a real,
    importable module)."""
    mod = sys.modules.get(getattr(fn, "__module__", None) or "")
    return (mod is not None and fn.__module__ != "__main__"
            and getattr(mod, "__spec__", None) is not None
            and "<locals>" not in getattr(fn, "__qualname__", "<locals>")
            and getattr(mod, fn.__name__, None) is fn)


def global_names(code) -> set:
    """Every global name ``code`` (and the functions and lambdas nested in it) reads."""
    names = {i.argval for i in dis.get_instructions(code) if i.opname == "LOAD_GLOBAL"}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= global_names(const)
    return names


def portable(fn):
    """``fn`` itself when a child can import it (or it is not a plain function), else a
    :class:`CellWorker` carrying its source.

    Refuses (ValueError, saying what to change) what cannot travel as source: a lambda, a function
    that uses variables of an enclosing function, a decorated function, one whose source cannot be
    read, and one that uses a global name (a module, a helper of the cell) it does not import or
    define inside its own body.
    """
    if importable(fn) or not isinstance(fn, types.FunctionType):
        return fn  # a function of a module, or a picklable callable (a partial): sent as it is
    name = fn.__name__
    if name == "<lambda>":
        raise ValueError("a worker must be a function defined with `def ...(ctx, ...)` at the top "
                         "of a cell or of a module in `course`, not a lambda: spawned workers run "
                         "it from its source")
    if fn.__code__.co_freevars:
        raise ValueError(f"worker {name!r} uses {sorted(fn.__code__.co_freevars)} of the function "
                         "it is defined in; define it at the top of the cell (or of a module in "
                         "`course`) and pass values as arguments")
    try:
        lines, first = inspect.getsourcelines(fn)
    except (OSError, TypeError) as e:
        raise ValueError(f"the source of worker {name!r} cannot be read ({e}); define it in a "
                         "notebook cell or in a module in `course`") from e
    source = textwrap.dedent("".join(lines))
    if source.lstrip().startswith("@"):
        raise ValueError(f"worker {name!r} is decorated; each rank runs the function from its "
                         "source, undecorated: remove the decorator")
    missing = sorted(n for n in global_names(fn.__code__) - set(dir(builtins)) if n != name)
    if missing:
        raise ValueError(f"worker {name!r} uses {', '.join(missing)} without importing or "
                         "defining it inside its own body. Each rank runs the worker in a fresh "
                         "process that sees only the function: put the imports (e.g. `import "
                         "torch`) at the top of its body")
    return CellWorker(name, "\n" * (first - 1) + source, fn.__code__.co_filename)
