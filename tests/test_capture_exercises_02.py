"""Lesson 02's capture exercises (02.6-02.8): the answers pass, and every wrong variant fails a check that names it.

Each mutant is the answer version's own code (the solution notebook's answer cell, read from disk) with textual
edits from a table: (name, exercise, [(find, replace)...], words the ✗ must contain). The cells run as the notebook
runs them, in one namespace: the import cells, the 02.7 setup cell, then the answer and its check cell. A find-string
that does not occur exactly once fails its test (the table must follow the answers).

The same tests run on the simulator path and on a GPU (``cg = course.graphs()`` is torch.cuda there), with the
same verdict on both: every mutant below fails on both paths, for the same named reason. Per exercise: 02.6 ten
mutants, 02.7 ten, 02.8 eight. A missing fork or join of the warm-up's side stream is a race on a GPU that no error
reports (and a laptop cannot show): the checks name it from the calls that order the streams, on both paths. Right
work written another way (events, ``synchronize()``, ``inference_mode``) passes on both.
"""
import json
import re
from pathlib import Path

import pytest
import torch

import course
from cellrun import apply_edits, run_cells
from course.core import checks, reference
from course.core.harness import judge
from course.core.runtime import runtime
from course.lessons.capture_replay import bench, capture_checks as cc, checks as replay_checks, replay
from course.lessons.capture_replay.capture_checks import _pools_in_words

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "solutions" / "02_capture_and_replay.ipynb"
ON_GPU = runtime().on_gpu
A, B, C = "02.6 capture a forward by hand", "02.7 capture a training step", "02.8 two graphs, one pool"
ANSWER = {A: "def capture_forward(", B: "def capture_train_step(", C: "def capture_buckets("}
CHECK = {A: "check_capture_forward(", B: "check_train_step(", C: "check_shared_pool("}
SETUP = ("course.header()", "cg = course.graphs()", "AMP_DEVICE, AMP_DTYPE = amp()")


def _cells() -> list:
    nb = json.loads(NOTEBOOK.read_text(encoding="utf-8"))
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


def _one(marker: str) -> str:
    hits = [s for s in _cells() if marker in s]
    assert len(hits) == 1, f"{len(hits)} code cells of {NOTEBOOK.name} contain {marker!r} (expected one)"
    return hits[0]


def run_exercise(exercise: str, edits=(), log_dir=None) -> dict:
    """Run the setup cells, ``exercise``'s answer cell with ``edits`` applied, and its check: the check's log entry."""
    answer, = apply_edits([_one(ANSWER[exercise])], edits, f"the {exercise} answer")
    cells = [_one(m) for m in SETUP] + [answer, _one(CHECK[exercise])]
    entries = run_cells(cells, log_dir, f"02 {exercise}")
    got = [e for e in entries if e["name"] == exercise]
    assert got, f"the {exercise} check never reported: {entries}"
    return got[-1]


@pytest.fixture(autouse=True)
def _fresh_checks():
    checks.reset()
    yield
    checks.reset()

    cg = course.graphs()
    assert not cg.is_current_stream_capturing(), "a check left a capture under way"
    assert cg.current_stream() == cg.default_stream(), "a check left another stream current"


def _edit(find, replace):
    return [(find, replace)]


_WARM_A = """    with cg.stream(side):
        for _ in range(3):
            model(static_x)
    cg.current_stream().wait_stream(side)
    graph = cg.CUDAGraph()
    with cg.graph(graph):
        static_y = model(static_x)
    return graph, static_y"""
_WARM_B = """    with cg.stream(side):
        for _ in range(3):
            train_step(model, optimizer, static_x, static_y)"""
_AUTOCAST = """        with torch.autocast(AMP_DEVICE, AMP_DTYPE, cache_enabled=False):
            static_loss = train_loss(model, static_x, static_y)"""
_SERVE = """    static_x.copy_(x)
    graph.replay()
    return static_y.clone()"""

# (name, exercise, edits, words the ✗ must contain)
MUTANTS = [
    # 02.6: a forward captured by hand
    ("no warm-up", A, _edit(_WARM_A, _WARM_A.split("\n", 3)[3]), ["no warm-up ran before the capture"]),
    ("warm-up on the default stream", A, _edit(_WARM_A, _WARM_A.replace(
        "    with cg.stream(side):\n        for _ in range(3):\n            model(static_x)",
        "    for _ in range(3):\n        model(static_x)")), ["default stream"]),
    ("a clone of the output taken at capture", A, _edit("    return graph, static_y\n",
                                                        "    return graph, static_y.clone()\n"),
     ["copy taken at capture"]),
    ("captured reading a copy of the static input", A, _edit(
        "    with cg.graph(graph):\n        static_y = model(static_x)",
        "    x = static_x.clone()\n    with cg.graph(graph):\n        static_y = model(x)"),
     ["does not read static_x"]),
    ("rebinds the static input instead of copy_", A, _edit("    static_x.copy_(new_x)\n", "    static_x = new_x\n"),
     ["never reached static_x", "copy_"]),
    ("reads a device value on the host during capture", A, _edit(
        "        static_y = model(static_x)\n    return",
        "        static_y = model(static_x)\n        print(float(static_y.sum()))\n    return"),
     ["not permitted"]),
    ("captures on the default stream (capture_begin/capture_end)", A, _edit(
        "    with cg.graph(graph):\n        static_y = model(static_x)",
        "    graph.capture_begin()\n    static_y = model(static_x)\n    graph.capture_end()"),
     ["non-default stream"]),
    ("warm-up without the fork (side stream never waits)", A,
     _edit("    side.wait_stream(cg.current_stream())\n", ""), ["the fork", "side.wait_stream(cg.current_stream())"]),
    ("warm-up without the join (capture never waits)", A,
     _edit("    cg.current_stream().wait_stream(side)\n", ""), ["the join", "cg.current_stream().wait_stream(side)"]),
    ("joined before the last warm-up call", A, _edit(_WARM_A, _WARM_A.replace(
        "            model(static_x)\n    cg.current_stream().wait_stream(side)\n",
        "            cg.current_stream().wait_stream(side)\n            model(static_x)\n")), ["the join"]),
    # 02.7: a whole training step
    ("no warm-up step", B, _edit(_WARM_B, "    with cg.stream(side):\n        pass"),
     ["no warm-up ran before the capture"]),
    ("warm-up on the default stream", B, _edit(_WARM_B, "    for _ in range(3):\n"
                                                     "        train_step(model, optimizer, static_x, static_y)"),
     ["default stream"]),
    ("warm-up without optimizer steps", B, _edit(
        "            train_step(model, optimizer, static_x, static_y)",
        "            train_loss(model, static_x, static_y).backward()"), ["no optimizer.step() before the capture"]),
    ("gradients not set to None before capture", B, _edit("    optimizer.zero_grad(set_to_none=True)\n", ""),
     ["not None", "zero_grad(set_to_none=True)"]),
    ("no autocast in the capture", B, _edit(_AUTOCAST, "        static_loss = train_loss(model, static_x, static_y)"),
     ["float32", "autocast"]),
    ("Adam without capturable=True", B, _edit("lr=LR, capturable=True", "lr=LR"), ["capturable is False"]),
    ("keeps the static loss tensor, not a copy", B, _edit("losses.append(static_loss.detach().clone())",
                                                          "losses.append(static_loss)"), ["last replay"]),
    ("copies x but not y", B, _edit("        static_y.copy_(y)\n", ""), ["static_y"]),
    ("warm-up without the fork (side stream never waits)", B,
     _edit("    side.wait_stream(cg.current_stream())\n", ""), ["the fork", "side.wait_stream(cg.current_stream())"]),
    ("warm-up without the join (capture never waits)", B,
     _edit("    cg.current_stream().wait_stream(side)\n", ""), ["the join", "cg.current_stream().wait_stream(side)"]),
    # 02.8: two graphs, one pool
    ("a private pool per graph", C, _edit("with cg.graph(graph, pool=pool):", "with cg.graph(graph):"),
     ["do not share one pool", "each graph (batches 16, 64) has a pool of its own"]),
    ("a new pool handle per graph", C, _edit("with cg.graph(graph, pool=pool):",
                                             "with cg.graph(graph, pool=cg.graph_pool_handle()):"),
     ["do not share one pool"]),
    ("serves the static output itself", C, _edit(_SERVE, _SERVE.replace("static_y.clone()", "static_y")),
     ["overwrote", "clone"]),
    ("captures the smallest first", C, _edit("sorted(sizes, reverse=True)", "sorted(sizes)"), ["largest first"]),
    ("no warm-up", C, _edit("            for _ in range(3):\n                model(static_x)",
                            "            pass"), ["no warm-up ran before the capture"]),
    ("rebinds the static input instead of copy_", C, _edit(_SERVE, _SERVE.replace("static_x.copy_(x)",
                                                                                  "static_x = x")),
     ["is not model(x)"]),
    ("warm-up without the fork (side stream never waits)", C,
     _edit("        side.wait_stream(cg.current_stream())\n", ""), ["the fork"]),
    ("warm-up without the join (capture never waits)", C,
     _edit("        cg.current_stream().wait_stream(side)\n", ""), ["the join"]),
]


def _indented(block: str) -> str:
    return "".join("    " + line if line.strip() else line for line in block.splitlines(True))


_FORK = "    side.wait_stream(cg.current_stream())\n"
_JOIN = "    cg.current_stream().wait_stream(side)\n"
# right work written another way: every one passes on both paths, as it does on a GPU
RIGHT = [
    ("02.6 fork and join with events", A, [(_FORK, "    side.wait_event(cg.current_stream().record_event())\n"),
                                           (_JOIN, "    done = cg.Event()\n    done.record(side)\n"
                                                   "    done.wait(cg.current_stream())\n")]),
    ("02.6 synchronize() as the fork and the join", A, [(_FORK, "    cg.synchronize()\n"),
                                                         (_JOIN, "    cg.synchronize()\n")]),
    ("02.6 the join by side.synchronize()", A, _edit(_JOIN, "    side.synchronize()\n")),
    ("02.6 captured on the warm-up's own stream", A, [(_JOIN, ""), ("with cg.graph(graph):",
                                                                   "with cg.graph(graph, stream=side):")]),
    ("02.6 under inference_mode", A, _edit("    side = cg.Stream()\n" + _FORK + _WARM_A,
                                           "    with torch.inference_mode():\n"
                                           + _indented("    side = cg.Stream()\n" + _FORK + _WARM_A))),
    ("02.7 fork and join with events", B, [(_FORK, "    side.wait_event(cg.current_stream().record_event())\n"),
                                           (_JOIN, "    cg.current_stream().wait_event(side.record_event())\n")]),
    ("02.8 under inference_mode", C, [
        ("            for _ in range(3):\n                model(static_x)",
         "            with torch.inference_mode():\n"
         "                for _ in range(3):\n                    model(static_x)"),
        ("        with cg.graph(graph, pool=pool):",
         "        with torch.inference_mode(), cg.graph(graph, pool=pool):")]),
]


@pytest.mark.parametrize("exercise", [A, B, C])
def test_answer_passes(exercise, tmp_path):
    entry = run_exercise(exercise, (), tmp_path)
    assert entry["status"] == "pass", entry


@pytest.mark.parametrize("variant", RIGHT, ids=[r[0] for r in RIGHT])
def test_right_work_written_another_way_passes(variant, tmp_path):
    name, exercise, edits = variant
    entry = run_exercise(exercise, edits, tmp_path)
    assert entry["status"] == "pass", f"{name}: {entry}"


@pytest.mark.parametrize("mutant", MUTANTS, ids=[f"{m[1][:4]} {m[0]}" for m in MUTANTS])
def test_mutant_is_named(mutant, tmp_path):
    name, exercise, edits, words = mutant
    entry = run_exercise(exercise, edits, tmp_path)
    assert entry["status"] in ("fail", "crash"), f"{exercise} passed the mutant {name!r}: {entry}"
    missing = [w for w in words if w.lower() not in entry["message"].lower()]
    assert not missing, f"{exercise}'s ✗ for {name!r} does not say {missing}: {entry['message']!r}"


def test_a_capture_refused_before_the_model_ran_leads_with_its_error(tmp_path):
    """capture_begin on the default stream: the ✗ quotes the refusal first, not "the model never ran in a capture"."""
    edits = _edit("    with cg.graph(graph):\n        static_y = model(static_x)",
                  "    graph.capture_begin()\n    static_y = model(static_x)\n    graph.capture_end()")
    message = run_exercise(A, edits, tmp_path)["message"]
    assert message.startswith("your capture failed before the model ran in it: RuntimeError: CUDA graphs must be "
                              "captured on a non-default stream"), message
    assert "never ran during a capture" not in message and "cg.stream(side)" in message, message


def test_separate_pools_are_said_in_words():
    assert _pools_in_words({16: (2, 0), 64: (1, 0)}) == "each graph (batches 16, 64) has a pool of its own"
    assert _pools_in_words({8: (0, 1), 16: (0, 1), 64: (3, 0)}) == ("batches 8, 16 share one pool; the batch-64 graph "
                                                                    "has a pool of its own")


def test_every_exercise_has_at_least_four_mutants():
    for exercise in (A, B, C):
        assert sum(m[1] == exercise for m in MUTANTS) >= 4, exercise


def test_learner_version_says_not_done_yet(tmp_path):
    """An answer left as its TODO is "not done yet", never a ✗ that blames a missing warm-up."""
    begin = "    ### BEGIN SOLUTION\n"
    for exercise in (A, B, C):
        answer = _one(ANSWER[exercise])
        head = answer[:answer.index(begin) + len(begin)]
        edits = [(head, head + "    raise NotImplementedError('your code goes here')\n")]
        assert run_exercise(exercise, edits, tmp_path)["status"] == "todo"


def test_rules_name_the_stack_the_sweep_was_recorded_on():
    """The lesson's rules say which software the recorded replay host times hold for: the sweep's provenance."""

    prov = reference.load_reference("graphs_kernel_sweep").provenance
    nb = json.loads(NOTEBOOK.read_text(encoding="utf-8"))
    rules = next("".join(c["source"]) for c in nb["cells"]
                 if c["cell_type"] == "markdown" and "Rules this lesson established" in "".join(c["source"]))
    torch_minor = re.match(r"(\d+\.\d+)", prov["torch"]).group(1)
    driver_major = prov["driver"].split(".")[0]
    for want in (f"torch {torch_minor}", f"CUDA {prov['cuda_runtime']}", f"driver {driver_major}"):
        assert want in rules, f"the rules cell must name {want!r} (the sweep's provenance); it says: {rules[-300:]}"


# ----------------------------------------------------------------------------- the checks' own tools
def test_train_step_trains_with_autocast_and_capturable_adam():

    course.graphs()  # on the simulator: capturable optimizers may then run on the CPU (course.sim.optim)
    model = cc.small_mlp(seed=3)
    opt = torch.optim.Adam(model.parameters(), lr=replay.LR, capturable=True)
    x, y = torch.randn(8, 16, device=model[0].weight.device), torch.randn(8, 4, device=model[0].weight.device)
    before = [p.detach().clone() for p in model.parameters()]
    loss = replay.train_step(model, opt, x, y)
    assert loss.dtype == torch.float32 and loss.ndim == 0
    assert float(replay.train_loss(model, x, y).detach()) >= 0
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    device_type, dtype = replay.amp()
    assert device_type == ("cuda" if ON_GPU else "cpu") and dtype == torch.bfloat16
    assert torch.equal(cc.small_mlp(seed=3)[0].weight, cc.small_mlp(seed=3)[0].weight)


def test_the_tracer_sees_streams_captures_and_steps():

    cg = course.graphs()
    model = cc.small_mlp(seed=4)
    x = torch.zeros(8, 16, device=course.device())
    with cc.watching(model, cc._step_rules, optimizers=True) as t:
        assert judge(t, cc._forward_rules(t)).rule == "not_captured"
        model(x)  # on the default stream
        with torch.no_grad():
            g = cg.CUDAGraph()
            with cg.graph(g):
                model(x)
        out = judge(t, cc._forward_rules(t))
        assert out.rule == "warm_up" and "default stream" in out.message
    model(x)
    assert len(t.of(cc.MODEL)) == 2, "the hooks go when the block ends"
    assert [e["where"] for e in t.of(cc.MODEL)] == ["default", "capture"] and t.of(cc.MODEL)[0]["batch"] == 8


def test_restored_puts_the_stream_back_after_an_error():
    cg = course.graphs()
    side = cg.Stream()
    with pytest.raises(ZeroDivisionError):
        with cc.restored():
            cg.set_stream(side)
            1 / 0
    assert cg.current_stream() == cg.default_stream()


def test_a_non_capturable_step_inside_a_capture_is_named():

    model = cc.small_mlp(seed=2)
    with cc.watching(model, cc._step_rules, optimizers=True) as t:
        opt = torch.optim.Adam(model.parameters(), lr=replay.LR)
        model(torch.randn(4, 16, device=model[0].weight.device)).sum().backward()
        opt.step()  # outside a capture: nothing to say about capturable
    steps = t.of("step")
    assert steps and steps[-1]["capturable"] is False
    t.events.append({**steps[-1], "where": "capture"})  # the same step, as a capture would see it
    out = judge(t, [r for r in cc._step_rules(t) if r.name == "capturable"])
    assert "capturable is False" in out.message and "Adam(..., capturable=True)" in out.message


# ----------------------------------------------------------------------------- 02.1-02.5, called directly
def _verdict(capsys, name: str):
    """The exercise's status and what its check printed."""
    return checks.status(name), capsys.readouterr().out


def test_the_sweep_checks_pass_the_fit_and_name_a_wrong_number(capsys):
    sweep = reference.load_reference("graphs_kernel_sweep")
    saving = bench.per_kernel_slopes(sweep)["saving_us_per_kernel"]
    replay_checks.check_per_kernel_saving(lambda s: saving, sweep)
    assert _verdict(capsys, "02.1 saving per kernel")[0] == checks.PASS
    replay_checks.check_per_kernel_saving(lambda s: 2 * saving, sweep)
    status, out = _verdict(capsys, "02.1 saving per kernel")
    assert status == checks.FAIL and "us per kernel, expected" in out

    b = bench.per_kernel_slopes(sweep)["replay_us_per_kernel"]
    rows = [r for r in sweep.rows if r["kernels"] >= 16]
    a = sum(r["replay_us"] - b * r["kernels"] for r in rows) / len(rows)
    replay_checks.check_replay_prediction(lambda s, n: a + b * n, sweep)
    assert _verdict(capsys, "02.4 predict, then measure")[0] == checks.PASS
    replay_checks.check_replay_prediction(lambda s, n: 1.0, sweep)
    status, out = _verdict(capsys, "02.4 predict, then measure")
    assert status == checks.FAIL and "the fit of the sweep gives" in out


def test_break_even_checks_every_row_with_a_saving(capsys):
    new_shape = reference.load_reference("graphs_new_shape")
    right = lambda r: (r["warmup_ms"] + r["capture_ms"]) * 1000 / (r["eager_us"] - r["replay_us"])  # noqa: E731
    replay_checks.check_break_even(right, new_shape)
    assert _verdict(capsys, "02.2 break-even replays")[0] == checks.PASS
    replay_checks.check_break_even(lambda r: right(r) / 1000, new_shape)  # ms over us
    status, out = _verdict(capsys, "02.2 break-even replays")
    assert status == checks.FAIL and "replays, expected" in out


def _captured_layer():
    """Section 1's graph on this path: ``(model, static_x, static_y, g)``."""
    cg = course.graphs()
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 8).to(course.device())
    static_x = torch.zeros(16, 64, device=course.device())
    with torch.no_grad():
        model(static_x)
        g = cg.CUDAGraph()
        with cg.graph(g):
            static_y = model(static_x)
    return model, static_x, static_y, g


def test_replay_with_names_a_result_the_next_replay_overwrote(capsys):
    model, static_x, static_y, g = _captured_layer()

    def right(x):
        static_x.copy_(x)
        g.replay()
        return static_y.clone()

    def not_cloned(x):
        static_x.copy_(x)
        g.replay()
        return static_y

    replay_checks.check_replay_with(right, model)
    assert _verdict(capsys, "02.3 replay with new data")[0] == checks.PASS
    replay_checks.check_replay_with(not_cloned, model)
    status, out = _verdict(capsys, "02.3 replay with new data")
    assert status == checks.FAIL and "was it overwritten?" in out


def test_serve_names_an_input_never_copied_in(capsys):
    model, static_x, static_y, g = _captured_layer()

    def forward(x):
        with torch.no_grad():
            return model(x)

    def serve(requests, copy_in=True):
        out = []
        for x in requests:
            if copy_in:
                static_x.copy_(x)
            g.replay()
            out.append(static_y.clone())
        return out

    replay_checks.check_serve(serve, forward)
    assert _verdict(capsys, "02.5 diagnose a wrong replay")[0] == checks.PASS
    static_x.zero_()
    replay_checks.check_serve(lambda reqs: serve(reqs, copy_in=False), forward)
    status, out = _verdict(capsys, "02.5 diagnose a wrong replay")
    assert status == checks.FAIL and "still reads the old input memory" in out
