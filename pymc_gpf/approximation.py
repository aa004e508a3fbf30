"""What ``pm.fit`` returns: the fitted approximation, with PyMC's ``Approximation`` interface.

Common to all methods: ``hist`` (the free-energy trace), ``sample`` (an ArviZ DataTree),
``refine``, ``params`` (for PyMC's callbacks). Each method adds how to draw from its q and
what goes into its own DataTree group.
"""

from __future__ import annotations

import functools
import time

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import pytensor
import xarray as xr

from arviz_base import dict_to_dataset
from pymc.backends.arviz import coords_and_dims_for_inferencedata

from pymc_gpf.checks import is_integer, seed_sequence
from pymc_gpf.datatree import build_datatree, fit_group, settings_attrs
from pymc_gpf.diagnostics import FULL_DATA, NUTS, Diagnosis, diagnosis_of, ridge_option
from pymc_gpf.engine import FlowInference
from pymc_gpf.gaussian import GaussianQ
from pymc_gpf.importance import ImportancePool, capped
from pymc_gpf.modes import search_modes
from pymc_gpf.persistence import save, to_datatree
from pymc_gpf.subsample import SubsampledLogDensity, subsample_applies, subsampled_log_density
from pymc_gpf.verdict import Verdict, importance_check, importance_verdict, modes_verdict

# points per log-density call: as many as keep one call within about 2^18 data terms. Each
# intermediate array of the data is then ~2 MB and stays in cache through the passes NumPy
# makes over it in quick_c's elementwise kernels: per 16 384 points, 2^18 against 2^22 terms,
# 205 vs 426 ms (earnings, 1059 rows), 136 vs 307 (radon), 108 vs 171 (GARCH), 297 vs 355
# (mixture), 218 vs 220 (latent GP, 30 rows); 2^19 within 5 % but for the mixture's 28 %
# slower, 2^20 already as slow as 2^22
LOGP_TERMS, MIN_CHUNK, MAX_CHUNK = 2**18, 16, 4096
# the fewest draws of q PSIS resamples from (fewer for a large model,
# pymc_gpf.importance.capped): with fewer, k̂ overstates the tail of a near-Gaussian
# posterior (pymc_gpf.verdict); and at least this many per draw resampled
PSIS_POOL, POOL_PER_DRAW = 16384, 4
# the search for modes q does not cover (pymc_gpf.modes): L-BFGS from this many draws of the
# prior, at most this many iterations, on models of at most this many coordinates (its
# Laplace approximation forms a D x D Hessian); central differences of the gradient with
# this step in q's sds (float64, float32)
MODE_STARTS, MODE_ITERATIONS, MODE_SEARCH_DIMENSIONS = 8, 100, 1000
# where the prior has no draw (Flat, or one a transform cannot map) a start is q's mean plus
# this many of q's sds times a standard normal (or, every other one, around the model's
# initial point: GaussianApproximation._undrawn_starts)
MODE_SPREAD = 10.0
HESSIAN_STEP = (1e-4, 1e-2)
# the least share of the mass a mode needs for WVGD to start a cell on it (one on a mode
# with 1e-24 of it, such as a frequency's aliases, would only be a particle lost)
CELL_SHARE = 0.01

__all__ = ["FlowApproximation", "GaussianApproximation", "ParticleCloud", "ParticlesMixin"]


class FlowApproximation:
    """Base class of fitted approximations (see :class:`pymc_gpf.GPFApproximation`)."""

    def __init__(self, inference: FlowInference):
        self.inference = inference
        self.diagnosis: Diagnosis | None = None  # the last pymc_gpf.diagnose(self)
        self._compiled: dict[Any, Any] = {}
        # the draws of the last verdict's check, with the step count they judged, and the
        # pool PSIS-corrected draws last resampled from (that one extended, if it was)
        self._judged: tuple[int, ImportancePool] | None = None
        self._extended: tuple[int, ImportancePool] | None = None
        # the subsample whose log p the last importance weights read (pymc_gpf.subsample)
        self.subsample: SubsampledLogDensity | None = None

    # -------------------------------------------------------------- PyMC's interface
    model = property(lambda self: self.inference.model, doc="The PyMC model.")
    target = property(
        lambda self: self.inference.target,
        doc="The model as a :class:`pymc_gpf.BatchedTarget` (flat coordinates, labels).",
    )
    hist = property(
        lambda self: self.inference.hist,
        doc="The free-energy trace (``-ELBO``, full-data scale), one value per step.",
    )

    @property
    def free_energy(self) -> float:
        """The free energy of the fitted state: the last recorded value (GPF: of the state
        it ended on, which an early stop may have restored); ``nan`` before any step."""
        final = self.inference.final_free_energy
        if final is not None:
            return float(final)
        return float(self.hist[-1]) if len(self.hist) else float("nan")

    @property
    def outcome(self):
        """How the fit ended (:class:`pymc_gpf.control.Outcome`): ``converged``, the reason,
        the step and an explanation; ``None`` before ``fit``."""
        return self.inference.outcome

    def fit_group(self) -> xr.Dataset:
        """The DataTree's ``fit`` group (see :func:`fit_dataset`)."""
        return fit_dataset(self.inference)

    def refine(self, n: int, **kwargs):
        """Continue fitting for ``n`` more steps (same settings)."""
        self.inference.refine(n, **kwargs)
        return self

    # --------------------------------------------------------------------- sampling
    def full_log_densities_and_gradients(self, points: np.ndarray) -> tuple[np.ndarray, ...]:
        """``log p(x, y)`` ``(S,)`` (``-inf`` where it is not finite) and its gradient
        ``(S, D)`` at flat points ``(S, D)``, of the whole data set, in batched calls."""
        fn = self._compiled_for("full_logp_dlogp", self.target.compile_full_logp_dlogp)
        return self._values_and_gradients(fn, points)

    def _values_and_gradients(
        self, fn, points: np.ndarray, rows: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(log p, gradient)`` from the compiled ``fn`` in chunks (:meth:`_in_chunks`),
        ``-inf`` and 0 where either is not finite."""
        chunks = self._in_chunks(fn, points, rows)
        log_p = np.concatenate([c[0] for c in chunks]).astype(float)
        grad = np.concatenate([c[1] for c in chunks]).astype(float)
        bad = ~(np.isfinite(log_p) & np.all(np.isfinite(grad), axis=1))
        log_p[bad], grad[bad] = -np.inf, 0.0
        return log_p, grad

    def log_density(self, points: np.ndarray) -> np.ndarray:
        """``log p(x, y)`` at flat unconstrained points ``(S, D)`` (log-Jacobian included),
        always of the whole data set (``pm.Minibatch`` data replaced by the full arrays):
        one batched call per chunk of points."""
        fn = self._compiled_for("logp", functools.partial(self.target.compile_logp, full_data=True))
        return np.concatenate(self._in_chunks(fn, points)).astype(float)

    def _in_chunks(self, fn, points: np.ndarray, rows: np.ndarray | None = None) -> list:
        """``fn`` of the checked ``points``, one call per chunk of :data:`LOGP_TERMS` data
        terms, on the fit's BLAS threads (also outside a fit: diagnose, PSIS draws), with
        the data the fit was made on (``pm.set_data`` since, for predictions, would judge
        and reweight q against data it never saw); ``rows``: only those rows of
        ``pm.Minibatch`` data, passed on to ``fn``."""
        points = self._check_points(points)
        terms = self.target.data_size
        if rows is not None:
            terms = max(1, terms * len(rows) // self.target.subsample_rows)
        size = int(np.clip(LOGP_TERMS // terms, MIN_CHUNK, MAX_CHUNK))
        extra = () if rows is None else (rows,)
        with self.inference.blas_threads(), self.target.with_data(self.inference.fitted_data):
            return [fn(points[i : i + size], *extra) for i in range(0, len(points), size)]

    def weights_log_density(self, proposal, rng: np.random.Generator) -> Callable:
        """``log p`` for importance weights of draws of ``proposal``: :meth:`log_density`,
        or where ``pm.Minibatch`` data are large its estimate from a subsample of their rows
        (:mod:`pymc_gpf.subsample`, rows and calibration draws from ``rng``), then kept as
        :attr:`subsample`."""
        self.subsample = None
        rows = self.target.subsample_rows if self.target.minibatch else None
        gaussian = isinstance(proposal, GaussianQ) and not proposal.degenerate
        if not (gaussian and subsample_applies(rows, self.target.ndim)):
            return self.log_density
        compile_fn = self.target.compile_subsample_logp
        evaluate = self._compiled_for("subsample_logp", compile_fn)
        gradient = self._compiled_for(
            "subsample_logp_dlogp", functools.partial(compile_fn, gradient=True)
        )

        def log_p(points, part):
            return np.concatenate(self._in_chunks(evaluate, points, part)).astype(float)

        step = HESSIAN_STEP[np.dtype(self.target.dtype).itemsize < 8]
        self.subsample = subsampled_log_density(
            rows, log_p, functools.partial(self._values_and_gradients, gradient),
            self.full_log_densities_and_gradients, proposal, rng, step,
        )  # fmt: skip
        return self.log_density if self.subsample is None else self.subsample

    # ------------------------------------------------------------------ the verdict
    # what to use where q cannot represent the posterior. NUTS first: on the 12 posteriors
    # of 21 never seen here where GF or GPF said family-limited (2026-11-28; hierarchical
    # scales near 0, a lasso, an IRT model), the ensemble at its defaults ended converged on
    # 2 and accurate on 6, nutpie's NUTS was the reference on all 12 (divergences on 2)
    @property
    def alternative(self) -> str:
        full_data = f",{FULL_DATA}" if self.target.minibatch else ""
        return (
            f"Use {NUTS}, which samples the posterior itself{full_data}; method='ensemble' "
            "(Langevin chains) does too, but on such posteriors often needs many more steps "
            "than its default"
        )

    @property
    def alternative_clause(self) -> str:
        """:attr:`alternative` inside a sentence."""
        return f"{self.alternative[0].lower()}{self.alternative[1:]}"

    def check_fit(self, rng: np.random.Generator, max_draws: int) -> Verdict | None:
        """The verdict on a fit that converged (or ran untested): importance sampling with
        q as proposal (:func:`pymc_gpf.verdict.importance_check`), at most ``max_draws``
        draws from ``rng`` (``0``: no check, no verdict)."""
        if max_draws == 0:
            return None
        start = time.perf_counter()
        with np.errstate(all="ignore"):
            check = importance_check(self, rng, max_draws=max_draws)
        self._judged = (len(self.hist), check.pool)
        verdict = importance_verdict(check, self.alternative, time.perf_counter() - start)
        if self.subsample is None:
            return verdict
        subsample = self.subsample
        numbers = {"subsample_rows": subsample.size, "subsample_noise": subsample.noise}
        cause = verdict.cause + subsample.describe(self.target.subsample_rows)
        return replace(verdict, cause=cause, numbers=verdict.numbers | numbers)

    def judged_pool(self, size: int) -> ImportancePool:
        """The draws the fit's verdict judged, extended to at least ``size`` draws of q:
        what default PSIS-corrected draws resample from. Rebuilt from the verdict's stream
        where it is not kept (a loaded fit): the same draws either way, so the same
        ``sample(random_seed=...)``."""
        steps = len(self.hist)
        if self._judged is None or self._judged[0] != steps:
            with np.errstate(all="ignore"):
                check = importance_check(
                    self, self.inference.verdict_rng(),
                    max_draws=self.inference.fit_options.check_draws,
                )  # fmt: skip
            self._judged = (steps, check.pool)
        pool = self._judged[1]
        if pool.size >= size:
            return pool
        if self._extended is None or self._extended[0] != steps or self._extended[1].size != size:
            with np.errstate(all="ignore"):
                self._extended = (steps, pool.copy().grow_to(size))
        return self._extended[1]

    def check_proposal(self, rng: np.random.Generator):
        """What the importance check draws from, and (for a degenerate q, whose density
        is not defined) q itself to read its moments from; else ``None``."""
        q, undefined = self.proposal(None, rng)
        if undefined is None:
            return q, None
        return self.proposal(True, rng)[0], q

    def _compiled_for(self, key, compile_fn, *args):
        """A compiled function of the target, once per fit backend, and kept with the
        target's graphs for later fits of the same model where they share them
        (:meth:`~pymc_gpf.target.BatchedTarget.remember`): building the graph anew took a
        third of a warm automatic GPF fit's loop on a 26-coefficient logistic regression
        (its bias check and fresh-cloud tests evaluate log-densities)."""
        backend = self.inference.compile_backend
        which = (key, backend, *args)
        if which not in self._compiled:
            target = self.target

            def build():
                return compile_fn(*args, backend=backend)

            shared = target.reusable and target.row_sharding is None
            self._compiled[which] = (
                target.remember(("compiled", *which), build) if shared else build()
            )
        return self._compiled[which]

    def _check_points(self, points) -> np.ndarray:
        points = np.atleast_2d(np.asarray(points, dtype=self.target.dtype))
        if points.ndim != 2 or points.shape[-1] != self.target.ndim:
            raise ValueError(
                f"points must have {self.target.ndim} columns (flat unconstrained coordinates "
                f"{self.target.labels}), got shape {points.shape}."
            )
        return points

    def constrained(self, flat: np.ndarray, include_transformed: bool = False) -> dict:
        """Flat unconstrained points ``(S, D)`` as constrained variables and deterministics."""
        fn = self._compiled_for(
            "constrained", self.target.compile_constrained, bool(include_transformed)
        )
        return fn(flat)

    def sample(
        self,
        draws: int = 500,
        *,
        random_seed=None,
        return_inferencedata: bool = True,
        include_transformed: bool | None = None,
        psis: bool | None = None,
        regularize: bool | float | None = None,
    ):
        """Draw from the fitted q; an ArviZ DataTree as ``approx.sample`` in PyMC.

        Groups: ``posterior`` (chain=1, draw; free variables and deterministics),
        ``observed_data``, ``constant_data``, ``fit`` (``free_energy`` on ``step``) and the
        method's own group (with the numbers of the last :func:`pymc_gpf.diagnose`). With
        ``return_inferencedata=False`` a dict of arrays.

        ``psis=True`` returns PSIS-corrected draws instead: a pool of ``4 * draws`` draws
        of q (at least 16 384, fewer for a large model: :func:`pymc_gpf.importance.capped`,
        so that k̂ of the weights is reliable;
        a Gaussian q's plus a quarter as many of q with twice its sds, a defensive mixture,
        :class:`pymc_gpf.importance.ImportancePool`) is importance-weighted towards the
        posterior (Pareto-smoothed) and ``draws`` of them resampled by weight; the diagnosis
        of those draws is stored, and a warning says when k̂ makes them unreliable.
        ``regularize`` gives a degenerate q the density PSIS needs (as in
        :func:`pymc_gpf.diagnose`). The default, ``psis=None``, returns them where the fit's
        verdict found q measurably off and importance sampling reliable
        (``approx.outcome.checks["psis_default"]``: family-limited with k̂ < 0.7), resampled
        from the very draws the verdict judged, whose k̂ it found reliable (extended if
        ``4 * draws`` exceeds them), so they cost no second pass over the data; q's own
        draws otherwise. ``psis=False`` always gives q's draws. The ``posterior`` group's
        ``draws_from`` attribute says which ("q" or "psis").
        """
        if not is_integer(draws, 1):
            raise ValueError(f"draws must be a positive integer, got {draws!r}.")
        if include_transformed is None:
            options = self.inference.fit_options
            include_transformed = bool(options and options.include_transformed)
        rng = np.random.default_rng(seed_sequence(random_seed))
        default = psis is None
        if default:
            psis = self.psis_by_default
        if psis:
            if default and regularize is None:  # the verdict's draws: no second pass
                pool = self.judged_pool(POOL_PER_DRAW * int(draws))
            else:
                size = max(POOL_PER_DRAW * int(draws), capped(PSIS_POOL, self.target.ndim))
                q, undefined = self.proposal(ridge_option(regularize), rng)
                if undefined is not None:
                    raise ValueError(
                        f"PSIS needs a density for q, but {undefined}. Pass regularize=True."
                    )
                pool = ImportancePool(q, self.weights_log_density(q, rng), rng).grow_to(size)
            log_p, log_q, _, from_q = pool.arrays
            diagnosis_of(self, pool.proposal, log_p[from_q], log_q[from_q])
            flat = pool.resample(int(draws), rng)
        else:
            if regularize is not None:
                raise ValueError("regularize applies to psis=True draws only.")
            flat = self.draw(int(draws), rng)
        values = self.constrained(flat, include_transformed)
        if not return_inferencedata:
            return values
        tree = build_datatree(
            self.model,
            values,
            fit=self.fit_group(),
            method=self.inference.name,
            method_group=self.method_group(),
        )
        tree["posterior"].attrs["draws_from"] = "psis" if psis else "q"
        return tree

    @property
    def psis_by_default(self) -> bool:
        """Whether ``sample()`` returns PSIS-corrected draws by default: the verdict found q
        measurably off the posterior where importance sampling is reliable."""
        outcome = self.inference.outcome
        return bool(outcome is not None and outcome.checks.get("psis_default", False))

    def save(self, path, draws: int = 0, random_seed=None):
        """Write the fit (state included, so :func:`pymc_gpf.load` can continue it) to a
        netCDF file, or a zarr store if ``path`` ends in ``.zarr``; with ``draws`` > 0 the
        file also holds that many posterior draws. Returns the path."""
        return save(self, path, draws, random_seed)

    def to_datatree(self, draws: int = 0, random_seed=None) -> xr.DataTree:
        """The fit as the DataTree :meth:`save` writes."""
        return to_datatree(self, draws, random_seed)

    def method_group(self) -> xr.Dataset:
        """The method's DataTree group: fitted state, settings, and the last diagnosis."""
        group = self._method_group()
        if self.diagnosis is not None:
            diagnosis = self.diagnosis.to_dataset()
            group = group.assign(diagnosis.data_vars)
            group.attrs.update(diagnosis.attrs)
        return group

    def _points_dataset(
        self, points: np.ndarray, dim: str, settings: dict[str, Any], extra: dict | None = None
    ) -> xr.Dataset:
        """A method group (see :func:`points_dataset`)."""
        values = self.constrained(points)
        return points_dataset(self.model, values, points, self.target.labels, dim, settings, extra)


class ParticlesMixin:
    """For an approximation whose fitted state is ``shared_particles`` ``(N, D)``."""

    @property
    def params(self) -> list:
        """Shared variables of the fitted state: the particles."""
        return [self.shared_particles]

    @property
    def particles(self) -> np.ndarray:
        """The particles ``(N, D)`` in flat unconstrained space (a NumPy copy: on JAX the
        shared value is a JAX array, which the verdict's mode search must write into)."""
        return np.array(self.shared_particles.get_value(borrow=True))  # one copy, not two

    def centre(self) -> tuple[np.ndarray, np.ndarray]:
        """The particles' mean and sds: where minibatch control variates anchor."""
        particles = self.particles
        return particles.mean(axis=0), np.maximum(particles.std(axis=0), 1e-300)

    def narrow(self, factor: float, centre: np.ndarray | None = None) -> None:
        """Move every particle ``factor`` of its way from ``centre`` (default: their mean;
        a start whose spread reached where the log-density is not finite)."""
        particles = self.shared_particles.get_value()
        centre = particles.mean(axis=0) if centre is None else centre
        factor = np.asarray(factor, dtype=particles.dtype)
        self.shared_particles.set_value(centre + factor * (particles - centre))

    def _method_group(self) -> xr.Dataset:
        """The particles on a ``particle`` dim and the fit's settings."""
        return self._points_dataset(self.particles, "particle", self.inference.settings())


class GaussianApproximation(FlowApproximation):
    """A fit whose q is one Gaussian ``N(m, C)`` (GPF, GF): draws and density come from
    :meth:`gaussian`."""

    # the modes the verdict's search found that q does not cover with at least CELL_SHARE
    # of the mass, flat ``(M, D)``, the heaviest first (WVGD starts cells on them)
    other_modes: np.ndarray | None = None

    def gaussian(self) -> GaussianQ:
        """The fitted q as a NumPy :class:`~pymc_gpf.gaussian.GaussianQ`."""
        raise NotImplementedError

    def draw(self, draws: int, rng: np.random.Generator) -> np.ndarray:
        """``draws`` points of q in flat unconstrained space, ``(draws, D)``."""
        return self.gaussian().sample(draws, rng)

    def logq(self, points: np.ndarray) -> np.ndarray:
        """``log q(x)`` at flat unconstrained points ``(S, D)`` (e.g. draws for importance
        ratios ``log p - log q``). When C is singular (GPF with ``N <= D``, GF with rank
        ``K < D``) q is degenerate: this is its density on its affine support, ``-inf`` off
        it; :func:`pymc_gpf.diagnose` offers a regularised alternative."""
        return self.gaussian().logpdf(self._check_points(points))

    def _why_singular(self) -> str:
        """What makes C singular, in the method's terms."""
        return "its covariance is singular"

    def _mean_and_sd(self) -> tuple[np.ndarray, np.ndarray]:
        """q's mean and sds, flat unconstrained (GPF's particles mixin has its own
        :meth:`centre`, so :meth:`location` reads this one by name)."""
        q = self.gaussian()
        return q.mean, np.sqrt(np.maximum(q.marginal_variances(), 1e-300))

    def centre(self) -> tuple[np.ndarray, np.ndarray]:
        """q's mean and sds: where minibatch control variates anchor."""
        return self._mean_and_sd()

    def location(self) -> tuple[np.ndarray, np.ndarray]:
        """What the stochastic stopping test watches, and its unit: q's mean in units of
        its sds and the log of its sds (unit 1: a relative error), ``(values, units)``."""
        mean, sd = self._mean_and_sd()
        return np.concatenate([mean, np.log(sd)]), np.concatenate([sd, np.ones_like(sd)])

    def check_fit(self, rng: np.random.Generator, max_draws: int) -> Verdict | None:
        """The importance check's verdict (:meth:`FlowApproximation.check_fit`), then a
        search for modes q does not cover (:mod:`pymc_gpf.modes`): "family-limited" where
        they would move q's marginals beyond the verdict's tolerances."""
        verdict = super().check_fit(rng, max_draws)
        if verdict is None or self.target.ndim > MODE_SEARCH_DIMENSIONS:
            return verdict
        start = time.perf_counter()
        q = self.gaussian()
        if q.degenerate:  # a proper Gaussian to whiten by
            q = q.with_ridge(q.smallest_variance())
        try:
            starts, drawn = self.target.prior_draws(rng.integers(2**63, size=MODE_STARTS))
            starts = np.where(drawn, starts, self._undrawn_starts(q, starts.shape, drawn, rng))
            with np.errstate(all="ignore"):
                search = search_modes(
                    self.full_log_densities_and_gradients, self.log_density, starts,
                    q.mean.astype(float), q.covariance(), rng, max_iterations=MODE_ITERATIONS,
                    step=HESSIAN_STEP[np.dtype(self.target.dtype).itemsize < 8],
                )  # fmt: skip
        except (ValueError, NotImplementedError, np.linalg.LinAlgError) as err:
            # a check that cannot run must not take the finished fit with it: it says so
            error = f"{type(err).__name__}: {str(err)[:200]}"
            return replace(verdict, numbers=verdict.numbers | {"mode_search_error": error})
        order = np.argsort(-search.shares)  # the heaviest first
        self.other_modes = search.modes[order][search.shares[order] >= CELL_SHARE]
        return modes_verdict(verdict, search, self.target.labels, time.perf_counter() - start)

    def _undrawn_starts(self, q, shape: tuple[int, int], drawn, rng) -> np.ndarray:
        """Starts of the mode search where the prior has no draw (``Flat``, a ``CustomDist``
        with only a log-density, one a transform cannot map): q's mean plus
        :data:`MODE_SPREAD` of q's sds times a standard normal; and, where some coordinate has
        none, every other start instead around the model's initial point, as far out again
        as q is from it (at least that spread), in antithetic pairs. From q alone no start
        left q's basin: a ``Flat`` x with ``y ~ N(x^2, 1)`` fitted at x = -2 passed as
        trustworthy, the mode at +2 (half the mass) never seen."""
        spread = MODE_SPREAD * np.sqrt(q.marginal_variances())
        starts = q.mean + spread * rng.standard_normal(shape)
        if np.all(drawn):
            return starts
        origin = self.target.start_vector()
        reach = np.maximum(2.0 * np.abs(q.mean - origin), spread)
        z = rng.standard_normal(((shape[0] + 2) // 4, shape[1]))
        # in antithetic pairs (+-z): a start on either side of the initial point
        distant = origin + reach * np.stack([z, -z], axis=1).reshape(-1, shape[1])
        starts[1::2] = distant[: len(starts[1::2])]
        return starts

    def proposal(self, ridge, rng):
        q = self.gaussian()
        if not q.degenerate:
            return q, None
        if ridge is None:
            return q, (
                f"q = N(m, C) is degenerate: C has rank {q.rank} < D = {q.ndim} "
                f"({self._why_singular()}), so q has no density on R^D"
            )
        return q.with_ridge(q.smallest_variance() if ridge is True else ridge), None


def fit_dataset(inference) -> xr.Dataset:
    """The DataTree's ``fit`` group: free energy and step size on ``step``, how the fit
    ended (``converged``, ``stop_reason``, ``stopped_at_step``, ``stop_message``) and
    what it cost (``gradient_evaluations``: points where the log-density and its
    gradient were evaluated; ``density_evaluations``: without gradient) in its
    attributes."""
    attrs = {} if inference.outcome is None else inference.outcome.attrs()
    attrs["gradient_evaluations"] = int(inference.gradient_evaluations)
    attrs["density_evaluations"] = int(inference.density_evaluations)
    if inference.fit_options is not None:
        tol = inference.fit_options.tol
        attrs["tol"] = "none" if tol is None else tol
        attrs["learning_rate"] = inference.fit_options.settings()["learning_rate"]
    group = fit_group(inference.name, inference.hist, inference.step_sizes, attrs)
    if inference.hyper_trace and inference.fit_options is not None:
        group = _with_hyper_trace(group, inference)
    return group


def _with_hyper_trace(group: xr.Dataset, inference) -> xr.Dataset:
    """The learnt hyperparameters' values on ``step`` (``hyper_<name>``, ``nan`` before
    they were learnt), their final values and θ's last decrement in the attributes."""
    params = inference.fit_options.more_obj_params
    trace = np.asarray(inference.hyper_trace, dtype=float)
    n = group.sizes["step"]
    trace = np.concatenate([np.full((max(n - len(trace), 0), trace.shape[1]), np.nan), trace])
    trace = trace[-n:] if n else trace[:0]
    offset = 0
    for i, p in enumerate(params):
        value = np.asarray(p.get_value())
        name = f"hyper_{p.name or i}"
        column = trace[:, offset : offset + value.size]
        offset += value.size
        if value.ndim == 0:
            group[name] = ("step", column[:, 0])
            group.attrs[name] = float(value)
        else:
            group[name] = (("step", f"{name}_dim"), column)
            group.attrs[name] = value.ravel().astype(float)
    if inference.hyper is not None:
        group.attrs["hyper_decrement"] = inference.hyper.decrement
        group.attrs["hyper_steps"] = inference.hyper.steps
    return group


def points_dataset(
    model, values: dict, points: np.ndarray, labels: list[str], dim: str,
    settings: dict[str, Any], extra: dict | None = None,
) -> xr.Dataset:  # fmt: skip
    """A method group: the constrained ``values`` of ``points`` on ``dim``, the points
    unconstrained on ``(dim, coordinate)``, and the settings as attributes."""
    coords, dims = coords_and_dims_for_inferencedata(model)
    ds = dict_to_dataset(values, coords=coords, dims=dims, sample_dims=[dim])
    ds = ds.assign(
        unconstrained=xr.DataArray(points, dims=(dim, "coordinate"), coords={"coordinate": labels}),
        **(extra or {}),
    )
    ds.attrs = settings_attrs(settings)
    return ds


class ParticleCloud(ParticlesMixin, GaussianApproximation):
    """Particles ``(N, D)`` whose q is the Gaussian of their mean and sds: the
    approximation of a new method that moves a cloud (docs: "Adding a method")."""

    def __init__(self, inference: FlowInference, particles: np.ndarray):
        super().__init__(inference)
        self.shared_particles = pytensor.shared(particles, name=f"{inference.name}_particles")

    def gaussian(self) -> GaussianQ:
        x = self.particles
        return GaussianQ(x.mean(axis=0), (np.arange(x.shape[1]),), (x.std(axis=0),))
