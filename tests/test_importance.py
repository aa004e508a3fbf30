"""The streamed importance pool (:mod:`pymc_gpf.importance`), against a closed form: q and
the posterior are Gaussians, so the weights, the resampled draws' moments and the replayed
draws are known exactly."""

from __future__ import annotations

import numpy as np
import pytest

from scipy import stats

from pymc_gpf import importance
from pymc_gpf.gaussian import GaussianQ

D = 3


def _posterior(points: np.ndarray) -> np.ndarray:
    """``N(0, I)``, unnormalised."""
    return stats.norm.logpdf(points).sum(axis=1) + 5.0


def _q() -> GaussianQ:
    """``N(0.3, 0.9^2 I)``: a little off and narrower than the posterior."""
    return GaussianQ(np.full(D, 0.3), (np.arange(D),), (np.full(D, 0.9),))


def test_the_pool_keeps_no_draws_and_replays_them_exactly(monkeypatch):
    """Drawn in chunks of 100 rows (a small chunk, to have many), the pool holds only
    log-densities; ``take`` replays any rows, and the log-densities it stored are those of
    the replayed points, for q, its widened copy and the posterior."""
    monkeypatch.setattr(importance, "CHUNK_NUMBERS", 100 * D)
    seen: list[tuple[int, np.ndarray]] = []
    pool = importance.ImportancePool(_q(), _posterior, np.random.default_rng(1))
    pool.add(1000, lambda first, points: seen.append((first, points)))
    pool.grow_to(3000)
    assert pool.size == 3000 and len(seen) == 13  # 10 chunks of q's draws, 3 of the wide
    kept = [v for v in vars(pool).values() if isinstance(v, np.ndarray)]
    kept += [a for part in pool._parts for a in part]
    assert all(a.ndim == 1 for a in kept), "an S x D array is kept"
    log_p, log_q, log_wide, from_q = pool.arrays
    assert len(log_p) == 3000 + 750 and from_q.sum() == 3000
    rows = np.array([0, 99, 100, 1249, 1250, 2000, 3749])
    points = pool.take(rows)
    np.testing.assert_allclose(log_p[rows], _posterior(points))
    np.testing.assert_allclose(log_q[rows], _q().logpdf(points))
    np.testing.assert_allclose(log_wide[rows], _q().widened(2.0).logpdf(points))
    first, chunk = seen[1]
    np.testing.assert_array_equal(pool.take(np.arange(first, first + len(chunk))), chunk)


def test_a_copy_grows_as_the_pool_would_and_leaves_it_alone():
    pool = importance.ImportancePool(_q(), _posterior, np.random.default_rng(2)).grow_to(4096)
    grown = pool.copy().grow_to(8192)
    assert pool.size == 4096 and grown.size == 8192
    again = importance.ImportancePool(_q(), _posterior, np.random.default_rng(2)).grow_to(8192)
    np.testing.assert_array_equal(grown.arrays[0], again.arrays[0])


@pytest.mark.filterwarnings("error")
def test_resampled_draws_are_the_posterior_s():
    """q = N(0.3, 0.81) against N(0, 1): the ratios' tail has k = 1 - 0.81 = 0.19 < 0.7
    (reliable, no warning); 4000 draws resampled from 16 384 (and their defensive share)
    have the posterior's mean and variance: within 4 standard errors (resampling with
    replacement from a pool about four times larger: about 1.25 times an iid draw's)."""
    pool = importance.ImportancePool(_q(), _posterior, np.random.default_rng(3))
    draws = pool.grow_to(16384).resample(4000, np.random.default_rng(4))
    se = 1.25 / np.sqrt(4000)
    np.testing.assert_array_less(np.abs(draws.mean(axis=0)), 4 * se)
    np.testing.assert_array_less(np.abs(draws.var(axis=0) - 1.0), 4 * se * np.sqrt(2))
    assert pool.mixture_weights()[1] < 0.5


def test_a_large_model_gets_fewer_draws():
    assert importance.capped(16384, 100) == 16384
    assert importance.capped(16384, 10_000) == importance.MIN_POOL
    assert importance.capped(1000, 10_000) == 1000  # never more than asked
