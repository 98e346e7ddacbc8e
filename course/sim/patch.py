"""The calls a simulated capture intercepts outside aten: host reads that never dispatch, and Numba.

While a capture runs (:func:`install`), ``.cpu()``, ``.tolist()``, ``print(t)``, Numba's allocations
and a new seed are refused on a capturing stream with the GPU's error, and a Numba launch there is
recorded, not run. A string ``"cpu"`` target is a copy to the host; ``torch.tensor(data,
device=...)`` a copy to the device. :func:`host_reads_refused` refuses host reads outside a capture;
:func:`set_sync_debug_mode` reports synchronizing calls outside captures too, as torch.cuda's does.
"""
from __future__ import annotations

import contextlib
import sys

import course.sim.rng as simrng
import course.sim.stream as ss

_saved: list = []  # (owner, name, had its own attribute, original)
_depth = [0]
_forced = [0]  # host_reads_refused() blocks: refuse even with no capture


def _on() -> bool:
    return _forced[0] > 0 or ss.capturing() is not None


def _sync(what):
    return ss.refuse_sync(what) if ss.capturing() is not None else _raise_sync(what)


def _raise_sync(what):
    raise ss._accelerator_error(f"{ss.SYNC} ({what})")


def _tensor_patches(torch):
    T = torch.Tensor
    orig = {k: getattr(T, k) for k in ("item", "tolist", "cpu", "to", "numpy", "__repr__", "__format__",
                                       "__bool__", "__float__", "__int__", "__index__")}

    def reader(name, what):
        def method(self, *a, **k):
            ss.on_sync(what)
            if _on():
                return _sync(what)
            with ss.sync_reported():
                return orig[name](self, *a, **k)
        return method

    def copier(name, what):
        def method(self, *a, **k):
            if _on():
                return ss.refuse_copy(what)
            ss.on_sync(what)
            with ss.sync_reported():
                return orig[name](self, *a, **k)
        return method

    def to(self, *a, **k):
        dev = k.get("device", a[0] if a else None)
        if isinstance(dev, str) and torch.device(dev).type == "cpu":
            if _on():
                ss.refuse_copy(f'.to("{dev}") copies the tensor to the host')
            ss.on_sync(f'.to("{dev}") copies the tensor to the host')
        with ss.sync_reported():
            return orig["to"](self, *a, **k)

    def numpy(self, *a, **k):
        caller = sys._getframe(1).f_code
        if _on() and not (caller.co_name == "as_numba" and caller.co_filename.endswith("runtime.py")):
            raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to "
                            "copy the tensor to host memory first. (on the simulator: refused "
                            "during capture; use course.as_numba for a kernel argument)")
        return orig["numpy"](self, *a, **k)

    host = "reads a device value on the host"
    return [(T, "item", reader("item", f".item() {host}")), (T, "__bool__", reader("__bool__", f"bool(tensor) {host}")),
            (T, "__float__", reader("__float__", f"float(tensor) {host}")),
            (T, "__int__", reader("__int__", f"int(tensor) {host}")),
            (T, "__index__", reader("__index__", f"using a tensor as a Python int {host}")),
            (T, "__repr__", reader("__repr__", "printing a tensor reads its values on the host")),
            (T, "__format__", reader("__format__", "formatting a tensor reads "
                                                   "its values on the host")),
            (T, "tolist", copier("tolist", ".tolist() copies the tensor to the host")),
            (T, "cpu", copier("cpu", ".cpu() copies the "
                                     "tensor to the host")), (T, "to", to), (T, "numpy", numpy)]


def _torch_patches(torch):
    def ctor(orig, name):
        def make(data, *a, **k):
            if k.get("device") is not None and not isinstance(data, torch.Tensor):
                what = f"torch.{name}(..., device=...) builds the tensor on the host and copies it"
                if _on():
                    ss.refuse_copy(what)
                ss.on_sync(what)
            with ss.sync_reported():
                return orig(data, *a, **k)
        return make

    def seeding(orig, name):
        def seed(*a, **k):
            if ss.capturing() is not None:
                new = (a[0] if a else k.get("seed")) if name == "manual_seed" else None
                if new is not None and int(new) & 0xFFFF_FFFF_FFFF_FFFF == torch.initial_seed():
                    return torch.random.default_generator  # the same seed: torch's CUDA generator lets it pass
                raise RuntimeError(ss.SEED)
            return orig(*a, **k)
        return seed

    out = [(torch, "tensor", ctor(torch.tensor, "tensor")), (torch, "as_tensor", ctor(torch.as_tensor, "as_tensor"))]
    for owner in (torch, torch.random):
        out += [(owner, "manual_seed", seeding(owner.manual_seed, "manual_seed")),
                (owner, "seed", seeding(owner.seed, "seed"))]
    return out


def _numba_patches():
    nc = sys.modules.get("numba.cuda")
    km = sys.modules.get("numba.cuda.simulator.kernel")
    if nc is None or km is None:
        return []
    kernel = km.FakeCUDAKernel
    call, getitem = kernel.__call__, kernel.__getitem__

    def configure(self, config):
        self._course_stream = config[2] if len(config) > 2 else None
        return getitem(self, config)

    def launch(self, *args):
        stream = None if self._device else ss.stream_of_numba(getattr(self, "_course_stream", None))
        if stream is None or stream.capture is None or stream.capture not in ss._ACTIVE:
            if ss._ACTIVE and not self._device:
                ss.OUTSIDE[0] += 1
            return call(self, *args)
        stream.capture.program.record_kernel(self, args, stream)

    def refused(orig, call_name, what, relaxed_ok=True):
        def api(*a, **k):
            if ss.strict_capture() is not None or (not relaxed_ok and ss._ACTIVE):
                ss.refuse_numba(call_name, what)
            return orig(*a, **k)
        return api

    alloc = "a Numba allocation during capture"
    return [(kernel, "__call__", launch), (kernel, "__getitem__", configure),
            (nc, "device_array", refused(nc.device_array, "cuMemAlloc", f"cuda.device_array: {alloc}")),
            (nc, "device_array_like", refused(nc.device_array_like, "cuMemAlloc", f"cuda.device_array_like: {alloc}")),
            (nc, "to_device", refused(nc.to_device, "cuMemAlloc", f"cuda.to_device: {alloc}")),
            (nc, "synchronize", refused(nc.synchronize, "cuCtxSynchronize", "cuda.synchronize() "
                                        "waits for the device", relaxed_ok=False))]


def launch_kernel(kernel, config, args) -> None:
    """Run a recorded Numba launch now (a replay), with the configuration it was captured with.

    A replay inside another capture records the launch into that capture instead (like any replayed
    op).
    """
    km = sys.modules["numba.cuda.simulator.kernel"]
    call = next((o for owner, name, _, o in _saved if owner is km.FakeCUDAKernel and name == "__call__"),
                km.FakeCUDAKernel.__call__)
    kernel.grid_dim, kernel.block_dim, kernel.dynshared_size = config
    cap = ss.capturing()
    if cap is not None:
        cap.program.record_kernel(kernel, args, ss.current_stream())
    else:
        call(kernel, *args)


def _apply(patches) -> None:
    for owner, name, repl in patches:
        _saved.append((owner, name, name in vars(owner), getattr(owner, name)))
        setattr(owner, name, repl)


def _restore() -> None:
    while _saved:
        owner, name, own, orig = _saved.pop()
        if own:
            setattr(owner, name, orig)
        else:
            delattr(owner, name)


def install() -> None:
    """Put the patches in force (nested: the first install patches, the matching last uninstall
    restores)."""
    import torch

    _depth[0] += 1
    if _depth[0] == 1:
        _apply(_tensor_patches(torch) + _torch_patches(torch) + _numba_patches() + simrng.patches(torch))


def uninstall() -> None:
    """Undo :func:`install` once."""
    _depth[0] -= 1
    if _depth[0] == 0:
        _restore()


_MODES = {"default": 0, "warn": 1, "error": 2}


def set_sync_debug_mode(debug_mode) -> None:
    """torch.cuda.set_sync_debug_mode on the simulator: "default"/0 off, "warn"/1 warn, "error"/2
    raise at every synchronizing call (the calls a capture refuses as host reads or copies, and
    ``Stream.synchronize()``)."""
    from course.sim import dispatch as simdispatch

    mode = _MODES.get(debug_mode, debug_mode) if isinstance(debug_mode, str) else debug_mode
    if isinstance(debug_mode, str) and debug_mode not in _MODES:
        raise RuntimeError("invalid value of debug_mode, expected "
                           "one of `default`, `warn`, `error`")
    mode = min(max(int(mode), 0), 2)  # as torch: below 0 is off, above 2 is "error"
    was = ss.sync_debug_mode()
    ss.set_sync_debug_level(mode)
    if mode and not was:
        install()
        simdispatch.begin()
    elif was and not mode:
        uninstall()
        simdispatch.end()


def get_sync_debug_mode() -> int:
    """The sync debug mode in force: 0 ("default"), 1 ("warn") or 2 ("error")."""
    return ss.sync_debug_mode()


@contextlib.contextmanager
def host_reads_refused():
    """Refuse host reads and copies in the block, as a capturing stream would, even with no capture
    under way."""
    from course.sim import dispatch as simdispatch

    install()
    _forced[0] += 1
    simdispatch.begin_watch()
    try:
        yield
    finally:
        simdispatch.end_watch()
        _forced[0] -= 1
        uninstall()
