"""Lesson 06's recording helpers (course.lessons.real_model.bench) and the KV-cache reading of lab 4.5."""
import math
import types

import pytest
import torch

from course.core.runtime import runtime
from course.lessons.real_model import bench as E
from course.lessons.real_model.hand_check import prompt_zeroed
from course.lessons.real_model.model import build_model


gpu = pytest.mark.skipif(not runtime().on_gpu, reason="the recording helpers synchronize a GPU")


def _broken():
    raise RuntimeError("no such kernel")


@gpu
def test_build_steps_times_the_first_call_and_keeps_a_broken_variant_as_a_row():
    steps, rows = E.build_steps({"ok": lambda: (lambda x: x + 1), "broken": _broken},
                                (torch.ones(2, device="cuda"),), log=lambda *_: None)
    assert list(steps) == ["ok"] and rows["ok"]["status"] == "ok" and rows["ok"]["first_call_s"] >= 0
    assert "no such kernel" in rows["broken"]["status"] and math.isnan(rows["broken"]["first_call_s"])


def test_kernel_counts_leaves_out_a_step_it_cannot_count():
    assert "raises" not in E.kernel_counts({"raises": lambda x: _broken()}, (torch.ones(2),))


@gpu
def test_build_logged_returns_the_step_and_its_row():
    x = torch.ones(2, device="cuda")
    fn, row = E.build_logged("plain", lambda: (lambda v: v * 2), (x,), log=lambda *_: None)
    assert torch.equal(fn(x), 2 * x)
    assert row["variant"] == "plain" and row["status"] == "ok" and row["first_call_s"] >= 0


def test_decode_result_has_a_row_per_variant_and_the_floor():
    model = build_model("tiny")
    rows = {"eager": {"variant": "eager", "status": "ok", "mode": "", "first_call_s": 0.1}}
    res = E.decode_result(model, rows, {}, {"eager": 7}, None, {}, 100.0, 12.5, position=3)
    assert [r["variant"] for r in res.rows] == ["eager"] and res.rows[0]["kernels_per_token"] == 7
    assert res.value("floor_us") == 12.5 and res.rows[0]["tokens_equal"] is True


def test_ro_variants_name_the_four_builds_without_building_them():
    assert set(E.ro_variants(build_model("tiny"), 16)) == {E.FAST, E.RO, E.RO_GEMV, E.RO_HAND}


def test_prompt_zeroed_reads_layer_0s_prompt_positions():
    keys = torch.zeros(1, 2, 6, 4)
    cache = types.SimpleNamespace(layers=[types.SimpleNamespace(keys=keys, values=keys.clone())])
    assert prompt_zeroed(cache, 3) and not prompt_zeroed(cache, 0)
    keys[0, 0, 1, 0] = 1.0
    assert not prompt_zeroed(cache, 3) and prompt_zeroed(cache, 1)


@gpu
def test_generate_us_gives_one_positive_value_per_repeat():
    per = E.generate_us(build_model("tiny", device="cuda"), 4, repeats=2, n_short=2, n_long=6)
    assert len(per) == 2 and all(v > 0 for v in per)  # time_per_token, the long minus the short run
