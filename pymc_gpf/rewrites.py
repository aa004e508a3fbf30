"""Graph rules PyTensor 3.3 lacks, used by every compiled function of this package.

* A batched rule for ``LogSumExp``, which PyMC's simplex transform (every Dirichlet) uses;
  without it ``vectorize_graph`` wraps it in a ``Blockwise`` loop (one core call per
  particle). It mirrors PyTensor's own rule for ``Softmax``: reduced axes shift past the new
  batch axes. Likewise for ``ViewOp``, the identity.
* ``switch(c, f(a), f(b)) -> f(switch(c, a, b))`` for a unary elementwise ``f``. PyMC's
  Bernoulli/Binomial logit log-densities become ``switch(y, -softplus(-x), -softplus(x))``,
  which evaluates both transcendental branches for every observation and particle; lifted,
  one is evaluated (the same values bit for bit, ~20 % off a logistic-regression step).
  Registered only in the modes we compile with, never globally.
* A variadic sum or product of more than 31 arrays as a tree of narrower ones, for the
  functions compiled without C code (:func:`python_mode`): Python mode evaluates an
  elementwise node with one NumPy ufunc, which takes at most 32 operands, and PyMC's
  log-density sums one term per free variable (a model with 40 scalar variables failed).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytensor.tensor as pt

from pytensor.compile.mode import Mode, get_mode
from pytensor.compile.ops import ViewOp
from pytensor.graph.basic import Variable
from pytensor.graph.replace import _vectorize_node, vectorize_graph
from pytensor.graph.rewriting.basic import in2out, node_rewriter
from pytensor.scalar import Switch
from pytensor.scalar import basic as ps
from pytensor.scan.op import Scan
from pytensor.tensor import switch
from pytensor.tensor.basic import AllocDiag, Join, alloc_diag
from pytensor.tensor.blockwise import Blockwise, vectorize_node_fallback
from pytensor.tensor.elemwise import Elemwise, get_normalized_batch_axes
from pytensor.tensor.rewriting.subtensor import local_blockwise_inc_subtensor
from pytensor.tensor.shape import Shape, shape
from pytensor.tensor.special import LogSumExp
from pytensor.tensor.subtensor import AdvancedIncSubtensor, IncSubtensor
from pytensor.tensor.type import TensorType

# after "specialize" (2), where log(sigmoid(x)) becomes -softplus(-x); before fusion (49)
LIFT_SWITCH_POSITION = 2.5
# NumPy ufuncs, so Elemwise in Python mode, take at most this many inputs and outputs
MAX_UFUNC_OPERANDS = 32
# after the canonicalisation that gathers sums into one variadic node (1)
SPLIT_POSITION = 48.5
_ASSOCIATIVE = (ps.Add, ps.Mul, ps.AND, ps.OR, ps.XOR)


@_vectorize_node.register(LogSumExp)
def _vectorize_logsumexp(op: LogSumExp, node, batched_x):
    core_ndim = node.inputs[0].type.ndim
    batch_ndim = batched_x.type.ndim - core_ndim
    if not batch_ndim:
        return [op(batched_x)]
    axis = get_normalized_batch_axes(op.axis, core_ndim, batch_ndim)
    return [type(op)(axis=axis)(batched_x)]


@_vectorize_node.register(ViewOp)
def _vectorize_view(op: ViewOp, node, batched_x):
    """The identity is batched as it is (PyTensor wraps it in a ``Blockwise`` loop: a
    deterministic that another deterministic uses, mapped for every draw)."""
    return op.make_node(batched_x)


@_vectorize_node.register(AllocDiag)
def _vectorize_alloc_diag(op: AllocDiag, node, batched_x):
    batch_ndim = batched_x.type.ndim - node.inputs[0].type.ndim
    return alloc_diag(
        batched_x, offset=op.offset, axis1=op.axis1 + batch_ndim, axis2=op.axis2 + batch_ndim
    ).owner


@_vectorize_node.register(IncSubtensor)
@_vectorize_node.register(AdvancedIncSubtensor)
def _vectorize_inc_subtensor(op, node, *batched_inputs):
    """PyTensor has no batched rule for writing into a tensor (the ordered transform,
    imputation, the LKJ factor): its ``Blockwise`` is rewritten away only at compile time,
    after the gradient of the batched graph has been taken through it, and that gradient
    (``Join``, ``Split``, ``AdvancedSubtensor`` of a ``Blockwise``) stays a loop. Applied here,
    PyTensor's own rewrite (``local_blockwise_inc_subtensor``) keeps both batched."""
    rebuilt = _with_integer_indices(op, node, batched_inputs)
    if rebuilt is not None:
        op, node, batched_inputs = rebuilt.op, rebuilt, (*batched_inputs[:2], *rebuilt.inputs[2:])
    looped = vectorize_node_fallback(op, node, *batched_inputs)
    if not isinstance(looped.op, Blockwise):
        return looped
    rewritten = local_blockwise_inc_subtensor.transform(None, looped)
    if not rewritten or rewritten[0].owner is None or len(rewritten[0].owner.outputs) != 1:
        return looped
    return rewritten[0].owner


def _with_integer_indices(op, node, batched_inputs):
    """The same write with each constant boolean mask replaced by the integer indices of its
    true entries (the same elements in the same order), which PyTensor's rewrite batches (it
    refuses masks: PyMC's imputation writes the observed and the imputed values through
    one); ``None`` when there is no such mask."""
    x, y, *idxs = node.inputs
    masks = [i for i, idx in enumerate(idxs) if idx.type.dtype == "bool"]
    if not masks or not all(
        isinstance(idxs[i], pt.TensorConstant) and batched_inputs[2 + i] is idxs[i] for i in masks
    ):
        return None
    index = []
    for entry in op.idx_list:
        if isinstance(entry, slice):
            bounds = (entry.start, entry.stop, entry.step)
            index.append(slice(*(None if at is None else idxs[at] for at in bounds)))
        elif idxs[entry].type.dtype == "bool":
            index.extend(pt.as_tensor(where) for where in np.nonzero(idxs[entry].data))
        else:
            index.append(idxs[entry])
    write = pt.set_subtensor if op.set_instead_of_inc else pt.inc_subtensor
    rebuilt = write(x[tuple(index)], y).owner
    return rebuilt if rebuilt.inputs[:2] == [x, y] else None


@_vectorize_node.register(Join)
def _vectorize_join(op: Join, node, *batched_inputs):
    """PyTensor's rule loops unless every input has the same batch dimensions; a constant
    joined to a batched one (the ordered logistic's ``[-inf, cutpoints, inf]``) is
    broadcast to the batch first."""
    pairs = zip(batched_inputs, node.inputs, strict=True)
    batch_ndims = [batched.type.ndim - core.type.ndim for batched, core in pairs]
    batch_ndim = max(batch_ndims)
    if not batch_ndim:
        return op.make_node(*batched_inputs)
    reference = batched_inputs[batch_ndims.index(batch_ndim)]
    batch_shape = tuple(reference.shape)[:batch_ndim]
    inputs = []
    for batched, ndim in zip(batched_inputs, batch_ndims, strict=True):
        padded = pt.shape_padleft(batched, batch_ndim - ndim)
        if padded.type.broadcastable[:batch_ndim] != reference.type.broadcastable[:batch_ndim]:
            padded = pt.alloc(padded, *batch_shape, *tuple(padded.shape)[batch_ndim:])
        inputs.append(padded)
    return Join(op.axis + batch_ndim).make_node(*inputs)


@_vectorize_node.register(Scan)
def _vectorize_scan(op: Scan, node, *batched_inputs):
    """A loop over time whose state carries the batch: one ``Scan`` of ``(B, ...)`` states
    instead of PyTensor's ``Blockwise`` of one ``Scan`` per particle (a GARCH or ARMA
    likelihood, ``T`` steps each). Sequences and states enter time-major, ``(T, B, ...)``,
    the inner graph is vectorised over the batch, and the outputs leave batch-major. Every
    state is batched (a state that starts shared by the batch soon depends on it).
    Loops with ``while``, taps into their own gradient (``mit_mot``) or untraced states keep
    PyTensor's rule."""
    info = op.info
    pairs = zip(batched_inputs, node.inputs, strict=True)
    batch = [batched.type.ndim - core.type.ndim for batched, core in pairs]
    ndim = max(batch)
    if not ndim:
        return op.make_node(*batched_inputs)
    if info.n_mit_mot or info.n_untraced_sit_sot or info.as_while or batch[0]:
        return vectorize_node_fallback(op, node, *batched_inputs)
    widest = max(
        (i for i, b in enumerate(batch) if b == ndim),
        key=lambda i: -sum(batched_inputs[i].type.broadcastable[:ndim]),
    )
    batch_shape = tuple(batched_inputs[widest].shape)[:ndim]
    full = batched_inputs[widest].type.broadcastable[:ndim]

    def time_major(x):  # (B..., T, ...) -> (T, B..., ...)
        return x.dimshuffle(ndim, *range(ndim), *range(ndim + 1, x.type.ndim))

    def inner_like(core, time_major_outer):  # an inner input with the outer's batch dims
        batch_dims = time_major_outer.type.shape[1 : ndim + 1]
        return TensorType(core.type.dtype, shape=batch_dims + core.type.shape)()

    inner_inputs = [v.type() for v in op.fgraph.inputs]
    core_outputs = op.fgraph.bind(inner_inputs)  # mutable copies of the frozen inner graph
    outer = [batched_inputs[0]]
    replace, k = {}, 0
    n_seqs, recurrent = info.n_seqs, info.mit_sot_in_slices + info.sit_sot_in_slices
    for i in range(n_seqs):
        x, b = batched_inputs[1 + i], batch[1 + i]
        if b:
            x = time_major(pt.shape_padleft(x, ndim - b))
            replace[inner_inputs[k]] = inner_like(inner_inputs[k], x)
        outer.append(x)
        k += 1
    states = []
    for j, taps in enumerate(recurrent):
        x = batched_inputs[1 + n_seqs + j]
        x = pt.shape_padleft(x, ndim - batch[1 + n_seqs + j])
        if x.type.broadcastable[:ndim] != full:
            x = pt.alloc(x, *batch_shape, *tuple(x.shape)[ndim:])
        x = time_major(x)
        first = inner_like(inner_inputs[k], x)
        states.append(first)
        replace[inner_inputs[k]] = first
        for tap in range(1, len(taps)):
            replace[inner_inputs[k + tap]] = first.type()
        outer.append(x)
        k += len(taps)
    start = 1 + n_seqs + len(recurrent)
    outer += batched_inputs[start : start + info.n_nit_sot]
    for i in range(info.n_non_seqs):
        x = batched_inputs[start + info.n_nit_sot + i]
        if x.type.ndim > inner_inputs[k].type.ndim:
            replace[inner_inputs[k]] = x.type()
        outer.append(x)
        k += 1
    inner_outputs = list(vectorize_graph(core_outputs, replace=replace))
    for j, state in enumerate(states):  # a state's update has the state's type
        update = inner_outputs[j]
        if update.type.ndim < state.type.ndim:
            update = pt.alloc(update, *tuple(state.shape))
        inner_outputs[j] = state.type.filter_variable(update)
    looped = Scan(
        [replace.get(v, v) for v in inner_inputs], inner_outputs, info, mode=op.mode,
        truncate_gradient=op.truncate_gradient, name=op.name, profile=op.profile,
        allow_gc=op.allow_gc, strict=op.strict,
    )  # fmt: skip
    outputs = looped(*outer, return_list=True)
    return [
        x.dimshuffle(*range(1, ndim + 1), 0, *range(ndim + 1, x.type.ndim))
        if x.type.ndim > old.type.ndim
        else x
        for x, old in zip(outputs, node.outputs, strict=True)
    ]


def _core_shape(op: Shape, node, batched_x):
    batch_ndim = batched_x.type.ndim - node.inputs[0].type.ndim
    return shape(batched_x)[batch_ndim:].owner


@contextmanager
def _core_shapes() -> Iterator[None]:
    """Within the block, a vectorised ``x.shape`` is the core shape, unbatched.

    PyTensor broadcasts it to the batch (``(N, ndim)``, one copy per particle), which is
    right for any batch but makes every index built from a shape batched: ``arange``,
    ``take_along_axis`` (PyMC's Categorical), the ordered logistic's cutpoints and the LKJ
    factor's indices then fall back to per-particle ``Blockwise`` loops the compiler cannot
    remove. Rows of one particle matrix all have the same core shape. Scoped, so that other
    users of ``vectorize_graph`` in the process keep PyTensor's rule."""
    original = _vectorize_node.dispatch(Shape)
    _vectorize_node.register(Shape, _core_shape)
    try:
        yield
    finally:
        _vectorize_node.register(Shape, original)


def batched_graph(outputs: list[Variable], replace: dict) -> list[Variable]:
    """``vectorize_graph(outputs, replace)`` with the core-shape rule (:func:`_core_shapes`)."""
    with _core_shapes():
        return list(vectorize_graph(outputs, replace=replace))


@node_rewriter([Elemwise])
def lift_switch_through_unary(fgraph, node):
    if not isinstance(node.op.scalar_op, Switch):
        return None
    cond, a, b = node.inputs
    if not (a.owner and b.owner and isinstance(a.owner.op, Elemwise)):
        return None
    if a.owner.op != b.owner.op or len(a.owner.inputs) != 1:
        return None
    if len(fgraph.clients[a]) != 1 or len(fgraph.clients[b]) != 1:
        return None  # f(a) or f(b) is needed elsewhere: lifting would not save work
    lifted = a.owner.op(switch(cond, a.owner.inputs[0], b.owner.inputs[0]))
    if lifted.type != node.outputs[0].type:
        return None
    return [lifted]


@node_rewriter([Elemwise])
def split_wide_elemwise(fgraph, node):
    """``op(x_1, ..., x_n)`` of an associative ``op`` on more than
    :data:`MAX_UFUNC_OPERANDS` operands as ``op`` of narrower ``op`` nodes, each input cast
    to the output's dtype first (a partial sum of integers must not wrap around)."""
    op, out = node.op, node.outputs[0]
    if len(node.inputs) + 1 <= MAX_UFUNC_OPERANDS or not isinstance(op.scalar_op, _ASSOCIATIVE):
        return None
    width = MAX_UFUNC_OPERANDS - 1
    inputs = [x if x.dtype == out.dtype else pt.cast(x, out.dtype) for x in node.inputs]
    chunks = [inputs[i : i + width] for i in range(0, len(inputs), width)]
    return [op(*(op(*chunk) if len(chunk) > 1 else chunk[0] for chunk in chunks))]


def python_mode() -> Mode:
    """PyTensor's ``FAST_COMPILE`` (no C code, every node in Python) with wide associative
    elementwise nodes split (:func:`split_wide_elemwise`): for functions called a few
    times, where compiling C would cost more than it saves."""
    return get_mode("FAST_COMPILE").register((in2out(split_wide_elemwise), SPLIT_POSITION))


def with_rewrites(mode: str | Mode | None) -> Mode:
    """``mode`` (a name, a Mode or None for PyTensor's default) with our rewrites added."""
    return get_mode(mode).register((in2out(lift_switch_through_unary), LIFT_SWITCH_POSITION))
