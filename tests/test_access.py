"""The memory-access picture (course.embedding.access): per-thread addresses on the simulator, coalescing score."""
import matplotlib

matplotlib.use("Agg")
import pytest
import torch
import torch.nn.functional as F

import course
from course import embedding as E
from course.core import plots, reference
from course.embedding import access as A
from course.embedding.kernels import naive_kernel

pytestmark = pytest.mark.skipif(course.runtime().on_gpu, reason="the trace runs on the simulator")


def test_a_correct_but_uncoalesced_kernel_passes_and_is_told_why(capsys):
    slow = lambda i, w, **kw: A.launch_elementwise(A.uncoalesced_kernel(), i, w)
    E.check_lookup(slow, padding=False)  # correct
    tr = A.check_coalescing(slow)
    assert isinstance(tr, A.AccessTrace)
    out = capsys.readouterr().out
    assert out.startswith("UNCOALESCED") and "1/8 of the bandwidth" in out
    res = tr.score()
    assert res.value("score") == pytest.approx(8.0)
    assert {(r["array"], r["access"]) for r in res.rows} >= {("weight", "read"), ("out", "write"), ("ids", "read")}


def test_coalesced_kernels_score_one():
    ids, w = A.demo_inputs()
    naive = A.trace(lambda i, t: A.launch_elementwise(naive_kernel(), i, t), ids, w)
    assert naive.score().value("score") == pytest.approx(1.0) and naive.verdict().startswith("coalesced")
    fast = A.trace(lambda i, t: E.embedding(i, t, impl="fast"), ids, w)  # 16-byte words count as one access
    assert fast.score().value("score") == pytest.approx(1.0)
    reqs = naive.requests("weight")
    assert len(reqs) == 32 and all(len(v) == 32 for v in reqs.values())  # 32 warps, 32 lanes each


def test_draw_one_colour_per_request():
    ids, w = A.demo_inputs()
    tr = A.trace(lambda i, t: A.launch_elementwise(A.uncoalesced_kernel(), i, t), ids, w)
    fig, (ax1, ax2) = plots.figure(ncols=2)
    A.draw(ax1, tr, "weight")
    assert len(ax1.collections) == 1 and "sectors" in ax1.get_legend().get_texts()[0].get_text()
    A.draw(ax2, tr, "weight", warp=99)
    assert "no accesses" in ax2.texts[0].get_text()


def test_embedding_coalescing_is_a_gpu_experiment():
    exp = reference.get("embedding_coalescing")
    assert exp.gpu_only and exp.quick
    assert torch.equal(A.launch_elementwise(A.uncoalesced_kernel(), *A.demo_inputs()),
                       F.embedding(*A.demo_inputs()))
    assert A._sim_scores() == {"naive": pytest.approx(1.0), "uncoalesced": pytest.approx(8.0)}
