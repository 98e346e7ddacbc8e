"""Lab 4, step 6 on the laptop path: a captured loop goes on from a prompt prefilled into the decoder's KV cache, and
the check names what the cache positions it wrote show (course.lessons.real_model.continuation, lab_chat). The loops
are the course's GraphedDecode and three wrong versions of it, on the tiny Llama (a random prompt: no tokenizer);
the shipped SmolLM2 answers in tests/test_trained_model.py and in `course check --answers` of the lab."""
import types

import pytest
import torch

from course.core import checks
from course.lessons.real_model import chat, continuation, lab_chat
from course.lessons.real_model.checkpoint import quiet_tokenizer
from course.lessons.real_model.decode import StaticDecoder
from course.lessons.real_model.handgraph import GraphedDecode
from course.lessons.real_model.lab import lab_model

N = 12


class StartIgnored(GraphedDecode):
    """Always begins at position 0 (a position "zeroed" for every new sequence)."""

    def generate(self, first_ids, n_tokens, start=0):
        return super().generate(first_ids, n_tokens, 0)


class CacheEmptied(GraphedDecode):
    """Resets the KV cache before every sequence."""

    def generate(self, first_ids, n_tokens, start=0):
        self.decoder.reset()
        return super().generate(first_ids, n_tokens, start)


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv(checks.ENV_GATE, raising=False)
    monkeypatch.delenv(checks.ENV_LOG, raising=False)
    checks.reset()
    yield
    checks.reset()


def _answer(make_loop):
    model = lab_model()
    prompt = continuation.prompt_for(model, 7)
    dec = StaticDecoder(model, prompt.shape[1] + N)
    return chat.answer(make_loop(dec), dec, prompt, N)


def _verdict(result, capsys):
    lab_chat.check_chat(result)
    return checks.status(lab_chat.NAME), capsys.readouterr().out


def test_the_right_loop_passes_and_its_text_is_on_the_check_line(capsys):
    result = _answer(GraphedDecode)
    assert result["cache_problem"] == "" and result["agree"] == result["compared"] == N
    status, out = _verdict(result, capsys)
    line = next(x for x in out.splitlines() if x.startswith("✓"))
    ids = " ".join(map(str, result["tokens"][0].tolist()))
    assert status == "pass" and ids in line and "not a source" in line and f"all {N} of generate's tokens" in line


@pytest.mark.parametrize("make_loop, words", [
    (lambda dec: GraphedDecode(StaticDecoder(dec.model, dec.max_len)), ["never wrote the decoder's KV cache",
                                                                         "decoder.cache_for(1)"]),
    (StartIgnored, ["decoded from position 0, not from start=6", "self.pos.fill_(start)"]),
    (CacheEmptied, ["emptied the KV cache", "positions 0..5"]),
], ids=["a cache of its own (stale)", "start ignored", "cache reset"])
def test_a_wrong_loop_gets_the_cause_its_cache_writes_show(make_loop, words, capsys):
    result = _answer(make_loop)
    status, out = _verdict(result, capsys)
    assert status == "fail", out
    assert all(w in out for w in words), out
    assert "does your generate start at" not in out  # no guess: the measured cause


def test_right_writes_but_other_tokens_is_named_as_such_in_float32(capsys):
    result = _answer(GraphedDecode)
    wrong = result["tokens"].clone()
    wrong[0, 3:] = (wrong[0, 3:] + 1) % lab_model().config.vocab_size
    status, out = _verdict({**result, "tokens": wrong, "agree": 3}, capsys)
    assert status == "fail" and "right cache positions" in out and "answer token 3" in out


def test_in_bfloat16_a_parting_is_reported_with_its_gap(capsys):
    result = _answer(GraphedDecode)
    wrong = result["tokens"].clone()
    wrong[0, 5:] = (wrong[0, 5:] + 1) % lab_model().config.vocab_size
    lab_chat.check_chat({**result, "tokens": wrong, "agree": 5}, dtype=torch.bfloat16)
    out = capsys.readouterr().out
    assert checks.status(lab_chat.NAME) == "pass" and "the first 5 of generate's" in out and "bfloat16 steps" in out


def test_before_step_5_passes_it_is_not_done_yet(capsys):
    lab_chat.check_chat(None)
    out = capsys.readouterr().out
    assert checks.status(lab_chat.NAME) == "todo" and "step 5" in out and "hint" not in out


def test_answer_text_stops_at_the_end_of_sequence():
    tok = types.SimpleNamespace(decode=lambda ids, skip_special_tokens=False: "|".join(map(str, ids)))
    result = {"tokens": torch.tensor([[5, 6, 2, 9]])}
    assert lab_chat.answer_text(result, tok, eos=2) == "5|6|2"
    assert lab_chat.answer_text(result, None) == "5 6 2 9"


def test_written_and_problem_measure_the_positions():
    model = lab_model()
    dec = StaticDecoder(model, 16)
    cache = dec.cache_for(1)
    chat.prefill(dec, continuation.prompt_for(model, 5))
    before = continuation.snapshot(cache)
    assert continuation.written(before, cache) == []
    assert continuation.problem(before, cache, 4, 3) == continuation.OWN_CACHE
    with torch.no_grad():
        for p in (4, 5, 6):
            dec.step(torch.tensor([[7]], device=dec.device), torch.tensor([p], device=dec.device))
    assert continuation.written(before, cache) == [4, 5, 6] and continuation.problem(before, cache, 4, 3) == ""
    assert "wrote positions 4..6" in continuation.problem(before, cache, 4, 4)


def test_quiet_tokenizer_turns_the_clean_up_off_for_bpe_only():
    bpe = types.SimpleNamespace(backend_tokenizer=types.SimpleNamespace(model=type("BPE", (), {})()),
                                clean_up_tokenization_spaces=True)
    wordpiece = types.SimpleNamespace(backend_tokenizer=types.SimpleNamespace(model=type("WordPiece", (), {})()),
                                      clean_up_tokenization_spaces=True)
    assert quiet_tokenizer(bpe).clean_up_tokenization_spaces is False
    assert quiet_tokenizer(wordpiece).clean_up_tokenization_spaces is True
    assert quiet_tokenizer(None) is None
