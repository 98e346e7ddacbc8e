"""The rules of the capture-hazard finder: what it reports, why it breaks capture, and what to do instead."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Rule:
    """A kind of hazard: what the finder reports and what to do about it."""

    id: str
    what: str
    why: str
    fix: str


_RULES = (
    Rule("item", ".item()",
         "copies one value to the host and waits for the GPU (a sync); during capture it fails",
         "keep the value on the device as a 0-dim tensor and use it in tensor ops (x / t, torch.where)"),
    Rule("cpu", ".cpu()",
         "a device-to-host copy: the host waits for the GPU; during capture it fails (pageable destination)",
         "keep results on the device; copy the graph's static output to the host after replay"),
    Rule("to_cpu", '.to("cpu")',
         "a device-to-host copy (InfiniCore's old Embedding::forward: indices->to(cpu_device)): a sync; "
         "during capture it fails",
         "do the work on the device (a device kernel, F.embedding, index_select) and copy results out after replay"),
    Rule("tolist", ".tolist()",
         "copies the tensor into a Python list on the host (a sync); on a host copy of GPU data the values "
         "freeze at capture time",
         "index with the device tensor itself (x[ids], index_select) instead of a Python list"),
    Rule("numpy", ".numpy()",
         "needs the values on the host: a device-to-host copy and a sync",
         "keep the computation in torch on the device; convert the static output after replay"),
    Rule("print", "print(tensor)",
         "formatting a CUDA tensor copies its values to the host (a sync); during capture it fails, and a "
         "replay never prints",
         "print outside the captured function, from the graph's static outputs after replay"),
    Rule("cuda_synchronize", "torch.cuda.synchronize()",
         "waits for all GPU work; not allowed while a stream is capturing",
         "delete it: work on one stream already runs in order; synchronize after replay if the host needs results"),
    Rule("synchronize", ".synchronize()",
         "a stream or event synchronize makes the host wait; not allowed while capturing",
         "delete it, or use stream/event waits on the device (wait_stream, wait_event) that a graph can record"),
    Rule("data_dependent", "data-dependent shape",
         "the output's size depends on the values: the host must read a count from the GPU (a sync), and a "
         "graph needs fixed shapes",
         "use a fixed-shape formulation: torch.where(mask, x, 0), multiply by the mask, index_fill_, "
         "or torch.nonzero_static(x, size=...)"),
    Rule("host_bool", "if tensor / bool(tensor)",
         "Python needs a host bool, so the value is copied from the GPU (a sync); during capture it fails, "
         "and a branch taken at capture would be frozen",
         "compute without branching: torch.where, clamp, masks; branch on shapes and Python values only"),
    Rule("host_scalar", "float(tensor) / int(tensor)",
         "converting a GPU tensor to a Python number copies it to the host (a sync), like .item()",
         "keep it a 0-dim tensor on the device"),
    Rule("tensor_ctor", "torch.tensor(..., device=cuda)",
         "builds the tensor on the host and copies it from pageable memory: a sync; during capture it fails",
         "create constants once before capture (a static buffer), or build them on the GPU "
         "(torch.arange/full/zeros with device=)"),
    Rule("h2d", "host-to-device copy",
         "copies host (pageable) memory to the GPU: the host waits, and during capture it fails",
         "copy the data into a static device buffer before capture (static.copy_(new)), or read it from pinned "
         "memory with non_blocking=True"),
    Rule("capture_branch", "torch.cuda.is_current_stream_capturing()",
         "the code does something different while capturing: the graph records the capture-time path and a "
         "replay can silently differ from eager",
         "make the captured path the same as eager; move the host-side logic out of the captured function"),
    Rule("numba_default_stream", "Numba launch without a stream",
         "kernel[blocks, threads](...) launches on Numba's default stream, not on torch's capturing stream: "
         "the capture does not record it (or CUDA refuses it)",
         "launch on torch's current stream: kernel[blocks, threads, course.numba_stream()](...)"),
    Rule("numba_alloc", "cuda.device_array / cuda.to_device",
         "Numba allocates device memory with cuMemAlloc (and to_device copies from pageable host memory): "
         "not allowed while a stream is capturing, and a replay would not allocate again",
         "allocate once before capture (torch.empty(..., device='cuda') or a static buffer) and reuse it"),
    Rule("host_value", "host value (random/time)",
         "a value computed on the host is read once, at capture; every replay reuses it",
         "use torch's device RNG (torch.rand(..., device=)), which graphs replay with fresh numbers, or pass "
         "the value in a static tensor"),
)
RULES = {r.id: r for r in _RULES}

_DATA_DEPENDENT = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount",
                   "repeat_interleave"}
_TENSORISH_METHODS = {"any", "all", "sum", "mean", "max", "min", "amax", "amin", "prod", "norm", "std", "var",
                      "eq", "ne", "gt", "lt", "ge", "le", "isnan", "isinf", "isfinite", "logical_and",
                      "logical_or", "logical_not", "count_nonzero", "abs", "item"}
_NOT_TENSOR_TORCH = ("torch.cuda.", "torch.is_", "torch.jit.", "torch.compiler.", "torch.backends.",
                     "torch.distributed.", "torch._dynamo.", "torch.get_", "torch.are_")
_HOST_FACTORIES = {"tensor", "as_tensor", "from_numpy", "Tensor", "ones", "zeros", "empty", "full", "arange",
                   "linspace", "rand", "randn", "randint", "eye"}
_DTYPES = {"float", "float16", "float32", "float64", "half", "double", "bfloat16", "int", "int8", "int16",
           "int32", "int64", "long", "short", "uint8", "bool", "complex64", "complex128", "cfloat"}
_HOST_VALUE_PREFIXES = ("random.", "np.random.", "numpy.random.", "time.time", "time.perf_counter",
                        "time.monotonic", "datetime.")


