"""The capture-hazard finder: static rules at exact lines (CPU), the zoo, reference data, and the GPU checks."""
from __future__ import annotations

import functools
import inspect
import json
import os
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import course
import course.sim.stream as stream
from course.core import cells, checks, reference
from course.core.blocking import BlockingReport
from course.core.capture import CaptureOutcome
from course.core.results import Result
from course.core.runtime import CourseEnvironmentError, runtime
from course.core.timing import Timing
from course.lessons import what_breaks as hazards
from course.lessons.what_breaks import bench as experiments, dynamic, find_static, zoo
from course.lessons.what_breaks.dynamic import is_library_file
from course.lessons.what_breaks.static import Finding

ON_GPU = runtime().on_gpu
gpu = pytest.mark.skipif(not ON_GPU, reason="needs a real GPU (the dynamic finder runs CUDA)")
sim = pytest.mark.skipif(ON_GPU, reason="reference loading is the simulator path's behaviour")


# ---------------------------------------------------------------------------------------
# fixture functions: each hazard at a known offset from the ``def`` line
# ---------------------------------------------------------------------------------------
def fx_item(x):
    y = x * 2
    return y.sum().item()


def fx_to_variants(x, cpu_device):
    a = x.to("cpu")
    b = x.to(device="cpu")
    c = x.to(torch.device("cpu"))
    d = x.to(cpu_device)
    e = x.to("cuda")
    f = x.to(torch.float16)
    return a, b, c, d, e, f


def fx_copies(x):
    a = x.cpu()
    b = x.tolist()
    c = x.detach().numpy()
    return a, b, c


def fx_print(x):
    print("a constant is fine")
    print(f"x = {x}")
    return x


def fx_sync(x):
    torch.cuda.synchronize()
    torch.cuda.current_stream().synchronize()
    return x


def fx_data_dependent(x, ids):
    a = x.nonzero()
    b = torch.masked_select(x, x > 0)
    c = torch.unique(ids)
    d = torch.where(x > 0)
    e = torch.where(x > 0, x, 0)
    f = ids.repeat_interleave(2)
    g = ids.bincount()
    return a, b, c, d, e, f, g


def fx_host_bool(x):
    if x.sum() > 0:
        x = x + 1
    while (x > 10).any():
        x = x / 2
    flag = bool(x.max() > 0)
    s = float(x.mean())
    n = int(x.shape[0])
    if x.shape[0] > 2:
        pass
    y = x if torch.equal(x, x) else -x
    return flag, s, n, y


def fx_h2d(x):
    t = torch.tensor([1.0, 2.0], device="cuda")
    u = torch.tensor([1.0, 2.0])
    host_v = torch.ones(2)
    w = host_v.to(x.device)
    z = torch.arange(2).to("cuda")
    q = host_v.cuda()
    pinned = torch.ones(2).pin_memory()
    p = pinned.to(x.device, non_blocking=True)
    return t, u, w, z, q, p


def fx_capture_branch(x):
    if torch.cuda.is_current_stream_capturing():
        return x
    return x + random.random()


def fx_multiline(x):
    return (x.abs()
            .max()
            .item())


def fx_safe(x, w):
    y = torch.relu(x @ w)
    if y.shape[0] > 4:
        y = y[:4]
    z = torch.where(y > 0, y, torch.zeros_like(y))
    return z.to(x.device), z.to(torch.float16), z.sum(dim=0), z.repeat_interleave(2, dim=0)


fx_lambda = lambda x: x.item() + 1  # noqa: E731


class FxModule(torch.nn.Module):
    def forward(self, x):
        return x.cpu()


def _def_line(fn) -> int:
    return inspect.getsourcelines(fn)[1]


def _found(fn) -> list:
    """(offset from the def line, rule) for every static finding."""
    first = _def_line(fn)
    return [(f.line - first, f.rule) for f in find_static(fn)]


# ---------------------------------------------------------------------------------------
# static finder: exact lines, CPU
# ---------------------------------------------------------------------------------------
def test_item_exact_line():
    assert _found(fx_item) == [(2, "item")]


def test_to_cpu_spellings_and_safe_to():
    assert _found(fx_to_variants) == [(1, "to_cpu"), (2, "to_cpu"), (3, "to_cpu"), (4, "to_cpu")]


def test_host_copies():
    assert _found(fx_copies) == [(1, "cpu"), (2, "tolist"), (3, "numpy")]


def test_print_of_values_not_of_constants():
    assert _found(fx_print) == [(2, "print")]


def test_synchronize_kinds():
    assert _found(fx_sync) == [(1, "cuda_synchronize"), (2, "synchronize")]


def test_data_dependent_shapes():
    assert _found(fx_data_dependent) == [(1, "data_dependent"), (2, "data_dependent"), (3, "data_dependent"),
                                         (4, "data_dependent"), (7, "data_dependent")]


def test_host_bool_and_scalar_but_not_shapes():
    assert _found(fx_host_bool) == [(1, "host_bool"), (3, "host_bool"), (5, "host_bool"), (6, "host_scalar"),
                                    (10, "host_bool")]


def test_host_to_device_copies_but_not_pinned():
    assert _found(fx_h2d) == [(1, "tensor_ctor"), (4, "h2d"), (5, "h2d"), (6, "h2d")]


def test_capture_branch_and_host_values():
    assert _found(fx_capture_branch) == [(1, "capture_branch"), (3, "host_value")]


def test_multiline_chain_reports_the_item_line():
    assert _found(fx_multiline) == [(3, "item")]


def test_safe_function_has_no_findings():
    assert find_static(fx_safe) == []


def test_lambda_module_partial_and_class():
    line = _def_line(fx_lambda)
    assert [(f.line, f.rule) for f in find_static(fx_lambda)] == [(line, "item")]
    mod_findings = find_static(FxModule())
    assert [(f.line - _def_line(FxModule.forward), f.rule) for f in mod_findings] == [(1, "cpu")]
    assert find_static(functools.partial(fx_item, torch.ones(2))) == find_static(fx_item)
    assert {f.rule for f in find_static(FxModule)} == {"cpu"}


def test_findings_carry_file_code_why_fix():
    (f,) = find_static(fx_item)
    assert f.file == os.path.abspath(__file__) or os.path.samefile(f.file, __file__)
    assert f.code == "return y.sum().item()"
    assert "host" in f.why and f.fix
    assert f.where() == f"test_hazards.py:{f.line}"
    assert f"test_hazards.py:{f.line}" in str(f)


def test_every_rule_explains_itself():
    for rule in hazards.RULES.values():
        assert isinstance(rule, hazards.Rule)
        assert rule.what and len(rule.why) > 20 and len(rule.fix) > 10, rule.id
    assert all(isinstance(f, hazards.Finding) for f in find_static(fx_h2d))


ZOO_FUNCTIONS = {
    "item": ("item_hazard", "item_fixed"), "cpu": ("cpu_hazard", "cpu_fixed"),
    "to_cpu": ("to_cpu_hazard", "to_cpu_fixed"), "tolist": ("tolist_hazard", "tolist_fixed"),
    "print": ("print_hazard", "print_fixed"), "if_tensor": ("if_tensor_hazard", "if_tensor_fixed"),
    "nonzero": ("nonzero_hazard", "nonzero_fixed"), "masked_select": ("masked_select_hazard", "masked_select_fixed"),
    "unique": ("unique_hazard", "unique_fixed"), "synchronize": ("synchronize_hazard", "synchronize_fixed"),
    "h2d_pageable": ("h2d_pageable_hazard", "h2d_pageable_fixed"),
    "tensor_ctor": ("tensor_ctor_hazard", "tensor_ctor_fixed"),
    "pinned_frozen": ("pinned_frozen_hazard", "pinned_frozen_fixed"),
}


def test_zoo_registry_lists_every_function_once():
    assert {e.name: (e.hazard.__name__, e.fixed.__name__) for e in zoo.ENTRIES} == ZOO_FUNCTIONS
    assert zoo.names() == list(ZOO_FUNCTIONS)
    assert [n for n, _, _ in zoo.SAFE] == ["safe_mlp", "safe_shape_logic", "safe_embedding_bag"]
    for e in zoo.ENTRIES:
        assert e.hazard.__doc__ and e.fixed.__doc__, e.name


def test_builtins_are_refused_with_a_clear_error():
    with pytest.raises(TypeError, match="no Python source"):
        find_static(len)


def test_module_wide_scan_finds_every_zoo_hazard():
    lines = {f.line for f in find_static(zoo)}
    for e in zoo.ENTRIES:
        assert set(e.hazard_lines()) <= lines, e.name


# ---------------------------------------------------------------------------------------
# the zoo under the static finder (CPU)
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", zoo.names())
def test_static_flags_each_zoo_hazard_at_its_marked_lines(name):
    e = zoo.get(name)
    found = find_static(e.hazard)
    assert e.hazard_lines(), f"{name}: the hazard has no '# hazard' marker"
    assert sorted({f.line for f in found}) == e.hazard_lines()
    assert sorted({f.rule for f in found}) == sorted(e.rules)


@pytest.mark.parametrize("name", zoo.names())
def test_static_finds_nothing_in_each_fix(name):
    assert find_static(zoo.get(name).fixed) == []


def test_static_finds_nothing_in_safe_functions():
    for name, fn, _ in zoo.safe_functions():
        assert find_static(fn) == [], name


@pytest.mark.parametrize("name", zoo.names())
def test_each_fix_computes_what_the_hazard_computes(name):
    e = zoo.get(name)
    if not e.cpu_eager and not ON_GPU:
        pytest.skip("this hazard needs CUDA to run even eagerly")
    assert checks.same_result(e.hazard(*e.hazard_args()), e.fixed(*e.fixed_args()))


def test_flat_tensors_walks_nested_outputs():
    a, b, c = torch.ones(1), torch.zeros(2), torch.ones(3)
    assert [t.numel() for t in checks.flat_tensors((a, [b, (c,)], "x", 3))] == [1, 2, 3]
    assert checks.flat_tensors(None) == []


def test_same_result_can_fail():
    assert not checks.same_result(torch.ones(3), torch.zeros(3))
    assert not checks.same_result((torch.ones(3),), (torch.ones(3), torch.ones(1)))
    assert checks.same_result((torch.ones(3), [torch.zeros(2)]), [torch.ones(3), torch.zeros(2)])


def test_zoo_lookup_and_source_listing():
    assert zoo.get("item").hazard is zoo.item_hazard
    with pytest.raises(KeyError, match="known"):
        zoo.get("nope")
    line = zoo.get("item").hazard_lines()[0]
    text = zoo.source(zoo.item_hazard, {line: "item"})
    assert f"{line:4d} |" in text and "<-- item" in text


def test_describe_uses_a_reference_row():
    row = {"function": "item_hazard", "capture": "AcceleratorError: CUDA error: x", "capture_where": "zoo.py:29",
           "replay": "-", "blocked": True}
    fixed_row = {"function": "item_fixed", "capture": "captured", "capture_where": "", "replay": "matches eager",
                 "blocked": False}
    text = zoo.describe("item", row, fixed_row)
    assert "AcceleratorError: CUDA error: x" in text and "captured" in text and "<-- .item()" in text
    short = zoo.describe("item", row, fixed_row, sources=False)  # the notebook's cell shows the code
    line = zoo.get("item").hazard_lines()[0]
    assert f"the finder: line {line}: .item()" in short and " | " not in short and "captured" in short


# ---------------------------------------------------------------------------------------
# frames and the CPU path of find_hazards
# ---------------------------------------------------------------------------------------
def test_library_vs_user_frames():
    assert hazards.is_library_file(torch.__file__)
    assert hazards.is_library_file(dynamic.__file__)
    assert hazards.is_library_file(os.__file__)
    assert not hazards.is_library_file(__file__)
    assert not hazards.is_library_file(zoo.__file__)
    frames = [(__file__, 10, "outer", "a"), (zoo.__file__, 29, "item_hazard", "b"), (torch.__file__, 5, "t", "c")]
    assert hazards.user_frame(frames)[1] == 29
    assert hazards.user_frame([(torch.__file__, 5, "t", "c")]) is None


@pytest.mark.skipif(ON_GPU, reason="the CPU path's behaviour")
def test_find_hazards_is_static_only_without_a_gpu():
    rep = hazards.find_hazards(fx_item, torch.ones(3))
    assert isinstance(rep, hazards.HazardReport)
    assert rep.dynamic is None and rep.flagged and "GPU" in rep.note
    assert rep.lines() == [_def_line(fx_item) + 2]
    assert "no hazards found" in str(hazards.find_hazards(fx_safe, torch.ones(2, 2), torch.ones(2, 2)))
    with pytest.raises(CourseEnvironmentError):
        hazards.find_hazards(fx_item, torch.ones(3), dynamic=True)
    with pytest.raises(CourseEnvironmentError, match="needs a real GPU"):
        hazards.find_dynamic(fx_item, torch.ones(3))


def test_tiny_kernel_runs_on_this_path():
    t = torch.zeros(8, device=course.device())
    experiments.launch_tiny(t)
    course.synchronize()
    assert t.cpu().tolist() == [1.0] * 8
    with pytest.raises(ValueError, match="at most 32"):
        experiments.launch_tiny(torch.zeros(64, device=course.device()))


# ---------------------------------------------------------------------------------------
# reference data (the simulator path)
# ---------------------------------------------------------------------------------------
def test_experiments_are_registered_gpu_only_with_quick_params():
    for name in ("hazards_finder", "hazards_event_test"):
        exp = reference.get(name)
        assert exp.gpu_only and isinstance(exp.quick, dict), name
        params = inspect.signature(exp.fn).parameters
        assert set(exp.quick) <= set(params), name


def test_waiting_line_is_where_the_sleep_ran_out_not_the_longest_line():
    ev = [(0.000, "f.py", 10, "f"), (0.001, "f.py", 11, "f"), (0.021, "f.py", 12, "f"), (0.060, "f.py", 13, "f")]
    # line 11 ran from 1 ms to 21 ms: the 16 ms threshold passed there; line 12 (a later 39 ms stall) is not blamed
    assert hazards.waiting_line(ev, 0.016)[2] == 11
    assert hazards.waiting_line(ev, 0.5) is None
    assert hazards.waiting_line([], 0.016) is None


@sim
def test_missing_reference_says_how_to_make_it(tmp_path, monkeypatch):
    monkeypatch.setattr(reference, "REFERENCE_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match="python -m course bench"):
        reference.run("hazards_finder")


@sim
def test_reference_result_loads_with_provenance(tmp_path, monkeypatch):
    monkeypatch.setattr(reference, "REFERENCE_DIR", tmp_path)
    row = {c: "" for c in ("function", "entry", "kind", "static_lines", "static_rules", "sync_debug_lines",
                           "blocking_line", "capture_line", "capture", "replay", "capture_where")}
    row.update(flagged=True, host_return_ms=20.0, gpu_busy_ms=20.1, blocked=True, event_complete=True,
               next_capture_ok=True)
    res = Result("hazards_finder", "t", {k: "" for k in row}, [row])
    path = reference.reference_path("hazards_finder")
    assert path == tmp_path / "hazards_finder.json"
    path.write_text(json.dumps(res.to_dict()))
    got = reference.run("hazards_finder")
    assert got.source == "reference" and not got.live
    assert got.rows[0]["blocked"] is True
    assert "recorded on" in got.caption()
    bad = res.to_dict()
    bad["rows"][0]["blocked"] = False
    (tmp_path / "hazards_finder.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="checksum"):
        reference.run("hazards_finder")


# ---------------------------------------------------------------------------------------
# dynamic finder (GPU)
# ---------------------------------------------------------------------------------------
@gpu
@pytest.mark.parametrize("name", zoo.names())
def test_dynamic_flags_each_hazard_at_its_line(name):
    e = zoo.get(name)
    rep = hazards.find_hazards(e.hazard, *e.hazard_args(), dynamic=True)
    d = rep.dynamic
    assert rep.flagged and isinstance(d, hazards.DynamicReport) and isinstance(d.blocking, BlockingReport)
    marked = set(e.hazard_lines())
    if e.outcome == "error":
        assert not d.capture.ok
        cap = [f for f in d.findings if f.source == "capture"]
        assert cap and cap[0].line in marked, (cap, marked)
    else:
        assert d.capture.ok and d.replay_matches is False
    assert d.blocking.blocked, f"{name} should make the host wait"
    blk = [f for f in d.findings if f.source == "host-blocking"]
    assert blk and blk[0].line in marked, (blk, marked)


@gpu
def test_dynamic_finds_nothing_in_safe_functions_and_fixes():
    for name, fn, args in zoo.safe_functions():
        rep = hazards.find_hazards(fn, *args, dynamic=True)
        assert not rep.flagged, f"{name}: {rep}"
        assert rep.dynamic.capture.ok and rep.dynamic.replay_matches is True, name


@gpu
def test_find_dynamic_alone_reports_lines_in_the_callers_file():
    x = torch.randn(16, device="cuda")
    d = hazards.find_dynamic(fx_item, x)
    assert {f.source for f in d.findings} == {"sync-debug", "host-blocking", "capture"}
    assert {f.line for f in d.findings} == {_def_line(fx_item) + 2}
    assert d.replay_matches is None and d.sync_warnings >= 1


@gpu
def test_sync_debug_maps_item_to_its_line():
    x = torch.randn(16, device="cuda")
    events = hazards.sync_debug_events(lambda: fx_item(x))
    assert events and events[0]["frame"][1] == _def_line(fx_item) + 2


@gpu
def test_blocking_line_points_at_synchronize():
    x = torch.randn(16, device="cuda")
    rep, frame = hazards.blocking_with_line(lambda: fx_sync(x), sleep_ms=20)
    assert rep.blocked and frame[1] == _def_line(fx_sync) + 1


@gpu
def test_finder_experiment_quick():
    exp = reference.get("hazards_finder")
    res = exp.fn(**exp.quick)
    assert res.value("safe functions flagged") == 0
    haz = [r for r in res.rows if r["kind"] == "hazard"]
    assert res.value("hazards flagged") == len(haz) > 0
    assert all(r["next_capture_ok"] for r in res.rows)


@gpu
def test_event_test_experiment_quick():
    exp = reference.get("hazards_event_test")
    res = exp.fn(**exp.quick)
    rows = {r["call"]: r for r in res.rows}
    assert rows["x.sum().item()"]["blocked"] and rows["torch.cuda.synchronize()"]["blocked"]
    nb = rows["numba tiny kernel (launch_tiny)"]
    assert not nb["blocked"], "a Numba launch does not wait for the GPU"
    assert res.value("launch / kernel") > 1


def _adds_a_cpu_vector(x):
    return x + torch.ones(1, 3)  # shape mismatch on any device: fails before any capture


def test_eager_failure_is_a_finding_at_the_users_line():
    try:
        _adds_a_cpu_vector(torch.ones(2, 2))
    except Exception as e:  # noqa: BLE001
        f = dynamic.eager_failure(e)
    assert f.rule == "fails" and f.source == "eager"
    assert f.file == __file__ and "torch.ones(1, 3)" in f.code
    assert "RuntimeError" in f.why and "without any capture" in f.why


@pytest.mark.skipif(not course.runtime().on_gpu, reason="the dynamic finder needs a GPU")
def test_finder_reports_a_function_that_fails_without_capture():
    x = torch.ones(4, device="cuda")
    rep = hazards.find_hazards(lambda t: t + torch.ones(1, 3), x)  # a CUDA tensor plus a CPU tensor of shape [1, 3]
    assert rep.flagged and rep.dynamic.findings[0].rule == "fails"
    assert "without any capture" in str(rep)


# ---------------------------------------------------------------------------------------
# lesson 03's experiments stand in its cells; their bookkeeping here (CPU) and their checks (GPU)
# ---------------------------------------------------------------------------------------
def test_lesson_03_experiments_are_its_cells():

    nb = Path(__file__).resolve().parents[1] / "solutions" / "03_what_breaks_capture.ipynb"
    for name in ("hazards_finder", "hazards_event_test", "hazards_numba", "compile_skip_reasons"):
        assert reference.get(name).fn.__module__ == cells.module_name(nb), name
    assert reference.get("capture_recovery").fn.__module__ == "course.lessons.what_breaks.bench"


def test_finder_targets_are_each_hazard_and_fix_then_the_safe_functions():
    targets = experiments.finder_targets(("item", "synchronize"))
    kinds = [(t[1], t[2]) for t in targets]
    assert kinds[:4] == [("item", "hazard"), ("item", "fix"), ("synchronize", "hazard"), ("synchronize", "fix")]
    assert [t[2] for t in targets[4:]] == ["safe"] * len(zoo.SAFE) and all(t[1] == "-" for t in targets[4:])
    assert targets[0][0] == zoo.get("item").hazard.__name__ and targets[0][3] is zoo.get("item").hazard
    assert [t[:3] for t in experiments.finder_targets("item")] == [t[:3] for t in experiments.finder_targets(["item"])]
    every = experiments.finder_targets()
    assert len(every) == 2 * len(zoo.ENTRIES) + len(zoo.SAFE)
    with pytest.raises(ValueError, match="no zoo entry called.*nope"):
        experiments.finder_targets(("item", "nope"))


def _finding(line, source, rule="item"):
    return Finding(rule, line, "/x/zoo.py", "y.item()", source)


def _report(static, findings, *, captured, replay, blocked=True):

    cap = CaptureOutcome(True) if captured else CaptureOutcome(False, "RuntimeError", "not permitted")
    d = hazards.DynamicReport(findings, BlockingReport(20.5, 21.0, blocked), cap, replay, 1)
    return SimpleNamespace(static=static, dynamic=d, flagged=bool(static or findings))


def test_finder_row_reads_each_check_of_the_report():
    rep = _report([_finding(12, "static"), _finding(10, "static", "cpu"), _finding(12, "static")],
                  [_finding(12, "sync-debug"), _finding(None, "sync-debug"), _finding(11, "capture"),
                   _finding(12, "host-blocking")], captured=False, replay=None)
    row = experiments.finder_row("item_hazard", "item", "hazard", rep, True, False)
    assert row["static_lines"] == "10,12" and row["static_rules"] == "cpu,item"
    assert row["sync_debug_lines"] == "12" and row["capture_line"] == "11" and row["blocking_line"] == "12"
    assert row["capture"] == "RuntimeError: not permitted" and row["replay"] == "-" and row["capture_where"] == "zoo.py:11"
    assert row["blocked"] is True and row["event_complete"] is True and row["next_capture_ok"] is False
    assert row["host_return_ms"] == 20.5 and row["gpu_busy_ms"] == 21.0 and row["flagged"]
    wrong = experiments.finder_row("f", "-", "safe", _report([], [], captured=True, replay=False, blocked=False),
                                   None, True)
    assert wrong["capture"] == "captured" and wrong["replay"] == "DIFFERS" and wrong["event_complete"] is False
    assert wrong["capture_where"] == "" and not wrong["flagged"] and wrong["blocked"] is False
    right = experiments.finder_row("f", "-", "safe", _report([], [], captured=True, replay=True), False, True)
    assert right["replay"] == "matches eager"


def test_finder_result_counts_flagged_hazards_and_safe_functions():
    def row(kind, flagged, next_ok=True):
        rep = _report([_finding(3, "static")] if flagged else [], [], captured=True, replay=True)
        return experiments.finder_row("f", "-", kind, rep, False, next_ok)

    rows = [row("hazard", True), row("hazard", False, False), row("fix", True), row("safe", False)]
    res = experiments.finder_result(rows, ("item",), 20.0)
    assert res.value("hazards flagged") == 1 and res.summary["hazards flagged"]["unit"] == "of 2"
    assert res.value("safe functions flagged") == 1 and res.summary["safe functions flagged"]["unit"] == "of 2"
    assert res.value("captures after a failure that still worked") == 3
    assert res.params == {"names": ["item"], "sleep_ms": 20.0}
    assert experiments.finder_result(rows, None, 5.0).params == {"names": None, "sleep_ms": 5.0}


def test_event_test_result_reads_the_cells_measurements():
    def host(us):
        return Timing(us * 1e-6, us * 1e-6, us * 1e-6, us * 1e-6, us * 1e-6, 5, 1, "host-enqueue")

    rows = [{"call": "numba", "host": host(30.0), "gpu_us": 2.0, "events": [True, True, True, False, False],
             "blocking": BlockingReport(0.05, 20.0, False)},
            {"call": "item", "host": host(40.0), "gpu_us": None, "events": [True, True, False, False, False],
             "blocking": BlockingReport(20.1, 20.0, True)}]
    res = experiments.event_test_result(rows, repeats=5, sleep_ms=20.0)
    nb, item = res.rows
    assert nb["event_complete"] is True and nb["event_complete_of_5"] == 3 and nb["blocked"] is False
    assert item["event_complete"] is False and item["event_complete_of_5"] == 2 and item["blocked"] is True
    assert nb["host_call_us"] == pytest.approx(30.0) and item["gpu_us"] is None and item["host_return_ms"] == 20.1
    assert res.value("launch / kernel") == pytest.approx(15.0) and res.value("numba kernel, GPU time") == 2.0
    assert res.params == {"repeats": 5, "sleep_ms": 20.0}


@gpu
def test_canary_and_gpu_time_per_call():
    assert experiments.canary_ok() is True
    x = torch.zeros(1, device="cuda")
    us = experiments.gpu_us_per_call(lambda: x.add_(1.0), n=10, host_us=50.0)
    assert 0 < us < 1000
    assert x.item() == 10.0


@pytest.mark.skipif(ON_GPU, reason="the CPU path's behaviour")
def test_lesson_03_cell_experiments_say_they_need_a_gpu():
    for name in ("hazards_finder", "hazards_event_test"):
        exp = reference.get(name)
        with pytest.raises(CourseEnvironmentError, match="needs a real GPU"):
            exp.fn(**exp.quick)


def test_simulator_frames_are_the_courses_not_the_learners():
    """A frame inside the simulator package (course/sim/) is a tool's frame, so a fallback names the learner's line."""
    assert is_library_file(stream.__file__)
    assert not is_library_file(__file__)
