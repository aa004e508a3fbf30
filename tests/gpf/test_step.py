"""The automatic GPF step as a pure function of its state (``pymc_gpf.gpf.step``)."""

from __future__ import annotations

import numpy as np
import pytensor
import pytest

from conftest import gaussian_target, mvnormal_model

from pymc_gpf.clouds import antithetic_cloud
from pymc_gpf.control import NEAR
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


@pytest.mark.parametrize(
    ("offset", "since_best", "best", "due"),
    [
        (10.0, 0, 5.0, False),  # far: every FAR_VALIDATION-th step without an improvement
        (10.0, step.FAR_VALIDATION - 1, 5.0, True),
        (10.0, 0, np.inf, True),  # nothing seen yet: the first accepted step
        (0.01, 0, 1e9, False),  # near: every NEAR_VALIDATION-th step
        (0.01, step.NEAR_VALIDATION - 1, 1e9, True),
    ],
)
def test_the_independent_cloud_is_evaluated_when_due(offset, since_best, best, due):
    """Far from the fixed point (decrement >= NEAR) the independent cloud is evaluated every
    FAR_VALIDATION-th accepted step without an improvement, near it every NEAR_VALIDATION-th:
    a step that is not due evaluates none of its points, keeps its free energy and best
    state, and counts one more step since the best; a due step evaluates all of them and
    takes a better value as the best."""
    d = 3
    mu, sigma = gaussian_target(d, np.array([0.3, 1.0, 4.0]), seed=5)
    target = BatchedTarget(mvnormal_model(mu, sigma))
    rng = np.random.default_rng(0)
    start = mu + offset * np.array([1.0, -2.0, 0.5])
    particles = start + antithetic_cloud(2 * d, d, rng) @ np.linalg.cholesky(sigma).T
    structure = Structure("full", d, (np.arange(d),))
    static = step.GPFStatic(structure, ranks=(d,))
    init = step.init_natural(particles, static, particles.dtype, rng)
    search = init.search._replace(
        validation_free_energy=np.asarray(7.0), best_validation=np.asarray(best),
        since_best=np.asarray(float(since_best)),
    )  # fmt: skip
    state = step.AutoState(
        pytensor.shared(particles, shape=(None, d)),
        step.NaturalState(*map(pytensor.shared, init.natural)),
        step.SearchState(*map(pytensor.shared, search)),
    )  # fmt: skip
    rate = pytensor.shared(1.0)[()]
    new, info = step.natural_step(state, None, target, (rate, rate), static)
    outputs = [info.accepted, info.decrement, info.densities, *new.search[2:]]
    values = compile_function([], outputs, QUICK_C)()
    accepted, decrement, densities, validation, best_particles, best_new, _, since = values
    # a step of size 0 from nothing evaluated: accepted at the start, the decrement there
    assert accepted and (decrement >= NEAR) == (offset > 1)
    if not due:
        assert densities == 0 and validation == 7.0 and best_new == best
        assert since == since_best + 1
        return
    assert densities == 2 * d and np.isfinite(validation) and validation != 7.0
    assert best_new == min(validation, best)
    assert since == (0 if validation < best else since_best + 1)
    if validation < best:
        np.testing.assert_array_equal(best_particles, particles)
