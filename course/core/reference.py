"""Registered experiments and the reference results recorded for them on a real GPU.

An experiment is a function decorated with :func:`experiment` that returns a
:class:`~course.core.results.Result`. Notebooks call :func:`run`: on the GPU path a GPU
experiment runs live; on the simulator path it is loaded from
``course/reference/<name>.json``. Those files are written only by
``python -m course bench`` on a GPU (:func:`bench`), never by hand; each carries a
checksum that :class:`~course.core.results.Result` verifies when it loads.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import contextlib
import os
from pathlib import Path

from course.core.results import Result
from course.core.runtime import gpu_count, runtime

REFERENCE_DIR = Path(__file__).resolve().parent.parent / "reference"
# COURSE_FULL=1: notebooks run their heavy variants live too (torch.compile, fresh processes)
ENV_FULL = "COURSE_FULL"

# The course map (course/tools/catalog.py) lists, beside each notebook, the modules that define its
# experiments. The toolkit names only the map, and only as a string: core imports no lesson.
COURSE_MAP = "course.tools.catalog"


@dataclasses.dataclass(frozen=True)
class Experiment:
    """A registered experiment."""

    name: str
    fn: object
    gpu_only: bool
    quick: dict  # keyword arguments for a fast live run (used by tests and the CPU path)
    gpus: int = 1  # GPUs a live run needs (2 or more: a multi-GPU experiment, one process per GPU)


_REGISTRY: dict = {}
# True while cells are read out of an answer version: a registration already made wins
_KEEP = [False]
_CELLS_LOADED: set = set()


@contextlib.contextmanager
def keeping_registered():
    """While active, :func:`experiment` leaves a name that is already registered as it is.

    :func:`course.core.cells.load` reads an answer version's experiment cells under it, so an
    experiment the notebook (or a learner's edit of its cell) registered first is the one
    :func:`run` measures.
    """
    old, _KEEP[0] = _KEEP[0], True
    try:
        yield
    finally:
        _KEEP[0] = old


def experiment(name: str, *, gpu_only: bool = True, quick: dict | None = None, gpus: int = 1):
    """Register ``fn(**params) -> Result`` under ``name``.

    ``gpu_only`` experiments need a real GPU; on the simulator path :func:`run` loads
    their reference result instead. ``quick`` gives small parameters for smoke tests.
    ``gpus``: how many GPUs a live run needs; a machine with fewer loads the reference.
    """
    if gpus < 1 or (gpus > 1 and not gpu_only):
        raise ValueError(f"experiment {name!r}: gpus={gpus} needs gpu_only=True and gpus >= 1")
    def deco(fn):
        if _KEEP[0] and name in _REGISTRY:
            return fn
        if name in _REGISTRY and _REGISTRY[name].fn.__qualname__ != fn.__qualname__:
            raise ValueError(f"experiment {name!r} is registered twice")
        _REGISTRY[name] = Experiment(name, fn, gpu_only, dict(quick or {}), int(gpus))
        return fn
    return deco


def experiment_modules() -> tuple:
    """The modules that define experiments, as the course map lists them (:data:`COURSE_MAP`)."""
    return tuple(importlib.import_module(COURSE_MAP).experiment_modules())


def experiment_notebooks() -> tuple:
    """The answer versions whose cells hold experiments (tagged ``experiment``), as the course map
    lists them."""
    return tuple(importlib.import_module(COURSE_MAP).experiment_notebooks())


def load_all() -> dict:
    """Import every experiment module the course map lists, read every experiment cell, return the
    registry.

    A listed module that does not exist is an error that names it and the map, never a silent skip:
    its experiments would otherwise vanish from ``course bench`` and the notebooks would find no
    reference for them.
    """
    for mod in experiment_modules():
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name != mod and not mod.startswith(f"{e.name}."):
                raise  # the module exists but imports something missing: that error says what
            raise ModuleNotFoundError(
                f"the course map ({COURSE_MAP.replace('.', '/')}.py) lists {mod!r} "
                "as a module with experiments, and there is no such module: "
                "correct the `experiments` of its entry there (or restore the module)",
                name=mod) from e
    from course.core import cells

    for path in experiment_notebooks():
        if str(path) not in _CELLS_LOADED:
            if not Path(path).exists():
                raise FileNotFoundError(f"the course map ({COURSE_MAP.replace('.', '/')}.py) "
                                        f"lists {path} as holding experiment cells, and there "
                                        "is no such notebook")
            cells.load(path, guard=keeping_registered)
            _CELLS_LOADED.add(str(path))
    return dict(_REGISTRY)


def get(name: str) -> Experiment:
    """The registered experiment called ``name``."""
    if name not in _REGISTRY:
        load_all()
    if name not in _REGISTRY:
        raise KeyError(f"no experiment called {name!r}; known: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def reference_path(name: str) -> Path:
    """Where the reference result for ``name`` lives."""
    return REFERENCE_DIR / f"{name}.json"


def load_reference(name: str) -> Result:
    """The reference result recorded on a GPU for ``name``; a clear error if there is none."""
    path = reference_path(name)
    if not path.exists():
        raise FileNotFoundError(
            f"No reference data for {name!r} yet ({path}). It is recorded on a GPU with "
            "`python -m course bench`; on this machine the experiment cannot run live.")
    return Result.from_dict(json.loads(path.read_text()))


def run(name: str, **params) -> Result:
    """Run ``name`` live when this machine can, else load the GPU reference result.

    GPU path: live, unless the experiment needs more GPUs than the machine has.
    Simulator path: live for experiments that are not GPU-only, reference data for
    GPU-only ones (the returned result says so in ``source`` and in its caption).
    """
    exp = get(name)
    if exp.gpu_only and (not runtime().on_gpu or gpu_count() < exp.gpus):
        res = load_reference(name)
        if runtime().on_gpu:  # a GPU, but too few of them: say so (not "no usable GPU")
            res.source = (f"reference: this machine has {gpu_count()} "
                          f"GPU(s) and the experiment needs {exp.gpus}")
        return res
    res = exp.fn(**params)
    if not isinstance(res, Result):
        raise TypeError(f"experiment {name!r} returned {type(res).__name__}, not a Result")
    return res


def available(name: str) -> bool:
    """True when :func:`run` gives a result for ``name`` here: it runs live on this machine, or a
    GPU recorded it.

    False for a GPU experiment that awaits its first recording on a simulator-path machine; a
    notebook then says so instead of showing a result.
    """
    exp = get(name)
    live = not exp.gpu_only or (runtime().on_gpu and gpu_count() >= exp.gpus)
    return live or reference_path(name).exists()


def full_run() -> bool:
    """True when ``COURSE_FULL=1`` (or "true"/"yes"): a notebook then runs its heavy experiments
    live on a GPU.

    Without it, a notebook on the GPU path runs its light experiments live and shows the heavy ones
    (torch.compile variants, one fresh process per variant) from reference data, labelled as such.
    """
    return os.environ.get(ENV_FULL, "").strip().lower() in ("1", "true", "yes")


def heavy(name: str, full: bool | None = None, **params) -> Result:
    """A heavy experiment: live where :func:`run` would run it and :func:`full_run` is on (``full``
    overrides it), else recorded, with a caption naming ``COURSE_FULL=1``. ``course bench`` records
    it full."""
    exp = get(name)
    live_here = not exp.gpu_only or (runtime().on_gpu and gpu_count() >= exp.gpus)
    if exp.gpu_only and live_here and not (full_run() if full is None else full):
        res = load_reference(name)
        res.source = ("reference: the full run takes minutes, so this notebook "
                      f"shows the recorded one; set {ENV_FULL}=1 to run it live here")
        return res
    return run(name, **params)


def bench_names(registry: dict, gpus: int) -> list:
    """The experiments ``course bench`` records by default on a machine with ``gpus`` GPUs.

    One GPU: the single-GPU experiments. Two or more: only the multi-GPU ones (those
    that need at most ``gpus``), leaving the single-GPU reference data alone.
    """
    if gpus < 2:
        return sorted(n for n, e in registry.items() if e.gpu_only and e.gpus == 1)
    return sorted(n for n, e in registry.items() if e.gpu_only and 2 <= e.gpus <= gpus)


def bench_skipped(registry: dict, gpus: int) -> list:
    """The GPU experiments ``course bench`` cannot record on a machine with ``gpus`` GPUs (they need
    more)."""
    return sorted(n for n, e in registry.items() if e.gpu_only and e.gpus > max(gpus, 1))


def bench(names=None, out_dir: Path | None = None, quick: bool = False, log=print) -> list:
    """Run GPU experiments on a real GPU and write their reference JSON files.

    Refuses on the simulator path: reference data must come from a GPU. Without
    ``names`` it records :func:`bench_names` for this machine's GPU count.
    Returns the list of files written.
    """
    rt = runtime()
    if not rt.on_gpu:
        raise RuntimeError("`course bench` writes reference data "
                           f"and needs a real GPU. {rt.reason} "
                           + (f"Fix: {rt.fixes[0]}" if rt.fixes else ""))
    reg = load_all()
    n_gpus = gpu_count()
    names = list(names) if names else bench_names(reg, n_gpus)
    unknown = [n for n in names if n not in reg]
    if unknown:
        raise KeyError(f"unknown experiments {unknown}; known: {sorted(reg)}")
    short = [n for n in names if reg[n].gpus > n_gpus]
    if short:
        raise RuntimeError(f"{short} need {max(reg[n].gpus for n in short)} GPUs; this "
                           f"machine has {n_gpus}. Record them on a multi-GPU machine.")
    log(f"bench: this machine has {n_gpus} GPU(s); recording {names}")
    unreachable = bench_skipped(reg, n_gpus)
    if unreachable:
        log(f"bench: not recorded here (they need more GPUs than this machine has): {unreachable}")
    out_dir = Path(out_dir or REFERENCE_DIR)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for n in names:
        exp = reg[n]
        log(f"bench: {n} ...")
        res = exp.fn(**(exp.quick if quick else {}))
        res.params = {**res.params, "quick": quick}
        path = out_dir / f"{n}.json"
        path.write_text(json.dumps(res.to_dict(), indent=1, default=str) + "\n")
        log(f"bench: wrote {path}")
        written.append(path)
    return written
