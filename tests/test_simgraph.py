"""course.graphs(): the simulator's CUDA graphs record at capture and replay without Python, as a GPU does.

The parity programs (course.parity.programs) run on the path this machine has: the simulator in CI, torch.cuda on
a GPU, with the same expected verdicts. The rest checks the stand-in's own rules (simulator only), and that the
programs catch a stand-in that is wrong in the ways the course's older stand-ins were.
"""
import gc
import warnings

import numpy as np
import pytest
import torch

import course
from course.parity import programs as simparity, tools as simcheck
from course.sim import cuda as simcuda, dispatch as simdispatch, graph as simgraph
from course.sim import patch as simpatch, record as simrecord, stream as simstream
from course.core.runtime import runtime

ON_GPU = runtime().on_gpu
sim_only = pytest.mark.skipif(ON_GPU, reason="the simulator's own behaviour")
cg = simcuda
DEV = torch.device("cpu")

# the programs and the verdicts a GPU gives (written here in full: a changed expectation shows in review)
EXPECTED = {
    "copy_in": "follows the copied data", "rebound_input": "reads the captured tensor",
    "made_after_capture": "never read", "frozen_scalar": "multiplies by 2.0",
    "frozen_branch": "relu (the branch taken at capture)", "python_side_effects": "3 calls (2 warm-ups + 1 capture)",
    "kept_output": "held output overwritten by the next replay",
    "inplace_at_replay": "0 after capture, 8 after 2 replays", "fresh_random": "new numbers each replay",
    "item": "operation not permitted when stream is capturing",
    "if_tensor": "operation not permitted when stream is capturing",
    "nonzero": "operation not permitted when stream is capturing",
    "print_tensor": "operation not permitted when stream is capturing",
    "synchronize": "operation not permitted when stream is capturing",
    "cpu_copy": "Cannot copy between CPU and CUDA tensors during CUDA graph capture",
    "tolist": "Cannot copy between CPU and CUDA tensors during CUDA graph capture",
    "tensor_ctor": "Cannot copy between CPU and CUDA tensors during CUDA graph capture",
    "manual_seed": "CUDAGeneratorImpl::set_current_seed can be called during stream capture only if new seed is the same as the original seed",
    "manual_seed_same": "captured",
    "unregistered_generator": "Attempt to increase offset for a CUDA generator not in capture mode",
    "default_stream": "CUDA graphs must be captured on a non-default stream",
    "replay_before_capture": "Called CUDAGraph::replay without a preceding successful capture",
    "capture_twice": "This CUDAGraph instance already owns a captured graph",
    "failed_capture_claims_pool": "beginAllocateToPool: already recording to mempool_id",
    "fork_join": "captured", "unjoined": "capturing stream has unjoined work",
    "pool_shared_outputs": "pool shared True, kept outputs intact True",
    "pool_freed_memory_reused": "B right True, then overwritten by A's replay True",
    "numba_kernel": "replay follows the input True, empty-graph warning False",
    "numba_default_stream": "replay follows the input False, empty-graph warning True",
    "numba_alloc": "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
    "graphed_module": "forward matches eager True, gradients match True",
    "inference_mode_replay": "replay follows the input: no_grad True, inference_mode True",
    "sync_debug_warns": "warn: item, if, mask, cpu, tolist, tensor(device=), stream sync; "
                        "quiet: synchronize, embedding, matmul",
    "sync_debug_error": "called a synchronizing CUDA operation; mode after 'default': 0",
    "graph_freed_during_capture": "operation failed due to a previous error during capture",
}




# ----------------------------------------------------------------------------- parity (both paths)
def test_the_programs_are_the_expected_ones():
    assert {p.name: p.expected for p in simparity.PROGRAMS} == EXPECTED
    with pytest.raises(KeyError, match="no parity program"):
        simparity.run("nope")


@pytest.mark.parametrize("name", list(EXPECTED))
def test_parity_program_gives_the_gpu_verdict(name):
    """On the simulator: course.graphs() is the stand-in; on a GPU: torch.cuda. Same program, same verdict."""
    assert course.graphs() is (torch.cuda if ON_GPU else simcuda)
    if ON_GPU:  # each in a fresh process: on a GPU a failed capture can leave the random generator in capture mode
        from course.core.isolate import run_isolated
        assert run_isolated("course.parity.programs", "run", timeout=120, name=name) == EXPECTED[name]
    else:
        assert simparity.run(name) == EXPECTED[name]


@sim_only
@pytest.mark.parametrize("sabotage,caught_by", [
    ("ops run at capture", "inplace_at_replay"),  # the capture computes (and writes) instead of recording
    ("replay reruns nothing", "copy_in"),
    ("no host-read refusal", "cpu_copy"),
    ("no pool reuse", "pool_freed_memory_reused"),
    ("kernels run at capture", "numba_kernel"),
    ("no sync debug mode", "sync_debug_warns"),
    ("a freed graph breaks nothing", "graph_freed_during_capture"),
    ("composite ops recorded whole", "inference_mode_replay"),  # under inference_mode: aten.to's return misread
    ("every manual_seed refused", "manual_seed_same"),
])
def test_the_programs_catch_a_wrong_stand_in(monkeypatch, sabotage, caught_by):
    warnings.simplefilter("ignore")  # a sabotaged stand-in records nothing: "the CUDA Graph is empty"
    if sabotage == "ops run at capture":
        monkeypatch.setattr(simdispatch, "record_op", lambda cap, func, args, kwargs: func(*args, **kwargs))
    elif sabotage == "replay reruns nothing":
        monkeypatch.setattr(simrecord, "run", lambda steps, launch: None)
    elif sabotage == "no host-read refusal":
        monkeypatch.setattr(simpatch, "_tensor_patches", lambda torch: [])
    elif sabotage == "no sync debug mode":
        monkeypatch.setattr(simstream, "on_sync", lambda what: None)
    elif sabotage == "a freed graph breaks nothing":
        monkeypatch.setattr(simstream, "graph_freed", lambda: None)
    elif sabotage == "no pool reuse":
        monkeypatch.setattr(simrecord.Block, "free", lambda self: False)
    elif sabotage == "composite ops recorded whole":
        monkeypatch.setattr(simdispatch, "_composite", lambda func: False)
    elif sabotage == "every manual_seed refused":
        monkeypatch.setattr(torch, "initial_seed", lambda: -1)
    else:
        monkeypatch.setattr(simrecord.Program, "record_kernel", lambda self, kernel, args, stream: None)
    assert simparity.run(caught_by, cg, DEV) != EXPECTED[caught_by]


# ----------------------------------------------------------------------------- capture and replay (simulator)
@sim_only
def test_capture_computes_nothing_and_replay_writes_the_same_tensors():
    x = torch.arange(4.0)
    ints, flags = torch.arange(4), torch.ones(4, dtype=torch.bool)
    g = cg.CUDAGraph()
    with cg.graph(g):
        y, n, b = x * 2, ints + 1, ~flags
    assert torch.isnan(y).all() and (n == torch.iinfo(torch.int64).max).all() and b.all(), "poison until replayed"
    assert g.recorded_ops() == ["aten.mul.Tensor", "aten.add.Tensor", "aten.bitwise_not.default"]
    ptr = y.data_ptr()
    g.replay()
    assert y.tolist() == [0.0, 2.0, 4.0, 6.0] and n.tolist() == [1, 2, 3, 4] and not b.any() and y.data_ptr() == ptr
    assert g.pool()[0] > 0, "a private pool: (n, 0), as torch"
    g.reset()
    with pytest.raises(RuntimeError, match="without a preceding successful capture"):
        g.pool()
    assert g.recorded_ops() == []


@sim_only
def test_views_and_metadata_run_at_capture_and_writes_through_views_replay():
    buf = torch.zeros(2, 3)
    g = cg.CUDAGraph()
    with cg.graph(g):
        row = buf[1]  # a view: aliases buf at once
        row.fill_(7.0)  # a write through it: at replay
        t = torch.ones(3)
        t.unsqueeze_(0)  # host-side metadata: at once
    assert row.data_ptr() == buf[1].data_ptr() and t.shape == (1, 3) and buf.sum() == 0
    g.replay()
    assert buf[1].tolist() == [7.0] * 3 and t.tolist() == [[1.0] * 3]


@sim_only
def test_shape_errors_raise_at_capture_like_a_gpu():
    with pytest.raises(RuntimeError, match="The size of tensor a"):  # the real op's message, not the meta one
        with cg.graph(cg.CUDAGraph()):
            torch.ones(3) + torch.ones(4)
    assert not cg.is_current_stream_capturing(), "a Python error does not invalidate the capture: it ends"


@sim_only
def test_host_reads_are_refused_with_the_gpu_errors_and_invalidate_the_capture():
    x = torch.ones(4)
    for body, phrase in [(lambda: x.sum().item(), simstream.SYNC), (lambda: bool(x.sum()), simstream.SYNC),
                         (lambda: float(x.sum()), simstream.SYNC), (lambda: f"{x}", simstream.SYNC),
                         (lambda: x.unique(), simstream.SYNC), (lambda: torch.masked_select(x, x > 0), simstream.SYNC),
                         (lambda: x.to("cpu"), "Cannot copy"), (lambda: torch.as_tensor([1.0], device=DEV), "Cannot copy")]:
        assert simcheck.capture_error(cg, body).split(" ")[0] in phrase, body
    with pytest.raises(torch.AcceleratorError, match="previous error during capture") as info:
        with cg.graph(cg.CUDAGraph()):
            x.sum().item()
    assert ".item()" in str(info.value.__context__), "the root cause names the host read"
    assert cg.current_stream() is cg.graph.default_capture_stream, "as torch: capture_end raised, stream stays"
    cg.set_stream(cg.default_stream())
    assert x.sum().item() == 4.0 and repr(x).startswith("tensor"), "patches undone after the capture"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(TypeError, match="numpy"):
            with cg.graph(cg.CUDAGraph()):
                x.numpy()
    assert not [w for w in caught if "empty" in str(w.message)], "the error says why: no empty-graph warning too"


@sim_only
def test_same_device_moves_host_constants_and_kernel_views_pass():
    x = torch.ones(3)
    g = cg.CUDAGraph()
    with cg.graph(g):
        y = x.to(x.device) + torch.tensor([1.0, 2.0, 3.0])  # no device: a host constant, frozen at capture
        view = course.as_numba(x)  # a kernel argument: allowed
    g.replay()
    assert y.tolist() == [2.0, 3.0, 4.0] and isinstance(view, np.ndarray)


@sim_only
def test_ops_on_other_streams_run_at_once_and_eager_code_is_untouched():
    x, other = torch.ones(2), cg.Stream()
    g = cg.CUDAGraph()
    with pytest.warns(UserWarning, match="The CUDA Graph is empty"), cg.graph(g):
        with cg.stream(other):
            eager = x * 5  # not forked into the capture: runs now, as on a GPU
    assert eager.tolist() == [5.0, 5.0] and g.recorded_ops() == []
    assert repr(x).startswith("tensor") and x.tolist() == [1.0, 1.0]


@sim_only
def test_capture_rules():
    g = cg.CUDAGraph()
    with pytest.raises(RuntimeError, match="Unknown capture error mode"):
        with cg.stream(cg.Stream()):
            g.capture_begin(capture_error_mode="loose")
    s = cg.Stream()
    with cg.stream(s):
        g.capture_begin()
    with pytest.raises(RuntimeError, match="same stream it began on"):
        g.capture_end()
    with cg.stream(s), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g.capture_end()
    assert any("empty" in str(w.message) for w in caught), "an empty capture warns, as torch does"
    g.instantiate()
    with pytest.raises(RuntimeError, match="instantiate"):
        cg.CUDAGraph().instantiate()
    with pytest.raises(torch.AcceleratorError, match="not initiated"):
        cg.CUDAGraph().capture_end()
    nested = cg.CUDAGraph()
    with pytest.raises(torch.AcceleratorError, match="previous error"):
        with cg.graph(nested):
            cg.graph(cg.CUDAGraph()).__enter__()  # torch.cuda.graph synchronizes first: refused inside a capture
    cg.set_stream(cg.default_stream())


@sim_only
def test_relaxed_mode_lets_a_numba_allocation_through():
    nc = course.cuda()
    x = torch.ones(4)
    assert simcheck.capture_error(cg, lambda: nc.device_array(4)) == "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"
    g = cg.CUDAGraph()
    with cg.graph(g, capture_error_mode="relaxed"):
        arr = nc.device_array(4)
        y = x + 1
    g.replay()
    assert arr.shape == (4,) and y.tolist() == [2.0] * 4
    assert simcheck.capture_error(cg, lambda: nc.synchronize()) == "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"


@sim_only
def test_registered_generator_draws_fresh_numbers():
    gen = torch.Generator().manual_seed(0)
    g = cg.CUDAGraph()
    g.register_generator_state(gen)
    with cg.graph(g):
        r = torch.rand(8, generator=gen)
        with pytest.raises(RuntimeError, match="register the state during capturing"):
            g.register_generator_state(gen)
    g.replay()
    first = r.clone()
    g.replay()
    assert not torch.equal(first, r)


@sim_only
def test_events_and_streams():
    s = cg.Stream()
    assert s.query() and cg.current_stream() is cg.default_stream() and "Stream" in repr(s)
    a, b = cg.Event(enable_timing=True), cg.Event(enable_timing=True)
    a.record()
    b.record()
    assert b.query() and a.elapsed_time(b) >= 0.0
    a.synchronize()
    assert simcheck.capture_error(cg, lambda: cg.current_stream().synchronize()) == simstream.SYNC[12:]
    assert simcheck.capture_error(cg, lambda: cg.current_stream().query()) == simstream.SYNC[12:]
    g = cg.CUDAGraph()
    with cg.graph(g):
        e = cg.current_stream().record_event()
        torch.ones(1) + 1
    with pytest.raises(torch.AcceleratorError, match="event last recorded in a capturing stream"):
        e.query()
    with pytest.raises(RuntimeError, match="elapsed_time"):
        a.elapsed_time(e)
    ctx = simstream.StreamContext(s)
    with ctx:
        assert cg.current_stream() is s
    assert cg.current_stream() is cg.default_stream() and not cg.is_available() and cg.SIMULATED


@sim_only
def test_numba_streams_stand_for_the_current_stream():
    nc = course.cuda()
    side = cg.Stream()
    main = course.numba_stream()
    with cg.stream(side):
        assert course.numba_stream() is course.numba_stream() is simstream.numba_stream_for(side, nc)
        assert course.numba_stream() is not main
        assert simstream.stream_of_numba(course.numba_stream()) is side
    assert simstream.stream_of_numba(object()) is None


@sim_only
def test_embedding_lookup_is_captured_and_replayed():
    from course import embedding as E
    weight = torch.randn(50, 8)
    ids = torch.randint(0, 50, (6,))
    E.embedding(ids, weight)  # warm-up: the error flag exists before capture
    g = cg.CUDAGraph()
    with cg.graph(g):
        out = E.embedding(ids, weight)
    assert torch.isnan(out).all() and len(g.recorded_ops()) == 1 and "fast" in g.recorded_ops()[0], g.recorded_ops()
    ids.copy_(torch.randint(0, 50, (6,)))
    g.replay()
    assert torch.equal(out, weight[ids])
    ids[0] = 99  # out of range: the device flag reports it after the replay, as on a GPU
    g.replay()
    with pytest.raises(E.EmbeddingIndexError, match="out of range"):
        E.check_errors()


@sim_only
def test_replay_inside_another_capture_is_recorded_by_it():
    x, kernel = torch.ones(32), simparity.streams._affine()
    inner = cg.CUDAGraph()
    with cg.graph(inner):
        y = x + 1
        k = torch.empty_like(x)
        kernel[1, 32, course.numba_stream()](course.as_numba(x), course.as_numba(k))
    outer = cg.CUDAGraph()
    with cg.graph(outer):
        inner.replay()  # recorded into the outer capture, Numba launch included
        z = y * 10 + k
    assert torch.isnan(z).all()
    x.fill_(2.0)
    outer.replay()
    assert z.tolist() == [35.0] * 32


@sim_only
def test_pool_memory_is_reused_only_when_free():
    pool = simrecord.pool_for(simrecord.new_handle())
    assert isinstance(pool, simrecord.Pool) and simrecord.pool_for(pool.handle) is pool
    s = cg.Stream()
    a = pool.alloc(100, s)
    assert a.nbytes == simrecord.ROUND and a.free(), "no tensor uses it yet"
    t = torch.empty(0).set_(a.storage, 0, (4,), (1,))
    assert not a.free() and pool.alloc(100, s) is not a
    del t
    gc.collect()
    assert pool.alloc(64, s) is a and pool.alloc(64, cg.Stream()) is not a, "free, same stream: reused"
    program = simrecord.Program(pool)
    assert program.steps == [] and program.finish() == ([], [])


@sim_only
def test_record_op_and_the_watch():
    with pytest.raises(torch.AcceleratorError, match="nonzero"):
        with simpatch.host_reads_refused():
            torch.ones(2).nonzero()
    simdispatch.begin_watch()
    simdispatch.end_watch()
    simpatch.install()
    simpatch.uninstall()
    assert torch.ones(2).nonzero().shape == (2, 1) and simstream.strict_capture() is None
    with pytest.raises(torch.AcceleratorError, match="waits"):
        simstream.refuse_sync("waits")
    with pytest.raises(RuntimeError, match="Cannot copy"):
        simstream.refuse_copy("copies")
    with pytest.raises(RuntimeError, match="cuMemAlloc"):
        simstream.refuse_numba("cuMemAlloc", "allocates")
    from torch.utils._python_dispatch import _disable_current_modes
    g, a = cg.CUDAGraph(), torch.ones(2)
    with cg.graph(g), _disable_current_modes():  # record_op is what the mode calls for each op on a capturing stream
        y = simdispatch.record_op(simstream.capturing(), torch.ops.aten.add.Tensor, (a, a), {})
    simdispatch.begin()
    simdispatch.end()
    g.replay()
    assert y.tolist() == [2.0, 2.0]


@sim_only
def test_launch_kernel_replays_a_recorded_launch():
    kernel = simparity.streams._affine()
    x, out = np.ones(4, np.float32), np.zeros(4, np.float32)
    simpatch.launch_kernel(kernel, ((1, 1, 1), (4, 1, 1), 0), (x, out))
    assert out.tolist() == [3.0] * 4


@sim_only
def test_make_graphed_callables_forms_and_checks():
    torch.manual_seed(0)
    f = torch.nn.Linear(4, 2)
    a, b = torch.randn(3, 4), torch.randn(3, 2)
    g1, g2 = cg.make_graphed_callables((f, lambda u: u * 2), ((a,), (b,)), num_warmup_iters=1)
    assert g1 is f
    with torch.no_grad():
        new = torch.randn(3, 4)
        assert torch.allclose(g1(new), torch.nn.functional.linear(new, f.weight, f.bias))
        assert torch.equal(g2(torch.ones(3, 2)), torch.full((3, 2), 2.0))
    f.eval()  # graphed in training mode: eval runs the original forward
    assert torch.allclose(f(new), torch.nn.functional.linear(new, f.weight, f.bias))
    with pytest.raises(AssertionError, match="only Tensors"):
        cg.make_graphed_callables(lambda u, k: u, (torch.ones(1), 3))
    hooked = torch.nn.Linear(2, 2)
    hooked.register_forward_hook(lambda *a: None)
    with pytest.raises(AssertionError, match="hooks"):
        cg.make_graphed_callables(hooked, (torch.ones(1, 2),))


@sim_only
def test_parity_tools():
    assert simcheck.close(torch.ones(2), torch.ones(2)) and simcheck.x8(DEV).shape == (8,)
    try:
        raise RuntimeError("outer") from None
    except RuntimeError as e:
        assert simcheck.phrase(e) == "RuntimeError: outer"
    before = cg.current_stream()
    simcheck.clean_up(cg, before, None)
    g, out = simcheck.capture(cg, lambda: torch.ones(2) * 3)
    g.replay()
    assert out.tolist() == [3.0, 3.0]


@sim_only
def test_sync_debug_mode_reports_once_at_the_callers_line_and_is_undone():
    x = torch.randn(8)
    assert cg.get_sync_debug_mode() == 0 and not simpatch._saved
    with pytest.raises(RuntimeError, match="expected one of `default`, `warn`, `error`"):
        cg.set_sync_debug_mode("loud")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cg.set_sync_debug_mode("warn")
        try:
            str(x)  # one call: printing reads every value, but torch reports the call, here once
            line = __import__("inspect").currentframe().f_lineno - 1
        finally:
            cg.set_sync_debug_mode("default")
    assert [(w.filename, w.lineno) for w in caught] == [(__file__, line)], [str(w.message) for w in caught]
    assert simstream.SYNC_DEBUG in str(caught[0].message) and "printing" in str(caught[0].message)
    assert not simpatch._saved and not simdispatch._mode, "the patches and the dispatch mode are gone with the mode"
    cg.set_sync_debug_mode(5)
    assert cg.get_sync_debug_mode() == 2, "as torch: above 2 is 'error'"
    cg.set_sync_debug_mode(0)
    simstream.set_sync_debug_level(1)  # the level alone, without the patches: nothing but on_sync sees it
    try:
        with pytest.warns(UserWarning, match="synchronizing"):
            simstream.on_sync("a test")
        with simstream.sync_reported(), warnings.catch_warnings():
            warnings.simplefilter("error")
            simstream.on_sync("inside a call already reported: silent")
    finally:
        simstream.set_sync_debug_level(0)


@sim_only
def test_sync_debug_mode_in_a_capture_speaks_before_the_refusal():
    x = torch.randn(8)
    cg.set_sync_debug_mode("error")
    try:
        g = cg.CUDAGraph()
        with pytest.raises(RuntimeError, match="synchronizing"):
            with cg.graph(g):
                x * x.sum().item()  # the mode raises first: torch checks it before calling CUDA
        assert g._steps is not None, "the capture was not invalidated by the mode's error"
        g2 = cg.CUDAGraph()
        with pytest.raises(RuntimeError, match="Cannot copy between CPU and CUDA"), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # nothing was recorded: "the CUDA Graph is empty"
            with cg.graph(g2):
                x.cpu()  # a copy: refused by torch before the mode is asked
    finally:
        cg.set_sync_debug_mode(0)
        simgraph.end_all_captures()


@sim_only
def test_a_graph_freed_or_reset_in_a_capture_breaks_it_unless_relaxed():
    gc.collect()  # graphs earlier tests left in reference cycles go now, not inside this test's first capture
    x = torch.ones(4)
    done, _ = simcheck.capture(cg, lambda: x + 1)
    g = cg.CUDAGraph()
    before = cg.current_stream()
    with pytest.raises(RuntimeError, match="previous error during capture"):
        with cg.graph(g):
            x * 2
            done.reset()
    cg.set_stream(before)
    again, _ = simcheck.capture(cg, lambda: x + 1)
    g = cg.CUDAGraph()
    with cg.graph(g, capture_error_mode="relaxed"):
        x * 2
        del again  # relaxed mode permits the destructor's CUDA call
    assert g.recorded_ops() == ["aten.mul.Tensor"]


@sim_only
def test_an_empty_graph_is_explained_by_what_happened():
    def warned(body):
        g = cg.CUDAGraph()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with cg.graph(g):
                    body()
            except ValueError:
                pass
        return [str(w.message) for w in caught if "CUDA Graph is empty" in str(w.message)]

    x, other = torch.ones(2), cg.Stream()

    def elsewhere():
        with cg.stream(other):
            x * 5

    def refused():
        raise ValueError("a check stopped the capture before any work")

    assert warned(lambda: None) == [simgraph.NOTHING]  # nothing ran: not "wrong device or stream"
    assert warned(elsewhere) == [simgraph.EMPTY]  # work ran on a stream that was not capturing: torch's words
    assert warned(refused) == []  # an error ended the capture: the error says why
    assert warned(lambda: x * 2) == []  # a graph with work in it
