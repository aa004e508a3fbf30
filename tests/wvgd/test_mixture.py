"""WVGD's fitted q as a NumPy mixture of truncated Gaussians (``pymc_gpf.wvgd.mixture``)."""

from __future__ import annotations

import numpy as np

from scipy import stats

from pymc_gpf.wvgd.mixture import MixtureQ, nearest


def _two_cells(a: float = 0.5) -> MixtureQ:
    # particles at -a and +a on the line: the cells are the half-lines x < 0 and x > 0
    particles = np.array([[-a], [a]])
    return MixtureQ(particles, particles.copy(), np.ones((2, 1)), np.array([0.3, 0.7]), np.ones(2))


def test_the_density_is_the_truncated_gaussian_of_the_cell():
    """``log q(x) = log beta_j + log N(x; m_j, s_j) - log Phi(a)`` in cell ``j``: each local
    N(+-a, 1) keeps the mass Phi(a) on its side of 0 (the normaliser is estimated from 10^6
    draws: relative error sqrt((1 - Z) / (Z n)) < 1e-3)."""
    q, a = _two_cells(), 0.5
    x = np.array([[-1.3], [-0.2], [0.1], [2.0]])
    cell = (x[:, 0] > 0).astype(int)
    centre = np.where(cell == 1, a, -a)
    exact = np.log(q.weights[cell]) + stats.norm.logpdf(x[:, 0], centre, 1.0) - stats.norm.logcdf(a)
    got = q.logpdf(x, np.random.default_rng(1), n_draws=1_000_000)
    np.testing.assert_allclose(got, exact, atol=3e-3)


def test_draws_fall_in_their_cells_in_proportion_to_the_weights():
    q = _two_cells()
    draws = q.sample(20_000, np.random.default_rng(2))
    share = np.mean(nearest(draws, q.particles) == 1)
    assert abs(share - 0.7) < 5 * np.sqrt(0.7 * 0.3 / 20_000)
    # in cell x > 0 the draws are N(a, 1) truncated to x > 0: mean a + pdf(a) / Phi(a)
    right = draws[draws[:, 0] > 0, 0]
    truncated_mean = 0.5 + stats.norm.pdf(0.5) / stats.norm.cdf(0.5)
    assert abs(right.mean() - truncated_mean) < 5 * right.std() / np.sqrt(len(right))


def test_a_whitened_mixture_is_its_affine_image():
    """In coordinates ``x = shift + factor u``: draws are the ``u``-mixture's mapped, and the
    density is the ``u``-density over ``|det factor|`` (one cell: exactly the Gaussian
    ``N(shift + factor m, factor diag(s^2) factor^T)``)."""
    shift, factor = np.array([1.0, -2.0]), np.array([[3.0, 0.0], [1.5, 0.2]])
    means, scales = np.array([[0.4, -0.3]]), np.array([[0.8, 1.5]])
    q = MixtureQ(means.copy(), means, scales, np.ones(1), np.ones(1), shift, factor)
    cov = factor @ np.diag(scales[0] ** 2) @ factor.T
    exact = stats.multivariate_normal(shift + factor @ means[0], cov)
    x = exact.rvs(5, random_state=3)
    np.testing.assert_allclose(q.logpdf(x, np.random.default_rng(0), 10), exact.logpdf(x))
    draws = q.sample(40_000, np.random.default_rng(4))
    se = np.sqrt(np.diag(cov) / 40_000)
    np.testing.assert_array_less(np.abs(draws.mean(0) - exact.mean), 5 * se)
    np.testing.assert_allclose(np.cov(draws.T), cov, rtol=0.03)
    np.testing.assert_allclose(q.to_u(q.to_x(means)), means)
