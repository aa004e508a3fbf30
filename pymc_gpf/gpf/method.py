"""GPF as a PyMC inference: ``pm.fit(method="gpf")`` or ``pm.fit(method=GPF(...))``."""

from __future__ import annotations

import warnings

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import cache, cached_property
from typing import ClassVar

import numpy as np
import pymc as pm
import pytensor
import pytensor.tensor as pt
import xarray as xr

from pymc_gpf.approximation import GaussianApproximation, ParticlesMixin
from pymc_gpf.checks import check_particles, renamed
from pymc_gpf.clouds import antithetic_cloud
from pymc_gpf.control import CRAWL, Control, Deterministic
from pymc_gpf.engine import FlowInference
from pymc_gpf.errors import FitWarning
from pymc_gpf.gaussian import GaussianQ
from pymc_gpf.gf import GF, arrow_points, model_locals
from pymc_gpf.gf.parameters import automatic_structure, low_rank_rank
from pymc_gpf.gpf import flow, held, step
from pymc_gpf.gpf.config import GPFConfig
from pymc_gpf.gpf.fresh import fresh_draws_fit
from pymc_gpf.gpf.particles import (
    MAX_DEFAULT_PARTICLES,
    MIN_DEFAULT_PAIRS,
    ParticleStages,
    biased_message,
    can_double,
    cap_would_converge,
    cloud_of,
    restart_cloud,
    start_cloud,
)
from pymc_gpf.options import AUTO, FitOptions, resolve_natural_mean
from pymc_gpf.protocols import Initialised
from pymc_gpf.record import FitRecord
from pymc_gpf.start import initial_centre
from pymc_gpf.stepgraph import StepGraph
from pymc_gpf.structure import Structure, parse_structure

__all__ = ["GPF", "GPFApproximation"]

# GPF's streams under the fit's seed (the engine's: pymc_gpf.engine, END_STREAM ...)
FRESH_STREAM = 7  # GF's continuation with fresh draws (pymc_gpf.gpf.fresh), an arrow's fit
VIEW_STREAM = 9  # the particles showing that continuation's q to callbacks


class GPFApproximation(ParticlesMixin, GaussianApproximation):
    """The fitted GPF: ``N`` particles, read as the Gaussian ``q = N(m, C)`` they define.

    ``mean``, ``std`` and ``cov`` are PyTensor expressions of the particles in flat
    unconstrained space (``approx.mean.eval()``), like PyMC's approximations; ``particles``
    is a NumPy copy. ``sample`` draws from ``q`` (eq. 16), not by resampling particles.
    """

    def __init__(self, inference: GPF, particles: np.ndarray):
        super().__init__(inference)
        # the number of particles is dynamic: the automatic fit may restart with more
        self.shared_particles = pytensor.shared(
            particles, name="gpf_particles", shape=(None, particles.shape[1])
        )

    @property
    def structure(self) -> Structure:
        """The block structure of the flow (§3.5): full, diagonal or blocks of variables."""
        return self.inference.structure

    @property
    def arrow(self):
        """With a structure that particles cannot span (the hierarchical arrow, the low-rank
        structure), the Gaussian that GF's flow fitted (:class:`~pymc_gpf.gf.GFApproximation`,
        whose q this fit reports; the particles then show it); else ``None``."""
        return self.inference.arrow

    @property
    def params(self) -> list:
        """Shared variables of the fitted state: the particles (GF's mean and factors with
        the hierarchical or low-rank structure)."""
        return self.arrow.params if self.arrow is not None else [self.shared_particles]

    @property
    def mean(self) -> pt.TensorVariable:
        """The particle mean ``m`` (eq. 13) in flat unconstrained space, a PyTensor
        expression (``.eval()``)."""
        return self.arrow.mean if self.arrow is not None else self._particle_moments[0]

    @property
    def std(self) -> pt.TensorVariable:
        """Square roots of the diagonal of ``C`` (eq. 15, with ``1/N``)."""
        return self.arrow.std if self.arrow is not None else self._particle_moments[1]

    @property
    def cov(self) -> pt.TensorVariable:
        """The empirical covariance ``C = (1/N) sum_i (x_i - m)(x_i - m)^T`` (eq. 15),
        block-diagonal as the structure says; a PyTensor expression (forms a ``D x D``
        matrix, unlike the fit)."""
        if self.arrow is not None:
            return self.arrow.cov
        z = self.shared_particles - self._particle_moments[0]
        cov = pt.dot(z.T, z) / z.shape[0]
        return cov if self.structure.kind == "full" else cov * self.structure.mask()

    @cached_property
    def _particle_moments(self) -> tuple[pt.TensorVariable, pt.TensorVariable]:
        mean = self.shared_particles.mean(axis=0)
        return mean, pt.sqrt(pt.mean(pt.square(self.shared_particles - mean), axis=0))

    def gaussian(self) -> GaussianQ:
        """The fitted ``q = N(m, C)`` (NumPy; degenerate when ``N <= D``)."""
        if self.arrow is not None:
            return self.arrow.gaussian()
        return flow.gaussian_q(self.particles, self.structure)

    def _why_singular(self) -> str:
        n = len(self.particles)
        return f"{n} particles span at most {n - 1} directions"

    def _method_group(self) -> xr.Dataset:
        return self._points_dataset(self.particles, "particle", self.inference.settings())


@dataclass
class GPFState:
    """What GPF keeps over its fits besides the engine's record: created by ``_initialise``,
    its fields updated as the fit goes (the inference's own attributes are not)."""

    stages: ParticleStages = field(default_factory=ParticleStages)  # restarts, fresh draws
    auto: held.AutoStep | None = None  # the automatic step (held.build): best state, restarts
    fresh: GF | None = None  # GF's fit that continued this run (fresh.py), its trace to record
    gf: GF | None = None  # and the one that continues any refine (saved as its continuation)


def arrow_particles(structure: Structure) -> int:
    """Particles showing GF's q: antithetic pairs on an arrow's globals and one local, or on
    the low-rank structure's default rank and one more."""
    if structure.low_rank:
        return 2 * (low_rank_rank(None, structure.ndim) + 1)
    return 2 * (len(structure.blocks[0]) + 1)


def fitted_by_gf(structure: Structure) -> bool:
    """A structure whose q particles cannot span: GF's flow fits it (the hierarchical arrow,
    the low-rank structure)."""
    return structure.hierarchical or structure.low_rank


class GPF(FlowInference):
    r"""Gaussian Particle Flow (Galy-Fajou, Perrone & Opper, Entropy 2021, Algorithm 2).

    ``N`` particles move by one affine map per step (eq. 13)

    .. math:: x_i \leftarrow x_i - \eta_1 \bar g - \eta_2 (\psi - I)(x_i - m),
              \quad \psi = \tfrac1N \textstyle\sum_i g_i (x_i - m)^\top,\ g = -\nabla\log p,

    and their mean and covariance converge to a Gaussian variational approximation (exactly
    the target for a Gaussian with ``N >= D + 1``; the top ``N - 1`` eigenpairs for fewer).
    Cost per step ``O(N^2 D)`` plus ``N`` gradients, memory ``O(N(N + D))``.

    By default the step is natural, its size found by backtracking, and the fit stops by
    itself; the particles start as an antithetic cloud and, with ``n_particles="auto"``,
    double while a fresh cloud of the same Gaussian finds their fixed point off the
    optimum, or GF's fresh draws finish the fit where more particles would not do
    (:mod:`pymc_gpf.gpf.step`, :mod:`pymc_gpf.gpf.fresh`).

    Parameters
    ----------
    n_particles
        ``"auto"`` (default): ``2 max(D, 10)`` (at most 1000), doubled (at most to 8 times
        that) while a fresh cloud finds the fixed point off, then continued by GF's flow if
        needed. A number ``N >= 2`` is used as given; ``N <= D`` fits the top directions
        only (Theorem 3).
    structure
        ``"full"``, ``"diagonal"`` (mean field), ``"variables"`` (one block per free
        variable), a list of lists of variable names (block-diagonal, §3.5),
        ``"hierarchical"``, ``"low-rank"`` or ``"auto"`` (default). ``"hierarchical"`` (GF's
        arrow factor over a hierarchical model's globals and group effects) and
        ``"low-rank"`` (diagonal plus low rank, see :class:`pymc_gpf.GF`): particles cannot
        hold them (``N`` of them span ``N - 1`` directions), so GF's flow with fresh draws
        fits them and the particles show the result. ``"auto"``: where the automatic cloud
        could not span the model (``2 D`` above ``MAX_DEFAULT_PARTICLES`` = 1000),
        ``"hierarchical"`` if the model has locals and at most 200 globals, else
        ``"low-rank"`` above ``D = 1000``; otherwise ``"full"``.
    natural_mean
        Precondition the mean step by ``C`` (the natural-gradient shift after Theorem 2).
        Default: on with the automatic step size (where it is part of the natural flow), off
        with a fixed ``learning_rate`` (Algorithm 2 as printed).
    cloud
        The initial cloud around the starting point: ``"antithetic"`` (pairs ``+-u``,
        whitened: sample covariance exactly ``init_scale^2 I``; with ``N < 2D`` the pairs span a
        random ``N/2``-dimensional subspace), ``"random"`` (``N`` independent Gaussian
        draws, as the paper), or ``"auto"`` (default): antithetic with the automatic
        ``n_particles``, random with an explicit one.
    init
        ``"initial_point"`` (the model's initial point, updated by ``start``) or ``"map"``.
    init_scale
        Scale of the initial cloud around that point; must be positive (identical particles
        never separate). Called ``jitter`` before 0.2 (still accepted, with a warning).
    initial_particles
        Explicit ``(N, D)`` starting particles in flat unconstrained space (overrides
        ``init``/``init_scale``/``cloud``; column order as ``approx.target.labels``).
    model, random_seed, start, devices
        As in ``pm.fit``; ``devices`` as in :class:`~pymc_gpf.engine.FlowInference`.
    """

    name = "gpf"
    steps = (step.fixed_step, step.natural_step)
    inits = (step.init_fixed, step.init_natural)
    default_learning_rate = 1e-3
    renamed_options: ClassVar[dict[str, str]] = {"jitter": "init_scale"}

    def __init__(
        self,
        n_particles: int | str = AUTO,
        *,
        structure: str | Sequence[Sequence[str]] = AUTO,
        natural_mean: bool | None = None,
        cloud: str = "auto",
        init: str = "initial_point",
        init_scale: float = 0.1,
        initial_particles: np.ndarray | None = None,
        model: pm.Model | None = None,
        random_seed=None,
        start: dict | None = None,
        devices=None,
        jitter: float | None = None,
    ):
        init_scale = renamed("GPF", "jitter", "init_scale", jitter, init_scale, 0.1)
        config = GPFConfig(n_particles, structure, natural_mean, cloud, init, init_scale)
        super().__init__(
            config=config, initial_particles=initial_particles, model=model,
            random_seed=random_seed, start=start, devices=devices,
        )  # fmt: skip

    stages = property(lambda self: self.own.stages.stages)
    final_free_energy = property(lambda self: self.own.stages.final_free_energy)
    particle_free_energy = True

    def _initialise(self) -> Initialised:
        config, target = self.config, self.target
        centre = cache(lambda: initial_centre(target, self._start, config.init, self._init_rng))
        structure = self._resolve_structure(centre)
        if self.initial_particles is not None:
            particles = check_particles(self.initial_particles, target.dtype, target.labels, "N", 2)
            resolved = replace(config, n_particles=len(particles))
            return Initialised(GPFApproximation(self, particles), resolved, structure, GPFState())
        n = arrow_particles(structure) if fitted_by_gf(structure) else config.n_particles
        particles = start_cloud(
            n, config.cloud, config.init_scale, target.ndim, centre, self._init_rng, target.dtype,
        )  # fmt: skip
        return Initialised(GPFApproximation(self, particles), config, structure, GPFState())

    def _resolve_structure(self, centre: Callable[[], np.ndarray]) -> Structure:
        """The structure option, ``"auto"`` resolved (see :class:`GPF`); ``centre()`` is the
        starting point, where the hierarchical structure is probed."""
        target, config = self.target, self.config

        def find() -> Structure | None:
            return model_locals(target, centre())

        if config.structure != AUTO:
            return parse_structure(config.structure, target, find)
        spans = 2 * max(target.ndim, MIN_DEFAULT_PAIRS) <= MAX_DEFAULT_PARTICLES
        if spans or not config.auto_particles or self.initial_particles is not None:
            return parse_structure("full", target)
        return automatic_structure(target, find)

    def _narrow_start(self, factor: float) -> bool:
        if self.initial_particles is not None:  # the user's points: theirs to move
            return False
        self.approx.narrow(factor)
        return True

    def _fitted_settings(self) -> dict:
        explicit = self.initial_particles is not None
        cloud = "initial_particles" if explicit else self.resolved.resolved_cloud
        return {
            "n_particles": len(self.approx.particles),
            "n_particles_option": self.resolved.n_particles,
            "structure": self.structure.describe(),
            "natural_mean": resolve_natural_mean(self.config.natural_mean, self.fit_options),
            "cloud": cloud,
            "init": "initial_particles" if explicit else self.options_in_effect.init,
        } | self.own.stages.settings()

    # backtracking needs a deterministic free energy: full data
    _line_search = property(lambda self: not self.target.minibatch)

    def _build_step(self, options: FitOptions) -> StepGraph | None:
        if fitted_by_gf(self.structure):
            # GF's flow fits the structure (run_elsewhere): no particle step to compile
            if not options.auto or options.more_obj_params:
                kind = self.structure.kind
                raise ValueError(
                    f"structure={kind!r} takes the automatic step size and no more_obj_params "
                    f"(GF's flow fits it); pass structure='full' to GPF for those, or fit the "
                    f"{kind} structure with method='gf'."
                )
            return None
        rng = self._method_rng if self._line_search else None
        graph, self.own.auto = held.build(
            self.approx.shared_particles, self.target, self.structure, self.config.natural_mean,
            options, self.learning_rates, rng,
        )  # fmt: skip
        return graph

    def checkpoint_extra(self) -> dict:
        return self.own.stages.checkpoint(self._method_rng)

    def load_checkpoint_extra(self, extra: dict) -> None:
        self.own.stages = ParticleStages.load(extra, self._method_rng)

    continuation = property(lambda self: self.own.gf)

    def load_continuation(self, inner) -> None:
        self.own.gf = inner
        if fitted_by_gf(self.structure):
            self._adopt(inner)

    @property
    def arrow(self):
        """GF's fit of the hierarchical or low-rank structure (its approximation), once it
        has run."""
        return (
            self.own.gf.approx if fitted_by_gf(self.structure) and self.own.gf is not None else None
        )

    def _control(self, options: FitOptions) -> Control:
        if options.auto and self._line_search:
            return Deterministic(options.tol, crawl=CRAWL)
        return super()._control(options)

    def _on_stop(self, reason: str, step_count: int) -> str | None:
        """Every early stop must leave a converged state (:class:`Deterministic`): restore
        the best state and test it; test a fixed point on a fresh cloud of the same
        Gaussian; grow the cloud while that test, or the free energy's value, says its
        quadrature is too coarse and the cap could pass, else continue with fresh draws
        (:meth:`_fresh_draws`); restart a stalled cloud once."""
        if not (self.fit_options.auto and self._line_search):
            return reason
        if reason == "overfitting":
            self.own.stages.final_free_energy = self.own.auto.finish(restore_best=True)
            if self._may_continue and self._restart_cloud(len(self.approx.particles)):
                # tested on a fresh cloud of the best Gaussian: its error and the
                # quadrature's then add up, and the cap's can be estimated
                self.own.stages.cloud_checked = True
            self.revise_control(Deterministic.verify)
            return None
        if reason == "unverified":
            # the state tested is not at a fixed point: the best one an independent cloud
            # found (the particles' own is nearer their quadrature than the optimum), or the
            # particles' fixed point on a fresh cloud (their quadrature is too coarse). More
            # particles, unless even the cap would not do: then fresh draws every step
            decrement, n = self.control_state.last_decrement, len(self.approx.particles)
            fresh = self.own.stages.cloud_checked
            why = {"decrement_fresh_cloud" if fresh else "decrement_at_best": decrement}
            hopeless = fresh and not cap_would_converge(
                decrement, n, self.target.ndim, self.fit_options.tol
            )
            if not hopeless and self._grow(step_count, why):
                return None
            self.own.stages.begin(n)
            self.own.stages.stages[-1] |= why
            return self._fresh_draws("fresh_cloud" if fresh else "overfitting", step_count)
        if reason == "stalled":
            if self.own.stages.stall_restarts:
                # a second stall: the particles' quadrature of a non-smooth log-density (a
                # Laplace prior's kinks) has no descent direction left, where fresh draws
                # average over the kinks
                return self._fresh_draws("stalled", step_count)
            # a fresh cloud of the same Gaussian: a degenerate or unlucky one can stall
            self.own.stages.stall_restarts += 1
            if not self._restart_cloud(len(self.approx.particles)):
                return reason
            self.revise_control(Deterministic.restart)
            return None
        if reason != "converged":
            return reason
        if not self.resolved.auto_particles:
            self.own.stages.final_free_energy = self.own.auto.finish(restore_best=False)
            return reason
        checked = self.own.stages.cloud_checked or not self._may_continue
        if not checked and self._restart_cloud(len(self.approx.particles)):
            # the fixed point is the particles' quadrature's: a fresh cloud of the same
            # Gaussian must find it at a fixed point too (else it is off the optimum by
            # more than tol, and the cloud grows)
            self.own.stages.cloud_checked = True
            self.revise_control(Deterministic.verify)
            return None
        self.own.stages.final_free_energy = self.own.auto.finish(restore_best=False)
        decision, draws = self.own.stages.check(self.approx, self._method_rng)
        self.record.count(densities=draws)
        if decision != "double":
            return reason if decision == "unbiased" else self._fresh_draws(decision, step_count)
        return None if self._grow(step_count, {}) else self._fresh_draws("biased", step_count)

    def _fresh_draws(self, reason: str, step_count: int) -> str:
        """The particles' fixed point is off the Gaussian optimum (``reason``) and more of
        them would not do (the cap, or a quadrature too coarse even there): GF's flow
        continues from their Gaussian (:mod:`.fresh`) with the steps left, and its outcome
        is the fit's (if :attr:`_may_continue`)."""
        steps = self.step_limit - step_count
        ending = "biased" if reason == "fresh_cloud" else reason
        if not self._may_continue or steps < 1:
            return ending
        seed = int(self.stream(FRESH_STREAM).generate_state(1)[0])
        q = self.approx.gaussian()
        callbacks = self._callbacks_on_gf(np.asarray(self.run_trace), step_count, 0)
        gf = fresh_draws_fit(q, self, self.fit_options, steps, seed, callbacks)
        if gf is None:
            return ending
        self.record.count(gf.gradient_evaluations, gf.density_evaluations)
        n = len(self.approx.particles)
        self.own.stages.begin(n)
        self.own.stages.stages.append({
            "step": step_count, "n_particles": n, "fresh_draws": reason,
            # GF's own words, without its "(n steps this call)": this call adds it
            "message": gf.end_message(gf.outcome.reason),
        })  # fmt: skip
        self._adopt(gf)
        self.own.fresh = self.own.gf = gf
        return gf.outcome.reason

    def _callbacks_on_gf(self, trace: np.ndarray, step: int, gf_step: int) -> list:
        """The fit's callbacks ``cb(approx, hist, i)`` on the steps of GF's continuation,
        as on the particles' (from this fit's step ``step``, GF's ``gf_step``): with this
        approximation, its particles showing GF's q (a cloud with its mean and covariance,
        drawn once from a stream of its own, so that callbacks change no result), this
        run's trace ``trace`` followed by GF's, and the fit's step count. The step the
        continuation began at is shown first, as the particles left it."""
        if not self.state.callbacks:
            return []
        n, base = len(self.approx.particles), []

        def show(gf) -> None:
            if fitted_by_gf(self.structure):
                self.approx.shared_particles.set_value(self._arrow_cloud(gf))
                return
            if not base:
                rng = np.random.default_rng(self.stream(VIEW_STREAM))
                base.append(antithetic_cloud(n, gf.approx.factor.shape[1], rng))
            cloud = gf.approx.mean.get_value() + base[0] @ gf.approx.factor.T
            self.approx.shared_particles.set_value(cloud.astype(self.target.dtype))

        def through(callback):
            def call(approx, hist, i):
                if step > self.callbacks_saw:  # the particles' last step, not yet shown
                    callback(self.approx, trace, step)
                show(approx.inference)
                callback(self.approx, np.concatenate([trace, hist]), step + i - gf_step)

            return call

        callbacks = [through(callback) for callback in self.state.callbacks]

        def saw(approx, hist, i) -> None:
            self.callbacks_seen(step + i - gf_step)

        return [*callbacks, saw]

    def _arrow_cloud(self, gf) -> np.ndarray:
        """The particles showing GF's arrow or low-rank q: points of it, from standard
        normals drawn once per fit from a stream of their own (so showing them changes no
        result)."""
        rng = np.random.default_rng(self.stream(VIEW_STREAM))
        n, q = len(self.approx.particles), gf.approx.gaussian()
        if self.structure.low_rank:
            return q.sample(n, rng).astype(self.target.dtype)
        noise = rng.standard_normal((n, self.target.ndim))
        return arrow_points(q, noise, self.structure).astype(self.target.dtype)

    def _adopt(self, gf) -> None:
        """The particles represent GF's q exactly (same mean and covariance); an arrow or
        low-rank q, which particles cannot span, they show as points of it."""
        n = len(self.approx.particles)
        if fitted_by_gf(self.structure):
            self.approx.shared_particles.set_value(self._arrow_cloud(gf))
            self.own.stages.final_free_energy = gf.final_free_energy
            return
        cloud = cloud_of(gf.approx.mean.get_value(), gf.approx.factor, n, self._method_rng)
        self.own.auto.restart(cloud.astype(self.target.dtype))
        self.own.stages.final_free_energy = gf.final_free_energy

    @property
    def _may_continue(self) -> bool:
        """GF's flow may continue a biased fit (not with an explicit ``n_particles``, where
        the user chose the quadrature, nor while learning hyperparameters)."""
        return self.resolved.auto_particles and not self.fit_options.more_obj_params

    def run_elsewhere(self, n: int, progressbar: bool) -> str | None:
        """GF's flow runs the hierarchical or low-rank structure's first fit, and any
        refine of a fit it continued; the particles' own steps are the engine's."""
        if fitted_by_gf(self.structure) and self.own.gf is None:
            return self._arrow_fit(n, progressbar)
        if self.own.gf is None or not n:
            return None
        # the fit went on with GF's flow: refine continues that (its schedule, its average)
        gf = self.own.gf
        done, grads, densities = len(gf.hist), gf.gradient_evaluations, gf.density_evaluations
        self.callbacks_seen(self.state.i)
        gf.replace_callbacks(self._callbacks_on_gf(np.empty(0), self.state.i, done))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FitWarning)  # the verdict below says it once
            gf.refine(n, progressbar=progressbar)
        self.merge_run(FitRecord(
            gf.hist[done:], gf.step_sizes[done:],
            gradient_evaluations=gf.gradient_evaluations - grads,
            density_evaluations=gf.density_evaluations - densities,
        ))  # fmt: skip
        self._adopt(gf)
        self.own.stages.stages[-1]["message"] = gf.outcome.message
        self.conclude_run(gf.outcome.reason, n)
        return gf.outcome.reason

    def _arrow_fit(self, n: int, progressbar: bool) -> str:
        """The hierarchical or low-rank structure's first fit: GF's flow from this fit's
        start, seed and fit keywords (its verdict is this fit's), on record as a stage."""
        options = self.fit_options
        seed = int(self.stream(FRESH_STREAM).generate_state(1)[0])
        gf = GF(structure=self.structure.kind, init=self.config.init,
                init_scale=self.config.init_scale, model=self.model, random_seed=seed,
                start=self._start)  # fmt: skip
        self.own.gf = gf
        self.callbacks_seen(0)
        keywords = {"tol": options.tol, "backend": options.backend, "check_draws": 0,
                    "compile_kwargs": options.compile_kwargs,
                    "include_transformed": options.include_transformed}  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FitWarning)  # the verdict below says it once
            gf.fit(n, progressbar=progressbar, callbacks=self._callbacks_on_gf(np.empty(0), 0, 0),
                   **keywords)  # fmt: skip
        self.merge_run(FitRecord(
            gf.hist, gf.step_sizes, gradient_evaluations=gf.gradient_evaluations,
            density_evaluations=gf.density_evaluations,
        ))  # fmt: skip
        self.own.stages.stages.append({
            "step": 0, "n_particles": len(self.approx.particles),
            "fresh_draws": self.structure.kind, "message": gf.end_message(gf.outcome.reason),
        })  # fmt: skip
        self._adopt(gf)
        self.conclude_run(gf.outcome.reason, n)
        return gf.outcome.reason

    def run_ended(self, run: FitRecord) -> None:
        gf, self.own.fresh = self.own.fresh, None
        if gf is not None:  # its steps follow the particles' in the trace
            run.extend(gf.hist, gf.step_sizes, False)

    def _hyper_points(self, rng: np.random.Generator, draws: int) -> tuple[np.ndarray, bool]:
        if self.target.minibatch:  # each batch of draws its own minibatch: a noise estimate
            return super()._hyper_points(rng, draws)
        # the particles: the quadrature F~ itself uses, so the gradient is F~'s exactly
        return self.approx.particles, True

    def hyperparameters_moved(self) -> bool:
        if not (self.fit_options.auto and self._line_search):
            return False
        self.own.auto.reset()  # nothing evaluated at the new hyperparameters yet
        self.revise_control(Deterministic.restart)
        return True

    def _grow(self, step_count: int, why: dict) -> bool:
        """Restart from the same Gaussian with twice the particles, if the automatic
        ``n_particles`` may still grow; ``why`` goes into the stage's record (a biased free
        energy records its gap when checked)."""
        n = len(self.approx.particles)
        if not (self.resolved.auto_particles and can_double(n, self.target.ndim)):
            return False
        if not self._restart_cloud(2 * n):
            return False
        self.own.stages.begin(n)
        self.own.stages.stages[-1] |= why
        self.revise_control(Deterministic.restart)
        self.own.stages.restart(step_count, 2 * n)
        return True

    def _restart_cloud(self, n: int) -> bool:
        """Restart from a fresh cloud of ``n`` particles of the same Gaussian, unless one of
        them falls where the log-density is not finite (a hard boundary the particles
        approach): then the fit keeps its cloud."""
        cloud = restart_cloud(self.approx.particles, n, self._method_rng)
        finite = np.all(np.isfinite(self.approx.log_density(cloud)))
        self.record.count(densities=len(cloud))
        if not finite:
            return False
        self.own.auto.restart(cloud)
        return True

    def _describe(self, reason: str) -> str:
        last = self.stages[-1] if self.stages else {}
        if "fresh_draws" in last:
            if last["fresh_draws"] in ("hierarchical", "low-rank"):
                factor = {
                    "hierarchical": "hierarchical structure's arrow factor",
                    "low-rank": "low-rank structure's factor",
                }[last["fresh_draws"]]
                return (
                    f"{last['message']}; GF's flow (fresh draws of q every step) fitted the "
                    f"{factor}, which particles cannot span at "
                    f"D = {self.target.ndim} (the particles show its q)"
                )
            if last["fresh_draws"] == "stalled":
                because = (
                    "no step lowered their free energy, twice (a log-density that is not "
                    "smooth near q, e.g. a Laplace prior's kink, or not finite)"
                )
            else:
                why = {
                    "biased": "its free energy below an independent estimate",
                    "fresh_cloud": "a fresh cloud of the same Gaussian found it off a fixed point",
                    "overfitting": "where an independent cloud's free energy was lowest it was "
                    "not at a fixed point",
                }[last["fresh_draws"]]
                because = f"the particles' own fixed point was off the Gaussian optimum ({why})"
            return (
                f"{last['message']}; GF's flow (fresh draws of q every step) continued from "
                f"step {last['step']}, because with {last['n_particles']} particles {because}"
            )
        if reason == "converged" and self.own.stages.cloud_checked:
            return (
                f"{super()._describe(reason)}; a fresh cloud of the same Gaussian found it at "
                f"a fixed point too (decrement {self.control_state.last_decrement:.2g})"
            )
        if reason == "biased":
            return biased_message(self.stages[-1])
        if reason == "overfitting":
            n = len(self.approx.particles)
            more = (
                f"{n} particles are the cap of the automatic n_particles"
                if self.resolved.auto_particles
                else f"n_particles={n} was given: pass more, or n_particles='auto'"
            )
            return f"{super()._describe(reason)} ({more})"
        return super()._describe(reason)
