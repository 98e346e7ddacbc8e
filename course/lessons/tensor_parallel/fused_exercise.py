"""Exercise 08.2's check: the learner's layer of the split fused step, where the residual and the all-reduces go.

The learner writes ``split_layer(k, layer, position)``: one layer on one rank, with ``k``'s methods ``qkv``,
``attend``, ``o_proj(layer, residual=...)``, ``gate_up``, ``down(layer, residual=...)``, ``all_reduce()`` and its
``k.rank``, ``k.world`` (a :class:`~course.lessons.tensor_parallel.fused.FusedShardDecoder`). The check
(:func:`check_split_layer`) starts the ranks (NCCL on 2+ GPUs, else gloo CPU processes) and, on every rank:

1. **traces** the function: calls it for two layers with a :class:`Tracer` that records the calls and runs
   nothing; the ranks exchange their traces over a gloo group with a time limit, and :func:`judge` names the first
   defect every rank sees alike (:data:`DEFECTS`): the ranks calling different collectives (a branch on the rank
   around an all-reduce, which would leave the others waiting), an all-reduce missing or in the wrong place, the
   residual added on several ranks or on none. No collective of the learner's runs before this agrees, so none can
   hang;
2. **runs** it: the split step (captured in one graph per rank on GPUs) decodes a few greedy tokens, against lesson
   07's step on the whole model (TP=1).
"""
from __future__ import annotations

import datetime
import gc

DEFECTS = {
    "not_done": "split_layer still raises NotImplementedError",
    "error": "split_layer raised an error",
    "kernels": "the layer's five kernels do not run once each, in order",
    "branch": "the ranks call different collectives",
    "missing": "an all-reduce is missing",
    "misplaced": "an all-reduce is in the wrong place",
    "double": "the residual is added on more than one rank (counted once per rank)",
    "lost": "the residual is added on no rank",
    "wrong": "the tokens differ from TP=1",
}
ORDER = ("qkv", "attend", "o_proj", "gate_up", "down")


class Tracer:
    """A stand-in for the decoder: records each call as ``(name, residual)``, computes nothing."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world, self.calls = rank, world, []

    def qkv(self, layer, position):
        """Records kernel 1."""
        self.calls.append(("qkv", None))

    def attend(self, layer, position):
        """Records kernel 2."""
        self.calls.append(("attend", None))

    def o_proj(self, layer, residual=True):
        """Records kernel 3 and whether it adds the residual."""
        self.calls.append(("o_proj", bool(residual)))

    def gate_up(self, layer):
        """Records kernel 4."""
        self.calls.append(("gate_up", None))

    def down(self, layer, residual=True):
        """Records kernel 5 and whether it adds the residual."""
        self.calls.append(("down", bool(residual)))

    def all_reduce(self):
        """Records an all-reduce."""
        self.calls.append(("all_reduce", None))


def trace(fn, rank: int, world: int, layers: int = 2):
    """``("ok", calls per layer)`` of ``fn`` on ``rank``, or ``("not_done" | "error", message)``."""
    out = []
    try:
        for layer in range(layers):
            t = Tracer(rank, world)
            fn(t, layer, None)
            out.append(tuple(t.calls))
    except NotImplementedError as e:
        return ("not_done", str(e))
    except Exception as e:  # noqa: BLE001 - the learner's error, reported on every rank
        return ("error", f"{type(e).__name__}: {e}")
    return ("ok", tuple(out))


def judge(traces: list) -> tuple:
    """``(kind, message)`` of the first defect in every rank's :func:`trace` (rank order), or ``("", "")``."""
    for kind in ("not_done", "error"):
        bad = [r for r, t in enumerate(traces) if t[0] == kind]
        if bad:
            return kind, f"{DEFECTS[kind]} on rank(s) {bad}: {traces[bad[0]][1]}"
    per_rank = [t[1] for t in traces]
    shape = [tuple(tuple(n for n, _ in layer) for layer in t) for t in per_rank]
    if any(s != shape[0] for s in shape):
        return "branch", (f"{DEFECTS['branch']}: rank by rank, layer 0 calls {[list(s[0]) for s in shape]}. A collective "
                          "completes only when every rank reaches it: no branch on the rank around an all-reduce (a "
                          "rank-dependent argument, such as which rank adds the residual, is fine)")
    for i, layer in enumerate(per_rank[0]):
        names = [n for n, _ in layer]
        kernels = [n for n in names if n != "all_reduce"]
        if kernels != list(ORDER):
            return "kernels", f"{DEFECTS['kernels']}: layer {i} runs {kernels}, want {list(ORDER)}"
        n = names.count("all_reduce")
        if n < 2:
            return "missing", (f"{DEFECTS['missing']}: layer {i} has {n}, and each of o_proj and down_proj leaves a "
                               "partial sum on every rank that must be summed before the next kernel reads x")
        want = ["qkv", "attend", "o_proj", "all_reduce", "gate_up", "down", "all_reduce"]
        if names != want:
            return "misplaced", (f"{DEFECTS['misplaced']}: layer {i} runs {names}; an all-reduce belongs right after "
                                 "each partial sum (o_proj, down), before the next kernel that reads x whole, and "
                                 "nowhere else (a second sum of whole values multiplies them by the ranks)")
    for proj in ("o_proj", "down"):
        adders = [r for r, t in enumerate(per_rank) if dict(t[0])[proj]]
        if len(adders) > 1:
            return "double", (f"{DEFECTS['double']}: {proj} adds it on ranks {adders}, so the all-reduce sums it "
                              f"{len(adders)} times; let one rank add it (e.g. residual=k.rank == 0)")
        if not adders:
            return "lost", f"{DEFECTS['lost']}: {proj} adds it on no rank; exactly one rank must add it"
    return "", ""


def _exchange(ctx, obj, timeout_s: float) -> list:
    import torch.distributed as dist

    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    out = [None] * ctx.world_size
    dist.all_gather_object(out, obj, group=group)
    return out


def exercise_worker(ctx, fns, n_tokens: int = 4, size: str = "tiny", timeout_s: float = 60.0) -> list:
    """On every rank: each function of ``fns`` (functions or cell sources) traced, judged, run (see the module doc);
    a dict per function (``ok``, ``kind``, ``message``, ``tokens``)."""
    import torch

    from course.core.runtime import runtime, synchronize
    from course.lessons.last_mile.decoder import TritonDecoder, graphed
    from course.lessons.real_model.generate import greedy
    from course.lessons.real_model.model import build_model
    from course.lessons.tensor_parallel.fused import FusedShardDecoder
    from course.lessons.tensor_parallel.workers import first_token

    fns = [f.load() if hasattr(f, "load") else f for f in fns]
    traces = _exchange(ctx, [trace(f, ctx.rank, ctx.world_size) for f in fns], timeout_s)  # every rank's, per function
    verdicts = [judge([t[i] for t in traces]) for i in range(len(fns))]  # the same verdicts on every rank
    if all(kind for kind, _ in verdicts):  # nothing to run
        return [{"ok": False, "kind": k, "message": m, "tokens": None} for k, m in verdicts]
    model = build_model(size, device=ctx.torch_device)
    first = first_token(ctx.torch_device, model.config.vocab_size)
    gpu = runtime().on_gpu
    pos0 = torch.zeros(1, dtype=torch.long, device=first.device)
    run = (lambda d: graphed(d, first.view(1, 1), pos0)) if gpu else (lambda d: d.step)
    ref = TritonDecoder(model, n_tokens + 8)
    want = greedy(run(ref), first, n_tokens)[0].tolist()  # TP=1: lesson 07's step on the whole model
    del ref
    out = []
    for i, fn in enumerate(fns):
        kind, message = verdicts[i]
        if kind:
            out.append({"ok": False, "kind": kind, "message": message, "tokens": None})
            continue
        dec = FusedShardDecoder(model, ctx.rank, ctx.world_size, None, "nccl", max_len=n_tokens + 8, layer=fn)
        try:
            got = greedy(run(dec), first, n_tokens)[0].tolist()
        finally:
            del dec
            gc.collect()
            synchronize()
        if got != want:
            at = next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)
            out.append({"ok": False, "kind": "wrong", "tokens": got,
                        "message": f"{DEFECTS['wrong']} from token {at} on: {got[at:at + 4]} where TP=1 gives "
                                   f"{want[at:at + 4]}"})
        else:
            out.append({"ok": True, "kind": "", "message": "", "tokens": got})
    return out


def run_split_layer(fns, world_size: int = 2, n_tokens: int = 4, timeout: float = 240.0) -> list:
    """Launch :func:`exercise_worker` for ``fns`` (written in notebook cells or modules); rank 0's outcomes."""
    from course.core.cell_workers import portable
    from course.core.launch import launch, plan

    p = plan(world_size)
    return launch(exercise_worker, p.world_size, backend=p.backend, timeout=timeout, fns=[portable(f) for f in fns],
                  n_tokens=n_tokens, timeout_s=min(60.0, timeout / 2))[0]


def check_split_layer(fn, world_size: int = 2, n_tokens: int = 4, timeout: float = 240.0) -> list:
    """Exercise 08.2's check: ``fn`` on every rank; its tokens, or AssertionError with the named ✗."""
    from course.core.launch import WorkerTimeout

    try:
        res = run_split_layer([fn], world_size, n_tokens, timeout)[0]
    except WorkerTimeout as e:
        raise AssertionError(f"the ranks did not all finish within {timeout:.0f} s; every process was stopped.\n{e}") \
            from None
    if res["kind"] == "not_done":
        raise NotImplementedError(res["message"])
    if not res["ok"]:
        raise AssertionError(res["message"])
    return res["tokens"]
