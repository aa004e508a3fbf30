"""WVGD's fitted q in NumPy: the mixture ``sum_j beta_j q~_j`` of local Gaussians, each
truncated to its particle's Voronoi cell (Ambrogioni et al. 2018, eq. 8, 10, 22-23).

:class:`MixtureQ` is to WVGD what :class:`pymc_gpf.gaussian.GaussianQ` is to GPF and GF: the
approximation draws from it and evaluates its density.
"""

from __future__ import annotations

import functools

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pymc_gpf.checks import seed_sequence
from pymc_gpf.gaussian import LOG_2PI

__all__ = ["EMPTY_LOG_MASS", "MixtureProposal", "MixtureQ", "estimate_log_mass", "nearest"]

EMPTY_LOG_MASS = -1e300  # "no estimate yet": finite, so the step guard accepts it
LOCATION_DRAWS = 256  # per cell (at most), for the moments the stopping test watches


@functools.cache
def _base_normals(ndim: int) -> np.ndarray:
    """``(LOCATION_DRAWS, ndim)`` standard normals, the same for every fit."""
    return np.random.default_rng(0).standard_normal((LOCATION_DRAWS, ndim))


def nearest(points: np.ndarray, particles: np.ndarray) -> np.ndarray:
    """NumPy twin of :func:`pymc_gpf.wvgd.flow.nearest_particle`."""
    sq = (points**2).sum(1)[:, None] - 2 * points @ particles.T + (particles**2).sum(1)
    return np.argmin(sq, axis=1)


def normalised_weights(log_mass: np.ndarray, count: np.ndarray) -> np.ndarray:
    """``beta_j`` from the running estimates (cells never estimated get 0; uniform before
    the first step)."""
    seen = count > 0
    if not seen.any():
        return np.full(len(count), 1.0 / len(count))
    log_est = np.where(seen, log_mass - np.log(np.where(seen, count, 1)), -np.inf)
    weights = np.exp(log_est - log_est.max())
    return weights / weights.sum()


@dataclass(frozen=True)
class MixtureQ:
    """``sum_j beta_j q~_j``: ``particles`` ``z_j`` ``(J, D)``, the local Gaussians'
    ``means`` and ``scales`` ``(J, D)``, the cell ``weights`` ``beta`` and each cell's running
    ``acceptance`` rate (``nan`` before any step; it sizes the rejection sampler's batches).
    All in the coordinates ``u`` of ``x = shift + factor u`` (the model's own without a
    ``factor``): cells, local Gaussians and draws there, mapped to ``x`` on the way out."""

    particles: np.ndarray
    means: np.ndarray
    scales: np.ndarray
    weights: np.ndarray
    acceptance: np.ndarray
    shift: np.ndarray | None = None
    factor: np.ndarray | None = None

    def to_x(self, u: np.ndarray) -> np.ndarray:
        """Points ``(K, D)`` of the mixture's coordinates in the model's."""
        return u if self.factor is None else self.shift + u @ self.factor.T

    def to_u(self, x: np.ndarray) -> np.ndarray:
        if self.factor is None:
            return x
        return np.linalg.solve(self.factor, (x - self.shift).T).T

    @property
    def log_det(self) -> float:
        """``log |det factor|``: the density of ``x`` is that of ``u`` over it."""
        return 0.0 if self.factor is None else float(np.linalg.slogdet(self.factor)[1])

    def sample(self, draws: int, rng: np.random.Generator) -> np.ndarray:
        """Choose a cell by ``beta``, then rejection-sample its local Gaussian inside it."""
        particles, means, scales = self.particles, self.means, self.scales
        d = particles.shape[1]
        counts = rng.multinomial(draws, self.weights)
        out = np.empty((draws, d), dtype=particles.dtype)
        rates = np.maximum(np.nan_to_num(self.acceptance, nan=1.0), 1e-3)
        filled = 0
        for cell in np.flatnonzero(counts):
            need, tries = counts[cell], 0
            while need > 0:
                batch = max(2 * need, int(need / rates[cell]))
                x = means[cell] + scales[cell] * rng.standard_normal((batch, d))
                keep = x[nearest(x, particles) == cell][:need]
                out[filled : filled + len(keep)] = keep
                filled += len(keep)
                need -= len(keep)
                tries += 1
                if tries > 1000 and need > 0:
                    raise RuntimeError(
                        f"WVGD sampling: cell {cell} accepts almost none of its local "
                        "Gaussian's draws (its particle lies outside the Gaussian's mass); "
                        "fit longer or with more draws_per_particle."
                    )
        return self.to_x(out[rng.permutation(draws)])

    def location(self) -> tuple[np.ndarray, np.ndarray]:
        """What the stochastic stopping test watches, with its units: q's mean in units of
        its sds, the log of those sds, and the cell weights (unit 1).

        q's moments are those of the truncated local Gaussians, from ``LOCATION_DRAWS``
        fixed standard normal draws per cell (common random numbers: a fixed function of
        q's parameters, with no random state). A local Gaussian's untruncated sd is not
        watched: along a direction in which its cell is short the sd is barely determined
        and wanders (a middle cell of three particles on N(0, 1)) while q does not change.
        The particles enter through the weights, their cells' masses: two particles on
        N(0, 1) drifting together hardly move q's moments but move each weight by 0.4 times
        the drift. (Watching each particle's distance from the origin as well brought the
        Lloyd-Max errors at tol = 0.01 from up to 0.058 to up to 0.029, but made fits in
        10-90 dimensions 2-4 times as long and a 20-d type-II fit run out of its 10 000
        steps: the particles' radial positions settle slowly and hardly change q. Their
        positions and mutual distances never settled in 3-d: a rotation of the
        configuration costs nothing where the target is near N(0, I), as whitening makes
        it.)"""
        particles, weights = self.particles.astype(float), self.weights
        j, d = particles.shape
        # at most ~2M numbers per call (it runs every step)
        k = int(np.clip(2**21 // (j * d), 32, LOCATION_DRAWS))
        draws = self.means[:, None, :] + self.scales[:, None, :] * _base_normals(d)[:k]
        flat = draws.reshape(-1, d)
        inside = nearest(flat, particles).reshape(j, -1) == np.arange(j)[:, None]
        count = inside.sum(axis=1)[:, None]
        empty = count == 0  # no draw in the cell: its particle, with no spread
        total = np.maximum(count, 1)
        cell_mean = np.where(empty, particles, np.einsum("jk,jkd->jd", inside, draws) / total)
        cell_square = np.where(
            empty, particles**2, np.einsum("jk,jkd->jd", inside, draws**2) / total
        )
        mean = weights @ cell_mean
        sd = np.sqrt(np.maximum(weights @ cell_square - mean**2, 1e-300))
        values = np.concatenate([mean, np.log(sd), weights])
        units = np.concatenate([sd, np.ones(d), np.ones(j)])
        return values, units

    def rough_location(self) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`location` for minibatch fits: the cell-weighted particles and their spread
        plus the local variances, in the same units. There the running cell weights, whose
        noise does not fall with the step size (they average over ``weight_memory`` steps),
        move q's mean by about its sd from step to step, while the fit's end estimates the
        weights afresh on the full data."""
        weights = self.weights[:, None]
        mean = np.sum(weights * self.particles, axis=0)
        spread = np.square(self.particles - mean) + np.square(self.scales)
        sd = np.sqrt(np.maximum(np.sum(weights * spread, 0), 1e-300))
        return np.concatenate([mean, np.log(sd)]), np.concatenate([sd, np.ones_like(sd)])

    def logpdf(self, points: np.ndarray, rng: np.random.Generator, n_draws: int) -> np.ndarray:
        """``log beta_j + log q_j(x) - log Z_j`` for the cell ``j`` containing ``x``, the
        normalisers ``Z_j = q_j(L_j)`` estimated from ``n_draws`` draws of each ``q_j``
        (``points`` in the model's coordinates)."""
        particles, means, scales = self.particles, self.means, self.scales
        points = self.to_u(points)
        log_z = np.empty(len(particles))
        for j in range(len(particles)):
            x = means[j] + scales[j] * rng.standard_normal((n_draws, particles.shape[1]))
            log_z[j] = np.log(np.mean(nearest(x, particles) == j))
        cell = nearest(points, particles)
        z = (points - means[cell]) / scales[cell]
        local = -0.5 * np.sum(z**2 + LOG_2PI, axis=1) - np.sum(np.log(scales[cell]), axis=1)
        with np.errstate(divide="ignore"):
            return np.log(self.weights[cell]) + local - log_z[cell] - self.log_det


class MixtureProposal:
    """:class:`MixtureQ` as an importance-sampling proposal: its density's cell normalisers
    are estimated from the caller's random stream."""

    def __init__(self, q: MixtureQ, rng: np.random.Generator, n_draws: int = 100_000):
        self.q, self.rng, self.n_draws = q, rng, n_draws

    @property
    def ndim(self) -> int:
        return self.q.particles.shape[1]

    def sample(self, draws: int, rng: np.random.Generator) -> np.ndarray:
        return self.q.sample(draws, rng)

    def logpdf(self, points: np.ndarray) -> np.ndarray:
        rng = np.random.default_rng(seed_sequence(self.rng))
        return self.q.logpdf(points, rng, self.n_draws)


def estimate_log_mass(
    q: MixtureQ, log_density: Callable[[np.ndarray], np.ndarray], draws: int, rng
) -> tuple[np.ndarray, int]:
    """Each cell's posterior mass (eq. 10) from ``draws`` fresh draws of its local Gaussian
    and ``log_density`` (the authors' post-processing): the log masses (``EMPTY_LOG_MASS``
    for a cell none of whose draws fell in it) and the number of densities evaluated."""
    particles, means, scales = q.particles, q.means, q.scales
    log_det = q.log_det
    log_mass = np.full(len(particles), EMPTY_LOG_MASS)
    evaluated = 0
    for j in range(len(particles)):
        eps = rng.standard_normal((draws, particles.shape[1]))
        x = means[j] + scales[j] * eps
        keep = nearest(x, particles) == j
        if not keep.any():
            continue
        log_q = -0.5 * np.sum(eps[keep] ** 2 + LOG_2PI, axis=1) - np.sum(np.log(scales[j]))
        ratio = log_density(q.to_x(x[keep])) + log_det - log_q
        evaluated += int(keep.sum())
        top = np.max(ratio)
        log_mass[j] = top + np.log(np.sum(np.exp(ratio - top)) / draws)
    return log_mass, evaluated
