"""GPF as a PyMC inference: ``pm.fit(method="gpf")`` or ``pm.fit(method=GPF(...))``."""

from __future__ import annotations

import numbers
import warnings

from collections.abc import Sequence
from functools import cached_property
from typing import ClassVar

import numpy as np
import pymc as pm
import pytensor
import pytensor.tensor as pt
import xarray as xr

from pymc_gpf.approximation import GaussianApproximation
from pymc_gpf.checks import is_integer, renamed, seed_sequence
from pymc_gpf.clouds import antithetic_cloud, matching_cloud
from pymc_gpf.control import Control, Deterministic
from pymc_gpf.diagnostics import free_energy_gap
from pymc_gpf.engine import (
    AUTO,
    FitOptions,
    FlowInference,
    StepGraph,
    transform_direction,
)
from pymc_gpf.gaussian import GaussianQ
from pymc_gpf.gpf import flow
from pymc_gpf.stepsize import Backtracking, accept_trial, cap, next_step_size
from pymc_gpf.structure import Structure, parse_structure

__all__ = ["GPF", "GPFApproximation"]

MAX_DEFAULT_PARTICLES = 1000
MIN_DEFAULT_PAIRS = 10
MAX_DOUBLINGS = 3  # the automatic N grows at most to 8 times its start
BIAS_DRAWS = 1000  # draws of the independent -ELBO estimate that checks the cloud's bias
BIAS_FLOOR = 0.01  # nats: a smaller significant gap is not worth more particles
BACKTRACKING = Backtracking()
# trust region of the stochastic (minibatch) natural step, in units of q's spread
MAX_MEAN_STEP, MAX_SCALE_STEP = 1.0, 0.5


def default_n_particles(ndim: int) -> int:
    """``2 max(D, 10)``: antithetic pairs spanning every direction (a cubature rule exact to
    degree 3 for every Gaussian the particles represent), at least 20 and at most 1000."""
    n = 2 * max(ndim, MIN_DEFAULT_PAIRS)
    if n > MAX_DEFAULT_PARTICLES:
        warnings.warn(
            f"The model has D = {ndim} unconstrained dimensions; the default uses "
            f"{MAX_DEFAULT_PARTICLES} particles in {MAX_DEFAULT_PARTICLES // 2} antithetic "
            f"pairs, so the fitted Gaussian has rank {MAX_DEFAULT_PARTICLES // 2} < D. Pass "
            f"inf_kwargs={{'n_particles': N}} to choose (N = {ndim + 1} with cloud='random' "
            "gives a full-rank fit).",
            UserWarning,
            stacklevel=3,
        )
        n = MAX_DEFAULT_PARTICLES
    return n


class GPFApproximation(GaussianApproximation):
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
    def params(self) -> list:
        """Shared variables of the fitted state: the particles."""
        return [self.shared_particles]

    @property
    def particles(self) -> np.ndarray:
        """The particles ``(N, D)`` in flat unconstrained space (a copy)."""
        return self.shared_particles.get_value()

    @cached_property
    def mean(self) -> pt.TensorVariable:
        """The particle mean ``m`` (eq. 13) in flat unconstrained space, a PyTensor
        expression (``.eval()``)."""
        return self.shared_particles.mean(axis=0)

    @cached_property
    def std(self) -> pt.TensorVariable:
        """Square roots of the diagonal of ``C`` (eq. 15, with ``1/N``)."""
        return pt.sqrt(pt.mean(pt.square(self.shared_particles - self.mean), axis=0))

    @cached_property
    def cov(self) -> pt.TensorVariable:
        """The empirical covariance ``C = (1/N) sum_i (x_i - m)(x_i - m)^T`` (eq. 15),
        block-diagonal as the structure says; a PyTensor expression (forms a ``D x D``
        matrix, unlike the fit)."""
        z = self.shared_particles - self.mean
        cov = pt.dot(z.T, z) / z.shape[0]
        return cov if self.structure.kind == "full" else cov * self.structure.mask()

    def gaussian(self) -> GaussianQ:
        """The fitted ``q = N(m, C)`` (NumPy; degenerate when ``N <= D``)."""
        return flow.gaussian_q(self.particles, self.structure)

    def _why_singular(self) -> str:
        n = len(self.particles)
        return f"{n} particles span at most {n - 1} directions"

    def _method_group(self) -> xr.Dataset:
        return self._points_dataset(self.particles, "particle", self.inference.settings())


class GPF(FlowInference):
    r"""Gaussian Particle Flow (Galy-Fajou, Perrone & Opper, Entropy 2021, Algorithm 2).

    ``N`` particles move by one affine map per step (eq. 13)

    .. math:: x_i \leftarrow x_i - \eta_1 \bar g - \eta_2 (\psi - I)(x_i - m),
              \quad \psi = \tfrac1N \textstyle\sum_i g_i (x_i - m)^\top,\ g = -\nabla\log p,

    and their mean and covariance converge to a Gaussian variational approximation (exactly
    the target for a Gaussian with ``N >= D + 1``; the top ``N - 1`` eigenpairs for fewer).
    Cost per step ``O(N^2 D)`` plus ``N`` gradients, memory ``O(N(N + D))``.

    By default (``learning_rate="auto"`` in ``fit``) both parts of the step are
    preconditioned by the particle covariance (:func:`pymc_gpf.gpf.flow.natural_flow`:
    Newton-like, whatever the posterior's scales and correlations), the step size is found
    by backtracking on the free energy, and the fit stops by itself. The particles start as
    an antithetic, exactly whitened cloud (:mod:`pymc_gpf.clouds`), a cubature rule exact to
    degree 3 that every affine step preserves; a second, independent cloud of the same
    Gaussian watches for finite-N bias (the fit stops where the two disagree), and with
    ``n_particles="auto"`` an independent Monte Carlo check of the free energy decides
    whether to restart from the fitted Gaussian with twice the particles (at most
    8 times the start).

    Parameters
    ----------
    n_particles
        ``"auto"`` (default): ``2 max(D, 10)`` (at most 1000), doubled while the free energy
        is significantly biased. A number ``N >= 2`` is used as given; ``N <= D`` fits the
        top directions only (Theorem 3).
    structure
        ``"full"``, ``"diagonal"`` (mean field), ``"variables"`` (one block per free
        variable) or a list of lists of variable names (block-diagonal, §3.5).
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
    model, random_seed, start
        As in ``pm.fit``.
    """

    name = "gpf"
    default_learning_rate = 1e-3
    renamed_options: ClassVar[dict[str, str]] = {"jitter": "init_scale"}
    CLOUDS = ("auto", "antithetic", "random")

    def __init__(
        self,
        n_particles: int | str = AUTO,
        *,
        structure: str | Sequence[Sequence[str]] = "full",
        natural_mean: bool | None = None,
        cloud: str = "auto",
        init: str = "initial_point",
        init_scale: float = 0.1,
        initial_particles: np.ndarray | None = None,
        model: pm.Model | None = None,
        random_seed=None,
        start: dict | None = None,
        jitter: float | None = None,
    ):
        self.n_particles = AUTO if n_particles is None else n_particles
        self.natural_mean = natural_mean if natural_mean is None else bool(natural_mean)
        self.cloud = cloud
        self.init = init
        self.init_scale = renamed("GPF", "jitter", "init_scale", jitter, init_scale, 0.1)
        self.initial_particles = initial_particles
        self._structure_option = structure
        self.stages: list[dict] = []
        self.final_free_energy: float | None = None
        super().__init__(model=model, random_seed=random_seed, start=start)

    @property
    def auto_particles(self) -> bool:
        """Whether the number of particles is chosen (and grown) by the fit."""
        return self._auto_particles

    # ------------------------------------------------------------------ initialising
    def _seed(self, random_seed) -> None:
        super()._seed(random_seed)
        # restarts and independent clouds draw from their own stream (saved with the fit)
        self._cloud_rng = np.random.default_rng(seed_sequence(random_seed).spawn(4)[3])

    def _initialise(self) -> GPFApproximation:
        d = self.target.ndim
        self.structure = parse_structure(self._structure_option, self.target)
        if self.cloud not in self.CLOUDS:
            raise ValueError(f"cloud must be one of {self.CLOUDS}, got {self.cloud!r}.")
        self.stages, self.final_free_energy = [], None
        if self.initial_particles is not None:
            particles = self._check_particles(self.initial_particles)
            self.n_particles = len(particles)
            self._auto_particles = False
            return GPFApproximation(self, particles)
        self._auto_particles = isinstance(self.n_particles, str) and self.n_particles == AUTO
        n = default_n_particles(d) if self._auto_particles else self.n_particles
        if not is_integer(n, 2):
            raise ValueError(
                f"n_particles must be 'auto' or an integer >= 2 (particles define a covariance "
                f"through their spread), got {n!r}. N = D + 1 = {d + 1} gives a full-rank fit."
            )
        scale = self.init_scale
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not scale > 0:
            raise ValueError(
                f"init_scale must be a positive number (identical particles never separate), "
                f"got {scale!r}."
            )
        if not np.isfinite(scale):
            raise ValueError(f"init_scale must be finite, got {scale!r}.")
        centre = self._initial_centre(self.init)
        if self.resolved_cloud == "antithetic":
            noise = antithetic_cloud(int(n), d, self._init_rng)
        else:
            noise = self._init_rng.standard_normal((int(n), d))
        particles = (centre + float(scale) * noise).astype(self.target.dtype)
        return GPFApproximation(self, particles)

    @property
    def resolved_cloud(self) -> str:
        if self.cloud != "auto":
            return self.cloud
        return "antithetic" if self._auto_particles else "random"

    def _check_particles(self, particles) -> np.ndarray:
        particles = np.array(particles, dtype=self.target.dtype)
        d = self.target.ndim
        if particles.ndim != 2 or particles.shape[1] != d or particles.shape[0] < 2:
            raise ValueError(
                f"initial_particles must have shape (N, {d}) with N >= 2 (flat unconstrained "
                f"coordinates {self.target.labels}), got {particles.shape}."
            )
        if not np.all(np.isfinite(particles)):
            raise ValueError("initial_particles contains non-finite values.")
        frozen = np.ptp(particles, axis=0) == 0
        if frozen.any():
            raise ValueError(
                f"initial_particles are identical along {np.asarray(self.target.labels)[frozen]}"
                "; particles that coincide in a coordinate never separate. Add noise."
            )
        return particles

    def constructor_options(self) -> dict:
        return {
            "n_particles": AUTO if self._auto_particles else int(self.n_particles),
            "structure": self._structure_option,
            "natural_mean": self.natural_mean,
            "cloud": self.cloud,
            "init": self.init,
            "init_scale": float(self.init_scale),
        }

    def settings(self) -> dict:
        """The options of this fit, as stored in the DataTree's ``gpf`` group."""
        out = {
            "n_particles": len(self.approx.particles),
            "n_particles_option": AUTO if self._auto_particles else int(self.n_particles),
            "structure": self.structure.describe(),
            "natural_mean": self._natural_mean(self.fit_options),
            "cloud": "initial_particles"
            if self.initial_particles is not None
            else self.resolved_cloud,
            "init": self.init if self.initial_particles is None else "initial_particles",
            "init_scale": self.init_scale,
            "random_seed": self.random_seed,
            "n_steps": len(self.hist),
        }
        if self.fit_options is not None:
            out.update(self.fit_options.settings())
        if self.stages:
            out["stage_steps"] = [int(st["step"]) for st in self.stages]
            out["stage_particles"] = [int(st["n_particles"]) for st in self.stages]
            checks = [st for st in self.stages if "gap" in st]
            if checks:
                out["bias_gap"] = float(checks[-1]["gap"])
                out["bias_gap_mcse"] = float(checks[-1]["gap_mcse"])
        return out

    def _natural_mean(self, options: FitOptions | None) -> bool:
        if self.natural_mean is not None:
            return self.natural_mean
        return options is not None and options.auto

    # ----------------------------------------------------------------------- the step
    def _build_step(self, options: FitOptions) -> StepGraph:
        if options.auto:
            if self.natural_mean is False:
                raise ValueError(
                    "natural_mean=False needs a fixed learning_rate: the automatic step size "
                    "uses the natural flow, whose mean step is C g_bar. Drop natural_mean or "
                    "pass e.g. learning_rate=1e-3."
                )
            return self._natural_step(options)
        shared = self.approx.shared_particles
        n, d = shared.get_value().shape
        particles = pt.specify_shape(shared, (n, d))
        logp, grad_logp, hyper = self.target.logp_and_grads(particles, options.more_obj_params)
        grads = -grad_logp
        _, deviations = flow.centre(particles)
        shift = flow.mean_shift(deviations, grads, self.structure, self._natural_mean(options))
        linear = flow.linear_flow(deviations, grads, self.structure)
        shift, up_shift = transform_direction(options.chain(), shift, (d,), "gpf_shift")
        linear, up_linear = transform_direction(
            options.chain(particle_axes=(0,)), linear, (n, d), "gpf_linear"
        )
        eta1, eta2 = self.learning_rates
        new = (particles - eta1 * shift - eta2 * linear).astype(shared.dtype)
        return StepGraph(
            free_energy=flow.free_energy(logp, deviations, self.structure),
            points=particles,
            logp=logp,
            grad=grad_logp,
            positions=new,
            updates={shared: new, **up_shift, **up_linear},
            hyper_grads=[-h / n for h in hyper],
        )

    # -------------------------------------------------- the automatic (natural) step
    @property
    def _line_search(self) -> bool:
        """Backtracking needs a deterministic free energy: full data."""
        return not self.target.minibatch

    def _block_ranks(self) -> list[int]:
        """Directions the cloud spans in each block (static for the compiled step: every
        affine step preserves them)."""
        z = self.approx.particles - self.approx.particles.mean(axis=0)
        blocks = [np.arange(self.target.ndim)] if self.structure.diagonal else self.structure.blocks
        ranks = []
        for b in blocks:
            s = np.linalg.svd(z[:, b], compute_uv=False)
            tol = s[0] * max(z.shape) * np.finfo(z.dtype).eps if len(s) else 0.0
            ranks.append(int(np.sum(s > tol)))
        return ranks

    def _new_state(self) -> dict[str, np.ndarray]:
        """Values of the automatic step's state for the current particles: nothing
        evaluated yet (the first call evaluates them, at step size 0)."""
        x = self.approx.particles
        n, d = x.shape
        dtype = self.target.dtype
        inf = np.asarray(np.inf, dtype=dtype)
        zero = np.zeros((), dtype=dtype)
        state = {
            "gpf_shift": np.zeros(d, dtype=dtype),
            "gpf_linear": np.zeros((n, d), dtype=dtype),
            "gpf_free_energy": inf,
            "gpf_decrement_mean": zero,
            "gpf_decrement_cov": zero,
        }
        if self._line_search:
            z = x - x.mean(axis=0)
            rank = int(np.sum(self._block_ranks())) if not self.structure.diagonal else d
            weights = matching_cloud(z, 2 * max(rank, 1), self._cloud_rng)
            state |= {
                "gpf_step_size": zero,
                "gpf_validation_weights": weights.astype(dtype),
                "gpf_validation_free_energy": inf,
                "gpf_best_particles": x.copy(),
                "gpf_best_validation": inf,
                "gpf_best_free_energy": inf,
                "gpf_since_best": zero,
            }
        return state

    def _reset_state(self) -> None:
        for key, value in self._new_state().items():
            self._auto_state[key].set_value(value)

    def _natural_step(self, options: FitOptions) -> StepGraph:
        d = self.target.ndim
        # the number of particles (rows) may change between stages: dynamic shapes
        shapes = {2: (None, d), 1: (d,), 0: ()}
        self._auto_state = {
            key: pytensor.shared(
                value,
                name=key,
                shape=(None, None) if key == "gpf_validation_weights" else shapes[value.ndim],
            )
            for key, value in self._new_state().items()
        }
        st = self._auto_state
        particles = self.approx.shared_particles
        if self._line_search:
            step = st["gpf_step_size"]
            eta_mean, eta_linear = step, 0.5 * step
        else:
            step = self.learning_rates[0]
            eta_mean = cap(step, pt.sqrt(st["gpf_decrement_mean"]), MAX_MEAN_STEP)
            eta_linear = cap(0.5 * step, pt.sqrt(st["gpf_decrement_cov"]), MAX_SCALE_STEP)
        trial = particles - eta_mean * st["gpf_shift"][None, :] - eta_linear * st["gpf_linear"]
        logp, grad_logp, _ = self.target.logp_and_grads(trial)
        mean, deviations = flow.centre(trial)
        natural = flow.natural_flow(deviations, -grad_logp, self.structure, self._block_ranks())
        free_energy = flow.natural_free_energy(logp, natural.log_pdet, d)
        finite = (
            pt.isfinite(free_energy)
            & pt.all(pt.isfinite(grad_logp))
            & pt.isfinite(natural.decrement)
            & pt.all(pt.isfinite(natural.linear))
        )
        if self._line_search:
            slope = st["gpf_decrement_mean"] + 0.5 * st["gpf_decrement_cov"]
            accepted = accept_trial(
                free_energy, st["gpf_free_energy"], step, slope, finite, BACKTRACKING
            )
        else:
            accepted = finite

        def keep(new, old):
            return pt.switch(accepted, new, old).astype(old.dtype)

        new_free_energy = keep(free_energy, st["gpf_free_energy"])
        new_decrement = keep(natural.decrement, st["gpf_decrement_mean"] + st["gpf_decrement_cov"])
        updates = {
            particles: keep(trial, particles),
            st["gpf_shift"]: keep(natural.shift, st["gpf_shift"]),
            st["gpf_linear"]: keep(natural.linear, st["gpf_linear"]),
            st["gpf_free_energy"]: new_free_energy,
            st["gpf_decrement_mean"]: keep(natural.decrement_mean, st["gpf_decrement_mean"]),
            st["gpf_decrement_cov"]: keep(natural.decrement_cov, st["gpf_decrement_cov"]),
        }
        info = {"accepted": accepted, "decrement": new_decrement}
        if self._line_search:
            # the same Gaussian on an independent cloud: its free energy is not fitted
            validation_points = mean + pt.dot(st["gpf_validation_weights"], deviations)
            validation = flow.natural_free_energy(
                self.target.logp(validation_points), natural.log_pdet, d
            )
            validation = pt.switch(pt.isfinite(validation), validation, np.inf)
            improved = accepted & (validation < st["gpf_best_validation"])
            since = pt.switch(
                improved, 0.0, pt.switch(accepted, st["gpf_since_best"] + 1.0, st["gpf_since_best"])
            )
            updates |= {
                # unchanged by the step, but part of the state a saved fit must restore
                st["gpf_validation_weights"]: st["gpf_validation_weights"],
                st["gpf_step_size"]: next_step_size(step, accepted, BACKTRACKING).astype(
                    step.dtype
                ),
                st["gpf_validation_free_energy"]: keep(
                    validation, st["gpf_validation_free_energy"]
                ),
                st["gpf_best_particles"]: pt.switch(improved, trial, st["gpf_best_particles"]),
                st["gpf_best_validation"]: pt.switch(
                    improved, validation, st["gpf_best_validation"]
                ),
                st["gpf_best_free_energy"]: pt.switch(
                    improved, free_energy, st["gpf_best_free_energy"]
                ),
                st["gpf_since_best"]: since.astype(step.dtype),
            }
            info |= {"step_size": step, "since_best": since, "validation": validation}
        else:
            info |= {"step_size": eta_mean}
        return StepGraph(
            free_energy=new_free_energy,
            points=trial,
            logp=logp,
            grad=grad_logp,
            positions=updates[particles],
            updates=updates,
            info=info,
            guarded=False,
        )

    def _evaluations_per_step(self) -> tuple[int, int]:
        # borrow: the hot loop asks every step, and only the shapes are read
        n = self.approx.shared_particles.get_value(borrow=True).shape[0]
        if self.fit_options.auto and self._line_search:
            weights = self._auto_state["gpf_validation_weights"].get_value(borrow=True)
            return n, weights.shape[0]
        return n, 0

    def checkpoint_extra(self) -> dict:
        return {
            "stages": self.stages,
            "final_free_energy": self.final_free_energy,
            "cloud_rng": self._cloud_rng.bit_generator.state,
        }

    def load_checkpoint_extra(self, extra: dict) -> None:
        self.stages = extra["stages"]
        self.final_free_energy = extra["final_free_energy"]
        self._cloud_rng.bit_generator.state = extra["cloud_rng"]

    def _control(self, options: FitOptions) -> Control:
        if options.auto and self._line_search:
            return Deterministic(options.tol)
        return super()._control(options)

    def _on_stop(self, reason: str, step: int) -> str | None:
        if not (self.fit_options.auto and self._line_search):
            return reason
        if reason == "overfitting":
            best = self._auto_state["gpf_best_particles"].get_value()
            self.approx.shared_particles.set_value(best)
        if reason not in ("converged", "overfitting"):
            return reason
        if reason == "overfitting":
            self.final_free_energy = float(self._auto_state["gpf_best_free_energy"].get_value())
            self._reset_state()  # a refine re-evaluates the restored particles first
        else:
            self.final_free_energy = float(self._auto_state["gpf_free_energy"].get_value())
        if not self._auto_particles:
            return reason
        gap, mcse = free_energy_gap(
            self.approx, self.final_free_energy, BIAS_DRAWS, self._cloud_rng
        )
        self.density_evaluations += BIAS_DRAWS
        n = len(self.approx.particles)
        if not self.stages:
            self.stages.append({"step": 0, "n_particles": n})
        self.stages[-1] |= {"gap": gap, "gap_mcse": mcse}
        # significant at about 2 % (one-sided) and larger than the floor
        biased = abs(gap) - 2.0 * mcse > BIAS_FLOOR
        if not biased:
            return reason
        if n >= default_n_particles(self.target.ndim) * 2**MAX_DOUBLINGS:
            return "biased"
        self.approx.shared_particles.set_value(self._restart_cloud(2 * n))
        self._reset_state()
        self.control.restart()
        self.final_free_energy = None
        self.stages.append({"step": step, "n_particles": 2 * n})
        return None

    def _describe(self, reason: str) -> str:
        if reason != "biased":
            return super()._describe(reason)
        last = self.stages[-1]
        return (
            f"finite-N bias: with {last['n_particles']} particles (the cap of the automatic "
            f"n_particles) the free energy is still {last['gap']:.3g} ± {last['gap_mcse']:.2g} "
            "nats below an independent Monte Carlo -ELBO of the same Gaussian, so q is not the "
            "best Gaussian; fit with method='gf' (fresh draws every step, no such bias) or "
            "use NUTS"
        )

    def _restart_cloud(self, n: int) -> np.ndarray:
        """``n`` antithetic particles with exactly the current mean and covariance."""
        x = self.approx.particles
        mean = x.mean(axis=0)
        _, s, vt = np.linalg.svd(x - mean, full_matrices=False)
        rank = int(np.sum(s > s[0] * max(x.shape) * np.finfo(x.dtype).eps))
        factor = vt[:rank].T * (s[:rank] / np.sqrt(len(x)))
        return (mean + antithetic_cloud(n, rank, self._cloud_rng) @ factor.T).astype(x.dtype)
