"""Suite-wide pytest setup.

- Decides the course runtime once, in the pytest process, so every notebook kernel
  nbval starts inherits the decision (through the environment) instead of probing again.
- ``COURSE_PATH=cuda`` (the GPU lane, `make gpu-test`) makes the run fail at once if the
  GPU path is not available, rather than silently testing the simulator.
- Records which notebooks nbval collected, for tests/test_suite.py to compare with disk.
- Orders the run by file, heaviest units first (:func:`run_order`): every notebook before the test modules, so that
  with ``-n 2 --dist loadfile`` (pytest-xdist, ``make test``) the two workers end on short test files rather than one
  of them on a long notebook; a file's items keep their order and stay together (nbval runs a notebook's cells in
  one kernel).
- The gate (:mod:`course.tools.gate`): an answer version (solutions/) fails unless every exercise
  passed or was skipped with a reason; a learner version (notebooks/, labs/) fails on any ✗.
- Makes the lane self-contained: notebook kernels (child processes that start in the
  notebook's folder) get the project root on ``PYTHONPATH``, so they import this checkout's
  ``course`` even where it is not installed (the GPU lane); nbconvert's templates are put on
  ``JUPYTER_PATH`` when nbconvert was installed with ``pip --target`` (not under sys.prefix), by the
  same function ``course run`` uses (:func:`course.tools.render.expose_nbconvert_templates`).
- Every test module starts with graphs left in dead cycles collected (one freed by the collector inside a later
  capture breaks it), and a test that leaves a simulated capture under way fails itself, not the next test.
"""
import gc
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
pytest_plugins = ["course.tools.gate"]


def _expose_course_to_kernels() -> None:
    from course.tools.render import expose_course_to_kernels

    expose_course_to_kernels()


def pytest_configure(config):
    os.environ.setdefault("MPLBACKEND", "Agg")
    _expose_course_to_kernels()
    from course.core.runtime import CourseEnvironmentError, runtime
    try:
        rt = runtime()
    except CourseEnvironmentError as e:
        raise pytest.UsageError(str(e)) from None
    config._course_runtime = rt


def pytest_report_header(config):
    rt = getattr(config, "_course_runtime", None)
    return f"course runtime: {rt.describe()}" if rt else None


def _nbval_active(config) -> bool:
    return bool(getattr(config.option, "nbval", False) or getattr(config.option, "nbval_lax", False))


def run_order(path) -> tuple:
    """The sort key of a collected file: notebooks first (answer versions, then lessons, then labs), then the test
    modules, each group by name."""
    p = Path(str(path))
    rank = {"solutions": 0, "notebooks": 1, "labs": 2}.get(p.parent.name, 3) if p.suffix == ".ipynb" else 4
    return rank, p.name


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=lambda item: run_order(item.fspath))  # stable: a file's items keep their order
    collected = set()
    for item in items:
        path = Path(str(item.fspath))
        if path.suffix == ".ipynb":
            collected.add(path.resolve())
    config._course_nbval_active = _nbval_active(config)
    config._course_notebooks_collected = collected


@pytest.fixture(autouse=True, scope="module")
def no_garbage_graphs():
    """Graphs that earlier test files left in reference cycles are freed now, not inside a capture."""
    gc.collect()
    yield


@pytest.fixture(autouse=True)
def no_capture_left_behind():
    """After each test on the simulator: no capture under way, the default stream current again."""
    yield
    from course.core.runtime import runtime
    if not runtime().on_gpu:
        from course.sim import graph as simgraph, stream as simstream  # the simulator's path only
        left = bool(simstream._ACTIVE) or simstream.current_stream() is not simstream.default_stream()
        simgraph.end_all_captures()
        assert not left, "the test left a capture under way or a capture stream current"
