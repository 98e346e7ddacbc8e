"""The hooks lesson 02's capture checks watch the learner's code with (:mod:`course.lessons.capture_checks`).

:class:`Watch` sees, on both paths alike, each call of the model (was a capture under way, was the default stream
current, the batch, the output's dtype, were the gradients None) and each optimizer step (capturing, stream,
whether its param groups are capturable), and which stream waited for which (:mod:`course.core.stream_order`):
enough to name a missing warm-up, a warm-up on the default stream, a missing fork or join of the side stream or a
non-capturable optimizer inside a capture, whatever error CUDA raised first. :func:`restored` leaves the notebook
usable however the learner's code ends, with the garbage collector off while it runs.
"""
from __future__ import annotations

import contextlib

import course
from course.core.stream_order import StreamOrder

SIDE = ("warm up on a side stream: side = cg.Stream(); side.wait_stream(cg.current_stream()); "
        "with cg.stream(side): ...; then cg.current_stream().wait_stream(side)")


class Watch:
    """Hooks on a model (and, with ``optimizers=True``, on every optimizer's ``step``), removed by :meth:`close`."""

    def __init__(self, model, optimizers: bool = False):
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        self.cg, self.calls, self.steps = course.graphs(), [], []
        self.model = model
        self.order = StreamOrder(self.cg)  # which stream waited for which: a missing fork or join
        self._handles = [model.register_forward_hook(self._forward)]
        if optimizers:
            self._handles.append(register_optimizer_step_pre_hook(self._step))

    def _where(self) -> dict:
        return {"capturing": bool(self.cg.is_current_stream_capturing()),
                "default": self.cg.current_stream() == self.cg.default_stream()}

    def _forward(self, module, args, out) -> None:
        where = self._where()
        self.order.work(where["capturing"])
        self.calls.append({**where, "batch": args[0].shape[0], "dtype": out.dtype,
                           "grads_none": all(p.grad is None for p in self.model.parameters())})

    def _step(self, optimizer, args, kwargs) -> None:
        self.steps.append({**self._where(), "optimizer": type(optimizer).__name__,
                           "capturable": all(g.get("capturable", False) for g in optimizer.param_groups)})

    def step_problem(self):
        """An optimizer step attempted inside the capture by an optimizer that is not capturable, or None."""
        bad = next((s for s in self.steps if s["capturing"] and not s["capturable"]), None)
        if bad is None:
            return None
        return (f"{bad['optimizer']}.step() ran inside the capture with param_groups' capturable is False: torch "
                "refuses it (a non-capturable optimizer keeps its step count on the host, where a graph would freeze "
                f"it). Create it with torch.optim.{bad['optimizer']}(..., capturable=True)")

    def close(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self.order.close()

    def recipe_problem(self, batch=None, steps: bool = False):
        """What the calls say is missing from the recipe (for one batch size), or None."""
        calls = [c for c in self.calls if batch is None or c["batch"] == batch]
        what = "the model" if batch is None else f"the batch-{batch} forward"
        first = next((i for i, c in enumerate(calls) if c["capturing"]), None)
        if first is None:
            return f"{what} never ran during a capture: call it inside `with cg.graph(g):`"
        if first == 0:
            return (f"{what} never ran before its capture: warm it up first (a few eager calls), so lazy "
                    f"initialisation and the allocator's first blocks happen outside the graph; {SIDE}")
        if any(c["default"] for c in calls[:first]):
            return ("the warm-up ran on the default stream; PyTorch's notes say warmup must occur on a side stream: "
                    + SIDE)
        if self.order.problem is not None:
            return self.order.problem
        if steps:
            start = next((i for i, s in enumerate(self.steps) if s["capturing"]), len(self.steps))
            warm = self.steps[:start]
            if not warm:
                return ("no optimizer.step() before the capture: Adam creates its state (step count, moments) on "
                        "its first step, so inside the graph every replay would create it afresh; warm up with "
                        "whole training steps (train_step)")
            if any(s["default"] for s in warm):
                return f"the warm-up's optimizer steps ran on the default stream: {SIDE}"
        return None


def _line(e: BaseException) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def _root(e: BaseException) -> BaseException:
    """The first error of a chain (a host read inside a capture, before ``capture_end`` failed because of it)."""
    while e.__context__ is not None and e.__context__ is not e:
        e = e.__context__
    return e


@contextlib.contextmanager
def _watching(model, optimizers: bool = False, batch=None):
    """A :class:`Watch` for the learner's call: an error the call raises is explained by the recipe's gaps first."""
    watch = Watch(model, optimizers)
    try:
        yield watch
    except NotImplementedError:  # the exercise is not done yet: say so, not what is missing
        raise
    except Exception as e:  # noqa: BLE001 - re-raised unless the hooks or the first error name the cause
        problem, root = watch.recipe_problem(batch, optimizers), _root(e)
        if not any(c["capturing"] for c in watch.calls):  # it failed before the model ran in a capture: say that
            advice = ("; capture on a side stream: `with cg.graph(g):` makes one for you (capture_begin() must run "
                      "inside `with cg.stream(side):`)" if "non-default stream" in str(root) else "")
            raise AssertionError(f"your capture failed before the model ran in it: {_line(root)}{advice}") from e
        if problem is None and optimizers:
            problem = watch.step_problem()
        if problem is not None:
            raise AssertionError(f"{problem} (your capture then failed: {_line(e)})") from e
        if root is not e and "during capture" in str(e):  # capture_end failed because of an earlier error
            raise AssertionError(f"your capture failed: {_line(root)} (ending it then raised {_line(e)})") from e
        raise
    finally:
        watch.close()


@contextlib.contextmanager
def restored():
    """However the learner's code ends, the notebook goes on: the stream that was current is current again, no
    simulated capture is left under way, and on a GPU the random generators leave capture mode after an error.
    Garbage is collected first, and the collector stays off until the check ends: a graph left in a reference
    cycle by an earlier run must not be freed in the middle of the learner's capture (lesson 03: that invalidates
    the capture, and the ✗ would blame their code)."""
    import gc

    from course.core.capture import collector_paused

    gc.collect()
    cg = course.graphs()
    before = cg.current_stream()
    try:
        with collector_paused():
            yield
    except BaseException:
        if getattr(cg, "SIMULATED", False):
            from course.sim.graph import end_all_captures

            end_all_captures()
        else:
            from course.core.capture import reset_rng_capture_state

            with contextlib.suppress(RuntimeError):
                cg.synchronize()
            reset_rng_capture_state()
        raise
    finally:
        cg.set_stream(before)
