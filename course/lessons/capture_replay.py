"""Lesson 02, capture and replay: the experiments behind notebook 02.

- :func:`kernel_sweep`: eager vs replay time against the number of kernels in the graph.
- :func:`seed_step_experiment`: a CUDA Graph lesson's exercise (a Linear layer,
  loss, backward and an SGD step captured whole and replayed 1000 times) against eager.
- :func:`new_shape_experiment`: what a new input shape costs (a new capture), and the private
  memory pool each graph keeps (separate pools vs one shared pool).
- :func:`frozen_experiment`: what a graph freezes at capture time, checked one by one.

torch.compile's own graphs (``mode="reduce-overhead"``) are in :mod:`course.lessons.reduce_overhead`.

All of them need a GPU; on the simulator path notebooks load the reference results.
"""
from __future__ import annotations

import time

from course.core.capture import graph as capture_graph, require_gpu, try_capture, warm_up
from course.core.reference import experiment
from course.core.results import Result
from course.core.timing import speedup, time_device, time_enqueue, time_interleaved, time_wall

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
# 2. a CUDA Graph lesson's exercise: Linear + loss + backward + SGD, captured whole
# =====================================================================================
def seed_setup(N: int = 64, D_in: int = 1024, D_out: int = 1024, seed: int = 0):
    """The exercise's static inputs, model and optimizer: (x, y, model, optimizer) on the GPU."""
    import torch

    torch.manual_seed(seed)
    x = torch.randn(N, D_in, device="cuda")
    y = torch.randn(N, D_out, device="cuda")
    model = torch.nn.Linear(D_in, D_out).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    return x, y, model, optimizer


def seed_step(model, optimizer, x, y):
    """One eager training step, as in that lesson: zero grads, forward, loss, backward, SGD step."""
    optimizer.zero_grad(set_to_none=True)
    loss = (model(x) - y).pow(2).sum()
    loss.backward()
    optimizer.step()
    return loss


def capture_seed_step(model, optimizer, x, y, warmup: int = 3):
    """That lesson's recipe: warm up on a side stream, then capture forward+backward+step whole.

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
    """A CUDA Graph lesson's Linear+loss+backward+SGD step: eager vs graph replay, per step and for ``iters`` steps."""
    require_gpu("the training-step exercise")
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
    res = Result("graphs_seed_step",
                 f"A CUDA Graph lesson's training step (Linear {D_in}->{D_out}, batch {N}): eager vs replay",
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
    """For each batch size: warm-up and capture time, eager vs replay (interleaved), the graph's memory.

    Memory is read the same way for every graph, right after its capture: ``pool_reserved_mib`` is what the
    capture added to the memory torch reserves (the allocator hands out whole blocks: 2 MiB, or 20 MiB for
    large tensors), ``pool_allocated_mib`` what the graph's live tensors take. Separate pools and one shared
    pool (largest batch captured first) are measured by the same code. Break-even counts the warm-up too.
    """
    require_gpu("the new-shape experiment")
    import torch

    MiB = 2 ** 20
    model = mlp(width, depth)

    def capture_all(order, pool=None):
        out = []
        for b in order:
            x = torch.randn(b, width, device="cuda")
            fn = lambda x=x: model(x)  # noqa: E731
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            warm_up(fn, 3)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            torch.cuda.empty_cache()  # torch.cuda.graph() does this as it starts: do it before reading "before"
            reserved, allocated = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
            g = torch.cuda.CUDAGraph()
            with capture_graph(g, pool=pool):  # torch.cuda.graph, clean after a failure
                y = fn()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            out.append({"batch": b, "graph": g, "fn": fn, "x": x, "y": y, "warmup_ms": (t1 - t0) * 1e3,
                        "capture_ms": (t2 - t1) * 1e3,
                        "pool_reserved_mib": (torch.cuda.memory_reserved() - reserved) / MiB,
                        "pool_allocated_mib": (torch.cuda.memory_allocated() - allocated) / MiB})
        return out

    rows = []
    with torch.no_grad():
        warm_up(lambda: model(torch.randn(1, width, device="cuda")), 1)  # one-time init (cuBLAS...) is no shape's cost
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        captured = capture_all(batches)  # memory read right after each capture, before any timing
        for c in captured:
            t = time_interleaved({"eager": c["fn"], "replay": c["graph"].replay}, warmup=3, repeats=repeats,
                                 inner=10)
            s = speedup("eager", t["eager"], "replay", t["replay"])
            saving = t["eager"].us - t["replay"].us
            paid = not s.noise and saving > 0
            rows.append({"batch": c["batch"], "warmup_ms": c["warmup_ms"], "capture_ms": c["capture_ms"],
                         "eager_us": t["eager"].us, "eager_q1_us": t["eager"].q1 * 1e6,
                         "eager_q3_us": t["eager"].q3 * 1e6, "replay_us": t["replay"].us,
                         "replay_q1_us": t["replay"].q1 * 1e6, "replay_q3_us": t["replay"].q3 * 1e6,
                         "saving_is_noise": s.noise,
                         "pool_reserved_mib": c["pool_reserved_mib"], "pool_allocated_mib": c["pool_allocated_mib"],
                         "break_even_replays": ((c["warmup_ms"] + c["capture_ms"]) * 1e3 / saving) if paid else None})
        del captured
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        shared = capture_all(sorted(batches, reverse=True), pool=torch.cuda.graph_pool_handle())
        shared_reserved = sum(c["pool_reserved_mib"] for c in shared)
        shared_allocated = sum(c["pool_allocated_mib"] for c in shared)
        del shared
        torch.cuda.synchronize()
    res = Result("graphs_new_shape", f"A new shape is a new capture (MLP {depth}x{width}, no_grad)",
                 {"batch": "count", "warmup_ms": "ms", "capture_ms": "ms", "eager_us": "us", "eager_q1_us": "us",
                  "eager_q3_us": "us", "replay_us": "us", "replay_q1_us": "us", "replay_q3_us": "us",
                  "saving_is_noise": "", "pool_reserved_mib": "MiB", "pool_allocated_mib": "MiB",
                  "break_even_replays": "count"}, rows,
                 params={"batches": list(batches), "width": width, "depth": depth, "repeats": repeats})
    res.add_summary("memory reserved, one pool per graph", sum(r["pool_reserved_mib"] for r in rows), "MiB")
    res.add_summary("memory reserved, one shared pool", shared_reserved, "MiB")
    res.add_summary("memory allocated, one pool per graph", sum(r["pool_allocated_mib"] for r in rows), "MiB")
    res.add_summary("memory allocated, one shared pool", shared_allocated, "MiB")
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


