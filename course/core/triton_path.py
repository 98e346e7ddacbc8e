"""The course's one Triton decision: compiled for the GPU, or run by Triton's interpreter on the
CPU.

It follows the runtime decision (:mod:`course.core.runtime`): on the GPU path Triton kernels are
compiled and launched on the GPU; on the simulator path (a laptop) they run under Triton's
**interpreter** (``TRITON_INTERPRET=1``), which executes each program of a kernel with NumPy on CPU
tensors: the same kernel source, checked against eager PyTorch on small shapes, in seconds.

Triton reads ``TRITON_INTERPRET`` as it is imported (its own library of kernel helpers, ``tl.sum``
and the like, is decorated then) and importing transformers' Llama imports Triton. So the variable
is set by the runtime decision itself (:func:`course.core.runtime.prepare_triton`, the moment it
decides: ``import course; course.header()``, or anything that asks ``runtime()``), before a model is
built. :func:`triton` returns the module and refuses, with the fix, a Triton imported earlier in the
other mode. Triton is a Linux package (torch's CUDA builds bring it; pyproject declares it for
Linux): where it is missing, :func:`missing_reason` says why and the lessons show recorded data
instead.
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
