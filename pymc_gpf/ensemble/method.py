"""Ensembles as a PyMC inference: ``pm.fit(method="ensemble", inf_kwargs={"kind": ...})``."""

from __future__ import annotations

import warnings

from dataclasses import dataclass, field

import numpy as np
import pymc as pm
import xarray as xr

from pymc_gpf.approximation import FlowApproximation, ParticlesMixin
from pymc_gpf.checks import is_integer
from pymc_gpf.control import Control, Deterministic
from pymc_gpf.datatree import build_datatree
from pymc_gpf.diagnostics import nuts
from pymc_gpf.engine import NARROWING, FlowInference
from pymc_gpf.ensemble import flow, step
from pymc_gpf.ensemble.config import EnsembleConfig
from pymc_gpf.ensemble.control import (
    MEAN_ACCURACY,
    MINIBATCH_ACCURACY,
    RIDGE,
    STEP_PER_CURVATURE,
    SamplingControl,
    accuracy_ess,
    curvature,
)
from pymc_gpf.errors import FitWarning
from pymc_gpf.gaussian import GaussianQ
from pymc_gpf.gf.method import GF, fit_inside
from pymc_gpf.options import FitOptions
from pymc_gpf.protocols import Initialised
from pymc_gpf.start import initial_centre, initial_cloud
from pymc_gpf.stepgraph import StepGraph, dynamic_rows, share, standard_normal
from pymc_gpf.verdict import FAMILY_LIMITED, NOT_CONVERGED, TRUSTWORTHY, Verdict

__all__ = ["Ensemble", "EnsembleApproximation"]

# the largest excess of the chains' stationary sd over the posterior's that a fixed step
# may cause before the verdict says so (the accuracy the benchmarks ask is 10 %)
MAX_STEP_SD_BIAS = 0.05


class EnsembleApproximation(ParticlesMixin, FlowApproximation):
    """The fitted ensemble: its particles and, for the Langevin kinds, the draws collected
    along their trajectories after burn-in (one chain per particle). A deep ensemble's q is
    the equally weighted mixture of point masses at its particles."""

    def __init__(self, inference: Ensemble, particles: np.ndarray):
        super().__init__(inference)
        init = step.init_deep if inference.config.kind == "deep" else step.init_langevin
        state = init(particles, inference.step_static(), particles.dtype)
        self.state = share(state, "ensemble", dynamic_rows)
        self.shared_particles = self.state.particles

    @property
    def draws(self) -> np.ndarray:
        """``(N, S, D)``: every particle's draws after burn-in, the second half of those
        collected (deep: ``(1, N, D)``, the particles as the draws of one chain). A fit that
        never left burn-in has the last states of burn-in instead (:attr:`burn_in_only`),
        or before any step the particles themselves."""
        state = self.inference.control_state
        if self.inference.config.kind == "deep" or state is None:
            return self.particles[None, :, :]  # one chain: the mixture of point masses
        kept = state.kept() or state.recent or [self.particles]
        return np.stack(kept, axis=1)

    @property
    def burn_in_only(self) -> bool:
        """Whether :attr:`draws` are burn-in states (the fit never finished burn-in)."""
        state = self.inference.control_state
        kind = self.inference.config.kind
        return kind != "deep" and state is not None and not state.kept()

    def check_fit(self, rng: np.random.Generator, max_draws: int) -> Verdict:
        """The verdict on a converged ensemble: its chains' diagnostics (a deep ensemble's
        particles are modes, not draws: family-limited)."""
        state = self.inference.control_state
        if self.inference.config.kind == "deep":
            return Verdict(
                FAMILY_LIMITED,
                "a deep ensemble's particles are modes of the posterior (independent "
                "gradient ascents), not draws from it: their spread is not the posterior's",
                "Use kind='langevin' (the default) for posterior draws",
            )
        numbers = {
            "ess": state.ess,
            "rhat": state.rhat,
            "rhat_excess": state.rhat_excess,
            "draws_per_chain": len(state.kept()),
        }
        apart = state.apart()
        if apart is not None:
            particle, coordinate, distance = apart
            return Verdict(
                NOT_CONVERGED,
                f"particle {particle} sits apart from the others (its mean of coordinate "
                f"{coordinate} is {distance:.0f} within-chain sds from theirs): the posterior "
                "has several modes, which the chains do not cross, so their shares of the "
                "draws are not the modes' masses",
                f"Reparameterise to remove the minor modes, or use {nuts(self.target.minibatch)} "
                "with many chains and compare them",
                numbers,
            )
        step_bias = self._fixed_step_bias()
        if step_bias is not None:
            return step_bias
        return Verdict(
            TRUSTWORTHY,
            f"the {len(self.particles)} chains' draws pass the convergence test (smallest "
            f"ESS {state.ess:.0f} >= {self.inference.control.target_ess}; largest R-hat "
            f"{state.rhat:.3f}, {state.rhat_excess:.3f} times what as many well-mixed chains "
            "show)",
            "",
            numbers,
        )

    def _fixed_step_bias(self) -> Verdict | None:
        """Under a fixed ``learning_rate``, the unadjusted scheme's own bias: its stationary
        sd in the stiffest direction is ``(1 - eta L / 2)^(-1/2)`` times the posterior's
        (:func:`~pymc_gpf.ensemble.flow.ula_gaussian_variance`, ``L`` the largest curvature
        the ensemble spans); beyond ``1 + MAX_STEP_SD_BIAS`` the chains, however well mixed,
        do not sample the posterior (the automatic step keeps it near 2.6 %)."""
        inference = self.inference
        if inference.fit_options is None or inference.fit_options.auto:
            return None
        rate = float(inference.control.rate(inference.control_state))
        largest = curvature(self.particles, self.state.drift.get_value())
        if not (np.isfinite(largest) and largest > 0):
            return None
        product = rate * largest
        # in units of the stiffest direction's posterior variance 1 / L
        inflation = float(np.sqrt(flow.ula_gaussian_variance(1.0, product)))
        if inflation <= 1.0 + MAX_STEP_SD_BIAS:
            return None
        given = inference.fit_options.learning_rate
        lowered = "" if rate == given[0] else f" (lowered to {rate:.3g} by refused moves)"
        numbers = {"step_sd_inflation": inflation, "curvature": largest}
        refit = (
            f"Refit without learning_rate (pm.fit(method='{inference.name}')) for the "
            "automatic step"
        )
        measured = (
            f"(step x largest curvature = {rate:.3g} x {largest:.3g} = {product:.3g}; the "
            f"automatic step keeps it at {STEP_PER_CURVATURE:g}, 2 is unstable)"
        )
        if not np.isfinite(inflation):
            # the chains are where the unstable moves threw them (held by the drift's cap):
            # neither their draws nor the curvature there tell the posterior's
            return Verdict(
                NOT_CONVERGED,
                f"the fixed learning_rate {given}{lowered} is too large for the posterior's "
                f"curvature: the unadjusted Langevin scheme is unstable where the chains "
                f"went {measured}, so they do not sample the posterior",
                refit,
                numbers,
            )
        return Verdict(
            FAMILY_LIMITED,
            f"the fixed learning_rate {given}{lowered} is too large for the posterior's "
            f"curvature: the unadjusted Langevin chains' stationary sd in its stiffest "
            f"direction is {inflation:.3g} times the posterior's {measured}, however well the "
            "chains mix",
            f"{refit}, or with one at most {STEP_PER_CURVATURE / largest:.2g}",
            numbers,
        )

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
        ``draws`` in total as the other methods' (``⌈draws / chains⌉`` per chain, at least
        one, evenly spaced over the trajectory). (``random_seed`` does not apply: nothing is
        drawn anew; ``psis=True`` or ``regularize`` raise, as there is no density of q to
        reweight.)"""
        if kwargs.get("psis") or kwargs.get("regularize") is not None:
            raise ValueError(
                "PSIS-corrected draws reweight draws of q by p / q, but an ensemble's q is its "
                "draws (point masses, no density): sample() returns them as they are, without "
                "psis or regularize."
            )
        flat = self.draws
        if draws is not None:
            if not is_integer(draws, 1):
                raise ValueError(f"draws must be a positive integer, got {draws!r}.")
            per_chain = -(-int(draws) // flat.shape[0])
            keep = np.unique(np.linspace(0, flat.shape[1] - 1, per_chain).round().astype(int))
            flat = flat[:, keep]
        if include_transformed is None:
            options = self.inference.fit_options
            include_transformed = bool(options and options.include_transformed)
        n, s, d = flat.shape
        if self.burn_in_only:
            warnings.warn(
                "The ensemble never finished burn-in: these draws are its last states of "
                "burn-in, not posterior draws (the DataTree's ensemble group says "
                "burn_in_only). Continue the fit with approx.refine(n).",
                FitWarning,
                stacklevel=2,
            )
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
        if isinstance(self.inference.control, SamplingControl):
            n = ds.sizes["step"]
            for key, values in self.inference.control_state.trace._asdict().items():
                # the last n; steps of an earlier fit() than the controller's are not in it
                tail = np.asarray(values.items()[-n:] if n else [], dtype=float)
                ds[key] = "step", np.pad(tail, (n - len(tail), 0), constant_values=np.nan)
        ds.attrs["definition"] = (
            "free energy = mean V + (lambda1 / 2) mean_ij kappa(theta_i, theta_j), V = -log p"
        )
        return ds

    def _method_group(self) -> xr.Dataset:
        settings = self.inference.settings() | {"burn_in_only": self.burn_in_only}
        return self._points_dataset(self.particles, "particle", settings)


@dataclass
class EnsembleStart:
    """How the ensemble started, decided by ``_initialise`` (saved with a fit, a loaded one
    being rebuilt without running it again): its fields are updated, the object is kept."""

    init_used: str  # "gaussian" or "initial_point" ("auto" resolved)
    start_fit: dict = field(default_factory=dict)  # the Gaussian fit's numbers, if one ran
    start_q: GaussianQ | None = None  # that fit's q
    start_preconditioner: bool = False  # its covariance preconditions the chains
    # the point the initial particles spread around (a narrowed start moves them towards it)
    centre: np.ndarray | None = None


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
        Where the particles start: ``"initial_point"``, the model's initial point plus
        ``init_scale`` times standard normal noise (default 1); ``"map"``, the MAP plus that
        noise; ``"gaussian"``, draws of a Gaussian fit (GF at its defaults) with twice its
        sds: a short burn-in, but every chain starts in that fit's mode, so other modes go
        unseen; ``"auto"`` (default): the initial point, so that chains reaching different
        modes show in R-hat, plus ``init_scale`` times deviations of the Gaussian fit's
        draws from its mean where that fit converged (the posterior's scales, which can be
        far from the model's; else standard normal noise), preconditioned (Langevin kinds,
        whole data set) by that fit's covariance where its verdict is trustworthy, else by
        the ensemble's own covariance, re-estimated during burn-in (the fit's is not the
        posterior's).
    thin, target_ess
        Keep every ``thin``-th state as a draw; the Langevin kinds stop once the draws'
        smallest bulk and tail ESS reach ``target_ess`` with R-hat within 1.01 times that of
        as many well-mixed chains (a fixed 1.01 would ask for about 100 effective draws per
        chain). ``"auto"`` (default): the ESS at which the largest Monte Carlo error of the
        ``D`` posterior means stays below 0.08 posterior sds (95 %), 1,037 for ``D = 5``,
        1,493 for ``D = 25``, 2,571 for ``D = 1000``
        (:func:`pymc_gpf.ensemble.control.accuracy_ess`). ``thin`` doubles when the draws
        would exceed 2e7 numbers.
    precondition
        With the automatic step size (the default), precondition the Langevin kinds by the
        covariance of a Gaussian fit (GF at its defaults, run before the first step; mean
        field where ``D > 4 N``) or, with ``pm.Minibatch`` data or if that fit fails, by the
        ensemble's own covariance, re-estimated during burn-in and frozen after it (default
        ``True``); ``False`` runs the paper's plain scheme.
    model, random_seed, start, devices
        As in ``pm.fit``; ``devices`` as in :class:`~pymc_gpf.engine.FlowInference`.

    Notes
    -----
    At the automatic step size (the default) the Langevin kinds set ``eta`` during burn-in
    from the largest curvature of ``V`` the ensemble sees (in the preconditioner's metric: a
    Gaussian fit's covariance, or on minibatches the ensemble's own, re-estimated), detect
    the end of burn-in, then freeze both
    (:mod:`pymc_gpf.ensemble.control`). The unadjusted scheme keeps an ``O(eta)`` bias
    (:func:`pymc_gpf.ensemble.flow.ula_gaussian_covariance` gives it for a Gaussian). A fixed
    ``learning_rate`` sets ``eta`` of the plain scheme instead. With ``pm.Minibatch`` data
    (SGLD, Langevin kinds only) ``eta`` is scaled by the batch's share of the rows when
    burn-in ends. The fit keywords are those of :meth:`pymc_gpf.GPF.fit`.
    """

    name = "ensemble"
    # the chains' noise spreads them again within their burn-in, whereas a Gaussian's
    # narrowed scales must be learnt back: narrower at once (an initial point 0.002 from
    # where a censored likelihood's gradient overflows needed 1e-4 of the spread)
    narrowing = NARROWING**2
    steps = (step.langevin_step, step.deep_step)
    inits = (step.init_langevin, step.init_deep)
    start_points = "particles"

    def __init__(
        self,
        kind: str = "langevin",
        *,
        n_particles: int = 20,
        temperature: float = 1.0,
        repulsion: float = 1.0,
        bandwidth: float | str = "median",
        init: str = "auto",
        init_scale: float = 1.0,
        thin: int = 1,
        target_ess: int | str = "auto",
        precondition: bool = True,
        model: pm.Model | None = None,
        random_seed=None,
        start: dict | None = None,
        devices=None,
    ):
        config = EnsembleConfig(
            kind, n_particles, temperature, repulsion, bandwidth, init, init_scale, thin,
            target_ess, precondition,
        )  # fmt: skip
        super().__init__(
            config=config, model=model, random_seed=random_seed, start=start, devices=devices
        )

    # the Gaussian fit the ensemble started from, if any (its numbers; saved with the fit)
    start_fit = property(lambda self: self.own.start_fit)

    def _initialise(self) -> Initialised:
        config, target = self.config, self.target
        own = EnsembleStart(init_used=config.resolved_init)
        automatic = config.init == "auto" and self._fits_a_gaussian_first()
        if config.resolved_init == "gaussian" or automatic:
            dense = flow.factor_rows(config.n_particles, target.ndim) == target.ndim
            q, own.start_fit = gaussian_start(
                target.model, self._start, self._init_rng, "full" if dense else "diagonal",
                check=automatic,
            )  # fmt: skip
            # "auto" starts at the initial point even where the fit is trustworthy: a mode q
            # never visits is invisible to its importance check (a mixture's mirror mode),
            # and chains started in q's mode would never find it
            own.start_q = q
            if q is not None and config.init == "gaussian":
                approx = EnsembleApproximation(self, self._overdispersed(q))
                own.centre = q.mean
                approx.preconditioner(start_preconditioner(q, config.n_particles))
                own.start_preconditioner = True
                own.init_used = "gaussian"
                return Initialised(approx, own=own)
            own.init_used = "initial_point"
        q, spread = own.start_q, None
        own.centre = initial_centre(target, self._start, own.init_used, self._init_rng)
        if q is not None and own.start_fit.get("converged"):
            # reported, and named in the remedy of a fit that did not converge: from beyond
            # far_start the chains can spend any number of steps crossing a region where
            # q's metric is not the posterior's. They still start here, not at q's draws:
            # started there, the ensembles tutorial's chains all stayed in q's mode and
            # passed R-hat, one of two mirror modes of equal mass missed
            own.start_fit["initial_point_distance"] = float(q.distance(own.centre)[0])
            # around the initial point at q's scales and orientation, not the model's: a
            # slope on predictors in the thousands has a posterior sd of 5e-5, and unit
            # noise there put the chains 10^4 sds out, on a flat ridge of an improper
            # posterior they never left (a negative binomial regression with flat priors)
            spread = lambda n, rng: q.sample(n, rng) - q.mean  # noqa: E731
        particles = initial_cloud(
            target, self._start, self._init_rng, n_particles=config.n_particles,
            init_scale=config.init_scale, init=own.init_used, spread=spread, centre=own.centre,
        )  # fmt: skip
        return Initialised(EnsembleApproximation(self, particles), own=own)

    def _narrow_start(self, factor: float) -> bool:
        # around the initial point at a Gaussian fit's scales (init="auto") the chains may
        # start where the log-density underflows: a censored Weibull likelihood 25 of that
        # fit's sds from its mean was -inf at 2 of 20 particles. Towards the point they
        # spread around, where log p is finite (check_start), not their mean
        self.approx.narrow(factor, self.own.centre)
        return True

    def _remedy(self, reason: str) -> str:
        below = self._below_the_posterior() if reason == "max_steps" else None
        if below is None:  # the chains are the alternative the other methods name
            return "" if reason == "max_steps" else super()._remedy(reason)
        return (
            f"The chains' log-density (median {below[0]:.4g}) is still far below its mean "
            f"under a Gaussian fit ({below[1]:.4g}), whose mean they started "
            f"{self.own.start_fit['initial_point_distance']:.0f} of its sds from (the initial "
            "point): they have not reached the posterior yet. init='gaussian' starts them "
            "at that fit's draws (every chain then begins in its mode), or refine(n) "
            "continues them"
        )

    def _far_from_the_fit(self) -> bool:
        """Whether the chains started farther than :func:`far_start` from the mean of a
        Gaussian fit whose log-density under q is known."""
        fit = self.own.start_fit
        return "mean_logp" in fit and fit.get("initial_point_distance", 0.0) > far_start(
            self.target.ndim
        )

    def _below_typical(self) -> float:
        """``log p`` ``FAR_BELOW`` sds under its mean over the start's Gaussian fit (a
        Gaussian posterior's ``log p`` has sd ``sqrt(D / 2)`` in its typical set)."""
        return self.own.start_fit["mean_logp"] - FAR_BELOW * np.sqrt(self.target.ndim / 2.0)

    def _below_the_posterior(self) -> tuple[float, float] | None:
        """``(median log p of the particles, E_q[log p] of the start's Gaussian fit)`` when
        the chains started far from that fit (:func:`far_start`) and their log-density is
        still below its typical values by more than ``FAR_BELOW`` of its sds (a Gaussian
        posterior's ``log p`` has sd ``sqrt(D / 2)`` in its typical set): chains crossing
        to the posterior, not chains in another mode of the same height."""
        if not self._far_from_the_fit():
            return None
        median = float(np.median(np.asarray(self.approx.state.logp.get_value())))
        mean = self.own.start_fit["mean_logp"]
        return (median, mean) if median < self._below_typical() else None

    def _overdispersed(self, q: GaussianQ) -> np.ndarray:
        """Draws of q with ``OVERDISPERSION`` times its sds (Gelman & Rubin): chains that
        begin in other modes stay there and show in R-hat, rather than all starting in
        q's."""
        spread = q.sample(self.config.n_particles, self._init_rng) - q.mean
        return (q.mean + OVERDISPERSION * spread).astype(self.target.dtype)

    def _fits_a_gaussian_first(self) -> bool:
        """Whether the Langevin kinds run a Gaussian fit before their first step (for their
        preconditioner and, with ``init="auto"``, their start): on the whole data set."""
        config = self.config
        return config.kind != "deep" and config.precondition and not self.target.minibatch

    def _build_step(self, options: FitOptions) -> StepGraph:
        config, state = self.config, self.approx.state
        _check_options(options, self.target, config.kind)
        static = self.step_static()
        if config.kind == "deep":
            new, info = step.deep_step(state, None, self.target, self.learning_rates, static)
            return StepGraph(state, new, info)
        state = state._replace(rng=self.noise_rng)
        shape = config.n_particles, self.target.ndim
        rng, noise = _noise(state.rng, shape, self._preconditioned(options))
        new, info = step.langevin_step(state, noise, self.target, self.learning_rates, static)
        return StepGraph(state, new._replace(rng=rng), info)

    def step_static(self) -> step.EnsembleStatic:
        """The settings of the step's graph (a deep ensemble's step has none)."""
        config = self.config
        if config.kind == "deep":
            return step.EnsembleStatic()
        return step.EnsembleStatic(config.temperature_used, config.repulsion_used, config.bandwidth)

    def _preconditioned(self, options: FitOptions) -> bool:
        return self.config.precondition and options.auto

    def _control(self, options: FitOptions) -> Control:
        if self.config.kind == "deep":
            return Deterministic(options.tol if options.tol is not None else 0.03)
        auto = options.auto
        # before the first curvature: a step a tenth of the initial spread's variance (in
        # the metric of a Gaussian fit's covariance, a tenth)
        spread = 1.0 if self.own.init_used == "gaussian" else self.config.init_scale**2
        rate = 0.1 * spread if auto else options.learning_rate[0]
        return SamplingControl(
            options.tol,
            minibatch_fraction=self.target.minibatch_fraction,
            initial_rate=rate,
            adapt=auto,
            initial_thin=self.config.thin,
            target_ess=self._target_ess(),
        )

    def observed_fields(self) -> dict:
        """What :class:`SamplingControl` reads now: the particles, and during burn-in their
        drift and log-density and the preconditioner (``None`` when the fit has none)."""
        if not isinstance(self.control, SamplingControl):
            return {}
        state, reads = self.approx.state, self.control.reads(self.control_state)
        fields = {
            "particles": state.particles.get_value,
            "drift": state.drift.get_value,
            "logp": lambda: np.asarray(state.logp.get_value()),
            "preconditioner": lambda: (
                self.approx.preconditioner() if self._preconditioned(self.fit_options) else None
            ),
        }
        return {name: read() for name, read in fields.items() if name in reads}

    def apply_decision(self, decision) -> None:
        """Besides q's parameters: the re-estimated preconditioner, and the restart of
        outlying particles from the state (position, ``log p``, drift) of the best ones."""
        if decision.preconditioner is not None:
            self.approx.preconditioner(decision.preconditioner)
        if decision.restart is not None:
            worst, best = decision.restart
            state = self.approx.state
            for shared in (state.particles, state.logp, state.drift):
                values = np.array(shared.get_value())  # a copy: JAX's arrays are immutable
                values[worst] = values[best]
                shared.set_value(values)
        if decision.rescue is not None:
            state, q = self.approx.state, self.own.start_q
            particles = np.array(state.particles.get_value())
            spread = q.sample(len(decision.rescue), self._method_rng) - q.mean
            particles[decision.rescue] = q.mean + OVERDISPERSION * spread
            state.particles.set_value(particles.astype(self.target.dtype))
            # the next step evaluates log p and the drift there before it moves
            state.ready.set_value(np.zeros((), dtype=self.target.dtype))

    def _target_ess(self) -> int:
        """``"auto"``: :func:`~pymc_gpf.ensemble.control.accuracy_ess` of ``D``; on
        minibatches to :data:`~pymc_gpf.ensemble.control.MINIBATCH_ACCURACY`, as the other
        methods' default ``tol`` is looser there."""
        if self.config.target_ess != "auto":
            return self.config.target_ess
        accuracy = MINIBATCH_ACCURACY if self.target.minibatch else MEAN_ACCURACY
        return accuracy_ess(self.target.ndim, accuracy)

    def _before_first_fit(self, options: FitOptions) -> None:
        """The Langevin kinds' preconditioner is a Gaussian fit's covariance: the chains
        move at the posterior's scale in every direction from the first step, whatever the
        model's units (on the whole data set; with ``pm.Minibatch`` the ensemble's own
        covariance, re-estimated during burn-in, as without a fit)."""
        if self.own.start_preconditioner and isinstance(self.control, SamplingControl):
            self.revise_control(SamplingControl.keep_preconditioner)  # a Gaussian fit's draws
        if not self._preconditioned(options) or self.own.start_preconditioner:
            return
        if not self._fits_a_gaussian_first():  # minibatches: a noisy GF costs more than it saves
            return
        fit = self.own.start_fit
        if self.config.init == "auto" and TRUSTWORTHY not in (
            fit.get("verdict"),
            fit.get("importance_verdict"),
        ):
            # the fit's verdict was not trustworthy: its covariance is not the posterior's
            # either, so the ensemble estimates its own during burn-in (as on minibatches).
            # Where only the mode search found fault (other modes), q still has its mode's
            # covariance, the metric a chain moves in: on a label-switching mixture chains
            # preconditioned by their own (between the modes) ended 0.15 sd off, 0.02 by q's
            return
        q = self.own.start_q
        if q is None and not self.own.start_fit:
            dense = flow.factor_rows(self.config.n_particles, self.target.ndim) == self.target.ndim
            q, self.own.start_fit = gaussian_start(
                self.model, self._start, self._method_rng, "full" if dense else "diagonal"
            )
        if q is not None:
            self.approx.preconditioner(start_preconditioner(q, self.config.n_particles))
            self.revise_control(SamplingControl.keep_preconditioner)
        if self._far_from_the_fit():
            # q is trustworthy and the chains start far from it: one still FAR_BELOW sds of
            # log p under q's typical values when burn-in would end is crossing to the
            # posterior, not in a mode of its own, and starts again at q's draws (sblrc-blr's
            # chains were 1 080 sds off after 10 000 steps, their log p 450 below)
            limit = self._below_typical()
            self.revise_control(lambda state: state._replace(lost_below=limit))

    def checkpoint_extra(self) -> dict:
        # what _initialise decided (a loaded fit is rebuilt without running it again), and
        # the fit's q (while a rescue may still draw from it) and the stream it draws with
        pending = getattr(self.control_state, "lost_below", -np.inf) > -np.inf
        q = self.own.start_q if pending else None
        return {
            "start_fit": self.own.start_fit,
            "init_used": self.own.init_used,
            "start_preconditioner": self.own.start_preconditioner,
            "rescue_rng": self._method_rng.bit_generator.state,
            "start_q": None if q is None else {
                "mean": q.mean.tolist(), "dtype": str(q.mean.dtype),
                "blocks": [b.tolist() for b in q.blocks],
                "factors": [f.tolist() for f in q.factors],
            },
        }  # fmt: skip

    def load_checkpoint_extra(self, extra: dict) -> None:
        self.own.start_fit = dict(extra["start_fit"])
        self.own.init_used = extra["init_used"]
        self.own.start_preconditioner = bool(extra["start_preconditioner"])
        if "rescue_rng" in extra:
            self._method_rng.bit_generator.state = extra["rescue_rng"]
        if (q := extra.get("start_q")) is not None:
            dtype = q["dtype"]
            self.own.start_q = GaussianQ(
                np.asarray(q["mean"], dtype=dtype),
                tuple(np.asarray(b, dtype=int) for b in q["blocks"]),
                tuple(np.asarray(f, dtype=dtype) for f in q["factors"]),
            )

    def _describe(self, reason: str) -> str:
        if reason == "converged" and self.config.kind == "deep":
            return (
                "converged: every particle's next gradient step would raise log p by less "
                f"than tol^2 = {self.control.tol**2:.3g} nats (each sits at a mode)"
            )
        return super()._describe(reason)

    def _fitted_settings(self) -> dict:
        out = {"lambda1": self.config.repulsion_used, "lambda2": self.config.temperature_used}
        out |= {f"start_{key}": value for key, value in self.own.start_fit.items()}
        if isinstance(self.control, SamplingControl):
            out |= self.control.settings(self.control_state)
        return out


OVERDISPERSION = 2.0  # the chains start at draws of q with twice its sds
FAR_BELOW = 10.0  # sds of log p below its typical values: the chains are not there yet


def far_start(ndim: int) -> float:
    """The distance from a Gaussian fit's mean, in its metric, beyond which a start is far:
    farther than nearly every overdispersed start (``OVERDISPERSION`` times a chi variable
    with ``ndim`` degrees of freedom, about ``sqrt(ndim)`` plus 3 sds)."""
    return OVERDISPERSION * (np.sqrt(ndim) + 3.0)


START_STEPS = 2000  # the most steps of the Gaussian fit (it converges in tens to hundreds)


def gaussian_start(
    model, start, rng: np.random.Generator, structure: str = "full", check: bool = False
) -> tuple[GaussianQ | None, dict]:
    """A Gaussian fit (GF at its defaults, no verdict, at most :data:`START_STEPS` steps) to
    precondition the chains by (and with ``init="gaussian"`` to start them from): ``(q,
    what the fit did)``, ``q`` ``None`` if it failed. The chains then move at the
    posterior's scale in every direction, even where the model's scales differ by orders of
    magnitude (unscaled predictors). ``structure="diagonal"`` (mean field, ``O(D)`` a draw)
    where the preconditioner's factor cannot hold a full covariance anyway."""
    gf = GF(model=model, random_seed=int(rng.integers(2**31)), start=start, structure=structure)
    try:
        approx = fit_inside(gf, START_STEPS, **({} if check else {"check_draws": 0}))
    except (FloatingPointError, ValueError) as err:
        return None, {"fit": "gf", "error": str(err)[:200]}
    q = approx.gaussian()
    info = {
        "fit": "gf" if structure == "full" else f"gf ({structure})",
        "converged": bool(approx.outcome.converged),
        "steps": len(approx.hist),
        "gradient_evaluations": int(gf.gradient_evaluations),
    } | ({"verdict": approx.outcome.verdict} if check else {})
    if check and "importance_verdict" in approx.outcome.checks:
        info["importance_verdict"] = approx.outcome.checks["importance_verdict"]
    if not (np.all(np.isfinite(q.mean)) and np.all(np.isfinite(q.marginal_variances()))):
        return None, info | {"error": "not finite"}
    elbo = approx.outcome.checks.get("elbo") if check else None
    if elbo is not None and np.isfinite(elbo):
        # E_q[log p] = ELBO + entropy, the entropy D/2 - log q(mean)
        entropy = 0.5 * q.ndim - float(q.logpdf(q.mean[None])[0])
        info["mean_logp"] = float(elbo) + entropy
    return q, info


def start_preconditioner(q: GaussianQ, n_particles: int) -> tuple[np.ndarray, np.ndarray]:
    """``M = diag(d) + F^T F`` equal to q's covariance (its top ``N`` directions plus the
    rest of each coordinate's variance on the diagonal when ``F`` has ``N`` rows,
    :func:`~pymc_gpf.ensemble.flow.factor_rows`)."""
    d = q.ndim
    factor = np.zeros((d, d))
    for block, f in zip(q.blocks, q.factors, strict=True):
        factor[np.ix_(block, block)] = np.diag(f) if f.ndim == 1 else _square(f)
    u, s, _ = np.linalg.svd(factor, full_matrices=False)  # cov = u s^2 u^T
    variances = q.marginal_variances()
    rows = flow.factor_rows(n_particles, d)
    top = (u[:, :rows] * s[:rows]).T  # (rows, D)
    rest = np.maximum(variances - np.sum(top**2, axis=0), 0.0)
    diagonal = np.maximum(rest, RIDGE * variances) + np.finfo(float).tiny ** 0.5
    if rows < d:
        return diagonal, top
    return diagonal, np.pad(top, ((0, d - top.shape[0]), (0, 0)))


def _square(f: np.ndarray) -> np.ndarray:
    """A square factor with ``f f^T`` (``f`` has at most as many columns as rows)."""
    return np.pad(f, ((0, 0), (0, f.shape[0] - f.shape[1])))


def _noise(rng, shape: tuple[int, int], precondition: bool) -> tuple:
    """The generator after a step's ``N(0, I)`` draws ``(N, D)`` and, to precondition,
    ``(N, K)`` more for the factor, as one draw; those draws."""
    n, d = shape
    if not precondition:
        rng, draws = standard_normal(rng, shape)
        return rng, (draws, None)
    rng, draws = standard_normal(rng, (n, d + flow.factor_rows(n, d)))
    return rng, (draws[:, :d], draws[:, d:])


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
