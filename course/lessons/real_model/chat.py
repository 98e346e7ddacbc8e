"""A chat prompt answered by a captured token loop, beside ``model.generate``.

The prompt is prefilled into the decoder's KV cache (one eager forward), then the loop decodes from
its last token at position ``L-1``, one replay per token; :func:`written` measures the positions it
wrote.
"""
from __future__ import annotations

import torch

QUESTION = "What is a CUDA graph? Explain it to a Python programmer in three sentences."


def chat_ids(tokenizer, question: str = QUESTION, device=None):
    """``question`` as one user turn in the tokenizer's chat template, the assistant's turn opened:
    int64 ``[1, L]``."""
    if tokenizer is None:
        raise ValueError("this checkpoint has no tokenizer: a chat prompt needs one (load a "
                         "checkpoint that ships its tokenizer files, or the default SmolLM2)")
    if not getattr(tokenizer, "chat_template", None):
        ids = tokenizer(question, return_tensors="pt")["input_ids"]
    else:
        turn = [{"role": "user", "content": question}]
        enc = tokenizer.apply_chat_template(turn, add_generation_prompt=True, return_tensors="pt")
        ids = enc if isinstance(enc, torch.Tensor) else enc["input_ids"]
    return ids.long().to(device) if device is not None else ids.long()


def prefill(decoder, prompt) -> None:
    """Write the K/V of ``prompt[0, :-1]`` (positions ``0..L-2``) into ``decoder.cache_for(1)``, in
    one eager forward (the cache's counter set to 0 first)."""
    if prompt.dim() != 2 or prompt.shape[0] != 1:
        raise ValueError(f"prompt must be int64 [1, L], got {tuple(prompt.shape)}")
    if prompt.shape[1] >= decoder.max_len:
        raise ValueError(f"a prompt of {prompt.shape[1]} tokens does not fit the decoder's "
                         f"{decoder.max_len} positions")
    if prompt.shape[1] < 2:
        return
    cache = decoder.cache_for(1)
    for layer in cache.layers:
        layer.cumulative_length.zero_()
    n = prompt.shape[1] - 1
    with torch.no_grad():
        positions = torch.arange(n, device=prompt.device).view(1, n)
        decoder.model(input_ids=prompt[:, :n], position_ids=positions, past_key_values=cache,
                      use_cache=True)


def generate_tokens(model, prompt, n: int):
    """``model.generate``'s greedy answer to ``prompt`` (at most ``n`` new tokens, stops at
    end-of-sequence): (tokens int64 ``[1, m]``, logits float32 ``[m, vocab]``)."""
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n,
                             do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    return out.sequences[:, prompt.shape[1]:], torch.cat([s.float() for s in out.logits], dim=0)


def agreement(got, want) -> int:
    """How many leading tokens ``got`` and ``want`` (``[1, *]``) share."""
    n = min(got.shape[1], want.shape[1])
    differ = (got[0, :n] != want[0, :n]).nonzero()
    return int(differ[0]) if len(differ) else n


def divergence(logits, want, got, step: int, tokenizer=None) -> dict:
    """At ``step`` where the loop chose ``got`` and generate ``want``: both tokens and their logits
    in generate's ``logits`` (``[m, vocab]``), the gap, and bfloat16's spacing at that magnitude
    (the gap's scale of noise)."""
    row = logits[step]
    w, g = int(want[0, step]), int(got[0, step])
    lw, lg = float(row[w]), float(row[g])
    # 8 bits of mantissa
    spacing = 2.0 ** (torch.tensor(abs(lw)).log2().floor().item() - 7) if lw else 2.0 ** -7
    text = (lambda t: repr(tokenizer.decode([t]))) if tokenizer is not None else str
    return {"step": step, "generate": text(w), "loop": text(g), "generate_logit": lw,
            "loop_logit": lg,
            "gap": lw - lg, "bf16_spacing": spacing}


def answer(loop, decoder, prompt, n: int) -> dict:
    """The captured ``loop``'s answer to ``prompt`` after a prefill, beside ``model.generate``'s:
    ``tokens``, ``want`` (generate's, up to end-of-sequence), ``want_logits``, ``agree``,
    ``compared``, ``start`` and ``written`` (the cache positions the loop wrote). Capture the loop
    first."""
    if prompt.shape[1] + n > decoder.max_len:
        raise ValueError(f"prompt ({prompt.shape[1]}) + {n} tokens exceed the decoder's "
                         f"{decoder.max_len} positions")
    prefill(decoder, prompt)
    start = prompt.shape[1] - 1
    before = snapshot(decoder.cache_for(1))
    with torch.no_grad():
        got = loop.generate(prompt[0, -1:], n, start=start)
    want, logits = generate_tokens(decoder.model, prompt, n)
    return {"tokens": got, "want": want, "want_logits": logits, "agree": agreement(got, want),
            "compared": want.shape[1], "start": start, "written": written(before,
                                                                          decoder.cache_for(1))}


def snapshot(cache) -> tuple:
    """Copies of layer 0's keys and values of ``cache`` (a ``StaticCache``): what :func:`written`
    compares with."""
    layer = cache.layers[0]
    return layer.keys.detach().clone(), layer.values.detach().clone()


def written(before: tuple, cache) -> list:
    """The positions of ``cache`` whose keys or values differ from :func:`snapshot`'s ``before``, in
    order."""
    keys, values = snapshot(cache)
    dims = (0, 1, 3)  # [batch, kv heads, position, head dim]
    changed = (keys != before[0]).any(dim=dims) | (values != before[1]).any(dim=dims)
    return [int(p) for p in changed.nonzero().flatten()]


def prompt_for(model, length: int = 6, seed: int = 1):
    """``length`` token ids (int64 ``[1, length]``) for ``model``, on its device, from a seeded
    generator."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (1, length), generator=g)
    return ids.to(next(model.parameters()).device)


def until_eos(tokens, eos) -> list:
    """The token ids of ``tokens`` (``[1, n]``) up to and including the first end-of-sequence id."""
    ids = tokens[0].tolist()
    eos = set(eos if isinstance(eos, (list, tuple)) else [eos])
    for i, t in enumerate(ids):
        if t in eos:
            return ids[:i + 1]
    return ids
