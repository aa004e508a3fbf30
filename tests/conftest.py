"""Shared helpers: Gaussian targets with known answers (notes §9) and small models."""

from __future__ import annotations

import numpy as np
import pymc as pm
import pytest

from threadpoolctl import threadpool_limits

import pymc_gpf  # noqa: F401  (registers pm.fit(method="gpf"))

# pytest -n 2 runs two workers on two cores: a multithreaded BLAS in each oversubscribes
# them (steps measured 15x slower); the models here are small, one thread is fastest
threadpool_limits(1, user_api="blas")


def gaussian_target(d: int, eigenvalues: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``mu ~ N(0, I)`` and ``Sigma = Q diag(eigenvalues) Q^T`` with a random rotation Q."""
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.uniform(size=(d, d)))
    return rng.normal(size=d), q @ np.diag(eigenvalues) @ q.T


def condition_spectrum(d: int, kappa: float) -> np.ndarray:
    """The paper's spectrum: log10 eigenvalues evenly from -1 to -1 + log10(kappa)."""
    return 10 ** np.linspace(-1, -1 + np.log10(kappa), d)


def mvnormal_model(mu: np.ndarray, cov: np.ndarray) -> pm.Model:
    with pm.Model() as model:
        pm.MvNormal("x", mu=mu, cov=cov)
    return model


def moments(particles: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and 1/N covariance of a particle matrix."""
    m = particles.mean(axis=0)
    z = particles - m
    return m, z.T @ z / len(particles)


def nuts_posterior(model: pm.Model, seed: int = 1):
    return pm.sample(
        2000, tune=1000, chains=2, cores=1, random_seed=seed, progressbar=False, model=model
    ).posterior


def assert_matches_nuts(reference, approx, names, seed=1):
    """Means within 0.1 posterior sd and sds within 15 % of NUTS, in constrained space."""
    q = approx.sample(20_000, random_seed=seed).posterior
    for name in names:
        ref_mean = reference[name].mean(("chain", "draw")).values
        ref_sd = reference[name].std(("chain", "draw")).values
        mean = q[name].mean(("chain", "draw")).values
        sd = q[name].std(("chain", "draw")).values
        np.testing.assert_array_less(np.abs(mean - ref_mean) / ref_sd, 0.1, err_msg=name)
        np.testing.assert_array_less(np.abs(sd / ref_sd - 1), 0.15, err_msg=name)


def linear_hierarchy_model(groups: int = 40, per_group: int = 5):
    """``a_j ~ N(mu + beta x_j, 1)``, ``y_jk ~ N(a_j, 1)``: a Gaussian posterior in
    ``(mu, beta, a)`` whose precision is an arrow (the hierarchical structure's family
    holds it), and that posterior's mean and covariance."""
    rng = np.random.default_rng(11)
    x = rng.normal(size=groups)
    a = 0.5 + 1.5 * x + rng.normal(size=groups)
    y = a[:, None] + rng.normal(size=(groups, per_group))
    with pm.Model() as model:
        mu = pm.Normal("mu", 0, 5)
        beta = pm.Normal("beta", 0, 2)
        group = pm.Normal("a", mu + beta * x, 1, shape=groups)
        pm.Normal("y", group[:, None], 1, observed=y)
    # log p = -1/2 sum_f (w_f . theta - c_f)^2 / s_f^2 over theta = (mu, beta, a)
    d = 2 + groups
    precision, shift = np.zeros((d, d)), np.zeros(d)

    def factor(w, c, s):
        precision[:] += np.outer(w, w) / s**2
        shift[:] += w * c / s**2

    factor(np.eye(d)[0], 0.0, 5.0)
    factor(np.eye(d)[1], 0.0, 2.0)
    for j in range(groups):
        w = np.zeros(d)
        w[[0, 1, 2 + j]] = -1.0, -x[j], 1.0
        factor(w, 0.0, 1.0)
        for k in range(per_group):
            factor(np.eye(d)[2 + j], y[j, k], 1.0)
    cov = np.linalg.inv(precision)
    return model, cov @ shift, cov


def eight_schools() -> pm.Model:
    """Eight schools, non-centred: a funnel in tau, where 20 particles' quadrature is too
    coarse for GPF's fixed point."""
    y = np.array([28.0, 8, -3, 7, -1, 1, 18, 12])
    sigma = np.array([15.0, 10, 16, 11, 9, 11, 10, 18])
    with pm.Model() as model:
        theta_trans = pm.Normal("theta_trans", 0, 1, shape=8)
        mu = pm.Normal("mu", 0, 5)
        tau = pm.HalfCauchy("tau", 5)
        pm.Normal("y", mu + tau * theta_trans, sigma, observed=y)
    return model


def log_gamma(shape: float) -> pm.Model:
    """x ~ Gamma(shape, 1), fitted as y = log x with density exp(shape y - e^y): skewed, the
    more so the smaller ``shape``."""
    with pm.Model() as model:
        pm.Gamma("x", shape, 1.0)
    return model


@pytest.fixture(scope="session")
def regression_data():
    rng = np.random.default_rng(42)
    x = rng.normal(size=60)
    y = 1.0 + 2.0 * x + rng.normal(scale=0.7, size=60)
    return x, y


def regression(x: np.ndarray, y: np.ndarray) -> pm.Model:
    """A small constrained regression (HalfNormal scale), with data and a deterministic."""
    with pm.Model(coords={"obs": np.arange(len(x))}) as model:
        xd = pm.Data("x", x, dims="obs")
        intercept = pm.Normal("intercept", 0, 5)
        slope = pm.Normal("slope", 0, 5)
        sigma = pm.HalfNormal("sigma", 2)
        pm.Deterministic("sigma2", sigma**2)
        pm.Normal("y", intercept + slope * xd, sigma, observed=y, dims="obs")
    return model


@pytest.fixture(scope="session")
def regression_model(regression_data):
    return regression(*regression_data)


@pytest.fixture(scope="session")
def regression_nuts(regression_model):
    return nuts_posterior(regression_model)
