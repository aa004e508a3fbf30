"""The verdict of a minibatch fit on a large data set reads log p from a subsample of its rows
(:mod:`pymc_gpf.subsample`): checked against the whole data set's log p."""

import numpy as np
import pymc as pm

from scipy.special import expit

import pymc_gpf

from pymc_gpf.importance import defensive
from pymc_gpf.subsample import FIRST_ROWS, NOISE

ROWS = 2**16  # four times the first subsample: the least that uses one


def _logistic(total_size: int = ROWS) -> pm.Model:
    rng = np.random.default_rng(5)
    x = rng.normal(size=(ROWS, 2)) * [1.0, 30.0]  # unscaled: q's axes are not the coordinates'
    y = (rng.random(ROWS) < expit(0.3 + x @ [0.5, -0.02])).astype(float)
    with pm.Model() as model:
        xb, yb = pm.Minibatch(x, y, batch_size=500)
        w = pm.Normal("w", 0.0, 2.0, shape=2)
        b = pm.Normal("b", 0.0, 2.0)
        pm.Bernoulli("y", logit_p=b + xb @ w, observed=yb, total_size=total_size)
    return model


def test_the_subsample_stands_for_every_row_only_where_one_index_can():
    assert pymc_gpf.BatchedTarget(_logistic()).subsample_rows == ROWS
    # total_size other than the rows: a minibatch of them is not scaled to the data set
    assert pymc_gpf.BatchedTarget(_logistic(total_size=2 * ROWS)).subsample_rows is None


def test_a_minibatch_fits_verdict_reads_log_p_from_a_subsample_within_its_stated_error():
    approx = pm.fit(method="gf", model=_logistic(), random_seed=3, progressbar=False)
    estimate = approx.subsample
    assert approx.outcome.verdict == "trustworthy"
    assert estimate is not None and estimate.size == FIRST_ROWS
    checks = approx.outcome.checks
    assert checks["subsample_rows"] == FIRST_ROWS
    assert f"{FIRST_ROWS} of the {ROWS} rows" in approx.outcome.verdict_message
    # against the whole data set at fresh draws of q and of q widened (the defensive
    # component): the error's spread, what moves the self-normalised weights, is within
    # NOISE and not beyond what the parts measured (its expected size: over eight
    # subsamples of this fit q's spread was 0.36-1.3 times it)
    q, rng = approx.gaussian(), np.random.default_rng(0)
    for proposal in (q, defensive(q)):
        points = proposal.sample(512, rng)
        error = estimate(points) - approx.log_density(points)
        spread = float(np.std(error, ddof=1))
        assert spread <= NOISE
        assert spread <= 2 * estimate.noise
