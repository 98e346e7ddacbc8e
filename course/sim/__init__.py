"""The simulator: torch.cuda's graph and stream API on a machine with no GPU, with the GPU's
verdicts.

``cg = course.graphs()`` is ``torch.cuda`` on the GPU path and :mod:`course.sim.cuda` on the
simulator path: that call (in :mod:`course.core.runtime`) stays the learner's single door. The
modules, one idea each:

- :mod:`~course.sim.cuda`: the public face, torch.cuda's names (``CUDAGraph``, ``graph``,
  ``Stream``, ...).
- :mod:`~course.sim.stream`: streams, events, which stream captures, and the errors a capturing
  stream raises.
- :mod:`~course.sim.graph`: ``CUDAGraph``, ``graph`` and ``graph_pool_handle``; what is modelled and
  what is not.
- :mod:`~course.sim.dispatch`: how aten ops reach the recorder during a capture (a
  ``TorchDispatchMode``).
- :mod:`~course.sim.record`: what a capture records, where its tensors live, how a replay runs it.
- :mod:`~course.sim.patch`: the calls intercepted outside aten (host reads, Numba launches, sync
  debug mode).
- :mod:`~course.sim.callables`: ``make_graphed_callables`` on the stand-in graphs.
- :mod:`~course.sim.optim`: ``capturable=True`` optimizers on CPU tensors that stand for device
  tensors.
- :mod:`~course.sim.rng`: the generator's state saved and restored inside a capture (activation
  checkpointing).
- :mod:`~course.sim.memory`: the device's memory limit during a capture, and
  ``Tensor.record_stream``.

The simulator imports nothing of the course outside itself: :mod:`course.core.runtime` reaches it,
and the programs that hold its verdicts equal to a GPU's are above both (:mod:`course.parity`).
"""
