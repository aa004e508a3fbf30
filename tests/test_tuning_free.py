"""Fits that need no tuning: antithetic clouds, backtracking, stopping rules, minibatches.

The default ``pm.fit(method=...)`` uses natural-gradient steps whose size adapts by itself
(:mod:`pymc_gpf.stepsize`), stops by itself (:mod:`pymc_gpf.control`) and starts GPF from
an antithetic, exactly whitened cloud (:mod:`pymc_gpf.clouds`). Every number asserted here
comes from a closed form (Gaussian expectations of polynomials, Gaussian and conjugate
posteriors, Algorithm 2 written out in NumPy) or from a stated property of the rule.
"""

import warnings

import numpy as np
import pymc as pm
import pytensor.tensor as pt
import pytest

from conftest import (
    condition_spectrum,
    eight_schools,
    gaussian_target,
    log_gamma,
    moments,
    mvnormal_model,
)
from methods import names
from scipy import optimize

import pymc_gpf

from pymc_gpf.clouds import antithetic_cloud, matching_cloud
from pymc_gpf.control import Deterministic, Stochastic
from pymc_gpf.gaussian import LOG_2PI_E


# ---------------------------------------------------------------------------- clouds
def _cubic(d, rng, coefficients=False):
    """A random polynomial of degree 3 and its expectation under N(m, C) in closed form."""
    a = rng.normal(size=d)
    b = rng.normal(size=(d, d))
    c = rng.normal(size=(d, d, d))

    def value(x):
        return x @ a + np.einsum("ni,ij,nj->n", x, b, x) + np.einsum("ni,nj,nk,ijk->n", x, x, x, c)

    def expectation(m, cov):
        second = cov + np.outer(m, m)
        third = (
            np.einsum("i,j,k->ijk", m, m, m)
            + np.einsum("i,jk->ijk", m, cov)
            + np.einsum("j,ik->ijk", m, cov)
            + np.einsum("k,ij->ijk", m, cov)
        )
        return m @ a + np.sum(b * second) + np.sum(c * third)

    return (value, expectation, (a, b, c)) if coefficients else (value, expectation)


def test_antithetic_whitened_cloud_integrates_cubics_exactly():
    """Any affine image of the cloud averages every cubic exactly under the Gaussian with
    the cloud's mean and covariance; a random cloud of the same size does not."""
    rng = np.random.default_rng(0)
    d, n = 4, 12
    value, expectation = _cubic(d, rng)
    m, factor = rng.normal(size=d), rng.normal(size=(d, d))
    cloud = m + antithetic_cloud(n, d, rng) @ factor.T
    np.testing.assert_allclose(cloud.mean(0), m, atol=1e-12)
    np.testing.assert_allclose(moments(cloud)[1], factor @ factor.T, atol=1e-12)
    exact = expectation(m, factor @ factor.T)
    assert value(cloud).mean() == pytest.approx(exact, rel=1e-12)
    random = m + rng.normal(size=(n, d)) @ factor.T
    assert abs(value(random).mean() - expectation(*moments(random))) > 1e-3 * abs(exact)


def test_matching_cloud_is_an_independent_rule_for_the_same_gaussian():
    rng = np.random.default_rng(1)
    z = rng.normal(size=(10, 3)) @ rng.normal(size=(3, 3))
    z -= z.mean(0)
    other = matching_cloud(z, 8, rng) @ z
    np.testing.assert_allclose(other.mean(0), 0.0, atol=1e-12)
    np.testing.assert_allclose(moments(other)[1], moments(z)[1], atol=1e-12)
    np.testing.assert_allclose(other[:4], -other[4:], atol=1e-12)  # antithetic pairs
    distances = np.linalg.norm(other[:, None, :] - z[None, :, :], axis=-1)
    assert distances.min() > 1e-3 * np.abs(z).max()  # new points, not the old ones


def test_the_free_energy_of_a_cubic_target_is_exact():
    """GPF's first recorded free energy, on particles of an antithetic cloud, equals the
    closed-form -ELBO = E_q[phi] - H(q) of a potential phi of degree 3."""
    rng = np.random.default_rng(2)
    d = 3
    _, expectation, (a, b, c) = _cubic(d, rng, coefficients=True)
    with pm.Model() as model:
        x = pm.Flat("x", shape=d)
        cubic = (x[:, None, None] * x[None, :, None] * x[None, None, :] * c).sum()
        pm.Potential("phi", -(pt.dot(a, x) + pt.dot(x, pt.dot(b, x)) + cubic))
    gpf = pymc_gpf.GPF(2 * d, cloud="antithetic", init_scale=0.7, model=model, random_seed=3)
    m, cov = moments(gpf.approx.particles)
    exact = expectation(m, cov) - 0.5 * np.linalg.slogdet(cov)[1] - 0.5 * d * LOG_2PI_E
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # one step: not converged
        approx = pm.fit(1, method=gpf, progressbar=False)
    assert approx.hist[0] == pytest.approx(exact, rel=1e-10)


# ------------------------------------------------------------------ backtracking (GPF)
def test_the_line_search_never_accepts_an_increase(regression_model):
    """On a non-Gaussian posterior the recorded free energy (that of the accepted state)
    never increases, although trials were refused along the way."""
    approx = pm.fit(
        method="gpf",
        model=regression_model,
        random_seed=2,
        inf_kwargs={"n_particles": 12, "cloud": "antithetic"},
        progressbar=False,
    )
    hist, sizes = approx.hist, approx.inference.step_sizes
    assert np.all(np.diff(hist) <= 0.0)
    assert np.any(np.diff(sizes[1:]) < 0)  # some trials were refused (the step shrank)
    assert approx.outcome.converged


def test_a_gaussian_target_converges_to_round_off_in_few_steps():
    """D = 10, condition number 100, started 3 sds off: the automatic step reaches the
    exact mean and covariance (Theorem 1) to round-off in at most 25 accepted steps; the
    paper's fixed step 0.01 (the stable range ends at 0.0198, notes F7) is far off after as
    many steps and needs about 30 000 (notes F1)."""
    d = 10
    mu, cov = gaussian_target(d, condition_spectrum(d, 100), seed=3)
    model = mvnormal_model(mu, cov)
    start = {"x": mu + 3 * np.sqrt(np.diag(cov))}
    approx = pm.fit(
        method="gpf", model=model, random_seed=1, start=start, tol=1e-6, progressbar=False
    )
    m, c = moments(approx.particles)
    np.testing.assert_allclose(m, mu, atol=1e-10)
    np.testing.assert_allclose(c, cov, atol=1e-10 * np.abs(cov).max())
    accepted = int(np.sum(np.diff(approx.hist) < 0)) + 1
    assert accepted <= 25 and approx.outcome.converged
    fixed = pm.fit(
        len(approx.hist),
        method="gpf",
        model=model,
        random_seed=1,
        start=start,
        inf_kwargs={"n_particles": 2 * d, "cloud": "antithetic"},
        learning_rate=0.01,
        progressbar=False,
    )
    m, c = moments(fixed.particles)
    assert np.abs(c - cov).max() > 0.1 * np.abs(cov).max()


def test_a_fixed_learning_rate_is_algorithm_2(regression_model):
    """With a numeric learning_rate the step is the paper's Algorithm 2, written out here in
    NumPy from the model's own log-density gradient: same particles after 50 steps."""
    gpf = pymc_gpf.GPF(5, model=regression_model, random_seed=4)
    assert gpf.resolved.resolved_cloud == "random"  # an explicit N keeps the paper's random cloud
    x = gpf.approx.particles.copy()
    dlogp = gpf.target.compile_logp_dlogp()
    eta1, eta2 = 0.01, 0.02
    for _ in range(50):
        g = -dlogp(x)[1]
        z = x - x.mean(0)
        psi = g.T @ z / len(x)
        x = x - eta1 * g.mean(0) - eta2 * z @ (psi - np.eye(3)).T
    approx = pm.fit(50, method=gpf, learning_rate=(eta1, eta2), progressbar=False)
    np.testing.assert_allclose(approx.particles, x, rtol=1e-10, atol=1e-12)
    assert approx.outcome.converged is None  # nothing tested: n steps were asked for


# --------------------------------------------------------------------- stopping rules
def _stops(control, infos, state=None):
    """``control``'s stop codes on steps with ``infos`` in turn (from its initial state, or
    from ``state``), and its state after them."""
    state = control.init() if state is None else state
    stops = []
    for info in infos:
        state, decision = control.observe(state, 0.0, info)
        stops.append(decision.stop)
    return stops, state


def test_the_deterministic_rule_stops_on_a_converged_fit_only():
    control = Deterministic(tol=0.03)
    info = {"accepted": True, "step_size": 1.0}
    falling, state = _stops(control, [info | {"decrement": 10.0 / k} for k in range(1, 1000)])
    assert all(stop is None for stop in falling)  # decrement 0.01 > tol^2 at the end
    stops, _ = _stops(control, [info | {"decrement": 1e-4}] * 3, state)
    assert stops == [None, None, "converged"]
    stall = {"accepted": False, "step_size": 1e-13, "decrement": 1.0}
    assert _stops(control, [stall])[0] == ["stalled"]
    at_round_off = [info | {"decrement": 1e-4}, {"accepted": False, "step_size": 1e-13}]
    assert _stops(control, at_round_off)[0] == [None, "converged"]


def test_a_backtracking_fit_that_crawls_is_stalled():
    """Accepted steps so small that q moves by less than CRAWL * tol of its sds (step size
    times the square root of the decrement) while the decrement stays above tol^2: GPF on a
    Laplace prior's kinks took 1000 such steps, its step size halving from 2e-4 to 1e-12.
    ``patience`` of them in a row stall the fit; one that moves further restarts the count."""
    from pymc_gpf.control import CRAWL

    control = Deterministic(tol=0.03, patience=10, crawl=CRAWL)
    size = 0.5 * CRAWL * 0.03 / np.sqrt(2.0)  # moves q by half of CRAWL * tol
    crawl = {"accepted": True, "step_size": size, "decrement": 2.0}
    stops, _ = _stops(control, [crawl] * 10)
    assert stops == [None] * 9 + ["stalled"]
    moving = crawl | {"step_size": 4 * size}  # twice CRAWL * tol
    stops, _ = _stops(control, [crawl] * 9 + [moving] + [crawl] * 9)
    assert stops == [None] * 19
    assert "moved q by less than" in control.describe(control.init(), "stalled")
    # off by default (a deep ensemble's gradient steps)
    assert _stops(Deterministic(tol=0.03, patience=10), [crawl] * 10)[0] == [None] * 10


def test_an_ensemble_out_of_steps_says_how_many_more_its_ess_needs():
    """The ESS grows in proportion to the draws since burn-in (the kept half of them), so an
    ensemble that ran out of steps with the smallest ESS short of its target needs about
    ``(steps - burn_in) (target / ESS - 1)`` more: the message says so (a spline
    regression's ensemble ended with ESS 915 of 1327 after 10 000 steps; refine(4500)
    converged, ESS 1413). With the ESS met (R-hat not) there is no such estimate."""
    from pymc_gpf.ensemble.control import SamplingControl

    control = SamplingControl(0.03, initial_rate=0.1, target_ess=1327)
    ended = control.init()._replace(steps=10_000, burn_in=250, ess=915.0, rhat=1.024,
                                    rhat_excess=1.004)  # fmt: skip
    more = 9750 * (1327 / 915 - 1)  # 4388.1
    message = control.describe(ended, "max_steps")
    assert f"smallest ESS reaches 1327 in about {np.ceil(more):.0f} more steps" in message
    mixed_badly = ended._replace(ess=2000.0, rhat_excess=1.05)
    assert "more steps" not in control.describe(mixed_badly, "max_steps")


def test_an_early_stop_must_pass_the_convergence_test():
    """The independent cloud's early stop applies near the fixed point only (decrement
    below 1, a finite best value), and the restored state it asks for ends the fit only if
    its own decrement passes the tol test; else the method must go on ("unverified")."""
    info = {"accepted": True, "step_size": 1.0}
    stalled = {"since_best": 10, "best_validation": 5.0}
    control = Deterministic(tol=0.03, patience=10)
    assert _stops(control, [info | {"decrement": 4.0} | stalled])[0] == [None]  # far
    blind = stalled | {"best_validation": np.inf}  # never finite
    assert _stops(control, [info | {"decrement": 0.5} | blind])[0] == [None]
    for decrement, decision in ((1e-4, "converged"), (0.01, "unverified")):
        stops, state = _stops(control, [info | {"decrement": 0.5} | stalled])
        assert stops == ["overfitting"]
        state = Deterministic.verify(state)  # the method restored its best state: the
        # next evaluation decides
        assert _stops(control, [info | {"decrement": decrement}], state)[0] == [decision]


def test_an_independent_cloud_that_stopped_improving_long_ago_stops_a_fit_far_out():
    """Far from the fixed point (decrement above 1) the independent cloud's free energy may
    pause while the flow makes progress, but not for ``far_patience`` accepted steps: then
    the particles are fitting their own positions (an IRT model's 168 particles did so for
    2350 steps at decrements of 1-14, their free energy falling by 14 nats). The fit asks
    for its best state, as near the fixed point after ``patience`` steps."""
    info = {"accepted": True, "step_size": 0.1, "decrement": 5.0, "best_validation": 420.5}
    control = Deterministic(tol=0.03, patience=10, far_patience=50)
    assert _stops(control, [info | {"since_best": 49}])[0] == [None]
    assert _stops(control, [info | {"since_best": 50}])[0] == ["overfitting"]
    blind = info | {"since_best": 500, "best_validation": np.inf}  # no independent value
    assert _stops(control, [blind])[0] == [None]


def test_controllers_are_pure_functions_of_an_immutable_state():
    """Every controller's settings are frozen and its state is an immutable NamedTuple:
    ``observe(state, free_energy, info)`` reads what it needs from the step's info and
    answers with the next state and a Decision (the engine carries it out), leaving every
    state it was given as it was, so that observing from an earlier state again gives the
    same answers. The checkpoint holds the settings and every field of the state, and
    restores both."""
    import json

    from dataclasses import FrozenInstanceError

    from pymc_gpf.control import Decision, FixedSteps, control_checkpoint, restore_control
    from pymc_gpf.ensemble.control import SamplingControl

    rng = np.random.default_rng(0)
    infos = []
    for _ in range(150):
        particles = rng.normal(size=(8, 2))
        infos.append({
            "accepted": True, "step_size": 1.0, "decrement": 1.0, "location": rng.normal(size=2),
            "scale": np.ones(2), "params": [rng.normal(size=2)], "particles": particles,
            "drift": -particles, "logp": np.zeros(8), "preconditioner": None, "mean_v": 0.0,
            "mmd": 0.0, "bandwidth": 1.0, "free_energy": rng.normal(),
        })  # fmt: skip
    controls = [
        FixedSteps(0.1, window=20), Deterministic(0.03), Stochastic(0.03),
        SamplingControl(0.03, initial_rate=0.1, min_burn_in=50, window=25),
    ]  # fmt: skip

    def checkpoint(control, state):
        return json.dumps(control_checkpoint(control, state), sort_keys=True)

    for control in controls:
        with pytest.raises(FrozenInstanceError):
            control.tol = 1.0
        states, answers = [control.init()], []
        for info in infos:
            assert set(control.reads(states[-1])) <= set(info)
            state, decision = control.observe(states[-1], info["free_energy"], info)
            assert isinstance(decision, Decision) and type(state) is type(states[-1])
            states.append(state)
            answers.append(decision.stop)
        with pytest.raises(AttributeError):
            setattr(states[-1], states[-1]._fields[0], None)
        saved = [checkpoint(control, state) for state in states]
        # from an earlier state again: the same answers and states, the later ones unchanged
        state, again = states[60], []
        for info in infos[60:]:
            state, decision = control.observe(state, info["free_energy"], info)
            again.append(decision.stop)
        assert again == answers[60:] and checkpoint(control, state) == saved[-1]
        assert [checkpoint(control, state) for state in states] == saved
        restored, state = restore_control(control, json.loads(saved[-1]))
        assert restored == control and checkpoint(restored, state) == saved[-1]


class _Iterate:
    """A scalar AR(1) iterate around ``target`` driven by the controller's rate: what a
    natural step of size ``rate`` does on a quadratic objective with gradient noise
    ``noise`` (in sds of q); the free energy is its squared error plus noise."""

    def __init__(self, noise, drift=0.0, seed=0, curvature=0.0, start=5.0, pull=1.0):
        self.rng = np.random.default_rng(seed)
        self.noise, self.drift, self.pull = noise, drift, pull
        self.controller: Stochastic | None = None  # sets the step size, as in a fit
        self.state = None  # the controller's
        self.curvature = curvature
        self.x, self.target, self.averaged = start, 0.0, None

    def step(self):
        self.target += self.drift
        d = self.x - self.target
        # a curved gradient, d - c min(d^2, 1): the iterates' average sits c Var above target
        gradient = self.pull * d - self.curvature * min(d * d, 1.0)
        rate = self.controller.rate(self.state)
        self.x += -rate * gradient + rate * self.noise * self.rng.normal()
        free_energy = 0.5 * (self.x - self.target) ** 2 - 0.01 * self.target
        return free_energy + 0.1 * self.rng.normal()

    def control(self, tol):
        self.controller = Stochastic(tol)
        self.state = self.controller.init()
        return self.controller

    def observe(self):
        """One step, the controller's decision on it carried out; its stop code."""
        free_energy = self.step()
        x = np.array([self.x])
        info = {"accepted": True, "location": x, "scale": np.array([1.0]), "params": [x]}
        self.state, decision = self.controller.observe(self.state, free_energy, info)
        if decision.params is not None:
            self.averaged = float(decision.params[0][0])
        return decision.stop


@pytest.mark.parametrize("seed", range(5))
def test_the_stochastic_rule_stops_on_a_converged_fit_with_a_precise_average(seed):
    """Noisy stationary iterates: the rule stops, and the average it returns is within
    three of its stated errors (tol) of the fixed point."""
    run = _Iterate(noise=3.0, seed=seed)
    run.control(tol=0.05)
    stops = (run.observe() for _ in range(200_000))
    assert any(stop is not None for stop in stops)
    assert abs(run.averaged - run.target) < 3 * 0.05


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize(("noise", "largest_rate"), [(0.3, 0.5), (0.8, 0.125)])
def test_the_stochastic_rule_ends_on_an_unbiased_average(noise, largest_rate, seed):
    """A curved objective (gradient ``d - c d^2`` near the optimum ``d = 0``) with noise
    ``sigma``: the average of iterates at step size ``r`` sits ``c Var = c sigma^2 r / (2 - r)``
    above the optimum (Dieuleveut, Durmus & Bach 2020). With ``sigma = 0.3``: 0.081 at
    ``r = 1``, 0.027 at ``r = 1/2``; ending on full steps' average (an earlier rule) missed
    the optimum on every seed. With ``sigma = 0.8``: 0.19 at ``r = 1/2``, 0.082 at ``1/4``,
    0.038 at ``1/8``, so no fixed step bounds the bias on every target; the rule compares the
    averages at ``r`` and ``r/2`` (their gap is the bias left at ``r/2``). Either way it ends
    within 3 tol of the optimum."""
    run = _Iterate(noise=noise, curvature=0.9, seed=seed, start=0.5)
    run.control(tol=0.02)
    stops = (run.observe() for _ in range(400_000))
    assert any(stop == "converged" for stop in stops)
    assert run.state.rate <= largest_rate
    assert abs(run.averaged - run.target) < 3 * 0.02


def test_the_average_s_error_measures_a_correlation_slower_than_the_step_implies():
    """An AR(1) series with lag-one autocorrelation 0.95 (a mode the step contracts by 5 %
    per step where a step of rate 1/2 implies 50 %: integrated correlation time
    (1 + 0.95) / 0.05 = 39, not 3) and stationary variance 1: the error of its average over
    n = 20 000 steps is sqrt(39 / n) = 0.0442. White noise keeps the step's time."""
    from pymc_gpf.control import RunningAverage

    rng = np.random.default_rng(0)
    n, rho = 20_000, 0.95
    slow = np.empty(n)
    slow[0] = rng.normal()
    for t in range(1, n):
        slow[t] = rho * slow[t - 1] + np.sqrt(1 - rho**2) * rng.normal()
    series = np.stack([slow, rng.normal(size=n)], axis=1)
    average = RunningAverage()
    for window in np.split(series, n // 20):
        average = average.add_window(window)
    times = average.correlation_times(3.0)
    np.testing.assert_allclose(times, [39.0, 3.0], rtol=0.1)
    errors = average.errors(3.0, np.ones(2))
    np.testing.assert_allclose(errors, np.sqrt([39.0 / n, 3.0 / n]), rtol=0.1)
    assert average.error(3.0, np.ones(2), tol=0.05) == pytest.approx(errors[0])


def test_the_average_s_error_sees_a_slow_mode_under_a_fast_one():
    """A sum of a fast AR(1) (lag-one autocorrelation 0.75, time 7, variance 0.7) and a slow
    one (0.98, time 99, variance 0.3), as GF's iterates on a latent GP posterior: integrated
    correlation time 0.7 * 7 + 0.3 * 99 = 34.6, where the lag-one autocorrelation (0.82)
    reads 10 and so underestimated the average's error by 1.9 (those averages ended 0.05
    sds off with an estimated error of 0.014). The longer lags find most of it, over
    20 000 steps, while white noise and a plain AR(1) keep their times."""
    from pymc_gpf.control import RunningAverage

    rng = np.random.default_rng(0)
    n = 20_000

    def ar1(rho):
        noise = rng.normal(size=n) * np.sqrt(1 - rho**2)
        out = np.empty(n)
        out[0] = rng.normal()
        for t in range(1, n):
            out[t] = rho * out[t - 1] + noise[t]
        return out

    mixed = np.sqrt(0.7) * ar1(0.75) + np.sqrt(0.3) * ar1(0.98)
    series = np.stack([mixed, ar1(0.75), rng.normal(size=n)], axis=1)
    average = RunningAverage()
    for window in np.split(series, n // 20):
        average = average.add_window(window)
    times = average.correlation_times(3.0)
    lag_one = np.corrcoef(mixed[1:], mixed[:-1])[0, 1]
    assert (1 + lag_one) / (1 - lag_one) < 11
    assert 0.55 * 34.6 < times[0] < 1.1 * 34.6
    np.testing.assert_allclose(times[1:], [7.0, 3.0], rtol=0.1)


def test_a_fit_that_ran_out_of_steps_before_its_error_was_known_says_why():
    """An average over 200 steps of a coordinate with lag-one autocorrelation 0.999 (e.g.
    WVGD's running cell weights) spans less than five of its correlation times, so its
    error is unknown (inf): the message says so instead of "error inf sds"."""
    from pymc_gpf.control import RunningAverage

    control, average = Stochastic(tol=0.03), RunningAverage()
    walk = np.cumsum(np.random.default_rng(0).normal(size=200))[:, None]
    for window in np.split(walk, 10):
        average = average.add_window(window)
    state = control.init()._replace(averaging=True, average=average)
    assert control._average_error(state) == np.inf
    message = control.describe(state, "max_steps")
    assert "over 200 steps, too few for 10 correlation times" in message
    assert "inf" not in message


def test_steps_cut_short_by_the_trust_region_a_hundred_times_in_a_row_are_a_crawl():
    """With ``crawl=100``: 100 accepted steps in a row whose trust region cut them below
    ``CRAWL_CUT`` of the step size stop the fit as "crawling" (the 99th does not); one step
    that is not cut starts the count again; without ``crawl`` no such stop."""
    from pymc_gpf.control import CRAWL_CUT

    def run(control, cuts):
        state, stops = control.init(), []
        for i, cut in enumerate(cuts):  # q moving and the free energy falling: no plateau
            x = np.array([float(i)])
            size = (0.5 if cut else 2.0) * CRAWL_CUT * state.rate
            info = {"accepted": True, "location": x, "scale": np.ones(1), "params": [x],
                    "step_size": size}  # fmt: skip
            state, decision = control.observe(state, -float(i), info)
            stops.append(decision.stop)
        return state, stops

    state, stops = run(Stochastic(0.03, crawl=100), [True] * 100)
    assert stops[:99] == [None] * 99 and stops[99] == "crawling"
    assert "crawling" in Stochastic(0.03, crawl=100).describe(state, "crawling")
    _, stops = run(Stochastic(0.03, crawl=100), [True] * 60 + [False] + [True] * 60)
    assert "crawling" not in stops
    _, stops = run(Stochastic(0.03), [True] * 200)
    assert "crawling" not in stops


@pytest.mark.parametrize("seed", range(5))
def test_the_stochastic_rule_does_not_stop_on_a_drifting_fit(seed):
    """A fixed point that keeps moving (the free energy keeps falling): no stop in 50 000
    steps."""
    run = _Iterate(noise=3.0, drift=0.01, seed=seed)
    run.control(tol=0.05)
    assert all(run.observe() is None for _ in range(50_000))


def _last_drift(control, state, means, noise=None):
    """Whether the last of the windows' ``means`` (with that ``noise``) still drifts,
    after the others (:meth:`Stochastic._drifting`)."""
    for mean in means:
        noisy = None if noise is None else np.array([noise])
        window_means, drifting = control._drifting(state, np.array([mean]), noisy)
        state = state._replace(window_means=window_means)
    return drifting


def test_quiet_windows_whose_means_still_move_do_not_end_a_fit():
    """The windows' means contract towards the fixed point by r per window: the first
    window's spread test ends a fit only once the drift left, d1 r / (1 - r), is below
    tol. A low-rank GF's factor turning across a small eigen-gap moved by 0.04 sds a window
    with r = 0.96 (about 1 sd to go) while each window's iterates spread by 0.01."""

    def drifting(moves):
        control = Stochastic(tol=0.05)
        return _last_drift(control, control.init(), np.cumsum([0.0, *moves]))

    assert drifting([]) is None  # one window: nothing known about its drift
    assert drifting([0.01]) is None  # two: not yet its rate
    assert drifting([0.2]) is True  # two, but the move is above tol
    assert drifting([0.0]) is False  # two at rest
    assert drifting([0.0417, 0.04]) is True  # r = 0.96: 0.96 sds to go
    assert drifting([0.2, 0.06]) is True  # the last move is above tol
    assert drifting([0.02, 0.01]) is False  # r = 1/2: 0.01 to go
    assert drifting([0.0, 0.0]) is False  # at rest
    assert drifting([0.01, -0.02]) is True  # r = 2: not contracting
    assert drifting([5e-14, 1.6e-8]) is False  # round-off: at rest, whatever its ratio


def test_window_means_moving_within_their_noise_are_not_a_drift():
    """Two moves in a row within Z_MOVE (3) sds of the windows' own noise are that noise,
    whatever their ratio: GF on arK moved 0.0006 then 0.0018 sds (r = 3) and averaged on
    for 2.8 times the steps of a fit that had converged. A move beyond it is extrapolated
    as before: the eigen-gap drift above, 0.04 sds a window, with windows' means noisy by
    0.007 sds."""

    def drifting(moves, noise):
        control = Stochastic(tol=0.05)
        return _last_drift(control, control.init(), np.cumsum([0.0, *moves]), noise)

    assert drifting([0.0006, 0.0018], 0.001) is False
    assert drifting([0.0006, 0.0018], 0.0) is True  # no noise: r = 3, not contracting
    assert drifting([0.0006, 0.0018], 0.0004) is True  # 0.0018 > 3 hypot(0.0004, 0.0004)
    assert drifting([0.0417, 0.04], 0.007) is True
    assert drifting([0.0417, 0.002], 0.007) is False  # contracted: 0.0001 to go


@pytest.mark.parametrize("seed", range(3))
def test_a_quiet_fit_stops_on_its_window_average(seed):
    """Iterates whose spread is well below tol (an AR(1) with gradient noise 0.01 sds:
    spread 0.006 at rate 1/2) stop on a window's average at rate 1/2, without averaging
    over ten correlation times, and that average is within a quarter of tol of the fixed
    point (its own sd is 0.002)."""
    run = _Iterate(noise=0.01, seed=seed)
    run.control(tol=0.05)
    stops = [run.observe() for _ in range(400)]
    assert "converged" in stops and not run.state.averaging and run.state.rate == 0.5
    assert abs(run.averaged - run.target) < 0.05 / 4


def test_iterates_that_wander_while_averaging_halve_the_step():
    """Averaging at rate 1/2 (entered after a quiet window), a window whose iterates spread
    by 1.5 sds of q (more than ``unstable_spread``, 1) ends the averaging and halves the
    step; a window spread by 0.3 is averaged. GF continuing GPF's fit of a non-centred
    eight-schools posterior (seed 10) averaged on at 1/2 for 10 000 steps, its windows
    spread by 0.8-2.1 sds, and ended 1.4 sds from the Gaussian optimum; it now halves, and
    ends 0.006 sds and 3 % from it (still warned: no stop test passed in 10 000 steps)."""
    control = Stochastic(tol=0.02)
    state = control.init()._replace(rate=0.5, averaging=True)
    rng = np.random.default_rng(0)
    for spread in (0.3, 0.3, 1.5):
        for x in rng.normal(0.0, spread, size=control.window_length(state)):
            info = {"accepted": True, "location": np.array([x]), "scale": np.array([1.0]),
                    "params": [np.array([x])]}  # fmt: skip
            state, decision = control.observe(state, 10.0 + 0.01 * rng.normal(), info)
            assert decision.stop is None
        if spread < 1:
            assert state.averaging and state.rate == 0.5
    assert not state.averaging and state.rate == 0.25 and state.coarse is None


def _white_noise_stop(control: Stochastic, seed: int) -> tuple[str, float, float]:
    """The stop, the step size it came at and the average it returned, for white-noise
    iterates (sd 0.3 of q) about a fixed point at 0, whatever the step."""
    state, rng = control.init(), np.random.default_rng(seed)
    for _ in range(100_000):
        x = np.array([0.3 * rng.normal()])
        info = {"accepted": True, "location": x, "scale": np.array([1.0]), "params": [x]}
        rate = state.rate
        state, decision = control.observe(state, 10.0 + 0.01 * rng.normal(), info)
        if decision.stop is not None:
            return decision.stop, rate, float(decision.params[0][0])
    raise AssertionError("no stop in 100 000 steps")


def test_averages_at_the_largest_step_and_half_of_it_do_not_end_a_fit():
    """At the largest averaging step (1/2) the bias need not be linear in the step yet, so
    by default the comparison of the averages at 1/2 and 1/4 does not end a fit (GF on a
    GARCH(1,1) posterior ended 0.021-0.030 of q's sds from the Gaussian optimum on 4 of 16
    seeds, each on that comparison); WVGD, whose margin of 3 sds already holds its stops
    back, keeps it. White-noise iterates, whose averages agree at every step: over 8 seeds
    the rule with that comparison stops at 1/4 on some, the default never does; both
    average to within 3 tol of the fixed point."""
    tol, stops = 0.05, {False: [], True: []}
    for seed in range(8):
        for beside_largest, found in stops.items():
            control = Stochastic(tol=tol, stop_beside_largest_step=beside_largest)
            found.append(_white_noise_stop(control, seed))
    for reason, _, average in stops[False] + stops[True]:
        assert reason == "converged" and abs(average) < 3 * tol
    assert max(rate for _, rate, _ in stops[False]) <= 0.125
    assert 0.25 in [rate for _, rate, _ in stops[True]]


def test_a_drift_measured_at_another_step_size_does_not_end_a_fit():
    """GF on the random walks: the windows' means of a scale moved -0.155 -> -0.069 sds at
    rate 1, then -0.045 in the first window at rate 1/2. Read as one contraction (r = 0.28,
    0.009 sds to go) the fit stopped there, 0.045 sds from the optimum (0.075 on another
    seed); at the smaller step the drift is slower, and nothing is known of it yet."""
    control = Stochastic(tol=0.03)
    state = control.init()
    for mean in (-0.155, -0.069):
        moved, _ = control._drifting(state, np.array([mean]))
        state = state._replace(window_means=moved)
    state = control._new_rate(state, 0.5)
    assert control._drifting(state, np.array([-0.045]))[1] is None
    state = state._replace(window_means=moved)  # the same means at one step size: contracting
    assert control._drifting(state, np.array([-0.045]))[1] is False


# ------------------------------------------------------------- defaults, end to end
def test_a_fit_that_did_not_converge_says_so(regression_model):
    with pytest.warns(UserWarning, match="GPF did not converge: reached the maximum"):
        approx = pm.fit(3, method="gpf", model=regression_model, progressbar=False)
    attrs = approx.sample(10, random_seed=0)["fit"].attrs
    assert attrs["converged"] == "False" and attrs["stop_reason"] == "max_steps"
    verdict = pymc_gpf.diagnose(approx, 200, random_seed=0).verdict
    assert verdict.startswith("the fit did not converge") and "refine" in verdict


@pytest.fixture(scope="module")
def counts():
    """Poisson counts with a log link: from log_rate = 0 the gradient is ~5000 (a fixed
    unit step overflows, tests/test_faults.py); the posterior of log_rate is close to
    N(log 1000, 0.014^2)."""
    import pytensor.tensor as pt

    with pm.Model() as model:
        log_rate = pm.Normal("log_rate", 0, 10)
        pm.Poisson("counts", pt.exp(log_rate), observed=np.full(5, 1000))
    return model


@pytest.mark.parametrize("method", names("gaussian_exact"))
def test_the_automatic_step_fits_where_a_fixed_one_diverges(counts, method):
    approx = pm.fit(method=method, model=counts, random_seed=0, progressbar=False)
    assert approx.outcome.converged
    draws = approx.sample(4000, random_seed=1)["posterior"]["log_rate"].values
    assert draws.mean() == pytest.approx(np.log(1000), abs=0.003)
    assert draws.std() == pytest.approx(1 / np.sqrt(5000), rel=0.1)


def test_gpf_grows_its_cloud_or_continues_with_fresh_draws(capsys):
    """Eight schools (non-centred): the 20-particle cloud fits its own positions (its free
    energy below an independent -ELBO, or a fresh cloud of the same Gaussian far from a
    fixed point: the quadrature is too coarse). The fit restarts from its Gaussian with
    twice the particles while the cap (160) can be expected to pass (a quadrature's
    decrement falls as 1/N), else continues with fresh draws every step (GF's flow) from its
    Gaussian, the particles then representing GF's q exactly; GF's steps show as a line of
    the fit's progress display."""
    model = eight_schools()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        approx = pm.fit(method="gpf", model=model, random_seed=1, progressbar=True)
    shown = capsys.readouterr().out
    stages = approx.inference.stages
    grown = [s for s in stages if "fresh_draws" not in s]
    sizes = [s["n_particles"] for s in grown]
    assert sizes == [20 * 2**k for k in range(len(sizes))] and sizes[-1] <= 160
    tol = 0.03
    for stage in grown[:-1]:  # each doubling had a cause, and the cap could pass
        if "gap" in stage:
            assert stage["gap"] > 2 * stage["gap_mcse"] + 0.01
        else:
            decrement = stage["decrement_fresh_cloud"]
            assert tol**2 < decrement < tol**2 * 160 / stage["n_particles"]
    last = stages[-1]
    if "fresh_draws" in last:
        before = grown[-1]
        hopeless = before.get("decrement_fresh_cloud", 0) * before["n_particles"] / 160
        assert before["n_particles"] == 160 or hopeless >= tol**2
        assert "GF's flow (fresh draws of q every step) continued" in approx.outcome.message
        assert len(approx.hist) > last["step"]  # GF's steps are on the trace
        assert "Fitting GPF:" in shown and "then fitting GF:" in shown
        q = approx.gaussian()  # the particles represent GF's q, which has full rank
        assert len(approx.particles) == before["n_particles"] and q.rank == 10
    else:
        assert approx.outcome.converged and abs(last["gap"]) <= 3 * last["gap_mcse"] + 0.01
    assert approx.outcome.converged or any(
        issubclass(w.category, pymc_gpf.FitWarning) for w in caught
    )


@pytest.mark.parametrize("seed", [1, 2])
def test_gpf_reaches_the_gaussian_optimum_of_a_skewed_target(seed):
    """log x of x ~ Gamma(1/2, 1), density exp(y/2 - e^y): skewed, so 20 particles'
    quadrature puts GPF's fixed point up to 10 % (an sd) off the Gaussian-VI optimum while
    its free energy matches an independent estimate. A fresh cloud of the same Gaussian
    finds it off a fixed point; GF's flow then continues, and q ends within tol = 0.03 of
    its sds of the optimum, found here by 200-node Gauss-Hermite quadrature; so does a
    refine of the fit, which goes on with GF's flow."""
    z, w = np.polynomial.hermite_e.hermegauss(200)
    w = w / w.sum()

    def free_energy(theta):
        y = theta[0] + np.exp(theta[1]) * z
        return -np.sum(w * (0.5 * y - np.exp(y))) - theta[1]

    best = optimize.minimize(free_energy, [0.0, 0.0], method="Nelder-Mead",
                             options={"xatol": 1e-10, "fatol": 1e-14}).x  # fmt: skip
    model = log_gamma(0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pymc_gpf.FitWarning)  # family-limited: not Gaussian
        approx = pm.fit(method="gpf", model=model, random_seed=seed, progressbar=False)
    assert approx.outcome.converged
    assert approx.inference.stages[0]["decrement_fresh_cloud"] > 0.03**2
    assert "fresh_draws" in approx.inference.stages[-1]
    sd = np.exp(best[1])
    for _ in range(2):  # the fit, then a refine of it: it goes on with GF's flow, converged
        q = approx.gaussian()
        assert abs(q.mean[0] - best[0]) / sd < 0.03
        assert abs(np.sqrt(q.marginal_variances()[0]) / sd - 1) < 0.03
        steps = len(approx.hist)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", pymc_gpf.FitWarning)
            approx.inference.refine(300)
        assert approx.outcome.converged and len(approx.hist) > steps
        assert [s.get("fresh_draws") for s in approx.inference.stages][-1] == "fresh_cloud"


def test_gpf_continuation_shows_callbacks_its_steps_and_is_saved(tmp_path):
    """GPF's continuation with GF's flow (log Gamma(1/2), as above): the fit's callbacks see
    its steps as the particles' (in order, with the whole trace, this approximation showing
    GF's q) and change no result; a saved fit holds the continuation, so its refine goes
    on with GF's flow (schedule, average, random stream) exactly as the fit in memory."""
    seen = []

    def spy(approx, hist, i):
        seen.append((i, np.array(hist), float(approx.particles.mean())))

    def fit(**keywords):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", pymc_gpf.FitWarning)  # family-limited
            return pm.fit(method="gpf", model=log_gamma(0.5), random_seed=1,
                          progressbar=False, **keywords)  # fmt: skip

    approx, plain = fit(callbacks=[spy]), fit()
    assert "fresh_draws" in approx.inference.stages[-1]
    np.testing.assert_array_equal(approx.hist, plain.hist)
    np.testing.assert_array_equal(approx.particles, plain.particles)
    assert [i for i, *_ in seen] == list(range(1, len(approx.hist) + 1))
    np.testing.assert_array_equal(seen[-1][1], approx.hist)
    assert seen[-1][2] == pytest.approx(approx.gaussian().mean[0], rel=1e-9)

    loaded = pymc_gpf.load(approx.save(tmp_path / "fit.nc"), model=log_gamma(0.5))
    assert loaded.inference.continuation is not None
    for fitted in (approx, loaded):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", pymc_gpf.FitWarning)
            fitted.inference.refine(300)
    assert len(approx.hist) > len(plain.hist)
    np.testing.assert_array_equal(loaded.hist, approx.hist)
    np.testing.assert_array_equal(loaded.gaussian().mean, approx.gaussian().mean)
    assert loaded.outcome.reason == approx.outcome.reason


def test_gpf_continuation_cut_by_the_step_cap_says_so_once():
    """GPF's continuation with GF's flow (log Gamma(1/2), as above) cut by the step cap 20
    steps after it began: the warning names the cap and the remedy once, with the reason the
    flow took over (GF's own message used to repeat "(n steps this call); continue with
    approx.refine(n)")."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pymc_gpf.FitWarning)
        whole = pm.fit(method="gpf", model=log_gamma(0.5), random_seed=1, progressbar=False)
    began = whole.inference.stages[-1]["step"]
    with pytest.warns(pymc_gpf.FitWarning, match="did not converge") as caught:
        cut = pm.fit(began + 20, method="gpf", model=log_gamma(0.5), random_seed=1,
                     progressbar=False)  # fmt: skip
    assert cut.outcome.reason == "max_steps" and "fresh_draws" in cut.inference.stages[-1]
    message = str(caught[0].message)
    assert f"continued from step {began}" in message
    assert message.count("steps this call") == 1
    assert message.count("continue with approx.refine(n)") == 1


# ---------------------------------------------------------------------- minibatches
@pytest.fixture(scope="module")
def minibatch_regression():
    """y = X w + noise with known noise sd and N(0, 10^2) priors: the posterior is Gaussian
    in closed form. n = 2000 rows, minibatches of 50."""
    rng = np.random.default_rng(5)
    n, p = 2000, 3
    x = rng.normal(size=(n, p))
    y = x @ np.array([1.0, -2.0, 0.5]) + rng.normal(size=n)
    precision = x.T @ x + np.eye(p) / 100
    cov = np.linalg.inv(precision)
    with pm.Model() as model:
        xb, yb = pm.Minibatch(x, y, batch_size=50)
        w = pm.Normal("w", 0, 10, shape=p)
        pm.Normal("y", xb @ w, 1.0, observed=yb, total_size=n)
    return model, cov @ x.T @ y, np.sqrt(np.diag(cov))


@pytest.mark.parametrize("method", names("minibatch"))
def test_a_minibatch_regression_fits_at_defaults(minibatch_regression, method):
    """No argument but the seed: the fit converges (the averaged iterate's Monte Carlo error
    below tol = 0.05 sds; the Langevin ensemble, SGLD: ESS 400, the least its automatic
    target takes) and matches the closed-form
    posterior. (The ensemble's step rule for minibatches matters: at the full-data step the
    gradient noise inflates its sds by 50-85 % here.)"""
    model, mean, sd = minibatch_regression
    approx = pm.fit(method=method, model=model, random_seed=1, progressbar=False)
    assert approx.outcome.converged
    draws = approx.sample(20_000, random_seed=0, return_inferencedata=False)["w"]
    draws = draws.reshape(-1, draws.shape[-1])  # an ensemble's are (chain, draw, 3)
    np.testing.assert_array_less(np.abs(draws.mean(0) - mean) / sd, 0.2)
    np.testing.assert_array_less(np.abs(draws.std(0) / sd - 1), 0.1)


def test_an_unconverged_minibatch_fit_names_nuts_on_the_full_data(minibatch_regression):
    """NUTS on pm.Minibatch data samples a wrong posterior (PyMC's on a 1000-row regression
    in minibatches of 50: a slope's sd 0.12 where the posterior's is 0.032) or fails
    (nutpie): where a minibatch fit sends the user to NUTS, it says to build the model with
    the full data."""
    model, _, _ = minibatch_regression
    with pytest.warns(pymc_gpf.FitWarning, match="did not converge") as caught:
        approx = pm.fit(20, method="gf", model=model, random_seed=1, progressbar=False)
    assert approx.outcome.reason == "max_steps"
    message = " ".join(str(w.message) for w in caught)
    nuts = "NUTS (pm.sample), which samples the posterior itself, on the model built with the full"
    assert nuts + " data arrays" in message
