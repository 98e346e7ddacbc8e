"""Capture and replay: the experiments behind notebook 02 (and torch.compile's graphs).

- :func:`kernel_sweep`: eager vs replay time against the number of kernels in the graph.
- :func:`seed_step_experiment`: the CUDA Graph lesson's exercise from the seeds (a Linear layer,
  loss, backward and an SGD step captured whole and replayed 1000 times) against eager.
- :func:`new_shape_experiment`: what a new input shape costs (a new capture), and the private
  memory pool each graph keeps (separate pools vs one shared pool).
- :func:`frozen_experiment`: what a graph freezes at capture time, checked one by one.
- :func:`compile_skip_experiment` / :func:`compile_shapes_experiment`: ``torch.compile(mode=
  "reduce-overhead")`` with and without a hazard (the reason it logs for skipping cudagraphs),
  and what happens when the input shape changes.

All of them need a GPU; on the simulator path notebooks load the reference results.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import time

from .capture import require_gpu, try_capture, warm_up
from .reference import experiment
from .results import Result
from .timing import time_device, time_enqueue, time_wall

SWEEP_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def _fit_slope(xs, ys) -> float:
    """Least-squares slope of ys against xs."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0


def per_kernel_slopes(result, min_kernels: int = 16) -> dict:
    """Fit time = a + b * kernels to the sweep (rows with >= ``min_kernels``): b for eager, replay, and saving (us)."""
    rows = [r for r in result.rows if r["kernels"] >= min_kernels]
    if len(rows) < 2:
        rows = result.rows
    ks = [r["kernels"] for r in rows]
    eager = _fit_slope(ks, [r["eager_us"] for r in rows])
    replay = _fit_slope(ks, [r["replay_us"] for r in rows])
    return {"eager_us_per_kernel": eager, "replay_us_per_kernel": replay, "saving_us_per_kernel": eager - replay}


# =====================================================================================
# 1. eager vs replay against the number of kernels
# =====================================================================================
def kernel_chain(buf, n: int):
    """A function that launches ``n`` tiny kernels (in-place adds on ``buf``)."""
    def chain():
        for _ in range(n):
            buf.add_(1.0)
    return chain


@experiment("graphs_kernel_sweep", gpu_only=True, quick={"counts": (1, 16, 128), "repeats": 5})
def kernel_sweep(counts=SWEEP_COUNTS, size: int = 1024, repeats: int = 15) -> Result:
    """Time n tiny kernels launched eagerly vs replayed from one graph, for n in ``counts``."""
    require_gpu("the kernel-count sweep")
    import torch

    buf = torch.zeros(size, device="cuda")
    rows = []
    for n in counts:
        chain = kernel_chain(buf, n)
        inner = max(1, 256 // n)
        eager = time_device(chain, warmup=3, repeats=repeats, inner=inner)
        out = try_capture(chain, warmup=1)
        if not out.ok:
            raise RuntimeError(f"capturing {n} adds failed: {out}")
        replay = time_device(out.graph.replay, warmup=3, repeats=repeats, inner=inner)
        launch = time_enqueue(out.graph.replay, warmup=3, repeats=repeats, inner=1)
        rows.append({"kernels": n, "eager_us": eager.us, "replay_us": replay.us,
                     "eager_per_kernel_us": eager.us / n, "replay_per_kernel_us": replay.us / n,
                     "saving_per_kernel_us": (eager.us - replay.us) / n, "replay_launch_us": launch.us})
        del out
        torch.cuda.synchronize()
    res = Result("graphs_kernel_sweep", "Eager launches vs one graph replay, by number of kernels",
                 {"kernels": "count", "eager_us": "us", "replay_us": "us", "eager_per_kernel_us": "us",
                  "replay_per_kernel_us": "us", "saving_per_kernel_us": "us", "replay_launch_us": "us"},
                 rows, params={"counts": list(counts), "size": size, "repeats": repeats})
    fit = per_kernel_slopes(res)
    res.add_summary("eager, per kernel (fit)", fit["eager_us_per_kernel"], "us")
    res.add_summary("replay, per kernel (fit)", fit["replay_us_per_kernel"], "us")
    res.add_summary("saving per kernel (fit)", fit["saving_us_per_kernel"], "us")
    last = rows[-1]
    res.add_summary(f"speedup at {last['kernels']} kernels", last["eager_us"] / last["replay_us"], "x")
    return res


# =====================================================================================
# 2. the seeds' exercise: Linear + loss + backward + SGD, captured whole
# =====================================================================================
def seed_setup(N: int = 64, D_in: int = 1024, D_out: int = 1024, seed: int = 0):
    """The seeds' static inputs, model and optimizer: (x, y, model, optimizer) on the GPU."""
    import torch

    torch.manual_seed(seed)
    x = torch.randn(N, D_in, device="cuda")
    y = torch.randn(N, D_out, device="cuda")
    model = torch.nn.Linear(D_in, D_out).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    return x, y, model, optimizer


def seed_step(model, optimizer, x, y):
    """One eager training step, as in the seeds: zero grads, forward, loss, backward, SGD step."""
    optimizer.zero_grad(set_to_none=True)
    loss = (model(x) - y).pow(2).sum()
    loss.backward()
    optimizer.step()
    return loss


def capture_seed_step(model, optimizer, x, y, warmup: int = 3):
    """The seeds' recipe: warm up on a side stream, then capture forward+backward+step whole.

    Returns (graph, static_loss). Gradients are set to None before capture, so backward
    allocates them from the graph's private pool and every replay overwrites them.
    """
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            seed_step(model, optimizer, x, y)
    torch.cuda.current_stream().wait_stream(s)

    g = torch.cuda.CUDAGraph()
    optimizer.zero_grad(set_to_none=True)
    with torch.cuda.graph(g):
        static_loss = (model(x) - y).pow(2).sum()
        static_loss.backward()
        optimizer.step()
    return g, static_loss


def gpu_ops_per_call(fn) -> int | None:
    """Number of GPU activities (kernels, memcpys, memsets) one call of ``fn`` issues (torch.profiler), or None."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    except Exception:  # noqa: BLE001 - the profiler is optional here (no CUPTI, another profiler active)
        return None


@experiment("graphs_seed_step", gpu_only=True, quick={"iters": 100, "repeats": 3})
def seed_step_experiment(N: int = 64, D_in: int = 1024, D_out: int = 1024, iters: int = 1000,
                         repeats: int = 7) -> Result:
    """The seeds' Linear+loss+backward+SGD step: eager vs graph replay, per step and for ``iters`` steps."""
    require_gpu("the seeds' training-step exercise")
    import copy

    import torch

    x, y, model, opt = seed_setup(N, D_in, D_out)
    twin = copy.deepcopy(model)  # the same weights, trained eagerly, to check the replays
    twin_opt = torch.optim.SGD(twin.parameters(), lr=1e-3)
    for _ in range(3):
        seed_step(twin, twin_opt, x, y)  # the warm-up steps the captured model also takes
    g, static_loss = capture_seed_step(model, opt, x, y)
    for _ in range(10):
        g.replay()
        seed_step(twin, twin_opt, x, y)
    torch.cuda.synchronize()
    match = all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(model.parameters(), twin.parameters()))

    eager_fn = lambda: seed_step(twin, twin_opt, x, y)  # noqa: E731
    eager = time_device(eager_fn, warmup=5, repeats=repeats * 3, inner=20)
    replay = time_device(g.replay, warmup=5, repeats=repeats * 3, inner=20)
    eager_loop = time_wall(eager_fn, warmup=5, repeats=repeats, inner=iters)
    replay_loop = time_wall(g.replay, warmup=5, repeats=repeats, inner=iters)
    ops = gpu_ops_per_call(eager_fn)
    rows = [{"mode": "eager", "per_step_us": eager.us, "loop_ms": eager_loop.median * iters * 1e3},
            {"mode": "graph replay", "per_step_us": replay.us, "loop_ms": replay_loop.median * iters * 1e3}]
    res = Result("graphs_seed_step", f"The seeds' training step (Linear {D_in}->{D_out}, batch {N}): eager vs replay",
                 {"mode": "", "per_step_us": "us", "loop_ms": "ms"}, rows,
                 params={"N": N, "D_in": D_in, "D_out": D_out, "iters": iters, "repeats": repeats})
    res.add_summary("speedup per step (CUDA events)", eager.us / replay.us, "x")
    res.add_summary(f"speedup over {iters} steps (synchronized wall clock)", eager_loop.median / replay_loop.median,
                    "x")
    res.add_summary("replayed weights match eager training", bool(match))
    if ops is not None:
        res.add_summary("GPU operations per step", ops, "count")
    return res


# =====================================================================================
# 3. a new shape is a new graph: what capture costs, and the private memory pools
# =====================================================================================
def mlp(width: int = 1024, depth: int = 4):
    """A plain MLP (Linear+ReLU, ``depth`` times) on the GPU, for the shape experiments."""
    import torch

    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers).cuda()


@experiment("graphs_new_shape", gpu_only=True, quick={"batches": (1, 64), "repeats": 5})
def new_shape_experiment(batches=(1, 8, 64, 512), width: int = 1024, depth: int = 4, repeats: int = 15) -> Result:
    """For each batch size: warm-up + capture time, replay vs eager time, memory of the graph's pool."""
    require_gpu("the new-shape experiment")
    import torch

    MiB = 2 ** 20
    model = mlp(width, depth)
    rows, graphs = [], []
    with torch.no_grad():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        for b in batches:
            x = torch.randn(b, width, device="cuda")
            fn = lambda x=x: model(x)  # noqa: E731
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            warm_up(fn, 3)
            t1 = time.perf_counter()
            before = torch.cuda.memory_reserved()  # after warm-up: only the graph's own pool counts
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                y = fn()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            graphs.append((g, x, y))
            eager = time_device(fn, warmup=3, repeats=repeats, inner=10)
            replay = time_device(g.replay, warmup=3, repeats=repeats, inner=10)
            saving = eager.us - replay.us
            rows.append({"batch": b, "warmup_ms": (t1 - t0) * 1e3, "capture_ms": (t2 - t1) * 1e3,
                         "eager_us": eager.us, "replay_us": replay.us,
                         "pool_mib": (torch.cuda.memory_reserved() - before) / MiB,
                         "break_even_replays": (t2 - t1) * 1e6 / saving if saving > 0 else None})
        separate = sum(r["pool_mib"] for r in rows)
        del graphs, g, y
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        pool = torch.cuda.graph_pool_handle()
        shared, shared_mib = [], 0.0
        for b in sorted(batches, reverse=True):  # largest first, so smaller graphs fit in its memory
            x = torch.randn(b, width, device="cuda")
            warm_up(lambda x=x: model(x), 3)
            before = torch.cuda.memory_reserved()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                y = model(x)
            torch.cuda.synchronize()
            shared_mib += (torch.cuda.memory_reserved() - before) / MiB
            shared.append((g, x, y))
        del shared
    res = Result("graphs_new_shape", f"A new shape is a new capture (MLP {depth}x{width}, no_grad)",
                 {"batch": "count", "warmup_ms": "ms", "capture_ms": "ms", "eager_us": "us", "replay_us": "us",
                  "pool_mib": "MiB", "break_even_replays": "count"}, rows,
                 params={"batches": list(batches), "width": width, "depth": depth, "repeats": repeats})
    res.add_summary("memory reserved, one pool per graph", separate, "MiB")
    res.add_summary("memory reserved, one shared pool", shared_mib, "MiB")
    return res


# =====================================================================================
# 4. what freezes at capture time
# =====================================================================================
@experiment("graphs_frozen", gpu_only=True, quick={})
def frozen_experiment() -> Result:
    """Eight checks of what a graph records and what it freezes, each against what eager would do."""
    require_gpu("the frozen-at-capture checks")
    import torch

    rows = []

    def add(check, happened, as_expected, lesson):
        rows.append({"check": check, "what_happened": happened, "as_expected": bool(as_expected),
                     "lesson": lesson})

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16).cuda()
    with torch.no_grad():
        static_x = torch.randn(4, 16, device="cuda")
        out = try_capture(lambda: model(static_x))
        g, static_y = out.graph, out.output

        new = torch.randn(4, 16, device="cuda")
        static_x.copy_(new)
        g.replay()
        ok = torch.allclose(static_y, model(new))
        add("copy_ new data into the static input, replay", "output matches eager on the new data" if ok
            else "output does NOT match eager", ok, "new data goes in with static_x.copy_(new)")

        old_buffer = static_x
        static_x = torch.randn(4, 16, device="cuda")  # rebinding the name: the graph never sees this tensor
        g.replay()
        stale = torch.allclose(static_y, model(old_buffer)) and not torch.allclose(static_y, model(static_x))
        add("rebind the Python name (static_x = new tensor), replay",
            "output still computed from the old buffer" if stale else "output follows the new tensor", stale,
            "the graph recorded an address, not a Python name")
        static_x = old_buffer

        try:
            static_x.copy_(torch.randn(8, 16, device="cuda"))
            add("copy a batch of 8 into the static batch of 4", "no error", False, "shapes are fixed")
        except RuntimeError as e:
            add("copy a batch of 8 into the static batch of 4", f"RuntimeError: {str(e).splitlines()[0]}", True,
                "shapes are fixed: a new shape needs a new capture")

        keep = static_y  # no clone
        before = keep.clone()
        static_x.copy_(torch.randn(4, 16, device="cuda"))
        g.replay()
        changed = not torch.equal(keep, before)
        add("hold the output tensor, replay again", "the held tensor changed under us" if changed
            else "the held tensor kept its values", changed,
            "outputs are static too: clone() what you keep")
        del out, g

        flag = {"relu": True}
        out = try_capture(lambda: torch.relu(static_x) if flag["relu"] else torch.tanh(static_x))
        flag["relu"] = False
        out.graph.replay()
        frozen = torch.allclose(out.output, torch.relu(static_x)) and not torch.allclose(out.output,
                                                                                         torch.tanh(static_x))
        add("Python if on a host flag, flip the flag, replay", "still the branch taken at capture (relu)" if frozen
            else "followed the new flag", frozen, "Python control flow runs once, at capture")

        scale = {"v": 2.0}
        out = try_capture(lambda: static_x * scale["v"])
        scale["v"] = 3.0
        out.graph.replay()
        frozen = torch.allclose(out.output, static_x * 2.0)
        add("Python float read at capture (2.0), change it to 3.0, replay",
            "still multiplies by 2.0" if frozen else "multiplies by 3.0", frozen,
            "host values are baked into the kernels' arguments")

        calls = [0]

        def counted():
            calls[0] += 1
            return static_x + 1

        out = try_capture(counted, warmup=3)
        at_capture = calls[0]
        for _ in range(10):
            out.graph.replay()
        add("a Python counter in the function, 10 replays", f"counter is {calls[0]} (3 warm-ups + 1 capture)",
            calls[0] == at_capture, "replay runs no Python: side effects happen only at capture")

        out = try_capture(lambda: torch.rand(4, device="cuda"))
        out.graph.replay()
        a = out.output.clone()
        out.graph.replay()
        fresh = not torch.equal(a, out.output)
        add("torch.rand inside the graph, replay twice", "new random numbers each replay" if fresh
            else "the same numbers", fresh, "torch's CUDA RNG is graph-safe (the offset advances per replay)")
        torch.cuda.synchronize()
    res = Result("graphs_frozen", "What a CUDA graph records and what it freezes",
                 {"check": "", "what_happened": "", "as_expected": "", "lesson": ""}, rows)
    res.add_summary("checks as expected", sum(r["as_expected"] for r in rows), f"of {len(rows)}")
    return res


# =====================================================================================
# 5. torch.compile(mode="reduce-overhead")
# =====================================================================================
class CompileNet:
    """Factory namespace for the small model compiled in the torch.compile experiments."""

    HAZARDS = ("none", "mutates_input", "cpu_tensor", "item")

    @staticmethod
    def build(hazard: str = "none", width: int = 256, depth: int = 6):
        """An MLP of ``depth`` Linear+ReLU layers whose forward carries ``hazard`` (one of :attr:`HAZARDS`)."""
        import torch

        if hazard not in CompileNet.HAZARDS:
            raise ValueError(f"hazard must be one of {CompileNet.HAZARDS}")

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

            def forward(self, x):
                if hazard == "mutates_input":
                    x.clamp_(-3.0, 3.0)  # an in-place update of an input
                h = x
                for i, layer in enumerate(self.layers):
                    h = torch.relu(layer(h))
                    if hazard == "item" and i == depth // 2:
                        h = h / h.abs().max().item()  # a host read: dynamo breaks the graph here
                if hazard == "cpu_tensor":
                    return h, h.mean().cpu()  # a device-to-host copy inside the compiled graph
                return h

        return Net().cuda()


class _Grab(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        try:
            self.messages.append(record.getMessage())
        except Exception:  # noqa: BLE001 - never let logging break an experiment
            pass


@contextlib.contextmanager
def torch_log_messages(**artifacts):
    """Turn on torch logging artifacts (those this torch knows) and collect every message logged meanwhile."""
    import torch._logging

    known = set(inspect.signature(torch._logging.set_logs).parameters)
    torch._logging.set_logs(**{k: v for k, v in artifacts.items() if k in known})
    names = {"torch", "torch._inductor", "torch._dynamo", "torch._inductor.cudagraph_trees"}
    try:
        from torch._logging._internal import log_registry
        names |= set(log_registry.get_log_qnames())
    except Exception:  # noqa: BLE001 - private API; the fixed names above cover the common cases
        pass
    grab = _Grab()
    loggers = [logging.getLogger(n) for n in sorted(names)]
    saved = {lg.name: list(lg.handlers) for lg in loggers}
    for lg in loggers:
        lg.handlers = [grab]  # collect instead of printing (torch's own handlers write to stderr)
    try:
        yield grab.messages
    finally:
        for lg in loggers:
            lg.handlers = saved[lg.name]
        torch._logging.set_logs()


def _condense(message: str, lines: int = 4) -> str:
    """The first few non-empty lines of a (multi-line) log message, joined with ' / '."""
    kept = [l.strip() for l in message.strip().splitlines() if l.strip()][:lines]
    return " / ".join(kept)[:400]


def _recompile_reason(message: str) -> str:
    """'recompiled: tensor 'x' size mismatch ...' from dynamo's recompile message."""
    reasons = [l.strip().lstrip("- ").split(": ", 1)[-1] for l in message.splitlines() if l.strip().startswith("- ")]
    return "recompiled: " + "; ".join(reasons) if reasons else "recompiled"


def _counters() -> dict:
    from torch._dynamo.utils import counters

    return {"cudagraph_skips": counters["inductor"]["cudagraph_skips"],
            "graph_breaks": sum(counters["graph_break"].values()),
            "unique_graphs": counters["stats"]["unique_graphs"]}


def _reset_compile() -> None:
    import torch
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()


@experiment("compile_skip_reasons", gpu_only=True, quick={"hazards": ("none", "mutates_input"), "repeats": 5})
def compile_skip_experiment(hazards=CompileNet.HAZARDS, width: int = 256, depth: int = 6, batch: int = 32,
                            repeats: int = 15) -> Result:
    """torch.compile(mode="reduce-overhead") on a small MLP with and without a hazard: logs, counters, time."""
    require_gpu("torch.compile with CUDA graphs")
    import torch

    rows = []
    for hazard in hazards:
        _reset_compile()
        torch.manual_seed(0)
        net = CompileNet.build(hazard, width, depth)
        x = torch.randn(batch, width, device="cuda")
        compiled = torch.compile(net, mode="reduce-overhead")
        with torch.no_grad(), torch_log_messages(perf_hints=True, graph_breaks=True, cudagraphs=True) as msgs:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            compiled(x)
            torch.cuda.synchronize()
            first_s = time.perf_counter() - t0
            for _ in range(3):
                compiled(x)
            c = time_device(lambda: compiled(x), warmup=3, repeats=repeats, inner=10)
        with torch.no_grad():
            e = time_device(lambda: net(x), warmup=3, repeats=repeats, inner=10)
        k = _counters()
        skips = [_condense(m) for m in msgs if "skipping cudagraphs" in m]
        breaks = [_condense(m) for m in msgs if "graph break" in m.lower()]
        parts = sorted({m.strip().splitlines()[0] for m in msgs if "graph partitions" in m})
        rows.append({"hazard": hazard, "first_call_s": first_s, "compiled_us": c.us, "eager_us": e.us,
                     "cudagraph_skips": k["cudagraph_skips"], "graph_breaks": max(k["graph_breaks"], len(breaks)),
                     "skip_reason": skips[0] if skips else "", "graph_break_reason": breaks[0] if breaks else "",
                     "partitions": " | ".join(parts)})
    _reset_compile()
    res = Result("compile_skip_reasons", 'torch.compile(mode="reduce-overhead"): what a hazard does to cudagraphs',
                 {"hazard": "", "first_call_s": "s", "compiled_us": "us", "eager_us": "us",
                  "cudagraph_skips": "count", "graph_breaks": "count", "skip_reason": "",
                  "graph_break_reason": "", "partitions": ""}, rows,
                 params={"hazards": list(hazards), "width": width, "depth": depth, "batch": batch, "repeats": repeats,
                         "torch": torch.__version__})
    clean = [r for r in rows if r["hazard"] == "none"]
    if clean:
        res.add_summary("clean model: eager / compiled", clean[0]["eager_us"] / clean[0]["compiled_us"], "x")
    return res


@experiment("compile_new_shapes", gpu_only=True, quick={"batches": (8, 16), "calls_per_shape": 3})
def compile_shapes_experiment(batches=(8, 16, 32, 8), calls_per_shape: int = 4, width: int = 256) -> Result:
    """The seeds' question, answered: a reduce-overhead compiled model called at new input shapes."""
    require_gpu("torch.compile with CUDA graphs")
    import torch

    _reset_compile()
    torch.manual_seed(0)
    net = CompileNet.build("none", width)
    compiled = torch.compile(net, mode="reduce-overhead")
    rows, seen = [], set()
    call = 0
    with torch.no_grad(), torch_log_messages(recompiles=True, cudagraphs=True, perf_hints=True) as msgs:
        for b in batches:
            x = torch.randn(b, width, device="cuda")
            new_shape = b not in seen
            seen.add(b)
            for i in range(calls_per_shape):
                before, n_msgs = _counters(), len(msgs)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                compiled(x)
                torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                after = _counters()
                new = msgs[n_msgs:]
                log = [_recompile_reason(m) for m in new if m.startswith("Recompiling")]
                log += [m.strip().splitlines()[0] for m in new if "Recording cudagraph tree" in m]
                rows.append({"call": call, "batch": b, "new_shape": new_shape and i == 0, "call_ms": dt * 1e3,
                             "graphs_compiled": after["unique_graphs"] - before["unique_graphs"],
                             "graphs_recorded": sum("Recording function" in m for m in new),
                             "log": " | ".join(log)[:300]})
                call += 1
    _reset_compile()
    res = Result("compile_new_shapes", 'torch.compile(mode="reduce-overhead"): calling at new input shapes',
                 {"call": "count", "batch": "count", "new_shape": "", "call_ms": "ms", "graphs_compiled": "count",
                  "graphs_recorded": "count", "log": ""}, rows,
                 params={"batches": list(batches), "calls_per_shape": calls_per_shape, "width": width,
                         "torch": torch.__version__})
    firsts = [r for r in rows if r["new_shape"]]
    steady = [r["call_ms"] for r in rows if not r["new_shape"] and r["call"] % calls_per_shape == calls_per_shape - 1]
    res.add_summary("first call ever (compile + warm-up)", firsts[0]["call_ms"], "ms")
    if len(firsts) > 1:
        res.add_summary("first call at the second shape", firsts[1]["call_ms"], "ms")
    if len(firsts) > 2:
        res.add_summary("first call at the third shape", firsts[2]["call_ms"], "ms")
    if steady:
        res.add_summary("a steady-state call (last at each shape, median)", sorted(steady)[len(steady) // 2], "ms")
    res.add_summary("dynamo compiles in total", sum(r["graphs_compiled"] for r in rows), "count")
    res.add_summary("CUDA graphs recorded in total", sum(r["graphs_recorded"] for r in rows), "count")
    return res
