"""What every registered method promises, one test parametrised over ``pm.fit``'s methods.

Type-II maximum likelihood with ``more_obj_params``: ``w_j ~ N(0, sigma^2)``,
``y_j ~ N(w_j, 1)``; q can be exact for this posterior (mean field suffices), so descending the
free energy jointly in q and ``log sigma`` reaches the closed-form ML-II estimate
``sigma^2 = mean(y^2) - 1``, at the defaults (the automatic step, no step count): the fit
stops by itself, converged. GPF's objective is deterministic: ``sigma^2`` within 1e-3 and the
final free energy within 1e-3 of ``-log p(y | sigma)``. GF's and WVGD's hyperparameters stop
within their Monte Carlo noise: 3 %.
"""

from __future__ import annotations

import warnings

import numpy as np
import pymc as pm
import pytensor
import pytensor.tensor as pt
import pytest

from methods import METHODS_UNDER_TEST, get, names

from pymc_gpf.errors import FitWarning
from pymc_gpf.registry import METHODS


def test_every_registered_method_is_under_test():
    """tests/methods.py has an entry for every name ``pm.fit(method=...)`` accepts (the test
    modules parametrise over it), and none for a method that is not registered."""
    assert set(METHODS_UNDER_TEST) == set(METHODS)


# methods whose objective cannot learn hyperparameters refuse more_obj_params clearly
@pytest.mark.parametrize("method", names("type_ii_refusal"))
def test_methods_without_type_ii_refuse_more_obj_params(method):
    log_sigma = pytensor.shared(0.0, name="log_sigma")
    with pm.Model() as model:
        pm.Normal("w", 0, pt.exp(log_sigma), shape=2)
    with pytest.raises(ValueError, match=get(method).type_ii_refusal):
        pm.fit(5, method=method, model=model, learning_rate=0.01, more_obj_params=[log_sigma],
               progressbar=False)  # fmt: skip


@pytest.mark.parametrize("method", names("type_ii"))
def test_more_obj_params_is_type_ii_maximum_likelihood(method):
    rng = np.random.default_rng(4)
    y = rng.normal(0, np.sqrt(2.0**2 + 1), 20)
    log_sigma = pytensor.shared(0.0, name="log_sigma")
    with pm.Model() as model:
        w = pm.Normal("w", 0, pt.exp(log_sigma), shape=20)
        pm.Normal("y", w, 1.0, observed=y)
    approx = pm.fit(
        method=method, model=model, random_seed=0, more_obj_params=[log_sigma], progressbar=False
    )
    assert approx.inference.settings()["more_obj_params"] == ["log_sigma"]
    assert approx.outcome.converged and approx.inference.hyper.steps > 0
    ml_ii = np.mean(y**2) - 1
    assert np.exp(2 * log_sigma.get_value()) == pytest.approx(ml_ii, rel=get(method).type_ii)
    trace = approx.fit_group()["hyper_log_sigma"].values
    assert trace[-1] == log_sigma.get_value() == approx.fit_group().attrs["hyper_log_sigma"]
    assert trace[0] == 0.0 != trace[-1]  # it moved during the fit, recorded on `step`
    if method == "gpf":
        marginal = -0.5 * np.sum(np.log(2 * np.pi * (ml_ii + 1)) + y**2 / (ml_ii + 1))
        assert approx.hist[-1] == pytest.approx(-marginal, abs=1e-3)


@pytest.mark.parametrize("method", names())
def test_sample_draws_is_the_total_number_of_draws(method):
    """sample(draws): ``draws`` in total for every method (an ensemble: its chains, the
    particles, share them), so a DataTree's chain x draw is the same across methods."""
    with pm.Model() as model:
        pm.Normal("x", 0, 1, shape=2)
    approx = pm.fit(50, method=method, model=model, random_seed=0, progressbar=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FitWarning)  # 50 steps: maybe not converged
        posterior = approx.sample(40).posterior
    assert posterior.sizes["chain"] * posterior.sizes["draw"] == 40
