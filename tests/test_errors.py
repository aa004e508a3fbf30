"""Bad input gets a clear error naming what to fix; nothing is lost; the model is untouched."""

import numpy as np
import pymc as pm
import pytensor
import pytensor.tensor as pt
import pytest

import pymc_gpf


def _fit(model, n=5, inf_kwargs=None, **kwargs):
    return pm.fit(n, method="gpf", model=model, inf_kwargs=inf_kwargs, progressbar=False, **kwargs)


BAD_CONSTRUCTOR = [
    ({"n_particles": 1}, ValueError, "n_particles must be an integer >= 2"),
    ({"n_particles": 2.5}, ValueError, "n_particles"),
    ({"n_particles": True}, ValueError, "n_particles"),
    ({"jitter": 0.0}, ValueError, "jitter must be a positive"),
    ({"jitter": -1.0}, ValueError, "jitter"),
    ({"jitter": float("nan")}, ValueError, "jitter"),
    ({"jitter": float("inf")}, ValueError, "jitter must be finite"),
    ({"structure": "banded"}, ValueError, "Unknown structure 'banded'.*intercept"),
    ({"structure": [["slope", "nope"]]}, ValueError, "'nope'.*not a free variable"),
    ({"structure": [["slope"], ["slope", "sigma"]]}, ValueError, "more than one block"),
    ({"structure": "slope"}, ValueError, "Unknown structure"),
    ({"structure": [["slope"], []]}, ValueError, "empty block"),
    ({"init": "random"}, ValueError, "init must be one of"),
    ({"initial_particles": np.zeros((3, 2))}, ValueError, r"shape \(N, 3\)"),
    ({"initial_particles": np.ones((3, 3))}, ValueError, "identical along"),
    ({"start": {"slope": [1.0, 2.0]}}, ValueError, r"start\['slope'\] has shape \(2,\)"),
    ({"start": {"nope": 1.0}}, KeyError, "'nope' that is not a free variable"),
    ({"start": {"sigma": np.nan}}, ValueError, "non-finite"),
]


@pytest.mark.parametrize("kwargs,error,match", BAD_CONSTRUCTOR)
def test_bad_constructor_arguments(regression_model, kwargs, error, match):
    with pytest.raises(error, match=match):
        _fit(regression_model, inf_kwargs=kwargs)


BAD_FIT = [
    ({"learning_rate": 0.0}, ValueError, "learning_rate must be positive"),
    ({"learning_rate": -0.1}, ValueError, "learning_rate must be positive"),
    ({"learning_rate": float("nan")}, ValueError, "learning_rate must be a positive finite"),
    ({"learning_rate": float("inf")}, ValueError, "learning_rate"),
    ({"learning_rate": (0.1, 0.0)}, ValueError, "learning_rate must be positive"),
    ({"learning_rate": (0.1, 0.1, 0.1)}, ValueError, "one number or a pair"),
    ({"learning_rate": "fast"}, ValueError, "learning_rate"),
    ({"clip_norm": 0.0}, ValueError, "clip_norm must be positive"),
    ({"optimizer": "lbfgs"}, ValueError, "Unknown optimizer 'lbfgs'"),
    ({"obj_optimizer": None}, TypeError, "unexpected keyword.*obj_optimizer"),
    ({"more_obj_params": [np.float64(1.0)]}, TypeError, "pytensor.shared"),
    ({"more_obj_params": [pytensor.shared(1.0, name="unused")]}, ValueError, "unused.*not used"),
    ({"start_sigma": {"slope": 1.0}}, NotImplementedError, "start_sigma.*jitter"),
    ({"backend": 3}, TypeError, "backend must be a string"),
]


@pytest.mark.parametrize("kwargs,error,match", BAD_FIT)
def test_bad_fit_arguments(regression_model, kwargs, error, match):
    with pytest.raises(error, match=match):
        _fit(regression_model, **kwargs)


def test_bad_n(regression_model):
    with pytest.raises(ValueError, match="non-negative integer"):
        _fit(regression_model, n=-1)


def test_discrete_and_empty_models():
    with pm.Model() as discrete:
        pm.Normal("mu", 0, 1)
        pm.Poisson("count", 3.0)
    with pytest.raises(pymc_gpf.ModelNotSupportedError, match=r"\['count'\] are discrete.*arginal"):
        _fit(discrete)
    with pm.Model() as empty:
        pm.Normal("y", 0, 1, observed=[0.0, 1.0])
    with pytest.raises(pymc_gpf.ModelNotSupportedError, match="no free variables"):
        _fit(empty)


def test_inf_kwargs_with_an_instance(regression_model):
    with pytest.raises(ValueError, match="pass them to the instance"):
        pm.fit(5, method=pymc_gpf.GPF(model=regression_model), inf_kwargs={"n_particles": 3})


def test_instance_for_another_model(regression_model):
    with pm.Model() as other:
        pm.Normal("z")
    with pytest.raises(ValueError, match="built for another model"):
        pm.fit(5, method=pymc_gpf.GPF(model=other), model=regression_model)


def test_non_finite_log_density_at_the_start_names_the_term():
    with pm.Model() as model:
        x = pm.Normal("x", 0, 1, shape=2)
        pm.Potential("wall", pt.switch(x[0] > 10.0, 0.0, -np.inf))
    with pytest.raises(pymc_gpf.InitialPointError, match=r"not finite for \['wall'\]"):
        _fit(model)


def test_divergence_names_the_variable_and_keeps_the_last_finite_state():
    """A too-large plain step on a stiff Gaussian blows up; the error names the variable and
    the approximation holds exactly the state after the last accepted step."""
    with pm.Model() as model:
        pm.Normal("stiff", 0, 0.01, shape=2)
        pm.Normal("easy", 0, 1)
    with pytest.raises(pymc_gpf.DivergenceError, match=r"diverged at step \d+.*\['stiff'\]") as err:
        _fit(model, n=1000, random_seed=0, learning_rate=0.5)
    approx = err.value.approx
    steps = len(approx.hist)
    assert 0 < steps < 1000 and np.isfinite(approx.hist).all()
    replay = _fit(model, n=steps - 1, random_seed=0, learning_rate=0.5)
    np.testing.assert_array_equal(approx.particles, replay.particles)


def test_divergence_into_zero_density_rolls_back_and_can_continue():
    """A step that jumps over a wall (log-density -inf) stops the fit naming the term; the
    kept state has a finite free energy and a smaller step continues to the exact answer."""
    with pm.Model() as model:
        x = pm.Normal("x", 0, 1, shape=2)
        pm.Potential("wall", pt.switch(x[0] < 4.0, 0.0, -np.inf))
    gpf = pymc_gpf.GPF(3, model=model, random_seed=1, start={"x": np.array([-3.5, 0.0])})
    # the first mean step moves -3.5 by +2.3 * 3.5, over the wall at 4
    with pytest.raises(pymc_gpf.DivergenceError, match=r"\['wall'\]") as err:
        pm.fit(100, method=gpf, learning_rate=2.3, progressbar=False)
    approx = err.value.approx
    assert approx is gpf.approx and np.isfinite(approx.hist).all()
    assert (approx.particles[:, 0] < 4.0).all()
    steps = len(approx.hist)
    approx.inference.fit(3000, learning_rate=0.1, progressbar=False)
    assert len(approx.hist) == steps + 3000
    m = approx.particles.mean(0)
    # no particle is past the wall, so the flow sees N(0, I) and D + 1 particles are exact
    np.testing.assert_allclose(m, 0.0, atol=1e-10)


def test_the_model_is_not_modified(regression_model):
    before = (
        dict(regression_model.named_vars),
        list(regression_model.free_RVs),
        list(regression_model.value_vars),
        regression_model.point_logps(),
        dict(regression_model.rvs_to_initial_values),
    )
    _fit(regression_model, n=20)
    after = (
        dict(regression_model.named_vars),
        list(regression_model.free_RVs),
        list(regression_model.value_vars),
        regression_model.point_logps(),
        dict(regression_model.rvs_to_initial_values),
    )
    assert before == after
