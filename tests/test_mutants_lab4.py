"""Lab 4: every wrong variant of an answer fails a check whose ✗ names its defect, by its rule
(tests/cellrun.py runs them); right work written another way passes."""
import pytest

from cellrun import _fresh_checks  # noqa: F401 - autouse: every test starts with no outcome
from cellrun import expect_caught, one as _one, run_notebook_checks
from course.lessons.real_model import hand_check as H, lab_checks as C

LAB4 = "lab4_real_model.ipynb"
L1, L2, L3, L4, L5 = C.CAPTURABLE, C.WRAPPED, C.PREDICT, C.GAP, C.HAND
_WRAP = ("GraphCache(decoder.step, buckets=[1, 2, 4, 8], batched=(0,), pad_value=(0, 0),\n"
         "                      backend=model_backend())")
_POS_IDS = "position_ids=position.view(1, 1).expand(b, 1)"
# lab 4.5 (the hand capture): lines of MyGraphedDecode's answer
_POS_BUF = ("        self.pos = torch.zeros(1, dtype=torch.long, device=dev)  # static input: its "
            "position\n")
_WARM = ("            for _ in range(2):\n                self.one_token()  # warm-up, on a side "
         "stream\n")
_PIN = "            layer.cumulative_length.copy_(pos[0])  # the cache writes at our position\n"
_FEED = "            self.ids.copy_(self.next)  # fed back into the buffer the graph reads\n"
_MASK = "mask = (self.decoder._arange <= pos).view(1, 1, 1, -1)"
_NEXT = "        return out.logits[:, -1].argmax(-1, keepdim=True)\n"
_START = "self.pos.fill_(start)  # 0"
_ADVANCE = "            self.pos.add_(1)\n"
_CACHE = ("        self.cache = decoder.cache_for(1)  # the static KV cache, allocated before the "
          "capture\n")
# (name, edits, the check that must fail, its rule ("" where the check names none), words its
# message must contain)
LAB4_MUTANTS = [
    ("cumulative_length left alone",
     _one("        for layer in cache.layers:\n"
          "            layer.cumulative_length.copy_(position[0])\n", ""), L1, "idempotent",
     ["second run", "cumulative_length"]),
    ("position read on the host", _one("layer.cumulative_length.copy_(position[0])",
                                       "layer.cumulative_length.fill_(int(position[0]))"), L1,
     # the finder does not flag int() of a tensor
     "capture", ["the capture failed", "int(position[0])"]),
    ("mask without the current position",
     _one("(self._arange <= position)", "(self._arange < position)"), L1, "tokens",
     ["greedy tokens differ", "mask"]),
    ("position ids frozen at 0", _one(_POS_IDS, "position_ids=torch.zeros_like(ids)"), L1,
     "logits", ["logits differ", "position ids"]),
    ("wrap without buckets", _one(_WRAP, _WRAP.replace("buckets=[1, 2, 4, 8], ", "")), L2,
     "no_padding", ["no padded rows"]),
    ("wrap with the position batched", _one(_WRAP, _WRAP.replace("batched=(0,), ", "")), L2,
     "", ["batch size", "batched=("]),
    ("padding token outside the vocabulary",
     _one(_WRAP, _WRAP.replace("pad_value=(0, 0)", "pad_value=(-1, 0)")), L2, "pad_token",
     ["token id -1", "device-side assert"]),
    ("predict without the batch", _one("return batch / (nbytes", "return 1 / (nbytes"), L3,
     "tokens_per_s", ["`batch` tokens"]),
    ("predict in bytes per second", _one("(bandwidth_GBps * 1e9)", "bandwidth_GBps"), L3,
     "tokens_per_s", ["GB/s"]),
    ("gap not per kernel", _one("return (slow_us - fast_us) / kernels", "return slow_us - fast_us"),
     L4, "per_kernel", ["whole gap"]),
    ("gap with the sign flipped",
     _one("return (slow_us - fast_us) / kernels", "return (fast_us - slow_us) / kernels"), L4,
     "per_kernel", ["the sign"]),
    # step 5, the hand capture: the same verdict on the simulator and on a GPU
    ("position a Python int, frozen at capture",
     [(_POS_BUF, _POS_BUF + "        self.position = 0\n"),
      ("        pos = self.pos\n",
       "        pos = torch.full((1,), self.position, dtype=torch.long, device=self.ids.device)\n"),
      (_ADVANCE, "            self.position += 1\n")], L5, "position_frozen",
     ["position 0", "frozen at capture"]),
    ("position never advanced", _one(_ADVANCE, ""), L5, "position_frozen",
     ["position 0", "never advanced"]),
    ("cache left to its own counter", _one("        for layer in self.cache.layers:\n" + _PIN, ""),
     L5, "own_counter", ["its own counter", "cumulative_length"]),
    ("no static KV cache", _one("past_key_values=self.cache, use_cache=True", "use_cache=True"), L5,
     "no_static_cache", ["past_key_values=none", "DynamicCache"]),
    ("token read with .item() inside the capture",
     _one(_NEXT,
          "        return torch.full((1, 1), out.logits[:, -1].argmax().item(), "
          "device=self.ids.device)\n"),
     L5, "host_read",
     ["the capture failed", "not permitted when stream is capturing", "host read", ".item()"]),
    ("position read with int() inside the capture",
     _one("        pos = self.pos\n",
          "        pos = torch.full((1,), int(self.pos), dtype=torch.long, "
          "device=self.ids.device)\n"), L5,
     "host_read", ["the capture failed", "host read", "int(self.pos)"]),
    ("a Python int position copied into the capture",
     _one("        pos = self.pos\n", "        pos = torch.tensor([0], device=self.ids.device)\n"),
     L5, "host_copy", ["the capture failed", "copy between host and device", "torch.tensor([0]"]),
    ("the cache's length set from a Python int",
     _one(_PIN, "            layer.cumulative_length.copy_(torch.tensor(0, device=pos.device))\n"),
     L5, "host_copy", ["the capture failed", "copy between host and device", "cumulative_length"]),
    ("next token not cloned before the next replay",
     _one("out.append(self.next.clone())", "out.append(self.next)"), L5, "not_cloned",
     ["the last one", "same tensor"]),
    ("logits kept for all positions",
     _one(_NEXT, "        return out.logits.argmax(-1, keepdim=True)\n"), L5, "token_shape",
     ["shape [1, 1, 1]", "every position"]),
    ("no warm-up", _one(_WARM, "            pass\n"), L5, "warm_up", ["no warm-up", "side stream"]),
    ("warm-up on the default stream",
     _one("        with cg.stream(side):\n" + _WARM,
          "        for _ in range(2):\n            self.one_token()\n"), L5,
     "warm_up", ["default stream", "side stream"]),
    ("warm-up without the fork", _one("        side.wait_stream(cg.current_stream())\n", ""), L5,
     "stream_order", ["the fork", "side.wait_stream(cg.current_stream())"]),
    ("warm-up without the join", _one("        cg.current_stream().wait_stream(side)\n", ""), L5,
     "stream_order", ["the join", "cg.current_stream().wait_stream(side)"]),
    ("next token rebound, not copied in", _one(_FEED, "            self.ids = self.next.clone()\n"),
     L5, "rebound", ["rebound self.ids", "tensor it saw at capture"]),
    ("next token never fed back", _one(_FEED, ""), L5, "not_fed_back",
     ["first token again", "never reached"]),
    ("generate runs the step eagerly",
     _one("            self.graph.replay()\n", "            self.next = self.one_token()\n"), L5,
     "eager_forward", ["in Python 32 times", "replay"]),
    ("a new sequence starts where the last ended", _one(_START, "# 0"), L5,
     "second_sequence", ["second sequence", "where the first ended"]),
    ("mask without the token's own position", _one(_MASK, _MASK.replace("<=", "<")), L5, "mask",
     ["mask", "own position"]),
    ("mask hard-coded to 128 positions",
     _one(_MASK, "mask = (torch.arange(128, device=pos.device) <= pos).view(1, 1, 1, -1)"), L5,
     "mask_length", ["mask covers 128 positions", f"holds {H.MAX_LEN}"]),
    ("mask hard-coded to the check's length",
     _one(_MASK, f"mask = (torch.arange({H.MAX_LEN}, device=pos.device) <= pos).view(1, 1, 1, -1)"),
     L5, "mask_length", [f"mask covers {H.MAX_LEN} positions", f"holds {H.PROMPT_LEN}"]),
    ("position set one past start", _one(_START, "self.pos.fill_(start + 1)  # 0"), L5, "one_late",
     ["one position late"]),
    ("position advanced before the replay",
     [("            self.graph.replay()\n", _ADVANCE + "            self.graph.replay()\n"),
      (_ADVANCE + "        return torch.cat", "        return torch.cat")], L5, "one_late",
     ["one position late"]),
    # step 5 goes on from a prompt prefilled into the decoder's cache, as step 6 does
    ("a KV cache of its own: the prompt never seen",
     _one(_CACHE,
          "        self.cache = StaticDecoder(decoder.model, decoder.max_len).cache_for(1)\n"), L5,
     "own_cache", ["never writes the decoder's KV cache", "decoder.cache_for(1)"]),
    ("the position zeroed, not set to start", _one(_START, "self.pos.zero_()  # 0"), L5,
     "from_zero",
     ["decoded from position 0, not from start=5", "over the prompt's keys and values"]),
    ("the cache emptied by every generate",
     _one("        self.ids.copy_(first_ids.view(1, 1))\n",
          "        self.cache.reset()\n        self.ids.copy_(first_ids.view(1, 1))\n"), L5,
     "cache_emptied", ["emptied the KV cache"]),
    ("generate without start", [("def generate(self, first_ids, n_tokens, start=0):",
                                 "def generate(self, first_ids, n_tokens):"),
                                (_START, "self.pos.fill_(0)  # 0")], L5, "no_start",
     ["takes no `start`"]),
]


# to step 5; step 6 (a trained model): tests/test_lab_chat.py
def test_lab4_answer_passes_every_check(tmp_path):
    got = run_notebook_checks(LAB4, log_dir=tmp_path, until=L5, every=True)
    assert set(got) == {L1, L2, L3, L4, L5}, sorted(got)
    bad = {k: v["message"] for k, v in got.items() if v["status"] != "pass"}
    assert not bad, bad


# right work written another way: step 5 passes on both paths, as it does on an H100
LAB4_RIGHT = [
    ("warm-up and capture under inference_mode", L5, [
        ("        with cg.stream(side):\n",
         "        with torch.inference_mode(), cg.stream(side):\n"),
        ("        with cg.graph(self.graph):\n",
         "        with torch.inference_mode(), cg.graph(self.graph):\n")]),
    ("the step and its argmax, through the decoder", L5, [
        ("        for layer in self.cache.layers:\n" + _PIN + "        " + _MASK + "\n"
         "        out = self.model(input_ids=self.ids, position_ids=pos.view(1, 1), "
         "attention_mask=mask,\n                         past_key_values=self.cache, "
         "use_cache=True)\n" + _NEXT,
         "        return self.decoder.step(self.ids, pos).argmax(-1, keepdim=True)\n")]),
]


@pytest.mark.parametrize("variant", LAB4_RIGHT, ids=[r[0] for r in LAB4_RIGHT])
def test_lab4_right_work_written_another_way_passes(variant, tmp_path):
    name, check, edits = variant
    entry = run_notebook_checks(LAB4, edits, tmp_path, until=check).get(check)
    assert entry is not None and entry["status"] == "pass", f"{name}: {entry}"


@pytest.mark.parametrize("mutant", LAB4_MUTANTS, ids=[m[0] for m in LAB4_MUTANTS])
def test_lab4_mutant_fails_a_check_that_names_it(mutant, tmp_path):
    name, edits, check, rule, words = mutant
    entry = expect_caught(LAB4, edits, check, words, tmp_path)
    assert not rule or entry.get("rule") == rule, (f"{name}: the ✗ came from rule "
                                                   f"{entry.get('rule')!r}, not {rule!r}")
