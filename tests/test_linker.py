"""``quick_c``: PyTensor's C virtual machine with the nodes NumPy runs in one call left to
NumPy. The values are those of the graph; the array kernels are C modules, the plumbing is not."""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt

from pymc_gpf.linker import numpy_is_enough
from pymc_gpf.target import QUICK_C, compile_kwargs_for


def test_quick_c_computes_the_graph_with_c_kernels_and_numpy_plumbing():
    x = pt.matrix("x")
    scale = pt.scalar("scale")
    kernel = pt.exp(x * scale) + pt.log1p(x**2)  # fused into one Composite on arrays
    out = [kernel.T.sum(axis=0), pt.dot(x, x.T), (scale * 2 + 1) ** 2]
    fn = pytensor.function([x, scale], out, **compile_kwargs_for(QUICK_C))
    values = np.random.default_rng(0).normal(size=(4, 3))
    got = fn(values, 0.5)
    expected = np.exp(values * 0.5) + np.log1p(values**2)
    np.testing.assert_allclose(got[0], expected.T.sum(axis=0), rtol=1e-12)
    np.testing.assert_allclose(got[1], values @ values.T, rtol=1e-12)
    np.testing.assert_allclose(got[2], 4.0, rtol=1e-12)
    in_c = {
        str(node.op): hasattr(thunk, "cthunk")
        for node, thunk in zip(fn.maker.fgraph.toposort(), fn.vm.thunks, strict=True)
    }
    kernels = [name for name in in_c if "Composite" in name and in_c[name]]
    assert kernels, in_c  # the array kernel is a C module
    plumbing = [
        name
        for node, name in zip(fn.maker.fgraph.toposort(), in_c, strict=True)
        if numpy_is_enough(node)
    ]
    assert plumbing and not any(in_c[name] for name in plumbing), in_c
