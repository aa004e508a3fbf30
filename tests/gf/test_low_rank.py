"""GF's low-rank structure, ``q = N(mu, U U^T + diag(s^2))``: its density (Woodbury), its
draws' rule (exact second moments), the natural flow's fixed point on a Gaussian posterior
the family holds (exact: the optimum is the posterior), the automatic choice above
``D = 1000`` and the refusals."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pymc as pm
import pytest

import pymc_gpf

from pymc_gpf.gaussian import GaussianQ
from pymc_gpf.gf.parameters import (
    MAX_FULL_RANK_DIM,
    MAX_LOW_RANK,
    automatic_structure,
    low_rank_rank,
)
from pymc_gpf.structure import parse_structure


def _diagonal_plus_low_rank(d: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``mu`` and ``V V^T + diag(t^2)``: ``k`` factors of sd about ``sqrt(d) / 2`` over
    coordinates of sd 0.5 to 2 (correlations up to 0.99)."""
    rng = np.random.default_rng(seed)
    loadings, scales = 0.5 * rng.normal(size=(d, k)), rng.uniform(0.5, 2.0, d)
    return 3 * rng.normal(size=d), loadings @ loadings.T + np.diag(scales**2)


def test_low_rank_gaussian_density_and_draws():
    """``GaussianQ`` with loadings is ``N(m, U U^T + diag(s^2))``: its log-density equals the
    dense one, its draws have that covariance (within 4 standard errors), its marginal
    variances are the diagonal, and widening scales the covariance."""
    rng = np.random.default_rng(0)
    d, k = 6, 2
    loadings, scales, mean = rng.normal(size=(d, k)), rng.uniform(0.5, 2, d), rng.normal(size=d)
    cov = loadings @ loadings.T + np.diag(scales**2)
    q = GaussianQ(mean, (np.arange(d),), (scales,), loadings=loadings)
    points = rng.normal(size=(7, d))
    dev = points - mean
    expected = -0.5 * np.einsum("si,ij,sj->s", dev, np.linalg.inv(cov), dev)
    expected -= 0.5 * np.linalg.slogdet(2 * np.pi * cov)[1]
    np.testing.assert_allclose(q.logpdf(points), expected, rtol=1e-10)
    np.testing.assert_allclose(q.marginal_variances(), np.diag(cov), rtol=1e-12)
    n = 200_000
    draws = q.sample(n, rng)
    sd = np.sqrt(np.diag(cov))
    se = np.sqrt((cov**2 + np.outer(np.diag(cov), np.diag(cov))) / n)  # of a covariance entry
    assert np.all(np.abs(np.cov(draws.T) - cov) < 4 * se)
    assert np.all(np.abs(draws.mean(axis=0) - mean) < 4 * sd / np.sqrt(n))
    wide = q.widened(1.5)
    np.testing.assert_allclose(wide.marginal_variances(), 2.25 * np.diag(cov), rtol=1e-12)


def test_the_rule_has_exact_second_moments_and_no_cross_terms():
    """The points of :func:`~pymc_gpf.gf.flow.low_rank_rule`: weights summing to 1, mean 0,
    ``E[z_u z_u^T] = I`` (the spherical-radial rule), ``E[z_u z_d^T] = 0`` (the sign
    pattern), and ``E[z_d^2] = 1`` in every coordinate (the standardisation), each draw
    exactly: so a Gaussian target's free energy and natural directions are exact; and every
    point lies in the odd-symmetric pattern that cancels, for a linear gradient, ``z_d``
    from ``U``'s direction."""
    import pytensor
    import pytensor.tensor as pt

    from pymc_gpf.gf.flow import low_rank_rule

    k, d, n_rules = 3, 40, 2
    directions = pt.tensor3(shape=(None, k, k))
    radii, diagonal = pt.matrix(shape=(None, k + 2)), pt.matrix()
    (u, dd), weights = low_rank_rule(directions, radii, diagonal)
    rule = pytensor.function([directions, radii, diagonal], [u, dd, weights])
    rng = np.random.default_rng(1)
    z_u, z_d, w = rule(
        rng.standard_normal((n_rules, k, k)),
        rng.standard_normal((n_rules, k + 2)),
        rng.standard_normal((n_rules * k + 1, d)),
    )
    assert z_u.shape == (4 * n_rules * k + 2, k) and z_d.shape == (len(z_u), d)
    assert w.sum() == pytest.approx(1.0, abs=1e-12)
    np.testing.assert_allclose(w @ z_u, 0.0, atol=1e-12)
    np.testing.assert_allclose(w @ z_d, 0.0, atol=1e-12)
    np.testing.assert_allclose((w[:, None] * z_u).T @ z_u, np.eye(k), atol=1e-12)
    np.testing.assert_allclose((w[:, None] * z_u).T @ z_d, 0.0, atol=1e-12)
    np.testing.assert_allclose(w @ z_d**2, 1.0, atol=1e-12)


@pytest.fixture(scope="module")
def low_rank_posterior():
    """D = 250, 4 factors: the family holds the posterior."""
    d = 250
    mu, cov = _diagonal_plus_low_rank(d, 4, seed=5)
    with pm.Model() as model:  # cov as data: a large constant stops numba caching
        pm.MvNormal("x", mu=mu, cov=pm.Data("cov", cov))
    with model:
        approx = pm.fit(
            method="gf", random_seed=2, progressbar=False, inf_kwargs={"structure": "low-rank"}
        )
    return mu, cov, model, approx


def _returns(value):
    return lambda: value


def test_auto_chooses_low_rank_above_full_rank_dimensions():
    """``structure="auto"`` without locals: full rank up to ``D = 1000``, diagonal plus low
    rank above (a full factor would hold ``D^2`` numbers and cost ``O(D^3)`` a step)."""
    for d, kind in ((MAX_FULL_RANK_DIM, "full"), (MAX_FULL_RANK_DIM + 1, "low-rank")):
        target = SimpleNamespace(ndim=d, coordinates=[SimpleNamespace(rv_name="x")])
        assert automatic_structure(target, lambda: None).kind == kind
        # a given rank asks for the paper's K-column factor, even where the model has locals
        # (the speed section's GF rank 10 raised "structure='diagonal' has one scale per
        # coordinate" on its independent normals: the locals' structure was chosen first)
        for found in (None, parse_structure("diagonal", target)):
            assert automatic_structure(target, _returns(found), rank_given=True).kind == "full"


def test_a_gaussian_posterior_of_the_family_is_fitted_exactly(low_rank_posterior):
    """Diagonal plus rank ``round(sqrt(D))`` (the default rank) on a Gaussian posterior of
    that family: the optimum is the posterior, the natural mean step is exact (the mean to
    round-off) and the spread ends within ``tol`` = 0.03 of the posterior's sds in every
    coordinate and correlation, with a trustworthy verdict."""
    mu, cov, _, approx = low_rank_posterior
    d = len(mu)
    assert approx.inference.structure.kind == "low-rank"
    assert approx.inference.resolved.rank == low_rank_rank(None, d) == round(np.sqrt(d))
    assert approx.outcome.converged and approx.outcome.verdict == "trustworthy"
    q = approx.gaussian()
    sd = np.sqrt(np.diag(cov))
    assert np.max(np.abs(q.mean - mu) / sd) < 1e-8
    assert np.max(np.abs(np.sqrt(q.marginal_variances()) / sd - 1)) < 0.03
    fitted = approx.cov.eval()
    assert np.max(np.abs(fitted - cov) / np.outer(sd, sd)) < 0.03


def test_low_rank_datatree_and_draws(low_rank_posterior):
    """The method group holds ``U`` ``(D, K)`` and ``s``; q's plain draws have the fitted
    marginal sds (4000 draws: within 10 %, where the standard error is 1.1 %)."""
    _, _, _, approx = low_rank_posterior
    tree = approx.sample(4000, random_seed=1, psis=False)
    gf = tree["gf"]
    d, k = len(low_rank_posterior[0]), approx.inference.resolved.rank
    assert gf["loadings"].shape == (d, k) and gf["scale"].shape == (d,)
    assert gf.attrs["structure"] == "low-rank"
    draws = approx.sample(4000, random_seed=1, psis=False, return_inferencedata=False)
    x = np.asarray(draws["x"]).reshape(4000, d)
    assert np.max(np.abs(x.std(axis=0) / gf["std"].values - 1)) < 0.1


def test_gpf_fits_the_low_rank_structure_with_gf_flow(low_rank_posterior):
    """Particles cannot span a low-rank-plus-diagonal q: GPF's ``structure="low-rank"`` is
    GF's flow (its q, to the same tolerance on the same posterior), the particles showing it
    and the outcome saying so."""
    mu, cov, model, _ = low_rank_posterior
    with model:
        approx = pm.fit(method="gpf", random_seed=3, progressbar=False,
                        inf_kwargs={"structure": "low-rank"})  # fmt: skip
    assert approx.outcome.converged and approx.outcome.verdict == "trustworthy"
    assert "low-rank structure's factor" in approx.outcome.message
    q = approx.gaussian()
    sd = np.sqrt(np.diag(cov))
    assert np.max(np.abs(q.mean - mu) / sd) < 1e-8
    assert np.max(np.abs(np.sqrt(q.marginal_variances()) / sd - 1)) < 0.03
    assert approx.particles.shape == (2 * (round(np.sqrt(len(mu))) + 1), len(mu))


def test_low_rank_refusals(low_rank_posterior):
    """A rank outside ``1 .. D - 1`` and a fixed step size are refused with what to do."""
    model = low_rank_posterior[2]
    d = len(low_rank_posterior[0])
    with pytest.raises(ValueError, match="between 1 and D - 1"):
        pymc_gpf.GF(structure="low-rank", rank=d, model=model)
    with pytest.raises(ValueError, match="automatic step size"):
        pm.fit(3, method="gf", model=model, learning_rate=0.01, progressbar=False,
               inf_kwargs={"structure": "low-rank"})  # fmt: skip
    assert low_rank_rank(None, 10**6) == MAX_LOW_RANK
    # an explicit draws_per_step is honoured (rounded up to whole rules): S / 4 spoke pairs
    gf = pymc_gpf.GF(structure="low-rank", rank=5, draws_per_step=40, model=model)
    assert gf.resolved_draws(pymc_gpf.options.parse_fit_options(gf.target, "sgd")) == 42
