"""WVGD as a PyMC inference: ``pm.fit(method="wvgd")`` or ``pm.fit(method=WVGD(...))``."""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

import numpy as np
import pymc as pm
import pytensor
import xarray as xr

from pymc_gpf.approximation import FlowApproximation
from pymc_gpf.checks import check_particles, renamed, seed_sequence
from pymc_gpf.engine import END_STREAM, FlowInference
from pymc_gpf.options import FitOptions
from pymc_gpf.start import initial_centre
from pymc_gpf.stepgraph import StepGraph, dynamic_rows, share, share_transform, standard_normal
from pymc_gpf.wvgd import step
from pymc_gpf.wvgd.config import WVGDConfig
from pymc_gpf.wvgd.mixture import (
    EMPTY_LOG_MASS,
    MixtureProposal,
    MixtureQ,
    estimate_log_mass,
    normalised_weights,
)

__all__ = ["WVGD", "WVGDApproximation"]


class WVGDApproximation(FlowApproximation):
    """The fitted WVGD: ``J`` particles ``z_j`` with their Voronoi cells ``L_j`` (eq. 8), one
    factorised Gaussian ``q_j`` per cell truncated to it, ``q~_j = q_j 1[L_j] / Z_j``
    (eq. 22-23), and cell weights ``beta_j``, the cells' posterior mass (eq. 10).

    q is the mixture ``sum_j beta_j q~_j`` (:class:`pymc_gpf.wvgd.mixture.MixtureQ`).
    ``sample`` draws from it by choosing a cell by ``beta`` and rejection-sampling its local
    Gaussian inside the cell; ``logq`` is its density. ``state`` is the
    :class:`~pymc_gpf.wvgd.step.WVGDState` in shared variables.
    """

    def __init__(self, inference: WVGD, particles: np.ndarray, local_scale: float):
        super().__init__(inference)
        self.state = share(step.init_state(particles, local_scale), "wvgd", dynamic_rows)
        self.shared_particles = self.state.particles

    @property
    def params(self) -> list:
        """Shared variables of the fitted state: particles, local means and log-scales."""
        return list(self.state[:3])

    @property
    def particles(self) -> np.ndarray:
        """The particles ``(J, D)`` in flat unconstrained space (a copy)."""
        return self.state.particles.get_value()

    @property
    def local_means(self) -> np.ndarray:
        """Means ``m_j`` of the local Gaussians ``q_j`` (eq. 22), ``(J, D)`` (a copy)."""
        return self.state.local_means.get_value()

    @property
    def local_scales(self) -> np.ndarray:
        """Standard deviations ``s_j`` of the local Gaussians ``q_j`` (eq. 22), ``(J, D)``."""
        return np.exp(self.state.local_log_scales.get_value())

    @property
    def acceptance(self) -> np.ndarray:
        """Running acceptance rate of each cell's rejection sampler (``nan`` before any
        step)."""
        count = self.state.step_count.get_value()
        if count > 0:
            return self.state.accepted_sum.get_value() / count
        return np.full(len(self.particles), np.nan)

    @property
    def cell_weights(self) -> np.ndarray:
        """``beta_j``: the estimated posterior mass of each cell (sums to 1)."""
        return normalised_weights(
            self.state.log_mass.get_value(), self.state.mass_count.get_value()
        )

    def mixture(self) -> MixtureQ:
        """The fitted q as a NumPy :class:`~pymc_gpf.wvgd.mixture.MixtureQ`."""
        return MixtureQ(
            self.particles, self.local_means, self.local_scales, self.cell_weights,
            self.acceptance,
        )  # fmt: skip

    def logq(self, points: np.ndarray, n_draws: int = 100_000, random_seed=None) -> np.ndarray:
        """``log q(x)`` of the mixture ``sum_j beta_j q~_j`` at flat unconstrained points
        ``(S, D)``: ``log beta_j + log q_j(x) - log Z_j`` for the cell ``j`` containing ``x``.
        The normalisers ``Z_j = q_j(L_j)`` are estimated from ``n_draws`` draws of each
        ``q_j`` (relative error ``sqrt((1 - Z_j) / (Z_j n_draws))``; exact for one particle)."""
        points = self._check_points(points)
        rng = np.random.default_rng(seed_sequence(random_seed))
        return self.mixture().logpdf(points, rng, n_draws)

    def proposal(self, ridge, rng):
        if ridge is not None:
            raise ValueError(
                "regularize applies to a degenerate Gaussian q (GPF, GF); WVGD's mixture of "
                "local Gaussians always has a density."
            )
        return MixtureProposal(self.mixture(), rng), None

    def draw(self, draws: int, rng: np.random.Generator) -> np.ndarray:
        """``draws`` points of q in flat unconstrained space (:meth:`MixtureQ.sample`)."""
        return self.mixture().sample(draws, rng)

    def estimate_cell_weights(self, rng: np.random.Generator, draws: int = 2000) -> int:
        """Estimate the cell weights afresh from ``draws`` draws of each local Gaussian and
        the full data's log-density (eq. 10, as the authors' post-processing): with
        ``pm.Minibatch`` data the running estimate exponentiates noisy log-densities, which
        biases it. Returns the number of log-densities evaluated."""
        log_mass, evaluated = estimate_log_mass(self.mixture(), self.log_density, draws, rng)
        seen = log_mass > EMPTY_LOG_MASS
        self.state.log_mass.set_value(log_mass.astype(self.target.dtype))
        self.state.mass_count.set_value(seen.astype(self.target.dtype))
        return evaluated

    def location(self) -> tuple[np.ndarray, np.ndarray]:
        """What the stochastic stopping test watches (:meth:`MixtureQ.location`)."""
        return self.mixture().location()

    def _method_group(self) -> xr.Dataset:
        extra = {
            "local_mean": (("particle", "coordinate"), self.local_means),
            "local_scale": (("particle", "coordinate"), self.local_scales),
            "cell_weight": ("particle", self.cell_weights),
            "acceptance": ("particle", self.acceptance),
        }
        return self._points_dataset(self.particles, "particle", self.inference.settings(), extra)


class WVGD(FlowInference):
    r"""Wasserstein variational gradient descent (Ambrogioni, Güçlü & van Gerven 2018).

    ``J`` particles partition the space into Voronoi cells; each carries a local factorised
    Gaussian restricted to its cell. Every step draws ``M`` points per particle (all in one
    batched log-density call), keeps those in the particle's cell, moves each particle
    toward the importance-weighted posterior centroid of its cell (eq. 20) and each local
    Gaussian down the gradient of ``KL(q~_j || p_j)`` (eq. 24-26). The cell weights ``beta``
    (posterior mass per cell, eq. 10) are a running importance-sampling estimate. The free
    energy is minus the ELBO of the mixture ``sum_j beta_j q~_j`` (eq. 27 plus ``H(beta)``),
    a bound: ``-F <= log p(y)``. One particle is mean-field Gaussian VI.

    Parameters
    ----------
    n_particles
        ``J >= 1`` (default 5).
    draws_per_particle
        Draws ``M >= 1`` of each local Gaussian per step (default 50). Called ``n_samples``
        before 0.2 (still accepted, with a warning).
    init_scale
        Scale of the initial local Gaussians and of the particles' initial spread around
        the starting point (default 0.1). Particles only find modes their local Gaussians
        reach: for a multimodal posterior spread them as widely as the prior (e.g. 3).
    init
        ``"initial_point"`` (updated by ``start``) or ``"map"``.
    weight_memory
        Steps over which the running cell-weight estimate averages (default 100).
    initial_particles
        Explicit ``(J, D)`` starting particles in flat unconstrained space (overrides
        ``init``); the local Gaussians start on them.
    model, random_seed, start, devices
        As in ``pm.fit``; ``devices`` as in :class:`~pymc_gpf.engine.FlowInference`.

    Notes
    -----
    The fit keywords are those of :meth:`pymc_gpf.GPF.fit`. ``learning_rate`` is one value or
    the pair ``(eta1, eta2)``: ``eta1`` for the particles (eq. 20), ``eta2`` for the local
    Gaussians (eq. 21). The defaults are dimension-wise Adam and 0.01.
    """

    name = "wvgd"
    renamed_options: ClassVar[dict[str, str]] = {"n_samples": "draws_per_particle"}
    default_learning_rate = 1e-2
    default_optimizer = "adam"
    spread_option = "init_scale"
    start_points = "local draws"

    def __init__(
        self,
        n_particles: int = 5,
        *,
        draws_per_particle: int = 50,
        init_scale: float = 0.1,
        init: str = "initial_point",
        weight_memory: float = 100.0,
        initial_particles: np.ndarray | None = None,
        model: pm.Model | None = None,
        random_seed=None,
        start: dict | None = None,
        devices=None,
        n_samples: int | None = None,
    ):
        draws = renamed(
            "WVGD", "n_samples", "draws_per_particle", n_samples, draws_per_particle, 50
        )
        self.config = WVGDConfig(n_particles, draws, init_scale, init, weight_memory)
        self.initial_particles = initial_particles
        super().__init__(model=model, random_seed=random_seed, start=start, devices=devices)

    def _initialise(self) -> WVGDApproximation:
        config, target = self.config, self.target
        self.resolved = config
        if self.initial_particles is not None:
            particles = check_particles(self.initial_particles, target.dtype, target.labels, "J")
            self.resolved = replace(config, n_particles=len(particles))
            return WVGDApproximation(self, particles, config.init_scale)
        centre = initial_centre(target, self._start, config.init, self._init_rng)
        j, d = config.n_particles, target.ndim
        noise = self._init_rng.standard_normal((j, d)) if j > 1 else None
        spread = config.init_scale * noise if j > 1 else np.zeros((1, d))
        return WVGDApproximation(self, (centre + spread).astype(target.dtype), config.init_scale)

    def _fitted_settings(self) -> dict:
        return {
            "init": self.config.init if self.initial_particles is None else "initial_particles",
            "free_energy": "-(sum_j beta_j ELBO_j + H(beta)), the mixture's -ELBO",
        }

    def _build_step(self, options: FitOptions) -> StepGraph:
        q = self.approx.state
        j, d, m = q.particles.shape[0], self.target.ndim, self.config.draws_per_particle
        noise = standard_normal(self.noise_rng, (j, m, d))
        decay = 1.0 - 1.0 / float(self.config.weight_memory)
        if options.auto:
            recorded = pytensor.shared(
                np.asarray(np.inf, dtype=self.target.dtype), "wvgd_free_energy"
            )
            state = step.NaturalState(q, recorded)
            new, info = step.natural_step(state, noise, self.target, decay, self.learning_rates[0])
            return StepGraph(state, new, info)
        fields = (q.particles, q.local_means, q.local_log_scales)
        transforms = [options.chain(particle_axes=(0,)) for _ in fields]
        moments = tuple(
            share_transform(t, var.get_value(borrow=True).shape, var.name, var.type.shape)
            for t, var in zip(transforms, fields, strict=True)
        )
        state = step.FixedState(q, moments)
        new, info = step.fixed_step(
            state, noise, self.target, decay, transforms, self.learning_rates,
            options.more_obj_params,
        )  # fmt: skip
        return StepGraph(state, new, info)

    def _finish(self, reason: str) -> None:
        if self.target.minibatch and len(self.hist):
            rng = np.random.default_rng(self.stream(END_STREAM))
            self.record.count(densities=self.approx.estimate_cell_weights(rng))
