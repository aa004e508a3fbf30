"""The search for modes q does not cover (:mod:`pymc_gpf.modes`), on closed-form targets in
NumPy (no model, no compilation): L-BFGS's endpoints, Laplace's mass and the mixture's
moments against their exact values."""

import numpy as np
import pytest

from scipy import stats
from scipy.special import logsumexp

from pymc_gpf.modes import (
    GRADIENT_TOLERANCE,
    ascend,
    importance_mass,
    laplace,
    mixture_errors,
    search_modes,
)

MEAN = np.array([1.0, -2.0, 0.5])
COVARIANCE = np.array([[4.0, 1.6, 0.0], [1.6, 1.0, 0.1], [0.0, 0.1, 0.09]])


def gaussian(mean, covariance, log_mass=0.0):
    """``log p`` of ``exp(log_mass) N(mean, covariance)`` and its gradient, counted."""
    precision = np.linalg.inv(covariance)
    norm = stats.multivariate_normal(mean, covariance)

    def value_and_grad(points):
        value_and_grad.evaluations += len(points)
        return log_mass + norm.logpdf(points).reshape(-1), -(points - mean) @ precision

    value_and_grad.evaluations = 0
    return value_and_grad


def mixture(weights, means, covariances):
    """A mixture of Gaussians: ``log p`` and its gradient."""
    parts = [gaussian(m, c, np.log(w)) for w, m, c in zip(weights, means, covariances, strict=True)]

    def value_and_grad(points):
        values, grads = zip(*(part(points) for part in parts), strict=True)
        values = np.array(values)  # (M, S)
        weights = np.exp(values - logsumexp(values, axis=0))
        return logsumexp(values, axis=0), np.einsum("ms,msd->sd", weights, np.array(grads))

    return value_and_grad


def test_lbfgs_finds_a_correlated_gaussians_mean_from_far_starts_in_a_few_batched_calls():
    """From starts 10^3-10^4 sds away and whitened by a wrong (diagonal) factor, every row
    converges to the mean (the gradient test in the whitened coordinates), and the count is
    of points evaluated."""
    target = gaussian(MEAN, COVARIANCE)
    starts = MEAN + np.random.default_rng(0).normal(size=(5, 3)) * [2e3, 5e3, 1e2]
    ascent = ascend(target, starts, np.zeros(3), np.eye(3), max_iterations=200)
    assert ascent.converged.all() and not ascent.absorbed.any()
    assert np.max(np.abs(ascent.points - MEAN) / np.sqrt(np.diag(COVARIANCE))) < 0.01
    assert ascent.evaluations == target.evaluations
    assert np.max(np.abs(ascent.grad)) < GRADIENT_TOLERANCE


def test_a_path_that_enters_the_named_region_stops_there():
    target = gaussian(MEAN, COVARIANCE)
    starts = MEAN + np.array([[50.0, 0.0, 0.0], [0.0, 0.0, 3.0]])
    factor = np.linalg.cholesky(COVARIANCE)

    def near(points):
        return np.max(np.abs(points - MEAN) / np.sqrt(np.diag(COVARIANCE)), axis=1) < 3

    ascent = ascend(target, starts, MEAN, factor, max_iterations=100, absorbed=near)
    assert ascent.absorbed.all() and near(ascent.points).all()


def test_laplace_and_its_importance_mass_are_exact_on_a_gaussian():
    """On ``c N(m, S)`` Laplace's approximation is ``N(m, S)`` (the finite differences taken
    along another Gaussian's factor), and importance sampling from it gives the mass
    ``log c`` exactly: with antithetic draws every ratio is ``c``."""
    target = gaussian(MEAN, COVARIANCE, log_mass=3.7)
    factor = np.linalg.cholesky(np.diag(np.diag(COVARIANCE)))
    approximation = laplace(target, MEAN, factor, step=1e-4)
    np.testing.assert_allclose(approximation.variances, np.diag(COVARIANCE), rtol=1e-6)
    covariance = approximation.factor @ approximation.factor.T
    np.testing.assert_allclose(covariance, COVARIANCE, rtol=1e-6, atol=1e-8)
    normals = np.random.default_rng(0).standard_normal((16, 3))
    log_mass = importance_mass(lambda x: target(x)[0], approximation, normals)
    assert log_mass == pytest.approx(3.7, abs=1e-6)


def test_the_importance_mass_sees_a_mode_narrower_than_its_curvature():
    """``log p = -x^2/2 - x^4`` has Laplace's N(0, 1) at its mode, but its mass is
    ``int exp(-x^2/2 - x^4) dx`` = 1.56 (quadrature), not sqrt(2 pi) = 2.51."""
    grid = np.linspace(-6, 6, 200_001)
    exact = np.log(np.sum(np.exp(-(grid**2) / 2 - grid**4)) * (grid[1] - grid[0]))

    def quartic(points):
        x = points[:, 0]
        return -(x**2) / 2 - x**4, (-x - 4 * x**3)[:, None]

    approximation = laplace(quartic, np.zeros(1), np.eye(1), step=1e-4)
    normals = np.random.default_rng(0).standard_normal((4096, 1))
    log_mass = importance_mass(lambda x: quartic(x)[0], approximation, normals)
    assert abs(log_mass - exact) < 0.02 < 0.4 < 0.5 * np.log(2 * np.pi) - exact


def test_laplace_refuses_a_saddle():
    def saddle(points):
        return -(points[:, 0] ** 2) + points[:, 1] ** 2, np.stack(
            [-2 * points[:, 0], 2 * points[:, 1]], axis=1
        )

    assert laplace(saddle, np.zeros(2), np.eye(2), step=1e-4) is None


def test_mixture_errors_are_the_mixtures_exact_moments():
    """0.3 N(-3, 1) + 0.7 N(3, 1): mean 1.2, variance 1 + 0.21 * 36 = 8.56; its first
    component's mean is 4.2 / sqrt(8.56) sds off and its sd 1 - 1/sqrt(8.56)."""
    means = np.array([[-3.0], [3.0]])
    mean_error, sd_error = mixture_errors(means, np.ones((2, 1)), np.log([0.3, 0.7]))
    assert mean_error[0] == pytest.approx(4.2 / np.sqrt(8.56))
    assert sd_error[0] == pytest.approx(1 - 1 / np.sqrt(8.56))


def _two_modes(weight=0.3):
    """A 3-D mixture with ``weight`` on a component 8 sds from the other along x."""
    other = MEAN + np.array([16.0, 0.0, 0.0])
    target = mixture([1 - weight, weight], [MEAN, other], [COVARIANCE, COVARIANCE])
    return target, other


@pytest.mark.parametrize("weight", [0.3, 0.001])
def test_the_search_finds_a_mode_q_misses_and_its_share_of_the_mass(weight):
    """q fitted to the main component; starts on both sides: the other mode is found, 8 of
    q's sds away in x, with its exact share of the mass (the components barely overlap),
    and the mixture's errors are those of q against the whole posterior's moments."""
    target, other = _two_modes(weight)
    starts = MEAN + np.random.default_rng(1).normal(size=(8, 3)) * [1.0, 3.0, 1.0]
    starts[:, 0] += np.linspace(-24.0, 24.0, 8)
    search = search_modes(
        target, lambda x: target(x)[0], starts, MEAN, COVARIANCE, np.random.default_rng(2),
        max_iterations=100, step=1e-4,
    )  # fmt: skip
    assert len(search.modes) == 1 and search.axes[0] == 0
    np.testing.assert_allclose(search.modes[0], other, atol=1e-3)
    assert search.distances[0] == pytest.approx(8.0, abs=1e-3)
    assert search.shares[0] == pytest.approx(weight, rel=1e-4)  # Gaussian modes: exact
    mean = (1 - weight) * MEAN[0] + weight * other[0]
    sd = np.sqrt(COVARIANCE[0, 0] + weight * (1 - weight) * 16.0**2)
    assert search.mean_errors[0] == pytest.approx(abs(MEAN[0] - mean) / sd, rel=1e-4)
    assert search.sd_errors[0] == pytest.approx(1 - 2.0 / sd, rel=1e-4)


def test_no_other_mode_is_found_on_a_skewed_unimodal_posterior():
    """A log-normal in one coordinate, q at its mean (not its mode): every start ends in q's
    bulk or at q's own mode, so no mode is reported."""

    def log_normal(points):
        x = points[:, 0]
        # log of the density of exp(x) for exp(x) ~ LogNormal(0, 1), in x: N(0, 1)'s
        # with a skew added by a cubic term that keeps one mode
        return -0.5 * x**2 - 0.1 * x**3 * (x > 0) + 0.0, (-x - 0.3 * x**2 * (x > 0))[:, None]

    starts = np.linspace(-30, 30, 8)[:, None]
    search = search_modes(
        log_normal, lambda x: log_normal(x)[0], starts, np.array([-0.2]), np.array([[0.8]]),
        np.random.default_rng(0), max_iterations=100, step=1e-4,
    )  # fmt: skip
    assert len(search.modes) == 0 and search.starts == 8


def test_a_start_beyond_a_narrow_mode_ends_there_not_in_q():
    """0.96 N(0, 1) + 0.04 N(8, 0.5^2), q = N(0, 1): from x = 13.6 the first step is one of q's
    sds, not a jump as far as the start is from q (which crossed the narrow mode into q's
    bulk), and L-BFGS ends at the minor mode."""
    target = mixture([0.96, 0.04], [np.zeros(1), np.full(1, 8.0)], [np.eye(1), np.eye(1) / 4])

    def in_q(points):
        return np.abs(points[:, 0]) < 3

    ascent = ascend(target, np.array([[13.6]]), np.zeros(1), np.eye(1), max_iterations=100,
                    absorbed=in_q)  # fmt: skip
    assert ascent.converged[0] and not ascent.absorbed[0]
    assert ascent.points[0, 0] == pytest.approx(8.0, abs=1e-3)
