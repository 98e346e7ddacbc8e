"""Is a fast kernel the one lab 1's exercise 3 asks for? Grid-stride loop, rows of threads, loads in
flight (the rules :data:`FAST_RULES` on the course's harness).

:func:`grid_stride` launches fewer blocks than the rows need, on an output filled with NaN: rows
left unwritten are named. :func:`layout` reads the access trace (:mod:`course.embedding.access`; on
a GPU in a ``COURSE_PATH=sim`` process): each row copied once by one row of threads, thread ``tx``
copying words ``tx, tx + blockDim.x, ...``, 4 loads before the stores. Speed is judged on a GPU
only, by the lab.
"""
from __future__ import annotations

import dis
import inspect
import json
import os
import subprocess
import sys
import textwrap
import types
from collections import defaultdict

import torch
import torch.nn.functional as F

from course.core.harness import Rule, check
from course.core.runtime import as_numba, numba_stream, runtime
from course.embedding.kernels import UNROLL, as_words, launch_config, pick_word_bytes
from course.embedding.lookup import error_flag, reset_errors

BLOCKS = 2  # the capped grid: fewer blocks than the rows need, so each block must loop


def _ranges(rows: list) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2, 5 and 7-8"."""
    parts, start = [], None
    for i, r in enumerate(rows):
        if start is None:
            start = r
        if i + 1 == len(rows) or rows[i + 1] != r + 1:
            parts.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def capped_inputs(n_ids=None, vocab: int = 40, dim: int = 64, seed: int = 0):
    """(ids, weight) for the checks: float32 rows of ``dim`` values (8-byte words), ids for 3 rounds
    of the grid."""
    _, (_, y) = launch_config("fast", 1, dim // 2)
    n = n_ids or 3 * BLOCKS * y
    g = torch.Generator().manual_seed(seed)
    dev = runtime().device
    return torch.randint(0, vocab, (n,), generator=g).to(dev), torch.randn(vocab, dim, generator=g).to(dev)


def launch_capped(kernel, ids, weight, blocks: int = BLOCKS):
    """Launch ``kernel`` on 8-byte word views with the lab's (x, y) blocks but only ``blocks`` of
    them.

    The output starts as NaN, so rows the kernel never wrote stay NaN. Returns
    ``(out, (blocks, (x, y)), word_bytes)``.
    """
    flat = ids.contiguous().view(-1)
    out = torch.full((flat.numel(), weight.shape[1]), float("nan"), dtype=weight.dtype, device=weight.device)
    word = min(8, pick_word_bytes(weight.shape[1] * weight.element_size(), weight, out))
    w, o = as_words(weight, word), as_words(out, word)
    _, threads = launch_config("fast", flat.numel(), w.shape[1])
    reset_errors()
    kernel[blocks, threads, numba_stream()](as_numba(flat), as_numba(w), as_numba(o), as_numba(error_flag()))
    return out, (blocks, threads), word


def grid_stride(kernel, ids=None, weight=None) -> tuple:
    """Launch with a grid of :data:`BLOCKS` blocks for more rows than they hold: ``(problem,
    line)``, the problem ('' if none) naming the rows left unwritten (no grid-stride loop) or wrong,
    the line what was covered."""
    if ids is None or weight is None:
        ids, weight = capped_inputs()
    out, (blocks, (x, y)), _ = launch_capped(kernel, ids, weight)
    got, want = out.cpu(), F.embedding(ids, weight).cpu()
    unwritten = [r for r in range(len(got)) if bool(torch.isnan(got[r]).all())]
    grid = (f"a grid of {blocks} blocks of {y} rows (blockDim = ({x}, {y})) for {len(got)} ids, "
            f"{blocks * y} rows per round")
    wrong = [r for r in range(len(got)) if not torch.equal(got[r], want[r])]
    if unwritten:
        return (f"with {grid}, rows {_ranges(unwritten)} of the output were never written: the "
                "kernel copies only the rows of the first round. Loop over rows (a grid-stride "
                "loop): while row < out.shape[0]: ... row += cuda.gridDim.x * cuda.blockDim.y"), ""
    if wrong:
        return (f"with {grid}, rows {_ranges(wrong)} of the output are wrong "
                "or partly written (the first round is right?): check the "
                "grid-stride step, row += cuda.gridDim.x * cuda.blockDim.y"), ""
    return "", f"grid-stride loop: {grid} - every row written"


# --------------------------------------------------------------------------- the layout, from the
# access trace

def layout_problem(records, out_name: str, weight_name: str, row_bytes: int, word_bytes: int, x: int):
    """The first way a traced launch breaks the exercise's layout, in words, or None.

    ``records``: :class:`course.embedding.access.AccessTrace` records (block, thread, k, array,
    offset, nbytes, write); ``x``: blockDim.x (a thread's ``tx, ty`` is ``thread % x, thread //
    x``).
    """
    writers = defaultdict(list)  # (row, word) -> [(block, tx, ty)]
    per_thread = defaultdict(list)  # (block, thread) -> [(k, array, row, word, write)]
    for b, t, k, name, off, _, write in records:
        if name in (out_name, weight_name):
            row, word = off // row_bytes, (off % row_bytes) // word_bytes
            per_thread[(b, t)].append((k, name, row, word, write))
            if name == out_name and write and (b, t % x, t // x) not in writers[(row, word)]:
                # a thread writing a word twice is no harm
                writers[(row, word)].append((b, t % x, t // x))
    if not writers:
        return "the kernel wrote nothing to the output"
    who = lambda w: f"block {w[0]}, tx={w[1]}, ty={w[2]}"
    for (row, word), ws in sorted(writers.items()):
        if len(ws) > 1:
            if len({(b, ty) for b, _, ty in ws}) == 1:
                return (f"word {word} of row {row} was written by {len(ws)} threads of one row "
                        f"of threads ({'; '.join(who(w) for w in ws[:3])}): each thread must "
                        "copy only its own words, tx, tx + blockDim.x, tx + 2 * blockDim.x, ...")
            return (f"row {row} was copied more than once "
                    f"({'; '.join(who(w) for w in ws[:3])}): step rows by cuda.gridDim.x * "
                    "cuda.blockDim.y, so that every row is copied by one row of threads, once")
    rows = defaultdict(dict)  # row -> {word: (block, tx, ty)}
    for (row, word), ws in writers.items():
        rows[row][word] = ws[0]
    for row, words in sorted(rows.items()):
        groups = sorted({(b, ty) for b, _, ty in words.values()})
        if len(groups) > 1:
            return (f"row {row} was copied by threads of {len(groups)} different rows of "
                    f"threads (threadIdx.y {', '.join(str(ty) for _, ty in groups[:4])}): "
                    "threadIdx.y picks the row (row = cuda.blockIdx.x * cuda.blockDim.y + "
                    "cuda.threadIdx.y) and threadIdx.x the word inside it")
        txs = {tx for _, tx, _ in words.values()}
        if len(txs) == 1 and len(words) > 1 and x > 1:
            (w0,) = {w for w in words.values()}
            return (f"row {row} was copied by one thread alone ({who(w0)}), all "
                    f"{len(words)} words: a row of blockDim.x = {x} threads must "
                    "share it, thread tx copying words tx, tx + blockDim.x, ...")
        for word, (b, tx, ty) in sorted(words.items()):
            if tx != word % x:
                return (f"word {word} of row {row} was written by tx={tx}, expected "
                        f"tx={word % x} (= word % blockDim.x): neighbouring threads must "
                        "copy neighbouring words, thread tx copying words tx, tx + "
                        "blockDim.x, tx + 2 * blockDim.x, ... (a warp's loads are then coalesced)")
    for (b, t), acc in sorted(per_thread.items()):
        acc.sort()
        loads, stored = 0, set()  # words loaded since this thread's last store; rows it has started storing
        todo = defaultdict(int)
        for _, name, row, _, write in acc:
            if name == out_name and write:
                todo[row] += 1
        for _, name, row, word, write in acc:
            if name == weight_name and not write:
                loads += 1
            elif name == out_name and write:
                if row not in stored and loads < min(UNROLL, todo[row]):
                    return (f"thread ({who((b, t % x, t // x))}) stored word {word} of row "
                            f"{row} after loading {loads} word{'s' if loads != 1 else ''}: "
                            f"load {UNROLL} words (j, j + bx, j + 2 * bx, j + 3 * bx) "
                            f"before storing them, so {UNROLL} loads are in flight")
                stored.add(row)
                loads = 0
    return None


def _layout_here(kernel) -> tuple:
    """Trace a capped launch of ``kernel`` on the simulator: ``(problem, lines)`` (see
    :func:`layout`)."""
    import course.embedding.access as access

    ids, weight = capped_inputs()
    held = {}
    tr = access.trace(lambda: held.setdefault("r", launch_capped(kernel, ids, weight)))
    out, (blocks, (x, y)), word = held["r"]
    names = list(tr.arrays)
    if len(names) != 4:
        return f"expected a kernel of four arrays (ids, weight, out, err), it got {len(names)}", []
    problem = layout_problem(tr.records, names[2], names[1], out.shape[1] * out.element_size(), word, x)
    if problem:
        return f"{problem} [access trace of {len(ids)} rows, blockDim = ({x}, {y})]", []
    return "", [f"rows of threads: each row copied once, by one row of {x} "
            f"threads, thread tx copying words tx, tx + {x}, ... (access trace)",
            f"{UNROLL} loads in flight: every thread loaded "
            f"{UNROLL} words before storing them (access trace)"]


def kernel_source(kernel) -> dict:
    """What a simulator process needs to rebuild ``kernel``: its source, its name, the globals it
    reads.

    Modules travel as their names, numbers as values; anything else raises ValueError.
    """
    fn = getattr(kernel, "py_func", None) or getattr(kernel, "fn", None) or kernel
    src = textwrap.dedent(inspect.getsource(fn))
    glob, free = {}, dict(zip(fn.__code__.co_freevars, [c.cell_contents for c in fn.__closure__ or ()]))
    read = {i.argval for i in dis.get_instructions(fn) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
    # the globals it reads (co_names would add attribute names: .x, .shape)
    for name in sorted(read):
        if name in free or name not in fn.__globals__:
            continue
        glob[name] = fn.__globals__[name]
    glob.update(free)
    spec = {}
    for name, value in glob.items():
        if isinstance(value, types.ModuleType):
            spec[name] = {"module": value.__name__}
        elif isinstance(value, (bool, int, float)):
            spec[name] = {"value": value}
        else:
            raise ValueError(f"the kernel reads {name!r} ({type(value).__name__}), "
                             "which cannot be sent to a simulator process")
    return {"source": src, "name": fn.__name__, "globals": spec}


def _rebuild(spec: dict):
    """The kernel of :func:`kernel_source`'s ``spec``, compiled for the simulator (in a simulator
    process)."""
    import importlib

    from course.core.runtime import cuda

    ns = {k: importlib.import_module(v["module"]) if "module" in v else v["value"]
          for k, v in spec["globals"].items()}
    ns.setdefault("cuda", cuda())
    exec(compile(spec["source"], "<learner "
                                 "kernel>", "exec"), ns)  # noqa: S102 - the learner's own kernel
    k = ns[spec["name"]]
    return k if hasattr(k, "configure") or hasattr(k, "__getitem__") else cuda().jit(k)


def _child_main() -> None:
    """Entry point of the simulator process: read a spec on stdin, print the layout's ``(problem,
    lines)`` as JSON."""
    print(json.dumps(_layout_here(_rebuild(json.load(sys.stdin)))))


def _layout_in_child(kernel) -> tuple:
    try:
        spec = kernel_source(kernel)
    except (OSError, TypeError, ValueError) as e:
        return "", [f"rows of threads, loads in flight: not traced ({e})"]
    env = {**os.environ, "COURSE_PATH": "sim", "NUMBA_ENABLE_CUDASIM": "1"}
    child = subprocess.run([sys.executable, "-c", "import course.embedding.fastcheck "
                                                  "as C; C._child_main()"],
                           input=json.dumps(spec), env=env, capture_output=True, text=True, timeout=600)
    lines = child.stdout.strip().splitlines()
    if child.returncode or not lines:
        why = (child.stderr.strip().splitlines() or ["no output"])[-1][:200]
        return "", ["rows of threads, loads in flight: not "
                    f"traced (the simulator process failed: {why})"]
    problem, covered = json.loads(lines[-1])
    return (problem + " (traced on the simulator, in its own process)" if problem else "",
            [f"{line} (in a simulator process)" for line in covered])


def layout(kernel, *, child=None) -> tuple:
    """The exercise's layout from the access trace: ``(problem, lines)``, the problem ('' if none)
    in words, the lines what was covered. On a GPU (or with ``child=True``) the kernel's source is
    traced in a ``COURSE_PATH=sim`` process; when that cannot be done the line says "not traced"."""
    return _layout_in_child(kernel) if (child if child is not None else runtime().on_gpu) else _layout_here(kernel)


def _covered(step):
    """A rule's test: ``step(kernel)``'s problem, its lines of what was covered kept."""
    def test(k) -> str:
        problem, lines = step(k.kernel)
        k.lines += [lines] if isinstance(lines, str) else lines
        return problem
    return test


FAST_RULES = [Rule("grid_stride", "", _covered(grid_stride)), Rule("layout", "", _covered(layout))]


def check_fast_kernel(kernel) -> list:
    """Judge ``kernel`` by :data:`FAST_RULES` (grid-stride loop, then the layout); what was covered
    (not speed)."""
    k = types.SimpleNamespace(kernel=kernel, lines=[])
    check(k, FAST_RULES)
    return k.lines
