"""Lab 1's checks that see past a right answer: the host check alone, bad-id rows, the fast kernel's layout.

Each check is tested against the course's right kernel (it must pass) and wrong ones (each named).
The notebook-level versions of these wrong answers are in tests/test_mutants_lab1_2.py.
"""
import re

import pytest
import torch
import torch.nn.functional as F

import course
from course import embedding as E
from course.core.harness import Defect
from course.embedding import fastcheck as C
from course.embedding import swap as S

cuda = course.cuda()
DEV = course.device()


def _no_stride(ids, weight, out, err):  # the fast kernel without its grid-stride loop
    tx, bx = cuda.threadIdx.x, cuda.blockDim.x
    row = cuda.blockIdx.x * cuda.blockDim.y + cuda.threadIdx.y
    if row < out.shape[0]:
        j = tx
        while j < weight.shape[1]:
            out[row, j] = weight[ids[row], j]
            j += bx


def _thread_per_row(ids, weight, out, err):  # right rows, but one thread copies a whole row
    row = cuda.blockIdx.x * cuda.blockDim.y + cuda.threadIdx.y
    while row < out.shape[0]:
        if cuda.threadIdx.x == 0:
            for j in range(weight.shape[1]):
                out[row, j] = weight[ids[row], j]
        row += cuda.gridDim.x * cuda.blockDim.y


def _one_load(ids, weight, out, err):  # rows of threads, tx striding words, but each load stored at once
    row = cuda.blockIdx.x * cuda.blockDim.y + cuda.threadIdx.y
    while row < out.shape[0]:
        j = cuda.threadIdx.x
        while j < weight.shape[1]:
            out[row, j] = weight[ids[row], j]
            j += cuda.blockDim.x
        row += cuda.gridDim.x * cuda.blockDim.y


def test_the_course_fast_kernel_passes_every_layout_check():
    lines = E.check_fast_kernel(E.fast_kernel(8))
    assert [line.split(":")[0] for line in lines] == ["grid-stride loop", "rows of threads", "4 loads in flight"]
    assert "every row written" in lines[0] and "access trace" in lines[1]


def test_capped_launch_leaves_the_rows_of_a_kernel_without_grid_stride_unwritten():
    ids, w = C.capped_inputs()
    out, (blocks, (x, y)), word = C.launch_capped(cuda.jit(_no_stride), ids, w)
    assert blocks == C.BLOCKS < len(ids) // y and word == 8
    assert torch.equal(out[: blocks * y], F.embedding(ids, w)[: blocks * y]) and torch.isnan(out[blocks * y:]).all()
    with pytest.raises(Defect, match=rf"rows {blocks * y}-{len(ids) - 1} of the output were never written") as e:
        E.check_fast_kernel(cuda.jit(_no_stride))
    assert e.value.rule == "grid_stride"


@pytest.mark.skipif(course.runtime().on_gpu, reason="traces in this process: the simulator")
def test_layout_names_one_thread_per_row_and_no_loads_in_flight():
    assert C.grid_stride(cuda.jit(_thread_per_row))[0] == ""  # right rows, whatever the grid
    with pytest.raises(Defect, match="copied by one thread alone") as e:
        E.check_fast_kernel(cuda.jit(_thread_per_row))
    assert e.value.rule == "layout"
    assert "after loading 1 word: load 4 words" in C.layout(cuda.jit(_one_load))[0]


def test_layout_problem_reads_records():
    rec = lambda b, t, k, name, off, write: (b, t, k, name, off, 8, write)  # noqa: E731
    good = [rec(0, t, 0, "w", 8 * t, False) for t in range(2)] + [rec(0, t, 1, "o", 8 * t, True) for t in range(2)]
    assert C.layout_problem(good, "o", "w", 16, 8, 2) is None  # 2 words, 2 threads: one load each is all there is
    twice = good + [rec(1, 0, 2, "o", 0, True)]
    assert "copied more than once" in C.layout_problem(twice, "o", "w", 16, 8, 2)
    swapped = [rec(0, t, 0, "w", 8 * t, False) for t in range(2)] + [rec(0, t, 1, "o", 8 * (1 - t), True)
                                                                       for t in range(2)]
    assert "written by tx=1, expected tx=0" in C.layout_problem(swapped, "o", "w", 16, 8, 2)
    assert C.layout_problem([], "o", "w", 16, 8, 2) == "the kernel wrote nothing to the output"


def test_kernel_source_sends_modules_and_numbers_and_refuses_the_rest():
    spec = C.kernel_source(cuda.jit(_no_stride))
    assert spec["name"] == "_no_stride" and spec["globals"]["cuda"] == {"module": cuda.__name__}
    held = object()

    def uses_object(ids, weight, out, err):
        out[0, 0] = held

    with pytest.raises(ValueError, match="cannot be sent to a simulator process"):
        C.kernel_source(cuda.jit(uses_object))


def test_layout_in_a_simulator_process_passes_and_fails_like_here():
    problem, lines = C.layout(E.fast_kernel(8), child=True)
    assert not problem and all(line.endswith("(in a simulator process)") for line in lines) and len(lines) == 2, lines
    assert re.search("copied by one thread alone .* in its own process",
                     C.layout(cuda.jit(_thread_per_row), child=True)[0])


def test_poisoned_empty_fills_floats_with_nan_and_restores_torch_empty():
    real = torch.empty
    with E.poisoned_empty():
        assert torch.isnan(torch.empty(3)).all() and torch.empty(2, dtype=torch.int32).dtype == torch.int32
    assert torch.empty is real


def test_check_bad_ids_names_an_unwritten_row_and_an_out_of_bounds_read():
    def never_zeroed(ids, w):
        out = torch.empty(len(ids), w.shape[1], device=w.device)
        ok = (ids >= 0) & (ids < w.shape[0])
        out[ok] = w[ids[ok]]
        return out

    with pytest.raises(AssertionError, match="id 5 .* was never written"):
        E.check_bad_ids(never_zeroed)

    if course.runtime().on_gpu:
        return  # torch's GPU index would assert on the device and end the process

    def raw_index(ids, w):
        return w[ids]  # torch raises IndexError for id 5, as the simulator does for a kernel

    with pytest.raises(AssertionError, match="went outside an array .*: a bad id must never index the table"):
        E.check_bad_ids(raw_index)


def test_check_rejects_host_mode_names_the_missing_half_of_the_range_check():
    def checks_dtype_only(ids, weight, padding_idx=None):
        E.validate(ids, weight, padding_idx)
        if ids.numel() and ids.max().item() >= weight.shape[0]:
            raise IndexError(f"ids must be below {weight.shape[0]}: check the vocabulary size")

    with pytest.raises(AssertionError, match=r"an id < 0 was not rejected by your host check .* ids.min\(\) < 0"):
        E.check_rejects(checks_dtype_only, host=True)
    lookup = lambda i, w, padding_idx=None: E.embedding(i, w, padding_idx, bounds="device")  # noqa: E731
    E.check_rejects(lookup)  # the error flag may stand in for a host check...
    with pytest.raises(AssertionError, match="an id >= num_embeddings was not rejected by your host check"):
        E.check_rejects(lookup, host=True)  # ...but not in host mode
    assert E.check_errors() == 0  # and it leaves the flag clear


def test_check_errors_says_when_the_kernel_did_not_record_the_table_size():
    E.reset_errors()
    E.error_flag()[0] += 2  # what a kernel that only counts leaves
    with pytest.raises(E.EmbeddingIndexError, match="2 id.* did not record the table size") as e:
        E.check_errors()
    assert "0 rows" not in str(e.value)


def test_check_swap_names_what_a_wrong_swap_misses():
    model = S.make_model(vocab=50, dim=8, out_features=4)
    S.check_swap(S.swap, model)
    assert model.embed.impl == "device"

    def top_level_only(m, impl):
        S.swap(m, "device")
        for child in m.children():
            if isinstance(child, S.SwapEmbedding) or hasattr(child, "embed"):
                getattr(child, "embed", child).impl = impl
        if hasattr(m, "embed"):
            m.embed.impl = impl
        return m

    with pytest.raises(Defect, match=r"nested model, swap\(\) left 1\.0\.embed unchanged") as e:
        S.check_swap(top_level_only, model)
    assert e.value.rule == "nested"


def test_kernel_source_sends_only_the_globals_the_kernel_reads():
    spec = C.kernel_source(E.fast_kernel(8))
    assert set(spec["globals"]) == {"cuda", "numba"}, spec["globals"]  # not .shape, .x, .add: attributes
