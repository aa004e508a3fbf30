"""Gaussian Flow (GF): fixed points on Gaussian targets (full rank, low rank, mean field),
the free energy, q's density, NUTS agreement, the DataTree and GF's own bad input.

GF is stochastic (S fresh draws per step), so its iterates fluctuate around the fixed point.
The tolerances come from that noise. For a Gaussian target with the natural mean step the
mean error is an AR(1) process, ``delta <- (1 - eta) delta - eta Gamma z_bar``, whose
stationary law gives ``E[delta^T Lambda delta] = eta D / ((2 - eta) S)``. Linearising the
factor update around ``Gamma Gamma^T = Sigma`` for a whitened target gives
``E||C - I||_F^2 = eta D (D + 1) / S`` (only the symmetric part of ``Gamma - I`` contracts,
at rate 2, driven by ``(1/S) sum z z^T - I``); the relative noise of one eigenvalue is
``sqrt(2 eta / S)``.
"""

import inspect

import numpy as np
import pymc as pm
import pytensor.tensor as pt
import pytest

from conftest import assert_matches_nuts, condition_spectrum, gaussian_target, mvnormal_model
from scipy.stats import multivariate_normal

import pymc_gpf

D = 10
S = 200
ETA = 0.01


def _fit(model, n, seed=1, learning_rate=ETA, **inf_kwargs):
    return pm.fit(
        n,
        method="gf",
        model=model,
        random_seed=seed,
        inf_kwargs=inf_kwargs,
        learning_rate=learning_rate,
        progressbar=False,
    )


def _whiten(cov):
    w, v = np.linalg.eigh(np.linalg.inv(cov))
    return v @ np.diag(np.sqrt(w)) @ v.T  # Lambda^(1/2)


@pytest.fixture(scope="module")
def target():
    mu, cov = gaussian_target(D, condition_spectrum(D, 10), seed=0)
    return mu, cov, mvnormal_model(mu, cov)


@pytest.fixture(scope="module")
def full_rank(target):
    return _fit(target[2], 3000, draws_per_step=S, natural_mean=True)


def test_full_rank_recovers_the_gaussian_within_its_noise(target, full_rank):
    mu, cov, _ = target
    half = _whiten(cov)
    delta = full_rank.mean.eval() - mu
    expected = ETA * D / ((2 - ETA) * S)  # E[delta^T Lambda delta] (module docstring)
    # delta^T Lambda delta / expected is roughly chi2_D / D: 4x its mean has p < 1e-4
    assert delta @ np.linalg.inv(cov) @ delta < 4 * expected
    c = full_rank.cov.eval()
    np.testing.assert_allclose(c, full_rank.factor @ full_rank.factor.T, rtol=1e-12)
    whitened = np.linalg.norm(half @ c @ half - np.eye(D))
    assert whitened < 3 * np.sqrt(ETA * D * (D + 1) / S)  # 0.22; a wrong fixed point is O(1)
    assert np.linalg.norm(c - cov) < 0.1 * np.linalg.norm(cov)


def test_free_energy_falls_to_minus_log_evidence(full_rank):
    """F = E_q[phi] - H[q] = KL(q || p) - log Z, and log Z = 0 for the normalised MvNormal.
    At the fixed point KL ~ 1/4 ||whitened C - I||^2 + 1/2 delta^T Lambda delta ~ 0.003, and
    each step's estimate has Monte Carlo sd sqrt(D / 2S) (phi is chi2_D / 2 under q = p), on
    fresh draws every step, so the mean of 1000 steps has se 0.005."""
    hist = full_rank.hist
    assert hist[:50].mean() > hist[-1000:].mean() + 5.0  # starts far: falls on average
    assert np.all(np.isfinite(hist))
    assert -0.02 < hist[-1000:].mean() < 0.03


def test_logq_is_the_fitted_gaussian_density(full_rank):
    draws = full_rank.inference.approx.draw(7, np.random.default_rng(0))
    exact = multivariate_normal(full_rank.mean.eval(), full_rank.cov.eval()).logpdf(draws)
    np.testing.assert_allclose(full_rank.logq(draws), exact, rtol=1e-10)
    with pytest.raises(ValueError, match="10 columns"):
        full_rank.logq(np.zeros((2, 3)))


def test_samples_have_the_fitted_moments(full_rank):
    draws = full_rank.sample(40_000, random_seed=2, include_transformed=True).posterior["x"]
    flat = draws.values.reshape(-1, D)
    std = full_rank.std.eval()
    # sample mean error sd = std / sqrt(40000) = std / 200
    np.testing.assert_array_less(np.abs(flat.mean(0) - full_rank.mean.eval()) / std, 4 / 200)
    np.testing.assert_allclose(flat.std(0), std, rtol=0.02)


def test_mean_field_fixed_point_is_one_over_the_precision_diagonal(target):
    """The mean-field Gaussian VI optimum: mean mu, variances 1/Lambda_dd (notes F10), which
    differ from Sigma_dd. Each variance has relative noise sqrt(2 eta / S) = 0.01."""
    mu, cov, model = target
    approx = _fit(model, 3000, draws_per_step=S, natural_mean=True, structure="diagonal")
    precision_diag = np.diag(np.linalg.inv(cov))
    var = approx.std.eval() ** 2
    np.testing.assert_allclose(var * precision_diag, 1.0, atol=4 * np.sqrt(2 * ETA / S))
    assert np.max(np.abs(np.diag(cov) * precision_diag - 1)) > 0.5  # 1/Lambda_dd != Sigma_dd
    delta = approx.mean.eval() - mu
    assert np.sqrt(delta @ np.linalg.inv(cov) @ delta) < 0.1
    np.testing.assert_array_equal(approx.cov.eval(), np.diag(var))
    draws = approx.inference.approx.draw(5, np.random.default_rng(0))
    exact = multivariate_normal(approx.mean.eval(), np.diag(var)).logpdf(draws)
    np.testing.assert_allclose(approx.logq(draws), exact, rtol=1e-10)


def test_blocks_fixed_point_is_each_blocks_precision_inverse():
    """Block-diagonal Gaussian VI on a Gaussian target: each block ``b`` is
    ``N(mu_b, (Lambda_bb)^-1)``, within the noise (relative noise per variance
    ``sqrt(2 eta / S)``). The fixed step drew every block's noise from the one generator
    with no draw following another, so PyMC's compile found no update for it ("multiple
    distinct clients"): the same S draws every step, and a block's whitened covariance
    ended 0.16-0.20 from I, its sds 7-8 % off, over three seeds (now 0.012-0.022)."""
    mu, cov = gaussian_target(5, condition_spectrum(5, 10), seed=1)
    precision = np.linalg.inv(cov)
    with pm.Model() as model:
        a = pm.Flat("a", shape=3)
        b = pm.Flat("b", shape=2)
        x = pm.math.concatenate([a, b]) - mu
        pm.Potential("gaussian", -0.5 * pm.math.dot(x, pm.math.dot(precision, x)))
    approx = _fit(model, 3000, draws_per_step=S, natural_mean=True, structure="variables")
    for block in (slice(0, 3), slice(3, 5)):
        optimum = np.linalg.inv(precision[block, block])
        whitened = _whiten(optimum) @ approx.cov.eval()[block, block] @ _whiten(optimum)
        identity = np.eye(optimum.shape[0])
        np.testing.assert_allclose(whitened, identity, atol=4 * np.sqrt(2 * ETA / S))
    delta = approx.mean.eval() - mu
    assert np.sqrt(delta @ precision @ delta) < 0.1


def test_low_rank_finds_the_top_eigenvalues():
    """Notes F11: D = 10, eigenvalues 10^linspace(-1, 1, 10), K = 3, Gamma_0 = the first K
    columns of I: the eigenvalues of Gamma Gamma^T are the top 3 (relative noise per
    eigenvalue sqrt(2 eta2 / S) = 0.0045 with S = 1000; the 3 % of F11 is ~7 sd)."""
    eigenvalues = 10 ** np.linspace(-1, 1, D)
    mu, cov = gaussian_target(D, eigenvalues, seed=3)
    # mean step 0.1 < 2 / lambda_max(Lambda) = 0.2; factor step 0.01 < 2 / kappa
    approx = _fit(
        mvnormal_model(mu, cov),
        3000,
        learning_rate=(0.1, 0.01),
        rank=3,
        draws_per_step=1000,
        init_scale=1.0,
    )
    factor = approx.factors[0]
    assert factor.shape == (D, 3)
    top = np.sort(np.linalg.eigvalsh(factor.T @ factor))[::-1]
    np.testing.assert_allclose(top, eigenvalues[::-1][:3], rtol=0.03)
    assert np.linalg.norm(approx.mean.eval() - mu) < 0.05
    # q is degenerate: logq is the density on its 3-d support, -inf off it
    draws = approx.inference.approx.draw(4, np.random.default_rng(1))
    z = np.linalg.lstsq(factor, (draws - approx.mean.eval()).T, rcond=None)[0].T
    gram = factor.T @ factor
    exact = -0.5 * np.sum(z**2, 1) - 0.5 * np.linalg.slogdet(2 * np.pi * gram)[1]
    np.testing.assert_allclose(approx.logq(draws), exact, rtol=1e-9)
    off = draws + np.linalg.svd(factor)[0][:, -1]  # a direction orthogonal to the factor
    assert np.all(approx.logq(off) == -np.inf)


def test_low_rank_in_500_dimensions_recovers_the_top_subspace():
    """D = 500 with 10 large eigenvalues in [1, 6] and 490 at 0.05; rank K = 10. The fixed
    point spans the top-10 eigenvectors with their eigenvalues (relative noise per eigenvalue
    sqrt(2 eta / S) = 0.02 with S = 50)."""
    d, k = 500, 10
    rng = np.random.default_rng(0)
    top = 1 + np.abs(rng.normal(2, 1, k))
    basis = np.linalg.qr(rng.normal(size=(d, d)))[0][:, :k]
    floor = 0.05  # kappa ~ 110: plain descent on Gamma needs eta < 2 / kappa = 0.018
    cov = basis @ np.diag(top - floor) @ basis.T + floor * np.eye(d)
    with pm.Model() as model:  # cov as data: a 500 x 500 constant stops numba caching
        pm.MvNormal("x", mu=np.zeros(d), cov=pm.Data("cov", cov))
    approx = _fit(model, 3000, rank=k, draws_per_step=50, init_scale=1.0)
    factor = approx.factors[0]
    cosines = np.linalg.svd(basis.T @ np.linalg.qr(factor)[0], compute_uv=False)
    assert cosines.min() > 0.999  # principal angles to the top subspace below 2.6 degrees
    found = np.sort(np.linalg.eigvalsh(factor.T @ factor))
    np.testing.assert_allclose(found, np.sort(top), rtol=4 * np.sqrt(2 * ETA / 50))


def test_the_spherical_radial_rule_is_exact_to_degree_3_and_unbiased():
    """Genz & Monahan's stochastic rule (the automatic step's draws): every draw of it
    integrates the polynomials of degree up to 3 exactly (weights summing to 1, mean 0,
    covariance I: a step on a Gaussian target is exact), and on average every function:
    ``|z|^4`` has expectation ``K (K + 2)`` under ``N(0, I_K)``, and one rule's estimate is
    ``K rho^2`` with ``rho^2 ~ chi^2(K + 2)``, so 4000 rules are within 4 of its standard
    errors ``K sqrt(2 (K + 2) / 4000)``. A rule with all its points at radius ``sqrt(K)``
    (the draws before) gives ``K^2``, a bias of ``2 / K``."""
    import pytensor
    import pytensor.tensor as pt

    from pymc_gpf.gf.flow import spherical_radial

    k, n_rules = 5, 4000
    rng = np.random.default_rng(0)
    directions = pt.tensor3(shape=(None, k, k))
    radii = pt.matrix(shape=(None, k + 2))
    rule = pytensor.function([directions, radii], spherical_radial(directions, radii))
    z, w = rule(rng.standard_normal((1, k, k)), rng.standard_normal((1, k + 2)))
    assert z.shape == (2 * k + 1, k)
    assert w.sum() == pytest.approx(1.0, abs=1e-12)
    np.testing.assert_allclose(w @ z, 0.0, atol=1e-12)
    np.testing.assert_allclose((w[:, None] * z).T @ z, np.eye(k), atol=1e-12)
    # many rules at once: their centres merge, which |z|^4 (zero there) does not see
    z, w = rule(rng.standard_normal((n_rules, k, k)), rng.standard_normal((n_rules, k + 2)))
    spokes = (w[1:] * np.sum(z[1:] ** 2, axis=1) ** 2).reshape(2, n_rules, k)
    estimates = n_rules * spokes.sum(axis=(0, 2))  # one per rule
    assert np.mean(estimates) == pytest.approx(
        k * (k + 2), abs=4 * k * np.sqrt(2 * (k + 2) / n_rules)
    )


@pytest.mark.parametrize("structure", [{}, {"structure": "low-rank", "rank": 2}])
def test_the_automatic_step_ends_at_the_gaussian_optimum_of_a_non_gaussian_target(structure):
    """Log-Gamma posteriors (``y = log g``, ``g ~ Gamma(a, 1)``): the Gaussian-VI optimum is
    ``mu = log a - 1/(2a)``, ``sigma = 1/sqrt(a)`` (``E_q[e^y] = e^(mu + sigma^2/2)``). At
    defaults GF ends within 2 tol of it (a precise average, tol, and a bias below tol). Draws
    on a sphere of fixed radius ended 0.08 sds too wide at ``a = 1/2``, and the average at
    step 1/2 without the halving test 0.09 sds too low (the bias of constant-step averages).
    The low-rank structure with a rank-2 ``U`` the optimum does not need ends there too."""
    a = np.array([0.5, 1.0, 2.0, 4.0, 8.0])
    with pm.Model() as model:
        pm.Gamma("g", alpha=a, beta=1.0, shape=5)
    approx = pm.fit(method="gf", model=model, random_seed=1, progressbar=False,
                    inf_kwargs=structure)  # fmt: skip
    assert approx.outcome.converged
    q = approx.gaussian()
    sd = 1 / np.sqrt(a)
    tol = 2 * pymc_gpf.options.DEFAULT_TOL
    np.testing.assert_allclose((q.mean - (np.log(a) - 0.5 / a)) / sd, 0.0, atol=tol)
    np.testing.assert_allclose(np.sqrt(q.marginal_variances()) / sd, 1.0, atol=tol)


def test_constrained_regression_matches_nuts(regression_model, regression_nuts):
    approx = _fit(regression_model, 10_000, seed=5, learning_rate=1e-3, natural_mean=True)
    assert_matches_nuts(regression_nuts, approx, ["intercept", "slope", "sigma"])


def test_blocks_by_variable(regression_model):
    approx = _fit(regression_model, 200, learning_rate=1e-3, structure="variables")
    assert [f.shape for f in approx.factors] == [(1, 1), (1, 1), (1, 1)]
    cov = approx.cov.eval()
    np.testing.assert_array_equal(cov, np.diag(np.diag(cov)))
    draws = approx.inference.approx.draw(5, np.random.default_rng(0))
    exact = multivariate_normal(approx.mean.eval(), cov).logpdf(draws)
    np.testing.assert_allclose(approx.logq(draws), exact, rtol=1e-10)
    group = approx.sample(10, random_seed=0)["gf"]
    assert {"factor_block0", "factor_block2", "mean", "std"} <= set(group.data_vars)
    assert group["block2_coordinate"].values.tolist() == ["sigma_log__"]


def test_datatree_and_reproducibility(regression_model):
    a = _fit(regression_model, 30, seed=4, learning_rate=1e-3)
    b = _fit(regression_model, 30, seed=4, learning_rate=1e-3)
    np.testing.assert_array_equal(a.hist, b.hist)
    np.testing.assert_array_equal(a.factors[0], b.factors[0])
    tree = a.sample(50, random_seed=1)
    assert set(tree.children) == {"posterior", "fit", "gf", "observed_data", "constant_data"}
    assert tree["fit"]["free_energy"].shape == (30,)
    gf = tree["gf"]
    assert gf["factor"].dims == ("coordinate", "rank") and gf["factor"].shape == (3, 3)
    assert gf.attrs["draws_per_step"] == 10 and gf.attrs["rank"] == 3
    assert tree["posterior"]["sigma"].shape == (1, 50)
    np.testing.assert_array_equal(
        tree["posterior"]["slope"], a.sample(50, random_seed=1)["posterior"]["slope"]
    )
    # refine continues the random stream: the same as one longer run
    a.refine(20)
    c = _fit(regression_model, 50, seed=4, learning_rate=1e-3)
    np.testing.assert_array_equal(a.hist, c.hist)


def test_init_map_starts_both_gaussian_methods_at_the_map(regression_model):
    if "jitter" in inspect.signature(pm.find_MAP).parameters:  # PyMC >= 6.4
        found = pm.find_MAP(
            model=regression_model, progressbar=False, jitter=False, return_inferencedata=True
        )["optimizer_result"]
        expected = found["x"].values  # flat unconstrained, PyMC's value-variable order
        assert found["variables"].values.tolist() == ["intercept", "slope", "sigma_log__"]
    else:
        found = pm.find_MAP(model=regression_model, progressbar=False)
        expected = np.array([found[k] for k in ("intercept", "slope", "sigma_log__")])
    gf = pymc_gpf.GF(model=regression_model, init="map", random_seed=1)
    np.testing.assert_allclose(gf.approx.mean.eval(), expected, atol=1e-5)
    gpf = pymc_gpf.GPF(model=regression_model, init="map", random_seed=1, init_scale=1e-3)
    np.testing.assert_allclose(gpf.approx.particles.mean(0), expected, atol=1e-3)


def test_a_stall_far_out_starts_again_at_the_curvatures_scales():
    """A Gamma regression with a log link on a predictor in the hundreds: from the initial
    point at 0.1 in every coordinate, q's draws put ``b1 x`` in the hundreds, the steps
    threw its mean 1 500 sds out and GF stalled (non-finite values) at every seed. Started
    again at the initial point with sds from the curvature there, it converges to the
    posterior: means within 0.1 sd and sds within 10 % of the exact ones, by quadrature on
    a grid in (b0, b1, log alpha)."""
    from scipy import stats

    rng = np.random.default_rng(303)
    x = rng.uniform(0, 1000, size=200)
    y = rng.gamma(3.0, np.exp(1.0 + 0.002 * x) / 3.0)
    with pm.Model() as model:
        b0, b1 = pm.Normal("b0", 0, 5), pm.Normal("b1", 0, 1)
        alpha = pm.Gamma("alpha", 2, 0.5)
        pm.Gamma("y", alpha=alpha, beta=alpha / pt.exp(b0 + b1 * x), observed=y)
    approx = pm.fit(method="gf", model=model, random_seed=1, progressbar=False,
                    backend="quick_c")  # fmt: skip
    assert approx.inference.control_state.restarted == 1
    assert approx.outcome.converged and "started again" in approx.outcome.message
    axes = [np.linspace(c - 7 * s, c + 7 * s, 41) for c, s in
            ((1.04, 0.081), (0.00189, 1.46e-4), (1.17, 0.095))]  # fmt: skip
    grid = np.stack(np.meshgrid(*axes, indexing="ij"), axis=-1).reshape(-1, 3)
    a = np.exp(grid[:, 2:3])
    log_p = (stats.gamma.logpdf(y, a, scale=np.exp(grid[:, :1] + grid[:, 1:2] * x) / a).sum(1)
             + stats.norm.logpdf(grid[:, 0], 0, 5) + stats.norm.logpdf(grid[:, 1], 0, 1)
             + stats.gamma.logpdf(a[:, 0], 2, scale=2.0) + grid[:, 2])  # fmt: skip
    weights = np.exp(log_p - log_p.max())
    weights /= weights.sum()
    mean = weights @ grid
    sd = np.sqrt(weights @ (grid - mean) ** 2)
    q = approx.gaussian()  # b0, b1, log alpha: the flat coordinates
    np.testing.assert_array_less(np.abs(q.mean - mean) / sd, 0.1)
    np.testing.assert_array_less(np.abs(np.sqrt(q.marginal_variances()) / sd - 1), 0.1)


def test_a_crawl_far_out_starts_again_at_the_map():
    """A regression with flat priors and a response in the tens of thousands: from the
    initial point (noise scale 1), q narrows to the curvature there, 10^-5 wide in the noise
    scale's log, and its natural steps, cut to one trust radius each, crawled (0.2 of the
    7.8 to go in 10 000 steps). After 100 such steps GF starts again from the MAP and
    converges to the posterior: means within 0.1 sd and sds within 10 % of the exact ones
    (the coefficients Student-t about least squares, the noise scale's square
    inverse-gamma)."""
    from scipy.special import gammaln

    rng = np.random.default_rng(2611)
    n = 80
    x = rng.uniform(1000, 5000, size=n)
    y = 12000 + 3.5 * x + rng.normal(0, 2500, size=n)
    with pm.Model() as model:
        a, b, s = pm.Flat("a"), pm.Flat("b"), pm.HalfFlat("s")
        pm.Normal("y", a + b * x, s, observed=y)
    approx = pm.fit(method="gf", model=model, random_seed=1, progressbar=False,
                    backend="quick_c")  # fmt: skip
    assert approx.inference.control_state.restarted == 2
    assert approx.outcome.converged and "from the MAP" in approx.outcome.message
    design = np.column_stack([np.ones(n), x])
    coef, rss = np.linalg.lstsq(design, y, rcond=None)[:2]
    # p(a, b, s | y) ∝ s^-n exp(-|y - Xβ|² / 2s²): β Student-t with ν = n - 3, s² IG(ν/2, rss/2)
    nu, shape, scale = n - 3, (n - 3) / 2, rss[0] / 2
    coef_sd = np.sqrt(rss[0] / (nu - 2) * np.diag(np.linalg.inv(design.T @ design)))
    s_mean = np.sqrt(scale) * np.exp(gammaln(shape - 0.5) - gammaln(shape))
    s_sd = np.sqrt(scale / (shape - 1) - s_mean**2)
    q = approx.gaussian()  # a, b, log s
    mean = np.array([*q.mean[:2], np.exp(q.mean[2] + q.marginal_variances()[2] / 2)])
    sd = np.sqrt(q.marginal_variances())
    sd[2] = mean[2] * np.sqrt(np.expm1(q.marginal_variances()[2]))
    exact_mean, exact_sd = np.array([*coef, s_mean]), np.array([*coef_sd, s_sd])
    np.testing.assert_array_less(np.abs(mean - exact_mean) / exact_sd, 0.1)
    np.testing.assert_array_less(np.abs(sd / exact_sd - 1), 0.1)
