"""The automatic GPF step as a pure function of its state (``pymc_gpf.gpf.step``)."""

from __future__ import annotations

import numpy as np
import pytensor

from conftest import gaussian_target, mvnormal_model

from pymc_gpf.clouds import antithetic_cloud
from pymc_gpf.gpf import step
from pymc_gpf.structure import Structure
from pymc_gpf.target import QUICK_C, BatchedTarget, compile_function


def test_the_natural_step_is_newton_on_a_gaussian_target():
    """After Theorem 2: at particles whose covariance is the target's, the natural flow's
    mean step is ``C g_bar = m - mu`` (one step of size 1 lands on the mean), its linear part
    vanishes, and the decrement is the squared Mahalanobis distance of the mean."""
    d = 3
    mu, sigma = gaussian_target(d, np.array([0.3, 1.0, 4.0]), seed=5)
    target = BatchedTarget(mvnormal_model(mu, sigma))
    rng = np.random.default_rng(0)
    start = mu + np.array([1.0, -2.0, 0.5])
    particles = start + antithetic_cloud(2 * d, d, rng) @ np.linalg.cholesky(sigma).T
    shared = pytensor.shared(particles, shape=(None, d))
    structure = Structure("full", d, (np.arange(d),))
    natural = step.init_natural(particles, step.GPFStatic(structure), particles.dtype).natural
    state = step.NaturalState(*(pytensor.shared(v) for v in natural))
    rate = pytensor.shared(1.0)[()]
    new, info = step.natural_step(
        step.AutoState(shared, state, None), None, target, (rate, rate),
        step.GPFStatic(structure, ranks=(d,)),
    )  # fmt: skip
    assert new.search is None
    # a state with nothing evaluated yet moves nowhere: the step evaluates the flow there
    values = compile_function([], [new.particles, *new.natural, info.accepted], QUICK_C)()
    moved, shift, linear, _, decrement_mean, decrement_cov, accepted = values
    np.testing.assert_allclose(moved, particles, rtol=0, atol=0)
    np.testing.assert_allclose(shift, start - mu, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(linear, 0.0, atol=1e-10)
    offset = start - mu
    np.testing.assert_allclose(decrement_mean, offset @ np.linalg.solve(sigma, offset), rtol=1e-10)
    np.testing.assert_allclose(decrement_cov, 0.0, atol=1e-10)
    assert accepted
