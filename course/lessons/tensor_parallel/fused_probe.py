"""One GPU's part of ``tp_fused_decode``: the split step's GPU path checked on a single GPU, nothing
recorded.

``python -m course.lessons.tensor_parallel.fused_probe [shape] [--modes
nccl,symm_one_shot,symm_two_shot]`` runs, in this one process with a one-rank NCCL process group:

- TP=1: lesson 07's step on the whole model of ``shape`` (default Llama-3.1-8B's, random bf16
  weights drawn on the GPU), captured, timed, against its floor (the row ``tp_fused_decode`` records
  at TP=1);
- per all-reduce mode at world size 1: the split step's code path with its 2 x layers all-reduces
  inside the graph (a one-rank all-reduce sums nothing, but its kernel, symmetric memory's
  rendezvous and the capture all run): the all-reduce's latency alone, the step's time, the
  all-reduces counted in the graph, 64 tokens against TP=1's.

A mode that fails says why on its own row and the others go on. It prints the rows
(``tp_fused_decode``'s columns) and writes them as JSON to ``--out`` when given; reference data is
written only by ``python -m course bench``.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import sys
import time


def probe(shape="llama-3.1-8b", modes=("nccl", "symm_one_shot", "symm_two_shot"), position=32,
          repeats=15, inner=10, log=print) -> tuple:
    """``(rows, failures)`` on this process's GPU (see the module doc); needs CUDA and an
    initialized one-rank NCCL process group (:func:`main` makes it)."""
    import torch

    from course.core.launch import Context
    from course.lessons.last_mile.shapes import build_shape
    from course.lessons.real_model.roofline import copy_bandwidth_GBps
    from course.lessons.tensor_parallel import bench as FB
    from course.lessons.tensor_parallel.tp import first_token

    ctx = Context(0, 1, "nccl", "cuda:0")
    bw = copy_bandwidth_GBps()
    pdl = torch.cuda.get_device_capability(0) >= (9, 0)
    t0 = time.perf_counter()
    model = build_shape(shape, device=ctx.torch_device)
    first = first_token(ctx.torch_device, model.config.vocab_size)
    log(f"probe: {shape} built in {time.perf_counter() - t0:.1f} s; copy rate {bw:,.0f} GB/s; "
        "TP=1 tokens ...")
    want = FB.reference_tokens(model, first, FB.N_TOKENS + 8, pdl)
    rows, failures = [], {}
    for mode in ("none",) + tuple(modes):
        log(f"probe: {shape} world 1, all-reduce {mode} ...")
        try:
            ar = 0.0 if mode == "none" else FB.all_reduce_us(
                mode, model.config.hidden_size, model.dtype, ctx.torch_device, None, repeats)
            rows.append(FB.measure(ctx, shape, model, 1, None, mode, want, bw, position, repeats,
                                   inner, ar))
            r = rows[-1]
            log(f"probe: {mode}: {r['us']:,.0f} us (IQR {r['q1_us']:,.0f}-{r['q3_us']:,.0f}), "
                f"{r['x_floor']:.3f}x floor {r['floor_us']:,.0f} us; all-reduces "
                f"{r['all_reduces']} issued / {r['all_reduces_graph']} in the graph at {ar:.1f} "
                f"us each; tokens equal TP=1: {r['tokens_equal']}")
        except Exception as e:  # noqa: BLE001 - one mode's failure is a finding; the others run
            failures[mode] = f"{type(e).__name__}: {e}"
            log(f"probe: {mode} failed: {failures[mode]}")
        gc.collect()
        torch.cuda.synchronize()
    del model, want
    gc.collect()
    torch.cuda.synchronize()
    return rows, failures


def main(argv=None) -> int:
    """Command line (see the module doc): 0 when TP=1 is within 1.25x its floor and every mode ran
    correctly."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape", nargs="?", default="llama-3.1-8b")
    ap.add_argument("--modes", default="nccl,symm_one_shot,symm_two_shot")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    import datetime

    import torch
    import torch.distributed as dist

    import course
    from course.core.runtime import runtime
    from course.lessons.tensor_parallel.allreduce import keep_multicast_off
    from course.lessons.tensor_parallel.bench import fused_result

    if not runtime().on_gpu:
        print(f"fused_probe needs a GPU (COURSE_PATH=cuda); {runtime().reason}")
        return 2
    env = keep_multicast_off()
    course.header()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120),
                            device_id=torch.device("cuda", 0))
    try:
        modes = tuple(m for m in a.modes.split(",") if m)
        rows, failures = probe(a.shape, modes, repeats=a.repeats)
    finally:
        gc.collect()
        torch.cuda.synchronize()
        dist.destroy_process_group()
    res = fused_result(rows, None, {"probe": "one GPU, world size 1", "multicast": env,
                                    "failures": failures})
    print(res.table())
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res.to_dict() | {"written_by": "fused_probe (not reference data)"}, f,
                      indent=1, default=str)
    one = next((r for r in rows if r["allreduce"] == "none"), None)
    ok = (one is not None and one["x_floor"] <= 1.25 and not failures
          and all(r["tokens_equal"] for r in rows))
    head = f"TP=1 at {one['x_floor']:.3f}x its floor (target <= 1.25); " if one else "no TP=1 row; "
    print(f"fused_probe: {head}modes failed: {sorted(failures) or 'none'}; verdict "
          f"{'ok' if ok else 'see above'}")
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("COURSE_PATH", "cuda")
    sys.exit(main())
