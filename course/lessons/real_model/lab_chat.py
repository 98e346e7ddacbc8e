"""Lab 4.6's check: the learner's captured loop (step 5) answers a chat prompt on a trained Llama.

The notebook cell builds the learner's class on the trained model's decoder and runs
:func:`~course.lessons.real_model.chat.answer` (a prefill, then ``generate(last, n, start=L-1)``, beside
``model.generate``). :func:`check_chat` judges what that run measured:

- the positions of the decoder's KV cache the loop wrote (:mod:`~course.lessons.real_model.continuation`): exactly
  ``L-1..L+n-2``, the prompt's left as the prefill wrote them. Anything else is named by what was written (nothing:
  a cache of its own; from 0: ``start`` ignored; zeros: a reset);
- the tokens: in float32 every one of them is ``model.generate``'s; in bfloat16 the two paths add the same products
  in different orders, so where the top two logits are closer than bfloat16's spacing the answers may part, and the
  ✓ says where.

The ✓ carries the text the loop wrote (``course check`` prints it too), with what a 135M-parameter model's text is
worth: fluent, and not to be taken as a fact.
"""
from __future__ import annotations

import torch

from course.core.checks import exercise
from course.lessons.real_model.chat import divergence, until_eos

NAME = "lab 4.6 your loop answers a chat prompt"
HINT = ["a prompt's keys and values are written into the decoder's KV cache by the prefill; the graph must read that "
        "cache and go on from the prompt's last position",
        "in MyGraphedDecode: the cache is the decoder's (self.cache = decoder.cache_for(1)), and generate sets the "
        "position buffer to its `start` argument before the first replay, then advances it by one per token",
        "a smaller example: a prompt of 5 tokens fills positions 0..3; generate(prompt[0, -1:], 3, start=4) must write "
        "positions 4, 5 and 6, and leave 0..3 as they are"]
ANSWER = ("self.cache = decoder.cache_for(1) in __init__ (the cache the prefill writes), and in generate: "
          "self.ids.copy_(first_ids.view(1, 1)); self.pos.fill_(start) before the loop of replays")
WORTH = ("A model this small (SmolLM2 has 135M parameters) writes fluent English and gets facts wrong: its answer "
         "tests your loop; it is not a source (compare what it says with lesson 02)")
TEXT_CHARS = 400  # the ✓ line shows the loop's text up to this many characters


def answer_text(result: dict, tokenizer, eos=None) -> str:
    """The text of the loop's tokens in ``result`` (:func:`~course.lessons.real_model.chat.answer`), up to the end of
    sequence, special tokens left out; its token ids as text when there is no tokenizer."""
    ids = until_eos(result["tokens"], eos) if eos is not None else result["tokens"][0].tolist()
    if tokenizer is None:
        return " ".join(map(str, ids))
    return tokenizer.decode(ids, skip_special_tokens=True).strip()


def check_chat(result, tokenizer=None, dtype=torch.float32, eos=None) -> None:
    """Step 6: the loop's answer to the chat prompt in ``result`` (:func:`~course.lessons.real_model.chat.answer`),
    judged by the cache positions it wrote and by its tokens against ``model.generate``'s (see the module doc);
    ``result`` None: step 5 is not passed yet ("not done yet")."""
    with exercise(NAME, hint=HINT, answer=ANSWER) as notes:
        if result is None:
            raise NotImplementedError("step 5 (lab 4.5) is not passed yet: your loop answers here once its check "
                                      "passes")
        why = result["cache_problem"]
        assert not why, f"after the prompt (positions 0..{result['start'] - 1} prefilled): {why}"
        agree, compared = result["agree"], result["compared"]
        if agree < compared and dtype == torch.float32:
            d = divergence(result["want_logits"], result["want"], result["tokens"], agree, tokenizer)
            raise AssertionError(
                f"float32: your loop wrote the right cache positions, but its tokens part from model.generate's at "
                f"answer token {agree} (generate {d['generate']}, your loop {d['loop']}): check what one_token "
                "feeds the model, the mask (keys 0..position) and the position ids")
        text = answer_text(result, tokenizer, eos)
        text = text if len(text) <= TEXT_CHARS else text[:TEXT_CHARS].rsplit(" ", 1)[0] + " ..."
        where = f"all {compared} of generate's tokens"
        if agree < compared:
            d = divergence(result["want_logits"], result["want"], result["tokens"], agree, tokenizer)
            where = (f"the first {agree} of generate's {compared} tokens; then generate chose {d['generate']} and "
                     f"your loop {d['loop']}, {d['gap']:.3f} apart in generate's logits, "
                     f"{d['gap'] / d['bf16_spacing']:.1f} bfloat16 steps")
        notes.append(f"your captured loop answered: {text!r} ({where}). {WORTH}")
