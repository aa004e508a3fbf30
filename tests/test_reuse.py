"""A later fit of the same model reuses the compiled functions and graphs of an earlier one
(pymc_gpf.reuse, pymc_gpf.target.batched_target): the same numbers as a fresh compile, the
model's current data, and a fresh build once the model changes."""

from __future__ import annotations

import numpy as np
import pymc as pm
import pytest

from pymc_gpf import reuse, target

RNG = np.random.default_rng(11)
X, Y = RNG.normal(size=(30, 2)), RNG.normal(size=30)


def _model() -> pm.Model:
    """``w ~ N(0, I)``, ``y ~ N(X w, 1)``: the posterior is ``N(S X^T y, S)``,
    ``S = (I + X^T X)^-1``."""
    with pm.Model() as model:
        x = pm.Data("x", X)
        w = pm.Normal("w", 0.0, 1.0, shape=2)
        pm.Normal("y", x @ w, 1.0, observed=Y, shape=x.shape[0])
    return model


def _exact(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    cov = np.linalg.inv(np.eye(2) + x.T @ x)
    return cov @ x.T @ y, np.sqrt(np.diag(cov))


def _fit(model: pm.Model, seed: int = 3):
    return pm.fit(method="gf", model=model, random_seed=seed, progressbar=False)


def _log_density_function(approx):
    [fn] = [fn for key, fn in approx._compiled.items() if key[0] == "logp"]
    return fn


def _forget() -> None:
    reuse._KEPT.clear()
    target._TARGETS.clear()


@pytest.fixture(scope="module")
def model():
    return _model()


def test_a_second_fit_reuses_the_first_s_functions_and_gives_a_fresh_compile_s_numbers(model):
    first = _fit(model)
    kept = list(reuse._KEPT)
    again = _fit(model)
    assert {id(k.fn) for k in reuse._KEPT} == {id(k.fn) for k in kept}  # nothing compiled anew
    assert again.inference.target is not first.inference.target  # a copy of its own
    np.testing.assert_array_equal(again.hist, first.hist)
    # the verdict's log-density, compiled once for the model
    assert _log_density_function(again) is _log_density_function(first)
    timings = ("seconds", "mode_search_seconds")
    assert {k: v for k, v in again.outcome.checks.items() if k not in timings} == {
        k: v for k, v in first.outcome.checks.items() if k not in timings
    }
    _forget()
    fresh = _fit(model)
    np.testing.assert_array_equal(fresh.hist, first.hist)
    for reused, compiled in zip(again.params, fresh.params, strict=True):
        np.testing.assert_array_equal(reused.get_value(), compiled.get_value())
    # the first fit still has its own state: refining it does not touch the second's
    before = [p.get_value().copy() for p in again.params]
    first.refine(5)
    for p, value in zip(again.params, before, strict=True):
        np.testing.assert_array_equal(p.get_value(), value)


def test_a_reused_fit_reads_the_model_s_current_data(model):
    _fit(model)
    x_new = 2.0 * X[:, ::-1]
    with model:
        pm.set_data({"x": x_new})
    try:
        approx = _fit(model, seed=4)
        # its verdict's log-density (kept from the first fit) reads the new data too: with
        # the old, q would be far off it
        assert approx.outcome.verdict == "trustworthy"
        q = approx.gaussian()
        mean, sd = _exact(x_new, Y)
        np.testing.assert_allclose(q.mean, mean, atol=0.03 * sd.min())
        np.testing.assert_allclose(np.sqrt(q.marginal_variances()), sd, rtol=0.03)
    finally:
        with model:
            pm.set_data({"x": X})


def test_a_changed_model_is_built_afresh():
    model = _model()
    _fit(model)
    with model:
        pm.Normal("extra", 1.0, 0.5)
    q = _fit(model).sample(4000, random_seed=0).posterior
    assert "extra" in q
    np.testing.assert_allclose(float(q["extra"].mean()), 1.0, atol=0.05)
    np.testing.assert_allclose(float(q["extra"].std()), 0.5, rtol=0.1)


def test_a_fit_after_the_data_changed_shape_has_the_new_dimension():
    """``theta_g ~ N(0, 1)``, ``y_g ~ N(theta_g, 1)``, one per group: the posterior of each is
    ``N(y_g / 2, 1/2)``, for the three groups and then for the five that ``set_data`` makes."""
    with pm.Model(coords={"group": range(3)}) as model:
        y = pm.Data("y", np.zeros(3), dims="group")
        theta = pm.Normal("theta", 0.0, 1.0, dims="group")
        pm.Normal("obs", theta, 1.0, observed=y, dims="group")
    _fit(model)
    with model:
        pm.set_data({"y": np.arange(5.0)}, coords={"group": range(5)})
    q = _fit(model).gaussian()
    np.testing.assert_allclose(q.mean, np.arange(5.0) / 2, atol=0.03)
    np.testing.assert_allclose(q.marginal_variances(), 0.5, rtol=0.05)
