"""``quick_c``: PyTensor's C virtual machine with the nodes NumPy runs in one call left to
NumPy. The values are those of the graph; a fused kernel with an operation NumPy lacks is a C
module, the plumbing and the kernels of NumPy ufuncs are not."""

from __future__ import annotations

import numpy as np
import pymc as pm
import pytensor
import pytensor.scalar as ps
import pytensor.tensor as pt

from pytensor.compile.mode import Mode
from pytensor.tensor.elemwise import Elemwise

from pymc_gpf.linker import QuickCVMLinker, numpy_is_enough
from pymc_gpf.options import parse_fit_options
from pymc_gpf.target import LARGE_DATA, QUICK_C, batched_target, compile_kwargs_for


def test_quick_c_computes_the_graph_with_c_kernels_and_numpy_plumbing():
    x = pt.matrix("x")
    scale = pt.scalar("scale")
    in_c = pt.tanh(x * scale) + pt.log1p(x**2)  # a fused kernel with an op NumPy lacks here
    # one ufunc per operation (the three-term sum is one variadic add)
    in_numpy = pt.switch(pt.isnan(x), 0.0, pt.exp(x - scale) + x + scale)
    out = [in_c.T.sum(axis=0), in_numpy, pt.dot(x, x.T), (scale * 2 + 1) ** 2]
    fn = pytensor.function([x, scale], out, **compile_kwargs_for(QUICK_C))
    values = np.random.default_rng(0).normal(size=(4, 3))
    values[1, 2] = np.nan
    got = fn(values, 0.5)
    expected = np.tanh(values * 0.5) + np.log1p(values**2)
    np.testing.assert_allclose(got[0], expected.T.sum(axis=0), rtol=1e-12)
    np.testing.assert_allclose(
        got[1], np.where(np.isnan(values), 0.0, np.exp(values - 0.5) + values + 0.5), rtol=1e-12
    )
    np.testing.assert_allclose(got[2][0], values[0] @ values.T, rtol=1e-12)
    np.testing.assert_allclose(got[3], 4.0, rtol=1e-12)
    nodes = fn.maker.fgraph.toposort()
    compiled = [hasattr(thunk, "cthunk") for thunk in fn.vm.thunks]
    kernels = [c for node, c in zip(nodes, compiled, strict=True) if "Composite" in str(node.op)]
    assert True in kernels and False in kernels  # tanh's kernel in C, the other in NumPy
    numpy_nodes = [c for node, c in zip(nodes, compiled, strict=True) if numpy_is_enough(node)]
    assert numpy_nodes and not any(numpy_nodes)


def test_quick_c_leaves_elementwise_nodes_of_more_than_32_operands_to_c():
    # NumPy's ufuncs refuse more than 32 operands (a GPF step with one block per variable
    # fuses that many)
    xs = [pt.vector(f"x{i}") for i in range(40)]
    total = pt.add(*xs)
    fn = pytensor.function(xs, total, **compile_kwargs_for(QUICK_C))
    values = [np.full(3, float(i)) for i in range(40)]
    np.testing.assert_array_equal(fn(*values), np.full(3, float(sum(range(40)))))


def test_quick_c_computes_integer_shape_arithmetic_beyond_int8():
    """The broadcast check PyTensor writes for a 250-row slice (WVGD's step on a GP): int64
    inputs and an int8 constant in one fused kernel of one element. PyTensor's scalar
    perform hands it Python ints, which NumPy 2 refuses to mix with int8 above 127."""
    n, m = pt.lscalar("n"), pt.lscalar("m")
    i0, i1 = ps.int64("i0"), ps.int64("i1")
    one, zero = ps.ScalarConstant(ps.int8, np.int8(1)), ps.ScalarConstant(ps.int64, np.int64(0))
    length = ps.switch(ps.lt(zero, i1), ps.add(one, ps.int_div(ps.sub(i1, one), one)), zero)
    kernel = ps.Composite([i0, i1], [ps.or_(ps.eq(i0, one), ps.eq(i0, length))])
    mode = Mode(QuickCVMLinker(use_cloop=True), None)  # the kernel as written, not rewritten
    fn = pytensor.function([n, m], Elemwise(kernel)(n, m), mode=mode)
    assert fn(250, 250) and fn(1, 7) and not fn(3, 250)


def test_an_automatic_fit_of_much_data_compiles_with_pymc_s_default():
    """quick_c builds fastest, but runs a fused kernel as one NumPy pass over the data per
    operation: from ``LARGE_DATA`` observed scalars an automatic fit compiles with PyMC's
    default (numba) instead; a backend the user names is kept, and fixed steps always take
    PyMC's default."""
    for rows, expected in ((1000, QUICK_C), (LARGE_DATA, None)):
        with pm.Model() as model:
            mu = pm.Normal("mu")
            pm.Normal("y", mu, 1.0, observed=np.zeros(rows))
        target = batched_target(model)
        assert parse_fit_options(target, "sgd").compile_backend == expected
        assert parse_fit_options(target, "sgd", backend="c").compile_backend == "c"
        assert parse_fit_options(target, "sgd", learning_rate=0.1).compile_backend is None


def test_a_numpy_kernel_s_outputs_own_their_memory():
    """A fused kernel run in NumPy hands over the arrays it computed without a copy, but
    never an input, nor one array as two outputs: PyTensor's outputs may be overwritten in
    place by later nodes."""
    from pymc_gpf.linker import _vectorised_perform

    x = ps.float64("x")
    twice = x * 2.0
    composite = ps.Composite([x], [ps.identity(x), twice, twice, twice + 1.0])
    node = Elemwise(composite).make_node(pt.vector("v"))
    values = np.arange(3.0)
    storage = [[None] for _ in node.outputs]
    _vectorised_perform(composite)(node, [values], storage)
    same, first, second, third = (s[0] for s in storage)
    np.testing.assert_array_equal(same, values)
    np.testing.assert_array_equal(first, 2 * values)
    np.testing.assert_array_equal(second, 2 * values)
    np.testing.assert_array_equal(third, 2 * values + 1)
    assert not np.shares_memory(same, values) and not np.shares_memory(first, second)


def test_a_numpy_kernel_computes_once_a_node_its_toposort_repeats():
    """PyTensor's toposort of a fused kernel can list one node once per use (``exp(x)`` used
    three times, as in a type-II GP's gradient): the program computes it once and keeps its
    slot (giving it a second slot made two results share one, and a step fail)."""
    from pymc_gpf.linker import _vectorised_perform

    x, y = ps.float64("x"), ps.float64("y")
    first, second, third = ps.exp(x), ps.exp(x), ps.exp(x)
    outputs = [first * y, second + y, third - y]
    composite = ps.Composite([x, y], outputs)
    node = Elemwise(composite).make_node(pt.vector("a"), pt.vector("b"))
    a, b = np.array([0.0, 1.0, 2.0]), np.array([1.0, 2.0, 3.0])
    storage = [[None] for _ in node.outputs]
    _vectorised_perform(composite)(node, [a, b], storage)
    for (got,), want in zip(storage, [np.exp(a) * b, np.exp(a) + b, np.exp(a) - b], strict=True):
        np.testing.assert_allclose(got, want)
