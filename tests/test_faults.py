"""Faults and bad input, across the three methods.

Bad input raises a clear, specific error naming what to fix, and leaves the model as it was;
a divergent step keeps the last finite state, which ``refine`` continues with a smaller step;
an interrupted fit returns a usable approximation; the same seed gives bitwise-identical
particles, trace and draws on every backend; GPF's fixed points satisfy the theorems on
random Gaussian targets (property tests).
"""

import functools
import os
import subprocess
import sys

import numpy as np
import pymc as pm
import pytensor
import pytensor.tensor as pt
import pytest

from conftest import condition_spectrum, gaussian_target
from hypothesis import given, settings
from hypothesis import strategies as st
from methods import get, names
from pytensor.compile.mode import Mode

import pymc_gpf

from pymc_gpf.gpf import flow
from pymc_gpf.structure import Structure

# every method: bad input (models, start, init, step size), interrupts, seeds, the model
# left as it was; the fixed-step divergence semantics only where a divergence stops the fit
# (tests/methods.py: the ensembles' Langevin steps refuse a non-finite move themselves)
INPUT_METHODS = names()


def _fit(model, n=5, inf_kwargs=None, method="gpf", **kwargs):
    return pm.fit(n, method=method, model=model, inf_kwargs=inf_kwargs, progressbar=False, **kwargs)


def _snapshot(model):
    """What a fit must not change (the log-densities are compared once, in the last test)."""
    data = {
        name: np.array(var.get_value())
        for name, var in model.named_vars.items()
        if isinstance(var, pytensor.compile.SharedVariable)
    }
    return (
        dict(model.named_vars),
        list(model.free_RVs),
        list(model.value_vars),
        dict(model.rvs_to_values),
        dict(model.rvs_to_initial_values),
        {k: v.tolist() for k, v in data.items()},
    )


# --------------------------------------------------------------- options, per method
BAD_OPTIONS = [
    # (method, inf_kwargs, fit keywords, error, message)
    ("gpf", {"n_particles": 1}, {}, ValueError, "n_particles must be 'auto' or an integer >= 2"),
    ("gpf", {"n_particles": 2.5}, {}, ValueError, "n_particles"),
    ("gpf", {"n_particles": True}, {}, ValueError, "n_particles"),
    ("gpf", {"init_scale": 0.0}, {}, ValueError, "init_scale must be a positive"),
    ("gpf", {"init_scale": -1.0}, {}, ValueError, "init_scale"),
    ("gpf", {"init_scale": float("nan")}, {}, ValueError, "init_scale"),
    ("gpf", {"init_scale": float("inf")}, {}, ValueError, "init_scale must be finite"),
    ("gpf", {"structure": "banded"}, {}, ValueError, "Unknown structure 'banded'.*intercept"),
    ("gpf", {"structure": [["slope", "nope"]]}, {}, ValueError, "'nope'.*not a free variable"),
    ("gpf", {"structure": [["slope"], ["slope", "sigma"]]}, {}, ValueError, "more than one"),
    ("gpf", {"structure": "slope"}, {}, ValueError, "Unknown structure"),
    ("gpf", {"structure": [["slope"], []]}, {}, ValueError, "empty block"),
    ("gpf", {"initial_particles": np.zeros((3, 2))}, {}, ValueError, r"shape \(N, 3\)"),
    ("gpf", {"initial_particles": np.ones((3, 3))}, {}, ValueError, "identical along"),
    ("gf", {"rank": 0}, {}, ValueError, "rank must be an integer between 1 and D = 3"),
    ("gf", {"rank": 4}, {}, ValueError, "rank must be an integer between 1 and D = 3"),
    ("gf", {"rank": 2.0}, {}, ValueError, "rank must be an integer"),
    ("gf", {"rank": 2, "structure": "diagonal"}, {}, ValueError, "rank applies to 'full'"),
    (
        "gf",
        {"draws_per_step": 0},
        {},
        ValueError,
        "draws_per_step must be 'auto' or an integer >= 1",
    ),
    ("gf", {"init_scale": 0.0}, {}, ValueError, "init_scale must be positive"),
    ("gf", {"init_scale": float("nan")}, {}, ValueError, "init_scale must be a positive finite"),
    ("gf", {"structure": "banded"}, {}, ValueError, "Unknown structure 'banded'"),
    ("gf", {"structure": "hierarchical"}, {}, ValueError, "no free variable whose coordinates"),
    ("gpf", {"structure": "hierarchical"}, {}, ValueError, "no free variable whose coordinates"),
    ("wvgd", {"n_particles": 0}, {}, ValueError, "n_particles must be an integer >= 1"),
    ("wvgd", {"n_particles": 2.5}, {}, ValueError, "n_particles must be an integer"),
    (
        "wvgd",
        {"draws_per_particle": 0},
        {},
        ValueError,
        "draws_per_particle must be an integer >= 1",
    ),
    ("wvgd", {"init_scale": -1.0}, {}, ValueError, "init_scale must be positive"),
    ("wvgd", {"weight_memory": 0.5}, {}, ValueError, "weight_memory must be >= 1"),
    ("wvgd", {"initial_particles": np.zeros((2, 2))}, {}, ValueError, r"shape \(J, 3\)"),
    ("wvgd", {"initial_particles": [[0.0, np.nan, 1.0]]}, {}, ValueError, "non-finite"),
    ("ensemble", {"kind": "mala"}, {}, ValueError, "kind must be one of"),
    ("ensemble", {"n_particles": 1}, {}, ValueError, "n_particles must be an integer >= 2"),
    ("ensemble", {"thin": 0}, {}, ValueError, "thin must be a positive integer"),
    ("ensemble", {"bandwidth": -1.0}, {}, ValueError, "bandwidth must be positive"),
    ("ensemble", {"kind": "deep"}, {"learning_rate": 0.01}, ValueError, "drop learning_rate"),
    *[(m, {"init": "random"}, {}, ValueError, "init must be one of") for m in INPUT_METHODS],
    # an unknown inf_kwargs key: the valid ones and the closest
    ("gpf", {"n_particle": 8}, {}, TypeError, "no option 'n_particle'. Did you mean 'n_particles'"),
    ("ensemble", {"bogus": 1}, {}, TypeError, r"no option 'bogus'\. Its options are: bandwidth"),
    *[
        (m, {"start": {"slope": [1.0, 2.0]}}, {}, ValueError, r"start\['slope'\] has shape")
        for m in INPUT_METHODS
    ],
    *[
        (m, {"start": {"nope": 1.0}}, {}, KeyError, "'nope' that is not a free")
        for m in INPUT_METHODS
    ],
    *[(m, {"start": {"sigma": np.nan}}, {}, ValueError, "non-finite") for m in INPUT_METHODS],
    *[
        (m, {}, {"learning_rate": 0.0}, ValueError, "learning_rate must be pos")
        for m in INPUT_METHODS
    ],
    ("gpf", {}, {"learning_rate": -0.1}, ValueError, "learning_rate must be positive"),
    ("gf", {}, {"learning_rate": float("nan")}, ValueError, "learning_rate must be a positive"),
    ("wvgd", {}, {"learning_rate": float("inf")}, ValueError, "learning_rate"),
    ("gpf", {}, {"learning_rate": (0.1, 0.0)}, ValueError, "learning_rate must be positive"),
    ("gf", {}, {"learning_rate": (0.1, 0.1, 0.1)}, ValueError, "one number or a pair"),
    ("wvgd", {}, {"learning_rate": "fast"}, ValueError, "learning_rate"),
    ("gpf", {}, {"clip_norm": 0.0}, ValueError, "clip_norm must be positive"),
    ("gf", {}, {"optimizer": "lbfgs"}, ValueError, "Unknown optimizer 'lbfgs'"),
    ("wvgd", {}, {"obj_optimizer": None}, TypeError, "unexpected keyword.*obj_optimizer"),
    ("gpf", {}, {"more_obj_params": [np.float64(1.0)]}, TypeError, "pytensor.shared"),
    ("gf", {}, {"more_obj_params": [pytensor.shared(1.0, name="unused")]}, ValueError, "unused"),
    ("gpf", {}, {"start_sigma": {"slope": 1.0}}, NotImplementedError, "start_sigma.*init_scale"),
    ("wvgd", {}, {"backend": 3}, TypeError, "backend must be a string"),
    ("gf", {}, {"n": -1}, ValueError, "n .the number of steps. must be a non-negative integer"),
]


@pytest.mark.parametrize("method,inf_kwargs,fit_kwargs,error,match", BAD_OPTIONS)
def test_bad_options(regression_model, method, inf_kwargs, fit_kwargs, error, match):
    before = _snapshot(regression_model)
    fit_kwargs = dict(fit_kwargs)
    n = fit_kwargs.pop("n", 5)
    with pytest.raises(error, match=match):
        _fit(regression_model, n, inf_kwargs, method, **fit_kwargs)
    assert _snapshot(regression_model) == before


# ---------------------------------------------------------------- models, per method
def _discrete():
    with pm.Model() as model:
        pm.Normal("mu", 0, 1)
        pm.Poisson("count", 3.0)
    return model


def _empty():
    with pm.Model() as model:
        pm.Normal("y", 0, 1, observed=[0.0, 1.0])
    return model


def _nan_minibatch():
    with pm.Model() as model:
        mu = pm.Normal("mu")
        pm.Normal(
            "y",
            mu,
            1,
            observed=pm.Minibatch(np.array([0.0, np.nan, 1.0]), batch_size=2),
            total_size=3,
        )
    return model


def _minibatch_without_total_size():
    with pm.Model() as model:
        mu = pm.Normal("mu")
        pm.Normal("y", mu, 1, observed=pm.Minibatch(np.arange(10.0), batch_size=2))
    return model


def _wall():
    with pm.Model() as model:
        x = pm.Normal("x", 0, 1, shape=2)
        pm.Potential("wall", pt.switch(x[0] > 10.0, 0.0, -np.inf))
    return model


def _wall_off_start():
    # the initial point itself is outside: found before the step is compiled
    with pm.Model() as model:
        x = pm.Normal("x", 0, 1, shape=2)
        pm.Potential("wall", pt.switch(x[0] > 0.5, 0.0, -np.inf))
    return model


BAD_MODELS = [
    (_discrete, pymc_gpf.ModelNotSupportedError, r"\['count'\] are discrete.*arginal"),
    (_empty, pymc_gpf.ModelNotSupportedError, "no free variables"),
    (_nan_minibatch, pymc_gpf.ModelNotSupportedError, "observed data of 'y' contain NaN"),
    (_minibatch_without_total_size, pymc_gpf.ModelNotSupportedError, "no total_size.*'y'"),
    (_wall, pymc_gpf.InitialPointError, r"cannot start.*not finite for \['wall'\]"),
    (_wall_off_start, pymc_gpf.InitialPointError, r"initial point.*\['wall'\].*`start`"),
]


@pytest.mark.parametrize("method", INPUT_METHODS)
@pytest.mark.parametrize("build,error,match", BAD_MODELS, ids=lambda v: getattr(v, "__name__", ""))
def test_bad_models(method, build, error, match):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # PyMC's own total_size warning
        model = build()
    before = _snapshot(model)
    with pytest.raises(error, match=match):
        _fit(model, 5, method=method)
    assert _snapshot(model) == before


def test_unknown_method_and_instances(regression_model):
    with pytest.raises(KeyError, match=r"advi.*gpf|gpf.*advi"):
        pm.fit(10, method="nonsense", model=regression_model)
    with pytest.raises(ValueError, match="pass them to the instance"):
        pm.fit(5, method=pymc_gpf.GF(model=regression_model), inf_kwargs={"draws_per_step": 3})
    with pm.Model() as other:
        pm.Normal("z")
    with pytest.raises(ValueError, match="built for another model"):
        pm.fit(5, method=pymc_gpf.WVGD(model=other), model=regression_model)


# ------------------------------------------------------------------------ divergence
def test_divergence_names_the_variable_and_keeps_the_last_finite_state():
    """Plain descent on a N(0, 0.01^2) coordinate is stable only for steps below ~2e-4; a
    step of 0.5 multiplies its spread by ~5000 per step until it overflows. The error names
    the variable (and, where the overflow reached the others through the particles' shared
    affine update in that step, they too: BLAS-dependent) and the approximation holds
    exactly the state after ``len(hist)`` steps."""
    with pm.Model() as model:
        pm.Normal("stiff", 0, 0.01, shape=2)
        pm.Normal("easy", 0, 1)
    named = r"diverged at step \d+.*\[[^]]*'stiff'[^]]*\]"
    with pytest.raises(FloatingPointError, match=named) as err:
        _fit(model, 1000, random_seed=0, learning_rate=0.5)
    approx = err.value.approx
    steps = len(approx.hist)
    assert 0 < steps < 1000 and np.isfinite(approx.hist).all()
    replay = _fit(model, steps, random_seed=0, learning_rate=0.5)
    np.testing.assert_array_equal(approx.particles, replay.particles)


@pytest.fixture(scope="module")
def counts():
    """Poisson counts with a log link: from log_rate = 0 the gradient is ~5000, so a unit
    step lands where exp overflows."""
    with pm.Model() as model:
        log_rate = pm.Normal("log_rate", 0, 10)
        pm.Poisson("counts", pt.exp(log_rate), observed=np.full(5, 1000))
    return model


@pytest.mark.parametrize("method", names("divergence_error"))
def test_after_a_divergence_refine_continues_with_a_smaller_step(counts, method):
    """The overflowing step is rolled back: the error names the term, the approximation
    keeps the last state with a finite free energy (the state after ``len(hist)`` steps,
    replayed exactly), and ``refine`` with a small step goes on to the posterior (mean
    log(1000) = 6.91, sd 0.014)."""
    kwargs = {"learning_rate": 1.0, "optimizer": "sgd", "random_seed": 0}
    if method == "wvgd":  # in its Gaussian fit's coordinates this step does not overflow
        kwargs["inf_kwargs"] = {"whiten": False}
    with pytest.raises(FloatingPointError, match=r"diverged at step \d+.*\['counts'\]") as err:
        _fit(counts, 100, method=method, **kwargs)
    assert isinstance(err.value, pymc_gpf.DivergenceError)
    approx = err.value.approx
    steps = len(approx.hist)
    assert np.isfinite(approx.hist).all() and approx.inference.state.i == steps
    replay = _fit(counts, steps, method=method, **kwargs)
    for kept, replayed in zip(approx.params, replay.params, strict=True):
        np.testing.assert_array_equal(kept.get_value(), replayed.get_value())
    approx.refine(3000, learning_rate=1e-4)
    assert len(approx.hist) == steps + 3000 and np.isfinite(approx.hist).all()
    assert approx.inference.settings()["learning_rate"] == (1e-4, 1e-4)
    draws = approx.sample(2000, random_seed=1)["posterior"]["log_rate"].values
    assert draws.mean() == pytest.approx(np.log(1000), abs=0.01)


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
    approx.refine(3000, learning_rate=0.1)
    assert len(approx.hist) == steps + 3000
    assert np.all(np.diff(approx.hist[steps:]) <= 1e-12)  # F~ never increases (App. D)
    # no particle is past the wall, so the flow sees N(0, I) and D + 1 particles are exact
    np.testing.assert_allclose(approx.particles.mean(0), 0.0, atol=1e-10)


def test_a_fit_still_travelling_to_a_far_posterior_suggests_starting_at_the_mode():
    """A prior centred far from where the data put the parameter: the automatic step moves
    q by about one of its sds a step. A fit that ends on its way (prior centre 20, 120
    steps: 140 posterior sds to go, never a hundred trust radii from its target for a
    hundred steps) names the travelling mean and init='map'. From 10^4 away the steps are
    cut short by the trust region and the fit crawls: it starts again from the MAP by
    itself, and converges to the conjugate posterior mean (within 0.1 sd), as init='map'
    does."""
    y = np.random.default_rng(1).normal(0.1, 1.0, 50)

    def model_centred_at(centre):
        with pm.Model() as model:
            theta = pm.Normal("theta", centre, 1e4)
            pm.Normal("y", theta, 1.0, observed=y)
        return model

    match = "mean of theta was still travelling: it moved .* init='map'"
    with pytest.warns(pymc_gpf.FitWarning, match=match):
        pm.fit(120, method="gf", model=model_centred_at(20.0), random_seed=1, progressbar=False)
    model = model_centred_at(1e4)
    precision = len(y) + 1e-8
    mean, sd = (y.sum() + 1e4 * 1e-8) / precision, precision**-0.5
    for kwargs in ({}, {"init": "map"}):
        approx = pm.fit(method="gf", model=model, random_seed=1, progressbar=False,
                        inf_kwargs=kwargs)  # fmt: skip
        assert approx.outcome.converged
        assert approx.inference.control_state.restarted == (0 if kwargs else 2)
        draws = approx.sample(4000, random_seed=1).posterior["theta"].values
        assert abs(draws.mean() - mean) < 0.1 * sd


def test_a_start_where_only_the_gradient_is_not_finite_is_jittered():
    """``phi ** k`` for k = 0, 1, 2 has the gradient ``k phi^(k - 1)``, ``0 * inf`` at
    ``phi = 0``: the initial point of ``Uniform(-1, 1)``, where GF's every step evaluates
    (the centre of its spherical-radial rules). GF raised InitialPointError there (and WVGD,
    which starts with it), though log p is finite and the singularity has measure zero;
    PyMC's samplers jitter their start. The fit now starts from the initial point moved by
    a small jitter, says so, and reaches the posterior (mean and sd of ``phi`` from
    quadrature of the exact log-density)."""
    rng = np.random.default_rng(14)
    y = rng.normal(1.0 + 0.3 + 0.3**2, 1.0, 200)
    with pm.Model() as model:
        phi = pm.Uniform("phi", -1, 1)
        pm.Normal("y", (phi ** pt.arange(3)).sum(), 1.0, observed=y)
    grid = np.linspace(-0.999, 0.999, 20001)
    log_post = -0.5 * ((y[None, :] - (1 + grid + grid**2)[:, None]) ** 2).sum(axis=1)
    weights = np.exp(log_post - log_post.max())
    weights /= weights.sum()
    mean = weights @ grid
    sd = np.sqrt(weights @ (grid - mean) ** 2)
    approx = pm.fit(method="gf", model=model, random_seed=1, progressbar=False)
    assert approx.outcome.converged
    assert "not finite for ['phi'] at the initial point" in approx.outcome.message
    draws = approx.sample(10_000, random_seed=1).posterior["phi"].values.ravel()
    assert abs(draws.mean() - mean) < 0.1 * sd
    assert draws.std() == pytest.approx(sd, rel=0.1)


@pytest.mark.parametrize("method", ["gpf", "gf", "ensemble"])
def test_a_start_whose_points_reach_an_underflowing_likelihood_is_narrowed(method):
    """PyMC's censored Weibull log-likelihood is -inf where (c / beta)^k passes ~745 (its
    survival term underflows), just below the initial point here (finite there, -inf 0.05
    lower). The default start's points straddle that edge: GPF and the Langevin ensemble
    raised InitialPointError and GF a LAPACK error from the NaN in its step. The automatic
    fit now starts 10x narrower (at most three times), says so, and reaches the posterior:
    mean and sd of ``a`` from quadrature of the exact log-density (a near-Gaussian 1-D
    posterior; the ensemble's draws, whose Monte Carlo error its ESS >= 400 bounds by
    0.05 sds and 3.5 %, within a third of the tolerances below)."""
    rng = np.random.default_rng(0)
    c, k = 26.5, 2.0
    t = np.minimum(20.0 * rng.weibull(k, 40), c)
    with pm.Model() as model:
        a = pm.Normal("a", 0, 5)
        weibull = pm.Weibull.dist(alpha=k, beta=pt.exp(a))
        pm.Censored("t", weibull, lower=None, upper=c, observed=t)
    grid = np.linspace(2.0, 4.0, 4001)
    z = t[None, :] / np.exp(grid)[:, None]
    log_lik = np.where(t < c, np.log(k) - grid[:, None] + (k - 1) * np.log(z) - z**k, -(z**k))
    log_post = log_lik.sum(axis=1) - grid**2 / 50
    weights = np.exp(log_post - log_post.max())
    weights /= weights.sum()
    mean = weights @ grid
    sd = np.sqrt(weights @ (grid - mean) ** 2)
    approx = pm.fit(method=method, model=model, random_seed=1, progressbar=False)
    assert approx.outcome.converged and "narrower q" in approx.outcome.message
    inference = approx.inference
    # resolved stays as built; the narrowing is on record beside it (and saved with the fit)
    default = inference.resolved.init_scale
    assert default == (1.0 if method == "ensemble" else 0.1)
    assert inference.options_in_effect.init_scale < default
    assert inference.constructor_options()["init_scale"] < default
    if method == "ensemble":
        draws = approx.sample(random_seed=1).posterior["a"].values.ravel()
        assert abs(draws.mean() - mean) < 0.15 * sd
        assert draws.std() == pytest.approx(sd, rel=0.1)
        return
    assert abs(float(approx.mean.eval()[0]) - mean) < 0.05 * sd
    assert float(approx.std.eval()[0]) == pytest.approx(sd, rel=0.03)


def test_refine_needs_a_fit_and_valid_steps(regression_model):
    gpf = pymc_gpf.GPF(4, model=regression_model)
    with pytest.raises(TypeError, match="fit"):
        gpf.refine(5)
    approx = gpf.fit(2, progressbar=False)
    with pytest.raises(ValueError, match="learning_rate must be positive"):
        approx.refine(5, learning_rate=-1.0)
    with pytest.raises(ValueError, match="non-negative integer"):
        approx.refine(-5)
    assert len(approx.hist) == 2


# ------------------------------------------------------- interrupts, seeds, backends
@pytest.mark.parametrize("method", names())
def test_keyboard_interrupt_returns_a_usable_fit(regression_model, method):
    def interrupt_at_9(approx, hist, i):
        if i == 9:
            raise KeyboardInterrupt

    approx = _fit(regression_model, 100, method=method, callbacks=[interrupt_at_9])
    assert len(approx.hist) == 9 and np.isfinite(approx.hist).all()
    assert approx.inference.state.i == 9
    posterior = approx.sample(5, random_seed=1)["posterior"]
    # an ensemble: a chain per particle, ceil(5 / chains) draws each (at least one)
    assert posterior.sizes["draw"] == (
        -(-5 // posterior.sizes["chain"]) if get(method).chains else 5
    )
    approx.refine(3)
    assert len(approx.hist) == 12


@pytest.mark.parametrize("backend", [None, "c"])
@pytest.mark.parametrize("method", names("reproducible"))
def test_same_seed_gives_bitwise_identical_results(regression_model, method, backend):
    def run():
        approx = _fit(regression_model, 30, method=method, random_seed=7, backend=backend)
        draws = approx.sample(20, random_seed=3, include_transformed=True)["posterior"]
        return approx, draws

    (a, draws_a), (b, draws_b) = run(), run()
    for x, y in zip(a.params, b.params, strict=True):
        np.testing.assert_array_equal(x.get_value(), y.get_value())
    np.testing.assert_array_equal(a.hist, b.hist)
    for name in draws_a.data_vars:
        np.testing.assert_array_equal(draws_a[name].values, draws_b[name].values)
    other = _fit(regression_model, 30, method=method, random_seed=8, backend=backend)
    assert not np.array_equal(other.hist, a.hist)


# a fit in a fresh process on a small logistic regression, through numba (every method's bits
# on one process, every backend: test_same_seed_gives_bitwise_identical_results)
_FIT_IN_A_FRESH_PROCESS = """
import hashlib, numpy as np, pymc as pm, pytensor.tensor as pt, pymc_gpf
rng = np.random.default_rng(0)
x = rng.normal(size=(200, 4))
y = rng.random(200) < 1 / (1 + np.exp(-x @ [0.5, -1.0, 0.2, 0.0]))
with pm.Model():
    w = pm.Normal("w", 0, 1, shape=4)
    pm.Bernoulli("y", logit_p=pt.as_tensor(x) @ w, observed=y)
    # a fixed step compiles with PyMC's default backend, numba, whose on-disk cache is what
    # differed (the automatic fits' quick_c loads the module it compiled in either case)
    fits = [pm.fit(30, method="gpf", learning_rate=0.01, random_seed=3, progressbar=False)]
digest = hashlib.sha256()
for approx in fits:
    digest.update(np.asarray(approx.hist).tobytes())
    for p in approx.params:
        digest.update(np.asarray(p.get_value()).tobytes())
print(digest.hexdigest())
"""


def test_same_seed_gives_the_same_bits_on_a_cold_and_a_warm_cache(tmp_path):
    """Numba compiling the steps in the process (empty cache) and loading them from its
    on-disk cache gave different floating-point results under fast-math; the steps are
    compiled without it."""
    env = dict(os.environ, PYTENSOR_FLAGS=f"base_compiledir={tmp_path}")

    def run() -> str:
        out = subprocess.run(
            [sys.executable, "-c", _FIT_IN_A_FRESH_PROCESS],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        return out.stdout.strip().splitlines()[-1]

    cold = run()
    assert any((tmp_path / "numba").iterdir()), "the first run did not fill the cache"
    assert run() == cold


@pytest.mark.parametrize("method", names())
def test_the_model_is_not_modified(regression_model, method):
    before = (_snapshot(regression_model), regression_model.point_logps())
    _fit(regression_model, 20, method=method)
    assert (_snapshot(regression_model), regression_model.point_logps()) == before


# -------------------------------------------------- property tests on Gaussian targets
@functools.cache
def _gaussian_step(n: int, d: int):
    """One GPF step (eq. 13, plain mean step) and F~ on ``N(mu, Lambda^-1)``, built from the
    package's pure flow functions and compiled without C (these graphs are tiny)."""
    x = pt.matrix("x", shape=(n, d))
    mu, precision, eta = pt.vector("mu"), pt.matrix("precision"), pt.scalar("eta")
    grads = pt.dot(x - mu, precision)
    logp = -0.5 * pt.sum(grads * (x - mu), axis=1)
    structure = Structure("full", d, (np.arange(d),))
    _, z = flow.centre(x)
    shift = flow.mean_shift(z, grads, structure)
    new = x - eta * shift - eta * flow.linear_flow(z, grads, structure)
    free_energy = flow.free_energy(logp, z, structure)
    mode = Mode(linker="py", optimizer="fast_compile")
    return pytensor.function([x, mu, precision, eta], [new, free_energy], mode=mode)


@settings(max_examples=15, deadline=None, derandomize=True)
@given(
    d=st.integers(2, 6),
    kappa=st.floats(1.0, 10.0),
    extra=st.integers(-3, 2),
    seed=st.integers(0, 2**16),
)
def test_gpf_fixed_points_satisfy_the_theorems(d, kappa, extra, seed):
    """Random D, condition number and N (below and above D + 1): F~ never increases (App.
    D, steps at a quarter of the stability bound 2/(kappa + 1/kappa) and of 2 s_min), the
    mean converges to mu, and at the fixed point every non-zero eigenpair of C is one of
    Sigma (Theorems 1, 3): C = Sigma when N >= D + 1; F~ = -log Z there."""
    n = max(2, d + 1 + extra)
    spectrum = condition_spectrum(d, kappa) * 10.0  # eigenvalues from 1 to kappa
    mu, cov = gaussian_target(d, spectrum, seed)
    precision = np.linalg.inv(cov)
    eta = 0.25 * min(2.0 / (kappa + 1.0 / kappa), 2.0 * spectrum.min())
    x = mu + np.random.default_rng(seed).normal(size=(n, d))
    step = _gaussian_step(n, d)
    trace = []
    for _ in range(int(30 * kappa / eta) + 1000):  # the mean's rate is eta / kappa
        x, free_energy = step(x, mu, precision, eta)
        trace.append(float(free_energy))
    trace = np.array(trace)
    assert np.all(np.diff(trace) <= 1e-10 * np.maximum(1.0, np.abs(trace[:-1])))
    np.testing.assert_allclose(x.mean(0), mu, atol=1e-6)
    z = x - x.mean(0)
    c = z.T @ z / n
    values, vectors = np.linalg.eigh(c)
    fitted = values > 1e-8 * values.max()
    assert fitted.sum() == min(n - 1, d)
    u, lam = vectors[:, fitted], values[fitted]
    np.testing.assert_allclose(cov @ u, u * lam, atol=1e-6 * spectrum.max())
    if n >= d + 1:
        np.testing.assert_allclose(c, cov, atol=1e-6 * spectrum.max())
        log_z = 0.5 * d * np.log(2 * np.pi) + 0.5 * np.linalg.slogdet(cov)[1]
        assert trace[-1] == pytest.approx(-log_z, abs=1e-8)


@pytest.mark.parametrize(
    ("method", "old", "new", "value"),
    [
        ("gpf", "jitter", "init_scale", 0.3),
        ("gf", "n_samples", "draws_per_step", 6),
        ("wvgd", "n_samples", "draws_per_particle", 7),
    ],
)
def test_renamed_options_still_work_with_a_warning(regression_model, method, old, new, value):
    cls = pymc_gpf.registry.METHODS[method]
    with pytest.warns(FutureWarning, match=f"{old}=.*is now.*{new}="):
        inference = cls(model=regression_model, random_seed=1, **{old: value})
    assert getattr(inference.config, new) == value
    assert inference.constructor_options()[new] == value
    with pytest.raises(TypeError, match=f"both {old}="):
        cls(model=regression_model, **{old: value, new: 2 * value})
    # a fit saved by an earlier release names the old option: it loads silently
    saved = {k: v for k, v in inference.constructor_options().items() if k != new}
    rebuilt = cls.from_options(regression_model, {**saved, old: value})
    assert getattr(rebuilt.config, new) == value
