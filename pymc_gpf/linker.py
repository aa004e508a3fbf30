"""A C backend that is quick to build: PyTensor's C virtual machine, with the nodes that
NumPy runs in a few calls left to NumPy.

On an empty cache PyTensor compiles one C module per distinct node, about half a second of gcc
each, serialised by its compile lock, and a flow step has dozens: dimshuffles, shapes, joins,
copies, assertions, indexing, matrix products (NumPy calls the same BLAS), single-ufunc
elementwise operations and reductions, and fused elementwise kernels. NumPy runs each of the
first kinds in one call; a fused kernel whose operations are all NumPy ufuncs it runs as one
call per operation on whole arrays. Kernels with other operations (softplus, special
functions, ...) and everything else stay in C. Measured on the logistic regression of the
benchmarks, cold cache: GPF's automatic step builds in about 3 s, against 20 s in plain C and
27 s with numba; each step costs more (a fused kernel makes several passes over memory, and
every node pays Python's call overhead: about 10 % on that model, more on tiny ones), which an
automatic fit of tens to hundreds of steps does not notice (startup section).
"""

from __future__ import annotations

import functools

import numpy as np

from pytensor.compile.mode import Mode
from pytensor.compile.ops import DeepCopyOp, ViewOp
from pytensor.graph.basic import Apply
from pytensor.link.vm import VMLinker
from pytensor.raise_op import Assert
from pytensor.scalar import basic as ps
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

from pymc_gpf.rewrites import MAX_UFUNC_OPERANDS

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


# scalar operations whose NumPy ufunc has the same semantics, for fused kernels evaluated one
# ufunc call per operation on whole arrays (:func:`_vectorised_perform`)
_NUMPY_SCALAR_OPS = (
    ps.Abs,
    ps.Add,
    ps.AND,
    ps.Cast,
    ps.EQ,
    ps.Exp,
    ps.Expm1,
    ps.GE,
    ps.GT,
    ps.Identity,
    ps.IntDiv,
    ps.Invert,
    ps.IsInf,
    ps.IsNan,
    ps.LE,
    ps.Log,
    ps.Log1p,
    ps.LT,
    ps.Mul,
    ps.Neg,
    ps.NEQ,
    ps.OR,
    ps.Sqr,
    ps.Sqrt,
    ps.Sub,
    ps.Switch,
    ps.TrueDiv,
)


def _vectorisable(composite: Composite) -> bool:
    return all(isinstance(n.op, _NUMPY_SCALAR_OPS) for n in composite.fgraph.apply_nodes)


def numpy_is_enough(node: Apply) -> bool:
    """Whether the NumPy ``perform`` of ``node`` is as fast as C code: plumbing, and
    elementwise operations and reductions that are one NumPy ufunc. A fused ``Composite``
    qualifies on one element, or when each of its operations is a NumPy ufunc (it is then
    evaluated one ufunc call per operation on whole arrays)."""
    op = node.op
    if isinstance(op, _ONE_NUMPY_CALL):
        return True
    if isinstance(op, Elemwise):
        # NumPy ufuncs take at most 32 operands (Elemwise.perform refuses more)
        few = len(node.inputs) + len(node.outputs) <= MAX_UFUNC_OPERANDS
        if isinstance(op.scalar_op, Composite):
            if _vectorisable(op.scalar_op):
                return True
            # one element, through PyTensor's scalar perform: floats only, which hands it
            # Python ints that NumPy 2 will not mix with the graph's int8 constants
            floats = all(v.type.dtype.startswith("float") for v in node.inputs + node.outputs)
            return few and floats and all(s == 1 for out in node.outputs for s in out.type.shape)
        return few and op.nfunc_spec is not None
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
                if isinstance(op, Elemwise) and isinstance(op.scalar_op, Composite):
                    if _vectorisable(op.scalar_op):
                        vars(op)["perform"] = _vectorised_perform(op.scalar_op)
                patched.append(op)
        try:
            return super().make_all(*args, **kwargs)
        finally:  # ops are shared between graphs: leave them as they were
            for op in patched:
                vars(op).pop("make_thunk")
                vars(op).pop("perform", None)


def _python_thunk(make_thunk):
    def make_python_thunk(node: Apply, storage_map, compute_map, no_recycling, impl=None):
        return make_thunk(node, storage_map, compute_map, no_recycling, impl="py")

    return make_python_thunk


def _numpy_function(op: ps.ScalarOp, nargs: int):
    """The NumPy function that applies the scalar ``op`` to ``nargs`` whole arrays."""
    if isinstance(op, ps.Identity):
        return lambda x: x
    if isinstance(op, ps.Cast):
        return functools.partial(np.asarray, dtype=op.o_type.dtype)
    name, nin, _ = op.nfunc_spec
    ufunc = getattr(np, name)
    if nargs > nin:  # variadic add, mul, and, or: a further argument would be `out`
        return lambda *args: functools.reduce(ufunc, args)
    return ufunc


def _vectorised_perform(composite: Composite):
    """``perform`` of an Elemwise ``Composite``: its scalar graph run once on whole arrays,
    one NumPy ufunc per operation (NumPy would otherwise call the scalar graph per element).
    The graph is translated once into a program over numbered slots (inputs, constants,
    results): looking values up by variable hashed each one at every operation, a fifth of
    the time of a GF step on a 5-parameter mixture."""
    graph = composite.fgraph
    slots = {id(var): i for i, var in enumerate(graph.inputs)}
    constants: list[tuple[int, object]] = []
    program = []
    for inner in graph.toposort():
        if id(inner.outputs[0]) in slots:
            # PyTensor's toposort of a kernel can list a node once per use (a type-II GP's
            # gradient had one exp(x) three times): computed once, it keeps its slot
            continue
        for var in inner.inputs:
            if id(var) not in slots:  # a constant
                slots[id(var)] = len(slots)
                constants.append((slots[id(var)], var.data))
        arguments = tuple(slots[id(var)] for var in inner.inputs)
        slots[id(inner.outputs[0])] = len(slots)
        program.append((_numpy_function(inner.op, len(arguments)), arguments, len(slots) - 1))
    n_inputs, size = len(graph.inputs), len(slots)
    constant_slots = {i for i, _ in constants}
    # the outputs' slots, and whether each is computed here (not an input, not a constant)
    outputs = [slots[id(var)] for var in graph.outputs]
    outputs = [(i, i >= n_inputs and i not in constant_slots) for i in outputs]

    def perform(node: Apply, inputs: list, output_storage: list) -> None:
        values = [*inputs, *([None] * (size - n_inputs))]
        for i, data in constants:
            values[i] = data
        # both branches of a switch are evaluated on every element, as in C, which does not
        # warn about the overflows and invalid values of the branch that is not taken
        with np.errstate(all="ignore"):
            for function, arguments, result in program:
                values[result] = function(*[values[i] for i in arguments])
        shape = np.broadcast_shapes(*(np.shape(x) for x in inputs))
        given, taken = {id(x) for x in inputs}, set()
        for out, (slot, computed), storage in zip(node.outputs, outputs, output_storage,
                                                  strict=True):  # fmt: skip
            result = values[slot]
            # a whole array this kernel made, not an input and not another output: its
            # own memory (a copy of each cost the digits network's GF step a third of its
            # time); else a copy, as PyTensor's outputs never alias inputs or each other
            fresh = (
                computed
                and isinstance(result, np.ndarray)
                and result.base is None
                and result.shape == shape
                and result.dtype == out.type.dtype
                and id(result) not in given | taken
            )
            storage[0] = result if fresh else np.array(np.broadcast_to(result, shape),
                                                       dtype=out.type.dtype)  # fmt: skip
            taken.add(id(storage[0]))

    return perform


def quick_c_mode() -> Mode:
    """PyTensor's ``"cvm"`` mode (C, ``fast_run`` rewrites) with :class:`QuickCVMLinker`."""
    return Mode(QuickCVMLinker(use_cloop=True), "fast_run")
