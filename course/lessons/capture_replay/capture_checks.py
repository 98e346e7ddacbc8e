"""Lesson 02's exercises 02.6-02.8 on the learner's own captures.

They run the learner's code on a fresh model against ``cg = course.graphs()`` (``torch.cuda`` on a
GPU, the simulated graphs otherwise) under one :class:`~course.core.harness.Tracer`: each call of
the model and each optimizer step, and the streams' order. The shared capture rules name the
recipe's gaps; then what the graph computes is compared with eager PyTorch.
"""
from __future__ import annotations

import contextlib
import copy

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

import course
from course.core.checks import exercise
from course.core.harness import (SIDE_RECIPE, Defect, Rule, Tracer, capture_error, capture_rules,
                                 check, expect, first_line, judge, restored, root_cause)
from course.lessons.capture_replay.checks import small_mlp
from course.lessons.capture_replay.replay import amp, train_step

TOL = {"rtol": 1e-3, "atol": 1e-5}  # graph vs eager: the same kernels run (simulator: the same ops)
A = "02.6 capture a forward by hand"
B = "02.7 capture a training step"
C = "02.8 two graphs, one pool"
MODEL = "the model"

def _close(a, b) -> bool:
    return a.shape == b.shape and torch.allclose(a.detach().float(), b.detach().float(), **TOL)


def _unchanged(a, b) -> bool:
    """Same values, NaN included (what a capture leaves in a new tensor: NaN on the simulator,
    leftovers on a GPU)."""
    return torch.allclose(a.detach().float(), b.detach().float(), rtol=0, atol=0, equal_nan=True)


def _autocast_dtype(model):
    """The dtype ``model``'s forward computes in now: autocast's, or its parameters'."""
    p = next(model.parameters())
    on = torch.is_autocast_enabled(p.device.type)
    return torch.get_autocast_dtype(p.device.type) if on else p.dtype


@contextlib.contextmanager
def watching(model, rules, optimizers: bool = False, per_batch: bool = False):
    """A :class:`Tracer` on ``model``'s calls (and every optimizer step) while the learner's
    capture runs; an error it raises is named by the broken rule of ``rules(trace)`` first, then as
    a host read or copy, or its root."""
    t = Tracer()
    t.hook(model, (lambda a, k: f"the batch-{a[0].shape[0]} forward") if per_batch else MODEL,
           batch=lambda a, k: a[0].shape[0], dtype=lambda a, k: _autocast_dtype(model),
           grads_none=lambda a, k: all(p.grad is None for p in model.parameters()))

    def step(opt, args, kwargs) -> None:
        t.note("step", optimizer=type(opt).__name__,
               capturable=all(g.get("capturable", False) for g in opt.param_groups))

    steps = register_optimizer_step_pre_hook(step) if optimizers else None
    try:
        yield t
    except NotImplementedError:  # the exercise is not done yet: say so, not what is missing
        raise
    except Exception as e:  # noqa: BLE001 - re-raised unless a rule or the first error names it
        root = root_cause(e)
        if not any(ev["where"] == "capture" for ev in t.events if ev["what"] != "step"):
            side = "non-default stream" in str(root)
            advice = ("; capture on a side stream: `with cg.graph(g):` makes one for you "
                      "(capture_begin() must run inside `with cg.stream(side):`)" if side else "")
            raise Defect("capture_failed", f"your capture failed before the model ran in it: "
                                           f"{first_line(root)}{advice}") from e
        out = judge(t, rules(t))
        if not out.ok:
            raise Defect(out.rule,
                         f"{out.message} (your capture then failed: {first_line(e)})") from e
        rule, text = capture_error(e)
        if rule:
            raise Defect(rule, text) from e
        if root is not e and "during capture" in str(e):  # capture_end failed after an error
            raise Defect("capture_failed", f"your capture failed: {first_line(root)} "
                                           f"(ending it then raised {first_line(e)})") from e
        raise
    finally:
        t.close()
        if steps is not None:
            steps.remove()


def _forward_rules(t) -> list:
    return capture_rules(MODEL, MODEL)


def _step_rules(t) -> list:
    """The model's capture rules, then the optimizer's: warm-up steps on a side stream, a capturable
    optimizer inside the capture."""
    steps = t.of("step")
    first = next((i for i, s in enumerate(steps) if s["where"] == "capture"), len(steps))
    bad = next((s for s in steps if s["where"] == "capture" and not s["capturable"]), None)
    return _forward_rules(t) + [
        expect("warm_up_steps", lambda t: steps[:first], (
            "no optimizer.step() before the capture: Adam creates its state (step count, moments) "
            "on its first step, so inside the graph every replay would create it afresh; warm up "
            "with whole training steps (train_step)")),
        expect("warm_up_steps_stream",
               lambda t: all(s["where"] != "default" for s in steps[:first]),
               f"the warm-up's optimizer steps ran on the default stream: warm up on a side stream "
               f"({SIDE_RECIPE})"),
        expect("capturable", lambda t: bad is None, lambda t: (
            f"{bad['optimizer']}.step() ran inside the capture with param_groups' capturable is "
            "False: torch refuses it (a non-capturable optimizer keeps its step count on the host, "
            "where a graph would freeze it). Create it with "
            f"torch.optim.{bad['optimizer']}(..., capturable=True)"))]


def _probe(g, static_x, static_y, x0) -> None:
    """Two replays with NaN in memory: does the graph write ``static_y``, read ``static_x``?"""
    with torch.inference_mode(static_y.is_inference()):  # as the capture ran
        static_y.fill_(float("nan"))
        static_x.copy_(x0)
        g.replay()
        writes = not bool(torch.isnan(static_y).all())
        static_x.fill_(float("nan"))
        g.replay()
        reads = bool(torch.isnan(static_y).any())
        static_x.copy_(x0)
    check({"writes": writes, "reads": reads}, [
        expect("output_is_copy", lambda t: t["writes"], _COPY_AT_CAPTURE),
        expect("reads_other", lambda t: t["reads"], (
            "the graph does not read static_x: it was captured reading another tensor (a copy?), "
            "so a replay never sees what you copy into static_x (on a GPU it reads whatever that "
            "tensor's memory holds once the copy is dropped); capture static_y = "
            "model(static_x)"))])


_COPY_AT_CAPTURE = ("static_y did not change when the graph replayed: it is not the graph's output "
                    "but a copy taken at capture (which computed nothing yet); return the tensor "
                    "the capture produced, static_y = model(static_x) inside cg.graph(g)")


def check_capture_forward(capture_fn, run_fn) -> None:
    """02.6: ``capture_fn(model, static_x) -> (graph, static_y)``; ``run_fn(g, static_x, static_y,
    new_x)`` replays."""
    with exercise(A, hint=[
                "a capture records what the model does to static_x; what must run before it, and "
                "where?",
                "in capture_forward: warm the model up on a side stream, then capture its call on "
                "static_x inside cg.graph(g) and return the graph with the very tensor that call "
                "returned; in run_forward: copy the new data into static_x and replay",
                "a smaller example: the recipe of section 1 above, on the lesson's model, is the "
                "same three steps: warm-up on a side stream, capture, replay after copy_"],
            answer="side = cg.Stream(); side.wait_stream(cg.current_stream()); with "
                   "cg.stream(side): model(static_x) three times; "
                   "cg.current_stream().wait_stream(side); g = cg.CUDAGraph(); with cg.graph(g): "
                   "static_y = model(static_x); in run: static_x.copy_(new_x); g.replay(); "
                   "return static_y"), restored(), torch.no_grad():
        model = small_mlp(seed=6)
        static_x = torch.randn(8, 16, device=course.device())
        first_x = static_x.clone()
        with watching(model, _forward_rules) as t:
            out = capture_fn(model, static_x)
        check(t, _forward_rules(t) + [
            expect("returns", lambda t: isinstance(out, tuple) and len(out) == 2,
                   "capture_forward must return (graph, static_y)"),
            expect("returns",
                   lambda t: hasattr(out[0], "replay") and isinstance(out[1], torch.Tensor),
                   lambda t: f"capture_forward must return (graph, static_y); got "
                             f"({type(out[0]).__name__}, {type(out[1]).__name__})")])
        g, static_y = out
        _probe(g, static_x, static_y, first_x)
        seen = [first_x]  # every input so far: a graph reading another tensor replays one of them
        for k in range(3):
            x = torch.randn(8, 16, device=course.device())
            before = static_y.clone()
            got, want = run_fn(g, static_x, static_y, x), model(x)
            stale = not _close(static_y, want) and any(_close(static_y, model(s)) for s in seen)
            check(got, [
                expect("output_is_copy", lambda got: _close(static_y, want)
                       or not _unchanged(static_y, before), _COPY_AT_CAPTURE),
                expect("input_not_copied", lambda got: not stale, lambda got: (
                    f"replay {k}: the output is the model's output for earlier data, not for the "
                    "data just copied in; " + (
                        "the graph does not read static_x: it was captured reading another "
                        "tensor (a copy?), and replays whatever that tensor's memory holds (on a "
                        "GPU, once the copy is dropped, memory the allocator hands to other "
                        "tensors)"
                        if _close(static_x, x) else
                        "the new data never reached static_x: copy it in with "
                        "static_x.copy_(new_x) (rebinding the name changes nothing the graph "
                        "reads)"))),
                expect("result", lambda got: isinstance(got, torch.Tensor) and _close(got, want),
                       f"replay {k}: run_forward's result is not model(new_x)"),
                expect("static_output", lambda got: _close(static_y, want),
                       f"replay {k}: static_y is not model(new_x) after the replay")])
            seen.append(x.clone())


def check_train_step(capture_fn, train_fn, steps: int = 4) -> None:
    """02.7: ``capture_fn(model, static_x, static_y) -> (graph, optimizer, static_loss)``;
    ``train_fn(g, static_x, static_y, static_loss, batches) -> losses``; against eager steps."""
    dev = course.device()
    with exercise(B, hint=[
                "which of the recipe's steps does the check name? warm-up, side stream, grads, "
                "autocast",
                "Adam(..., capturable=True); a few train_step calls on a side stream; "
                "optimizer.zero_grad(set_to_none=True); then capture forward (under autocast), "
                "backward and step; to train, copy each batch into static_x and static_y and "
                "replay",
                "a smaller example: the whole-step capture of section 6 above captures forward, "
                "backward and step in one graph; its losses come out of one static tensor, "
                "cloned after every replay"],
            answer="with cg.graph(g): with torch.autocast(AMP_DEVICE, AMP_DTYPE, "
                   "cache_enabled=False): static_loss = train_loss(model, static_x, static_y); "
                   "then static_loss.backward(); opt.step(); and per batch: copy_, g.replay(), "
                   "losses.append(static_loss.detach().clone())"), restored():
        model = small_mlp(seed=7)
        twin = copy.deepcopy(model)
        static_x, static_y = torch.randn(32, 16, device=dev), torch.randn(32, 4, device=dev)
        x0, y0 = static_x.clone(), static_y.clone()
        with watching(model, _step_rules, optimizers=True) as t:
            out = capture_fn(model, static_x, static_y)
        check(out, [expect("returns", lambda o: isinstance(o, tuple) and len(o) == 3,
                           "capture_train_step must return (graph, optimizer, static_loss)"),
                    expect("adam", lambda o: isinstance(o[1], torch.optim.Adam),
                           lambda o: "the second value must be the Adam optimizer, not "
                                     f"{type(o[1]).__name__}")])
        g, opt, static_loss = out
        check(t, _step_rules(t))  # a non-capturable step is named whether or not torch raised
        captured = next(e for e in t.of(MODEL) if e["where"] == "capture")
        device_type, dtype = amp()
        check(captured, [
            expect("autocast", lambda c: c["dtype"] == dtype, lambda c: (
                f"the captured forward ran in {c['dtype']}: capture it under "
                f"torch.autocast({device_type!r}, {dtype}, cache_enabled=False)")),
            expect("grads_none", lambda c: c["grads_none"], (
                "the gradients were not None when the capture began: call "
                "optimizer.zero_grad(set_to_none=True) before capturing, so backward() creates "
                "them in the graph's pool and every replay overwrites them (as it is, every "
                "replay adds this step's gradients to the last ones)"))])
        warm = sum(1 for s in t.of("step") if s["where"] != "capture")
        group = opt.param_groups[0]
        twin_opt = torch.optim.Adam(twin.parameters(), **{k: group[k] for k in (
            "lr", "betas", "eps", "weight_decay", "amsgrad")}, capturable=True)
        for _ in range(warm):
            train_step(twin, twin_opt, x0, y0)
        check(twin, [expect("warm_up_steps", lambda tw: all(_close(p, q) for p, q in zip(
            model.parameters(), tw.parameters())), (
            f"after your {warm} warm-up steps the parameters differ from {warm} eager train_step "
            "calls: warm up with the same step you capture"))])
        batches = [(torch.randn(32, 16, device=dev), torch.randn(32, 4, device=dev))
                   for _ in range(steps)]
        losses = train_fn(g, static_x, static_y, static_loss, batches)
        want = [train_step(twin, twin_opt, x, y) for x, y in batches]
        check(losses, [expect("losses", lambda v: v is not None and len(v) == steps, lambda v: (
            f"train_graphed must return one loss per batch: got {0 if v is None else len(v)} "
            f"for {steps}"))])
        losses = [torch.as_tensor(v) for v in losses]
        check(losses, [
            expect("loss_not_cloned", lambda v: steps == 1 or _close(want[0], want[-1])
                   or not all(_unchanged(x, v[-1]) for x in v), (
                "every loss you returned holds the last replay's value: they are the graph's "
                "static loss tensor, overwritten by each replay; keep "
                "static_loss.detach().clone()"))] + [
            expect("loss", lambda v, k=k: _close(v[k].reshape(()), want[k]), lambda v, k=k: (
                f"loss of batch {k}: {v[k].item():.5f}, eager training gives {want[k].item():.5f}: "
                "copy each batch into static_x AND static_y (static_x.copy_(x)) before replaying"))
            for k in range(steps)])
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            check(p, [expect("parameters", lambda p: _close(p, q), (
                f"after {steps} replays {name} differs from {warm + steps} eager steps of an "
                f"identical model (tolerance rtol {TOL['rtol']}, atol {TOL['atol']})"))])


def _pools_in_words(pools: dict) -> str:
    """``{batch: pool id}`` in words: which graphs share a pool, which have one of their own."""
    groups: dict = {}
    for b in sorted(pools):
        groups.setdefault(pools[b], []).append(b)
    if all(len(g) == 1 for g in groups.values()):
        batches = ", ".join(map(str, sorted(pools)))
        return f"each graph (batches {batches}) has a pool of its own"
    return "; ".join(f"the batch-{g[0]} graph has a pool of its own" if len(g) == 1 else
                     f"batches {', '.join(map(str, g))} share one pool" for g in groups.values())


def check_shared_pool(capture_fn, serve_fn, sizes=(16, 64)) -> None:
    """02.8: ``capture_fn(model, sizes) -> {batch: (graph, static_x, static_y)}`` in one pool,
    largest first; ``serve_fn(graphs, x)`` replays ``x``'s graph; its result outlives later
    replays."""
    dev = course.device()
    big, small = max(sizes), min(sizes)
    with exercise(C, hint=[
                "the check says what happened to the first result when the other graph replayed",
                "one pool for both captures, the largest first; a result you return must not be a "
                "graph's static output (the other graph may reuse that memory as scratch)",
                "a smaller example: y8 = serve(8 rows); serve(4 rows) may overwrite y8's memory if "
                "y8 is graph 8's static output; y8 = static_y.clone() keeps it"],
            answer="pool = cg.graph_pool_handle(); for b in sorted(sizes, reverse=True): ... with "
                   "cg.graph(g, pool=pool): static_y = model(static_x); serve: copy_, replay, "
                   "return static_y.clone()"), restored(), torch.no_grad():
        model = small_mlp(seed=8)

        def rules(t) -> list:
            names = [f"the batch-{b} forward" for b in sizes]
            order = [e["batch"] for e in t.events if e["where"] == "capture"]
            first = expect("largest_first", lambda t: order == sorted(sizes, reverse=True), (
                f"captured batches {order}: capture the largest first, so the smaller graph fits "
                "in memory the larger one's capture already holds"))
            return [r for name in names for r in capture_rules(name, name)] + [first]

        with watching(model, rules, per_batch=True) as t:
            graphs = capture_fn(model, sizes)
        check(graphs, [expect("returns", lambda g: isinstance(g, dict) and set(g) == set(sizes), (
            f"capture_buckets must return a dict {{batch: (graph, static_x, static_y)}} for "
            f"batches {sorted(sizes)}"))])
        pools = {b: tuple(graphs[b][0].pool()) for b in sizes}
        check(t, rules(t) + [expect("one_pool", lambda t: len(set(pools.values())) == 1, (
            f"the graphs do not share one pool: {_pools_in_words(pools)}; capture every graph with "
            "the same pool= (cg.graph_pool_handle(), or the first graph's .pool())"))])
        results = []
        for k, b in enumerate([small, big, small, big]):
            x = torch.randn(b, 16, device=dev)
            got = serve_fn(graphs, x)
            right = isinstance(got, torch.Tensor) and _close(got, model(x))
            check(got, [expect("result", lambda got: right,
                               f"request {k} (batch {b}): the result is not model(x)")])
            results.append((b, x, got))
            for j, (bj, xj, out) in enumerate(results[:-1]):
                how = (f"replaying the batch-{b} graph overwrote it: the graphs share one pool, "
                       "and a graph's output may sit in memory another graph uses as scratch"
                       if bj != b else f"the next replay of the batch-{b} graph overwrote it: it "
                       "is the graph's static output")
                check(out, [Rule("overwritten", "", lambda out: "" if _close(out, model(xj)) else (
                    f"the result of request {j} (batch {bj}) changed after request {k}: {how}; "
                    "return a copy (static_y.clone()) or consume it before the next replay"))])
