"""Exercise 08.1, run: the learner's ``tp_generate`` on every rank, watched by :mod:`~.referee`, against TP=1.

:func:`exercise_worker` is what each rank runs: it builds the model (the same seed on every rank), decodes TP=1
with the whole model for the reference, splits the model by hand over the ranks
(:class:`~course.lessons.tensor_parallel.shard.HandShardedDecoder`), and calls each function it was given with a
watched step and graph API (:mod:`~.watch`). Each function's outcome is a dict (``ok``, ``kind``, ``message``,
``tokens``), so one launch judges several functions (the tests run the answers and the wrong variants in one
launch). An error the learner's code raises on one rank is told to the others (:meth:`~.referee.Referee.crash`), so
every rank reports that rank's error, not a lost connection. :func:`check_capture` launches it for one function and
raises the named ✗ (AssertionError) when the function is wrong, and NotImplementedError when it still raises it
(the learner's "not done yet").
"""
from __future__ import annotations

import gc
import time
import traceback
import warnings

import torch

import course.lessons.tensor_parallel.referee as R

EXCHANGE_S = 20.0  # a rank that does not reach the next event within this stops the others
HOST_SYNC = ("a host read or a wait inside the capture ({key}): .item(), int(), .tolist(), print of a tensor or a "
             "synchronize inside `with cg.graph(graph):` asks for a value while the capture only records work, so "
             "CUDA refuses it and the capture fails (\"operation failed due to a previous error during capture\"). "
             "Keep the next token on the device (nxt = step(ids, position).argmax(-1, keepdim=True)) and read "
             "tokens only after the loop")


def classify(e: BaseException, filename: str) -> tuple:
    """An error the learner's code raised on this rank, as ``(kind, message)``: a host read inside the capture, the
    TODO (NotImplementedError), or another error with the line of ``tp_generate`` (``filename``) it came from."""
    if isinstance(e, NotImplementedError):
        return "not_done", str(e)
    chain, x = [], e
    while x is not None and len(chain) < 5:
        chain.append(f"{type(x).__name__}: {x}")
        x = x.__context__
    text = " | ".join(chain)
    for key in ("operation not permitted when stream is capturing", "previous error during capture"):
        if key in text:
            return "host_sync", HOST_SYNC.format(key=key)
    lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if f.filename == filename]
    where = f" (line {lines[-1]} of tp_generate)" if lines else ""
    return "crash", f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}{where}"


def _reset(referee, cg, graphs) -> None:
    """After each function: no capture left under way, the stream back, the GPU usable again."""
    from course.core.runtime import runtime, synchronize

    for g in graphs.made:
        g.abandon()
    referee.close()
    cg.set_stream(referee.start_stream)
    if runtime().on_gpu:
        from course.core.capture import recover
        for g in graphs.made:
            if g.failed:
                recover(graph=g.graph)  # a graph whose capture failed is kept alive (torch may still call into it)
        recover()
    else:
        from course.sim.graph import end_all_captures
        end_all_captures()
    gc.collect()  # the learner's graph goes before the next run (and before the process group)
    synchronize()


def _run_one(ctx, fn, dec, first, want, n_tokens: int, timeout_s: float) -> dict:
    import course
    from course.core.agree import RankLost
    from course.core.runtime import runtime
    from course.lessons.tensor_parallel.watch import WatchedGraphs, WatchedStep

    cg = course.graphs()
    dec.reset()
    ids = first.view(1, 1).clone()
    position = torch.zeros(1, dtype=torch.long, device=first.device)
    referee = R.Referee(ctx, cg, n_tokens, timeout_s, runtime().on_gpu)
    graphs = WatchedGraphs(cg, referee)
    try:
        try:
            with torch.no_grad(), warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*CUDA Graph is empty.*")
                out = fn(ctx, WatchedStep(dec.step, referee), ids, position, n_tokens, graphs)
        except (R.CaptureDefect, RankLost):
            raise
        except Exception as e:  # noqa: BLE001 - the learner's error on this rank: every rank names it
            referee.crash(*classify(e, fn.__code__.co_filename))
        shape = ""
        if not isinstance(out, torch.Tensor) or out.numel() != n_tokens:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            shape = f"tp_generate must return the {n_tokens} tokens as a tensor [1, {n_tokens}], got {got}"
        tokens = referee.done(None if shape else [int(t) for t in out.reshape(-1).tolist()], shape)
    except R.CaptureDefect as e:
        if e.kind == "not_done":
            return {"ok": False, "kind": "not_done", "message": str(e).split(": ", 1)[1], "tokens": None}
        return {"ok": False, "kind": e.kind, "message": str(e), "tokens": None}
    except RankLost as e:
        return {"ok": False, "kind": "crash", "message": f"{R.TITLES['crash']}: {e}", "tokens": None}
    finally:
        _reset(referee, cg, graphs)
    if tokens != want:
        kind, message = referee.diagnose(tokens, want)
        return {"ok": False, "kind": kind, "tokens": tokens, "message": f"{R.TITLES[kind]}: {message}"}
    return {"ok": True, "kind": "", "message": "", "tokens": tokens}


def exercise_worker(ctx, fns, n_tokens: int = 6, size="tiny", timeout_s: float = EXCHANGE_S) -> list:
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
        ctx.say(f"judging {getattr(fn, '__name__', fn)} ({len(out) + 1} of {len(fns)})")
        t0 = time.monotonic()
        out.append(_run_one(ctx, fn, dec, first, want, n_tokens, timeout_s))
        out[-1]["seconds"] = time.monotonic() - t0
    return out


def run_capture(fns, world_size: int = 2, n_tokens: int = 6, timeout: float = 120.0) -> list:
    """Launch :func:`exercise_worker` for ``fns`` (written in notebook cells or modules); rank 0's outcomes."""
    from course.core.cell_workers import portable
    from course.core.launch import launch, plan

    p = plan(world_size)
    sent = [portable(f) for f in fns]
    return launch(exercise_worker, p.world_size, backend=p.backend, timeout=timeout, pg_timeout=3 * EXCHANGE_S,
                  fns=sent, n_tokens=n_tokens)[0]


def check_capture(fn, world_size: int = 2, n_tokens: int = 6, timeout: float = 120.0) -> list:
    """Exercise 08.1's check: ``fn`` on every rank; its tokens, or AssertionError with the named ✗."""
    from course.core.launch import WorkerError, WorkerTimeout

    try:
        res = run_capture([fn], world_size, n_tokens, timeout)[0]
    except WorkerTimeout as e:
        raise AssertionError(f"the ranks did not all finish within {timeout:.0f} s (a rank waiting in a collective "
                             f"that another never joins?); every process was stopped.\n{e}") from None
    except WorkerError as e:
        raise AssertionError(f"rank {e.first} stopped outside tp_generate's watched calls: {e}") from None
    if res["kind"] == "not_done":
        raise NotImplementedError(res["message"])
    if not res["ok"]:
        raise AssertionError(res["message"])
    return res["tokens"]
