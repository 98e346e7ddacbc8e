"""The embedding kernels (course.embedding) and their benchmark (course.embedding.bench).

On the CPU these run the Numba CUDA simulator with tiny sizes; the GPU tests run the
same checks on a real GPU plus the registered experiments with their quick sizes.
"""
import pytest
import torch
import torch.nn.functional as F

from course import embedding as E
from course.embedding import bench as B
from course.core.checks import close
from course.core.runtime import CourseEnvironmentError, runtime

GPU = pytest.mark.skipif(not runtime().on_gpu, reason="needs a real GPU")
DEV = torch.device(runtime().device)


@pytest.fixture(autouse=True)
def clean_flag():
    E.reset_errors()
    yield
    E.reset_errors()


@pytest.mark.parametrize("impl", ["fast", "naive"])
def test_embedding_matches_F_embedding_on_every_case(impl):
    passed = E.check_lookup(lambda ids, w, **kw: E.embedding(ids, w, impl=impl, **kw), seed=1)
    assert len(passed) == len(E.lookup_cases(seed=1)) >= 8
    assert E.check_errors() == 0


def test_lookup_cases_cover_dtypes_shapes_padding_and_strides():
    cases = E.lookup_cases(seed=0)
    assert {c["weight"].dtype for c in cases} == set(E.WEIGHT_DTYPES)
    assert {c["ids"].dtype for c in cases} == set(E.ID_DTYPES)
    assert any(not c["ids"].is_contiguous() for c in cases)
    assert any(c["ids"].dim() == 0 for c in cases) and any(c["ids"].dim() == 3 for c in cases)
    assert any(c["padding_idx"] is not None for c in cases)
    assert all(c["padding_idx"] is None for c in E.lookup_cases(padding=False))


def test_check_lookup_catches_a_wrong_lookup():
    def off_by_one(ids, w, **kw):
        return F.embedding((ids + 1) % w.shape[0], w)
    with pytest.raises(AssertionError, match="differs"):
        E.check_lookup(off_by_one, padding=False)

    def wrong_dtype(ids, w, **kw):
        return F.embedding(ids, w).float()
    with pytest.raises(AssertionError, match="dtype"):
        E.check_lookup(wrong_dtype)


@pytest.mark.parametrize("word_bytes", [16, 8, 4, 2, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_word_size_is_exact(word_bytes, dtype):
    w = torch.randn(9, 8, device=DEV).to(dtype)
    ids = torch.tensor([[3, 0, 8], [1, 1, 5]], device=DEV, dtype=torch.int32)
    close(E.embedding(ids, w, word_bytes=word_bytes), F.embedding(ids, w), rtol=0, atol=0)
    kernel = E.fast_kernel(word_bytes)
    assert kernel is E.fast_kernel(word_bytes)  # compiled once, cached


def test_fast_kernel_rejects_unknown_word_size():
    with pytest.raises(ValueError, match="word_bytes"):
        E.fast_kernel(3)


def test_naive_kernel_launched_by_hand_matches():
    w = torch.randn(6, 4, device=DEV)
    ids = torch.tensor([5, 0, 2], device=DEV)
    out = torch.empty(3, 4, device=DEV)
    blocks, threads = E.launch_config("naive", 3, 4)
    from course import as_numba, numba_stream
    E.naive_kernel()[blocks, threads, numba_stream()](as_numba(ids), as_numba(E.element_view(w)),
                                                      as_numba(E.element_view(out)), as_numba(E.error_flag()))
    close(out, w[ids], rtol=0, atol=0)


def test_as_words_and_element_view():
    w = torch.randn(3, 8, device=DEV).bfloat16()  # rows of 16 bytes
    assert E.as_words(w, 16).dtype == torch.int32 and E.as_words(w, 16).shape == (3, 4)
    assert E.as_words(w, 8).shape == (3, 2) and E.as_words(w, 8).dtype == torch.int64
    assert E.element_view(w).dtype == torch.int16 and E.element_view(w.float()).dtype == torch.int32
    with pytest.raises(ValueError, match="whole number"):
        E.as_words(w[:, :3].contiguous(), 4)
    with pytest.raises(ValueError, match="contiguous 2-D"):
        E.as_words(w.t(), 2)


def test_pick_word_bytes_respects_row_size_and_alignment():
    w = torch.randn(4, 8, device=DEV)
    assert E.pick_word_bytes(32, w) == 16
    assert E.pick_word_bytes(24, w) == 8
    assert E.pick_word_bytes(6, w) == 2
    shifted = w.view(-1)[1:9].view(1, 8)  # starts 4 bytes into the buffer
    assert E.pick_word_bytes(32, shifted) == 4


def test_launch_config_shapes():
    blocks, threads = E.launch_config("naive", 10, 7)
    assert blocks * threads >= 70
    blocks, (x, y) = E.launch_config("fast", 10, 2)
    assert x * y == (256 if runtime().on_gpu else 32) and x >= 1
    with pytest.raises(ValueError, match="impl"):
        E.launch_config("medium", 1, 1)


def test_validate_explains_what_to_do():
    w = torch.randn(5, 4, device=DEV)
    ids = torch.tensor([0, 1], device=DEV)
    with pytest.raises(TypeError, match=r"ids\.long\(\)"):
        E.validate(ids.float(), w)
    with pytest.raises(ValueError, match="2-D"):
        E.validate(ids, w[0])
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        E.validate(ids, w.double())
    with pytest.raises(ValueError, match=r"weight\.contiguous\(\)"):
        E.validate(ids, w.t())
    with pytest.raises(ValueError, match="padding_idx=5"):
        E.validate(ids, w, padding_idx=5)
    with pytest.raises(TypeError, match="padding_idx"):
        E.validate(ids, w, padding_idx=1.0)
    assert E.validate(ids, w, padding_idx=-1) == 4
    with pytest.raises(ValueError, match="out must be"):
        E.validate(ids, w, out=torch.empty(2, 3, device=DEV))
    with pytest.raises(TypeError, match="torch tensors"):
        E.validate([0, 1], w)


def test_embedding_rejects_unknown_impl_and_bounds():
    w = torch.randn(5, 4, device=DEV)
    ids = torch.tensor([0], device=DEV)
    with pytest.raises(ValueError, match="impl"):
        E.embedding(ids, w, impl="slow")
    with pytest.raises(ValueError, match="bounds"):
        E.embedding(ids, w, bounds="never")


def test_host_bounds_check_names_the_bad_id():
    ids = torch.tensor([[0, 1], [9, 2]], device=DEV)
    with pytest.raises(E.EmbeddingIndexError, match=r"ids\[1, 0\] = 9 .* 5 rows"):
        E.host_bounds_check(ids, 5)
    E.host_bounds_check(ids, 10)  # no error
    E.host_bounds_check(ids[:0], 1)  # empty: nothing to check


@pytest.mark.parametrize("impl", ["fast", "naive"])
def test_device_error_flag_zeroes_rows_and_reports_later(impl):
    w = torch.randn(5, 8, device=DEV) + 10  # no zero entries
    ids = torch.tensor([[0, 7], [-2, 1]], device=DEV)
    out = E.embedding(ids, w, impl=impl, bounds="device")  # returns: nothing checked on the host
    assert out[0, 1].abs().sum() == 0 and out[1, 0].abs().sum() == 0
    close(out[0, 0], w[0], rtol=0, atol=0)
    count, first, _, vocab = E.error_flag().tolist()
    assert (count, first, vocab) == (2, 1, 5)
    with pytest.raises(E.EmbeddingIndexError, match="2 id\\(s\\) were out of range .* 5 rows"):
        E.check_errors()
    assert E.check_errors() == 0  # the flag was reset
    E.embedding(ids, w, impl=impl, bounds="device")
    with pytest.raises(E.EmbeddingIndexError):
        E.check_errors(reset=False)
    with pytest.raises(E.EmbeddingIndexError):
        E.check_errors()  # still set: reset=False kept it
    E.reset_errors()
    assert E.check_errors() == 0


def test_auto_bounds_is_host_on_the_simulator_and_device_on_gpu():
    w = torch.randn(5, 4, device=DEV)
    bad = torch.tensor([6], device=DEV)
    if runtime().on_gpu:
        E.embedding(bad, w)
        with pytest.raises(E.EmbeddingIndexError):
            E.check_errors()
    else:
        with pytest.raises(E.EmbeddingIndexError, match=r"ids\[0\] = 6"):
            E.embedding(bad, w)


def test_check_rejects_passes_for_the_library_and_fails_for_a_lax_lookup():
    lines = E.check_rejects(E.embedding)
    assert len(lines) == len(E.reject_cases())
    assert all(":" in line for line in lines)

    def lax(ids, w, padding_idx=None):
        return w[ids.long()]  # no validation: float ids are silently truncated
    with pytest.raises(AssertionError, match="float ids: expected TypeError"):
        E.check_rejects(lax)


def test_out_parameter_empty_ids_and_padding():
    w = torch.randn(5, 4, device=DEV)
    ids = torch.tensor([[1, 2]], device=DEV)
    out = torch.empty(1, 2, 4, device=DEV)
    assert E.embedding(ids, w, out=out) is out
    close(out, F.embedding(ids, w), rtol=0, atol=0)
    assert E.embedding(ids[:, :0], w).shape == (1, 0, 4)
    close(E.embedding(ids, w, padding_idx=1), F.embedding(ids, w, padding_idx=1), rtol=0, atol=0)


def test_fallback_uses_the_reference_while_the_todo_raises(capsys):
    def todo(x):
        raise NotImplementedError("not yet")
    f = E.fallback(todo, lambda x: x + 1, "my_function()")
    assert f(1) == 2 and f(2) == 3
    assert capsys.readouterr().out.count("my_function() is not done yet") == 1
    g = E.fallback(lambda x: x * 10, lambda x: -1, "done")
    assert g(2) == 20


# --------------------------------------------------------------------------- the benchmark module

def test_experiments_are_registered_gpu_only_with_quick_sizes():
    from course.core import reference
    names = ["embedding_bandwidth", "embedding_small_lookup", "embedding_bounds_modes", "embedding_verify",
             "embedding_swap_timing", "embedding_sync_timeline", "embedding_profile"]
    for name in names:
        exp = reference.get(name)
        assert exp.gpu_only and isinstance(exp.quick, dict)


def test_bandwidth_helpers():
    assert B.gbps(2e9, 1.0) == pytest.approx(2.0)
    assert B.lookup_bytes(10, 4, torch.float32, torch.int64) == 2 * 10 * 4 * 4 + 10 * 8
    assert B.lookup_bytes(10, 4, torch.bfloat16, torch.int32) == 2 * 10 * 4 * 2 + 10 * 4


def test_run_isolated_runs_in_a_fresh_process():
    assert B.run_isolated("gbps", nbytes=3e9, seconds=1.5) == pytest.approx(2.0)
    with pytest.raises(RuntimeError, match="failed in its own process"):
        B.run_isolated("gbps", nbytes=1.0)  # missing argument


@pytest.mark.skipif(runtime().on_gpu, reason="simulator behaviour")
def test_graph_time_needs_a_gpu():
    with pytest.raises(CourseEnvironmentError, match="needs a real GPU"):
        B.graph_time(lambda: None)


# --------------------------------------------------------------------------- GPU only

@GPU
def test_gpu_graph_time_is_per_call():
    x = torch.zeros(1 << 20, device="cuda")
    one = B.graph_time(lambda: x.add_(1), calls=4, repeats=3)
    assert one.clock == "cuda-graph-replay" and 0 < one.median < 1e-3


@GPU
def test_gpu_device_bounds_capture_and_replay_reports_bad_ids():
    from course.core.capture import try_capture
    w = torch.randn(50, 64, device="cuda")
    ids = torch.randint(0, 50, (8,), device="cuda")
    outcome = try_capture(lambda: E.embedding(ids, w, bounds="device"))
    assert outcome.ok, outcome.error
    ids.copy_(torch.tensor([1, 2, 3, 4, 5, 6, 7, 99], device="cuda"))
    outcome.graph.replay()
    with pytest.raises(E.EmbeddingIndexError, match="first at flat position 7"):
        E.check_errors()
    close(outcome.output[:7], w[ids[:7]], rtol=0, atol=0)
    ids[7] = 0
    host = try_capture(lambda: E.embedding(ids, w, bounds="host"))
    assert not host.ok and "bounds='host'" in host.error


@GPU
def test_gpu_quick_bandwidth_is_exact_and_complete():
    res = B.embedding_bandwidth(**__import__("course.core.reference", fromlist=["get"]).get("embedding_bandwidth").quick)
    assert all(res.column("exact"))
    assert set(res.column("kernel", dtype="float32")) >= {"F.embedding", B.SM_COPY, B.MEMCPY}
    assert all(v > 0 for v in res.column("GB_per_s"))


@GPU
def test_gpu_quick_small_lookup_replay_beats_eager():
    res = B.embedding_small_lookup(repeats=5, inner=5)
    assert res.value("numba_fast_replay_us") < res.value("numba_fast_eager_us")


@GPU
def test_gpu_quick_bounds_modes():
    res = B.embedding_bounds_modes(repeats=5)
    host, device = res.rows
    assert host["host_waits"] and not host["captured"] and host["error_reported"] == "at the call"
    assert not device["host_waits"] and device["captured"] and device["error_reported"].startswith("later")
