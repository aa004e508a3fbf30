"""When a Langevin ensemble has burnt in, its step size, its draws and when it stops.

Plain Python between steps (:class:`SamplingControl`, a :class:`pymc_gpf.control.Control`):

* **Burn-in.** The unadjusted scheme on a Gaussian with variance ``sigma^2`` in its stiffest
  direction keeps a stationary variance ``sigma^2 / (1 - eta / (2 sigma^2))``
  (:func:`pymc_gpf.ensemble.flow.ula_gaussian_variance`), so ``eta = 0.1 / L`` with ``L``
  the largest curvature of ``V`` bounds that bias by 5 %. ``L`` is measured at every step
  from the ensemble itself (:func:`curvature`: the largest Rayleigh quotient of the drift's
  Jacobian over the particles' span, exact for a Gaussian target once ``N > D``). Burn-in
  ends once the objective (mean ``V``, plus the MMD term) has stopped falling between two
  windows (the one-sided 5 % test of :class:`pymc_gpf.control.Stochastic`); ``eta`` is
  then frozen.
* **Sampling.** Every ``thin``-th state of every particle is a draw (chain = particle); the
  first half of the draws counts as further burn-in (:meth:`SamplingControl.kept`). At
  geometrically spaced numbers of draws (every 25 %, at least a window apart) the fit
  **converges** once the smallest bulk and tail effective sample size over the coordinates
  reaches ``target_ess`` and the largest rank-normalised split R-hat is below 1.01
  (Vehtari et al. 2021, through arviz-stats).
* A move the step refused (non-finite) quarters ``eta``; 30 in a row **stall** the fit.
"""

from __future__ import annotations

import math

from collections.abc import Callable

import numpy as np

from arviz_stats.base import array_stats

from pymc_gpf.control import Z_ONE_SIDED_5, Control

__all__ = ["SamplingControl"]

STEP_PER_CURVATURE = 0.1  # eta * L: at most 5 % excess variance on a Gaussian target
MAX_RHAT = 1.01


def curvature(particles: np.ndarray, drift: np.ndarray) -> float:
    """The largest curvature of the potential over the ensemble's span: with deviations
    ``Z`` and drift deviations ``G``, a quadratic ``V`` has ``G = -Z A``, and the largest
    eigenvalue of ``A`` on ``span(Z^T)`` is that of ``S^(-1/2) U^T (-G Z^T) U S^(-1/2)``
    (``Z Z^T = U S U^T``): an ``N x N`` problem, never ``D x D``."""
    z = particles - particles.mean(axis=0)
    g = drift - drift.mean(axis=0)
    values, vectors = np.linalg.eigh(z @ z.T)
    keep = values > values[-1] * len(z) * np.finfo(float).eps
    if not keep.any():
        return float("nan")
    basis = vectors[:, keep] / np.sqrt(values[keep])
    hessian = basis.T @ (-g @ z.T) @ basis
    return float(np.max(np.linalg.eigvalsh(0.5 * (hessian + hessian.T))))


def _window_stats(values: list[float]) -> tuple[float, float]:
    """Mean and the variance of the mean of a window (iid; a conservative plateau test)."""
    values = np.asarray(values, dtype=float)
    return float(values.mean()), float(values.var(ddof=1) / len(values))


class SamplingControl(Control):
    """Burn-in, step-size adaptation, draws and the convergence test of a Langevin ensemble.

    ``particles()`` returns the current particles ``(N, D)`` and their drift; ``set_rate(eta)``
    sets the step size of the compiled step. ``adapt=False`` keeps a fixed ``learning_rate``.
    """

    kind = "sampling"

    def __init__(
        self,
        tol: float | None,
        *,
        particles: Callable[[], np.ndarray],
        set_rate: Callable[[float], None],
        rate: float,
        adapt: bool = True,
        thin: int = 1,
        target_ess: int = 400,
        window: int = 50,
        min_burn_in: int = 100,
        max_rejections: int = 30,
    ):
        super().__init__(tol)
        self._particles, self._set_rate = particles, set_rate
        self.rate, self.adapt, self.thin, self.target_ess = rate, adapt, thin, target_ess
        self.window, self.min_burn_in, self.max_rejections = window, min_burn_in, max_rejections
        self.steps = self.rejections = 0
        self.burn_in: int | None = None  # the step burn-in ended at
        self.draws: list[np.ndarray] = []
        self.values: list[float] = []
        self.curvature = float("nan")
        self.shrink = 1.0  # the guard's factor on the curvature's step size
        self.previous: list[float] | None = None
        self.ess = self.rhat = float("nan")
        self.next_check = window  # the number of draws at which to test convergence next
        self._set_rate(self.rate)

    def observe(self, free_energy, info):
        if not info["accepted"]:
            self.rejections += 1
            self.rate /= 4.0
            self.shrink /= 4.0
            self._set_rate(self.rate)
            return "stalled" if self.rejections >= self.max_rejections else None
        self.rejections = 0
        self.steps += 1
        if self.burn_in is None:
            return self._burn(float(free_energy))
        if (self.steps - self.burn_in) % self.thin == 0:
            self.draws.append(np.array(self._particles()[0]))
        if len(self.draws) >= self.next_check:
            # checks at geometrically spaced counts: each costs O(draws), so all of them
            # together cost a constant factor of the last one
            self.next_check = max(self.next_check + self.window, int(1.25 * len(self.draws)))
            return self._check()
        return None

    def _burn(self, value: float) -> None:
        if self.adapt:
            self.curvature = curvature(*self._particles())
            if np.isfinite(self.curvature) and self.curvature > 0:
                self.rate = self.shrink * STEP_PER_CURVATURE / self.curvature
                self._set_rate(self.rate)
        self.values.append(value)
        if len(self.values) < self.window:
            return None
        current = _window_stats(self.values)
        previous, self.previous = self.previous, current
        falling = previous is None or previous[0] - current[0] > Z_ONE_SIDED_5 * math.sqrt(
            previous[1] + current[1]
        )
        if self.steps >= self.min_burn_in and not falling:
            self.burn_in = self.steps
        self.values = []
        return None

    def kept(self) -> list[np.ndarray]:
        """The draws that count: the second half of those collected (the first half is
        further burn-in, Gelman & Rubin's halving, so a burn-in that ended too early is
        discarded as the run grows)."""
        return self.draws[len(self.draws) // 2 :]

    def _check(self) -> str | None:
        """Bulk and tail ESS and R-hat of the kept draws (chain = particle)."""
        draws = np.moveaxis(np.asarray(self.kept()), 0, -1)  # (particles, D, draws)
        draws = np.moveaxis(draws, 1, 0)  # (D, particles, draws)
        bulk = array_stats.ess(draws, chain_axis=-2, draw_axis=-1, method="bulk")
        tail = array_stats.ess(draws, chain_axis=-2, draw_axis=-1, method="tail", prob=0.05)
        rhat = array_stats.rhat(draws, chain_axis=-2, draw_axis=-1)
        self.ess = float(np.min(np.minimum(bulk, tail)))
        self.rhat = float(np.max(rhat))
        if self.ess >= self.target_ess and self.rhat < MAX_RHAT:
            return "converged"
        return None

    def describe(self, reason):
        if reason == "converged":
            return (
                f"converged: {len(self.kept())} draws per particle after a burn-in of "
                f"{self.burn_in} steps and {len(self.draws) - len(self.kept())} more; "
                f"smallest bulk/tail ESS {self.ess:.0f} >= "
                f"{self.target_ess} and largest R-hat {self.rhat:.3f} < {MAX_RHAT}"
            )
        if reason == "stalled":
            return (
                f"stalled: {self.rejections} consecutive moves produced non-finite values even "
                f"at step size {self.rate:.2g}"
            )
        if reason == "max_steps" and self.burn_in is None:
            return "reached the maximum number of steps during burn-in (no draws yet)"
        if reason == "max_steps":
            return (
                f"reached the maximum number of steps with {len(self.kept())} draws per "
                f"particle (smallest ESS {self.ess:.0f}, target {self.target_ess}; R-hat "
                f"{self.rhat:.3f})"
            )
        return super().describe(reason)
