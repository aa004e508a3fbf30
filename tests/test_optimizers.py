"""Optimiser transforms against the algorithms of App. H (dimension-wise variants)."""

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

from pymc_gpf import optimizers as opt


def _run(transform, directions):
    """Feed a sequence of directions through a transform; return its outputs."""
    u = pt.tensor(shape=directions[0].shape, dtype="float64")
    state = opt.map_state(lambda v: pytensor.shared(v, shape=v.shape), transform.init(u.type.shape))
    out, new_state = transform.update(u, state)
    updates = dict(zip(opt.state_leaves(state), opt.state_leaves(new_state), strict=True))
    f = pytensor.function([u], out, updates=updates, mode="FAST_COMPILE")
    return [f(d) for d in directions]


@pytest.fixture
def directions():
    rng = np.random.default_rng(0)
    return [rng.normal(size=(5, 3)) * [1.0, 10.0, 0.1] for _ in range(4)]


def test_dimension_wise_rmsprop(directions):
    decay, eps, v = 0.9, 1e-8, np.zeros(3)
    expected = []
    for phi in directions:  # Alg. A6: v_d <- rho v_d + (1 - rho) mean_n phi_nd^2
        v = decay * v + (1 - decay) * np.mean(phi**2, axis=0)
        expected.append(phi / (np.sqrt(v) + eps))
    got = _run(opt.RMSProp(decay=decay, eps=eps).transform(particle_axes=(0,)), directions)
    np.testing.assert_allclose(got, expected, rtol=1e-12)


def test_dimension_wise_adam(directions):
    b1, b2, eps = 0.9, 0.999, 1e-8
    m, v = np.zeros((5, 3)), np.zeros(3)
    expected = []
    for t, phi in enumerate(directions, start=1):  # Alg. A2
        m = b1 * m + (1 - b1) * phi
        v = b2 * v + (1 - b2) * np.mean(phi**2, axis=0)
        expected.append(m / (1 - b1**t) / (np.sqrt(v / (1 - b2**t)) + eps))
    got = _run(opt.Adam().transform(particle_axes=(0,)), directions)
    np.testing.assert_allclose(got, expected, rtol=1e-12)


def test_dimension_wise_adagrad_and_elementwise_difference(directions):
    v = np.zeros(3)
    expected = []
    for phi in directions:  # Alg. A4
        v = v + np.mean(phi**2, axis=0)
        expected.append(phi / (np.sqrt(v) + 1e-8))
    got = _run(opt.AdaGrad().transform(particle_axes=(0,)), directions)
    np.testing.assert_allclose(got, expected, rtol=1e-12)
    elementwise = _run(opt.AdaGrad(dimension_wise=False).transform(particle_axes=(0,)), directions)
    first = directions[0]  # elementwise: every entry scaled by its own magnitude
    np.testing.assert_allclose(elementwise[0], first / (np.abs(first) + 1e-8), rtol=1e-12)


def test_clip_then_momentum_chain(directions):
    chain = opt.chain(opt.clip_by_norm(1.0), opt.Momentum(beta=0.5).transform())
    m = np.zeros((5, 3))
    expected = []
    for phi in directions:
        clipped = phi * min(1.0, 1.0 / np.linalg.norm(phi))
        m = 0.5 * m + clipped
        expected.append(m)
    np.testing.assert_allclose(_run(chain, directions), expected, rtol=1e-12)


def test_resolve():
    assert isinstance(opt.resolve("ADAM"), opt.Adam)
    assert opt.resolve("descent") == opt.SGD()
    with pytest.raises(ValueError, match="Unknown optimizer"):
        opt.resolve(object())
