"""The ensembles' equations (``pymc_gpf.ensemble.flow``) against brute force and calculus."""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt

from pymc_gpf.ensemble import flow


def test_the_interaction_drift_is_minus_n_times_the_gradient_of_the_energy():
    """With ``E = (1/2) mean_ij kappa_ij``, ``dE/dtheta_n = (1/N^2) sum_j grad_1 kappa_nj``
    (kappa symmetric), so ``-(1/N) sum_j grad_1 kappa_nj = -N dE/dtheta_n``; and it equals the
    sum written out pair by pair."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(6, 4))
    h = 0.7
    particles = pt.matrix("particles")
    kernel = flow.rbf_kernel(flow.squared_distances(particles), h)
    energy = flow.interaction_energy(kernel)
    drift, grad = pytensor.function(
        [particles],
        [flow.interaction_drift(particles, kernel, h), pytensor.grad(energy, particles)],
        mode="FAST_COMPILE",
    )(x)
    np.testing.assert_allclose(drift, -len(x) * grad, rtol=1e-12, atol=1e-14)
    by_pairs = np.zeros_like(x)
    for n in range(len(x)):
        for j in range(len(x)):
            k = np.exp(-np.sum((x[n] - x[j]) ** 2) / (2 * h))
            by_pairs[n] += k * (x[n] - x[j]) / h / len(x)  # -grad_1 kappa / N
    np.testing.assert_allclose(drift, by_pairs, rtol=1e-12)


def test_the_median_bandwidth():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(7, 3))
    d2 = ((x[:, None] - x[None]) ** 2).sum(-1)
    off = np.sort(d2[~np.eye(7, dtype=bool)])
    particles = pt.matrix("particles")
    got = pytensor.function(
        [particles], flow.median_bandwidth(flow.squared_distances(particles)), mode="FAST_COMPILE"
    )(x)
    np.testing.assert_allclose(got, off[len(off) // 2] / (2 * np.log(8)), rtol=1e-12)


def test_the_unadjusted_langevin_variance_on_a_gaussian():
    """AR(1): ``theta' = (1 - eta / s2) theta + sqrt(2 eta) xi`` has variance
    ``2 eta / (1 - (1 - eta / s2)^2)``; simulated exactly in NumPy."""
    s2, eta = 0.5, 0.2
    a = 1 - eta / s2
    np.testing.assert_allclose(flow.ula_gaussian_variance(s2, eta), 2 * eta / (1 - a**2))
    rng = np.random.default_rng(0)
    theta = np.zeros(4000)
    for _ in range(200):
        theta = a * theta + np.sqrt(2 * eta) * rng.normal(size=theta.shape)
    var = flow.ula_gaussian_variance(s2, eta)
    assert abs(theta.var() - var) < 5 * var * np.sqrt(2 / len(theta))
    assert flow.ula_gaussian_variance(s2, 2 * s2) == np.inf  # unstable at eta >= 2 s2


def test_the_drift_cap_bounds_a_move_in_the_preconditioners_metric():
    """``eta M g`` is ``eta sqrt(g^T M g)`` long in the metric ``M^(-1)``: a move shorter
    than ``MAX_DRIFT_MOVE sqrt(D)`` keeps the factor exactly 1, a longer one is shortened to
    that length (checked with ``M^(-1)`` written out)."""
    rng = np.random.default_rng(4)
    d = 3
    b = rng.normal(size=(d, d))
    metric = b @ b.T + np.eye(d)
    drift = np.vstack([rng.normal(size=d), 1e4 * rng.normal(size=d)])
    g, pre, eta = pt.matrix(), pt.matrix(), pt.scalar()
    cap = pytensor.function([g, pre, eta], flow.drift_cap(g, pre, eta))(drift, drift @ metric, 0.1)
    assert cap[0] == 1.0
    move = 0.1 * cap[1] * drift[1] @ metric
    length = np.sqrt(move @ np.linalg.solve(metric, move))
    np.testing.assert_allclose(length, flow.MAX_DRIFT_MOVE * np.sqrt(d))
