"""Lab 4: every wrong variant of an answer fails a check whose ✗ names its defect (tests/cellrun.py runs them)."""
import pytest

from cellrun import ON_GPU, _fresh_checks, expect_caught, one as _one, run_mutant, run_notebook_checks  # noqa: F401


# ----------------------------------------------------------------------------- lab 4
LAB4 = "lab4_real_model.ipynb"
L1, L2, L3, L4, L5 = ("lab 4.1 a capturable step", "lab 4.2 wrapped in the graph cache", "lab 4.3 predict tokens/s",
                      "lab 4.4 the gap, per kernel", "lab 4.5 the token loop, captured by hand")
_WRAP = "GraphCache(decoder.step, buckets=[1, 2, 4, 8], batched=(0,), pad_value=(0, 0), backend=model_backend())"
_POS_IDS = "position_ids=position.view(1, 1).expand(b, 1)"
# lab 4.5 (the hand capture): lines of MyGraphedDecode's answer
_POS_BUF = "        self.pos = torch.zeros(1, dtype=torch.long, device=dev)  # static input: its position\n"
_WARM = "            for _ in range(2):\n                self.one_token()  # warm-up, on a side stream\n"
_PIN = ("        for layer in self.cache.layers:\n"
        "            layer.cumulative_length.copy_(pos[0])  # the cache writes at our position, not at its own counter\n")
_FEED = "            self.ids.copy_(self.next)  # fed back into the buffer the graph reads\n"
# (name, edits, the check that must fail, words its message must contain[, the only path that can see it])
LAB4_MUTANTS = [
    ("cumulative_length left alone", _one("        for layer in cache.layers:\n"
                                          "            layer.cumulative_length.copy_(position[0])\n", ""), L1,
     ["second run", "cumulative_length"]),
    ("position read on the host", _one("layer.cumulative_length.copy_(position[0])",
                                       "layer.cumulative_length.fill_(int(position[0]))"), L1,
     ["the capture failed", "int(position[0])"]),  # the finder does not flag int() of a tensor; the capture does
    ("mask without the current position", _one("(self._arange <= position)", "(self._arange < position)"), L1,
     ["greedy tokens differ", "mask"]),
    ("position ids frozen at 0", _one(_POS_IDS, "position_ids=torch.zeros_like(ids)"), L1,
     ["logits differ", "position ids"]),
    ("wrap without buckets", _one(_WRAP, _WRAP.replace("buckets=[1, 2, 4, 8], ", "")), L2, ["no padded rows"]),
    ("wrap with the position batched", _one(_WRAP, _WRAP.replace("batched=(0,), ", "")), L2,
     ["batch size", "batched=("]),
    ("padding token outside the vocabulary", _one(_WRAP, _WRAP.replace("pad_value=(0, 0)", "pad_value=(-1, 0)")),
     L2, ["token id -1", "device-side assert"]),
    ("predict without the batch", _one("return batch / (nbytes", "return 1 / (nbytes"), L3, ["`batch` tokens"]),
    ("predict in bytes per second", _one("(bandwidth_GBps * 1e9)", "bandwidth_GBps"), L3, ["GB/s"]),
    ("gap not per kernel", _one("return (slow_us - fast_us) / kernels", "return slow_us - fast_us"), L4,
     ["whole gap"]),
    ("gap with the sign flipped", _one("return (slow_us - fast_us) / kernels", "return (fast_us - slow_us) / kernels"),
     L4, ["the sign"]),
    # step 5, the hand capture: 18 mutants, the same verdict on the simulator and on a GPU
    ("position a Python int, frozen at capture",
     [(_POS_BUF, _POS_BUF + "        self.position = 0\n"),
      ("        pos = self.pos\n",
       "        pos = torch.full((1,), self.position, dtype=torch.long, device=self.ids.device)\n"),
      ("            self.pos.add_(1)\n", "            self.position += 1\n")], L5, ["position 0", "frozen at capture"]),
    ("position never advanced", _one("            self.pos.add_(1)\n", ""), L5, ["position 0", "self.pos.add_(1)"]),
    ("cache left to its own counter", _one(_PIN, ""), L5, ["its own counter", "cumulative_length is 66"]),
    ("no static KV cache", _one("past_key_values=self.cache, use_cache=True", "use_cache=True"), L5,
     ["past_key_values=none", "DynamicCache"]),
    ("token read with .item() inside the capture",
     _one("        return out.logits[:, -1].argmax(-1, keepdim=True)\n",
          "        return torch.full((1, 1), out.logits[:, -1].argmax().item(), device=self.ids.device)\n"), L5,
     ["the capture failed", "not permitted when stream is capturing", "host read"]),
    ("next token not cloned before the next replay", _one("out.append(self.next.clone())", "out.append(self.next)"),
     L5, ["the last one", "clone()"]),
    ("no warm-up", _one(_WARM, "            pass\n"), L5, ["no warm-up", "side stream"]),
    ("warm-up on the default stream",
     _one("        with cg.stream(side):\n" + _WARM, "        for _ in range(2):\n            self.one_token()\n"), L5,
     ["default stream", "side stream"]),
    ("warm-up without the fork", _one("        side.wait_stream(cg.current_stream())\n", ""), L5,
     ["the fork", "side.wait_stream(cg.current_stream())"]),
    ("warm-up without the join", _one("        cg.current_stream().wait_stream(side)\n", ""), L5,
     ["the join", "cg.current_stream().wait_stream(side)"]),
    ("next token rebound, not copied in", _one(_FEED, "            self.ids = self.next.clone()\n"), L5,
     ["rebound self.ids", "copy_"]),
    ("next token never fed back", _one(_FEED, ""), L5, ["first token again", "self.ids.copy_"]),
    ("generate runs the step eagerly",
     _one("            self.graph.replay()\n", "            self.next = self.one_token()\n"), L5, ["in Python 64 times", "replay"]),
    ("a new sequence starts where the last ended", _one("self.pos.fill_(start)  # 0", "# 0"), L5,
     ["second did not", "self.pos.fill_(start)"]),
    # step 5 goes on from a prompt prefilled into the decoder's cache, as step 6 does: the cache positions written
    ("a KV cache of its own: the prompt never seen",
     _one("        self.cache = decoder.cache_for(1)  # the static KV cache, allocated before the capture\n",
          "        self.cache = StaticDecoder(decoder.model, decoder.max_len).cache_for(1)\n"), L5,
     ["never wrote the decoder's KV cache", "decoder.cache_for(1)"]),
    ("the position zeroed, not set to start", _one("self.pos.fill_(start)  # 0", "self.pos.zero_()  # 0"), L5,
     ["decoded from position 0, not from start=5", "self.pos.fill_(start)"]),
    ("the cache emptied by every generate",
     _one("        self.ids.copy_(first_ids.view(1, 1))\n",
          "        self.cache.reset()\n        self.ids.copy_(first_ids.view(1, 1))\n"), L5, ["emptied the KV cache"]),
    ("generate without start", [("def generate(self, first_ids, n_tokens, start=0):",
                                 "def generate(self, first_ids, n_tokens):"),
                                ("self.pos.fill_(start)  # 0", "self.pos.fill_(0)  # 0")], L5, ["takes no `start`"]),
]


def test_lab4_answer_passes_every_check(tmp_path):  # to step 5; step 6 (a trained model): tests/test_lab_chat.py
    got = run_notebook_checks(LAB4, log_dir=tmp_path, until=L5, every=True)
    assert set(got) == {L1, L2, L3, L4, L5}, sorted(got)
    bad = {k: v["message"] for k, v in got.items() if v["status"] != "pass"}
    assert not bad, bad


# right work written another way: step 5 passes on both paths, as it does on an H100
LAB4_RIGHT = [
    ("warm-up and capture under inference_mode", L5, [
        ("        with cg.stream(side):\n", "        with torch.inference_mode(), cg.stream(side):\n"),
        ("        with cg.graph(self.graph):\n", "        with torch.inference_mode(), cg.graph(self.graph):\n")]),
]


@pytest.mark.parametrize("variant", LAB4_RIGHT, ids=[r[0] for r in LAB4_RIGHT])
def test_lab4_right_work_written_another_way_passes(variant, tmp_path):
    name, check, edits = variant
    entry = run_notebook_checks(LAB4, edits, tmp_path, until=check).get(check)
    assert entry is not None and entry["status"] == "pass", f"{name}: {entry}"


@pytest.mark.parametrize("mutant", LAB4_MUTANTS, ids=[m[0] for m in LAB4_MUTANTS])
def test_lab4_mutant_fails_a_check_that_names_it(mutant, tmp_path):
    run_mutant(LAB4, mutant, tmp_path)
