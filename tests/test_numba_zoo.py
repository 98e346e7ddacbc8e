"""Numba capture hazards (course.lessons.what_breaks.numba_zoo): eager results, static findings, GPU captures."""
import pytest
import torch

import course
from course.core import numba_kernels, reference
from course.core.runtime import CourseEnvironmentError, as_numba, numba_stream
from course.lessons.what_breaks import find_static, numba_zoo
from course.lessons.what_breaks.bench import capture_and_replay, numba_result, run_eagerly
from course.lessons.what_breaks.numba_zoo import ENTRIES, entry_args, kernels
from course.parity.streams import _affine

NAMES = [e[0] for e in ENTRIES]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("kind", ["hazard", "fix"])
def test_every_entry_computes_2x_plus_1_eagerly(name, kind):
    out, x = run_eagerly(name, kind)
    assert torch.allclose(out.cpu(), 2 * x.cpu() + 1)


def test_static_finder_flags_the_numba_hazards_and_not_their_fixes():
    want = {"default_stream": {"numba_default_stream"}, "device_array": {"numba_alloc"},
            "to_device": {"numba_alloc"}, "first_compile": set()}
    for name, _, hazard, fixed in ENTRIES:
        assert {f.rule for f in find_static(hazard)} == want[name], name
        assert find_static(fixed) == [], name


def test_kernels_are_compiled_once_and_args_match_entries():
    assert kernels() is not None and kernels()[0] is kernels()[0]
    x = torch.zeros(4)
    assert len(entry_args("to_device", True, x)) == 2 and entry_args("device_array", False, x) == (x,)
    assert numba_zoo.ENTRIES and callable(capture_and_replay)


@pytest.mark.skipif(not course.runtime().on_gpu, reason="needs a GPU")
def test_numba_experiment_fixes_replay_right():
    res = reference.get("hazards_numba").fn(n=256)  # the experiment as lesson 03's cell defines it
    assert res.value("fixes that capture and replay right") == len(ENTRIES)
    assert [(r["entry"], r["kind"]) for r in res.rows] == [(e[0], k) for e in ENTRIES for k in ("hazard", "fix")]


def test_numba_result_counts_fixes_that_replay_right_and_hazards_that_break():
    def row(kind, captured, matches):
        return {"entry": "e", "title": "t", "kind": kind, "function": "f", "static_rules": "", "captured": captured,
                "error": "" if captured else "CUDAError: x", "empty_graph_warning": False,
                "replay_matches_eager": matches}

    rows = [row("hazard", False, None), row("fix", True, True), row("hazard", True, False), row("fix", True, False),
            row("hazard", True, True), row("fix", False, None)]
    res = numba_result(rows, n=64)
    assert res.value("fixes that capture and replay right") == 1
    assert res.value("hazards that fail to capture or replay wrong") == 2
    assert res.summary["fixes that capture and replay right"]["unit"] == f"of {len(ENTRIES)}"
    assert res.params == {"n": 64} and res.name == "hazards_numba" and len(res.rows) == 6


@pytest.mark.skipif(course.runtime().on_gpu, reason="the CPU path's behaviour")
def test_numba_experiment_says_it_needs_a_gpu():
    with pytest.raises(CourseEnvironmentError, match="needs a real GPU"):
        reference.get("hazards_numba").fn()


def test_entries_name_their_functions():
    assert {e[0]: (e[2].__name__, e[3].__name__) for e in ENTRIES} == {
        "default_stream": ("default_stream_hazard", "default_stream_fixed"),
        "device_array": ("device_array_hazard", "device_array_fixed"),
        "to_device": ("to_device_hazard", "to_device_fixed"),
        "first_compile": ("first_compile_hazard", "first_compile_fixed"),
    }


def test_the_shared_affine_kernel_is_compiled_once_and_computes_2x_plus_1():

    k = numba_kernels.affine()
    assert k is numba_kernels.affine() is _affine() is numba_zoo.kernels()[0]
    x = torch.arange(40, dtype=torch.float32, device=course.device())
    out = torch.zeros_like(x)
    k[2, 32, numba_stream()](as_numba(x), as_numba(out))
    course.graphs().synchronize()
    assert torch.equal(out, 2 * x + 1)
