"""A C backend that is quick to build: PyTensor's C virtual machine, with the nodes that gain
nothing from C run through their NumPy ``perform``.

On an empty cache PyTensor compiles one C module per distinct node, about half a second of gcc
each, serialised by its compile lock, and a flow step has dozens of small ones: dimshuffles,
shapes, joins, copies, assertions, indexing, matrix products (NumPy calls the same BLAS),
single-ufunc elementwise operations and reductions, one-element fused kernels. NumPy runs each
of those in one call, so compiling them only costs time. Fused elementwise kernels
(``Composite``) on arrays, and everything else, stay in C. Measured on the logistic regression
of the benchmarks, cold cache: GPF's automatic step builds in about 8 s, against 20 s in plain
C and 27 s with numba, for a few microseconds more per node and step (startup section).
"""

from __future__ import annotations

import numpy as np

from pytensor.compile.mode import Mode
from pytensor.compile.ops import DeepCopyOp, ViewOp
from pytensor.graph.basic import Apply
from pytensor.link.vm import VMLinker
from pytensor.raise_op import Assert
from pytensor.scalar.basic import Composite
from pytensor.tensor.basic import (
    AllocEmpty,
    ARange,
    ExtractDiag,
    Join,
    MakeVector,
    ScalarFromTensor,
    TensorFromScalar,
)
from pytensor.tensor.blas import Dot22, Dot22Scalar, Gemm, Gemv
from pytensor.tensor.elemwise import CAReduce, DimShuffle, Elemwise
from pytensor.tensor.math import Argmax
from pytensor.tensor.shape import Reshape, Shape, Shape_i, SpecifyShape
from pytensor.tensor.subtensor import Subtensor

__all__ = ["QuickCVMLinker", "numpy_is_enough", "quick_c_mode"]

# views, shapes, copies, indexing and BLAS calls: NumPy does each in one call whatever the
# size (the products call the same BLAS through NumPy)
_ONE_NUMPY_CALL = (
    AllocEmpty,
    ARange,
    Argmax,
    Assert,
    DeepCopyOp,
    DimShuffle,
    Dot22,
    Dot22Scalar,
    ExtractDiag,
    Gemm,
    Gemv,
    Join,
    MakeVector,
    Reshape,
    ScalarFromTensor,
    Shape,
    Shape_i,
    SpecifyShape,
    Subtensor,
    TensorFromScalar,
    ViewOp,
)


def numpy_is_enough(node: Apply) -> bool:
    """Whether the NumPy ``perform`` of ``node`` is as fast as C code: plumbing, and
    elementwise operations and reductions that are one NumPy ufunc. A fused ``Composite``
    is evaluated element by element in Python, so only on one element."""
    op = node.op
    if isinstance(op, _ONE_NUMPY_CALL):
        return True
    if isinstance(op, Elemwise):
        if isinstance(op.scalar_op, Composite):
            return all(s == 1 for out in node.outputs for s in out.type.shape)
        return op.nfunc_spec is not None
    if isinstance(op, CAReduce):
        spec = getattr(op.scalar_op, "nfunc_spec", None)
        return spec is not None and hasattr(np, spec[0])
    return False


class QuickCVMLinker(VMLinker):
    """:class:`~pytensor.link.vm.VMLinker` (C loop, C thunks) that builds the nodes
    :func:`numpy_is_enough` accepts as NumPy thunks instead of C modules."""

    def make_all(self, *args, **kwargs):
        patched = []
        # an op instance may serve several nodes: it runs in NumPy if every one qualifies;
        # equal ops (same props) may be distinct instances, each patched by identity
        nodes: dict[int, list[Apply]] = {}
        for node in self.fgraph.apply_nodes:
            nodes.setdefault(id(node.op), []).append(node)
        for group in nodes.values():
            op = group[0].op
            if all(map(numpy_is_enough, group)) and "make_thunk" not in vars(op):
                vars(op)["make_thunk"] = _python_thunk(op.make_thunk)
                patched.append(op)
        try:
            return super().make_all(*args, **kwargs)
        finally:  # ops are shared between graphs: leave them as they were
            for op in patched:
                del vars(op)["make_thunk"]


def _python_thunk(make_thunk):
    def make_python_thunk(node: Apply, storage_map, compute_map, no_recycling, impl=None):
        return make_thunk(node, storage_map, compute_map, no_recycling, impl="py")

    return make_python_thunk


def quick_c_mode() -> Mode:
    """PyTensor's ``"cvm"`` mode (C, ``fast_run`` rewrites) with :class:`QuickCVMLinker`."""
    return Mode(QuickCVMLinker(use_cloop=True), "fast_run")
