"""Small capture programs, each written once against ``cg = course.graphs()``, with the verdict a
GPU gives.

The simulator (:mod:`course.sim`) must give each the verdict torch.cuda gives on a GPU: a laptop ✓
is then a GPU ✓. :mod:`~course.parity.programs` lists them (with :mod:`~course.parity.streams`,
:mod:`~course.parity.sync` and :mod:`~course.parity.modes`; their tools in
:mod:`~course.parity.tools`); :mod:`~course.parity.torch_behaviours`: the failing captures among the
behaviours PyTorch's own graph tests check.
"""
