"""The course's one Triton decision: compiled for the GPU, or run by Triton's interpreter on the
CPU.

It follows :mod:`course.core.runtime`: on the simulator path Triton runs under its interpreter
(``TRITON_INTERPRET=1``, set by the runtime decision before Triton is imported, since Triton reads
it then). :func:`triton` returns the module and refuses, with the fix, one imported earlier in the
other mode; where Triton is missing (it is a Linux package), :func:`missing_reason` says why.
"""
from __future__ import annotations

import importlib.util

from course.core.runtime import TRITON_ENV as ENV  # noqa: F401  (re-exported: one name for the variable)


def missing_reason() -> str:
    """Why Triton cannot be used here ("" when it can): not installed, with what to do about it."""
    if importlib.util.find_spec("triton") is None:
        return ("Triton is not installed (it ships for Linux only: `pip install "
                "triton`; on macOS or Windows the lesson shows the GPU's recorded data)")
    return ""


def available() -> bool:
    """True when Triton is installed (compiled on the GPU path, interpreted on the simulator path).
    """
    return not missing_reason()


def interpreting() -> bool:
    """True when Triton kernels run under the interpreter (the simulator path), False when compiled
    (the GPU)."""
    from course.core.runtime import runtime

    return not runtime().on_gpu


def imported_interpreting() -> bool:
    """True when the imported Triton's own helpers were built for the interpreter
    (``TRITON_INTERPRET=1``)."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.sum, InterpretedFunction)


def triton():
    """The ``triton`` module, in the mode of the runtime path (see the module doc).

    Raises ImportError naming the fix where Triton is missing, and CourseEnvironmentError where
    Triton was imported before the runtime decision, in the other mode.
    """
    from course.core.runtime import CourseEnvironmentError

    why = missing_reason()
    if why:
        raise ImportError(why)
    want = interpreting()  # decides the runtime (and sets TRITON_INTERPRET) if nothing did yet
    import triton as tr

    if imported_interpreting() != want:
        mode = "for its interpreter" if not want else "to compile for a GPU"
        raise CourseEnvironmentError(
            "Triton was imported before the course chose its runtime, "
            f"{'compiled' if want else 'interpreted'}, but this path needs it {mode}. "
            "Restart the kernel and run `import course; course.header()` first "
            "(before building a transformers model, which imports Triton).")
    return tr


def describe() -> str:
    """One sentence for a notebook: how Triton kernels run on this machine."""
    why = missing_reason()
    if why:
        return why
    return ("Triton kernels run under Triton's interpreter "
            "(CPU, NumPy): correct, not fast" if interpreting()
            else "Triton kernels are compiled for this GPU")
