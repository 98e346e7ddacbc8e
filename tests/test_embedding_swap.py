"""The swappable embedding (course.embedding.swap): cpu-copy vs device, the model, swap, replay."""
import pytest
import torch
import torch.nn.functional as F

from course import embedding as E
from course.embedding import swap as S
from course.core.checks import close
from course.core.runtime import CourseEnvironmentError, runtime

GPU = pytest.mark.skipif(not runtime().on_gpu, reason="needs a real GPU")
DEV = torch.device(runtime().device)


@pytest.mark.parametrize("impl", S.IMPLS)
def test_swap_embedding_matches_F_embedding(impl):
    emb = S.SwapEmbedding(11, 8, impl=impl, padding_idx=2, generator=torch.Generator().manual_seed(0))
    assert emb.weight[2].abs().sum() == 0 and not emb.weight.requires_grad
    ids = torch.tensor([[1, 2, 10], [0, 3, 3]], device=DEV)
    close(emb(ids), F.embedding(ids, emb.weight), rtol=0, atol=0)
    assert f"impl='{impl}'" in repr(emb)


def test_lookups_agree_and_reject_bad_ids():
    w = torch.randn(7, 4, device=DEV)
    ids = torch.tensor([6, 0, 3], device=DEV)
    close(S.cpu_copy_lookup(ids, w), S.device_lookup(ids, w), rtol=0, atol=0)
    with pytest.raises(E.EmbeddingIndexError, match="7 rows"):
        S.cpu_copy_lookup(torch.tensor([7], device=DEV), w)
    with pytest.raises(TypeError):
        S.device_lookup(ids.float(), w)


def test_unknown_impl_is_refused():
    with pytest.raises(ValueError, match="cpu-copy"):
        S.SwapEmbedding(5, 4, impl="gpu")
    emb = S.SwapEmbedding(5, 4)
    emb.impl = "typo"
    with pytest.raises(ValueError, match="impl must be one of"):
        emb(torch.tensor([0], device=DEV))


def test_make_model_is_reproducible_and_swap_keeps_weights():
    a, b = S.make_model(50, 8, 6, seed=3), S.make_model(50, 8, 6, seed=3)
    assert isinstance(a, S.TinyModel)
    ids = torch.randint(0, 50, (2, 5), device=DEV)
    out = a(ids)
    assert out.shape == (2, 5, 6)
    close(out, b(ids), rtol=0, atol=0)
    ptr = a.embed.weight.data_ptr()
    assert S.swap(a, "cpu-copy") is a and a.embed.impl == "cpu-copy"
    assert a.embed.weight.data_ptr() == ptr
    close(a(ids), out, rtol=0, atol=0)
    with pytest.raises(ValueError, match="impl"):
        S.swap(a, "host")
    with pytest.raises(ValueError, match="no SwapEmbedding"):
        S.swap(torch.nn.Linear(2, 2), "device")


def test_lookups_can_be_plugged_in():
    calls = []

    def mine(ids, weight, padding_idx=None):
        calls.append(ids.shape)
        return F.embedding(ids, weight)
    model = S.make_model(20, 4, 3, impl="cpu-copy", lookups={"cpu-copy": mine})
    ids = torch.tensor([[1, 2]], device=DEV)
    model(ids)
    assert calls == [ids.shape]
    S.swap(model, "device")
    model(ids)
    assert len(calls) == 1  # the course's device lookup, not mine


def _with_host_work(x):
    y = x.cpu()
    z = x.to("cpu")
    w = x.to(device="cpu:0")
    v = x.to(torch.device("cpu"))
    n = x.sum().item()
    back = x.to("cuda")
    return y, z, w, v, n, x.tolist(), back


def test_find_host_copies_finds_each_kind_and_nothing_in_the_device_version():
    found = S.find_host_copies(_with_host_work)
    assert len(found) == 6, found
    assert any(".item()" in f for f in found) and any('to(device="cpu:0")' in f for f in found)
    assert not any('to("cuda")' in f for f in found)
    assert any("ids.to(\"cpu\")" in f for f in S.find_host_copies(S.cpu_copy_lookup))
    assert S.find_host_copies(S.device_lookup) == []


def test_replay_stand_in_reads_the_static_input_memory():
    model = S.make_model(40, 8, 4)
    static_ids = torch.randint(0, 40, (3,), device=DEV)
    graph, static_out, how = S.capture_for_replay(lambda: model(static_ids))
    new = torch.tensor([5, 6, 7], device=DEV)
    if not runtime().on_gpu:
        assert isinstance(graph, S.ReplayStandIn) and "stand-in" in how
    out = S.replay_with(graph, static_ids, static_out, new)
    assert out is static_out
    close(out, model(new), rtol=1e-6, atol=1e-6)

    def rebinding_mistake(graph, static_ids, static_out, new_ids):
        static_ids = new_ids  # noqa: F841 - the classic mistake: the graph never sees these ids
        graph.replay()
        return static_out
    before = static_out.clone()
    rebinding_mistake(graph, static_ids, static_out, torch.tensor([1, 2, 3], device=DEV))
    close(static_out, before, rtol=0, atol=0)  # still the old answer


def test_replay_stand_in_replay_writes_in_place():
    x = torch.zeros(3)
    out = torch.zeros(3)
    stand_in = S.ReplayStandIn(lambda: x + 1, out)
    x.fill_(4)
    stand_in.replay()
    assert out.tolist() == [5.0, 5.0, 5.0]


@pytest.mark.skipif(runtime().on_gpu, reason="simulator behaviour")
def test_simulator_capture_refuses_cpu_copy_with_the_gpu_error_and_records_device():
    model = S.make_model(40, 8, 4)
    ids = torch.randint(0, 40, (2, 3), device=DEV)
    S.swap(model, "cpu-copy")
    with pytest.raises(RuntimeError, match="capture failed: RuntimeError: Cannot copy between CPU and CUDA tensors "
                                           "during CUDA graph capture"):
        S.capture_for_replay(lambda: model(ids))
    S.swap(model, "device")
    graph, out, how = S.capture_for_replay(lambda: model(ids))
    assert torch.isnan(out).all(), "the capture recorded the lookup and the linear layer, and computed nothing"
    close(S.replay_with(graph, ids, out, torch.randint(0, 40, (2, 3), device=DEV)), model(ids), rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(runtime().on_gpu, reason="simulator behaviour")
def test_count_device_to_host_copies_needs_a_gpu():
    with pytest.raises(CourseEnvironmentError, match="needs a real GPU"):
        S.count_device_to_host_copies(lambda: None)


@GPU
def test_gpu_cpu_copy_cannot_be_captured_and_device_can():
    from course.core.capture import try_capture
    model = S.make_model()
    ids = torch.randint(0, 1000, (4, 32), device="cuda")
    S.swap(model, "cpu-copy")
    bad = try_capture(lambda: model(ids))
    assert not bad.ok and bad.error_type == "RuntimeError"
    assert "Cannot copy between CPU and CUDA tensors during CUDA graph capture" in bad.error
    with pytest.raises(RuntimeError, match="capture failed"):
        S.capture_for_replay(lambda: model(ids))
    S.swap(model, "device")
    graph, out, how = S.capture_for_replay(lambda: model(ids))
    assert how == "CUDA graph"
    for _ in range(2):
        new = torch.randint(0, 1000, (4, 32), device="cuda")
        close(S.replay_with(graph, ids, out, new), model(new), rtol=1e-5, atol=1e-5)


@GPU
def test_gpu_host_copies_counted_by_the_profiler():
    emb = S.SwapEmbedding(100, 64)
    ids = torch.tensor([[1, 2, 3, 4, 5]], device="cuda")
    emb.impl = "cpu-copy"
    assert S.count_device_to_host_copies(lambda: emb(ids)) >= 1
    emb.impl = "device"
    assert S.count_device_to_host_copies(lambda: emb(ids)) == 0


@GPU
def test_gpu_only_the_device_lookup_is_asynchronous():
    from course.core.blocking import host_blocking
    emb = S.SwapEmbedding(100, 64)
    ids = torch.randint(0, 100, (64,), device="cuda")
    emb.impl = "cpu-copy"
    assert host_blocking(lambda: emb(ids), sleep_ms=30).blocked is True
    emb.impl = "device"
    assert host_blocking(lambda: emb(ids), sleep_ms=30).blocked is False


# ----------------------------------------------------------------------------- lab 2's captures (both paths)
@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty")
def test_course_capture_passes_lab2s_checks_and_a_wrong_record_does_not(capsys):
    from course.embedding import lookup_capture as LC

    LC.check_capture(LC.capture, S.device_lookup)
    assert "3 replays with new ids equal F.embedding" in capsys.readouterr().out
    ids = torch.randint(0, 50, (2, 8), device=DEV)
    w = torch.randn(50, 4, device=DEV)
    try:
        LC.capture(S.cpu_copy_lookup, ids, w)
    except RuntimeError as e:
        refused = e
    LC.check_cpu_copy_error(refused, S.cpu_copy_lookup)
    assert "the capture refused the copy at your line" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="returned None: nothing failed"):
        LC.check_cpu_copy_error(None, S.cpu_copy_lookup)
    with pytest.raises(AssertionError, match="not raised in your cpu_copy_lookup"):
        LC.check_cpu_copy_error(refused, S.device_lookup)
    with pytest.raises(AssertionError, match="must raise its error"):
        LC.check_capture(lambda fn, *static: (LC.capture(fn, *static) if fn is not LC._host_read else (None, None)),
                         S.device_lookup)
