"""WVGD as a PyMC inference: ``pm.fit(method="wvgd")`` or ``pm.fit(method=WVGD(...))``."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import pymc as pm
import pytensor
import pytensor.tensor as pt
import xarray as xr

from pytensor.gradient import disconnected_grad

from pymc_gpf.approximation import FlowApproximation
from pymc_gpf.checks import is_integer, positive, renamed, seed_sequence
from pymc_gpf.engine import (
    FitOptions,
    FlowInference,
    StepGraph,
    transform_direction,
)
from pymc_gpf.gaussian import LOG_2PI
from pymc_gpf.wvgd import flow

__all__ = ["WVGD", "WVGDApproximation"]

EMPTY_LOG_MASS = -1e300  # "no estimate yet": finite, so the step guard accepts it
# trust region of the automatic step: a local mean moves at most 0.2 local sds per step and
# coordinate, a local sd changes by at most a factor e^0.1
MAX_MEAN_STEP, MAX_LOG_SCALE_STEP = 0.2, 0.1
MIN_ACCEPTANCE = 0.02  # below it a cell's local Gaussian is re-centred on its particle


def _shared(value: np.ndarray, name: str) -> pytensor.compile.SharedVariable:
    # the number of particles stays a dynamic dimension: one compiled graph serves any J
    return pytensor.shared(value, name=name, shape=(None, *value.shape[1:]))


class WVGDApproximation(FlowApproximation):
    """The fitted WVGD: ``J`` particles ``z_j`` with their Voronoi cells ``L_j`` (eq. 8), one
    factorised Gaussian ``q_j`` per cell truncated to it, ``q~_j = q_j 1[L_j] / Z_j``
    (eq. 22-23), and cell weights ``beta_j``, the cells' posterior mass (eq. 10).

    q is the mixture ``sum_j beta_j q~_j``. ``sample`` draws from it by choosing a cell by
    ``beta`` and rejection-sampling its local Gaussian inside the cell; ``logq`` is its
    density.
    """

    def __init__(self, inference: WVGD, particles: np.ndarray, local_scale: float):
        super().__init__(inference)
        j, d = particles.shape
        dtype = particles.dtype
        self.shared_particles = _shared(particles, "wvgd_particles")
        self.shared_means = _shared(particles.copy(), "wvgd_local_means")
        self.shared_log_scales = _shared(
            np.full((j, d), np.log(local_scale), dtype=dtype), "wvgd_local_log_scales"
        )
        # running importance-sampling estimates (exponentially weighted over steps)
        self.shared_log_mass = _shared(np.full(j, EMPTY_LOG_MASS, dtype=dtype), "wvgd_log_mass")
        self.shared_mass_count = _shared(np.zeros(j, dtype=dtype), "wvgd_mass_count")
        self.shared_accepted_sum = _shared(np.zeros(j, dtype=dtype), "wvgd_accepted_sum")
        self.shared_step_count = pytensor.shared(np.zeros((), dtype=dtype), "wvgd_step_count")
        self.shared_elbos = _shared(np.zeros(j, dtype=dtype), "wvgd_cell_elbos")

    @property
    def params(self) -> list:
        """Shared variables of the fitted state: particles, local means and log-scales."""
        return [self.shared_particles, self.shared_means, self.shared_log_scales]

    @property
    def particles(self) -> np.ndarray:
        """The particles ``(J, D)`` in flat unconstrained space (a copy)."""
        return self.shared_particles.get_value()

    @property
    def local_means(self) -> np.ndarray:
        """Means ``m_j`` of the local Gaussians ``q_j`` (eq. 22), ``(J, D)`` (a copy)."""
        return self.shared_means.get_value()

    @property
    def local_scales(self) -> np.ndarray:
        """Standard deviations ``s_j`` of the local Gaussians ``q_j`` (eq. 22), ``(J, D)``."""
        return np.exp(self.shared_log_scales.get_value())

    @property
    def acceptance(self) -> np.ndarray:
        """Running acceptance rate of each cell's rejection sampler (``nan`` before any
        step)."""
        count = self.shared_step_count.get_value()
        return (
            self.shared_accepted_sum.get_value() / count
            if count > 0
            else np.full(len(self.particles), np.nan)
        )

    @property
    def cell_weights(self) -> np.ndarray:
        """``beta_j``: the estimated posterior mass of each cell (sums to 1)."""
        count = self.shared_mass_count.get_value()
        seen = count > 0
        if not seen.any():  # before the first step
            return np.full(len(count), 1.0 / len(count))
        log_est = np.where(
            seen, self.shared_log_mass.get_value() - np.log(np.where(seen, count, 1)), -np.inf
        )
        weights = np.exp(log_est - log_est.max())
        return weights / weights.sum()

    def logq(self, points: np.ndarray, n_draws: int = 100_000, random_seed=None) -> np.ndarray:
        """``log q(x)`` of the mixture ``sum_j beta_j q~_j`` at flat unconstrained points
        ``(S, D)``: ``log beta_j + log q_j(x) - log Z_j`` for the cell ``j`` containing ``x``.
        The normalisers ``Z_j = q_j(L_j)`` are estimated from ``n_draws`` draws of each
        ``q_j`` (relative error ``sqrt((1 - Z_j) / (Z_j n_draws))``; exact for one particle)."""

        points = self._check_points(points)
        particles, means, scales = self.particles, self.local_means, self.local_scales
        rng = np.random.default_rng(seed_sequence(random_seed))
        log_z = np.empty(len(particles))
        for j in range(len(particles)):
            x = means[j] + scales[j] * rng.standard_normal((n_draws, particles.shape[1]))
            log_z[j] = np.log(np.mean(_nearest(x, particles) == j))
        cell = _nearest(points, particles)
        z = (points - means[cell]) / scales[cell]
        local = -0.5 * np.sum(z**2 + LOG_2PI, axis=1) - np.sum(np.log(scales[cell]), axis=1)
        with np.errstate(divide="ignore"):
            return np.log(self.cell_weights[cell]) + local - log_z[cell]

    def proposal(self, ridge, rng):
        if ridge is not None:
            raise ValueError(
                "regularize applies to a degenerate Gaussian q (GPF, GF); WVGD's mixture of "
                "local Gaussians always has a density."
            )
        return _MixtureProposal(self, rng), None

    def _draw(self, draws, rng):
        particles, means, scales = self.particles, self.local_means, self.local_scales
        d = particles.shape[1]
        counts = rng.multinomial(draws, self.cell_weights)
        out = np.empty((draws, d), dtype=particles.dtype)
        rates = np.maximum(np.nan_to_num(self.acceptance, nan=1.0), 1e-3)
        filled = 0
        for cell in np.flatnonzero(counts):
            need, tries = counts[cell], 0
            while need > 0:
                batch = max(2 * need, int(need / rates[cell]))
                x = means[cell] + scales[cell] * rng.standard_normal((batch, d))
                keep = x[_nearest(x, particles) == cell][:need]
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
        return out[rng.permutation(draws)]

    def _method_group(self) -> xr.Dataset:
        extra = {
            "local_mean": (("particle", "coordinate"), self.local_means),
            "local_scale": (("particle", "coordinate"), self.local_scales),
            "cell_weight": ("particle", self.cell_weights),
            "acceptance": ("particle", self.acceptance),
        }
        return self._points_dataset(self.particles, "particle", self.inference.settings(), extra)


def _nearest(points: np.ndarray, particles: np.ndarray) -> np.ndarray:
    """NumPy twin of :func:`pymc_gpf.wvgd.flow.nearest_particle`."""
    sq = (points**2).sum(1)[:, None] - 2 * points @ particles.T + (particles**2).sum(1)
    return np.argmin(sq, axis=1)


def cell_weights(log_mass: pt.TensorVariable, count: pt.TensorVariable) -> pt.TensorVariable:
    """Normalised ``beta`` from the running estimates; cells never estimated get 0."""
    seen = count > 0
    log_est = pt.switch(seen, log_mass - pt.log(pt.switch(seen, count, 1.0)), -pt.inf)
    return pt.special.softmax(log_est)


def _running_log_mean(log_sum, count, new_log, keep, decay):
    """Exponentially weighted running sum (log domain) and count, for cells where
    ``keep``; an empty cell leaves its estimate as it was."""
    top = pt.maximum(log_sum + np.log(decay), new_log)
    summed = top + pt.log(pt.exp(log_sum + np.log(decay) - top) + pt.exp(new_log - top))
    return pt.switch(keep, summed, log_sum), pt.switch(keep, decay * count + 1.0, count)


class _MixtureProposal:
    """WVGD's q for importance sampling: draws and density of the mixture, the cell
    normalisers of the density estimated from the caller's random stream."""

    def __init__(self, approx: WVGDApproximation, rng: np.random.Generator):
        self.approx, self.rng = approx, rng

    def sample(self, draws: int, rng: np.random.Generator) -> np.ndarray:
        return self.approx._draw(draws, rng)

    def logpdf(self, points: np.ndarray) -> np.ndarray:
        return self.approx.logq(points, random_seed=self.rng)


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
    model, random_seed, start
        As in ``pm.fit``.

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
        n_samples: int | None = None,
    ):
        self.n_particles = n_particles
        self.draws_per_particle = renamed(
            "WVGD", "n_samples", "draws_per_particle", n_samples, draws_per_particle, 50
        )
        self.init_scale = init_scale
        self.init = init
        self.weight_memory = weight_memory
        self.initial_particles = initial_particles
        super().__init__(model=model, random_seed=random_seed, start=start)

    def _initialise(self) -> WVGDApproximation:
        if not is_integer(self.n_particles, 1):
            raise ValueError(f"n_particles must be an integer >= 1, got {self.n_particles!r}.")
        if not is_integer(self.draws_per_particle, 1):
            raise ValueError(
                f"draws_per_particle must be an integer >= 1 (draws per particle and step), "
                f"got "
                f"{self.draws_per_particle!r}."
            )
        scale = positive("init_scale", self.init_scale)
        if not (positive("weight_memory", self.weight_memory) >= 1):
            raise ValueError(f"weight_memory must be >= 1 step, got {self.weight_memory!r}.")
        d = self.target.ndim
        if self.initial_particles is not None:
            particles = np.array(self.initial_particles, dtype=self.target.dtype)
            if particles.ndim != 2 or particles.shape[1] != d or not len(particles):
                raise ValueError(
                    f"initial_particles must have shape (J, {d}) (flat unconstrained "
                    f"coordinates {self.target.labels}), got {particles.shape}."
                )
            if not np.all(np.isfinite(particles)):
                raise ValueError("initial_particles contains non-finite values.")
            self.n_particles = len(particles)
            return WVGDApproximation(self, particles, scale)
        centre = self._initial_centre(self.init)
        j = int(self.n_particles)
        spread = scale * self._init_rng.standard_normal((j, d)) if j > 1 else np.zeros((1, d))
        particles = (centre + spread).astype(self.target.dtype)
        return WVGDApproximation(self, particles, scale)

    def constructor_options(self) -> dict:
        return {
            "n_particles": int(self.n_particles),
            "draws_per_particle": int(self.draws_per_particle),
            "init_scale": float(self.init_scale),
            "init": self.init,
            "weight_memory": float(self.weight_memory),
        }

    def settings(self) -> dict:
        out = {
            "n_particles": self.n_particles,
            "draws_per_particle": self.draws_per_particle,
            "init_scale": self.init_scale,
            "init": self.init if self.initial_particles is None else "initial_particles",
            "weight_memory": self.weight_memory,
            "random_seed": self.random_seed,
            "n_steps": len(self.hist),
            "free_energy": "-(sum_j beta_j ELBO_j + H(beta)), the mixture's -ELBO",
        }
        if self.fit_options is not None:
            out.update(self.fit_options.settings())
        return out

    def _build_step(self, options: FitOptions) -> StepGraph:
        a = self.approx
        particles, means, log_scales = a.shared_particles, a.shared_means, a.shared_log_scales
        j, d, m = particles.shape[0], self.target.ndim, self.draws_per_particle
        noise = self.standard_normal((j, m, d))
        draws = flow.local_draws(means, log_scales, noise)
        points = draws.reshape((j * m, d))
        logp, grad_logp, _ = self.target.logp_and_grads(points)
        logp, grad_logp = logp.reshape((j, m)), grad_logp.reshape((j, m, d))
        logq = flow.local_logq(log_scales, noise)
        accepted = flow.accepted_draws(draws, particles)
        has = pt.any(accepted, axis=1)

        # running cell weights and acceptance
        decay = 1.0 - 1.0 / float(self.weight_memory)
        log_mass, count = _running_log_mean(
            a.shared_log_mass,
            a.shared_mass_count,
            flow.cell_log_mass(logp, logq, accepted),
            has,
            decay,
        )
        rate = pt.mean(pt.cast(accepted, logp.dtype), axis=1)
        elbos = pt.switch(has, flow.cell_elbos(logp, logq, accepted), a.shared_elbos)
        weights = cell_weights(log_mass, count)

        updates = {
            a.shared_log_mass: log_mass,
            a.shared_mass_count: count,
            a.shared_accepted_sum: decay * a.shared_accepted_sum + rate,
            a.shared_step_count: decay * a.shared_step_count + 1.0,
            a.shared_elbos: elbos,
        }
        d_means, d_log_scales = flow.local_gradients(grad_logp, noise, log_scales, accepted)
        # with pm.Minibatch data log p is a noisy estimate, and exp of it a biased one: the
        # centroid then weights the cell's accepted draws equally (q~_j's own mean, the
        # "biased" centroid of the authors' code), which the local fit keeps consistent
        centroid_logp = logq if self.target.minibatch else logp
        particle_direction = flow.particle_direction(
            particles, draws, centroid_logp, logq, accepted
        )
        # with no accepted draw in any cell the bound is stale and nothing can move
        # (e.g. local Gaussians thrown far off by a too-large step)
        free_energy = pt.switch(pt.any(has), -flow.mixture_elbo(elbos, weights), np.nan)
        directions = {particles: particle_direction, means: d_means, log_scales: d_log_scales}
        graph = StepGraph(
            free_energy=free_energy,
            points=points,
            logp=logp.reshape((j * m,)),
            grad=grad_logp.reshape((j * m, d)),
            positions=points,  # set below, from the new local Gaussians
            updates=updates,
        )
        if options.auto:
            self._natural_moves(graph, directions, has, rate, options)
        else:
            self._fixed_moves(graph, directions, has, options)
            graph.hyper_grads = _hyper_grads(logp, accepted, weights, options.more_obj_params)
        new_draws = flow.local_draws(graph.updates[means], graph.updates[log_scales], noise)
        graph.positions = new_draws.reshape((j * m, d))
        return graph

    def _fixed_moves(self, graph: StepGraph, directions: dict, has, options: FitOptions) -> None:
        """Eq. 20-21 with the fit's optimiser (dimension-wise Adam by default)."""
        eta1, eta2 = self.learning_rates
        particles = self.approx.shared_particles
        for var, direction in directions.items():
            eta = eta1 if var is particles else eta2
            chain = options.chain(particle_axes=(0,))
            shape = var.get_value().shape
            direction, opt_updates = transform_direction(chain, direction, shape, var.name)
            graph.updates.update(opt_updates)
            # a cell without accepted draws keeps its particle and local Gaussian this step
            new = pt.switch(has[:, None], var - eta * direction, var)
            graph.updates[var] = new.astype(var.dtype)

    def _natural_moves(
        self, graph: StepGraph, directions: dict, has, acceptance, options: FitOptions
    ) -> None:
        """Natural-gradient steps (the automatic step size): each particle moves a fraction
        ``eta`` of the way to its cell's centroid (a damped Lloyd step, eq. 20), each local
        Gaussian ``N(m, s^2)`` by its Fisher-preconditioned gradient ``(s^2 d_m, d_log_s / 2)``
        scaled by the cell's acceptance rate (few accepted draws: a poor estimate) and capped
        per coordinate at 0.2 local sds for the mean and a factor ``e^0.1`` for the scale; a
        local Gaussian that accepts under 2 % of its draws is re-centred on its particle.
        The base step comes from :class:`pymc_gpf.control.Stochastic`; a non-finite step is
        refused in the graph (the schedule then shrinks the step)."""
        a = self.approx
        particles, means, log_scales = a.shared_particles, a.shared_means, a.shared_log_scales
        step = self.learning_rates[0]
        scale = pt.exp(log_scales)
        local_step = step * acceptance[:, None]
        mean_step = local_step * pt.square(scale) * directions[means]
        mean_step = mean_step / pt.maximum(1.0, pt.abs(mean_step) / (MAX_MEAN_STEP * scale))
        scale_step = pt.clip(
            0.5 * local_step * directions[log_scales], -MAX_LOG_SCALE_STEP, MAX_LOG_SCALE_STEP
        )
        # a local Gaussian whose draws almost all land in other cells (the cells moved)
        # cannot improve from its own draws: it starts again on its particle
        orphan = (acceptance < MIN_ACCEPTANCE)[:, None]
        moves = {
            particles: particles - 0.5 * pt.minimum(step, 1.0) * directions[particles],
            means: pt.switch(orphan, particles, means - mean_step),
            log_scales: log_scales - scale_step,
        }
        accepted = pt.any(has) & pt.isfinite(graph.free_energy)
        for new in moves.values():
            accepted = accepted & pt.all(pt.isfinite(new))
        previous = pytensor.shared(np.asarray(np.inf, dtype=self.target.dtype), "wvgd_free_energy")
        recorded = pt.switch(accepted, graph.free_energy, previous)
        updates = {
            var: pt.switch(accepted, value, var).astype(var.dtype)
            for var, value in graph.updates.items()
        }
        for var, new in moves.items():
            movable = has[:, None] | orphan if var is means else has[:, None]
            updates[var] = pt.switch(accepted & movable, new, var).astype(var.dtype)
        updates[previous] = recorded
        graph.free_energy, graph.updates, graph.guarded = recorded, updates, False
        graph.info = {"accepted": accepted, "step_size": step}

    def _evaluations_per_step(self) -> tuple[int, int]:
        return self.approx.shared_particles.get_value(borrow=True).shape[0] * int(
            self.draws_per_particle
        ), 0

    def _finish(self, reason: str) -> None:
        if self.target.minibatch and len(self.hist):
            self._estimate_cell_weights()

    def _estimate_cell_weights(self, draws: int = 2000) -> None:
        """The cells' posterior masses from ``draws`` fresh draws of each local Gaussian and
        the full data's log-density (eq. 10, as the authors' post-processing). With
        ``pm.Minibatch`` data the running estimate of the fit exponentiates noisy
        log-densities, which biases it; this one does not."""
        a = self.approx
        particles, means, scales = a.particles, a.local_means, a.local_scales
        rng = np.random.default_rng(seed_sequence(self.random_seed).spawn(5)[4])
        log_mass = np.full(len(particles), EMPTY_LOG_MASS)
        for j in range(len(particles)):
            eps = rng.standard_normal((draws, particles.shape[1]))
            x = means[j] + scales[j] * eps
            keep = _nearest(x, particles) == j
            if not keep.any():
                continue
            log_q = -0.5 * np.sum(eps[keep] ** 2 + LOG_2PI, axis=1) - np.sum(np.log(scales[j]))
            ratio = a.log_density(x[keep]) - log_q
            self.density_evaluations += int(keep.sum())
            top = np.max(ratio)
            log_mass[j] = top + np.log(np.sum(np.exp(ratio - top)) / draws)
        seen = log_mass > EMPTY_LOG_MASS
        a.shared_log_mass.set_value(log_mass.astype(self.target.dtype))
        a.shared_mass_count.set_value(seen.astype(self.target.dtype))

    def _location(self) -> tuple[np.ndarray, np.ndarray]:
        """q's approximate mean (the cell-weighted particles) in units of its sd (the spread
        of the particles plus the local variances), and the log of that sd."""
        a = self.approx
        weights = a.cell_weights[:, None]
        mean = np.sum(weights * a.particles, axis=0)
        variance = np.sum(weights * (np.square(a.particles - mean) + np.square(a.local_scales)), 0)
        sd = np.sqrt(np.maximum(variance, 1e-300))
        return np.concatenate([mean, np.log(sd)]), np.concatenate([sd, np.ones_like(sd)])


def _hyper_grads(logp, accepted, weights, params) -> list:
    """``d F / d theta = -sum_j beta_j E_q~j[d log p / d theta]`` (q and beta held fixed),
    the expectation over each cell's accepted draws."""
    if not params:
        return []
    acc = pt.cast(accepted, logp.dtype)
    share = acc * (weights / pt.maximum(pt.sum(acc, axis=1), 1.0))[:, None]
    weighted = pt.sum(disconnected_grad(share) * logp)
    return [-g for g in pytensor.grad(weighted, list(params))]
