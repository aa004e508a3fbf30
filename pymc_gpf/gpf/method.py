"""GPF as a PyMC inference: ``pm.fit(method="gpf")`` or ``pm.fit(method=GPF(...))``."""

from __future__ import annotations

import numbers
import warnings

from collections.abc import Sequence
from functools import cached_property

import numpy as np
import pymc as pm
import pytensor
import pytensor.tensor as pt
import xarray as xr

from pymc_gpf.approximation import GaussianApproximation
from pymc_gpf.engine import FitOptions, FlowInference, StepGraph, is_integer, transform_direction
from pymc_gpf.gaussian import GaussianQ
from pymc_gpf.gpf import flow
from pymc_gpf.structure import Structure, parse_structure

__all__ = ["GPF", "GPFApproximation"]

MAX_DEFAULT_PARTICLES = 1000


def default_n_particles(ndim: int) -> int:
    """``max(D + 1, 50)``: full rank, and enough particles that the finite-N bias of the
    particle free energy stays small on non-Gaussian posteriors (see docs, "Choosing N")."""
    n = max(ndim + 1, 50)
    if n > MAX_DEFAULT_PARTICLES:
        warnings.warn(
            f"The model has D = {ndim} unconstrained dimensions; the default uses "
            f"{MAX_DEFAULT_PARTICLES} particles, so the fitted Gaussian has rank "
            f"{MAX_DEFAULT_PARTICLES - 1} < D. Pass inf_kwargs={{'n_particles': {ndim + 1}}} "
            "for a full-rank fit, or a smaller number for a cheaper low-rank one.",
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
        self.shared_particles = pytensor.shared(
            particles, name="gpf_particles", shape=particles.shape
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

    Parameters
    ----------
    n_particles
        Number of particles ``N >= 2``. The default ``max(D + 1, 50)`` (at most 1000) gives a
        full-rank fit with enough particles to keep the finite-``N`` bias small on
        non-Gaussian posteriors; ``N <= D`` fits the top ``N - 1`` directions only.
    structure
        ``"full"``, ``"diagonal"`` (mean field), ``"variables"`` (one block per free
        variable) or a list of lists of variable names (block-diagonal, §3.5).
    natural_mean
        Precondition the mean step by ``C`` (the natural-gradient shift after Theorem 2).
    init
        ``"initial_point"`` (the model's initial point, updated by ``start``) or ``"map"``.
    jitter
        Scale of the isotropic Gaussian spread of the initial particles around that point;
        must be positive (identical particles never separate).
    initial_particles
        Explicit ``(N, D)`` starting particles in flat unconstrained space (overrides
        ``init``/``jitter``; column order as ``approx.target.labels``).
    model, random_seed, start
        As in ``pm.fit``.
    """

    name = "gpf"
    default_learning_rate = 1e-3

    def __init__(
        self,
        n_particles: int | None = None,
        *,
        structure: str | Sequence[Sequence[str]] = "full",
        natural_mean: bool = False,
        init: str = "initial_point",
        jitter: float = 0.1,
        initial_particles: np.ndarray | None = None,
        model: pm.Model | None = None,
        random_seed=None,
        start: dict | None = None,
    ):
        self.n_particles = n_particles
        self.natural_mean = bool(natural_mean)
        self.init = init
        self.jitter = jitter
        self.initial_particles = initial_particles
        self._structure_option = structure
        super().__init__(model=model, random_seed=random_seed, start=start)

    # ------------------------------------------------------------------ initialising
    def _initialise(self) -> GPFApproximation:
        d = self.target.ndim
        self.structure = parse_structure(self._structure_option, self.target)
        if self.initial_particles is not None:
            particles = self._check_particles(self.initial_particles)
            self.n_particles = len(particles)
            return GPFApproximation(self, particles)
        if self.n_particles is None:
            self.n_particles = default_n_particles(d)
        n = self.n_particles
        if not is_integer(n, 2):
            raise ValueError(
                f"n_particles must be an integer >= 2 (particles define a covariance through "
                f"their spread), got {n!r}. N = D + 1 = {d + 1} gives a full-rank fit."
            )
        jitter = self.jitter
        if isinstance(jitter, bool) or not isinstance(jitter, numbers.Real) or not jitter > 0:
            raise ValueError(
                f"jitter must be a positive number (identical particles never separate), got "
                f"{jitter!r}."
            )
        if not np.isfinite(jitter):
            raise ValueError(f"jitter must be finite, got {jitter!r}.")
        centre = self._initial_centre(self.init)
        noise = self._init_rng.standard_normal((int(n), d))
        particles = (centre + float(jitter) * noise).astype(self.target.dtype)
        return GPFApproximation(self, particles)

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
                "; particles that coincide in a coordinate never separate. Add jitter."
            )
        return particles

    def constructor_options(self) -> dict:
        return {
            "n_particles": int(self.n_particles),
            "structure": self._structure_option,
            "natural_mean": self.natural_mean,
            "init": self.init,
            "jitter": float(self.jitter),
        }

    def settings(self) -> dict:
        """The options of this fit, as stored in the DataTree's ``gpf`` group."""
        out = {
            "n_particles": self.n_particles,
            "structure": self.structure.describe(),
            "natural_mean": self.natural_mean,
            "init": self.init if self.initial_particles is None else "initial_particles",
            "jitter": self.jitter,
            "random_seed": self.random_seed,
            "n_steps": len(self.hist),
        }
        if self.fit_options is not None:
            out.update(self.fit_options.settings())
        return out

    # ----------------------------------------------------------------------- the step
    def _build_step(self, options: FitOptions) -> StepGraph:
        shared = self.approx.shared_particles
        n, d = shared.get_value().shape
        particles = pt.specify_shape(shared, (n, d))
        logp, grad_logp, hyper = self.target.logp_and_grads(particles, options.more_obj_params)
        grads = -grad_logp
        _, deviations = flow.centre(particles)
        shift = flow.mean_shift(deviations, grads, self.structure, self.natural_mean)
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
