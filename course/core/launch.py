"""Start N worker processes, run one function in each, collect what they return: never hang.

:func:`plan` follows the course's one runtime decision: on the GPU path with 2 or more GPUs, NCCL
with one process per GPU; otherwise gloo on the CPU (2 processes unless asked for more).
:func:`launch` starts the processes with multiprocessing *spawn* (safe inside a notebook kernel; a
worker function written in a notebook cell travels to each process as its source,
:mod:`~course.core.cell_workers`), sets up ``torch.distributed`` in each, calls ``fn(ctx,
**kwargs)``, and returns the results in rank order. Every run has a hard time limit: when it passes,
every worker is killed and :class:`WorkerTimeout` names the ranks that had not answered. A worker
that raises makes :class:`WorkerError` name its rank and carry its message; the others are killed.

Teardown: after CUDA graphs that hold NCCL work, ``destroy_process_group()`` has been seen to hang.
Workers therefore free their graphs before returning (the worker functions do), and the launcher
synchronizes the GPU before tearing down; a worker still tearing down after its result arrived is
killed after a short grace period (the result is kept).

Stopping: a worker dies with the process that launched it
(:func:`~course.core.reaper.die_with_parent`), so a kernel or script that is killed leaves no rank
behind; workers still alive when the launcher's Python exits are killed then (atexit). When several
ranks fail, the rank whose own error caused the others' (gloo's "Connection closed by peer", a
time-out: :func:`~course.core.agree.knock_on`) is named as the cause, whatever order they came in.
"""
from __future__ import annotations

import atexit
import dataclasses
import datetime
import gc
import multiprocessing as mp
import os
import queue as _queue
import socket
import time
import traceback

from course.core.agree import knock_on
from course.core.reaper import die_with_parent
from course.core.runtime import ENV_CACHE, ENV_FORCE, gpu_count, runtime
from course.core.cell_workers import portable
from course.core.isolate import env_set

TEARDOWN_GRACE_S = 10.0
_LIVE: set = set()  # worker processes of launches under way in this process (killed at exit)


@atexit.register
def _kill_live() -> None:
    for proc in list(_LIVE):
        if proc.is_alive():
            proc.kill()


class WorkerError(RuntimeError):
    """A worker process failed; the message names its rank and says what happened."""

    def __init__(self, message: str, ranks=(), first=None):
        super().__init__(message)
        self.ranks = tuple(ranks)  # every rank that failed (or, for a timeout, had not answered)
        self.first = first  # the rank at fault (the others' errors: its knock-on)


class WorkerTimeout(WorkerError):
    """The run passed its time limit; every worker was killed. ``ranks``: those that had not
    answered."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """How a multi-process run is laid out: backend, number of processes, device kind, and why."""

    backend: str  # "nccl" or "gloo"
    world_size: int
    device_type: str  # "cuda" (one GPU per process) or "cpu"
    reason: str

    @property
    def gpus(self) -> int:
        """GPUs the run uses (0 for gloo on the CPU)."""
        return self.world_size if self.backend == "nccl" else 0

    def describe(self) -> str:
        """One line for notebooks: backend, processes, why."""
        return (f"{self.backend} with {self.world_size} processes on {self.device_type}: "
                f"{self.reason}")


@dataclasses.dataclass(frozen=True)
class Context:
    """What a worker function gets: its rank, the world size, the backend and its device."""

    rank: int
    world_size: int
    backend: str
    device: str  # "cuda:<rank>" or "cpu"
    queue: object = dataclasses.field(default=None, repr=False, compare=False)

    def say(self, text: str) -> None:
        """Tell the launcher what this rank is doing now; a timeout reports each silent rank's last
        words."""
        if self.queue is not None:
            self.queue.put((self.rank, "note", str(text)))

    @property
    def torch_device(self):
        """``torch.device(self.device)``."""
        import torch
        return torch.device(self.device)


def device_mesh(ctx, group=None):
    """A 1-D DeviceMesh over every rank of the launch, or over ``group``'s ranks (a subgroup), on
    this rank's device (inside a worker: lesson 05's DTensor lookups and lesson 08's
    ``parallelize_module`` split both use it)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    dev = ctx.torch_device.type
    if group is None:
        return init_device_mesh(dev, (ctx.world_size,))
    return DeviceMesh.from_group(group, dev)


def plan(world_size: int | None = None, backend: str | None = None) -> Plan:
    """The layout of a run. Default: NCCL on every GPU when there are 2 or more, else gloo with 2
    processes."""
    n = gpu_count()
    if backend not in (None, "nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl', 'gloo' or None (choose for me), got {backend!r}")
    if world_size is not None and (type(world_size) is not int or world_size < 1):
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if backend is None:
        backend = "nccl" if n >= 2 else "gloo"
    if backend == "nccl":
        if n < 2:
            raise ValueError(f"NCCL needs 2 or more GPUs on the GPU path; this machine has {n} "
                             "usable. Use backend='gloo' (CPU processes) instead.")
        ws = world_size or n
        if ws > n:
            raise ValueError(f"world_size={ws} needs {ws} GPUs (one process per GPU); this "
                             f"machine has {n}. Use world_size <= {n}, or backend='gloo' to run "
                             f"{ws} CPU processes.")
        return Plan("nccl", ws, "cuda", f"{n} GPUs on the GPU path: one process per GPU")
    why = (f"{runtime().device_name}; " if not runtime().on_gpu else f"{n} GPU(s), fewer than 2; ")
    return Plan("gloo", world_size or 2, "cpu", why + "CPU processes talk over gloo")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_env(p: Plan):
    """gloo workers run the course's CPU path (simulator), even when the parent is on a GPU; one
    thread each."""
    values = {"OMP_NUM_THREADS": "1"}
    if p.backend == "gloo" and runtime().on_gpu:
        values.update({ENV_FORCE: "sim", ENV_CACHE: None})
    return env_set(values)


def _entry(rank: int, p: Plan, port: int, fn, kwargs: dict, q, pg_timeout_s: float,
           parent: int = 0) -> None:
    """Body of one worker process."""
    die_with_parent(parent or None)
    try:
        import torch  # only now: the rank dies with its parent even while torch loads
        import torch.distributed as dist

        if p.backend == "nccl":
            torch.cuda.set_device(rank)
            from course.core.runtime import cuda
            cuda().select_device(rank)  # Numba launches on this rank's GPU too
            device = f"cuda:{rank}"
        else:
            torch.set_num_threads(1)
            device = "cpu"
        dist.init_process_group(p.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=p.world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        result = fn(Context(rank, p.world_size, p.backend, device, q), **kwargs)
        q.put((rank, "ok", result))
    except BaseException as e:  # noqa: BLE001 - report everything to the parent, with the rank
        q.put((rank, "error", f"{type(e).__name__}: {e}", traceback.format_exc(limit=6)))
        return  # no teardown: the parent kills the others, which may be stuck in a collective
    gc.collect()  # graphs the worker dropped are freed now, before the process group goes
    if p.backend == "nccl":
        torch.cuda.synchronize()
    dist.destroy_process_group()


def cause(errors: dict) -> int:
    """The rank whose error caused the others': the first (in arrival order) whose message is not a
    knock-on (a lost peer, a time-out, :func:`~course.core.agree.knock_on`); else the first to
    report."""
    return next((r for r, (m, _) in errors.items() if not knock_on(m)), next(iter(errors)))


def launch(fn, world_size: int | None = None, *, backend: str | None = None, timeout: float = 120.0,
           pg_timeout: float | None = None, **kwargs) -> list:
    """Run ``fn(ctx, **kwargs)`` in ``world_size`` processes (see :func:`plan`); return results by
    rank.

    ``fn``: a function defined at the top of a module of ``course`` or of a notebook cell (sent to
    the workers as source, :func:`~course.core.cell_workers.portable`); it returns something
    picklable. ``timeout``: hard limit in seconds for the whole run; past it every worker is killed
    and :class:`WorkerTimeout` is raised. ``pg_timeout``: the process group's own timeout for one
    collective (default: the run's limit).
    """
    p = plan(world_size, backend)
    fn = portable(fn)  # a function of a notebook cell travels as its source
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = []
    with _child_env(p):
        for rank in range(p.world_size):
            args = (rank, p, port, fn, kwargs, q, pg_timeout or timeout, os.getpid())
            proc = ctx.Process(target=_entry, args=args, name=f"course-rank{rank}", daemon=True)
            proc.start()
            procs.append(proc)
            _LIVE.add(proc)
    results, errors, notes = {}, {}, {}
    deadline = time.monotonic() + timeout
    error_deadline = None
    try:
        while len(results) + len(errors) < p.world_size:
            now = time.monotonic()
            if now > deadline or (error_deadline and now > error_deadline):
                break
            try:
                msg = q.get(timeout=0.2)
            except _queue.Empty:
                for rank, proc in enumerate(procs):  # a worker that died without a word
                    if rank not in {**results, **errors} and proc.exitcode not in (None, 0):
                        errors[rank] = (f"the process died with exit code {proc.exitcode} before "
                                        "reporting", "")
                        error_deadline = error_deadline or time.monotonic() + 2.0
                continue
            if msg[1] == "note":
                notes[msg[0]] = msg[2]
            elif msg[1] == "ok":
                results[msg[0]] = msg[2]
            else:
                errors[msg[0]] = (msg[2], msg[3])
                error_deadline = error_deadline or time.monotonic() + 2.0  # the others' reports
    finally:
        finished = len(results) == p.world_size  # all answered: let them tear down; else kill now
        grace = time.monotonic() + (TEARDOWN_GRACE_S if finished else 0.5)
        for proc in procs:
            proc.join(timeout=max(0.0, grace - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
            _LIVE.discard(proc)
        q.close()
    if errors:
        first = cause(errors)
        lines = "\n".join(f"rank {r}: {m}" + ("  (a knock-on: this rank lost its peer)"
                                                if r != first and knock_on(m) else "")
                          for r, (m, _) in errors.items())
        raise WorkerError(f"{p.backend} run with {p.world_size} processes failed first on rank "
                          f"{first}: {errors[first][0]}\nfailed rank(s) {sorted(errors)}, in the "
                          f"order they reported:\n{lines}\n-- traceback of rank {first}:\n"
                          f"{errors[first][1]}", ranks=sorted(errors), first=first)
    missing = [r for r in range(p.world_size) if r not in results]
    if missing:
        words = "".join(f"\n  rank {r}'s last words: {notes[r]}" for r in missing if r in notes)
        raise WorkerTimeout(f"{p.backend} run with {p.world_size} processes passed its time limit "
                            f"of {timeout:.0f} s; rank(s) {missing} had not answered (waiting in "
                            "a collective the others never joined?). Every worker was "
                            f"killed.{words}", ranks=missing)
    return [results[r] for r in range(p.world_size)]
