"""Real models: NUTS agreement, pm.Minibatch on the full-data scale (type-II ML is in
tests/test_contract.py)."""

import numpy as np
import pymc as pm
import pytest

from conftest import assert_matches_nuts, nuts_posterior

import pymc_gpf


def test_constrained_regression_matches_nuts(regression_model, regression_nuts):
    approx = pm.fit(
        10_000,
        method="gpf",
        model=regression_model,
        random_seed=5,
        inf_kwargs={"natural_mean": True},
        progressbar=False,
    )
    assert_matches_nuts(regression_nuts, approx, ["intercept", "slope", "sigma"])


def test_hierarchical_model_matches_nuts():
    """Centred hierarchical model with HalfNormal and Exponential scales. Its posterior is
    not Gaussian, so GPF needs N well above D + 1 (finite-N bias, see the docs): with 200
    particles the fit stops where an independent cloud's free energy was lowest, which is
    accurate but not yet the particles' fixed point, and says so."""
    rng = np.random.default_rng(11)
    groups, per_group = 30, 20
    group = np.repeat(np.arange(groups), per_group)
    y = rng.normal(1.0, 1.0, groups)[group] + rng.normal(0, 1.0, groups * per_group)
    with pm.Model() as model:
        mu = pm.Normal("mu", 0, 5)
        tau = pm.HalfNormal("tau", 2)
        sigma = pm.Exponential("sigma", 1)
        a = pm.Normal("a", mu, tau, shape=groups)
        pm.Normal("y", a[group], sigma, observed=y)
    with pytest.warns(pymc_gpf.FitWarning, match="finite-N bias.*n_particles=200 was given"):
        approx = pm.fit(
            10_000,
            method="gpf",
            model=model,
            random_seed=5,
            inf_kwargs={"n_particles": 200, "natural_mean": True},
            progressbar=False,
        )
    assert approx.outcome.reason == "overfitting" and not approx.outcome.converged
    assert_matches_nuts(nuts_posterior(model), approx, ["mu", "tau", "sigma", "a"])


def _regression(x, y, minibatch=None):
    with pm.Model() as model:
        intercept = pm.Normal("intercept", 0, 5)
        slope = pm.Normal("slope", 0, 5)
        sigma = pm.HalfNormal("sigma", 2)
        if minibatch:
            x, y = pm.Minibatch(x, y, batch_size=minibatch)
        pm.Normal("y", intercept + slope * x, sigma, observed=y, total_size=1000)
    return model


def test_minibatch_free_energy_is_on_the_full_data_scale(monkeypatch):
    """At fixed particles, F~ from pm.Minibatch + total_size is an unbiased estimate of the
    full-data F~: its average over many minibatches matches within Monte Carlo error, with
    the control variates (pymc_gpf.target.BatchedTarget.logp_and_grads, an anchor at the
    particles' mean) and without them, and the control variates remove most of its noise
    (the particles sit within the posterior's spread of the anchor)."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=1000)
    y = 0.5 + 1.5 * x + rng.normal(scale=0.8, size=1000)
    full = pm.fit(
        10_000,
        method="gpf",
        model=_regression(x, y),
        random_seed=1,
        inf_kwargs={"natural_mean": True},
        progressbar=False,
    )
    particles = full.particles
    full.inference.fit(1, learning_rate=1e-14, progressbar=False)
    exact = full.hist[-1]  # F~ at exactly these particles, full data

    def frozen():
        approx = pm.fit(
            4000,
            method="gpf",
            model=_regression(x, y, minibatch=100),
            random_seed=2,
            inf_kwargs={"initial_particles": particles},
            learning_rate=1e-14,
            progressbar=False,
        )
        np.testing.assert_allclose(approx.particles, particles, atol=1e-9)
        return approx.hist

    estimates = frozen()
    monkeypatch.setattr(pymc_gpf.BatchedTarget, "anchor", None)
    plain = frozen()
    assert plain.std() > 1.0  # the minibatch noise is real...
    assert estimates.std() < plain.std() / 5  # ...the control variates remove most of it...
    for values in (estimates, plain):  # ...and both are centred on the full-data value
        assert abs(values.mean() - exact) < 4 * values.std() / np.sqrt(len(values))


@pytest.mark.parametrize("method", ["gf", "gpf"])
def test_a_minibatch_regression_converges_in_a_few_epochs(method):
    """n = 5000 rows, minibatches of 100, 6 coefficients and sigma known: the posterior is
    Gaussian in closed form. With the control variates both methods stop by themselves in
    under 20 epochs (2000 steps; 26 200 steps without them), q within 0.1 sd and 10 % of the
    posterior and trustworthy."""
    rng = np.random.default_rng(0)
    n, d = 5000, 5
    x = rng.normal(size=(n, d))
    y = 1.0 + x @ np.array([1.0, -2.0, 0.5, 3.0, 0.0]) + rng.normal(size=n)
    design = np.column_stack([np.ones(n), x])
    cov = np.linalg.inv(design.T @ design + np.eye(d + 1) / 100.0)
    mean, sd = cov @ design.T @ y, np.sqrt(np.diag(cov))
    x_batch, y_batch = pm.Minibatch(x, y, batch_size=100)
    with pm.Model() as model:
        a = pm.Normal("a", 0, 10)
        b = pm.Normal("b", 0, 10, shape=d)
        pm.Normal("y", a + x_batch @ b, 1.0, observed=y_batch, total_size=n)
    approx = pm.fit(method=method, model=model, random_seed=1, progressbar=False)
    assert approx.outcome.converged and len(approx.hist) <= 2000
    assert approx.outcome.verdict == "trustworthy"
    q = approx.gaussian()
    np.testing.assert_array_less(np.abs(q.mean - mean) / sd, 0.1)
    np.testing.assert_array_less(np.abs(np.sqrt(q.marginal_variances()) / sd - 1), 0.1)
