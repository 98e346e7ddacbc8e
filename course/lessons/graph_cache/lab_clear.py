"""Lab 3's step 7 check: ``set_enabled`` and ``clear_cache`` (re-exported by :mod:`course.lessons.graph_cache.lab`).

A cleared cache must give back what its captures held: no graph alive, nothing left in their memory pool, and the
memory reserved down by at least what the pool held (on a GPU, the allocator's segments of that pool). On a GPU the
passing check then says what stays reserved and on which stream (:func:`what_stays`): none of it is the cache's.
"""
from __future__ import annotations

import gc

import torch

from course.core.checks import exercise
from course.core.runtime import torch_device
from course.lessons.graph_cache.counting import counting


def reserved_now(backend) -> int:
    """The backend's reserved memory once garbage is collected (and, on a GPU, the allocator's cache emptied).

    What a cache's recordings hold shows up here only while something references them, so the difference
    before and after ``clear_cache()`` is the memory that clearing gave back.
    """
    gc.collect()
    if backend.name != "recording":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return backend.memory_reserved()


def what_stays(freed: int, held: int, snapshot, streams=None) -> str:
    """One sentence after a clear: the bytes it gave back (``freed``) against what the captures' pool held (``held``),
    and what stays reserved, by stream and pool, from ``snapshot`` (``torch.cuda.memory_snapshot()`` after it;
    ``streams``: stream handle -> name)."""
    from course.lessons.graph_cache.memory_ledger import MiB, by_stream_pool

    where = by_stream_pool(snapshot, streams or {})
    left = sum(where.values())
    pools = sum(v for k, v in where.items() if not k.endswith("/ordinary"))
    parts = ", ".join(f"{v / MiB:.1f} MiB on {k.split('/')[0]}" for k, v in where.items()) or "nothing"
    return (f"clear_cache() gave back {freed / MiB:.1f} MiB (the captures' pool held {held / MiB:.1f} MiB); "
            f"{left / MiB:.1f} MiB stay reserved ({parts}), {pools / MiB:.1f} MiB of it in a graph pool: outside "
            "the captures' pool, what stays is the caller's (its tensors) and torch's (a cuBLAS workspace per stream "
            "that ran a matrix product since the clear)")


def check_enable_clear(cls) -> None:
    """Step 7: set_enabled(False) runs eager, graphs kept; clear_cache() empties the captures' pool (a GPU's segments
    in it: :meth:`CountingBackend.pool_bytes`) and reserved memory falls by at least what it held."""
    with exercise("lab 3.7 enable and clear", hint=[
                "disabled: the cache is bypassed but keeps its graphs; cleared: nothing of the old graphs is left, in"
                " the cache or in the backend's pool",
                "set_enabled stores the flag and __call__ runs self.fn eagerly while it is off; clear_cache empties "
                "self.entries, keeps no other reference to them, and calls self.backend.reset_pool()",
                "a smaller example: d.clear() while another name still holds one of d's graphs keeps it alive"],
            answer="self.enabled = bool(enabled); clear_cache: self.entries.clear(); self.backend.reset_pool()"), \
            counting() as _counted:
        d = torch_device()
        w = torch.randn(8, 8, generator=torch.Generator().manual_seed(7)).to(d)
        forward = lambda x: x @ w + 1  # noqa: E731
        cache, backend = _counted(cls, forward)
        x = torch.ones(2, 8, device=d)
        cache(x)
        cache.set_enabled(False)
        assert torch.allclose(cache(x), forward(x), atol=1e-5) and backend.replays == 1, "disabled: run it eagerly"
        assert cache.stats["eager_calls"] == 1, "count the disabled call as an eager call"
        cache.set_enabled(True)
        cache(x)
        assert backend.replays == 2 and backend.captures == 1, "enabled again: the recorded graph is replayed"
        before = reserved_now(backend)
        held = backend.pool_bytes()
        cache.clear_cache()
        assert not cache.entries, "clear_cache() must drop every entry (their graphs and static buffers)"
        assert backend.pool_resets >= 1, (
            "clear_cache() never called self.backend.reset_pool(): the backend keeps the dropped graphs' pool and "
            "would put the next captures into it. Call it after emptying self.entries, so they start a fresh pool")
        live = backend.live_graphs()
        if live:
            gc.collect()
            assert backend.live_graphs() == live, (
                f"clear_cache() dropped the entries, but {live - backend.live_graphs()} graph(s) lived on until the "
                "garbage collector ran: a reference cycle held them. The collector may run in the middle of a later "
                "capture, and a graph freed there breaks it (lesson 03): keep no cycle (nothing that refers back to "
                "the cache or the entry) around your entries, so that clearing frees the graphs at once")
        after = reserved_now(backend)
        left = backend.pool_bytes()
        assert not backend.live_graphs(), (
            f"clear_cache() emptied self.entries, but the memory the graphs held did not come back ({before} bytes "
            f"reserved before, {after} after): something still references the old entries or their recordings. "
            "Keep no copy of them (no second dict or list, no saved entry): a graph's memory is freed only when "
            "nothing references it")
        assert not left, (
            f"the graphs are freed, but {left} of the {held} bytes their memory pool held stayed reserved: something "
            "still references a tensor the capture made (a graph's static output, entry['output'], or a view of it), "
            "and its memory keeps the pool's. Return copies (copy_out) and keep no reference to a static output "
            "outside its entry")
        assert before - after >= held, (
            f"clear_cache() freed the graphs and their pool, but reserved memory fell by only {before - after} bytes "
            f"({before} before, {after} after), less than the {held} bytes the pool held")
        if backend.name != "recording":
            print(what_stays(before - after, held, torch.cuda.memory_snapshot(),
                             {torch.cuda.default_stream().cuda_stream: "the default stream"}))
        cache(x)
        assert backend.captures == 2 and cache.stats["cache_misses"] == 2, "after clear_cache() the next call records"
