"""Lesson 02's capture exercises (02.6-02.8): the learner writes the capture, these checks run it.

Every check runs the learner's code on a fresh model against ``cg = course.graphs()`` (``torch.cuda`` on a GPU,
the course's simulated graphs on the simulator, which record at capture and replay without Python, as a GPU does),
and watches it through hooks that see the same thing on both paths: each call of the model (was a capture under
way, was the default stream current, the batch, the output's dtype, were the gradients None) and each optimizer
step. So a check can name a missing warm-up, a warm-up on the default stream or a capture without autocast, and
then compares what the graph computes with eager PyTorch.

- :func:`check_capture_forward` (02.6): a forward captured by hand, replayed on new data.
- :func:`check_train_step` (02.7): a whole training step (forward, backward, capturable Adam, autocast) against
  the same number of eager steps of an identical model.
- :func:`check_shared_pool` (02.8): two graphs sharing one memory pool, and the outputs rule that comes with it.

:func:`train_step` is the eager step 02.7's graph must reproduce; :func:`amp` the autocast settings of each path.
"""
from __future__ import annotations

import copy

import course
from course.core.checks import exercise
from course.lessons.capture_watch import SIDE, Watch, _watching, restored  # noqa: F401 - Watch: the checks' hooks

LR = 1e-2  # Adam's learning rate in 02.7
TOL = {"rtol": 1e-3, "atol": 1e-5}  # graph vs eager: the same kernels run (the simulator: the same CPU ops)


def amp() -> tuple:
    """``(device_type, dtype)`` for ``torch.autocast``: ``("cuda", bfloat16)`` on a GPU, ``("cpu", bfloat16)`` on
    the simulator (CPU autocast supports bfloat16; float16 autocast on the CPU is narrower)."""
    import torch

    return ("cuda" if course.runtime().on_gpu else "cpu"), torch.bfloat16


def mlp(d_in: int = 16, hidden: int = 32, d_out: int = 4, seed: int = 0):
    """A small MLP on the course's device, the same weights for the same seed."""
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(d_in, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, d_out)).to(course.device())


def train_loss(model, x, y):
    """The loss 02.7 trains: mean squared error of the model's output, computed in float32."""
    import torch

    return torch.nn.functional.mse_loss(model(x).float(), y)


def train_step(model, optimizer, x, y):
    """One eager training step: gradients to None, forward and loss under autocast, backward, step; the loss."""
    import torch

    device_type, dtype = amp()
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(device_type, dtype, cache_enabled=False):
        loss = train_loss(model, x, y)
    loss.backward()
    optimizer.step()
    return loss.detach()


def _close(a, b) -> bool:
    import torch

    return a.shape == b.shape and torch.allclose(a.detach().float(), b.detach().float(), **TOL)


def _unchanged(a, b) -> bool:
    """Same values, NaN included (what a capture leaves in a new tensor: NaN on the simulator, leftovers on a GPU)."""
    import torch

    return torch.allclose(a.detach().float(), b.detach().float(), rtol=0, atol=0, equal_nan=True)


# ------------------------------------------------------------------------------------------------ 02.6
A = "02.6 capture a forward by hand"


def check_capture_forward(capture_fn, run_fn) -> None:
    """02.6: ``capture_fn(model, static_x) -> (graph, static_y)``; ``run_fn(g, static_x, static_y, x)`` replays."""
    import torch

    with exercise(A, hint=[
                "a capture records what the model does to static_x; what must run before it, and where?",
                "in capture_forward: warm the model up on a side stream, then capture its call on static_x inside "
                "cg.graph(g) and return the graph with the very tensor that call returned; in run_forward: copy the "
                "new data into static_x and replay",
                "a smaller example: the recipe of section 1 above, on the lesson's model, is the same three steps: "
                "warm-up on a side stream, capture, replay after copy_"],
            answer="side = cg.Stream(); side.wait_stream(cg.current_stream()); with cg.stream(side): model(static_x) "
                   "three times; cg.current_stream().wait_stream(side); g = cg.CUDAGraph(); with cg.graph(g): static_y ="
                   " model(static_x); in run: static_x.copy_(new_x); g.replay(); return static_y"), restored(), torch.no_grad():
        model = mlp(seed=6)
        static_x = torch.randn(8, 16, device=course.device())
        first_x = static_x.clone()
        with _watching(model) as watch:
            out = capture_fn(model, static_x)
        problem = watch.recipe_problem()
        assert problem is None, problem
        assert isinstance(out, tuple) and len(out) == 2, "capture_forward must return (graph, static_y)"
        g, static_y = out
        assert hasattr(g, "replay") and isinstance(static_y, torch.Tensor), \
            f"capture_forward must return (graph, static_y); got ({type(g).__name__}, {type(static_y).__name__})"
        _probe_forward_graph(g, static_x, static_y, first_x)
        seen = [first_x]  # every input so far: a graph that reads another tensor replays one of them
        for k in range(3):
            x = torch.randn(8, 16, device=course.device())
            before = static_y.clone()
            got = run_fn(g, static_x, static_y, x)
            want = model(x)
            if _unchanged(static_y, before) and not _close(static_y, want):
                raise AssertionError("static_y did not change when the graph replayed: it is not the graph's output "
                                     "but a copy taken at capture (which computed nothing yet); return the tensor "
                                     "the capture produced, static_y = model(static_x) inside cg.graph(g)")
            if not _close(static_y, want) and any(_close(static_y, model(s)) for s in seen):
                where = ("the graph does not read static_x: it was captured reading another tensor (a copy?), "
                         "and replays whatever that tensor's memory holds (on a GPU, once the copy is dropped, "
                         "memory the allocator hands to other tensors)"
                         if _close(static_x, x) else "the new data never reached static_x: copy it in with "
                         "static_x.copy_(new_x) (rebinding the name changes nothing the graph reads)")
                raise AssertionError(f"replay {k}: the output is the model's output for earlier data, not for the "
                                     f"data just copied in; {where}")
            assert isinstance(got, torch.Tensor) and _close(got, want), \
                f"replay {k}: run_forward's result is not model(new_x)"
            assert _close(static_y, want), f"replay {k}: static_y is not model(new_x) after the replay"
            seen.append(x.clone())


def _probe_forward_graph(g, static_x, static_y, x0) -> None:
    """Two replays with marked memory: does the graph write ``static_y``, and does it read ``static_x``?

    NaN marks the memory: a replay that writes static_y replaces NaN put there, and a graph that reads static_x
    turns NaN put there into NaN in its output (a linear layer propagates it). Values alone cannot tell on a GPU:
    a graph captured reading a copy that was dropped afterwards reads whatever the allocator put in its memory.
    """
    import torch

    with torch.inference_mode(static_y.is_inference()):  # captured under inference_mode: its output is marked so
        _probe(g, static_x, static_y, x0)


def _probe(g, static_x, static_y, x0) -> None:
    import torch

    static_y.fill_(float("nan"))
    static_x.copy_(x0)
    g.replay()
    if bool(torch.isnan(static_y).all()):
        raise AssertionError("static_y did not change when the graph replayed: it is not the graph's output but a "
                             "copy taken at capture (which computed nothing yet); return the tensor the capture "
                             "produced, static_y = model(static_x) inside cg.graph(g)")
    static_x.fill_(float("nan"))
    g.replay()
    reads = bool(torch.isnan(static_y).any())
    static_x.copy_(x0)
    if not reads:
        raise AssertionError("the graph does not read static_x: it was captured reading another tensor (a copy?), "
                             "so a replay never sees what you copy into static_x (on a GPU it reads whatever that "
                             "tensor's memory holds once the copy is dropped); capture static_y = model(static_x)")


# ------------------------------------------------------------------------------------------------ 02.7
B = "02.7 capture a training step"


def _twin_steps(twin, hyper, batches) -> tuple:
    import torch

    opt = torch.optim.Adam(twin.parameters(), **hyper)
    return [train_step(twin, opt, x, y) for x, y in batches], opt


def check_train_step(capture_fn, train_fn, steps: int = 4) -> None:
    """02.7: ``capture_fn(model, static_x, static_y) -> (graph, optimizer, static_loss)``;
    ``train_fn(g, static_x, static_y, static_loss, batches) -> losses``; against eager train_step."""
    import torch

    dev = course.device()
    with exercise(B, hint=[
                "which of the recipe's steps does the check name? warm-up, side stream, grads, autocast",
                "Adam(..., capturable=True); a few train_step calls on a side stream; "
                "optimizer.zero_grad(set_to_none=True); then capture forward (under autocast), backward and step; to "
                "train, copy each batch into static_x and static_y and replay",
                "a smaller example: the whole-step capture of section 6 above captures forward, backward and step in "
                "one graph; its losses come out of one static tensor, cloned after every replay"],
            answer="with cg.graph(g): with torch.autocast(AMP_DEVICE, AMP_DTYPE, cache_enabled=False): static_loss = "
                   "train_loss(model, static_x, static_y); then static_loss.backward(); opt.step(); and per batch: "
                   "copy_, g.replay(), losses.append(static_loss.detach().clone())"), restored():
        model = mlp(seed=7)
        twin = copy.deepcopy(model)
        static_x, static_y = torch.randn(32, 16, device=dev), torch.randn(32, 4, device=dev)
        x0, y0 = static_x.clone(), static_y.clone()
        with _watching(model, optimizers=True) as watch:
            out = capture_fn(model, static_x, static_y)
        assert isinstance(out, tuple) and len(out) == 3, \
            "capture_train_step must return (graph, optimizer, static_loss)"
        g, opt, static_loss = out
        assert isinstance(opt, torch.optim.Adam), \
            f"the second value must be the Adam optimizer, not {type(opt).__name__}"
        # a non-capturable step inside the capture is named whether or not this torch raised for it
        problem = watch.recipe_problem(steps=True) or watch.step_problem()
        assert problem is None, problem
        captured = next(c for c in watch.calls if c["capturing"])
        device_type, dtype = amp()
        assert captured["dtype"] == dtype, (f"the captured forward ran in {captured['dtype']}: capture it under "
                                            f"torch.autocast({device_type!r}, {dtype}, cache_enabled=False)")
        assert captured["grads_none"], ("the gradients were not None when the capture began: call "
                                        "optimizer.zero_grad(set_to_none=True) before capturing, so backward() "
                                        "creates them in the graph's pool and every replay overwrites them (as "
                                        "it is, every replay adds this step's gradients to the last ones)")
        warm = sum(1 for s in watch.steps if not s["capturing"])
        group = opt.param_groups[0]
        hyper = {k: group[k] for k in ("lr", "betas", "eps", "weight_decay", "amsgrad")} | {"capturable": True}
        _, twin_opt = _twin_steps(twin, hyper, [(x0, y0)] * warm)
        for p, q in zip(model.parameters(), twin.parameters()):
            assert _close(p, q), (f"after your {warm} warm-up steps the parameters differ from {warm} eager "
                                  "train_step calls: warm up with the same step you capture")
        batches = [(torch.randn(32, 16, device=dev), torch.randn(32, 4, device=dev)) for _ in range(steps)]
        losses = train_fn(g, static_x, static_y, static_loss, batches)
        want = [train_step(twin, twin_opt, x, y) for x, y in batches]
        assert losses is not None and len(losses) == steps, \
            f"train_graphed must return one loss per batch: got {0 if losses is None else len(losses)} for {steps}"
        losses = [torch.as_tensor(v) for v in losses]
        if steps > 1 and all(_unchanged(v, losses[-1]) for v in losses) and not _close(want[0], want[-1]):
            raise AssertionError("every loss you returned holds the last replay's value: they are the graph's "
                                 "static loss tensor, overwritten by each replay; keep static_loss.detach().clone()")
        for k, (got, exp) in enumerate(zip(losses, want)):
            assert _close(got.reshape(()), exp), (
                f"loss of batch {k}: {got.item():.5f}, eager training gives {exp.item():.5f}: copy each batch "
                "into static_x AND static_y (static_x.copy_(x)) before replaying")
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            assert _close(p, q), (f"after {steps} replays {name} differs from {warm + steps} eager steps of an "
                                  f"identical model (tolerance rtol {TOL['rtol']}, atol {TOL['atol']})")


# ------------------------------------------------------------------------------------------------ 02.8
C = "02.8 two graphs, one pool"


def _pools_in_words(pools: dict) -> str:
    """``{batch: pool id}`` said in words: which graphs share a pool, which have one of their own."""
    groups: dict = {}
    for b in sorted(pools):
        groups.setdefault(pools[b], []).append(b)
    if all(len(g) == 1 for g in groups.values()):
        return "each graph (batches " + ", ".join(map(str, sorted(pools))) + ") has a pool of its own"
    return "; ".join(f"the batch-{g[0]} graph has a pool of its own" if len(g) == 1 else
                     "batches " + ", ".join(map(str, g)) + " share one pool" for g in groups.values())


def check_shared_pool(capture_fn, serve_fn, sizes=(16, 64)) -> None:
    """02.8: ``capture_fn(model, sizes) -> {batch: (graph, static_x, static_y)}`` sharing one pool, largest first;
    ``serve_fn(graphs, x)`` replays the graph for ``x``'s batch and returns a result that outlives later replays."""
    import torch

    dev = course.device()
    big, small = max(sizes), min(sizes)
    with exercise(C, hint=[
                "the check says what happened to the first result when the other graph replayed",
                "one pool for both captures, the largest first; a result you return must not be a graph's static "
                "output (the other graph may reuse that memory as scratch)",
                "a smaller example: y8 = serve(8 rows); serve(4 rows) may overwrite y8's memory if y8 is graph 8's "
                "static output; y8 = static_y.clone() keeps it"],
            answer="pool = cg.graph_pool_handle(); for b in sorted(sizes, reverse=True): ... with cg.graph(g, "
                   "pool=pool): static_y = model(static_x); serve: copy_, replay, return static_y.clone()"), restored(), torch.no_grad():
        model = mlp(seed=8)
        with _watching(model) as watch:
            graphs = capture_fn(model, sizes)
        assert isinstance(graphs, dict) and set(graphs) == set(sizes), \
            f"capture_buckets must return a dict {{batch: (graph, static_x, static_y)}} for batches {sorted(sizes)}"
        for b in sizes:
            problem = watch.recipe_problem(batch=b)
            assert problem is None, problem
        order = [c["batch"] for c in watch.calls if c["capturing"]]
        assert order == sorted(sizes, reverse=True), (
            f"captured batches {order}: capture the largest first, so the smaller graph fits in memory the larger "
            "one's capture already holds")
        pools = {b: tuple(graphs[b][0].pool()) for b in sizes}
        assert len(set(pools.values())) == 1, (f"the graphs do not share one pool: {_pools_in_words(pools)}; capture "
                                               "every graph with the same pool= (cg.graph_pool_handle(), or the "
                                               "first graph's .pool())")
        requests = [small, big, small, big]
        results = []
        for k, b in enumerate(requests):
            x = torch.randn(b, 16, device=dev)
            got = serve_fn(graphs, x)
            assert isinstance(got, torch.Tensor) and _close(got, model(x)), \
                f"request {k} (batch {b}): the result is not model(x)"
            results.append((b, x, got))
            for j, (bj, xj, out) in enumerate(results[:-1]):
                if not _close(out, model(xj)):
                    how = (f"replaying the batch-{b} graph overwrote it: the graphs share one pool, and a graph's "
                           "output may sit in memory another graph uses as scratch" if bj != b else
                           f"the next replay of the batch-{b} graph overwrote it: it is the graph's static output")
                    raise AssertionError(f"the result of request {j} (batch {bj}) changed after request {k}: {how}; "
                                         "return a copy (static_y.clone()) or consume it before the next replay")
