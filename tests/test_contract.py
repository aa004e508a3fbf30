"""What every registered method promises, one test parametrised over ``pm.fit``'s methods.

Type-II maximum likelihood with ``more_obj_params``: ``w_j ~ N(0, sigma^2)``,
``y_j ~ N(w_j, 1)``; q can be exact for this posterior (mean field suffices), so descending the
free energy jointly in q and ``log sigma`` reaches the closed-form ML-II estimate
``sigma^2 = mean(y^2) - 1``. GPF's objective is deterministic: ``sigma^2`` and the final free
energy ``-log p(y | sigma)`` match to 1e-8. GF's and WVGD's fluctuate with the Monte Carlo
noise: the average of ``sigma^2`` over the last 2000 steps (correlation time of a few steps)
must be within half a per-step sd of the closed form.
"""

from __future__ import annotations

import numpy as np
import pymc as pm
import pytensor
import pytensor.tensor as pt
import pytest

from pymc_gpf.registry import METHODS

TYPE_II = {
    # method: (steps, seed, inf_kwargs, largest per-step sd of sigma^2; None: deterministic)
    "gpf": (20_000, 6, {"natural_mean": True}, None),
    "gf": (5000, 0, {"natural_mean": True, "draws_per_step": 50, "structure": "diagonal"}, 0.2),
    "wvgd": (5000, 0, {"n_particles": 1, "draws_per_particle": 50}, 0.3),
}


# methods whose objective cannot learn hyperparameters: they refuse more_obj_params clearly
NO_TYPE_II = {"ensemble": "not available for ensembles"}


def test_every_registered_method_is_covered():
    assert set(TYPE_II) | set(NO_TYPE_II) == set(METHODS)
    assert not set(TYPE_II) & set(NO_TYPE_II)


@pytest.mark.parametrize("method", sorted(NO_TYPE_II))
def test_methods_without_type_ii_refuse_more_obj_params(method):
    log_sigma = pytensor.shared(0.0, name="log_sigma")
    with pm.Model() as model:
        pm.Normal("w", 0, pt.exp(log_sigma), shape=2)
    with pytest.raises(ValueError, match=NO_TYPE_II[method]):
        pm.fit(5, method=method, model=model, learning_rate=0.01, more_obj_params=[log_sigma],
               progressbar=False)  # fmt: skip


@pytest.mark.parametrize("method", sorted(TYPE_II))
def test_more_obj_params_is_type_ii_maximum_likelihood(method):
    steps, seed, inf_kwargs, max_sd = TYPE_II[method]
    rng = np.random.default_rng(4)
    y = rng.normal(0, np.sqrt(2.0**2 + 1), 20)
    log_sigma = pytensor.shared(0.0, name="log_sigma")
    with pm.Model() as model:
        w = pm.Normal("w", 0, pt.exp(log_sigma), shape=20)
        pm.Normal("y", w, 1.0, observed=y)
    trace = []
    approx = pm.fit(
        steps,
        method=method,
        model=model,
        random_seed=seed,
        inf_kwargs=inf_kwargs,
        learning_rate=0.01,
        more_obj_params=[log_sigma],
        callbacks=[lambda approx, hist, i: trace.append(log_sigma.get_value())],
        progressbar=False,
    )
    assert approx.inference.settings()["more_obj_params"] == ["log_sigma"]
    ml_ii = np.mean(y**2) - 1
    if max_sd is None:
        assert np.exp(2 * log_sigma.get_value()) == pytest.approx(ml_ii, rel=1e-8)
        marginal = -0.5 * np.sum(np.log(2 * np.pi * (ml_ii + 1)) + y**2 / (ml_ii + 1))
        assert approx.hist[-1] == pytest.approx(-marginal, abs=1e-8)
    else:
        sigma2 = np.exp(2 * np.array(trace[-2000:]))
        assert 0 < sigma2.std() < max_sd
        assert abs(sigma2.mean() - ml_ii) < 0.5 * sigma2.std()
