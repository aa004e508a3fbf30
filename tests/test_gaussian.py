"""``GaussianQ`` (the fitted q of every Gaussian method) against closed forms: SciPy's
multivariate normal density, the covariance its factors define, the degenerate (subspace)
density and the ridge that makes it proper."""

from __future__ import annotations

import numpy as np
import pytest

from scipy.stats import multivariate_normal

from pymc_gpf.gaussian import GaussianQ

RNG = np.random.default_rng(0)
MEAN = RNG.normal(size=5)
FULL = RNG.normal(size=(3, 3))  # block {0, 2, 4}, full rank
SCALES = np.array([0.5, 2.0])  # block {1, 3}, mean field
BLOCKS = (np.array([0, 2, 4]), np.array([1, 3]))


def _covariance() -> np.ndarray:
    cov = np.zeros((5, 5))
    cov[np.ix_(BLOCKS[0], BLOCKS[0])] = FULL @ FULL.T
    cov[BLOCKS[1], BLOCKS[1]] = SCALES**2
    return cov


def test_block_density_is_the_multivariate_normal():
    q = GaussianQ(MEAN, BLOCKS, (FULL, SCALES))
    points = RNG.normal(size=(7, 5))
    expected = multivariate_normal(MEAN, _covariance()).logpdf(points)
    np.testing.assert_allclose(q.logpdf(points), expected, rtol=1e-12)
    np.testing.assert_allclose(q.marginal_variances(), np.diag(_covariance()), rtol=1e-12)
    assert q.rank == 5 and not q.degenerate


def test_draws_have_the_factor_covariance():
    """Mean and covariance of 200 000 draws within 5 Monte Carlo standard errors."""
    q = GaussianQ(MEAN, BLOCKS, (FULL, SCALES))
    draws = q.sample(200_000, np.random.default_rng(1))
    cov = _covariance()
    se_mean = np.sqrt(np.diag(cov) / len(draws))
    np.testing.assert_array_less(np.abs(draws.mean(0) - MEAN), 5 * se_mean)
    # var of a sample covariance entry: (C_ij^2 + C_ii C_jj) / n
    se_cov = np.sqrt((cov**2 + np.outer(np.diag(cov), np.diag(cov))) / len(draws))
    np.testing.assert_array_less(np.abs(np.cov(draws.T, bias=True) - cov), 5 * se_cov)


def test_a_degenerate_q_has_a_density_on_its_subspace_only():
    """Rank-1 factor in 3 dimensions: on the line ``m + t u`` the density is the 1-D normal
    of sd ``|f|``; off it ``-inf``. A ridge ``lam`` adds ``N(0, lam)`` in the 2 missing
    directions."""
    f = np.array([[1.0], [2.0], [2.0]])  # |f| = 3
    u = f[:, 0] / 3.0
    q = GaussianQ(np.zeros(3), (np.arange(3),), (f,))
    assert q.degenerate and q.ranks == [1]
    assert q.smallest_variance() == pytest.approx(9.0)
    t = np.array([-1.0, 0.5, 4.0])
    on_line = t[:, None] * u
    expected = -0.5 * (t / 3.0) ** 2 - np.log(3.0) - 0.5 * np.log(2 * np.pi)
    np.testing.assert_allclose(q.logpdf(on_line), expected, rtol=1e-12)
    off = on_line + np.array([2.0, -1.0, 0.0]) / np.sqrt(5.0)  # orthogonal to u
    assert np.all(q.logpdf(off) == -np.inf)

    ridged = q.with_ridge(0.25)
    assert not ridged.degenerate
    cov = np.outer(f, f) + 0.25 * (np.eye(3) - np.outer(u, u))
    np.testing.assert_allclose(
        ridged.logpdf(off), multivariate_normal(np.zeros(3), cov).logpdf(off), rtol=1e-12
    )
    draws = ridged.sample(100_000, np.random.default_rng(2))
    np.testing.assert_allclose(np.cov(draws.T, bias=True), cov, atol=0.05)
