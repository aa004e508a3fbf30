"""Whether to trust a fit: one verdict at the end of every ``fit`` and ``refine``.

Three words (:data:`WORDS`), with the numbers behind them:

* **not converged**: the fit ended without passing its convergence test (the step limit,
  a stall, GPF's finite-N bias at the largest cloud, ...). No further check is made: an
  unfinished q says nothing yet.
* **family-limited**: the fit converged, but q cannot represent this posterior: importance
  sampling with q as proposal (Yao et al. 2018) says it misses part of the posterior
  (Pareto k̂ >= 0.7), or that its means or sds are off by more than the accuracy the verdict
  vouches for (0.1 posterior sd, 10 %); or (GPF, GF) a search from draws of the prior found
  modes q does not cover that would move them that far (:func:`modes_verdict`,
  :mod:`pymc_gpf.modes`).
* **trustworthy**: converged, k̂ < 0.7, and importance sampling confirms every constrained
  free scalar's mean within 0.1 posterior sd and sd within 10 % of q's (upper 95 % bounds of
  the estimated errors, widened where k̂ > 1/2: :func:`widening`, :func:`importance_check`),
  and no other mode was found that would change that.

The importance check draws from q in batches, ``FIRST_DRAWS`` then doubling up to
``max_draws`` while the answer is not yet clear: on a near-Gaussian posterior the log ratios
``log p - log q`` have a narrow Gaussian bulk and a long thin upper tail, and with a few
thousand draws the standard PSIS tail (the largest ``3 sqrt(S)`` ratios) starts on that bulk's
shoulder and overstates k̂ (a 2-parameter normal model fitted to 1 %: k̂ 1.2 from 4096
draws, 0.4 from 32 768, the same from the exact Gaussian-VI optimum; the tutorial "When
to trust a fit").

Any verdict but "trustworthy" warns once with :class:`~pymc_gpf.errors.FitWarning`, naming
the cause and a remedy. A family-limited q whose k̂ is below 0.7 (importance sampling
reliable) is one importance sampling can correct: ``approx.sample()`` then returns
PSIS-corrected draws.
"""

from __future__ import annotations

import time

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from scipy.special import logsumexp

from pymc_gpf.diagnostics import smoothed_log_weights
from pymc_gpf.importance import FIRST_DRAWS, ImportancePool, capped

__all__ = [
    "FAMILY_LIMITED",
    "NOT_CONVERGED",
    "PSIS_DRAWS",
    "TRUSTWORTHY",
    "UNCONVERGED_REMEDIES",
    "WORDS",
    "ImportanceCheck",
    "Verdict",
    "fit_warning",
    "importance_check",
    "importance_verdict",
    "modes_verdict",
    "widening",
]

TRUSTWORTHY, FAMILY_LIMITED, NOT_CONVERGED = "trustworthy", "family-limited", "not converged"
WORDS = (TRUSTWORTHY, FAMILY_LIMITED, NOT_CONVERGED)
KHAT_LIMIT = 0.7  # PSIS is reliable below (Vehtari et al. 2024, for S > 2200 draws)
MEAN_TOLERANCE = 0.1  # |mean of q - posterior mean| in posterior sds
SD_TOLERANCE = 0.1  # |sd of q / posterior sd - 1|
BOUND_Z = 2.0  # the errors' upper and lower bounds: estimate +- 2 standard errors
MAX_DRAWS = 16384  # draws of q (the defensive ones come on top)
# A family-limited q with k̂ < 0.7 gets PSIS-corrected draws by default, and that k̂ is read
# from at least this many draws of q. On a heavy tail k̂ from fewer reads low: from the first
# batch (2048) it read below 0.7 on 7 of 81 family-limited checks (GF, GPF; hard and
# reference sections, 2026-11-27) where 4096 and more read 0.79-0.95 (the centred radon
# model's GF fit: 0.39 from 2048, 0.88 from 20 480).
PSIS_DRAWS = 4096
# NUTS as a remedy: {nuts} in the texts below (pymc_gpf.diagnostics.nuts)
UNCONVERGED_REMEDIES = {
    "stalled": (
        "Check the model near q (a parameter at the edge of its support, a density that is "
        "not finite everywhere), reparameterise, or use {nuts}"
    ),
    "crawling": (
        "q is far from the posterior even after starting again from the MAP: standardise the "
        "data (a response or predictor in the thousands), give start= values near the "
        "posterior, or use method='gpf' (its line search takes long steps) or {nuts}"
    ),
    "floor": "Refine with a larger tol, or use method='gpf' (deterministic) on full data",
    "callback": (
        "The automatic fit stops by itself once it has converged, so it needs no stopping "
        "callback (PyMC's CheckParametersConvergence watches ADVI's parameters, not this "
        "convergence test); approx.refine(n) continues it"
    ),
}
CHUNK = 4096  # draws mapped to the constrained space at once
CACHE = 2**23  # constrained columns kept between batches up to this many numbers


@dataclass(frozen=True)
class Verdict:
    """A fit's verdict: the ``word`` (:data:`WORDS`), its ``cause`` and a ``remedy`` in
    words, the ``numbers`` behind it, and what the check cost (log-density evaluations and
    seconds; the fit's own cost is in ``approx.inference.gradient_evaluations``)."""

    word: str
    cause: str
    remedy: str = ""
    numbers: dict[str, Any] = field(default_factory=dict)
    density_evaluations: int = 0
    seconds: float = 0.0
    gradient_evaluations: int = 0

    @property
    def trustworthy(self) -> bool:
        return self.word == TRUSTWORTHY

    @property
    def message(self) -> str:
        text = f"{self.word}: {self.cause}"
        return f"{text}. {self.remedy}" if self.remedy else text

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class ImportanceCheck:
    """What importance sampling with q as proposal says of q (:func:`importance_check`):
    Pareto k̂ of the ratios, and the largest estimated errors of q's constrained means (in
    posterior sds) and sds (relative), each with its standard error and the scalar it
    belongs to."""

    draws: int
    pareto_k: float
    mean_error: float
    mean_error_se: float
    worst_mean: str
    sd_error: float
    sd_error_se: float
    worst_sd: str
    elbo: float
    elbo_mcse: float
    # log p(y) estimated by importance sampling, log mean exp(log p - log q): its excess over
    # the ELBO is the bound's gap, KL(q || posterior)
    log_evidence: float = float("nan")
    # over all scalars: the largest upper and lower bounds of the two errors, 2 standard
    # errors times ``widening`` (:func:`widening`) either side
    upper: float = 0.0  # max over scalars of (|error| + 2 widening se) / tolerance
    lower: float = 0.0  # max over scalars of (|error| - 2 widening se) / tolerance
    mixture_k: float = float("nan")  # k̂ of the weights the errors use (defensive mixture)
    widening: float = 1.0
    # the draws judged (PSIS-corrected draws of the fit resample from them)
    pool: ImportancePool | None = field(default=None, repr=False, compare=False)

    @property
    def reliable(self) -> bool:
        """Importance sampling with q, and the errors' weights, are reliable."""
        return bool(self.pareto_k < KHAT_LIMIT and not self.mixture_k >= KHAT_LIMIT)

    @property
    def accurate(self) -> bool:
        """q's errors are confidently within the tolerances."""
        return self.reliable and self.upper < 1.0

    @property
    def inaccurate(self) -> bool:
        """q's errors confidently exceed a tolerance."""
        return self.reliable and self.lower > 1.0

    def settled(self, q_draws: int) -> bool:
        """More draws would not change the answer, made from ``q_draws`` draws of q: an
        inaccurate q only from :data:`PSIS_DRAWS`, since its ``sample()`` then defaults to
        PSIS-corrected draws."""
        return self.accurate or (self.inaccurate and q_draws >= PSIS_DRAWS)

    def numbers(self) -> dict[str, Any]:
        return {
            "pareto_k": self.pareto_k,
            "check_draws": self.draws,
            "max_mean_error": self.mean_error,
            "max_mean_error_se": self.mean_error_se,
            "max_mean_error_at": self.worst_mean,
            "max_sd_error": self.sd_error,
            "max_sd_error_se": self.sd_error_se,
            "max_sd_error_at": self.worst_sd,
            "elbo": self.elbo,
            "elbo_mcse": self.elbo_mcse,
            "log_evidence": self.log_evidence,
            "mixture_pareto_k": self.mixture_k,
            "error_se_widening": self.widening,
        }


class _PowerSums:
    """Per column of ``f = (x - shift) / scale``: ``Σ_s c_s f_s^k`` for ``k = 0..4`` and the
    weights ``c`` of :data:`WEIGHTS` built from ``u`` (importance weights scaled to average
    1) and ``v`` (q's own draws' weights, also averaging 1). Every moment the check needs
    is a combination of these, so draws are streamed through in batches, never all kept."""

    WEIGHTS = ("v", "u", "uu", "uv", "vv")

    def __init__(self, shift: np.ndarray, scale: np.ndarray):
        self.shift, self.scale = shift, scale
        self.sums = np.zeros((len(self.WEIGHTS), 5, len(shift)))
        self.n = 0

    def add(self, columns: np.ndarray, u: np.ndarray, v: np.ndarray) -> None:
        f = (columns - self.shift) / self.scale
        weights = np.stack([v, u, u * u, u * v, v * v])
        power = np.ones_like(f)
        for k in range(5):
            self.sums[:, k] += weights @ power
            power = power * f
        self.n += len(f)

    def poly(self, weight: str, coefficients: list[np.ndarray]) -> np.ndarray:
        """``Σ_s c_s P(f_s)`` for the polynomial ``P`` (coefficients by degree, per
        column) and the weight ``c`` named ``weight``."""
        i = self.WEIGHTS.index(weight)
        return sum(a * self.sums[i, k] for k, a in enumerate(coefficients))


def _times(a: list, b: list) -> list:
    """The product of two polynomials given by coefficients (arrays per column)."""
    out = [0.0] * (len(a) + len(b) - 1)
    for i, x in enumerate(a):
        for j, y in enumerate(b):
            out[i + j] = out[i + j] + x * y
    return out


def _moments(sums: _PowerSums, own: _PowerSums | None) -> dict[str, np.ndarray]:
    """Means, variances and the standard errors of (q's - IS) differences, in the scaled
    units of ``sums`` (self-normalised IS, delta method:
    ``Var(Δ) ≈ (1/S²) Σ_s [u_s (f_s - μ_IS) - v_s (f_s - μ_q)]²``, likewise for the variance
    with ``(f - μ)² - var``). With ``own`` (a degenerate q) q's moments come from its own,
    independent draws."""
    n = sums.n
    mean_is = sums.poly("u", [0.0, 1.0]) / n
    var_is = np.maximum(sums.poly("u", [0.0, 0.0, 1.0]) / n - mean_is**2, 0.0)
    centred_is = [mean_is**2 - var_is, -2.0 * mean_is, 1.0]  # (f - μ)² - var
    shifted_is = [-mean_is, 1.0]  # f - μ
    if own is None:
        mean_q = sums.poly("v", [0.0, 1.0]) / n
        var_q = np.maximum(sums.poly("v", [0.0, 0.0, 1.0]) / n - mean_q**2, 0.0)
        centred_q, shifted_q = [mean_q**2 - var_q, -2.0 * mean_q, 1.0], [-mean_q, 1.0]

        def difference(a: list, b: list) -> np.ndarray:
            return (
                sums.poly("uu", _times(a, a))
                - 2.0 * sums.poly("uv", _times(a, b))
                + sums.poly("vv", _times(b, b))
            ) / n**2

        mean_se2 = difference(shifted_is, shifted_q)
        var_se2 = difference(centred_is, centred_q)
    else:
        k = own.n
        mean_q = own.poly("v", [0.0, 1.0]) / k
        var_q = np.maximum(own.poly("v", [0.0, 0.0, 1.0]) / k - mean_q**2, 0.0)
        centred_q = [mean_q**2 - var_q, -2.0 * mean_q, 1.0]
        mean_se2 = var_q / k + sums.poly("uu", _times(shifted_is, shifted_is)) / n**2
        var_se2 = (
            own.poly("v", _times(centred_q, centred_q)) / k**2
            + sums.poly("uu", _times(centred_is, centred_is)) / n**2
        )
    return {
        "mean_q": mean_q,
        "mean_is": mean_is,
        "var_q": var_q,
        "var_is": var_is,
        "mean_diff_se": np.sqrt(np.maximum(mean_se2, 0.0)),
        "var_diff_se": np.sqrt(np.maximum(var_se2, 0.0)),
    }


def importance_check(
    approx,
    rng: np.random.Generator,
    *,
    max_draws: int = MAX_DRAWS,
    first_draws: int = FIRST_DRAWS,
) -> ImportanceCheck:
    """Importance sampling with q as proposal, in batches until the answer is clear.

    ``approx.check_proposal(rng)`` gives what to draw from (q, or for a degenerate q a proper
    Gaussian around it) and, for a degenerate q, q itself to read its moments from. Draws are
    added (``first_draws`` of q, then doubling up to ``max_draws``) until the answer is
    settled: k̂ below 0.7 and the errors' bounds, widened where k̂ exceeds 1/2
    (:func:`widening`), clear of the tolerances (beyond them only from :data:`PSIS_DRAWS`
    draws of q). k̂ is that of q's draws. The errors
    compare q's moments with importance-weighted ones of every scalar of the constrained
    free variables; those weights are p / g for the defensive mixture g of q and q widened
    (:class:`pymc_gpf.importance.ImportancePool`), so that a q too narrow for the
    posterior still gets bounded weights where the widened q covers it. Only the log
    densities are kept; the draws are regenerated from their generators' states to map them
    to the constrained space (memory ``O(S + D)``, not ``O(S D)``). The check's ``pool``
    is that pool: PSIS-corrected draws resample from it."""
    proposal, own = approx.check_proposal(rng)
    pool = ImportancePool(proposal, approx.weights_log_density(proposal, rng), rng, own)
    names = [rv.name for rv in approx.model.free_RVs]
    # a large model: fewer draws (each a log-density of the data, mapping D numbers)
    max_draws = capped(max_draws, proposal.ndim)
    cache: dict[int, tuple] = {}  # constrained columns of each batch, while they are few
    size = min(first_draws, max_draws)
    while True:
        chunks, labels, visit = _collector(approx, names)
        pool.add(size, visit)
        newest = len(pool.batches) - 1
        cache[newest] = (chunks, labels, _own_columns(approx, pool, names, newest))
        check = _summarise(approx, pool, names, cache)
        if _cached_numbers(cache) > CACHE:
            del cache[newest]  # drawn again when needed
        if check.settled(pool.size) or pool.size >= max_draws:
            return replace(check, pool=pool)
        size = min(pool.size, max_draws - pool.size)


def _constrained_columns(
    approx, points: np.ndarray, names: list[str]
) -> tuple[np.ndarray, list[str]]:
    """``(S, P)``: every scalar of the constrained free variables at flat ``points``, and
    their labels ``name[i, j]``."""
    parts, shapes = [], {}
    for i in range(0, len(points), CHUNK):
        values = approx.constrained(points[i : i + CHUNK])
        rows = min(CHUNK, len(points) - i)
        shapes = {n: np.shape(values[n])[1:] for n in names}
        parts.append(np.column_stack([np.reshape(values[n], (rows, -1)) for n in names]))
    labels = []
    for name in names:
        shape = shapes[name]
        for k in range(int(np.prod(shape, dtype=int))):
            index = np.unravel_index(k, shape) if shape else ()
            labels.append(name + ("[" + ", ".join(map(str, index)) + "]" if shape else ""))
    return np.concatenate(parts).astype(float), labels


def _collector(approx, names) -> tuple[list, list, Callable]:
    """Lists that ``visit(first row, points)`` fills with each chunk's constrained columns
    and their labels, as the pool draws them."""
    chunks: list[tuple[int, np.ndarray]] = []
    labels: list[str] = []

    def visit(first: int, points: np.ndarray) -> None:
        columns, labels[:] = _constrained_columns(approx, points, names)
        chunks.append((first, columns))

    return chunks, labels, visit


def _own_columns(approx, pool: ImportancePool, names, index: int) -> list[np.ndarray]:
    """The constrained columns of q's own draws in batch ``index`` (a degenerate q), per
    chunk; none otherwise."""
    if pool.own is None:
        return []
    return [_constrained_columns(approx, points, names)[0] for points in pool.replay_own(index)]


def _cached_numbers(cache: dict) -> int:
    return sum(c.size for chunks, _, own in cache.values() for c in [*(x for _, x in chunks), *own])


def _columns(approx, pool: ImportancePool, names, index: int, cache: dict) -> tuple:
    """Batch ``index``'s constrained columns, per chunk ``(first row, columns)``, their
    labels and q's own draws' columns (a degenerate q): from ``cache``, or drawn again and
    kept there while the cache is small."""
    if index in cache:
        return cache[index]
    chunks, labels = [], []
    for first, points in pool.replay(index):
        columns, labels = _constrained_columns(approx, points, names)
        chunks.append((first, columns))
    out = (chunks, labels, _own_columns(approx, pool, names, index))
    if _cached_numbers(cache) + _cached_numbers({index: out}) <= CACHE:
        cache[index] = out
    return out


def _summarise(approx, pool: ImportancePool, names, cache) -> ImportanceCheck:
    log_p, log_q, _, from_q = pool.arrays
    if not np.isfinite(log_p - log_q)[from_q].any():  # no mass of q where log p is finite
        inf = float("inf")
        return ImportanceCheck(
            len(log_p), inf, inf, 0.0, "", inf, 0.0, "", -inf, 0.0, inf, inf, inf
        )
    k = _khat(smoothed_log_weights(log_p[from_q], log_q[from_q])[1])
    log_weights, k_mixture = pool.mixture_weights()
    k_mixture = _khat(k_mixture)
    sums = own_sums = None
    labels: list[str] = []
    for index, offset in enumerate(pool.offsets):
        chunks, labels, own_chunks = _columns(approx, pool, names, index, cache)
        for first, columns in chunks:
            rows = slice(offset + first, offset + first + len(columns))
            finite = np.all(np.isfinite(columns), axis=1)
            if sums is None:
                kept = columns[finite]
                shift = kept.mean(axis=0) if len(kept) else np.zeros(len(labels))
                scale = kept.std(axis=0) if len(kept) > 1 else np.ones_like(shift)
                sums = _PowerSums(shift, np.where(scale > 0, scale, 1.0))
                own_sums = _PowerSums(shift, sums.scale) if pool.own is not None else None
            weight = np.exp(log_weights[rows] - np.max(log_weights))
            sums.add(columns[finite], weight[finite], from_q[rows][finite].astype(float))
        for own_columns in own_chunks:
            own_finite = own_columns[np.all(np.isfinite(own_columns), axis=1)]
            own_sums.add(own_finite, np.ones(len(own_finite)), np.ones(len(own_finite)))
    _normalise(sums)
    moments = _moments(sums, own_sums)
    sd_is = np.sqrt(np.maximum(moments["var_is"], 1e-300))
    mean_error = np.abs(moments["mean_q"] - moments["mean_is"]) / sd_is
    mean_error_se = moments["mean_diff_se"] / sd_is
    ratio = np.sqrt(moments["var_q"]) / sd_is
    sd_error = np.abs(ratio - 1.0)
    # d(sd_q / sd_is) ≈ ratio (dvar_q / var_q - dvar_is / var_is) / 2: the difference's se
    sd_error_se = 0.5 * ratio * moments["var_diff_se"] / np.maximum(moments["var_is"], 1e-300)
    wider = widening(k, k_mixture, int(from_q.sum()))
    upper = np.maximum(
        (mean_error + BOUND_Z * wider * mean_error_se) / MEAN_TOLERANCE,
        (sd_error + BOUND_Z * wider * sd_error_se) / SD_TOLERANCE,
    )
    lower = np.maximum(
        (mean_error - BOUND_Z * wider * mean_error_se) / MEAN_TOLERANCE,
        (sd_error - BOUND_Z * wider * sd_error_se) / SD_TOLERANCE,
    )
    i, j = int(np.argmax(mean_error)), int(np.argmax(sd_error))
    ratios = (log_p - log_q)[from_q]
    usable = np.isfinite(ratios)
    return ImportanceCheck(
        draws=len(log_p),
        pareto_k=float(k),
        mean_error=float(mean_error[i]),
        mean_error_se=float(mean_error_se[i]),
        worst_mean=labels[i],
        sd_error=float(sd_error[j]),
        sd_error_se=float(sd_error_se[j]),
        worst_sd=labels[j],
        elbo=float(np.mean(ratios[usable])) if usable.any() else float("nan"),
        elbo_mcse=float(np.std(ratios[usable], ddof=1) / np.sqrt(usable.sum()))
        if usable.sum() > 1
        else float("nan"),
        log_evidence=float(logsumexp(ratios[usable]) - np.log(usable.sum()))
        if usable.any()
        else float("nan"),
        upper=float(np.max(upper)),
        lower=float(np.max(lower)),
        mixture_k=float(k_mixture),
        widening=wider,
    )


def widening(k: float, k_mixture: float, draws: int) -> float:
    """What the errors' standard errors are multiplied by in their bounds. They assume a
    finite variance of the weights, i.e. k < 1/2; above it the error of an
    importance-sampling estimate falls as ``S^-(1-k)``, not ``S^-1/2`` (tail index 1/k;
    Vehtari et al. 2024), so for the heavier of k̂ (q's ``draws``) and the errors' own
    weights' k̂ they are widened by ``S^(k - 1/2)``: 2.1 at k̂ = 0.6 from 2048 draws, 2.3
    from 4096, 1 below k̂ = 1/2. (At k̂ >= 0.7 the check is unreliable whatever the bounds.)"""
    heaviest = float(np.nanmax([k, k_mixture]))  # no defensive component: k_mixture NaN
    if not heaviest > 0.5:
        return 1.0
    return float(draws ** (min(heaviest, KHAT_LIMIT) - 0.5))


def _khat(k: float) -> float:
    """k̂, with the generalised Pareto fit's failure (a tail of equal values: one draw
    carries all the weight) read as an infinitely heavy tail."""
    return float("inf") if np.isnan(k) else float(k)


def _normalise(sums: _PowerSums) -> None:
    """Rescale ``u`` and ``v`` to average 1 over the rows added."""
    n = sums.n
    v_total, u_total = sums.sums[0, 0, 0], sums.sums[1, 0, 0]
    a = n / u_total if u_total > 0 else 1.0
    b = n / v_total if v_total > 0 else 1.0
    sums.sums = sums.sums * np.array([b, a, a * a, a * b, b * b])[:, None, None]


def importance_verdict(check: ImportanceCheck, alternative: str, seconds: float) -> Verdict:
    """The verdict of a converged fit from its :class:`ImportanceCheck`; ``alternative``
    names what to use where q cannot represent the posterior."""
    numbers = check.numbers()
    cost = {"density_evaluations": check.draws, "seconds": seconds}
    k = check.pareto_k
    if k == float("inf"):
        return Verdict(
            FAMILY_LIMITED,
            f"none of {check.draws} draws of q has a finite log p and log q: q is off the "
            "posterior's support, or collapsed to a point",
            alternative,
            numbers,
            **cost,
        )
    if not check.reliable:
        if k >= KHAT_LIMIT:
            which = f"Pareto k̂ = {k:.2f} ≥ {KHAT_LIMIT} from {check.draws} draws of q"
        else:  # q's own k̂ passes; the errors' weights (q and q widened) do not
            which = (
                f"Pareto k̂ = {check.mixture_k:.2f} ≥ {KHAT_LIMIT} for the weights of q and "
                f"q with twice its sds, {check.draws} draws; {k:.2f} for q's own"
            )
        return Verdict(
            FAMILY_LIMITED,
            f"q misses part of the posterior ({which}): the posterior is not close to q's "
            "family here, so its tails, sds and even means may be off, and importance "
            "sampling cannot reliably correct them",
            alternative,
            numbers,
            **cost,
        )
    if check.accurate:
        return Verdict(
            TRUSTWORTHY,
            f"importance sampling (Pareto k̂ = {k:.2f}, {check.draws} draws) puts q's means "
            f"within {MEAN_TOLERANCE:g} posterior sd and its sds within "
            f"{SD_TOLERANCE:.0%} of the posterior's (largest: {check.mean_error:.2g} sd at "
            f"{check.worst_mean}, {check.sd_error:.1%} at {check.worst_sd})",
            "",
            numbers,
            **cost,
        )
    how = "is off" if check.inaccurate else "may be off"
    # sample() returns PSIS-corrected draws wherever importance sampling is reliable: on the
    # reference and hard sections (2026-11-26) their largest error in units of the
    # tolerances was smaller on every family-limited row with 0.6 <= k̂ < 0.7 (radon's GPF
    # fit 49 % -> 20 % in an sd, its mean error 0.11 -> 0.17 sd; mesquite's WVGD fit
    # 4.6 % -> 2.0 %), as on two unseen posteriors (a hierarchical logistic regression's GF
    # fit, k̂ 0.63: 27 % -> 2.7 %), and never larger below 0.6 beyond their noise
    numbers["psis_default"] = True
    remedy = (
        "approx.sample() therefore returns PSIS-corrected draws, which remove most of it "
        "(q's own draws: approx.sample(psis=False))"
    )
    return Verdict(
        FAMILY_LIMITED,
        f"q does not match the posterior here: importance sampling (Pareto k̂ = "
        f"{k:.2f}, {check.draws} draws) says q {how} by up to {check.mean_error:.2g} ± "
        f"{check.mean_error_se:.1g} posterior sd in the mean of {check.worst_mean} and "
        f"{check.sd_error:.1%} ± {check.sd_error_se:.1%} in the sd of {check.worst_sd}",
        remedy,
        numbers,
        **cost,
    )


def modes_verdict(verdict: Verdict, search, labels: list[str], seconds: float) -> Verdict:
    """``verdict`` with what a search for modes q does not cover found
    (:class:`pymc_gpf.modes.ModeSearch`; ``labels`` name the flat coordinates): "family-
    limited" where q and the other modes together have marginals beyond the tolerances."""
    numbers = verdict.numbers | {
        "importance_verdict": verdict.word,  # before the search
        "mode_search_starts": search.starts,
        "mode_search_evaluations": search.evaluations,
        "mode_search_seconds": round(seconds, 4),
        "other_modes": len(search.modes),
    }
    cost = dict(
        gradient_evaluations=verdict.gradient_evaluations + search.evaluations,
        density_evaluations=verdict.density_evaluations + search.density_evaluations,
        seconds=verdict.seconds + seconds,
    )
    if not len(search.modes):
        return replace(verdict, numbers=numbers, **cost)
    largest = int(np.argmax(search.shares))
    mean_at, sd_at = int(np.argmax(search.mean_errors)), int(np.argmax(search.sd_errors))
    numbers |= {
        "other_mode_share": float(search.shares[largest]),
        "other_mode_distance": float(search.distances[largest]),
        "modes_mean_error": float(search.mean_errors[mean_at]),
        "modes_sd_error": float(search.sd_errors[sd_at]),
    }
    if search.mean_errors[mean_at] < MEAN_TOLERANCE and search.sd_errors[sd_at] < SD_TOLERANCE:
        return replace(verdict, numbers=numbers, **cost)
    numbers["psis_default"] = False  # q's draws never reach the other modes
    where = labels[int(search.axes[largest])]
    count = len(search.modes)
    found = "another" if count == 1 else f"{count} more, the heaviest"
    cause = (
        f"the posterior has {count + 1} modes and q covers one: L-BFGS from {search.starts} "
        f"dispersed starts (draws of the prior where it has them) found {found} "
        f"{search.distances[largest]:.0f} of q's sds away "
        f"(in {where}) holding {search.shares[largest]:.0%} of the mass (importance sampling "
        f"from Laplace's approximation at each mode); with {'it' if count == 1 else 'them'} "
        f"q's mean of {labels[mean_at]} is {search.mean_errors[mean_at]:.2g} posterior sd "
        f"off and its sd of {labels[sd_at]} {search.sd_errors[sd_at]:.0%} off"
    )
    remedy = (
        "One Gaussian cannot hold several modes: method='wvgd' starts a cell on each mode "
        "this search finds (on y ~ N(x^2, 1) it then put 0.500 of the mass at x < 0, exactly "
        "half). If the modes are copies of each other (a sign or a labelling the data cannot "
        "tell apart), breaking the symmetry in the model (an ordered transform, a positive "
        "constraint) also removes them"
    )
    return Verdict(FAMILY_LIMITED, cause, remedy, numbers, **cost)


def elapsed(start: float) -> float:
    return time.perf_counter() - start


def fit_warning(name: str, outcome, verdict: Verdict) -> str:
    """The :class:`FitWarning` text for a fit of method ``name`` that ended with ``outcome``
    (:class:`pymc_gpf.control.Outcome`) and was judged ``verdict`` (not trustworthy)."""
    name = name.upper()
    if verdict.word == NOT_CONVERGED:
        text = f"{name} did not converge: {outcome.message}"
        if verdict.cause not in outcome.message:  # the check of a fit that ran its course
            text = f"{text}; {verdict.cause}"
    elif outcome.converged is None:
        text = (
            f"{name} ran the steps asked for without a convergence test (a fixed learning_rate "
            f"and no tol), and its q is {verdict.word} (or unfinished): {verdict.cause}"
        )
    else:
        text = f"{name} converged, but its q is {verdict.word}: {verdict.cause}"
    return f"{text}. {verdict.remedy}" if verdict.remedy else text
