"""Is the fit good enough? Pareto k̂ of the importance ratios, the evidence bound, PSIS draws.

Yao, Vehtari, Simpson & Gelman (2018), "Yes, but did it work?": draw ``x_s ~ q`` and form the
importance ratios ``log r_s = log p(x_s, y) - log q(x_s)``. The shape ``k̂`` of a generalised
Pareto fit to the largest ratios (Pareto-smoothed importance sampling, Vehtari et al. 2024)
says how far q is from the posterior in the way that matters for expectations: below
``min(1 - 1/log10 S, 0.7)`` (ArviZ's threshold) importance sampling with q is reliable and q is
close to the posterior; above it q misses mass (usually its tails are too light); above 1 it
is far off. The same draws give the ELBO ``mean log r`` with its Monte Carlo error and the
importance-weighted evidence estimate ``log mean r``.

k̂ judges q as a proposal, and a q wider than the posterior is a good one. What it does not
see is a fit whose own objective was fooled: GPF minimises the free energy of its N
particles, a quadrature of ``E_q[log p]`` that moves with them, and with few particles on a
non-Gaussian posterior it can sit well below the true ``-ELBO`` of the Gaussian it reports
(finite-N bias). The gap ``-ELBO - F`` between an independent estimate and the fit's final
free energy measures that bias in nats.

Everything happens in the model's flat unconstrained space, where q lives and ``log p``
includes the log-Jacobian, so the ratios are those of the posterior PyMC samples with NUTS.
"""

from __future__ import annotations

import warnings

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xarray as xr

from arviz_stats.base import array_stats
from scipy.special import logsumexp

from pymc_gpf.checks import is_integer, seed_sequence
from pymc_gpf.protocols import FittedApproximation

__all__ = [
    "FULL_DATA", "NUTS", "Diagnosis", "diagnose", "diagnosis_of", "free_energy_gap",
    "khat_threshold", "nuts", "ridge_option", "smoothed_log_weights",
]  # fmt: skip

KHAT_VERY_BAD = 1.0
# the defensive component of importance sampling: q with twice its sds, 20 % of the draws
WIDE_SCALE, WIDE_SHARE = 2.0, 0.2
# a GPF free energy this many nats (beyond 3 Monte Carlo se) below -ELBO is flagged
FREE_ENERGY_GAP_TOLERANCE = 0.1


def khat_threshold(draws: int) -> float:
    """ArviZ's (Vehtari et al. 2024) sample-size dependent threshold for a good k̂."""
    return float(min(1.0 - 1.0 / np.log10(draws), 0.7))


@dataclass(frozen=True, eq=False)
class Diagnosis:
    """The importance ratios of ``draws`` draws of q, and what they say.

    ``points`` are the draws (flat unconstrained, ``(S, D)``; ``None`` for the streamed
    draws of PSIS-corrected sampling, which keeps only their log-densities),
    ``log_p``/``log_q`` their log-densities, ``log_weights`` the Pareto-smoothed, normalised
    log importance weights.
    ``undefined`` explains why k̂ and the ELBO could not be computed (a degenerate q), else
    ``None``; ``ridge`` is the variance a regularised q gave the directions a degenerate q
    lacks. ``free_energy`` is the fit's own objective at its end (the mean of its last
    recorded values), ``None`` before any step.
    """

    method: str
    points: np.ndarray | None
    log_p: np.ndarray
    log_q: np.ndarray
    log_weights: np.ndarray
    pareto_k: float
    ridge: float | None = None
    undefined: str | None = None
    minibatch: bool = False
    free_energy: float | None = None
    unconverged: str | None = None  # why the fit did not converge, if it did not
    # the fit's free energy is its particles' (a quadrature that finite N can bias low)
    particle_free_energy: bool = False
    proposal: Any = field(default=None, repr=False)  # q, as drawn from

    @property
    def n_draws(self) -> int:
        return len(self.log_p)

    @property
    def threshold(self) -> float:
        return khat_threshold(self.n_draws)

    @property
    def log_ratios(self) -> np.ndarray:
        return self.log_p - self.log_q

    @property
    def elbo(self) -> float:
        """``E_q[log p - log q]``: the evidence lower bound (full-data scale)."""
        return float(np.mean(self.log_ratios)) if self.undefined is None else float("nan")

    @property
    def elbo_mcse(self) -> float:
        """Monte Carlo standard error of :attr:`elbo`."""
        if self.undefined is not None:
            return float("nan")
        return float(np.std(self.log_ratios, ddof=1) / np.sqrt(self.n_draws))

    @property
    def free_energy_gap(self) -> float:
        """``-ELBO - F``: how far the fit's final free energy is below an independent
        estimate of the same quantity (about 0 when the fit's objective is unbiased; its
        Monte Carlo error is :attr:`elbo_mcse`; undefined for a regularised q, which is not
        the one the fit reports)."""
        if self.free_energy is None or self.ridge is not None:
            return float("nan")
        return -self.elbo - self.free_energy

    @property
    def finite_n_bias(self) -> bool:
        """Whether GPF's particle free energy is significantly below ``-ELBO``."""
        excess = self.free_energy_gap - 3.0 * self.elbo_mcse
        return self.particle_free_energy and bool(excess > FREE_ENERGY_GAP_TOLERANCE)

    @property
    def log_evidence(self) -> float:
        """``log mean_s r_s``: the importance-sampling estimate of ``log p(y)`` (a tighter
        stochastic lower bound than the ELBO; trustworthy only when k̂ is good)."""
        if self.undefined is not None:
            return float("nan")
        return float(logsumexp(self.log_ratios) - np.log(self.n_draws))

    @property
    def ess(self) -> float:
        """Effective sample size of the smoothed importance weights."""
        if self.undefined is not None:
            return float("nan")
        return float(1.0 / np.sum(np.exp(2.0 * self.log_weights)))

    @property
    def verdict(self) -> str:
        """The diagnosis in plain language."""
        if self.unconverged is None:
            return self._verdict()
        return _unconverged_verdict(self.unconverged, self._verdict())

    def _verdict(self) -> str:
        if self.undefined is not None:
            return f"undefined: {self.undefined}"
        text = _khat_verdict(self.pareto_k, self.threshold, self.minibatch)
        if self.finite_n_bias:
            text += _finite_n_bias_note(self.free_energy, self.free_energy_gap, self.elbo_mcse)
        if self.ridge is not None:
            text += f" [for the regularised q with variance {self.ridge:.3g} added off C's range]"
        if self.minibatch:
            text += " [log p of the whole data set, pm.Minibatch data replaced by the full arrays]"
        return text + "."

    def __str__(self) -> str:
        lines = [
            f"{self.method.upper()} diagnosis from {self.n_draws} draws of q:",
            f"  Pareto k̂      {self.pareto_k:.3f} (good below {self.threshold:.2f})",
            f"  ELBO          {self.elbo:.4f} ± {self.elbo_mcse:.4f} (Monte Carlo se)",
            f"  -ELBO - F     {self.free_energy_gap:.4f} (F: the fit's final free energy)",
            f"  log p(y) (IS) {self.log_evidence:.4f}",
            f"  PSIS ESS      {self.ess:.0f}",
            f"  verdict: {self.verdict}",
        ]
        return "\n".join(lines)

    def to_dataset(self) -> xr.Dataset:
        """The numbers as variables of a method group (``log_p``/``log_q`` on
        ``diagnostic_draw``, so a later importance-sampling analysis needs no new draws)."""
        scalars = {
            "pareto_k": self.pareto_k,
            "elbo": self.elbo,
            "elbo_mcse": self.elbo_mcse,
            "log_evidence_is": self.log_evidence,
            "psis_ess": self.ess,
            "free_energy_gap": self.free_energy_gap,
        }
        data = {name: ((), value) for name, value in scalars.items()}
        data["log_p"] = ("diagnostic_draw", self.log_p)
        data["log_q"] = ("diagnostic_draw", self.log_q)
        attrs = {
            "diagnosis": self.verdict,
            "khat_threshold": self.threshold,
            "diagnosis_ridge": "none" if self.ridge is None else self.ridge,
        }
        return xr.Dataset(data, attrs=attrs)

    def resample(
        self,
        draws: int,
        rng: np.random.Generator,
        log_density: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> np.ndarray:
        """``draws`` points drawn with replacement with probabilities the smoothed weights
        (sampling-importance-resampling): approximately posterior draws when k̂ is good.

        With ``log_density`` (the model's) and a Gaussian q, the pool is a defensive mixture
        (Hesterberg 1995): q's draws plus :data:`WIDE_SHARE` of the pool from q with
        :data:`WIDE_SCALE` times its sds, weighted by p over the mixture's density. Where q
        is too narrow, those weights stay bounded where the wider q covers the posterior."""
        if self.undefined is not None:
            raise ValueError(
                f"PSIS needs a density for q, but {self.undefined}. Pass regularize=True."
            )
        points, log_weights, k = self.points, self.log_weights, self.pareto_k
        widened = getattr(self.proposal, "widened", None)
        if log_density is not None and widened is not None:
            wide = widened(WIDE_SCALE)
            extra = wide.sample(round(self.n_draws * WIDE_SHARE / (1 - WIDE_SHARE)), rng)
            points = np.concatenate([self.points, extra])
            log_p = np.concatenate([self.log_p, log_density(extra)])
            share = self.n_draws / len(points)
            log_g = np.logaddexp(
                np.log(share) + self.proposal.logpdf(points), np.log1p(-share) + wide.logpdf(points)
            )
            log_weights, k = smoothed_log_weights(log_p, log_g)
        if k >= self.threshold:
            warnings.warn(
                f"Pareto k̂ = {k:.2f} ≥ {self.threshold:.2f}: the PSIS-corrected "
                "draws are not reliable.",
                UserWarning,
                stacklevel=3,
            )
        probabilities = np.exp(log_weights - logsumexp(log_weights))
        return points[rng.choice(len(points), size=draws, p=probabilities)]


# NUTS named as a remedy (here, and as {nuts} in verdict.UNCONVERGED_REMEDIES): with
# pm.Minibatch data the model's log-density is a random subsample's, and NUTS on it samples a
# wrong posterior without a word (PyMC's NUTS on a 1000-row regression in minibatches of 50:
# the slope's sd 0.12 over 2 x 1000 draws, 0.016 over 2 x 300, where the posterior's is
# 0.032; nutpie raises an AttributeError on the minibatch's random generator)
NUTS = "NUTS (pm.sample)"
FULL_DATA = (
    " on the model built with the full data arrays (on pm.Minibatch data NUTS samples a "
    "wrong posterior)"
)


def nuts(minibatch: bool) -> str:
    """NUTS as a remedy for a model with (``minibatch``) or without ``pm.Minibatch`` data."""
    return NUTS + FULL_DATA if minibatch else NUTS


def _khat_verdict(k: float, limit: float, minibatch: bool = False) -> str:
    """What a Pareto k̂ of ``k`` says about q, ``limit`` the threshold of a good one
    (:func:`khat_threshold`), for a model with (``minibatch``) or without pm.Minibatch
    data."""
    if k == -np.inf:
        return "exact (constant importance ratios): q is the posterior"
    if k < limit:
        text = (
            f"good (k̂ = {k:.2f} < {limit:.2f}): q is close to the posterior where it "
            "matters; importance sampling with q is reliable"
        )
        if k >= 0.5:
            text += " (0.5 ≤ k̂: q is not exact, so prefer PSIS-corrected draws)"
        return text
    if k < KHAT_VERY_BAD:
        return (
            f"bad (k̂ = {k:.2f} ≥ {limit:.2f}): q misses part of the posterior, usually "
            "its tails; means may be usable but standard deviations and tail "
            "probabilities are not, and importance sampling cannot fix it reliably. The "
            f"posterior is not close to Gaussian here: use {nuts(minibatch)} for it, or "
            "reparameterise the model"
        )
    return (
        f"very bad (k̂ = {k:.2f} ≥ 1): q is far from the posterior; do not trust its "
        f"estimates. Use {nuts(minibatch)}, or a richer q (e.g. full rank instead of "
        "mean field or low rank)"
    )


def _finite_n_bias_note(free_energy: float, gap: float, mcse: float) -> str:
    """The caveat on a GPF fit whose particles' free energy ``free_energy`` is ``gap ±
    mcse`` nats below ``-ELBO`` (:attr:`Diagnosis.finite_n_bias`)."""
    return (
        f" [but the particles' free energy F = {free_energy:.4g} is "
        f"{gap:.3g} ± {mcse:.2g} nats below -ELBO: with this "
        "few particles their quadrature of E_q[log p] is biased (finite-N bias) and q is "
        "not the best Gaussian; refit with method='gf' (fresh draws every step, no such "
        "bias) or with n_particles='auto', which grows N while the bias shows]"
    )


def _unconverged_verdict(unconverged: str, verdict: str) -> str:
    """The verdict on a fit that did not converge (``unconverged`` says why; ``verdict``
    is what the draws alone say): k̂ of an unfinished q says nothing about the posterior,
    so no advice from it."""
    measured = verdict.split(":")[0]
    refine = "refine" in unconverged or "bias" in unconverged
    advice = "" if refine else "; continue it with approx.refine(n) and diagnose again"
    return (
        f"the fit did not converge ({unconverged}), so this judges an unfinished q "
        f"({measured}){advice}."
    )


def free_energy_gap(
    approx: FittedApproximation,
    free_energy: float,
    draws: int,
    rng: np.random.Generator,
    enough: Callable[[float, float], bool] | None = None,
    first: int | None = None,
) -> tuple[float, float, int]:
    """``-ELBO - F``, its Monte Carlo standard error and the draws it took: ``-ELBO`` of
    the fitted Gaussian q estimated from antithetic draws (pairs ``m +- F xi``) of
    ``log p - log q``, whose variance vanishes as q approaches a Gaussian posterior; ``F``
    the fit's own free energy. Significantly positive: the fit's objective is biased low
    (GPF's finite-N bias).

    With ``enough(gap, mcse)``, draws come in batches (``first``, then doubling up to
    ``draws``) until it holds: on a near-Gaussian posterior the pairs hardly vary and the
    first batch settles the answer."""
    q = approx.gaussian()
    pairs: list[np.ndarray] = []
    size = draws if enough is None or first is None else min(first, draws)
    while True:
        half = size // 2
        centred = q.sample(half, rng) - q.mean
        points = np.concatenate([q.mean + centred, q.mean - centred])
        log_ratio = approx.log_density(points) - q.logpdf(points)
        pairs.append(0.5 * (log_ratio[:half] + log_ratio[half:]))
        every = np.concatenate(pairs)
        used = 2 * len(every)
        if not np.all(np.isfinite(every)):
            return float("inf"), 0.0, used
        gap = float(-np.mean(every) - free_energy)
        mcse = float(np.std(every, ddof=1) / np.sqrt(len(every)))
        if enough is None or used >= draws or enough(gap, mcse):
            return gap, mcse, used
        size = min(used, draws - used)


def _final_free_energy(hist: np.ndarray) -> float | None:
    """The mean of the last tenth (at most 100) of the recorded free energies: GPF's is
    deterministic, GF's and WVGD's are Monte Carlo estimates worth averaging."""
    hist = np.asarray(hist, dtype=float)
    if len(hist) == 0:
        return None
    return float(np.mean(hist[-min(100, max(1, len(hist) // 10)) :]))


def ridge_option(regularize) -> bool | float | None:
    if regularize is None or regularize is False:
        return None
    if regularize is True:
        return True
    if isinstance(regularize, bool | str) or not np.isfinite(regularize) or regularize <= 0:
        raise ValueError(
            "regularize must be True (the smallest fitted variance) or a positive variance "
            f"for the directions a degenerate q lacks, got {regularize!r}."
        )
    return float(regularize)


def diagnose(
    approx: FittedApproximation,
    draws: int = 16384,
    *,
    random_seed=None,
    regularize: bool | float | None = None,
) -> Diagnosis:
    """Pareto k̂, ELBO and evidence estimate of a fitted approximation from ``draws`` draws.

    For GPF and GF q is the Gaussian ``N(m, C)``; when C is singular (GPF with ``N <= D``
    particles, GF with rank ``K < D``) q has no density on ``R^D`` and k̂ is undefined:
    ``regularize=True`` diagnoses instead the proper Gaussian ``N(m, C + lam (I - P))``, P the
    projector on C's range, with ``lam`` the smallest non-zero eigenvalue of C (a float sets
    ``lam``). It keeps every fitted direction and is at least as wide as a Gaussian
    posterior in the missing ones (by Theorem 3 the eigenvalues GPF leaves out are the
    smallest), so its ratios are a sound importance-sampling check of the fit. For WVGD q
    is the mixture of truncated local Gaussians (its normalisers estimated by Monte Carlo).

    The result is also kept as ``approx.diagnosis``, so ``approx.sample()`` stores its
    numbers in the method's DataTree group.
    """
    if not is_integer(draws, 10):
        raise ValueError(f"draws must be an integer >= 10, got {draws!r}.")
    rng = np.random.default_rng(seed_sequence(random_seed))
    q, undefined = approx.proposal(ridge_option(regularize), rng)
    if q is None:  # nothing to draw from: an ensemble's point masses
        raise ValueError(f"diagnose has no q to draw from: {undefined}.")
    points = q.sample(int(draws), rng)
    log_q = q.logpdf(points)
    return diagnosis_of(approx, q, approx.log_density(points), log_q, points, undefined)


def diagnosis_of(
    approx: FittedApproximation,
    q,
    log_p: np.ndarray,
    log_q: np.ndarray,
    points: np.ndarray | None = None,
    undefined: str | None = None,
) -> Diagnosis:
    """The :class:`Diagnosis` of draws of ``q`` with these log-densities (``points``, the
    draws themselves, where kept), also kept as ``approx.diagnosis``."""
    if undefined is None:
        log_weights, k = smoothed_log_weights(log_p, log_q)
        ridge = getattr(q, "ridge", None)
    else:
        log_weights, k, ridge = np.full(len(log_p), -np.log(len(log_p))), float("nan"), None
    final = approx.inference.final_free_energy
    outcome = approx.inference.outcome
    diagnosis = Diagnosis(
        approx.inference.name,
        points,
        log_p,
        log_q,
        np.asarray(log_weights),
        float(k),
        ridge=ridge,
        undefined=undefined,
        minibatch=approx.target.minibatch,
        free_energy=final if final is not None else _final_free_energy(approx.hist),
        unconverged=outcome.message if outcome is not None and outcome.converged is False else None,
        particle_free_energy=approx.inference.particle_free_energy,
        proposal=q,
    )
    approx.diagnosis = diagnosis
    return diagnosis


def smoothed_log_weights(log_p: np.ndarray, log_q: np.ndarray) -> tuple[np.ndarray, float]:
    """The Pareto-smoothed, normalised log importance weights of draws of q and the shape
    k̂ of the Pareto fit to their largest ratios (``-inf`` for constant ratios: no tail); a
    draw where ``log p`` is NaN gets weight 0."""
    log_ratios = np.where(np.isnan(log_p), -np.inf, log_p) - log_q
    if not np.isfinite(log_ratios).any():
        raise FloatingPointError(
            f"log p is not finite at any of the {len(log_p)} draws of q: the fit is outside "
            "the posterior's support."
        )
    finite = log_ratios[np.isfinite(log_ratios)]
    if np.ptp(finite) <= 1e-9 * max(1.0, abs(finite[0])):
        # constant ratios: q is the posterior (up to its normaliser); no tail to fit
        return np.full(len(log_ratios), -np.log(len(log_ratios))), -np.inf
    # arviz-stats smooths the ratios of -ary (LOO convention: ary = log-likelihood)
    return array_stats.psislw(-log_ratios, r_eff=1.0)
