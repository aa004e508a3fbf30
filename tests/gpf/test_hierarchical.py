"""GPF with a hierarchical model: the arrow factor of GF's hierarchical structure, which
particles cannot span (``N`` particles hold ``N - 1`` directions), is fitted by GF's flow
and reported as GPF's q; ``structure="auto"`` chooses it where GPF's automatic cloud could
not span the model (it stalled for 25 minutes on a hierarchical normal with 1000 groups)."""

from __future__ import annotations

import numpy as np
import pymc as pm
import pytest

import pymc_gpf

from benchmarks.cases import hierarchical_normal
from pymc_gpf.gpf.fresh import fresh_draws_fit
from pymc_gpf.options import parse_fit_options
from tests.conftest import linear_hierarchy_model


@pytest.fixture(scope="module")
def linear_hierarchy():
    return linear_hierarchy_model()


def test_gpf_reports_the_arrow_fit_of_a_gaussian_hierarchy(tmp_path, linear_hierarchy):
    """The posterior is Gaussian with an arrow precision (in the family): GPF's q is it, to
    the stop rule's ``tol`` (0.03 sds), as its mean, sds, covariance, density and draws;
    the particles are points of it; the verdict is trustworthy; saved and loaded, the fit
    continues with the same q."""
    model, mean, cov = linear_hierarchy
    approx = pm.fit(method="gpf", model=model, random_seed=1, progressbar=False,
                    inf_kwargs={"structure": "hierarchical"})  # fmt: skip
    outcome = approx.outcome
    assert outcome.converged and outcome.verdict == "trustworthy"
    assert "fitted the hierarchical structure's arrow factor" in outcome.message
    sd = np.sqrt(np.diag(cov))
    np.testing.assert_array_less(np.abs(approx.mean.eval() - mean) / sd, 0.03)
    np.testing.assert_array_less(np.abs(approx.std.eval() / sd - 1), 0.03)
    correlation = (approx.cov.eval() - cov) / np.outer(sd, sd)
    np.testing.assert_array_less(np.abs(correlation), 0.03)
    q = approx.gaussian()
    assert q.coupling is not None  # the arrow, not a particle cloud
    assert approx.particles.shape == (2 * (2 + 1), 2 + 40)
    draws = approx.sample(4000, random_seed=2, return_inferencedata=False)["a"]
    # 4000 draws: each mean within 4.5 of its standard errors (sd / 63)
    np.testing.assert_array_less(np.abs(draws.mean(0) - mean[2:]) / sd[2:], 4.5 / np.sqrt(4000))
    assert (
        approx.inference.gradient_evaluations == approx.inference.continuation.gradient_evaluations
    )

    path = approx.save(tmp_path / "arrow.nc")
    loaded = pymc_gpf.load(path, model=model)
    np.testing.assert_array_equal(loaded.gaussian().mean, q.mean)
    np.testing.assert_array_equal(loaded.particles, approx.particles)
    loaded.refine(20)
    approx.refine(20)
    np.testing.assert_array_equal(loaded.gaussian().mean, approx.gaussian().mean)
    np.testing.assert_array_equal(loaded.hist, approx.hist)


def test_auto_chooses_the_arrow_where_the_cloud_cannot_span_the_model():
    """``2 D`` above the 1000 particles of the automatic cloud and the model has locals: the
    arrow; fewer dimensions, an explicit number of particles or no locals: full."""
    assert pymc_gpf.GPF(model=hierarchical_normal(500, per_group=2)).structure.hierarchical
    assert pymc_gpf.GPF(model=hierarchical_normal(400, per_group=2)).structure.kind == "full"
    explicit = pymc_gpf.GPF(50, model=hierarchical_normal(500, per_group=2))
    assert explicit.structure.kind == "full"
    with pm.Model() as walk:
        pm.GaussianRandomWalk("w", sigma=1, init_dist=pm.Normal.dist(), shape=600)
    with pytest.warns(UserWarning, match="rank 500 < D"):
        assert pymc_gpf.GPF(model=walk).structure.kind == "full"


def test_the_arrow_refuses_a_fixed_step_with_what_to_do(linear_hierarchy):
    model = linear_hierarchy[0]
    with pytest.raises(ValueError, match=r"takes the automatic step size.*structure='full'"):
        pm.fit(method="gpf", model=model, learning_rate=0.01,
               inf_kwargs={"structure": "hierarchical"})  # fmt: skip


def test_gf_continues_gpf_with_gpf_s_own_structure():
    """Where the particles' fixed point is off the optimum GF continues from their Gaussian:
    with the structure GPF resolved (full here, D = 72), not GF's own automatic choice (the
    arrow above D = 64, whose factors cannot take the particles' q: GPF then ended "biased"
    on a centred radon model)."""
    gpf = pymc_gpf.GPF(model=hierarchical_normal(70, per_group=2), random_seed=1)
    assert gpf.structure.kind == "full"
    options = parse_fit_options(gpf.target, gpf.default_optimizer)
    gf = fresh_draws_fit(gpf.approx.gaussian(), gpf, options, 3, seed=2)
    assert gf is not None and gf.structure.kind == "full"
    np.testing.assert_allclose(gf.approx.gaussian().mean, gpf.approx.gaussian().mean, atol=1)
