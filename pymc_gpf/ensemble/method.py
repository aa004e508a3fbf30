"""Ensembles as a PyMC inference: ``pm.fit(method="ensemble", inf_kwargs={"kind": ...})``."""

from __future__ import annotations

import numpy as np
import pymc as pm
import xarray as xr

from pymc_gpf.approximation import FlowApproximation, ParticlesMixin
from pymc_gpf.checks import is_integer
from pymc_gpf.control import Control, Deterministic
from pymc_gpf.datatree import build_datatree
from pymc_gpf.engine import FlowInference
from pymc_gpf.ensemble import flow, step
from pymc_gpf.ensemble.config import EnsembleConfig
from pymc_gpf.ensemble.control import SamplingControl
from pymc_gpf.options import FitOptions
from pymc_gpf.start import initial_centre
from pymc_gpf.stepgraph import StepGraph, dynamic_rows, share, standard_normal, updates

__all__ = ["Ensemble", "EnsembleApproximation"]


class EnsembleApproximation(ParticlesMixin, FlowApproximation):
    """The fitted ensemble: its particles and, for the Langevin kinds, the draws collected
    along their trajectories after burn-in (one chain per particle). A deep ensemble's q is
    the equally weighted mixture of point masses at its particles."""

    def __init__(self, inference: Ensemble, particles: np.ndarray):
        super().__init__(inference)
        kind = inference.config.kind
        self.state = share(step.init_state(particles, kind), "ensemble", dynamic_rows)
        self.shared_particles = self.state.particles

    @property
    def draws(self) -> np.ndarray:
        """``(N, S, D)``: every particle's draws after burn-in, the second half of those
        collected (deep: ``(1, N, D)``, the particles as the draws of one chain)."""
        control = self.inference.control
        if self.inference.config.kind == "deep" or control is None:
            return self.particles[None, :, :]  # one chain: the mixture of point masses
        kept = control.kept()
        if not kept:
            raise ValueError(
                "No draws yet: the ensemble is still burning in. Continue with approx.refine(n)."
            )
        return np.stack(kept, axis=1)

    def draw(self, draws: int, rng: np.random.Generator) -> np.ndarray:
        """``draws`` points resampled from the collected draws, pooled over particles."""
        pooled = self.draws.reshape(-1, self.target.ndim)
        return pooled[rng.integers(len(pooled), size=draws)]

    def proposal(self, ridge, rng):
        return None, (
            "an ensemble's q is its draws (point masses), which have no density, so k̂ and "
            "the ELBO are undefined; use ArviZ's R-hat and ESS on approx.sample()"
        )

    def sample(self, draws: int | None = None, *, include_transformed: bool | None = None,
               return_inferencedata: bool = True, **kwargs):  # fmt: skip
        """The collected draws as an ArviZ DataTree, ``chain`` = particle: all of them, or
        ``draws`` per chain evenly spaced over the trajectory. (``random_seed`` and the
        PSIS options of the other methods do not apply: nothing is drawn anew.)"""
        flat = self.draws
        if draws is not None:
            if not is_integer(draws, 1):
                raise ValueError(f"draws must be a positive integer, got {draws!r}.")
            keep = np.unique(np.linspace(0, flat.shape[1] - 1, draws).round().astype(int))
            flat = flat[:, keep]
        if include_transformed is None:
            options = self.inference.fit_options
            include_transformed = bool(options and options.include_transformed)
        n, s, d = flat.shape
        values = self.constrained(flat.reshape(n * s, d), include_transformed)
        values = {k: v.reshape(n, s, *v.shape[1:]) for k, v in values.items()}
        if not return_inferencedata:
            return values
        return build_datatree(
            self.model, values, fit=self.fit_group(), method="ensemble",
            method_group=self.method_group(), chains=True,
        )  # fmt: skip

    def preconditioner(self, values: tuple[np.ndarray, np.ndarray] | None = None):
        """The Langevin kinds' preconditioner ``(diagonal, factor)``,
        ``M = diag(diagonal) + factor^T factor``; set to ``values`` if given."""
        shared = self.state.preconditioner_diagonal, self.state.preconditioner_factor
        if values is not None:
            for var, value in zip(shared, values, strict=True):
                var.set_value(np.asarray(value, dtype=self.target.dtype))
        return tuple(var.get_value() for var in shared)

    def fit_group(self) -> xr.Dataset:
        """The ``fit`` group with the objective of the kind on ``step`` (``free_energy``:
        mean ``V`` plus the MMD term ``(lambda1 / 2) mean_ij K_ij``; the entropy term of
        the Langevin kinds has no particle estimate), and for the Langevin kinds its two
        parts ``mean_v`` and ``mmd`` and the kernel's ``bandwidth``."""
        ds = super().fit_group()
        control = self.inference.control
        if isinstance(control, SamplingControl):
            n = ds.sizes["step"]
            for key, values in control.trace.items():
                # the last n; steps of an earlier fit() than the controller's are not in it
                tail = np.asarray(values[-n:] if n else [], dtype=float)
                ds[key] = "step", np.pad(tail, (n - len(tail), 0), constant_values=np.nan)
        ds.attrs["definition"] = (
            "free energy = mean V + (lambda1 / 2) mean_ij kappa(theta_i, theta_j), V = -log p"
        )
        return ds

    def _method_group(self) -> xr.Dataset:
        return self._points_dataset(self.particles, "particle", self.inference.settings())


class Ensemble(FlowInference):
    r"""Deep, Langevin and repulsive Langevin ensembles (Wild, Ghalebikesabi, Sejdinovic &
    Knoblauch, NeurIPS 2023): ``N`` particles follow the Wasserstein gradient flow of
    generalised VI with the regulariser ``lambda1 MMD^2 + lambda2 KL``,

    .. math:: d\theta_n = -\Big(\nabla V(\theta_n) + \tfrac{\lambda_1}{N}\textstyle\sum_j
              \nabla_1\kappa(\theta_n, \theta_j)\Big)dt + \sqrt{2\lambda_2}\,dB_n,
              \quad V = -\log p(\theta, y),

    all particles and their gradients in one batched call, the interaction in ``O(N^2 D)``
    (:mod:`pymc_gpf.ensemble.flow`).

    Parameters
    ----------
    kind
        ``"deep"`` (``lambda1 = lambda2 = 0``: independent MAP ascents, each with its own
        backtracking step; stops once every particle is within ``tol^2`` nats of its mode),
        ``"langevin"`` (default; ``lambda1 = 0``: ``N`` unadjusted Langevin chains) or
        ``"repulsive"`` (``lambda1 > 0``: the MMD interaction pushes particles apart).
    n_particles
        ``N >= 2`` (default 20, the slides' ``N_E``); one chain each.
    temperature
        ``lambda2`` (default 1: the chains sample the posterior; ``T`` samples ``p^(1/T)``).
    repulsion
        ``lambda1`` of the repulsive kind (default 1).
    bandwidth
        The RBF kernel's ``h`` in ``exp(-|x - y|^2 / (2 h))``: ``"median"`` (default, the
        median heuristic recomputed every step) or a positive number.
    init, init_scale
        The particles start at ``init`` (``"initial_point"`` or ``"map"``) plus
        ``init_scale`` times standard normal noise (default 1).
    thin, target_ess
        Keep every ``thin``-th state as a draw; the Langevin kinds stop once the draws'
        smallest bulk and tail ESS reach ``target_ess`` (default 400) with R-hat within
        1.01 times that of as many well-mixed chains (a fixed 1.01 would ask for about 100
        effective draws per chain). ``thin`` doubles when the draws would exceed 2e7
        numbers.
    precondition
        With the automatic step size (the default), precondition the Langevin kinds by the
        ensemble's own covariance, re-estimated during burn-in and then frozen (default
        ``True``); ``False`` runs the paper's plain scheme.
    model, random_seed, start
        As in ``pm.fit``.
    devices
        JAX devices to split the particles or draws across (``backend="jax"``; a number, a
        list of devices or a ``jax.sharding.Mesh``; docs: "Scaling up").

    Notes
    -----
    At the automatic step size (the default) the Langevin kinds set ``eta`` during burn-in
    from the largest curvature of ``V`` the ensemble sees (in the preconditioner's metric),
    re-estimate the preconditioner, detect the end of burn-in, then freeze both
    (:mod:`pymc_gpf.ensemble.control`). The unadjusted scheme keeps an ``O(eta)`` bias
    (:func:`pymc_gpf.ensemble.flow.ula_gaussian_covariance` gives it for a Gaussian). A fixed
    ``learning_rate`` sets ``eta`` of the plain scheme instead. With ``pm.Minibatch`` data
    (SGLD, Langevin kinds only) ``eta`` is scaled by the batch's share of the rows when
    burn-in ends. The fit keywords are those of :meth:`pymc_gpf.GPF.fit`.
    """

    name = "ensemble"
    start_points = "particles"

    def __init__(
        self,
        kind: str = "langevin",
        *,
        n_particles: int = 20,
        temperature: float = 1.0,
        repulsion: float = 1.0,
        bandwidth: float | str = "median",
        init: str = "initial_point",
        init_scale: float = 1.0,
        thin: int = 1,
        target_ess: int = 400,
        precondition: bool = True,
        model: pm.Model | None = None,
        random_seed=None,
        start: dict | None = None,
        devices=None,
    ):
        self.config = EnsembleConfig(
            kind, n_particles, temperature, repulsion, bandwidth, init, init_scale, thin,
            target_ess, precondition,
        )  # fmt: skip
        super().__init__(model=model, random_seed=random_seed, start=start, devices=devices)

    def _initialise(self) -> EnsembleApproximation:
        config, target = self.config, self.target
        centre = initial_centre(target, self._start, config.init, self._init_rng)
        noise = self._init_rng.standard_normal((config.n_particles, target.ndim))
        return EnsembleApproximation(
            self, (centre + config.init_scale * noise).astype(target.dtype)
        )

    def _build_step(self, options: FitOptions) -> StepGraph:
        config, state = self.config, self.approx.state
        _check_options(options, self.target, config.kind)
        if config.kind == "deep":
            new, objective, info, (points, logp, grad) = step.deep_step(state, self.target)
        else:
            shape = config.n_particles, self.target.ndim
            noise = _noise(self.noise_rng, shape, self._preconditioned(options))
            new, objective, info, (points, logp, grad) = step.langevin_step(
                state, noise, self.learning_rates[0], self.target, config.temperature_used,
                config.repulsion_used, config.bandwidth,
            )  # fmt: skip
        return StepGraph(
            objective, points, logp, grad, new.particles, updates(state, new), info=info,
            guarded=False,
        )  # fmt: skip

    def _preconditioned(self, options: FitOptions) -> bool:
        return self.config.precondition and options.auto

    def _control(self, options: FitOptions) -> Control:
        if self.config.kind == "deep":
            return Deterministic(options.tol if options.tol is not None else 0.03)
        auto = options.auto
        # before the first curvature: a step a tenth of the initial spread's variance
        rate = 0.1 * self.config.init_scale**2 if auto else options.learning_rate[0]
        return SamplingControl(
            options.tol,
            particles=lambda: (
                self.approx.state.particles.get_value(),
                self.approx.state.drift.get_value(),
            ),
            set_rate=lambda eta: self._learning_rates.set_value(
                np.full(2, eta, dtype=self.target.dtype)
            ),
            preconditioner=self.approx.preconditioner if self._preconditioned(options) else None,
            minibatch_fraction=self.target.minibatch_fraction,
            rate=rate,
            adapt=auto,
            thin=self.config.thin,
            target_ess=self.config.target_ess,
        )

    def _describe(self, reason: str) -> str:
        if reason == "converged" and self.config.kind == "deep":
            return (
                "converged: every particle's next gradient step would raise log p by less "
                f"than tol^2 = {self.control.tol**2:.3g} nats (each sits at a mode)"
            )
        return super()._describe(reason)

    def _evaluations_per_step(self) -> tuple[int, int]:
        return self.config.n_particles, 0

    def _fitted_settings(self) -> dict:
        out = {"lambda1": self.config.repulsion_used, "lambda2": self.config.temperature_used}
        if isinstance(self.control, SamplingControl):
            out |= self.control.settings()
        return out


def _noise(rng, shape: tuple[int, int], precondition: bool) -> tuple:
    """A step's ``N(0, I)`` draws ``(N, D)`` and, to precondition, ``(N, K)`` more for the
    factor, as one draw (the generator updates once a step)."""
    n, d = shape
    if not precondition:
        return standard_normal(rng, shape), None
    draws = standard_normal(rng, (n, d + flow.factor_rows(n, d)))
    return draws[:, :d], draws[:, d:]


def _check_options(options: FitOptions, target, kind: str) -> None:
    """No hyperparameters; and what a deep ensemble's per-particle line search needs: its
    own step sizes, and the whole data set (on ``pm.Minibatch`` data it would compare two
    noisy log-densities)."""
    if options.more_obj_params:
        raise ValueError(
            "more_obj_params (type-II maximum likelihood) is not available for "
            "ensembles: their objective has no entropy term to descend jointly with the "
            "hyperparameters. Use method='gpf', 'gf' or 'wvgd'."
        )
    if kind != "deep":
        return
    if not options.auto:
        raise ValueError(
            "The deep ensemble finds its step sizes by backtracking; drop learning_rate (it "
            "applies to the Langevin kinds)."
        )
    if target.minibatch:
        raise ValueError(
            "The deep ensemble's line search compares log-densities, which pm.Minibatch data "
            "make noisy: give the model the whole data set, or use kind='langevin' (SGLD "
            "on minibatches)."
        )
