"""Labs 3 and 4: every wrong variant of an answer fails a check whose ✗ names its defect.

Each mutant is the answer version's own code (the solution notebook's answer cells, read from disk)
with textual edits from a table: (name, [(find, replace)...], the check that must fail, words its
message must contain). The cells run as the notebook runs them, in one namespace (its setup cells
first, then the answer and check cells in order, up to the expected check; the check cells of other steps
before it are left out, since their verdict on the unmutated answer is the answer test's, unless the expected
check's cell reads another check's outcome); outcomes come from the check log (``COURSE_CHECK_LOG``). The unmutated answer must pass every check, and a find-string that
does not occur exactly once fails its test (the table must follow the answers).

The same tests run on the simulator path and on a GPU (the checks use this machine's backend). A
mutant only one path can see names it as a fifth field ("simulator" or "gpu") and is skipped, with
the reason, on the other. Lab 4's steps run the tiny Llama (a second or two per mutant on a CPU; step 5's
hand capture decodes 64 + 16 tokens, a few seconds).
"""
import json
import re
from functools import lru_cache
from pathlib import Path

import nbformat
import pytest

from cellrun import apply_edits, run_cells
from course.core import checks
from course.core.runtime import runtime
from course.tools.grade import exercise_cells

ROOT = Path(__file__).resolve().parent.parent
ON_GPU = runtime().on_gpu


def _code_cells(notebook: str) -> list:
    nb = json.loads((ROOT / "solutions" / notebook).read_text(encoding="utf-8"))
    return [c for c in nb["cells"] if c["cell_type"] == "code"]


def _source(cell) -> str:
    return "".join(cell["source"])


@lru_cache(maxsize=None)
def _checks_by_cell(notebook: str) -> dict:
    """Code-cell index -> the exercise its check reports (``course check``'s own reading of the notebook)."""
    nb = nbformat.read(ROOT / "solutions" / notebook, as_version=4)
    code = {j: k for k, j in enumerate(j for j, c in enumerate(nb.cells) if c.cell_type == "code")}
    return {code[i]: name for name, i in exercise_cells(nb).items()}


def _runs(i: int, cell, target, cells) -> bool:
    """Whether code cell ``i`` runs in a mutant's notebook: every answer cell; a check cell unless it comes before the
    expected check's own cell ``target`` (all run when that cell reads another check's outcome, or with no target)."""
    src = _source(cell)
    if "### BEGIN SOLUTION" in src:
        return True
    if "check" not in cell.get("metadata", {}).get("tags", []):
        return False
    return target is None or i >= target or bool(re.search(r"checks\.(passed|status)\(", _source(cells[target])))


def run_notebook_checks(notebook: str, edits=(), log_dir=None, until: str = "", every: bool = False) -> dict:
    """Run a solution notebook's setup, answer and check cells with ``edits`` applied; check name -> outcome entry.

    ``edits``: (find, replace) pairs, each find occurring exactly once in the answer and check cells (else
    the test fails: the table no longer follows the answer). Setup cells are the code cells before the first
    answer cell (imports, the model); answer cells hold ``### BEGIN SOLUTION``; check cells are tagged
    ``check``; other cells (measurements, summaries) are skipped. ``until``: stop once that check has run, having run
    only the check cells from its own on (see :func:`_runs`), or every check cell before it too with ``every``.
    """
    cells = _code_cells(notebook)
    first = next(i for i, c in enumerate(cells) if "### BEGIN SOLUTION" in _source(c))
    setup = [_source(c) for c in cells[:first]]
    target = next((i for i, name in _checks_by_cell(notebook).items() if name == until), None) \
        if until and not every else None
    steps = [_source(c) for i, c in enumerate(cells) if i >= first and _runs(i, c, target, cells)]
    steps = apply_edits(steps, edits, f"{notebook}'s answer and check cells")
    checks.reset()
    out = {}
    for entry in run_cells(setup + steps, log_dir, notebook, until=until):
        out[entry["name"]] = entry
    return out


def expect_caught(notebook, edits, check, words, tmp_path) -> dict:
    """Run the mutant; assert ``check`` failed (or crashed) with a message containing every one of ``words``."""
    got = run_notebook_checks(notebook, edits, tmp_path, until=check)
    entry = got.get(check)
    assert entry is not None, f"{check} never ran: {sorted(got)}"
    assert entry["status"] in ("fail", "crash"), f"{check} passed the mutant; outcomes: " + \
        "; ".join(f"{k}: {v['status']} {v['message']}" for k, v in got.items())
    missing = [w for w in words if w.lower() not in entry["message"].lower()]
    assert not missing, f"{check}'s ✗ does not say {missing}: {entry['message']!r}"
    return entry


def run_mutant(notebook, mutant, tmp_path) -> None:
    """One row of a mutant table: skipped on a path it names as blind, else :func:`expect_caught`."""
    name, edits, check, words, *only = mutant
    here = "gpu" if ON_GPU else "simulator"
    if only and only[0] != here:
        pytest.skip(f"{name}: only the {only[0]} path can see this defect")
    expect_caught(notebook, edits, check, words, tmp_path)


@pytest.fixture(autouse=True)
def _fresh_checks():
    checks.reset()
    yield
    checks.reset()


def _one(find, replace):
    return [(find, replace)]


# ----------------------------------------------------------------------------- lab 3
LAB3 = "lab3_graph_cache.ipynb"
K1, K2, K3, K4, K5, K6, K7 = ("lab 3.1 the key", "lab 3.2 static inputs", "lab 3.3 outputs",
                              "lab 3.4 capture on miss, replay on hit", "lab 3.5 buckets and padding",
                              "lab 3.6 fallback", "lab 3.7 enable and clear")
_KEY = 'key.append(("tensor", (bucket, *a.shape[1:]), str(a.dtype), str(a.device)))'
_PADS = "return self.pad_value if isinstance(self.pad_value, (tuple, list)) else (self.pad_value,) * len(args)"
_HIT = 'self.stats["cache_hits"] += 1\n            copy_in(entry["static"], args, n, self.pads(args))'
_CLEAR = "        self.entries.clear()\n        self.backend.reset_pool()"
# (name, edits, the check that must fail, words its message must contain)
LAB3_MUTANTS = [
    # the key, the static inputs, the outputs (steps 1 to 3)
    ("key without the dtype", _one(_KEY, _KEY.replace(" str(a.dtype),", "")), K1, ["ignores the dtype"]),
    ("key without the shape", _one(_KEY, _KEY.replace("(bucket, *a.shape[1:])", "bucket")), K1, ["shape"]),
    ("key with the batch, not the bucket", _one(_KEY, _KEY.replace("(bucket, *a.shape[1:])", "tuple(a.shape)")),
     K1, ["bucket, not the batch size"]),
    ("key without the device", _one(_KEY, _KEY.replace(", str(a.device)", "")), K1, ["ignores the device"]),
    ("key as a list", _one("return tuple(key)", "return key"), K1, ["not hashable"]),
    ("static inputs are the caller's tensors",
     _one("torch.empty((bucket, *a.shape[1:]), dtype=a.dtype, device=a.device) if", "a if"), K2,
     ["caller's tensor itself"]),
    ("static buffers on the default device", _one("dtype=a.dtype, device=a.device)", "dtype=a.dtype)"), K2,
     ["keep each input's device"]),
    ("padding rows never filled", _one("            s[n:].fill_(pad)\n", ""), K2, ["pad"]),
    ("outputs not cloned", _one("return out.clone() if copy else out", "return out"), K3, ["clone them"]),
    ("outputs not sliced", _one("out = out[:n]", "out = out"), K3, ["slice the padded output"]),
    # MyGraphCache (steps 4 to 7)
    ("lookup without the dtype", _one("key = cache_key(args, bucket)",
                                      "key = tuple(k[:2] for k in cache_key(args, bucket))"), K4,
     ["float16", "returned float32", "cache_key"]),
    ("no copy-in on a hit", _one(_HIT, 'self.stats["cache_hits"] += 1'), K4, ["copied into the static buffers"]),
    ("a hit runs eagerly", _one(_HIT, 'self.stats["cache_hits"] += 1\n            return self.fn(*args)'), K4,
     ["a hit", "eagerly"]),
    ("new buffers on a hit", _one(_HIT, _HIT.replace("copy_in(", 'entry["static"][:] = make_static(args, bucket)\n'
                                                               "            copy_in(")), K4,
     ["put new tensors", "copy_()"]),
    ("no replay on a miss", [(_HIT, _HIT + '\n            entry["graph"].replay()'),
                             ('        entry["graph"].replay()\n        self.stats', "        self.stats")], K4,
     ["first of its shape", "without a replay"]),
    ("no clone on return", _one("return copy_out(entry[\"output\"], n, bucket)",
                                "return copy_out(entry[\"output\"], n, bucket, copy=False)"), K4,
     ["overwritten by a later replay"]),
    ("capture on the caller's tensors", _one("                out = self.fn(*static)\n",
                                             "                out = self.fn(*args)\n"), K4,
     ["same as the previous call", "static buffers"]),
    ("recordings not counted", _one('        self.stats["recordings"] += 1\n', ""), K4, ["recordings 0"]),
    ("pads with -1", _one(_PADS, "return (-1,) * len(args)"), K5, ["padding rows", "pad_value", "[-1]"]),
    ("pads with random real values", _one(_PADS, "return tuple(int(torch.randint(0, 8, ())) for _ in args)"), K5,
     ["padding rows", "pad_value", "slots holds"]),
    ("pads with the first pad_value everywhere", _one(_PADS, "return (self.pad_value[0],) * len(args)"), K5,
     ["slots holds [0] where its pad_value is 10"]),
    ("no eager above the largest bucket", _one("if not self.enabled or bucket is None:", "if not self.enabled:"),
     K5, ["above the largest bucket", "eagerly"]),
    ("padded rows not counted", _one('        self.stats["padded_rows"] += bucket - n\n', ""), K5, ["padded_rows"]),
    ("eager key counted as hits",
     _one('elif not entry["eager"]:\n            ' + _HIT,
          'else:\n            ' + _HIT.replace("copy_in(", 'if not entry["eager"]: copy_in(')),
     K6, ["cache_hits", "eager", "never hits"]),
    ("no fallback memo", _one("        entry = self.entries.get(key)\n",
                              "        entry = self.entries.get(key)\n"
                              "        if entry is not None and entry[\"eager\"]:\n            entry = None\n"), K6,
     ["captured 2 times"]),
    ("capture error not caught", _one("except Exception as e:", "except ValueError as e:"), K6,
     ["let the capture's error escape", "capture_failed"]),
    ("fallback without its reason", _one('            self.stats["fallbacks"][key] = reason\n', ""), K6,
     ["stats['fallbacks']"]),
    ("failure not handed to the backend", _one("reason = self.backend.capture_failed(e, graph=g, stream=before)",
                                               "reason = str(e)"), K6,
     ["capture stream is still current", "capture_failed(e, graph=g, stream=before)"]),
    ("set_enabled ignored", _one("        self.enabled = bool(enabled)\n", "        pass\n"), K7, ["disabled"]),
    ("clear_cache keeps the entries", _one(_CLEAR, "        self.backend.reset_pool()"), K7, ["drop every entry"]),
    ("clear_cache keeps a second reference", _one(_CLEAR, "        self.old = dict(self.entries)\n" + _CLEAR), K7,
     ["did not come back", "still references"]),
    ("clear_cache without reset_pool", _one(_CLEAR, "        self.entries.clear()"), K7, ["reset_pool()"]),
    ("clear_cache leaves a static output referenced",
     _one('return copy_out(entry["output"], n, bucket)',
          'self.last_output = entry["output"]\n        return copy_out(entry["output"], n, bucket)'), K7,
     ["memory pool", "stayed reserved", "static output"]),
    ("clear_cache leaves the graphs in a cycle",
     _one(_CLEAR, "        old = dict(self.entries)\n        old['me'] = old\n" + _CLEAR), K7,
     ["reference cycle", "garbage collector"]),
    # the learner's own capture (step 4)
    ("no warm-up", _one("            self.fn(*static)  # the warm-up, on a side stream\n", "            pass\n"), K4,
     ["without a warm-up"]),
    ("warm-up on the default stream", _one("        with cg.stream(side):\n", "        if True:\n"), K4,
     ["warm-up ran on the default stream"]),
    ("collector on during the capture", _one("with collector_paused(), cg.graph(g, pool=self.backend.pool()):",
                                             "with cg.graph(g, pool=self.backend.pool()):"), K4,
     ["garbage collector", "collector_paused()"]),
    ("a private pool per graph", _one("cg.graph(g, pool=self.backend.pool())", "cg.graph(g)"), K4,
     ["cache's pool", "pool=self.backend.pool()"]),
    ("a new pool per capture",
     _one("cg.graph(g, pool=self.backend.pool())", "cg.graph(g, pool=cg.graph_pool_handle())"), K4, ["cache's pool"]),
]


def test_lab3_answer_passes_every_check(tmp_path):
    got = run_notebook_checks(LAB3, log_dir=tmp_path)
    assert set(got) == {K1, K2, K3, K4, K5, K6, K7}, sorted(got)
    bad = {k: v["message"] for k, v in got.items() if v["status"] != "pass"}
    assert not bad, bad


@pytest.mark.parametrize("mutant", LAB3_MUTANTS, ids=[m[0] for m in LAB3_MUTANTS])
def test_lab3_mutant_fails_a_check_that_names_it(mutant, tmp_path):
    run_mutant(LAB3, mutant, tmp_path)


def test_a_find_string_that_no_longer_matches_fails_loudly(tmp_path):
    with pytest.raises(pytest.fail.Exception, match="occurs 0 times"):
        run_notebook_checks(LAB3, [("this line is in no answer", "")], tmp_path)


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
