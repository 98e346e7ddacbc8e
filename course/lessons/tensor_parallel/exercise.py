"""Exercise 08.1, run: the learner's ``tp_generate`` on every rank, watched by :mod:`~.referee`, against TP=1.

:func:`exercise_worker` is what each rank runs: it builds the model (the same seed on every rank), decodes TP=1
with the whole model for the reference, splits the model by hand over the ranks
(:class:`~course.lessons.tensor_parallel.shard.HandShardedDecoder`), and calls each function it was given with a
watched step and graph API. Each function's outcome is a dict (``ok``, ``kind``, ``message``, ``tokens``), so one
launch judges several functions (the tests run the answer and its wrong variants in one launch). :func:`check_capture`
launches it for one function and raises the named ✗ (AssertionError) when the function is wrong, and
NotImplementedError when it still raises it (the learner's "not done yet").
"""
from __future__ import annotations

import gc

import torch

import course.lessons.tensor_parallel.referee as R


def _run_one(ctx, fn, dec, first, want, n_tokens: int, timeout_s: float) -> dict:
    import course

    referee = R.Referee(ctx, timeout_s)
    cg = course.graphs()
    dec.reset()
    ids = first.view(1, 1).clone()
    position = torch.zeros(1, dtype=torch.long, device=first.device)
    try:
        with torch.no_grad():
            out = fn(ctx, R.WatchedStep(dec.step, referee, cg), ids, position, n_tokens, R.WatchedGraphs(cg, referee))
        if not isinstance(out, torch.Tensor) or out.numel() != n_tokens:
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            tokens = None
            referee.done([])
            return {"ok": False, "kind": "wrong", "tokens": None,
                    "message": f"tp_generate must return the {n_tokens} tokens as a tensor [1, {n_tokens}], got {shape}"}
        tokens = [int(t) for t in out.reshape(-1).tolist()]
        tokens = referee.done(tokens)
    except R.CaptureDefect as e:
        return {"ok": False, "kind": e.kind, "message": str(e), "tokens": None}
    except NotImplementedError as e:  # the learner's TODO, on every rank alike: "not done yet", not a crash
        return {"ok": False, "kind": "not_done", "message": str(e), "tokens": None}
    finally:
        gc.collect()  # the learner's graph goes before the next run (and before the process group)
        from course.core.runtime import synchronize
        synchronize()
    if tokens != want:
        at = next((i for i, (a, b) in enumerate(zip(tokens, want)) if a != b), 0)
        return {"ok": False, "kind": "wrong", "tokens": tokens,
                "message": f"{R.DEFECTS['wrong']} from token {at} on: {tokens[at:at + 4]} where TP=1 gives "
                           f"{want[at:at + 4]} (a stale output kept without .clone(), a token not fed back into the "
                           "static input, or a position not advanced?)"}
    return {"ok": True, "kind": "", "message": "", "tokens": tokens}


def exercise_worker(ctx, fns, n_tokens: int = 6, size="tiny", timeout_s: float = 60.0) -> list:
    """On every rank: each function of ``fns`` (functions or cell sources) judged in turn (see the module doc)."""
    from course.lessons.real_model.decode import StaticDecoder
    from course.lessons.real_model.generate import greedy
    from course.lessons.real_model.model import build_model
    from course.lessons.tensor_parallel.shard import HandShardedDecoder
    from course.lessons.tensor_parallel.workers import first_token

    model = build_model(size, device=ctx.torch_device)
    first = first_token(ctx.torch_device, model.config.vocab_size)
    want = greedy(StaticDecoder(model, 64).step, first, n_tokens)[0].tolist()  # TP=1, the whole model
    dec = HandShardedDecoder(model, ctx.rank, ctx.world_size, max_len=64)
    del model
    out = []
    for fn in fns:
        fn = fn.load() if hasattr(fn, "load") else fn
        out.append(_run_one(ctx, fn, dec, first, want, n_tokens, timeout_s))
    return out


def run_capture(fns, world_size: int = 2, n_tokens: int = 6, timeout: float = 240.0) -> list:
    """Launch :func:`exercise_worker` for ``fns`` (written in notebook cells or modules); rank 0's outcomes."""
    from course.core.cell_workers import portable
    from course.core.launch import launch, plan

    p = plan(world_size)
    sent = [portable(f) for f in fns]
    return launch(exercise_worker, p.world_size, backend=p.backend, timeout=timeout, fns=sent, n_tokens=n_tokens,
                  timeout_s=min(60.0, timeout / 2))[0]


def check_capture(fn, world_size: int = 2, n_tokens: int = 6, timeout: float = 240.0) -> list:
    """Exercise 08.1's check: ``fn`` on every rank; its tokens, or AssertionError with the named ✗."""
    from course.core.launch import WorkerTimeout

    try:
        res = run_capture([fn], world_size, n_tokens, timeout)[0]
    except WorkerTimeout as e:
        raise AssertionError(f"the ranks did not all finish within {timeout:.0f} s (a rank waiting in a collective "
                             f"that another never joins?); every process was stopped.\n{e}") from None
    if res["kind"] == "not_done":
        raise NotImplementedError(res["message"])
    if not res["ok"]:
        raise AssertionError(res["message"])
    return res["tokens"]
