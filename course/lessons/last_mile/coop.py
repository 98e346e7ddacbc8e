"""The laptop's way to run a kernel with grid barriers: Triton's interpreter, the programs as
co-operating threads.

The interpreter runs a kernel's programs one after another, each to its end: the first program to
spin at a grid barrier would wait forever for programs that have not started. :func:`run` runs
the same interpreted kernel with each program in a thread of its own, **one at a time**, switching
at atomics (:data:`SCHEDULES`): ``"turns"`` switches to the next live program at every atomic, so
each program runs a whole stage between two barriers; ``"ahead"`` lets a program run on until it
spins (two atomics in a row that change nothing), so the first one reaches the next stage before
the others have written: a barrier that does not wait shows there. The kernel's own barrier code
runs unchanged (its atomics really add and compare): a barrier with a wrong count never opens here
either, and the kernel's spin limit ends the wait, as on the GPU.

**Which reads were ordered after their writes** (:class:`Trace`): every load and store of a
``watch``-ed buffer is recorded with its program's vector clock (its releases, and what it learned
of the others' through acquires: ``sem="release"``, ``"acquire"``, ``"acq_rel"``). A read of
another program's write that no release/acquire chain orders after it is a race (so is a write
over another program's unordered read or write), whatever order the threads happened to run in.

Not modelled: time; the GPU's weaker orders (one program runs at a time, so every write is seen at
once: L1 caches, reordered loads and ``sem`` on a plain load are not simulated); co-residency
(every program here is resident); what registers carried across a barrier cost.
"""
from __future__ import annotations

import dataclasses
import inspect
import threading

import numpy as np

SCHEDULES = ("turns", "ahead")  # switch at every atomic; or run on until spinning (module doc)


@dataclasses.dataclass
class Race:
    """One unordered pair of accesses to an element of a watched buffer."""

    buffer: str
    index: int
    kind: str  # "read before its write", "write over an unordered read", "two unordered writes"
    program: int  # the program that made the second access
    other: int  # the program whose access it is not ordered with
    atomics: int = 0  # atomics the reader (for two writes, the writer) had made before: 0, none

    @property
    def reader(self) -> int:
        """The program whose read is unordered (for two unordered writes: the second writer)."""
        return self.other if self.kind == "write over an unordered read" else self.program

    def __str__(self) -> str:
        at, p, o = f"{self.buffer}[{self.index}]", self.program, self.other
        return {"read before its write": f"program {p} read {at} without waiting for program {o}'s "
                                         "write of it",
                "write over an unordered read": f"program {o} read {at} before program {p} wrote "
                                                "it, with nothing ordering the two",
                "two unordered writes": f"programs {o} and {p} both wrote {at} with nothing "
                                        "ordering the writes"}[self.kind]


@dataclasses.dataclass
class Trace:
    """What :func:`run` saw: races on watched buffers (the first ``limit``), atomics per program,
    switches, a deadlock (two rounds of atomics of every live program that changed nothing), and
    ``reads``: ``{buffer: [(atomics before the first read, before the last), ...per program]}``."""

    races: list
    atomics: list
    switches: int
    deadlock: bool = False
    reads: dict = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True when no watched element was read or written out of order."""
        return not self.races


class _Clocks:
    """Vector clocks of the programs and of the atomics' addresses; the last accesses of watched
    elements."""

    def __init__(self, n: int, watch: dict, limit: int):
        self.n, self.limit = n, limit
        self.now = [0] * n  # atomics each program has made so far
        self.reads = {name: [[None, None] for _ in range(n)] for name in watch}
        self.vc = np.eye(n, dtype=np.int64) + 0  # program p's clock: vc[p]; its epoch vc[p, p]
        self.sync: dict = {}
        self.races: list = []
        self.bufs = []
        for name, t in watch.items():
            size = t.element_size()
            first = t.data_ptr()
            count = t.untyped_storage().nbytes() // size - t.storage_offset()
            m = t.numel()
            self.bufs.append((name, first, size, min(count, m), np.full(m, -1, np.int64),
                              np.zeros(m, np.int64), np.zeros((n, m), np.int64),
                              np.zeros((n, m), np.int64)))

    def atomic(self, p: int, addrs, sem: str) -> None:
        for a in np.unique(np.asarray(addrs).ravel()):
            a = int(a)
            if sem in ("ACQUIRE", "ACQUIRE_RELEASE") and a in self.sync:
                self.vc[p] = np.maximum(self.vc[p], self.sync[a])
            if sem in ("RELEASE", "ACQUIRE_RELEASE"):
                self.sync[a] = np.maximum(self.sync.get(a, 0), self.vc[p])
        if sem in ("RELEASE", "ACQUIRE_RELEASE"):
            self.vc[p, p] += 1

    def access(self, p: int, addrs, mask, write: bool) -> None:
        a = np.asarray(addrs).ravel().astype(np.int64)
        if mask is not None:
            a = a[np.broadcast_to(np.asarray(mask), np.asarray(addrs).shape).ravel().astype(bool)]
        me = self.vc[p]
        for name, first, size, count, writer, wepoch, reads, read_at in self.bufs:
            i = (a - first) // size
            i = i[(a >= first) & (i < count)]
            if not i.size:
                continue
            if not write:
                seen = self.reads[name][p]
                seen[0] = self.now[p] if seen[0] is None else seen[0]
                seen[1] = self.now[p]
            w = writer[i]
            bad = (w >= 0) & (w != p) & (me[np.maximum(w, 0)] < wepoch[i])
            kind = "two unordered writes" if write else "read before its write"
            self._report(name, i[bad], w[bad], kind, p, np.full(len(i), self.now[p])[bad])
            if write:
                r = reads[:, i]
                unordered = (r > 0) & (me[:, None] < r)
                unordered[p] = False
                hit = unordered.any(axis=0)
                who = unordered[:, hit].argmax(axis=0)
                self._report(name, i[hit], who, "write over an unordered read", p,
                             read_at[who, i[hit]])
                writer[i], wepoch[i], reads[:, i] = p, me[p], 0
            else:
                reads[p, i], read_at[p, i] = me[p], self.now[p]

    def _report(self, name, idx, others, kind, p, atomics) -> None:
        for i, o, a in zip(idx[: self.limit], others[: self.limit], atomics[: self.limit]):
            if len(self.races) < self.limit:
                self.races.append(Race(name, int(i), kind, p, int(o), int(a)))


class _Abort(BaseException):
    """Ends a program's thread when another program failed."""


def run(kernel, grid: int, *args, watch: dict | None = None, limit: int = 20,
        schedule: str = "turns", **kwargs) -> Trace:
    """Run the interpreted ``kernel`` over ``grid`` programs as co-operating threads (module doc).

    ``watch``: ``{name: tensor}`` whose accesses are checked for order (at most ``limit`` races);
    ``schedule``: one of :data:`SCHEDULES`. A program's exception is raised here, naming the
    program; a deadlock ends the run with ``Trace.deadlock`` set.
    """
    from triton.runtime import interpreter as I

    if not isinstance(kernel, I.InterpretedFunction):
        raise TypeError("coop.run runs a kernel under Triton's interpreter (the laptop path); on a "
                        "GPU launch it")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, not {schedule!r}")
    fn = kernel.rewrite()
    ex = I.GridExecutor(fn, kernel.arg_names, (grid,))
    spec = inspect.getfullargspec(fn)
    kwargs = {k: v for k, v in kwargs.items() if k in spec.args}
    args_hst, kwargs_hst = ex._init_args_hst(args, kwargs)
    b = I.interpreter_builder
    clocks = _Clocks(grid, watch or {}, limit)
    state = {"turn": 0, "alive": set(range(grid)), "error": None, "switches": 0, "idle": 0,
             "deadlock": False}
    still = [0] * grid  # each program's atomics in a row that changed nothing
    cv = threading.Condition()
    saved = {k: getattr(b, k) for k in ("create_atomic_rmw", "create_atomic_cas",
                                        "create_masked_load", "create_masked_store")}

    def me() -> int:
        return b.grid_idx[0]

    def wait_turn(p: int) -> None:
        with cv:
            cv.wait_for(lambda: state["turn"] == p or state["error"] is not None)
            if state["error"] is not None:
                raise _Abort()
        b.set_grid_idx(p, 0, 0)

    def pass_on(p: int, done: bool = False) -> None:
        with cv:
            if done:
                state["alive"].discard(p)
            live = sorted(state["alive"])
            if live:
                later = [q for q in live if q > p]
                state["turn"] = later[0] if later else live[0]
                state["switches"] += state["turn"] != p
            else:
                state["turn"] = -1
            cv.notify_all()

    # the interpreter's load takes (ptrs, mask, other, <cache hints>, is_volatile): Triton 3.6 has
    # two cache hints (cache_modifier, eviction_policy), 3.9 one (cache_policy): count them
    hints = len(inspect.signature(saved["create_masked_load"]).parameters) - 4

    def peek(ptr):
        mask = I.TensorHandle(np.ones_like(ptr.data, dtype=bool), I.tl.int1)
        return saved["create_masked_load"](ptr, mask, None, *([None] * hints), True).data

    def changed(ptr, before) -> bool:
        return not np.array_equal(peek(ptr), before)

    def step(p: int, progress: bool) -> None:
        """After an atomic or a volatile load: a deadlock (two rounds of atomics of every live
        program that changed nothing), else the turn passed on as the schedule says."""
        state["idle"] = 0 if progress else state["idle"] + 1
        if state["idle"] > 2 * len(state["alive"]) + 2:
            with cv:
                state["deadlock"] = True
                state["error"] = (p, None)
                cv.notify_all()
            raise _Abort()
        still[p] = 0 if progress else still[p] + 1
        if schedule == "turns" or still[p] >= 2:
            pass_on(p)
            wait_turn(p)

    def atomic(orig, sem_at, ptr_at):
        def wrapped(*a):
            ptr = a[ptr_at]
            before = peek(ptr).copy()
            out = orig(*a)
            p = me()
            clocks.now[p] += 1
            clocks.atomic(p, ptr.data, a[sem_at].name)
            step(p, changed(ptr, before))
            return out
        return wrapped

    def load(ptrs, mask, other, *hints_and_volatile):
        p = me()
        clocks.access(p, ptrs.data, mask.data, False)
        out = saved["create_masked_load"](ptrs, mask, other, *hints_and_volatile)
        if hints_and_volatile[-1]:  # is_volatile: a spin on a volatile load; let the others run
            step(p, False)
        return out

    def store(ptrs, value, mask, *hints):
        clocks.access(me(), ptrs.data, mask.data, True)
        state["idle"] = 0
        return saved["create_masked_store"](ptrs, value, mask, *hints)

    def program(p: int) -> None:
        try:
            wait_turn(p)
            fn(**callargs)
        except _Abort:
            return
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            with cv:
                state["error"] = (p, e)
                cv.notify_all()
            return
        pass_on(p, done=True)

    scope = I._patch_lang(fn)
    try:
        b.create_atomic_rmw = atomic(saved["create_atomic_rmw"], 4, 1)
        b.create_atomic_cas = atomic(saved["create_atomic_cas"], 3, 0)
        b.create_masked_load, b.create_masked_store = load, store
        callargs = inspect.getcallargs(fn, *args_hst, **kwargs_hst)
        callargs = {k: v if k in ex.constexprs else I._implicit_cvt(v)
                    for k, v in callargs.items()}
        b.set_grid_dim(grid, 1, 1)
        threads = [threading.Thread(target=program, args=(p,), daemon=True)
                   for p in range(grid)]
        for t in threads:
            t.start()
        with cv:
            cv.wait_for(lambda: state["turn"] == -1 or state["error"] is not None)
        for t in threads:
            t.join()
    finally:
        for k in saved:
            b.__dict__.pop(k, None)  # the class's own methods again
        scope.restore()
    if state["error"] is not None and not state["deadlock"]:
        p, e = state["error"]
        raise RuntimeError(f"program {p} of {grid} failed: {type(e).__name__}: {e}") from e
    ex._restore_args_dev(args, args_hst, kwargs, kwargs_hst)
    reads = {k: [tuple(v) for v in per] for k, per in clocks.reads.items()}
    return Trace(clocks.races, list(clocks.now), state["switches"], state["deadlock"], reads)
