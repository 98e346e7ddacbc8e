"""The persistent step's launch-shape search (course.lessons.last_mile.persistent_tuning, bench):
the candidates' shapes, which candidate a recording chooses (only beyond the spread, only correct
ones, only on the GPU it was recorded on), and the decoder taking it; the search itself on a GPU."""
import json

import pytest

from course.core import reference as R
from course.core import triton_path as TP
from course.core.results import Result
from course.core.runtime import runtime
from course.lessons.last_mile import persistent_tuning as T

ON_GPU = runtime().on_gpu
needs_triton = pytest.mark.skipif(not TP.available(), reason=TP.missing_reason() or "triton")
COLS = {"candidate": "", "status": "", "us": "us", "q1_us": "us", "q3_us": "us", "correct": ""}


def _result(rows, device="NVIDIA H200", quick=False):
    full = [{"candidate": n, "status": s, "us": us, "q1_us": us - 2, "q3_us": us + 2, "correct": ok}
            for n, s, us, ok in rows]
    return Result(T.NAME, "search", COLS, full, provenance={"device": device, "path": "cuda"},
                  params={"quick": quick})


def test_shapes_for_caps_each_chunk_at_its_input_width():
    from course.lessons.last_mile.decoder import default_config
    from course.lessons.real_model import build_model

    stages = {"qkv": (4, 2048, 1), "down": (16, 1024, 2)}
    cfg = T.shapes_for(default_config(64, 176, 16, 256), stages, build_model("tiny").config)
    assert (cfg.qkv.rows, cfg.qkv.depth) == (4, 1) and cfg.qkv.block_k <= 64
    assert cfg.down.rows == 16 and cfg.down.block_k <= 256 and cfg.down.depth == 2


def test_choose_takes_the_fastest_correct_candidate_beyond_the_spread():
    names = list(T.CANDIDATES)
    res = _result([(T.DEFAULT, "ok", 1400.0, True), (names[1], "ok", 1300.0, True),
                   (names[2], "ok", 1200.0, False), (names[3], "ok", 1250.0, True),
                   (names[4], "RuntimeError: barrier", float("nan"), False)])
    assert T.choose(res) == names[3]  # 1200 was wrong, so the 1250 one
    inside = _result([(T.DEFAULT, "ok", 1400.0, True), (names[1], "ok", 1399.0, True)])
    assert T.choose(inside) is None  # inside the spread: noise, the defaults stand
    assert T.choose(_result([(names[1], "ok", 900.0, True)])) is None  # no defaults: none to beat


def test_tuned_reads_the_recording_of_this_gpu_only(tmp_path, monkeypatch):
    monkeypatch.setattr(R, "REFERENCE_DIR", tmp_path)
    assert T.tuned("NVIDIA H200") is None  # no recording
    name = list(T.CANDIDATES)[2]
    res = _result([(T.DEFAULT, "ok", 1400.0, True), (name, "ok", 1000.0, True)])
    (tmp_path / f"{T.NAME}.json").write_text(json.dumps(res.to_dict(), default=str))
    assert T.tuned("NVIDIA H200") == T.CANDIDATES[name] and T.chosen("NVIDIA H200") == name
    assert T.tuned("NVIDIA H100 80GB HBM3") is None  # another GPU: the defaults
    assert T.chosen("NVIDIA H100 80GB HBM3") == T.DEFAULT
    quick = _result([(T.DEFAULT, "ok", 1400.0, True), (name, "ok", 1000.0, True)], quick=True)
    (tmp_path / f"{T.NAME}.json").write_text(json.dumps(quick.to_dict(), default=str))
    assert T.tuned("NVIDIA H200") is None  # a smoke run never sets the shapes


@needs_triton
@pytest.mark.skipif(ON_GPU, reason="the interpreter's build; the GPU's is timed by the search")
def test_build_gives_a_persistent_decoder_with_the_candidates_warps():
    from course.lessons.last_mile.bench import build
    from course.lessons.real_model import build_model

    name = "chunks of 1024, 16 warps"
    dec = build(build_model("tiny"), 32, name)
    assert dec.warps == T.CANDIDATES[name][0] and dec.tuned is None and dec.kernels_per_token == 1


@pytest.mark.skipif(not (ON_GPU and TP.available()), reason="needs a GPU with Triton")
def test_search_experiment_on_the_gpu():
    from course.lessons.last_mile.bench import search_experiment

    res = search_experiment(size="tiny", repeats=3, n_tokens=4,
                            candidates=(T.DEFAULT, "chunks of 1024"))
    by = {r["candidate"]: r for r in res.rows}
    assert by[T.DEFAULT]["status"] == "ok" and by[T.DEFAULT]["correct"]
    assert res.summary["chosen"]["value"] in T.CANDIDATES
