"""What a captured loop did to the decoder's KV cache when it went on from a prompt (lab 4's steps 5 and 6).

After a prefill wrote the prompt's keys and values at positions ``0..start-1`` of the decoder's own cache
(``decoder.cache_for(1)``, :func:`~course.lessons.real_model.chat.prefill`), ``loop.generate(last, n, start)`` must
read them and write positions ``start..start+n-1`` of that same cache, one per replay, leaving the prompt's alone.
Which positions a ``generate`` wrote is measured, not guessed: :func:`snapshot` keeps layer 0's keys and values
before it, :func:`written` compares them after it, and :func:`problem` names what the measurement shows:

- nothing written: the graph reads and writes a cache of its own, so it never sees the prompt (a stale cache);
- the prompt's positions written from 0: ``generate`` ignored ``start`` and began at position 0;
- the prompt's keys and values zeroed: ``generate`` emptied the cache (a reset) before decoding;
- other positions than ``start..start+n-1``: the position was set or advanced wrongly.
"""
from __future__ import annotations

import torch

OWN_CACHE = ("your graph never wrote the decoder's KV cache (decoder.cache_for(1)): during generate no position of it "
             "changed, so the graph reads and writes a cache of its own, made apart from the decoder's. The prompt's "
             "keys and values are prefilled into the decoder's cache, so your loop never sees the prompt and answers "
             "as if there were none. Capture with the decoder's cache: self.cache = decoder.cache_for(1), made "
             "before the capture")


def snapshot(cache) -> tuple:
    """Copies of layer 0's keys and values of ``cache`` (a ``StaticCache``): what :func:`written` compares with."""
    layer = cache.layers[0]
    return layer.keys.detach().clone(), layer.values.detach().clone()


def written(before: tuple, cache) -> list:
    """The positions of ``cache`` whose keys or values differ from :func:`snapshot`'s ``before``, in order."""
    keys, values = snapshot(cache)
    k0, v0 = before
    dims = tuple(d for d in range(keys.dim()) if d != 2)  # [batch, kv heads, position, head dim]
    changed = (keys != k0).any(dim=dims) | (values != v0).any(dim=dims)
    return [int(p) for p in changed.nonzero().flatten()]


def _span(positions) -> str:
    ps = list(positions)
    if not ps:
        return "none"
    return f"{ps[0]}..{ps[-1]}" if ps == list(range(ps[0], ps[-1] + 1)) else ", ".join(map(str, ps[:8])) + (
        ", ..." if len(ps) > 8 else "")


def problem(before: tuple, cache, start: int, n: int) -> str:
    """Why ``generate(last, n, start)`` mishandled the prompt in ``cache`` (see the module doc); '' when it did not.

    ``before``: :func:`snapshot` of ``cache`` after the prefill, before ``generate``; the prompt holds ``0..start-1``.
    """
    pos = written(before, cache)
    want = list(range(start, start + n))
    if pos == want:
        return ""
    if not pos:
        return OWN_CACHE
    prompt = [p for p in pos if p < start]
    if prompt:
        k, v = snapshot(cache)
        zeroed = bool((k[:, :, :start] == 0).all() and (v[:, :, :start] == 0).all())
        if zeroed:
            return (f"generate emptied the KV cache: the prompt's keys and values (positions 0..{start - 1}, "
                    "written by the prefill) are zeros after it. A new sequence needs no reset (every replay writes "
                    "its own position before it attends over 0..position): keep what the prefill wrote, and start at "
                    "`start` (self.pos.fill_(start))")
        if prompt[0] == 0 and pos == list(range(0, len(pos))):
            return (f"generate decoded from position 0, not from start={start}: it wrote positions {_span(pos)} over "
                    f"the prompt's keys and values. The position buffer must hold `start` before the first replay "
                    "(self.pos.fill_(start)): 0 for a new sequence, the prompt's last position after a prefill")
        return (f"generate overwrote the prompt's keys and values (positions {_span(prompt)} of 0..{start - 1}); it "
                f"should write {_span(want)} only: set the position to `start` (self.pos.fill_(start)) and advance it "
                "by one per token (self.pos.add_(1))")
    return (f"generate wrote positions {_span(pos)} of the KV cache, not {_span(want)} (one per token from "
            f"start={start}): set the position to `start` before the first replay (self.pos.fill_(start)) and advance "
            "it by one after each (self.pos.add_(1))")


def prompt_for(model, length: int = 6, seed: int = 1):
    """``length`` token ids (int64 ``[1, length]``) for ``model``, on its device, from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (1, length), generator=g)
    return ids.to(next(model.parameters()).device)
