"""``pm.fit(method="ensemble")``: deep, Langevin and repulsive Langevin ensembles."""

from __future__ import annotations

import warnings

import numpy as np
import pymc as pm
import pytensor.tensor as pt
import pytest

from arviz_stats.base import array_stats

import pymc_gpf

from pymc_gpf.control import Series
from pymc_gpf.ensemble import control, flow
from pymc_gpf.ensemble import method as ensemble_method
from pymc_gpf.target import BatchedTarget

MU, SD = np.array([1.0, -0.5]), np.array([1.0, 0.8])


def _gaussian():
    with pm.Model() as model:
        pm.Normal("x", MU, SD)
    return model


def _two_modes(centre: float, sd: float):
    """An equal mixture of N(-centre, sd^2) and N(centre, sd^2) in one dimension."""
    with pm.Model() as model:
        x = pm.Flat("x")
        pm.Potential(
            "mixture",
            pt.logsumexp(pt.stack([pm.logp(pm.Normal.dist(m, sd), x) for m in (-centre, centre)])),
        )
    return model


@pytest.fixture(scope="module")
def langevin():
    model = _gaussian()
    with model:
        approx = pm.fit(method="ensemble", random_seed=3, progressbar=False)
    return model, approx


def test_langevin_draws_have_the_gaussian_moments_up_to_the_known_step_bias(langevin):
    """Mean within 4 Monte Carlo standard errors of ``mu``; variance within 4 of the
    preconditioned unadjusted scheme's stationary variance at the frozen step and
    preconditioner (``flow.ula_gaussian_covariance``, at most 5 % above ``sigma^2`` by the
    step rule)."""
    _, approx = langevin
    assert approx.outcome.converged, approx.outcome.message
    state = approx.inference.control_state
    draws = approx.draws  # (particles, draws, D)
    assert draws.shape[0] == 20 and state.burn_in is not None
    chains = np.moveaxis(draws, -1, 0)  # (D, chain, draw)
    ess = array_stats.ess(chains, chain_axis=-2, draw_axis=-1, method="mean")
    mean = draws.mean(axis=(0, 1))
    np.testing.assert_array_less(np.abs(mean - MU), 4 * SD / np.sqrt(ess))
    diagonal, factor = approx.preconditioner()
    preconditioner = np.diag(diagonal) + factor.T @ factor
    assert not np.allclose(preconditioner, np.eye(2))  # adapted to the ensemble
    covariance = flow.ula_gaussian_covariance(np.diag(SD**2), state.rate, preconditioner)
    expected = np.diag(covariance)
    assert np.all(expected <= SD**2 * 1.06)
    variance = draws.reshape(-1, 2).var(axis=0)
    # the variance of a sample variance of a Gaussian: 2 s^4 / ESS
    np.testing.assert_array_less(np.abs(variance - expected), 4 * expected * np.sqrt(2 / ess))


def test_the_preconditioned_scheme_has_the_stationary_covariance_of_the_formula():
    """``flow.ula_gaussian_covariance`` against the scheme itself, run in NumPy on a
    correlated Gaussian with a dense preconditioner and a large step (17 % bias):
    the empirical covariance of 400 000 steps within 3 %."""
    rng = np.random.default_rng(0)
    covariance = np.array([[1.0, 0.8], [0.8, 1.0]])
    precision = np.linalg.inv(covariance)
    preconditioner = np.array([[2.0, 0.5], [0.5, 0.5]])
    root = np.linalg.cholesky(preconditioner)
    eta = 0.3
    expected = flow.ula_gaussian_covariance(covariance, eta, preconditioner)
    chains, steps = 100, 4000
    theta, total = np.zeros((chains, 2)), np.zeros((2, 2))
    for i in range(steps + 200):
        drift = -theta @ precision @ preconditioner
        theta = theta + eta * drift + np.sqrt(2 * eta) * rng.standard_normal((chains, 2)) @ root.T
        if i >= 200:
            total += theta.T @ theta
    empirical = total / (chains * steps)
    assert np.max(np.abs(np.diag(expected) / np.diag(covariance) - 1)) > 0.1
    np.testing.assert_allclose(empirical, expected, rtol=0.03, atol=0.03)


def test_the_draws_are_chains_for_arviz(langevin):
    """sample(draws) is draws in total, as for the other methods: 2000 = 20 chains x 100."""
    _, approx = langevin
    tree = approx.sample(2000)
    x = tree.posterior["x"]
    assert x.sizes["chain"] == 20 and x.sizes["draw"] == 100
    rhat = array_stats.rhat(np.moveaxis(x.values, -1, 0), chain_axis=-2, draw_axis=-1)
    assert np.all(rhat < 1.05)
    assert tree["ensemble"].attrs["kind"] == "langevin" and tree["ensemble"].attrs["burn_in"] > 0
    # the other methods' PSIS options have no density of q to work with: said, not ignored
    for option in ({"psis": True}, {"regularize": True}):
        with pytest.raises(ValueError, match="no density"):
            approx.sample(2000, **option)


def test_the_fit_group_traces_the_objective_of_the_kind(langevin):
    """``mean_v`` on ``step`` is ``-mean log p`` at the particles (its last value at the
    final ones, recomputed here on the whole data set)."""
    _, approx = langevin
    fit = approx.sample(10)["fit"]
    assert fit.sizes["step"] == len(approx.hist)
    final = -np.mean(approx.log_density(approx.particles))
    np.testing.assert_allclose(fit["mean_v"].values[-1], final, rtol=1e-5)
    with pytest.raises(ValueError, match=r"no q to draw from.*point masses"):
        pymc_gpf.diagnose(approx)


def test_repulsion_towards_zero_is_the_langevin_ensemble():
    """The MMD term scales with lambda1: with lambda1 = 1e-9 the repulsive ensemble follows
    the Langevin ensemble's trajectories (same seed, same fixed step) to 1e-6."""
    model = _gaussian()
    fits = {}
    for kind in ("langevin", "repulsive"):
        with model:
            fits[kind] = pm.fit(
                150, method="ensemble", inf_kwargs={"kind": kind, "repulsion": 1e-9},
                learning_rate=0.05, random_seed=2, progressbar=False, backend="quick_c",
            )  # fmt: skip
    np.testing.assert_allclose(
        fits["repulsive"].particles, fits["langevin"].particles, rtol=0, atol=1e-6
    )
    with model:
        pushed = pm.fit(
            150, method="ensemble", inf_kwargs={"kind": "repulsive", "repulsion": 50.0},
            learning_rate=0.05, random_seed=2, progressbar=False, backend="quick_c",
        )  # fmt: skip
    # a strong repulsion spreads the ensemble beyond the Langevin one
    assert pushed.particles.std(axis=0).min() > fits["langevin"].particles.std(axis=0).max()


def test_a_deep_ensemble_stops_at_the_modes():
    model = _two_modes(3.0, 0.5)
    with model:
        approx = pm.fit(method="ensemble", inf_kwargs={"kind": "deep"}, random_seed=1,
                        progressbar=False)  # fmt: skip
    assert approx.outcome.converged and "mode" in approx.outcome.message
    x = approx.particles[:, 0]
    _, grad = BatchedTarget(model).compile_logp_dlogp()(approx.particles)
    # the stop: every particle's step eta g^2 < tol^2, and backtracking keeps eta >= 1/(2 L)
    # (L = 1/sd^2 near a mode), so |g| < tol sqrt(2 L) and the distance |g| / L to the mode
    curvature, tol = 1 / 0.5**2, 0.03
    assert np.max(np.abs(grad)) < tol * np.sqrt(2 * curvature)
    assert np.all(np.abs(np.abs(x) - 3.0) < tol * np.sqrt(2 / curvature))
    assert (x > 0).any() and (x < 0).any()
    tree = approx.sample()
    assert tree.posterior["x"].shape == (1, 20)  # the mixture of point masses


@pytest.mark.parametrize("kind", ["langevin", "repulsive"])
def test_the_langevin_kinds_put_half_the_mass_on_each_mode(kind):
    """Modes at +-1 with sd 0.5 (a barrier of 2 nats: the chains cross it): each mode gets
    half the draws to within 0.05."""
    with _two_modes(1.0, 0.5):
        approx = pm.fit(method="ensemble", inf_kwargs={"kind": kind}, random_seed=5,
                        progressbar=False)  # fmt: skip
    share = np.mean(approx.draws[..., 0] > 0)
    assert abs(share - 0.5) < 0.05, (share, approx.outcome.message)


def test_the_chains_start_at_the_posteriors_scale_not_the_models_units():
    """A regression on a predictor in the thousands with flat priors and known noise: the
    slope's posterior sd is about 1e-4 (closed form). The chains start around the initial
    point with the Gaussian fit's spread (about that sd), not with unit noise 10^4 sds
    wide, and the fit at defaults matches the exact posterior."""
    rng = np.random.default_rng(8)
    x = rng.uniform(1000, 5000, size=100)
    design = np.column_stack([np.ones_like(x), x])
    y = design @ [1.0, 0.002] + rng.normal(size=100)
    cov = np.linalg.inv(design.T @ design)  # sigma = 1, flat priors
    mean, sd = cov @ design.T @ y, np.sqrt(np.diag(cov))
    with pm.Model():
        beta = pm.Flat("beta", shape=2)
        pm.Normal("y", design @ beta, 1.0, observed=y)
        inference = pymc_gpf.Ensemble(random_seed=3)
        start = inference.approx.particles
        approx = pm.fit(method=inference, progressbar=False)
    spread = start.std(axis=0) / sd
    assert np.all((spread > 0.5) & (spread < 2.0)), spread
    draws = approx.draws.reshape(-1, 2)
    assert np.all(np.abs(draws.mean(axis=0) - mean) / sd < 0.1)
    assert np.all(np.abs(draws.std(axis=0) / sd - 1) < 0.1)
    assert approx.outcome.verdict == "trustworthy"


def test_chains_that_started_far_and_ran_out_of_steps_are_told_of_init_gaussian():
    """The initial point of a regression with a predictor in the thousands lies about 70 of
    the Gaussian fit's sds from it (the slope's posterior mean 0.002, sd about 1e-4, the
    intercept's correlated with it). Stopped during burn-in, the chains' log-density is far
    below the fit's typical values and the warning names ``init="gaussian"``; from an
    initial point a few sds away it does not."""
    rng = np.random.default_rng(8)
    x = rng.uniform(1000, 5000, size=100)
    design = np.column_stack([np.ones_like(x), x])
    y = design @ [1.0, 0.002] + rng.normal(size=100)
    cov = np.linalg.inv(design.T @ design)  # sigma = 1, flat priors
    mean = cov @ design.T @ y
    with pm.Model():
        beta = pm.Flat("beta", shape=2)
        pm.Normal("y", design @ beta, 1.0, observed=y)
        with pytest.warns(pymc_gpf.FitWarning, match="init='gaussian'"):
            far = pm.fit(5, method="ensemble", random_seed=3, progressbar=False)
        near_start = {"beta": mean + np.linalg.cholesky(cov) @ np.ones(2)}  # sqrt(2) sds
        with pytest.warns(pymc_gpf.FitWarning) as record:
            near = pm.fit(5, method="ensemble", random_seed=3, start=near_start,
                          progressbar=False)  # fmt: skip
    # q is the Gaussian fit of an exactly Gaussian posterior: the exact Mahalanobis distance
    exact = np.sqrt(mean @ np.linalg.solve(cov, mean))
    distance = far.inference.start_fit["initial_point_distance"]
    assert exact > 5 * ensemble_method.far_start(2) and abs(distance / exact - 1) < 0.05
    assert near.inference.start_fit["initial_point_distance"] < 3.0
    assert not any("init='gaussian'" in str(w.message) for w in record)
    assert far.outcome.reason == near.outcome.reason == "max_steps"
    below = far.inference._below_the_posterior()
    assert below is not None and below[0] < below[1]


def _far_intercept():
    """A regression with intercept 1000, slope 5 and unit noise (its scale unknown), 50 rows."""
    rng = np.random.default_rng(7)
    x = rng.normal(size=50)
    y = 1000.0 + 5.0 * x + rng.normal(size=50)
    with pm.Model() as model:
        b0, b1 = pm.Normal("b0", 0, 1e4), pm.Normal("b1", 0, 1e4)
        pm.Normal("y", b0 + b1 * x, pm.HalfNormal("s", 100), observed=y)
    return x, y, model


def test_a_fit_saved_before_its_rescue_resumes_exactly(tmp_path):
    """Saved during burn-in while the rescue is still to come, loaded and continued, the
    fit draws the same rescued chains (the Gaussian fit and the stream they come from are in
    the checkpoint) and its trace is the uninterrupted one's, bit for bit."""
    _, _, model = _far_intercept()
    options = {"method": "ensemble", "model": model, "random_seed": 1, "progressbar": False,
               "backend": "quick_c"}  # fmt: skip
    whole = pm.fit(400, **options)
    part = pm.fit(60, **options)
    assert part.inference.control_state.lost_below > -np.inf  # the rescue is still to come
    loaded = pymc_gpf.load(part.save(tmp_path / "fit.nc"), model=model)
    loaded.refine(340)
    assert loaded.inference.control_state.rescued == whole.inference.control_state.rescued == 20
    np.testing.assert_array_equal(np.asarray(loaded.hist), np.asarray(whole.hist))


def test_chains_lost_far_below_a_trustworthy_fit_start_again_at_its_draws():
    """A regression whose intercept (1000) lies 8 000 of the Gaussian fit's sds from the
    initial point, with a noise scale that grows to explain the residuals on the way: the
    chains crawl along that ridge and were still 1 000 intercept-units off after 10 000
    steps (not converged). Still far below the fit's typical log p when burn-in ends, they
    start again at its draws and sample the posterior: with flat priors ``beta | y`` is a
    Student-t at least squares, ``Var(beta_i) = RSS / (n - p - 3) [(X^T X)^(-1)]_ii``
    (``p(sigma)`` flat)."""
    x, y, model = _far_intercept()
    design = np.column_stack([np.ones(50), x])
    mean, rss = np.linalg.lstsq(design, y, rcond=None)[:2]
    sd = np.sqrt(rss[0] / (50 - 2 - 3) * np.diag(np.linalg.inv(design.T @ design)))
    approx = pm.fit(method="ensemble", model=model, random_seed=1, progressbar=False,
                    backend="quick_c")  # fmt: skip
    assert approx.inference.control_state.rescued == 20
    assert approx.outcome.converged and approx.outcome.verdict == "trustworthy"
    draws = approx.draws.reshape(-1, 3)[:, :2]
    assert np.all(np.abs(draws.mean(axis=0) - mean) / sd < 0.1)
    assert np.all(np.abs(draws.std(axis=0) / sd - 1) < 0.1)


def test_a_fixed_step_too_large_for_the_posterior_says_so():
    """A regression on 400 rows (coefficients' sds about 0.05) with the fixed step 0.01,
    twice the largest stable Euler step (2 sd^2): the moves grow until the drift's cap holds
    them, the chains sample nothing, and the verdict (not converged) names the fixed
    learning_rate, not the model, as the cause."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 2))
    with pm.Model():
        b = pm.Normal("b", 0, 1, shape=2)
        s = pm.HalfNormal("s", 1)
        pm.Normal("y", x @ b, s, observed=x @ [1.0, -0.5] + rng.normal(size=400))
        with pytest.warns(pymc_gpf.FitWarning, match=r"learning_rate \(0.01, 0.01\).* unstable"):
            approx = pm.fit(300, method="ensemble", learning_rate=0.01, random_seed=4,
                            progressbar=False, backend="quick_c")  # fmt: skip
    assert approx.outcome.verdict == "not converged"
    assert "pm.fit(method='ensemble')" in approx.outcome.verdict_message


def test_a_fixed_step_is_trusted_only_where_its_own_bias_is_small():
    """The unadjusted scheme at a fixed step ``eta`` has, on a Gaussian, the stationary
    variance ``sigma^2 / (1 - eta / (2 sigma^2))``: well-mixed chains at ``eta = 0.5 sigma^2``
    have sds 15 % too large and must not be called trustworthy; at ``eta = 0.05 sigma^2``
    (1.3 %) they are. One coordinate, N(0, 0.1^2), 2000 steps; the draws' sd is checked
    against the formula too."""
    with pm.Model() as model:
        pm.Normal("x", 0.0, 0.1)
    verdicts = {}
    for fraction in (0.5, 0.05):
        with model:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", pymc_gpf.FitWarning)
                approx = pm.fit(2000, method="ensemble", learning_rate=fraction * 0.01,
                                random_seed=5, progressbar=False)  # fmt: skip
        expected = np.sqrt(flow.ula_gaussian_variance(0.01, fraction * 0.01))
        draws = approx.draws[..., 0]
        ess = float(array_stats.ess(draws, chain_axis=0, draw_axis=1, method="sd"))
        assert abs(draws.std() / expected - 1) < 4 / np.sqrt(2 * ess)
        verdicts[fraction] = approx.outcome.verdict
    assert verdicts == {0.5: "family-limited", 0.05: "trustworthy"}


def test_a_superlinear_drift_does_not_throw_the_chains_out():
    """The unadjusted scheme is transient where the gradient grows faster than linearly
    (Mattingly et al. 2002): on ``p(x) ~ exp(-x^4 / 4)`` from |x| ~ 20 at the fixed step
    0.01 a move of 80 lands where the next is 2000 long, and the plain scheme overflowed
    (stalled, draws ~1e83). The capped drift brings the chains in; their ``E x^2`` matches
    ``2 Gamma(3/4) / Gamma(1/4)`` within 4 Monte Carlo errors plus the scheme's 1 % bias
    at this step."""
    from scipy.special import gamma

    with pm.Model():
        x = pm.Flat("x")
        pm.Potential("quartic", -(x**4) / 4)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", pymc_gpf.FitWarning)
            approx = pm.fit(3000, method="ensemble", learning_rate=0.01, random_seed=3,
                            progressbar=False, backend="quick_c",
                            inf_kwargs={"init": "initial_point", "init_scale": 20.0})  # fmt: skip
    assert approx.outcome.reason == "max_steps"
    squares = approx.draws[..., 0] ** 2
    ess = float(array_stats.ess(squares, chain_axis=0, draw_axis=1, method="mean"))
    exact = 2 * gamma(0.75) / gamma(0.25)
    assert abs(squares.mean() - exact) < 4 * squares.std() / np.sqrt(ess) + 0.01 * exact


def test_bad_options_are_clear_errors():
    model = _gaussian()
    with pytest.raises(ValueError, match="kind must be one of"):
        pymc_gpf.Ensemble("mcmc", model=model)
    with pytest.raises(ValueError, match="n_particles must be an integer >= 2"):
        pymc_gpf.Ensemble(n_particles=1, model=model)
    with pytest.raises(ValueError, match="temperature must be positive"):
        pymc_gpf.Ensemble(temperature=0.0, model=model)
    with model, pytest.raises(ValueError, match="drop learning_rate"):
        pm.fit(5, method="ensemble", inf_kwargs={"kind": "deep"}, learning_rate=0.1,
               progressbar=False)  # fmt: skip
    with pytest.raises(ValueError, match="precondition must be True or False"):
        pymc_gpf.Ensemble(precondition="yes", model=model)
    with pm.Model():
        data = pm.Minibatch(np.arange(100.0), batch_size=10)
        pm.Normal("y", pm.Normal("mu"), observed=data, total_size=100)
        with pytest.raises(ValueError, match="whole data set, or use kind='langevin'"):
            pm.fit(5, method="ensemble", inf_kwargs={"kind": "deep"}, progressbar=False)


def test_long_runs_thin_their_draws_to_bound_memory(monkeypatch):
    """With room for 300 draws of the 20 particles, the draws are thinned (``thin``
    doubles) and still have the Gaussian's moments within 4 Monte Carlo errors (variance:
    plus the 6 % step bias bound)."""
    monkeypatch.setattr(control, "MAX_STORED", 300 * 20 * 2)
    with _gaussian():
        approx = pm.fit(method="ensemble", inf_kwargs={"target_ess": 1000}, random_seed=3,
                        progressbar=False)  # fmt: skip
    thin = approx.inference.control_state.thin
    assert approx.outcome.converged and thin > 1
    assert len(approx.inference.control_state.draws) <= 300
    draws = approx.draws
    ess = array_stats.ess(np.moveaxis(draws, -1, 0), chain_axis=-2, draw_axis=-1, method="mean")
    np.testing.assert_array_less(np.abs(draws.mean(axis=(0, 1)) - MU), 4 * SD / np.sqrt(ess))
    variance = draws.reshape(-1, 2).var(axis=0)
    np.testing.assert_array_less(np.abs(variance / SD**2 - 1), 0.06 + 4 * np.sqrt(2 / ess))


@pytest.mark.filterwarnings("ignore:ENSEMBLE did not converge")
def test_a_saved_ensemble_continues_exactly(tmp_path):
    model = _gaussian()
    with model:
        approx = pm.fit(300, method="ensemble", random_seed=4, progressbar=False)
        path = approx.save(tmp_path / "ensemble.nc")
        loaded = pymc_gpf.load(path)
        approx.refine(60, progressbar=False)
        loaded.refine(60, progressbar=False)
    np.testing.assert_array_equal(loaded.particles, approx.particles)
    np.testing.assert_array_equal(loaded.hist, approx.hist)
    np.testing.assert_array_equal(loaded.draws, approx.draws)


def test_thinning_keeps_the_checks_geometric_in_steps(monkeypatch):
    """Draws of N = 2, D = 100 with room for 50 of them over 40 000 steps: the convergence
    checks come at least 4 D = 400 steps apart and then every 25 % of the run (in steps),
    however often the store thins; a model too large for the store still keeps draws."""
    monkeypatch.setattr(control, "MAX_STORED", 50 * 200)
    store, particles, checks = control.Draws(Series(), 1, 50), np.zeros((2, 100)), []
    for step in range(1, 40_001):
        store, due = store.add(step, particles, window=50)
        checks += [step] if due else []
    assert checks[0] >= 400 and len(store.draws) <= 50 and store.thin >= 512
    checks = np.asarray(checks)
    # at least 4 D steps apart (less a thinning's rounding), and once that is under a
    # quarter of the run, 25 % apart, not doubling with every thinning
    assert np.all(np.diff(checks) >= 0.9 * 400)
    late = checks[:-1] >= 1600
    assert np.all(np.diff(checks)[late] / checks[:-1][late] <= 0.3)
    monkeypatch.setattr(control, "MAX_STORED", 100)  # less than one draw
    store = control.Draws(Series(), 1, 50)
    for step in range(1, 200):
        store, _ = store.add(step, particles, window=50)
    assert control.MIN_STORED // 2 <= len(store.draws) <= control.MIN_STORED


@pytest.mark.parametrize("ndim", [1, 25, 1000])
def test_the_automatic_target_ess_bounds_the_largest_error_of_the_means(ndim):
    """At ``accuracy_ess(D)`` independent draws per coordinate, the largest error of the
    ``D`` means exceeds 0.08 sds in at most 5 % of fits (Bonferroni: just under 5 % for
    independent coordinates), and at a fifth of it far more often: 4 000 simulated fits."""
    rng = np.random.default_rng(ndim)
    ess = control.accuracy_ess(ndim)

    def misses(draws: int) -> float:
        errors = rng.standard_normal((4000, ndim)) / np.sqrt(draws)
        return float(np.mean(np.max(np.abs(errors), axis=1) > control.MEAN_ACCURACY))

    assert 0.03 < misses(ess) < 0.06
    assert misses(ess // 5) > 0.3


def test_particles_started_where_the_density_explodes_restart_during_burn_in():
    """A wall ``log p(x) = log N(x; 0, 1) - exp(exp(2 (x - 3)))`` and a bad initial value,
    3.5: of the automatic start (the initial point plus unit noise), a particle at x ~ 5
    sees V ~ 1e23 and a curvature that alone would set the step size of all to ~ 1e-25
    (an ARMA's non-invertible region does the same). It restarts from the best particle's
    state during burn-in (:func:`control.outlying`), and the draws' mean and sd match the
    density's, by quadrature, to within their Monte Carlo error."""
    with pm.Model() as model:
        x = pm.Normal("x", 0.0, 1.0, initval=3.5)
        pm.Potential("wall", -pt.exp(pt.exp(2.0 * (x - 3.0))))
    with model:
        approx = pm.fit(method="ensemble", random_seed=2, progressbar=False)
    settings = approx.inference.settings()
    assert approx.outcome.converged, approx.outcome.message
    assert settings["restarted_in_burn_in"] > 0
    grid = np.linspace(-8.0, 4.0, 200_001)
    density = np.exp(-(grid**2) / 2 - np.exp(np.exp(2.0 * (grid - 3.0))))
    density /= density.sum()
    mean = np.sum(grid * density)
    sd = np.sqrt(np.sum((grid - mean) ** 2 * density))
    draws = approx.draws[..., 0]
    # 4 Monte Carlo standard errors at the ESS reached, plus the unadjusted scheme's 5 %
    error = 4.0 / np.sqrt(settings["ess"])
    assert abs(draws.mean() - mean) < (error + 0.05) * sd
    assert abs(draws.std() / sd - 1) < 2 * error + 0.05


def test_only_particles_far_above_the_others_are_outliers():
    chains = np.random.default_rng(0).chisquare(25, 40) / 2  # V at the posterior's spread
    assert not control.outlying(chains).any()
    assert not control.outlying(np.r_[chains, chains.min() + 5.0]).any()  # a minor mode
    far = control.outlying(np.r_[chains, 1e117, np.inf, np.nan])
    assert far[-3:].all() and not far[:-3].any()
