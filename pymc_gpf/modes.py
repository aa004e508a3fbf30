"""Modes that q does not cover: a search from dispersed starts, run with the verdict.

The verdict's importance check draws from q, so a mode that q's draws never reach is invisible to
it: on ``y ~ N(x^2, 1)`` GF and GPF fit one of the modes at ``x = +-2`` exactly and pass it
(the multimodal benchmark section). As multi-path Pathfinder (Zhang et al. 2022) does, L-BFGS
runs from several dispersed points, here draws of the prior, all of them in one batched call
of the log-density and gradient per iteration (:func:`ascend`). A path that enters q's bulk
(within :data:`SEPARATION` of q's sds of its mean in every coordinate) is q's mode and stops
there. An endpoint that converged (a gradient below :data:`GRADIENT_TOLERANCE` per q sd)
farther than :data:`SEPARATION` q sds from q's own mode is another mode; importance
sampling from Laplace's approximation at each mode (:func:`laplace`,
:func:`importance_mass`) gives its share of the mass, and the mixture of q and the other
modes says how far q's marginal means and sds are from that of the whole posterior
(:func:`mixture_errors`), in the verdict's own units.

What it cannot see: a mode no path reaches (a search from a few starts, not a proof), and mass
that is not at a mode (a funnel's neck, a ridge to the boundary: there L-BFGS does not
converge and the endpoint is not counted).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from scipy.linalg import solve_triangular
from scipy.special import logsumexp

from pymc_gpf.gaussian import LOG_2PI

__all__ = [
    "GRADIENT_TOLERANCE",
    "SEPARATION",
    "Ascent",
    "Laplace",
    "ModeSearch",
    "ascend",
    "importance_mass",
    "laplace",
    "mixture_errors",
    "search_modes",
]

ValueAndGrad = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]
LogDensity = Callable[[np.ndarray], np.ndarray]
MASS_DRAWS = 128  # antithetic pairs of Laplace's Gaussian per mode (importance_mass)

SEPARATION = 3.0  # q sds, in some coordinate, between two modes counted apart
# |d log p / dz| at a converged endpoint in every coordinate z of x = m + L z, q = N(m, L L^T)
GRADIENT_TOLERANCE = 1e-3
MEMORY = 10  # L-BFGS pairs kept
ARMIJO = 1e-4
MAX_SHRINKS = 20


@dataclass(frozen=True)
class Ascent:
    """Where L-BFGS ended from each start: ``points`` ``(K, D)``, their ``log_p`` and its
    gradient ``grad`` in the whitened coordinates, whether each ``converged`` (gradient
    test) or was ``absorbed`` (entered the region the caller named), and the points
    evaluated (``evaluations``)."""

    points: np.ndarray
    log_p: np.ndarray
    grad: np.ndarray
    converged: np.ndarray
    absorbed: np.ndarray
    evaluations: int
    iterations: int


def _two_loop(gradient: np.ndarray, s: np.ndarray, y: np.ndarray, kept: np.ndarray) -> np.ndarray:
    """L-BFGS's direction ``-H grad`` for every row (Nocedal & Wright, Algorithm 7.4):
    ``s``, ``y`` ``(K, M, D)`` the pairs, newest last; ``kept`` ``(K, M)`` which are set."""
    sy = np.einsum("kmd,kmd->km", s, y)
    rho = np.where(kept, 1.0 / np.where(kept, sy, 1.0), 0.0)
    q = gradient.copy()
    alpha = np.zeros(kept.shape)
    for m in range(s.shape[1] - 1, -1, -1):
        alpha[:, m] = rho[:, m] * np.einsum("kd,kd->k", s[:, m], q)
        q -= alpha[:, m, None] * y[:, m]
    newest = kept[:, -1]
    # s.y / y.y, with y scaled first: far out in a steep tail y.y can overflow
    big = np.maximum(np.max(np.abs(y[:, -1]), axis=1), 1e-300)
    unit = y[:, -1] / big[:, None]
    gamma = sy[:, -1] / big / np.where(newest, np.einsum("kd,kd->k", unit, unit), 1.0) / big
    gamma = np.where(newest, gamma, 1.0)
    r = gamma[:, None] * q
    for m in range(s.shape[1]):
        beta = rho[:, m] * np.einsum("kd,kd->k", y[:, m], r)
        r += (alpha[:, m] - beta)[:, None] * s[:, m]
    return -r


def ascend(
    value_and_grad: ValueAndGrad,
    starts: np.ndarray,
    centre: np.ndarray,
    factor: np.ndarray,
    *,
    max_iterations: int,
    tolerance: float = GRADIENT_TOLERANCE,
    absorbed: Callable[[np.ndarray], np.ndarray] | None = None,
) -> Ascent:
    """L-BFGS maximising ``log p`` from every row of ``starts`` ``(K, D)`` at once, in the
    coordinates ``z`` of ``x = centre + factor z`` (``factor`` lower triangular: e.g. a
    Gaussian fit's mean and the Cholesky factor of its covariance, so that ``log p`` is near
    isotropic there; a first step goes at most one unit of ``z``):
    ``value_and_grad`` maps points ``(k, D)`` to ``log p`` ``(k,)`` and its gradient
    ``(k, D)`` (``-inf`` where it is not finite). A row stops when its gradient in ``z`` is
    below ``tolerance`` in every coordinate, when ``absorbed(points)`` says so, when its line
    search fails, or after ``max_iterations``."""
    k, d = starts.shape

    def evaluate(z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        log_p, grad = value_and_grad(centre + z @ factor.T)
        return -log_p, -grad @ factor  # minimise -log p in z

    z = solve_triangular(factor, (starts - centre).T, lower=True).T
    f, g = evaluate(z)
    evaluations = k
    s = np.zeros((k, MEMORY, d))
    y = np.zeros((k, MEMORY, d))
    kept = np.zeros((k, MEMORY), dtype=bool)
    converged = np.max(np.abs(g), axis=1) < tolerance
    inside = absorbed(starts) if absorbed is not None else np.zeros(k, dtype=bool)
    active = np.isfinite(f) & ~converged & ~inside
    iteration = 0
    while active.any() and iteration < max_iterations:
        iteration += 1
        rows = np.flatnonzero(active)
        direction = _two_loop(g[rows], s[rows], y[rows], kept[rows])
        slope = np.einsum("kd,kd->k", direction, g[rows])
        downhill = slope < 0
        direction[~downhill] = -g[rows][~downhill]  # a lost direction: steepest descent
        slope[~downhill] = -np.einsum("kd,kd->k", g[rows][~downhill], g[rows][~downhill])
        # no curvature known yet: one unit (one of q's sds for q's factor) along the
        # gradient, scaled first (far out in a steep tail its square overflows). A longer
        # first step, as far as the start is from the centre, jumped over a narrow mode into
        # q's bulk (a 4 % mode at 8 sds, from a start beyond it)
        first = ~kept[rows, -1]
        longest = np.maximum(np.max(np.abs(g[rows]), axis=1), 1e-300)
        direction[first] = -g[rows][first] / longest[first, None]
        unit = direction[first]
        slope[first] = -np.einsum("kd,kd->k", unit, unit) * longest[first]
        length = np.where(first, np.minimum(1.0, longest), 1.0)
        pending = np.ones(len(rows), dtype=bool)
        new_f = np.full(len(rows), np.inf)
        new_g = np.zeros((len(rows), d))
        for _ in range(MAX_SHRINKS):
            trial = np.flatnonzero(pending)
            lp, gr = evaluate(z[rows[trial]] + length[trial, None] * direction[trial])
            evaluations += len(trial)
            tried, base, drop = length[trial], f[rows[trial]], slope[trial]
            ok = np.isfinite(lp) & (lp <= base + ARMIJO * tried * drop)
            new_f[trial[ok]], new_g[trial[ok]] = lp[ok], gr[ok]
            pending[trial[ok]] = False
            # the minimum of the quadratic through f, its slope and the value at the trial,
            # kept within [0.1, 0.5] of the trial (a tenth where the value is not finite)
            curvature = np.where(np.isfinite(lp), lp - base - drop * tried, np.inf)
            shrink = np.clip(-drop * tried / (2 * np.maximum(curvature, 1e-300)), 0.1, 0.5)
            length[trial[~ok]] *= shrink[~ok]
            if not pending.any():
                break
        moved = ~pending
        active[rows[pending]] = False  # no step lowers -log p: stuck
        rows, step = rows[moved], length[moved, None] * direction[moved]
        new_f, new_g = new_f[moved], new_g[moved]
        change = new_g - g[rows]
        curved = np.einsum("kd,kd->k", step, change) > 1e-10 * np.linalg.norm(
            step, axis=1
        ) * np.linalg.norm(change, axis=1)
        update = rows[curved]
        s[update] = np.roll(s[update], -1, axis=1)
        y[update] = np.roll(y[update], -1, axis=1)
        kept[update] = np.roll(kept[update], -1, axis=1)
        s[update, -1], y[update, -1], kept[update, -1] = step[curved], change[curved], True
        z[rows] += step
        f[rows], g[rows] = new_f, new_g
        converged[rows] = np.max(np.abs(new_g), axis=1) < tolerance
        if absorbed is not None:
            inside[rows] = absorbed(centre + z[rows] @ factor.T)
        active[rows] &= ~converged[rows] & ~inside[rows]
    points = centre + z @ factor.T
    return Ascent(points, -f, -g, converged, inside, evaluations, iteration)


@dataclass(frozen=True)
class Laplace:
    """Laplace's approximation at ``mode``: ``N(mode, H^-1)``, ``H`` the Hessian of
    ``-log p``, with ``H^-1 = factor factor^T`` and its diagonal ``variances``."""

    mode: np.ndarray
    factor: np.ndarray
    variances: np.ndarray


def laplace(
    value_and_grad: ValueAndGrad, mode: np.ndarray, factor: np.ndarray, step: float
) -> Laplace | None:
    """Laplace's approximation at ``mode``, ``H`` from central differences of the gradient
    along the columns of ``factor`` times ``step`` (``2 D`` points in one batched call);
    ``None`` where ``H`` is not positive definite (not a mode)."""
    d = len(mode)
    shifts = step * factor.T
    log_p, grad = value_and_grad(np.concatenate([mode + shifts, mode - shifts]))
    if not np.all(np.isfinite(log_p)):
        return None
    # in the coordinates z of x = factor z, where H is near the identity at a mode q fits
    hessian = -(grad[:d] - grad[d:]) @ factor / (2 * step)
    hessian = 0.5 * (hessian + hessian.T)
    try:
        root = np.linalg.cholesky(hessian)
    except np.linalg.LinAlgError:
        return None
    covariance_factor = solve_triangular(root, factor.T, lower=True).T  # factor root^-T
    return Laplace(mode, covariance_factor, np.sum(covariance_factor**2, axis=1))


def importance_mass(log_density: LogDensity, approximation: Laplace, normals: np.ndarray) -> float:
    """``log`` of the posterior mass around a mode, ``log E[p / g]`` for draws of Laplace's
    Gaussian ``g`` there: ``normals`` ``(S, D)`` and their negatives (antithetic), so that a
    Gaussian mode's mass is exact. Laplace's own ``log p(mode) - 1/2 log det (H / 2 pi)``
    is off wherever the mode is not Gaussian: for ``log p = -x^2/2 - x^4`` it gives 2.51
    where the mass is 1.56 (the draws: within 2 %)."""
    normals = np.concatenate([normals, -normals])
    points = approximation.mode + normals @ approximation.factor.T
    _, log_det = np.linalg.slogdet(approximation.factor)
    log_g = -0.5 * np.sum(normals**2, axis=1) - 0.5 * normals.shape[1] * LOG_2PI - log_det
    log_p = log_density(points)
    log_p = np.where(np.isfinite(log_p), log_p, -np.inf)  # NaN: no mass there
    return float(logsumexp(log_p - log_g) - np.log(len(points)))


def mixture_errors(
    means: np.ndarray, variances: np.ndarray, log_masses: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """How far the first component's marginals are from those of the mixture of all: per
    coordinate, ``|mean_0 - mean| / sd`` and ``|sd_0 / sd - 1|``, the mixture's weights
    proportional to ``exp(log_masses)``; ``means`` and ``variances`` ``(M, D)``."""
    weights = np.exp(log_masses - logsumexp(log_masses))[:, None]
    mean = np.sum(weights * means, axis=0)
    variance = np.sum(weights * (variances + (means - mean) ** 2), axis=0)
    sd = np.sqrt(variance)
    return np.abs(means[0] - mean) / sd, np.abs(np.sqrt(variances[0]) / sd - 1)


@dataclass(frozen=True)
class ModeSearch:
    """What :func:`search_modes` found: the ``starts`` it ran from, the ``evaluations``
    (points where ``log p`` and its gradient ran), the other ``modes`` ``(M, D)`` with
    their ``shares`` of the mass (q's mode included in the total), ``distances`` (the
    largest coordinate distance from q's mode, in q's sds) and ``axes`` (that coordinate),
    and the mixture's ``mean_errors`` / ``sd_errors`` per coordinate
    (:func:`mixture_errors`; zeros where no other mode was found)."""

    starts: int
    evaluations: int
    modes: np.ndarray
    shares: np.ndarray
    distances: np.ndarray
    axes: np.ndarray
    mean_errors: np.ndarray
    sd_errors: np.ndarray
    unconverged: int = 0  # endpoints outside q's bulk that did not converge
    density_evaluations: int = 0  # of the masses (importance_mass)
    notes: list[str] = field(default_factory=list)


def search_modes(
    value_and_grad: ValueAndGrad,
    log_density: LogDensity,
    starts: np.ndarray,
    mean: np.ndarray,
    covariance: np.ndarray,
    rng: np.random.Generator,
    *,
    max_iterations: int,
    step: float,
) -> ModeSearch:
    """L-BFGS from ``starts`` (:func:`ascend`) in the coordinates whitened by the Gaussian
    q ``N(mean, covariance)``; the endpoints that converged away from q's bulk compared with
    q's own mode (L-BFGS from ``mean``) by their masses (:func:`laplace` with ``step``, its
    finite-difference step in q's sds, then :func:`importance_mass` with draws from
    ``rng`` and ``log_density``)."""
    starts = starts[np.all(np.isfinite(starts), axis=1)]  # e.g. a prior draw that overflowed
    variances = np.diagonal(covariance).copy()
    sd = np.sqrt(variances)
    d = len(mean)
    none = np.zeros((0, d))
    result = dict(
        starts=len(starts), modes=none, shares=np.zeros(0), distances=np.zeros(0),
        axes=np.zeros(0, int), mean_errors=np.zeros(d), sd_errors=np.zeros(d),
    )  # fmt: skip
    try:
        factor = np.linalg.cholesky(covariance)
    except np.linalg.LinAlgError:  # q collapsed in some direction: no coordinates to search in
        return ModeSearch(
            evaluations=0, **result, notes=["q's covariance is singular: no search"]
        )  # fmt: skip
    if not len(starts):
        return ModeSearch(evaluations=0, **result)

    def in_bulk(points: np.ndarray) -> np.ndarray:
        return np.max(np.abs(points - mean) / sd, axis=1) < SEPARATION

    paths = ascend(
        value_and_grad, starts, mean, factor, max_iterations=max_iterations, absorbed=in_bulk
    )
    evaluations = paths.evaluations
    away = ~paths.absorbed & np.isfinite(paths.log_p)
    found = away & paths.converged
    result["unconverged"] = int(np.sum(away & ~found))
    if not found.any():
        return ModeSearch(evaluations=evaluations, **result)
    own = ascend(value_and_grad, mean[None], mean, factor, max_iterations=max_iterations)
    evaluations += own.evaluations
    centre = own.points[0]
    candidates = []  # the highest first, each apart from q's mode and from those kept
    for i in np.argsort(-paths.log_p):
        point = paths.points[i]
        if found[i] and all(
            np.max(np.abs(point - other) / sd) >= SEPARATION for other in [centre, *candidates]
        ):
            candidates.append(point)
    if not candidates:
        return ModeSearch(evaluations=evaluations, **result)
    approximations = []
    for point in [centre, *candidates]:
        approximations.append(laplace(value_and_grad, point, factor, step))
        evaluations += 2 * d
    if approximations[0] is None:
        return ModeSearch(
            evaluations=evaluations, **result,
            notes=["q's own mode has no positive-definite Hessian: no masses compared"],
        )  # fmt: skip
    kept = [a for a in approximations if a is not None]
    if len(kept) == 1:
        return ModeSearch(evaluations=evaluations, **result)
    log_masses = np.array([
        importance_mass(log_density, a, rng.standard_normal((MASS_DRAWS, d))) for a in kept
    ])  # fmt: skip
    shares = np.exp(log_masses - logsumexp(log_masses))
    means = np.array([mean, *(a.mode for a in kept[1:])])
    spreads = np.array([variances, *(a.variances for a in kept[1:])])
    mean_errors, sd_errors = mixture_errors(means, spreads, log_masses)
    modes = means[1:]
    apart = np.abs(modes - centre) / sd
    result |= dict(
        modes=modes, shares=shares[1:], distances=np.max(apart, axis=1),
        axes=np.argmax(apart, axis=1), mean_errors=mean_errors, sd_errors=sd_errors,
        density_evaluations=2 * MASS_DRAWS * len(kept),
    )  # fmt: skip
    return ModeSearch(evaluations=evaluations, **result)
