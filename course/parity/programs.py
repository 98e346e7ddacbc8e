"""Small capture programs, each written once against ``cg = course.graphs()``, with the verdict a
GPU gives.

The simulator's graphs (:mod:`course.sim.graph`) must give every program the verdict torch.cuda
gives on a GPU: a laptop ✓ then means a GPU ✓. ``tests/test_simgraph.py`` runs them on the path the
machine has (the simulator in CI; torch.cuda on a GPU). :func:`run` runs one and returns its
verdict; :data:`PROGRAMS` lists them (these: what a replay reads and writes, and what a capture
refuses; :mod:`course.parity.streams`: streams, pools, Numba launches and
``make_graphed_callables``; :mod:`course.parity.sync`: torch's sync debug mode and a graph freed
during a capture; :mod:`course.parity.modes`: inference mode and the seed in a capture).
"""
from __future__ import annotations

import dataclasses

import torch

import course.parity.modes as modes
import course.parity.streams as streams
import course.parity.sync as sync
from course.parity.tools import PHRASES, capture, capture_error, clean_up, close, phrase, x8


@dataclasses.dataclass(frozen=True)
class Program:
    """One program: ``fn(cg, device)`` returns a verdict; ``expected`` is the verdict a GPU gives.
    """

    name: str
    fn: object
    expected: str


# --------------------------------------------------------------------------- what a replay reads
# and writes

def copy_in(cg, dev):
    """copy_ new data into the static input, replay: the output follows the new data."""
    x = torch.randn(8, device=dev)
    g, y = capture(cg, lambda: x * 2 + 1)
    new = torch.randn(8, device=dev)
    x.copy_(new)
    g.replay()
    return "follows the copied data" if close(y, new * 2 + 1) else "stale"


def rebound_input(cg, dev):
    """Rebind the input's Python name to a new tensor, replay: the graph still reads the captured
    tensor."""
    x = torch.randn(8, device=dev)
    g, y = capture(cg, lambda sx=x: sx * 2)
    # rebinding the name: the graph never sees the new tensor
    old, x = x, torch.randn(8, device=dev)
    g.replay()
    return "reads the captured tensor" if close(y, old * 2) and not close(y, x * 2) else "reads the new tensor"


def made_after_capture(cg, dev):
    """A tensor made after capture, put where the function looked it up: a replay never reads it."""
    state = {"x": torch.ones(8, device=dev)}
    g, y = capture(cg, lambda: state["x"] + 1)
    state["x"] = torch.full((8,), 5.0, device=dev)  # made after capture: never read by a replay
    g.replay()
    return "never read" if close(y, torch.full((8,), 2.0, device=dev)) else "read"


def frozen_scalar(cg, dev):
    """A Python float read at capture (2.0), changed to 3.0: the replay still multiplies by 2.0."""
    x, scale = torch.ones(4, device=dev), {"v": 2.0}
    g, y = capture(cg, lambda: x * scale["v"])
    scale["v"] = 3.0
    g.replay()
    return f"multiplies by {float(y[0]):.1f}"


def frozen_branch(cg, dev):
    """A Python if on a host flag, flipped after capture: the replay runs the branch taken at
    capture."""
    x, flag = torch.randn(8, device=dev), {"relu": True}
    g, y = capture(cg, lambda: torch.relu(x) if flag["relu"] else torch.tanh(x))
    flag["relu"] = False
    g.replay()
    return "relu (the branch taken at capture)" if close(y, torch.relu(x)) else "tanh"


def python_side_effects(cg, dev):
    """A Python counter in the function: replays run no Python, so it counts warm-ups and capture
    only."""
    x, calls = torch.ones(4, device=dev), [0]

    def counted():
        calls[0] += 1
        return x + 1
    g, _ = capture(cg, counted)
    for _ in range(5):
        g.replay()
    return f"{calls[0]} calls (2 warm-ups + 1 capture)"


def kept_output(cg, dev):
    """Hold the output tensor (no clone) and replay with new input: the held tensor is overwritten.
    """
    x = torch.randn(8, device=dev)
    g, y = capture(cg, lambda: x * 2)
    g.replay()
    kept, cloned = y, y.clone()  # kept: the graph's own output tensor; cloned: a copy
    x.copy_(torch.randn(8, device=dev))
    g.replay()
    return "held output overwritten by the next replay" if not torch.equal(kept, cloned) else "held output kept"


def inplace_at_replay(cg, dev):
    """An in-place add captured: nothing changes at capture, each replay adds once."""
    acc, x = torch.zeros(4, device=dev), torch.ones(4, device=dev)
    g = cg.CUDAGraph()
    with cg.graph(g):
        acc.add_(x)
    cg.synchronize()
    after_capture = float(acc.sum())
    g.replay()
    g.replay()
    cg.synchronize()
    return f"{after_capture:.0f} after capture, {float(acc.sum()):.0f} after 2 replays"


def fresh_random(cg, dev):
    """torch.rand inside the graph: every replay draws new numbers."""
    g, r = capture(cg, lambda: torch.rand(64, device=dev))
    g.replay()
    a = r.clone()
    g.replay()
    return "new numbers each replay" if not torch.equal(a, r) else "the same numbers"


# --------------------------------------------------------------------------- what a capture refuses

def item(cg, dev):
    """.item() inside the capture: refused (the host would wait for the GPU)."""
    x = x8(dev)
    return capture_error(cg, lambda: x * x.abs().max().item())


def if_tensor(cg, dev):
    """if tensor: inside the capture: refused (a host read)."""
    x = x8(dev)
    return capture_error(cg, lambda: torch.relu(x) if x.sum() > 0 else x)


def nonzero(cg, dev):
    """Boolean-mask indexing (nonzero) inside the capture: refused (a data-dependent size)."""
    x = x8(dev)
    return capture_error(cg, lambda: x[x > 0])


def print_tensor(cg, dev):
    """Printing a tensor inside the capture: refused (a host read)."""
    x = x8(dev)
    return capture_error(cg, lambda: str(x))


def cpu_copy(cg, dev):
    """.cpu() inside the capture: refused by torch (a copy to pageable host memory)."""
    x = x8(dev)
    return capture_error(cg, lambda: x.cpu())


def tolist(cg, dev):
    """.tolist() inside the capture: refused by torch (a copy to the host)."""
    x = x8(dev)
    return capture_error(cg, lambda: x.tolist())


def tensor_ctor(cg, dev):
    """torch.tensor(data, device=...) inside the capture: refused by torch (a host-to-device copy).
    """
    x = x8(dev)
    return capture_error(cg, lambda: x + torch.tensor([1.0], device=dev))


def synchronize(cg, dev):
    """synchronize() inside the capture: refused."""
    x = x8(dev)
    return capture_error(cg, lambda: (x * 2, cg.synchronize()))


def manual_seed(cg, dev):
    """torch.manual_seed to a new seed inside the capture: refused by the CUDA generator."""
    x = x8(dev)
    torch.manual_seed(29)
    return capture_error(cg, lambda: (x * 2, torch.manual_seed(30)))


def manual_seed_same(cg, dev):
    """torch.manual_seed to the generator's current seed inside the capture: accepted (torch's
    rule)."""
    x = x8(dev)
    torch.manual_seed(29)
    return capture_error(cg, lambda: (x * 2, torch.manual_seed(29)))


def unregistered_generator(cg, dev):
    """A generator not registered with the graph, used inside the capture: refused."""
    gen = torch.Generator(device=dev)
    gen.manual_seed(0)
    return capture_error(cg, lambda: torch.rand(8, device=dev, generator=gen))


def default_stream(cg, dev):
    """capture_begin on the legacy default stream: refused."""
    g = cg.CUDAGraph()
    try:
        with cg.stream(cg.default_stream()):
            g.capture_begin()
    except RuntimeError as e:
        return phrase(e)
    return "captured"


def replay_before_capture(cg, dev):
    """replay() of a graph that captured nothing: refused."""
    try:
        cg.CUDAGraph().replay()
    except RuntimeError as e:
        return phrase(e)
    return "replayed"


def capture_twice(cg, dev):
    """Capturing again into a graph that holds a capture: refused."""
    x, before = x8(dev), cg.current_stream()
    g, _ = capture(cg, lambda: x + 1)
    try:
        with cg.graph(g):
            x * 2
    except RuntimeError as e:
        # graph() made its capture stream current before capture_begin refused
        cg.set_stream(before)
        return phrase(e)
    return "captured again"


def failed_capture_claims_pool(cg, dev):
    """A capture that fails with a CUDA error leaves its pool claimed: the next capture into it
    fails."""
    x, pool, before = x8(dev), cg.graph_pool_handle(), cg.current_stream()
    try:
        with cg.graph(cg.CUDAGraph(), pool=pool):
            x * float(x.sum())
    except Exception:  # noqa: BLE001 - expected: the host read
        cg.set_stream(before)
    verdict = "captured"
    try:
        with cg.graph(cg.CUDAGraph(), pool=pool):
            x + 1
    except RuntimeError as e:
        verdict = phrase(e)
    clean_up(cg, before, pool)
    return verdict


SYNC_WARNS = "warn: item, if, mask, cpu, tolist, tensor(device=), stream sync; quiet: synchronize, embedding, matmul"
PROGRAMS = tuple(Program(*p) for p in (
    ("copy_in", copy_in, "follows the copied data"),
    ("rebound_input", rebound_input, "reads the captured tensor"),
    ("made_after_capture", made_after_capture, "never read"),
    ("frozen_scalar", frozen_scalar, "multiplies by 2.0"),
    ("frozen_branch", frozen_branch, "relu (the branch taken at capture)"),
    ("python_side_effects", python_side_effects, "3 calls (2 warm-ups + 1 capture)"),
    ("kept_output", kept_output, "held output overwritten by the next replay"),
    ("inplace_at_replay", inplace_at_replay, "0 after capture, 8 after 2 replays"),
    ("fresh_random", fresh_random, "new numbers each replay"),
    ("item", item, PHRASES[0]), ("if_tensor", if_tensor, PHRASES[0]), ("nonzero", nonzero, PHRASES[0]),
    ("print_tensor", print_tensor, PHRASES[0]), ("synchronize", synchronize, PHRASES[0]),
    ("cpu_copy", cpu_copy, PHRASES[1]), ("tolist", tolist, PHRASES[1]), ("tensor_ctor", tensor_ctor, PHRASES[1]),
    ("manual_seed", manual_seed, PHRASES[5]), ("manual_seed_same", manual_seed_same, "captured"),
    ("unregistered_generator", unregistered_generator, PHRASES[9]),
    ("default_stream", default_stream, PHRASES[3]), ("replay_before_capture", replay_before_capture, PHRASES[7]),
    ("capture_twice", capture_twice, PHRASES[8]), ("failed_capture_claims_pool", failed_capture_claims_pool,
                                                   PHRASES[6]),
    ("fork_join", streams.fork_join, "captured"), ("unjoined", streams.unjoined, PHRASES[2]),
    ("pool_shared_outputs", streams.pool_shared_outputs, "pool shared True, kept "
                                                         "outputs intact True"),
    ("pool_freed_memory_reused", streams.pool_freed_memory_reused, "B right True, then overwritten by A's replay True"),
    ("numba_kernel", streams.numba_kernel, "replay follows the input True, "
                                           "empty-graph warning False"),
    ("numba_default_stream", streams.numba_default_stream, "replay follows the input "
                                                           "False, empty-graph warning True"),
    ("numba_alloc", streams.numba_alloc, PHRASES[4]),
    ("graphed_module", streams.graphed_module, "forward matches eager True, gradients match True"),
    ("inference_mode_replay", modes.inference_mode_replay, "replay follows the input: "
                                                           "no_grad True, inference_mode True"),
    ("sync_debug_warns", sync.sync_debug_warns, SYNC_WARNS),
    ("sync_debug_error", sync.sync_debug_error, "called a synchronizing CUDA "
                                                "operation; mode after 'default': 0"),
    ("graph_freed_during_capture", sync.graph_freed_during_capture, PHRASES[10]),
))


def run(name: str, cg=None, device=None) -> str:
    """The verdict of program ``name`` on ``cg`` (default ``course.graphs()``) and ``device``
    (``course.device()``)."""
    from course.core.runtime import graphs, torch_device

    prog = next((p for p in PROGRAMS if p.name == name), None)
    if prog is None:
        raise KeyError(f"no parity program {name!r}; known: {[p.name for p in PROGRAMS]}")
    return prog.fn(cg if cg is not None else graphs(), device if device is not None else torch_device())
