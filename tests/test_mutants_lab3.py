"""Lab 3: every wrong variant of an answer fails a check whose ✗ names its defect (tests/cellrun.py runs them)."""
import pytest

from cellrun import ON_GPU, _fresh_checks, expect_caught, one as _one, run_mutant, run_notebook_checks  # noqa: F401


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
     ["no warm-up ran before the capture"]),
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


