"""When a Langevin ensemble has burnt in, its step size, its draws and when it stops.

Plain Python between steps (:class:`SamplingControl`, a :class:`pymc_gpf.control.Control`):

* **Burn-in.** The unadjusted scheme on a Gaussian with variance ``sigma^2`` in its stiffest
  direction keeps a stationary variance ``sigma^2 / (1 - eta / (2 sigma^2))``
  (:func:`pymc_gpf.ensemble.flow.ula_gaussian_variance`), so ``eta = 0.1 / L`` with ``L``
  the largest curvature of ``V`` bounds that bias by 5 %. ``L`` is measured at every step
  from the ensemble itself (:func:`curvature`: the largest Rayleigh quotient of the drift's
  Jacobian over the particles' span, exact for a Gaussian target once ``N > D``; on the
  whole data set also along each particle's last move, :func:`move_curvature`, which sees
  inside a mode when the particles sit in several). With a
  preconditioner ``M`` the same holds in its metric (``L`` the largest eigenvalue of
  ``M A``). ``M`` is a Gaussian fit's covariance from the first step (set by the method,
  ``reestimate = False``), or re-estimated at the end of every window from the ensemble's
  covariance (:func:`ensemble_preconditioner`; minibatches), so that a badly scaled or
  correlated posterior mixes as fast as a round one. Burn-in ends once the objective (mean
  ``V``, plus the MMD term) has stopped falling between two windows (the one-sided 5 % test of
  :class:`pymc_gpf.control.Stochastic`); ``eta`` and ``M`` are then frozen.
* **Outliers.** During burn-in a particle far above the others in ``V`` (:func:`outlying`)
  takes the state of one of the best: alone, it would set ``L`` and freeze all of them.
* **Minibatches** (SGLD). When every step reads a fraction ``f`` of the rows, the gradient's
  noise has about ``(1/f - 1)`` times the likelihood's curvature as covariance (the Fisher
  identity, for a well-specified model), which adds ``eta^2 (1/f - 1) L`` to the
  ``2 eta`` of injected variance per step in the stiffest preconditioned direction; at the
  end of burn-in ``eta`` is therefore multiplied by ``f``, which keeps the total excess
  variance near the same 5 % (burn-in itself runs at ``0.1 / L``: its draws are discarded;
  the preconditioner it estimates is wider than the posterior where the gradient noise
  inflated the spread, which costs mixing speed, not accuracy, as ``L`` is measured in
  the same metric).
* **Sampling.** Every ``thin``-th state of every particle is a draw (chain = particle); the
  first half of the draws counts as further burn-in (:meth:`SamplingState.kept`). At
  geometrically spaced numbers of draws (every 25 %, at least a window and 4 D steps
  apart) the fit **converges** once the smallest bulk and tail effective sample size over
  the coordinates reaches ``target_ess`` (by default :func:`accuracy_ess`: the largest
  Monte Carlo error of the means below 0.08 posterior sds, 1,493 for ``D = 25``) and the
  largest rank-normalised split R-hat (Vehtari et al. 2021, through arviz-stats) is within
  1.01 times what ``N`` well-mixed chains of that ESS show (:func:`chain_diagnostics`).
* Draws are kept in memory up to ``MAX_STORED`` numbers (``N D`` per draw); beyond, every
  other one is dropped and ``thin`` doubles (a large model's long run stays within 160 MB).
* A move the step refused (non-finite) quarters ``eta``; 30 in a row **stall** the fit.
"""

from __future__ import annotations

import math
import statistics

from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass
from typing import ClassVar, NamedTuple

import numpy as np

from arviz_stats.base import array_stats

from pymc_gpf.control import GO_ON, Z_ONE_SIDED_5, Control, Decision, Series
from pymc_gpf.ensemble import flow

__all__ = [
    "Draws",
    "SamplingControl",
    "SamplingState",
    "Trace",
    "accuracy_ess",
    "chain_diagnostics",
    "curvature",
    "ensemble_preconditioner",
    "move_curvature",
    "outlying",
    "outlying_restart",
]

STEP_PER_CURVATURE = 0.1  # eta * L: at most 5 % excess variance on a Gaussian target
MAX_RHAT = 1.01
# the automatic target ESS keeps the largest Monte Carlo error of the D posterior means below
# this many posterior sds (95 %): the benchmarks' "accurate" bar is 0.1, and the unadjusted
# scheme's own bias needs part of it
MEAN_ACCURACY = 0.08
# on minibatches, as the other methods' default tol (0.05 against 0.03): SGLD's step is the
# batch's share of the full-data one, so its chains mix that much more slowly
MINIBATCH_ACCURACY = 0.12
MIN_ESS = 400  # Vehtari et al. (2021): below, R-hat and ESS themselves are unreliable
CHECK_SPACING = 4  # convergence checks are at least this many draws per coordinate apart
MAX_STORED = 20_000_000  # numbers kept as draws (160 MB); beyond, the draws are thinned
MIN_STORED = 8  # draws kept whatever their size (a model too large for MAX_STORED)
BURN_IN_KEPT = 20  # the last burn-in states kept: a fit that never left burn-in returns them
APART = 4.0  # a chain whose mean is this many within-chain sds from the others' sits apart
RIDGE = 1e-6  # the least weight of the diagonal in the preconditioner
# during burn-in, a particle whose V exceeds the median by this many median absolute
# deviations of V (at least one nat each) restarts from the state of one of the best
OUTLYING = 100.0


def curvature(
    particles: np.ndarray,
    drift: np.ndarray,
    preconditioner: tuple[np.ndarray, np.ndarray] | None = None,
) -> float:
    """The largest curvature of the potential over the ensemble's span, in the metric of the
    preconditioner ``M = diag(d) + F^T F`` (the largest eigenvalue of ``M A``; ``M = I`` if
    ``None``). With deviations ``Z`` and drift deviations ``G``, a quadratic ``V`` has
    ``G = -Z A``; over ``span(Z^T)`` that eigenvalue is the largest of the pencil
    ``(-G Z^T, Z M^(-1) Z^T)``, an ``N x N`` problem (:func:`_inverse_gram`), never
    ``D x D``; exact for a Gaussian target once ``N > D``."""
    z = particles - particles.mean(axis=0)
    g = drift - drift.mean(axis=0)
    gram = z @ z.T if preconditioner is None else _inverse_gram(z, *preconditioner)
    values, vectors = np.linalg.eigh(0.5 * (gram + gram.T))
    keep = values > values[-1] * len(z) * np.finfo(float).eps
    if not keep.any():
        return float("nan")
    basis = vectors[:, keep] / np.sqrt(values[keep])
    hessian = basis.T @ (-g @ z.T) @ basis
    return float(np.max(np.linalg.eigvalsh(0.5 * (hessian + hessian.T))))


def _inverse_gram(z: np.ndarray, diagonal: np.ndarray, factor: np.ndarray) -> np.ndarray:
    """``Z M^(-1) Z^T`` for ``M = diag(d) + F^T F`` without cancellation (the diagonal may be
    a millionth of the factor's scale): with ``d^(-1/2) F^T = V s U^T`` (thin SVD),
    ``d^(1/2) M^(-1) d^(1/2) = (I - V V^T) + V (1 + s^2)^(-1) V^T``, and the first term is
    applied as the residual of ``Z d^(-1/2)`` off ``span(V)``. ``O(N D min(N, D))``."""
    root = np.sqrt(diagonal)
    scaled = z / root
    _, s, vt = np.linalg.svd(factor / root, full_matrices=False)
    along = scaled @ vt.T
    residual = scaled - along @ vt
    return residual @ residual.T + (along / (1.0 + s**2)) @ along.T


def move_curvature(
    moves: np.ndarray, drift_changes: np.ndarray, preconditioner: tuple | None = None
) -> float:
    """The largest curvature of the potential along the particles' last moves, in the
    preconditioner's metric: ``-dg . dtheta / |dtheta|^2_(M^-1)`` per particle. Each move
    is local, so this sees the curvature inside a mode even when the particles sit in
    different ones (where :func:`curvature`'s secants between particles do not). Only on
    the whole data set: with minibatches the two drifts come from different rows."""
    if preconditioner is None:
        lengths = np.sum(moves**2, axis=1)
    else:
        lengths = np.diag(_inverse_gram(moves, *preconditioner))
    moved = lengths > 0
    if not moved.any():
        return float("nan")
    return float(np.max(-np.sum(drift_changes * moves, axis=1)[moved] / lengths[moved]))


def ensemble_preconditioner(deviations: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """``M`` as ``(diagonal, factor)`` from the ensemble's deviations from its mean at every
    step of the last window; the factor has :func:`~pymc_gpf.ensemble.flow.factor_rows`
    rows.

    With ``D`` rows, ``M`` is the deviations' pooled covariance ``S`` plus ``2 RIDGE`` times
    its diagonal (one in the Cholesky factor, one as the diagonal term: both positive
    definite): a window's states estimate
    ``S`` far better than the ``N`` particles of one step, whose spread of eigenvalues
    (Marchenko-Pastur) would set a smaller ``eta``. With ``N`` rows (``D > 4 N``),
    ``M = alpha diag(v) + (1 - alpha) S_now``: the current ensemble's covariance (rank
    ``N - 1``, factor its scaled deviations) and the window's averaged variances ``v``, with
    ``alpha = 1 - (N - 1) / D`` the share of the dimensions the deviations cannot span.
    More of the diagonal would inflate ``M`` in a posterior's narrow, correlated directions,
    and with it the curvature that sets ``eta``. (The spread between particles, not each
    particle's own: over a window a particle explores too little of a wide direction to
    estimate it, and the shortfall would feed on itself.)"""
    n, d = deviations[-1].shape
    floor = np.finfo(float).tiny ** 0.5  # a coordinate that did not move keeps a scale
    if flow.factor_rows(n, d) == d:
        pooled = np.concatenate(deviations)
        covariance = pooled.T @ pooled / (len(pooled) - len(deviations))
        variances = np.maximum(np.diag(covariance), floor)
        factor = np.linalg.cholesky(covariance + RIDGE * np.diag(variances)).T
        return RIDGE * variances, factor
    variances = np.mean([np.sum(z**2, axis=0) for z in deviations], axis=0) / (n - 1)
    alpha = 1.0 - (n - 1) / d
    factor = np.sqrt((1.0 - alpha) / (n - 1)) * deviations[-1]
    return alpha * np.maximum(variances, floor), factor


def outlying(potential: np.ndarray) -> np.ndarray:
    """Which particles sit far above the others in ``V = -log p`` ``(N,)`` (or where it is not
    finite): more than :data:`OUTLYING` median absolute deviations (at least one nat each)
    above the median. One particle started where the log-density explodes (an ARMA's
    non-invertible region, ``V ~ 1e117``) sets the largest curvature, hence a step size of
    1e-94 for all; a minor mode sits a few nats up, and a chain at the posterior's spread
    some ``sqrt(D)``."""
    finite = potential[np.isfinite(potential)]
    if not len(finite):
        return np.zeros(len(potential), dtype=bool)
    median = np.median(finite)
    spread = max(float(np.median(np.abs(finite - median))), 1.0)
    return ~(potential - median <= OUTLYING * spread)


def outlying_restart(logp: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """The particles that are :func:`outlying` in ``-logp`` and the ones whose state they
    take: the best as many, the worst from the best; ``None`` when none is."""
    far = outlying(-logp)
    if not far.any():  # never all: the median is not far above itself
        return None
    best = np.argsort(-logp)[: int(far.sum())]
    worst = np.flatnonzero(far)[np.argsort(logp[far])]
    return worst, best


def accuracy_ess(ndim: int, accuracy: float = MEAN_ACCURACY) -> int:
    """The ESS at which the largest Monte Carlo error of ``ndim`` posterior means stays below
    ``accuracy`` posterior sds with 95 % probability: ``(z / accuracy)^2`` with ``z`` the
    normal quantile of a two-sided 5 % shared by the coordinates (Bonferroni). A fixed 400
    (Vehtari et al. 2021's minimum for reliable R-hat) leaves each mean an error of 0.05 sd,
    and the largest of 25 about 0.11: measured on german_credit (D = 25), 0.08-0.105 at
    ESS 400-620, 0.046-0.065 at this rule's 1,493 (3 seeds each). At least ``MIN_ESS``."""
    z = statistics.NormalDist().inv_cdf(1.0 - 0.025 / max(int(ndim), 1))
    return max(math.ceil((z / accuracy) ** 2), MIN_ESS)


def chain_diagnostics(draws: np.ndarray) -> tuple[float, float, float]:
    """Smallest bulk/tail ESS, largest R-hat and largest R-hat relative to well-mixed chains
    of draws ``(S, N, D)`` (chain = particle). ``N`` split chains that mix perfectly still
    show ``R-hat^2 = 1 + 2N / ESS`` (between-chain variance of means of ``ESS / 2N``
    effective draws each; Margossian et al. 2024 on many short chains), so a fixed 1.01
    would ask for about 100 effective draws per particle: the third number divides that
    out."""
    draws = np.moveaxis(draws, 0, -1)  # (N, D, S)
    draws = np.moveaxis(draws, 1, 0)  # (D, N, S)
    bulk = array_stats.ess(draws, chain_axis=-2, draw_axis=-1, method="bulk")
    tail = array_stats.ess(draws, chain_axis=-2, draw_axis=-1, method="tail", prob=0.05)
    rhat = array_stats.rhat(draws, chain_axis=-2, draw_axis=-1)
    excess = rhat / np.sqrt(1.0 + 2 * draws.shape[1] / bulk)
    return float(np.min(np.minimum(bulk, tail))), float(np.max(rhat)), float(np.max(excess))


class Draws(NamedTuple):
    """Every ``thin``-th state after burn-in, kept within ``MAX_STORED`` numbers, and when
    to check them."""

    draws: Series
    thin: int
    next_check: int  # the number of draws at which to test convergence next

    def add(self, step: int, particles: np.ndarray, window: int) -> tuple[Draws, bool]:
        """Keep ``particles`` if ``step`` (after burn-in) is on the grid; whether a
        convergence check is due. Checks come at geometrically spaced counts: each costs
        ``O(D draws)``, so all of them together cost a constant factor of the last one. A
        check also costs a few milliseconds per coordinate whatever the draws (arviz-stats
        loops over them in Python: 4 s for D = 1930), about as much as a network's step
        costs per coordinate, so checks are also at least ``4 D`` steps apart."""
        if step % self.thin:
            return self, False
        store = self._replace(draws=self.draws.add(np.array(particles)))
        # a window and 4 D steps, whatever the thinning: in draws, fewer as thin grows
        steps = max(window, CHECK_SPACING * particles.shape[1])
        spacing = math.ceil(steps / store.thin)
        capacity = max(MAX_STORED // particles.size, MIN_STORED)
        if len(store.draws) == 1:
            store = store._replace(next_check=max(store.next_check, spacing))
        if len(store.draws) > capacity:
            store = store._thinned()
        if len(store.draws) < store.next_check:
            return store, False
        next_check = max(store.next_check + spacing, int(1.25 * len(store.draws)))
        return store._replace(next_check=next_check), True

    def _thinned(self) -> Draws:
        """Keep every other draw and double ``thin``: the draws then stay within
        ``MAX_STORED`` numbers whatever the run's length. Draw ``i`` was taken ``thin (i + 1)``
        steps after burn-in, so the odd ones are those on the doubled grid."""
        draws = Series.of(self.draws.items()[1::2])
        return Draws(draws, self.thin * 2, max(len(draws) + 1, self.next_check // 2))


class Trace(NamedTuple):
    """Every step's mean ``V``, MMD term and kernel bandwidth (the ``fit`` group's)."""

    mean_v: Series
    mmd: Series
    bandwidth: Series

    def add(self, info: dict) -> Trace:
        return Trace(*(values.add(info[key]) for key, values in self._asdict().items()))


def _falling(previous: tuple[float, float] | None, current: tuple[float, float]) -> bool:
    """Whether the window mean fell significantly (one-sided 5 %) since the last window."""
    if previous is None:
        return True
    return previous[0] - current[0] > Z_ONE_SIDED_5 * math.sqrt(previous[1] + current[1])


def _window_stats(values: Sequence[float]) -> tuple[float, float]:
    """Mean and the variance of the mean of a window (iid; a conservative plateau test)."""
    values = np.asarray(values, dtype=float)
    return float(values.mean()), float(values.var(ddof=1) / len(values))


class SamplingState(NamedTuple):
    """:class:`SamplingControl`'s state: the step size and burn-in, the draws and their
    diagnostics, and the current window's values."""

    rate: float  # the step size
    store: Draws
    trace: Trace
    steps: int = 0
    rejections: int = 0
    burn_in: int | None = None  # the step burn-in ended at
    restarted: int = 0  # particles restarted during burn-in (:func:`outlying`)
    # a chain whose log p is below this when burn-in would end has not reached the posterior
    # (set by the method from a trustworthy Gaussian fit); such chains start again once
    lost_below: float = -math.inf
    rescued: int = 0  # particles started again at the Gaussian fit's draws
    values: tuple[float, ...] = ()
    deviations: tuple[np.ndarray, ...] = ()  # the ensemble's deviations in this window
    last: tuple[np.ndarray, np.ndarray] | None = None  # the last particles, drift
    curvature: float = float("nan")
    shrink: float = 1.0  # the guard's factor on the curvature's step size
    previous: tuple[float, float] | None = None
    ess: float = float("nan")
    rhat: float = float("nan")
    rhat_excess: float = float("nan")
    recent: tuple[np.ndarray, ...] = ()  # the last BURN_IN_KEPT states of burn-in
    # re-estimate the preconditioner from the ensemble during burn-in (not when it
    # starts as a Gaussian fit's covariance: far from the posterior, the ensemble's
    # spread is the start's, not the posterior's)
    reestimate: bool = True
    converged: bool = False  # the last convergence check passed

    @property
    def draws(self) -> list[np.ndarray]:
        return self.store.draws.items()

    @property
    def thin(self) -> int:
        return self.store.thin

    def kept(self) -> list[np.ndarray]:
        """The draws that count: the second half of those collected (the first half is
        further burn-in, Gelman & Rubin's halving, so a burn-in that ended too early is
        discarded as the run grows)."""
        draws = self.draws
        return draws[len(draws) // 2 :]

    def apart(self) -> tuple[int, str, float] | None:
        """A chain whose draws' mean sits apart from the others' (a particle stuck in
        another mode): ``(particle, coordinate index, distance in within-chain sds)`` of
        the largest such distance, or ``None``."""
        kept = np.asarray(self.kept())  # (S, N, D)
        if kept.ndim != 3 or kept.shape[0] < 4:
            return None
        means = kept.mean(axis=0)  # (N, D)
        within = np.sqrt(np.mean(kept.var(axis=0, ddof=1), axis=0))  # (D,)
        centre = np.median(means, axis=0)
        distance = np.abs(means - centre) / np.maximum(within, 1e-300)
        particle, coordinate = np.unravel_index(int(np.argmax(distance)), distance.shape)
        if distance[particle, coordinate] < APART:
            return None
        return int(particle), int(coordinate), float(distance[particle, coordinate])


@dataclass(frozen=True)
class SamplingControl(Control):
    """Burn-in, step-size adaptation, draws and the convergence test of a Langevin ensemble.

    It reads the current ``particles`` ``(N, D)``, their ``drift`` and ``logp``, and the
    ``preconditioner`` ``(diagonal, factor)`` (``None``: no preconditioning); its decisions
    re-estimate the preconditioner and restart outlying particles during burn-in. Its
    state's ``rate`` is the step size (``initial_rate`` at first; multiplied by
    ``minibatch_fraction`` once burn-in ends), which the engine writes into the compiled
    step. ``adapt=False`` keeps a fixed ``learning_rate``. Every step's mean ``V`` and MMD
    term are kept in its state's ``trace`` with the kernel's bandwidth (the ``fit`` group's
    ``mean_v``, ``mmd`` and ``bandwidth``).
    """

    _: KW_ONLY
    initial_rate: float
    minibatch_fraction: float = 1.0
    adapt: bool = True
    initial_thin: int = 1
    target_ess: int = 400
    window: int = 50
    min_burn_in: int = 100
    max_rejections: int = 30

    kind: ClassVar[str] = "sampling"

    def init(self) -> SamplingState:
        trace = Trace(Series(), Series(), Series())
        return SamplingState(
            self.initial_rate, Draws(Series(), self.initial_thin, self.window), trace
        )

    def rate(self, state):
        return state.rate

    def reads(self, state):
        """Burn-in adapts the step, preconditioner and outliers from the whole ensemble;
        after it only the particles are drawn from (no copies of the rest every step)."""
        if state.burn_in is None:
            return ("particles", "drift", "logp", "preconditioner")
        return ("particles",)

    @staticmethod
    def keep_preconditioner(state: SamplingState) -> SamplingState:
        """The preconditioner is a Gaussian fit's covariance: burn-in keeps it."""
        return state._replace(reestimate=False)

    def observe(self, state, free_energy, info):
        state = state._replace(trace=state.trace.add(info))
        if not info["accepted"]:
            rejections = state.rejections + 1
            state = state._replace(
                rejections=rejections, rate=state.rate / 4.0, shrink=state.shrink / 4.0
            )
            return state, Decision("stalled" if rejections >= self.max_rejections else None)
        state = state._replace(rejections=0, steps=state.steps + 1)
        if state.burn_in is None:
            return self._burn(state, float(free_energy), info)
        store, due = state.store.add(state.steps - state.burn_in, info["particles"], self.window)
        state = state._replace(store=store)
        if due:
            state, stop = self._check(state)
            return state, Decision(stop)
        return state, GO_ON

    def _burn(
        self, state: SamplingState, value: float, info: dict
    ) -> tuple[SamplingState, Decision]:
        values, last, restarted = (*state.values, value), state.last, state.restarted
        particles, drift, metric = info["particles"], info["drift"], info["preconditioner"]
        restart = outlying_restart(info["logp"]) if self.adapt else None
        if restart is not None:
            worst, best = restart
            particles, drift = np.array(particles), np.array(drift)
            particles[worst], drift[worst] = particles[best], drift[best]
            restarted += len(worst)
            # a restarted particle's jump is no move of the chain, and the window's
            # values so far are the outlier's (V ~ 1e117 would hide any later trend)
            last, values = None, ()
        recent = (*state.recent[-(BURN_IN_KEPT - 1) :], np.array(particles))
        window_ends = len(values) == self.window
        deviations, reestimated = state.deviations, None
        if self.adapt and metric is not None and state.reestimate:
            deviations = (*deviations, particles - particles.mean(axis=0))
            if window_ends:
                metric = reestimated = ensemble_preconditioner(deviations)
                deviations = ()
        decision = Decision(preconditioner=reestimated, restart=restart)
        largest, rate = state.curvature, state.rate
        if self.adapt:
            largest = curvature(particles, drift, metric)
            # on minibatches the drift of the last step saw other rows: its change is noise
            if last is not None and self.minibatch_fraction == 1:
                moves = move_curvature(particles - last[0], drift - last[1], metric)
                largest = float(np.nanmax([largest, moves]))
            last = np.array(particles), np.array(drift)
            if np.isfinite(largest) and largest > 0:
                rate = state.shrink * STEP_PER_CURVATURE / largest
        state = state._replace(
            values=values, last=last, restarted=restarted, recent=recent,
            deviations=deviations, curvature=largest, rate=rate,
        )  # fmt: skip
        if not window_ends:
            return state, decision
        previous, current = state.previous, _window_stats(values)
        if state.steps >= self.min_burn_in and not _falling(previous, current):
            lost = np.flatnonzero(np.asarray(info["logp"]) < state.lost_below)
            if lost.size:  # burn-in begins again, from the rescued particles
                state = state._replace(
                    lost_below=-math.inf, rescued=int(lost.size), last=None, previous=None,
                    values=(), deviations=(),
                )  # fmt: skip
                return state, decision._replace(rescue=lost)
            state = state._replace(burn_in=state.steps)
            if self.adapt and self.minibatch_fraction < 1:
                state = state._replace(rate=state.rate * self.minibatch_fraction)
        return state._replace(previous=current, values=()), decision

    def _check(self, state: SamplingState) -> tuple[SamplingState, str | None]:
        ess, rhat, rhat_excess = chain_diagnostics(np.asarray(state.kept()))
        converged = bool(ess >= self.target_ess and rhat_excess < MAX_RHAT)
        state = state._replace(ess=ess, rhat=rhat, rhat_excess=rhat_excess, converged=converged)
        return state, "converged" if converged else None

    def conclude(self, state, reason):
        """At the step limit, a last check of the draws so far: a converged fit that
        ``refine`` continued for fewer steps than the next check stays converged."""
        if reason == "max_steps" and state.burn_in is not None and len(state.kept()) >= 4:
            state, stop = self._check(state)
            return state, stop or reason
        return state, reason

    def settings(self, state: SamplingState) -> dict:
        """What the sampling chose and found, for the method group."""
        out = {"step_size": state.rate, "burn_in": state.burn_in or -1, "thin_used": state.thin}
        if len(state.trace.bandwidth):
            out["bandwidth_used"] = state.trace.bandwidth.items()[-1]
        out |= {"n_draws": len(state.kept()), "target_ess_used": self.target_ess}
        out |= {"restarted_in_burn_in": state.restarted, "rescued_in_burn_in": state.rescued}
        out |= {"ess": state.ess, "rhat": state.rhat}
        return out | {"rhat_excess": state.rhat_excess}

    def describe(self, state, reason):
        kept = len(state.kept())
        if reason == "converged":
            return (
                f"converged: {kept} draws per particle after a burn-in of "
                f"{state.burn_in} steps and {len(state.draws) - kept} more; "
                f"smallest bulk/tail ESS {state.ess:.0f} >= {self.target_ess}, and the "
                f"largest R-hat, {state.rhat:.3f}, is {state.rhat_excess:.3f} times what as "
                f"many well-mixed chains show (below the limit of {MAX_RHAT} times)"
            )
        if reason == "stalled":
            return (
                f"stalled: {state.rejections} consecutive moves produced non-finite values even "
                f"at step size {state.rate:.2g}"
            )
        if reason == "max_steps" and state.burn_in is None:
            return (
                "reached the maximum number of steps during burn-in: the draws are the "
                f"last {len(state.recent)} states of burn-in"
            )
        if reason == "max_steps":
            text = (
                f"reached the maximum number of steps with {kept} draws per "
                f"particle: smallest ESS {state.ess:.0f} (needs {self.target_ess}), largest "
                f"R-hat {state.rhat:.3f}, which is {state.rhat_excess:.3f} times what as many "
                f"well-mixed chains show (needs below {MAX_RHAT} times)"
            )
            if 0 < state.ess < self.target_ess:
                # the ESS grows with the draws since burn-in (the kept half of them)
                more = (state.steps - state.burn_in) * (self.target_ess / state.ess - 1)
                text += (
                    f"; at this rate the smallest ESS reaches {self.target_ess} in about "
                    f"{math.ceil(more):d} more steps"
                )
            apart = state.apart()
            if apart is not None:
                particle, coordinate, distance = apart
                text += (
                    f"; particle {particle} sits apart from the others (its mean of "
                    f"coordinate {coordinate} is {distance:.0f} within-chain sds from theirs): "
                    "the posterior has several modes, which the chains do not cross, or that "
                    "particle is stuck where the density is flat (an improper ridge)"
                )
            return text
        return super().describe(state, reason)

    def restored(self, saved):
        """Also a checkpoint of an earlier version, whose draws' store held the window."""
        store, trace = saved.pop("store"), saved.pop("trace")
        state = super().restored(saved)
        return state._replace(
            store=Draws(Series.of(store["draws"]), store["thin"], store["next_check"]),
            trace=Trace(**{key: Series.of(values) for key, values in trace.items()}),
        )
