"""Batched rules for PyTensor Ops that ``vectorize_graph`` would otherwise wrap in a
``Blockwise`` loop (correct, but one core call per particle).

PyTensor 3.3 has no rule for ``LogSumExp``, which PyMC's simplex transform (every Dirichlet)
uses; the rule mirrors PyTensor's own for ``Softmax``: the reduced axes shift past the new
batch axes.
"""

from pytensor.graph.replace import _vectorize_node
from pytensor.tensor.elemwise import get_normalized_batch_axes
from pytensor.tensor.special import LogSumExp


@_vectorize_node.register(LogSumExp)
def _vectorize_logsumexp(op: LogSumExp, node, batched_x):
    core_ndim = node.inputs[0].type.ndim
    batch_ndim = batched_x.type.ndim - core_ndim
    if not batch_ndim:
        return [op(batched_x)]
    axis = get_normalized_batch_axes(op.axis, core_ndim, batch_ndim)
    return [type(op)(axis=axis)(batched_x)]
