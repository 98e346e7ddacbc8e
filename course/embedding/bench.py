"""GPU experiments of the embedding labs (registered with :func:`course.core.reference.experiment`).

Kernel time here is **device time per call from CUDA-graph replay**: ``calls``
back-to-back calls are captured into one graph, the graph is replayed between two CUDA
events, and the time is divided by ``calls``. A Numba launch costs 100+ us of Python on
the host, which would otherwise hide the kernel (that launch cost is the subject of the
course, measured separately in ``embedding_small_lookup``).

Bandwidth: GB/s = (bytes read + bytes written) / time, with 1 GB = 1e9 bytes. A lookup
reads ``N*D`` elements of the table and ``N`` ids and writes ``N*D`` elements; a copy
reads and writes its size once.
"""
from __future__ import annotations

import gc

import torch
import torch.nn.functional as F

from course import embedding as E
import course.core.isolate as isolate
from course.core.reference import experiment
from course.core.results import Result
from course.core.timing import graph_time, time_device  # noqa: F401 (graph_time is part of this module's API)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def run_isolated(func: str, **kwargs):
    """``course.embedding.bench.<func>(**kwargs)`` in a fresh process
    (:func:`course.core.isolate.run_isolated`).

    Used for the experiments that start ``torch.profiler``, as a precaution: whatever state the
    profiler (CUPTI) leaves behind stays in that process, away from the timings of the experiments
    after it.
    """
    return isolate.run_isolated("course.embedding.bench", func, **kwargs)


def gbps(nbytes: float, seconds: float) -> float:
    """Bandwidth in GB/s (1 GB = 1e9 bytes)."""
    return nbytes / seconds / 1e9


def lookup_bytes(n_ids: int, dim: int, dtype, id_dtype=torch.int64) -> int:
    """Bytes a lookup moves: rows read + ids read + rows written."""
    el = torch.empty((), dtype=dtype).element_size()
    return 2 * n_ids * dim * el + n_ids * torch.empty((), dtype=id_dtype).element_size()


# the bound: a kernel that only reads and writes
SM_COPY = "copy on the SMs (torch.mul(src, 1, out=out))"
MEMCPY = "memcpy device-to-device (cudaMemcpyAsync)"
NUMBA_KERNELS = {  # label -> keyword arguments of course.embedding.embedding
    "numba naive (1 thread per element)": dict(impl="naive"),
    "numba fast, 4-byte words": dict(impl="fast", word_bytes=4),
    "numba fast, 8-byte words": dict(impl="fast", word_bytes=8),
    "numba fast, 16-byte words": dict(impl="fast", word_bytes=16),
}


@experiment("embedding_bandwidth", quick=dict(n_ids=4096, dim=512, vocab=1000, calls=3, repeats=3))
def embedding_bandwidth(n_ids: int = 65536, dim: int = 4096, vocab: int = 32000,
                        dtypes=("float32", "bfloat16"), calls: int = 10, repeats: int = 10, seed: int = 0) -> Result:
    """Lookup bandwidth of F.embedding and each Numba kernel, beside a device-to-device copy of the
    output size."""
    from course.core.capture import require_gpu
    require_gpu("the embedding bandwidth benchmark")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows = []
    for dname in dtypes:
        dtype = DTYPES[dname]
        weight = torch.randn(vocab, dim, device="cuda", generator=gen).to(dtype)
        ids = torch.randint(0, vocab, (n_ids,), device="cuda", generator=gen)
        out = torch.empty(n_ids, dim, device="cuda", dtype=dtype)
        src = torch.empty_like(out).copy_(weight[ids])
        want = F.embedding(ids, weight)
        nbytes = lookup_bytes(n_ids, dim, dtype)
        copy_bytes = 2 * out.numel() * out.element_size()
        entries = [(SM_COPY, lambda: torch.mul(src, 1, out=out), copy_bytes,
                    True),
                   (MEMCPY, lambda: out.copy_(src), copy_bytes, True),
                   ("F.embedding", lambda: F.embedding(ids, weight), nbytes, True)]
        for label, kw in NUMBA_KERNELS.items():
            E.embedding(ids, weight, out=out, bounds="device", **kw)
            exact = bool(torch.equal(out, want))
            entries.append((label, lambda kw=kw: E.embedding(ids, weight, out=out, bounds="device", **kw),
                            nbytes, exact))
        base = None
        for label, fn, moved, exact in entries:
            t = graph_time(fn, calls=calls, repeats=repeats)
            bw = gbps(moved, t.median)
            if label == "F.embedding":
                base = bw
            rows.append(dict(dtype=dname, kernel=label, us_per_call=t.us, q1_us=t.q1 * 1e6, q3_us=t.q3 * 1e6,
                             GB_per_s=bw, vs_F_embedding=None, exact=exact))
        for r in rows:
            if r["dtype"] == dname:
                r["vs_F_embedding"] = r["GB_per_s"] / base
        E.check_errors()
        del weight, ids, out, src, want
        gc.collect()
        torch.cuda.empty_cache()
    res = Result("embedding_bandwidth",
                 f"Embedding lookup, {n_ids} ids x {dim} dims (table {vocab} rows): device "
                 f"time per call from CUDA-graph replay of {calls} back-to-back calls",
                 {"dtype": "", "kernel": "", "us_per_call": "us", "q1_us": "us", "q3_us": "us", "GB_per_s": "GB/s",
                  "vs_F_embedding": "x", "exact": ""}, rows,
                 params=dict(n_ids=n_ids, dim=dim, vocab=vocab, dtypes=list(dtypes), calls=calls, repeats=repeats))
    for dname in dtypes:
        numba = [r for r in rows if r["dtype"] == dname and r["kernel"].startswith("numba")]
        best = max(numba, key=lambda r: r["GB_per_s"])
        res.add_summary(f"best_numba_{dname}", best["kernel"])
        res.add_summary(f"best_numba_vs_F_embedding_{dname}", best["vs_F_embedding"], "x")
        res.add_summary(f"copy_GB_per_s_{dname}", res.column("GB_per_s", dtype=dname, kernel=SM_COPY)[0], "GB/s")
        res.add_summary(f"memcpy_GB_per_s_{dname}", res.column("GB_per_s", dtype=dname, kernel=MEMCPY)[0], "GB/s")
    return res


@experiment("embedding_small_lookup", quick=dict(repeats=5, inner=5))
def embedding_small_lookup(n_ids: int = 128, dim: int = 128, vocab: int = 32000, dtype: str = "float32",
                           repeats: int = 25, inner: int = 20) -> Result:
    """A small lookup: eager launches vs CUDA-graph replay of one call (device time and host time
    per call)."""
    from course.core.capture import try_capture
    from course.core.timing import time_enqueue
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(vocab, dim, device="cuda", generator=gen).to(DTYPES[dtype])
    ids = torch.randint(0, vocab, (n_ids,), device="cuda", generator=gen)
    fns = {"F.embedding": lambda: F.embedding(ids, weight),
           "numba fast": lambda: E.embedding(ids, weight, bounds="device"),
           "numba naive": lambda: E.embedding(ids, weight, impl="naive", bounds="device")}
    rows = []
    for label, fn in fns.items():
        outcome = try_capture(fn)
        assert outcome.ok, f"{label} could not be captured: {outcome.error}"
        for mode, call in (("eager", fn), ("graph replay", outcome.graph.replay)):
            dev_t = time_device(call, warmup=5, repeats=repeats, inner=inner)
            host_t = time_enqueue(call, warmup=5, repeats=repeats, inner=inner)
            rows.append(dict(kernel=label, mode=mode, device_us=dev_t.us, q1_us=dev_t.q1 * 1e6, q3_us=dev_t.q3 * 1e6,
                             host_us=host_t.us))
        del outcome
    E.check_errors()
    res = Result("embedding_small_lookup",
                 f"Small lookup ({n_ids} ids x {dim} dims, {dtype}): time per "
                 "call, eager vs CUDA-graph replay (device_us: CUDA events around "
                 f"{inner} back-to-back calls; host_us: time to issue a call)",
                 {"kernel": "", "mode": "", "device_us": "us", "q1_us": "us", "q3_us": "us", "host_us": "us"}, rows,
                 params=dict(n_ids=n_ids, dim=dim, vocab=vocab, dtype=dtype, repeats=repeats, inner=inner))
    eager = res.column("device_us", kernel="numba fast", mode="eager")[0]
    replay = res.column("device_us", kernel="numba fast", mode="graph replay")[0]
    res.add_summary("numba_fast_eager_us", eager, "us")
    res.add_summary("numba_fast_replay_us", replay, "us")
    res.add_summary("replay_speedup", eager / replay, "x")
    return res


@experiment("embedding_bounds_modes", quick=dict(repeats=5))
def embedding_bounds_modes(n_ids: int = 128, dim: int = 128, vocab: int = 32000, repeats: int = 20) -> Result:
    """bounds='host' vs bounds='device': cost per call, does the host wait, can it be captured, when
    errors show."""
    from course.core.blocking import host_blocking
    from course.core.capture import try_capture
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(vocab, dim, device="cuda", generator=gen)
    ids = torch.randint(0, vocab, (n_ids,), device="cuda", generator=gen)
    bad = ids.clone()
    bad[7] = vocab + 5
    rows = []
    for bounds in ("host", "device"):
        fn = (lambda b=bounds: E.embedding(ids, weight, bounds=b))
        t = time_device(fn, warmup=5, repeats=repeats, inner=10)
        rep = host_blocking(fn, sleep_ms=20)
        cap = try_capture(fn)
        try:
            E.embedding(bad, weight, bounds=bounds)
            torch.cuda.synchronize()
            when = "never"
            try:
                E.check_errors()
            except E.EmbeddingIndexError:
                when = "later, at check_errors()"
        except E.EmbeddingIndexError:
            when = "at the call"
        rows.append(dict(bounds=bounds, device_us=t.us, host_waits=bool(rep.blocked),
                         host_return_ms=rep.host_return_ms, captured=cap.ok,
                         capture_error="" if cap.ok else f"{cap.error_type}: "
                                                         f"{cap.error}", error_reported=when))
    return Result("embedding_bounds_modes",
                  f"Out-of-range checks for a {n_ids} x {dim} lookup: on the host (exact, "
                  "immediate, a sync) or on the device (an error flag, checked later)",
                  {"bounds": "", "device_us": "us", "host_waits": "", "host_return_ms": "ms", "captured": "",
                   "capture_error": "", "error_reported": ""}, rows,
                  params=dict(n_ids=n_ids, dim=dim, vocab=vocab, repeats=repeats))


def _verify_rows() -> dict:
    from course.embedding.verify import run_checks
    rows, texts = [], {}
    for impl in ("cpu-copy", "device"):
        lines = []
        checks = run_checks(impl, log=lines.append)
        texts[impl] = "\n".join(lines)
        for c in checks:
            rows.append(dict(impl=impl, check=c.title, passed=c.passed, detail=" | ".join(c.lines)))
    return dict(rows=rows, texts=texts)


@experiment("embedding_verify", quick={})
def embedding_verify() -> Result:
    """The verify-embedding report for both implementations (rows: one per check; summary: the
    printed reports).

    Runs in its own process (it uses the profiler; see :func:`run_isolated`).
    """
    from course.core.capture import require_gpu
    require_gpu("verify-embedding")
    out = run_isolated("_verify_rows")
    res = Result("embedding_verify", "verify-embedding: capture, replay, "
                                     "device-resident ids, asynchrony",
                 {"impl": "", "check": "", "passed": "", "detail": ""}, out["rows"])
    for impl, text in out["texts"].items():
        res.add_summary(f"report_{impl}", text)
    return res


@experiment("embedding_swap_timing", quick=dict(tokens=(1, 256), repeats=5, inner=5))
def embedding_swap_timing(tokens=(1, 16, 256, 4096), vocab: int = 32000, dim: int = 512, out_features: int = 512,
                          repeats: int = 15, inner: int = 10) -> Result:
    """The small model (embedding -> linear): eager cpu-copy vs eager device vs graph replay, per
    forward."""
    from course.core.capture import try_capture
    from course.embedding.swap import make_model, swap
    model = make_model(vocab, dim, out_features)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for n in tokens:
        ids = torch.randint(0, vocab, (n,), device="cuda", generator=gen)
        swap(model, "device")
        outcome = try_capture(lambda: model(ids))
        assert outcome.ok, f"capture failed: {outcome.error}"
        modes = (("eager cpu-copy", "cpu-copy", lambda: model(ids)),
                 ("eager device", "device", lambda: model(ids)),
                 ("graph replay (device)", "device", outcome.graph.replay))
        for mode, impl, fn in modes:
            swap(model, impl)
            t = time_device(fn, warmup=3, repeats=repeats, inner=inner)
            rows.append(dict(tokens=n, mode=mode, us=t.us, q1_us=t.q1 * 1e6, q3_us=t.q3 * 1e6))
        del outcome
    E.check_errors()
    res = Result("embedding_swap_timing",
                 f"TinyModel (embedding {vocab}x{dim} -> linear {dim}->{out_features}): "
                 f"time per forward (CUDA events around {inner} back-to-back forwards)",
                 {"tokens": "", "mode": "", "us": "us", "q1_us": "us", "q3_us": "us"}, rows,
                 params=dict(tokens=list(tokens), vocab=vocab, dim=dim, out_features=out_features))
    n = tokens[0]
    res.add_summary("cpu_copy_vs_device_eager", res.column("us", tokens=n, mode="eager cpu-copy")[0]
                    / res.column("us", tokens=n, mode="eager device")[0], "x")
    res.add_summary("device_eager_vs_replay", res.column("us", tokens=n, mode="eager device")[0]
                    / res.column("us", tokens=n, mode="graph replay (device)")[0], "x")
    return res


@experiment("embedding_sync_timeline", quick=dict(sleep_ms=5))
def embedding_sync_timeline(sleep_ms: float = 20.0, tokens: int = 128) -> Result:
    """Host-blocking timeline: GPU busy with a long sleep, when does forward() return? (both impls)
    """
    from course.core.blocking import host_blocking
    from course.embedding.swap import SwapEmbedding
    emb = SwapEmbedding(32000, 256, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, 32000, (tokens,), device="cuda")
    rows = []
    res_blocked = {}
    for impl in ("cpu-copy", "device"):
        emb.impl = impl
        rep = host_blocking(lambda: emb(ids), sleep_ms=sleep_ms)
        res_blocked[impl] = rep
        rows.append(dict(impl=impl, lane=f"{impl}: GPU", name=f"queued GPU work ({sleep_ms:g} ms sleep), then lookup",
                         start_us=0.0, dur_us=rep.gpu_busy_ms * 1e3))
        rows.append(dict(impl=impl, lane=f"{impl}: CPU", name="forward() call, until it returns",
                         start_us=0.0, dur_us=rep.host_return_ms * 1e3))
    res = Result("embedding_sync_timeline",
                 "When does forward() return while the GPU is "
                 f"busy for {sleep_ms:g} ms? (host clock)",
                 {"impl": "", "lane": "", "name": "", "start_us": "us", "dur_us": "us"}, rows,
                 params=dict(sleep_ms=sleep_ms, tokens=tokens))
    for impl, rep in res_blocked.items():
        res.add_summary(f"host_return_ms_{impl}", rep.host_return_ms, "ms")
        res.add_summary(f"host_waits_{impl}", bool(rep.blocked))
    return res


_KEEP_CPU = ("aten::to", "aten::_to_copy", "aten::copy_", "cudaMemcpy", "cudaStreamSynchronize",
             "cudaDeviceSynchronize", "cuLaunchKernel", "cudaLaunchKernel", "forward")


def _short(name: str) -> str:
    for key, label in (("_fast16_body", "numba fast kernel "
                                        "(16-byte words)"), ("_fast_body", "numba fast kernel"),
                       ("_naive_body", "numba naive kernel"), ("sleep", "GPU sleep (queued work)"),
                       ("spin", "GPU sleep (queued work)")):
        if key in name:
            return label
    return name if len(name) <= 48 else name[:45] + "..."


def _profile_rows(sleep_ms: float, tokens: int) -> dict:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    from course.core.blocking import gpu_sleep, sleep_cycles_per_ms
    from course.embedding.swap import SwapEmbedding
    emb = SwapEmbedding(32000, 256, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, 32000, (tokens,), device="cuda")
    rows, summary = [], {}
    sleep_cycles_per_ms()  # calibrate the GPU sleep now, not inside a trace
    # warm-up: first-session costs
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
        for impl in ("cpu-copy", "device"):
            emb.impl = impl
            gpu_sleep(sleep_ms)
            emb(ids)
        torch.cuda.synchronize()
    for impl in ("cpu-copy", "device"):
        emb.impl = impl
        emb(ids)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            gpu_sleep(sleep_ms)
            with record_function("forward"):
                emb(ids)
            torch.cuda.synchronize()
        events = []
        for e in prof.events():
            on_gpu = e.device_type == DeviceType.CUDA
            if (on_gpu and e.name != "forward") or (not on_gpu and any(k in e.name for k in _KEEP_CPU)):
                events.append((e.time_range.start, e.time_range.elapsed_us(), "GPU" if on_gpu else "CPU", e.name))
        t0 = min(s for s, *_ in events)
        fwd = [(s, d) for s, d, lane, n in events if lane == "CPU" and n == "forward"]
        f0, f1 = (fwd[0][0], fwd[0][0] + fwd[0][1]) if fwd else (t0, float("inf"))
        # CPU events up to the end of forward() (not the trace's own final synchronize), every GPU
        # event
        events = [e for e in events if e[2] == "GPU" or e[0] <= f1]
        for start, dur, lane, name in sorted(events)[:60]:
            rows.append(dict(impl=impl, lane=f"{impl}: {lane}", name=_short(name), start_us=float(start - t0),
                             dur_us=float(dur)))
        waits = [d for s, d, lane, n in events
                 if lane == "CPU" and f0 <= s <= f1 and ("Synchronize" in n or "cudaMemcpy" in n)]
        summary[impl] = dict(
            dtoh=sum(1 for *_, lane, n in events if lane == "GPU" and ("DtoH" in n or "Device -> P" in n)),
            wait=max(waits or [0.0]), forward=float(fwd[0][1]) if fwd else 0.0)
    return dict(rows=rows, summary=summary)


@experiment("embedding_profile", quick=dict(sleep_ms=1.0))
def embedding_profile(sleep_ms: float = 2.0, tokens: int = 128) -> Result:
    """torch.profiler trace of one forward per impl, behind ``sleep_ms`` of queued GPU work.

    Runs in its own process (see :func:`run_isolated`). Summary: device-to-host copies,
    the longest host wait (a copy or sync call) inside forward(), forward()'s host time.
    """
    from course.core.capture import require_gpu
    require_gpu("profiling the embedding")
    out = run_isolated("_profile_rows", sleep_ms=sleep_ms, tokens=tokens)
    res = Result("embedding_profile",
                 f"torch.profiler: one forward ({tokens} ids) "
                 f"behind {sleep_ms:g} ms of queued GPU work",
                 {"impl": "", "lane": "", "name": "", "start_us": "us", "dur_us": "us"}, out["rows"],
                 params=dict(sleep_ms=sleep_ms, tokens=tokens))
    for impl, s in out["summary"].items():
        res.add_summary(f"dtoh_copies_{impl}", s["dtoh"])
        res.add_summary(f"longest_host_wait_us_{impl}", s["wait"], "us")
        res.add_summary(f"forward_cpu_us_{impl}", s["forward"], "us")
    return res
