"""GF as a PyMC inference: ``pm.fit(method="gf")`` or ``pm.fit(method=GF(...))``."""

from __future__ import annotations

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
from pymc_gpf.checks import is_integer, positive, renamed
from pymc_gpf.datatree import settings_attrs
from pymc_gpf.engine import (
    AUTO,
    FitOptions,
    FlowInference,
    StepGraph,
    transform_direction,
)
from pymc_gpf.gaussian import GaussianQ
from pymc_gpf.gf import flow
from pymc_gpf.stepsize import cap
from pymc_gpf.structure import Structure, parse_structure

__all__ = ["GF", "GFApproximation"]

MAX_DEFAULT_RANK = 1000
MIN_DEFAULT_PAIRS, MAX_DEFAULT_PAIRS = 10, 500
MAX_SCALE_STEP = 0.5  # trust region: one step scales q's spread by at most 1 +- this


def default_pairs(rank: int) -> int:
    """Antithetic pairs of draws per step at the automatic step size: one per direction
    of the factor (the whitened pairs are then a cubature rule exact to degree 3), at
    least 10 and at most 500."""
    return min(max(rank, MIN_DEFAULT_PAIRS), MAX_DEFAULT_PAIRS)


def default_rank(ndim: int) -> int:
    """Full rank ``D``, capped at :data:`MAX_DEFAULT_RANK` with a warning (memory ``D K``)."""
    if ndim <= MAX_DEFAULT_RANK:
        return ndim
    warnings.warn(
        f"The model has D = {ndim} unconstrained dimensions; the default GF factor has rank "
        f"{MAX_DEFAULT_RANK} < D (a full-rank factor needs D^2 memory). Pass "
        "inf_kwargs={'rank': K} to choose, or structure='diagonal' for mean field.",
        UserWarning,
        stacklevel=3,
    )
    return MAX_DEFAULT_RANK


class GFApproximation(GaussianApproximation):
    """The fitted GF: ``q = N(mu, Gamma Gamma^T)``, i.e. ``x = mu + Gamma z`` with
    ``z ~ N(0, I_K)`` (eq. 3), ``Gamma`` block-diagonal as the structure says (§3.5; a vector
    of scales for mean field).

    ``mean``, ``std`` and ``cov`` are PyTensor expressions of the parameters in flat
    unconstrained space (``approx.mean.eval()``), like PyMC's approximations; ``factors``
    are NumPy copies, one ``(D_b, K_b)`` matrix per block. ``logq`` is the density of q.
    """

    def __init__(self, inference: GF, mean: np.ndarray, factors: list[np.ndarray]):
        super().__init__(inference)
        self.shared_mean = pytensor.shared(mean, name="gf_mean", shape=mean.shape)
        self.shared_factors = [
            pytensor.shared(f, name=f"gf_factor{i}", shape=f.shape) for i, f in enumerate(factors)
        ]

    @property
    def structure(self) -> Structure:
        """The block structure of ``Gamma`` (§3.5): full, diagonal or blocks of variables."""
        return self.inference.structure

    @property
    def params(self) -> list:
        """Shared variables of the fitted state: the mean and one factor per block."""
        return [self.shared_mean, *self.shared_factors]

    @property
    def factors(self) -> list[np.ndarray]:
        """``Gamma_b`` per block ``(D_b, K_b)`` (mean field: one vector of scales ``(D,)``)."""
        return [f.get_value() for f in self.shared_factors]

    @property
    def factor(self) -> np.ndarray:
        """The whole factor ``Gamma`` ``(D, sum_b K_b)``, zero outside the blocks, so that
        ``cov = factor @ factor.T``."""
        if self.structure.diagonal:
            return np.diag(self.factors[0])
        ranks = [f.shape[1] for f in self.factors]
        out = np.zeros((self.target.ndim, sum(ranks)), dtype=self.target.dtype)
        offsets = np.cumsum([0, *ranks])
        for f, b, lo in zip(self.factors, self.structure.blocks, offsets, strict=False):
            out[b, lo : lo + f.shape[1]] = f
        return out

    @cached_property
    def mean(self) -> pt.TensorVariable:
        """``mu`` in flat unconstrained space, a PyTensor variable (``.eval()``)."""
        return self.shared_mean

    @cached_property
    def std(self) -> pt.TensorVariable:
        """Marginal standard deviations ``sqrt(diag(Gamma Gamma^T))``, a PyTensor expression."""
        if self.structure.diagonal:
            return pt.abs(self.shared_factors[0])
        out = pt.zeros((self.target.ndim,), dtype=self.target.dtype)
        for f, b in zip(self.shared_factors, self.structure.blocks, strict=True):
            out = pt.set_subtensor(out[b], pt.sqrt(pt.sum(pt.square(f), axis=1)))
        return out

    @cached_property
    def cov(self) -> pt.TensorVariable:
        """The covariance ``Gamma Gamma^T`` ``(D, D)``, block-diagonal; a PyTensor expression
        (forms a ``D x D`` matrix, unlike the fit)."""
        if self.structure.diagonal:
            return pt.diag(pt.square(self.shared_factors[0]))
        d = self.target.ndim
        out = pt.zeros((d, d), dtype=self.target.dtype)
        for f, b in zip(self.shared_factors, self.structure.blocks, strict=True):
            out = pt.set_subtensor(out[np.ix_(b, b)], pt.dot(f, f.T))
        return out

    def _blocks(self) -> list[np.ndarray]:
        if self.structure.diagonal:
            return [np.arange(self.target.ndim)]
        return list(self.structure.blocks)

    def _why_singular(self) -> str:
        return f"its factor Gamma has rank {self.inference.rank}"

    def gaussian(self) -> GaussianQ:
        """The fitted ``q = N(mu, Gamma Gamma^T)`` (NumPy; degenerate when ``K < D``)."""
        return GaussianQ(self.shared_mean.get_value(), tuple(self._blocks()), tuple(self.factors))

    def _method_group(self) -> xr.Dataset:
        labels = np.asarray(self.target.labels)
        std = np.empty(self.target.ndim, dtype=self.target.dtype)
        for f, b in zip(self.factors, self._blocks(), strict=True):
            std[b] = np.abs(f) if f.ndim == 1 else np.sqrt(np.sum(f**2, axis=1))
        data = {"mean": ("coordinate", self.shared_mean.get_value()), "std": ("coordinate", std)}
        coords = {"coordinate": labels}
        if not self.structure.diagonal:
            factors = self.factors
            if len(factors) == 1:
                data["factor"] = (("coordinate", "rank"), factors[0])
            for i, (f, b) in enumerate(zip(factors, self.structure.blocks, strict=True)):
                if len(factors) > 1:
                    data[f"factor_block{i}"] = ((f"block{i}_coordinate", f"block{i}_rank"), f)
                    coords[f"block{i}_coordinate"] = labels[b]
        return xr.Dataset(data, coords=coords, attrs=settings_attrs(self.inference.settings()))


class GF(FlowInference):
    r"""Gaussian Flow (Galy-Fajou, Perrone & Opper, Entropy 2021, §3.2, eq. 11).

    Gaussian VI with explicit parameters ``q = N(mu, Gamma Gamma^T)``: each step draws ``S``
    points of q and moves

    .. math:: \mu \leftarrow \mu - \eta_1 \bar g, \qquad
              \Gamma \leftarrow \Gamma - \eta_2 \Big[\tfrac1S \textstyle\sum_s
              g_s (x_s - \mu)^\top \Gamma - \Gamma\Big], \quad g = -\nabla\log p,

    without inverses or Hessians, ``O(S D K)`` per step plus ``S`` gradients. Its fixed
    points are the Gaussian VI optimum (full rank), the top-``K`` subspace (``rank=K``) or
    the mean-field optimum (``structure="diagonal"``).

    Parameters
    ----------
    rank
        Columns ``K`` of each block's factor, ``1 <= K <= D``; default full rank (at most
        1000). ``K < D`` fits a low-rank Gaussian (its free energy is then regularised, as
        GPF's with ``N <= D``).
    draws_per_step
        Draws ``S >= 1`` of q per step (Monte Carlo for the update and the free energy).
        ``"auto"`` (default): with the automatic step size, ``2 max(K, 10)`` (at most
        1000) draws in antithetic pairs, whitened so that they integrate every polynomial
        of degree up to 3 exactly under q; with a fixed ``learning_rate``, 10 independent
        draws. An explicit number is honoured (at the automatic step size in pairs: an odd
        number gets one more draw). Called ``n_samples`` before 0.2 (still accepted, with a
        warning).
    structure
        ``"full"``, ``"diagonal"`` (mean field), ``"variables"`` (one block per free
        variable) or a list of lists of variable names (block-diagonal, §3.5).
    natural_mean
        Precondition the mean step by ``Gamma Gamma^T``. Default: on with the automatic
        step size (where both steps are natural-gradient steps,
        :func:`pymc_gpf.gf.flow.natural_directions`), off with a fixed ``learning_rate``
        (eq. 11 as printed; with ``K < D`` the natural mean would move only inside
        ``span(Gamma)``).
    init
        ``"initial_point"`` (the model's initial point, updated by ``start``) or ``"map"``.
    init_scale
        The initial factor is ``init_scale`` times the first ``K`` columns of the identity.
    model, random_seed, start
        As in ``pm.fit``.

    Notes
    -----
    At the automatic step size (the default) each step draws fresh whitened antithetic
    pairs, takes natural-gradient steps inside a trust region (the mean moves at most
    ``sqrt(K)`` of q's sds, the spread changes by at most 50 %) and the step size follows
    :class:`pymc_gpf.control.Stochastic`: halved when the free energy stops falling, the
    fit ending on the average of its last window once that is precise to ``tol`` sds.
    Fresh draws every step mean the fit cannot adapt itself to particular points, so GF has
    no finite-N bias of GPF's kind (the whitening leaves only a small bias of order 1/S in
    moments of degree 4 and higher).

    Algorithm 1 of the paper prints ``phi`` for ``grad phi`` in the mean step and drops the
    ``+ eta2 Gamma`` term; eq. 11, used here, has both. Plain descent on ``Gamma`` is stable
    for ``eta2 < 2 / kappa`` (``kappa`` the condition number of the posterior covariance);
    the iterates fluctuate around the fixed point with a spread of order ``sqrt(eta / S)``.
    The fit keywords are those of :meth:`pymc_gpf.GPF.fit`.
    """

    name = "gf"
    renamed_options: ClassVar[dict[str, str]] = {"n_samples": "draws_per_step"}
    default_learning_rate = 1e-3
    spread_option = "init_scale"
    start_points = "draws of q"

    def __init__(
        self,
        rank: int | None = None,
        *,
        draws_per_step: int | str = AUTO,
        structure: str | Sequence[Sequence[str]] = "full",
        natural_mean: bool | None = None,
        init: str = "initial_point",
        init_scale: float = 0.1,
        model: pm.Model | None = None,
        random_seed=None,
        start: dict | None = None,
        n_samples: int | str | None = None,
    ):
        self.rank = rank
        draws = renamed("GF", "n_samples", "draws_per_step", n_samples, draws_per_step, AUTO)
        self.draws_per_step = AUTO if draws is None else draws
        self.natural_mean = natural_mean if natural_mean is None else bool(natural_mean)
        self.init = init
        self.init_scale = init_scale
        self._structure_option = structure
        super().__init__(model=model, random_seed=random_seed, start=start)

    def _initialise(self) -> GFApproximation:
        d = self.target.ndim
        self.structure = parse_structure(self._structure_option, self.target)
        if self.draws_per_step != AUTO and not is_integer(self.draws_per_step, 1):
            raise ValueError(
                f"draws_per_step must be 'auto' or an integer >= 1 (draws of q per step), got "
                f"{self.draws_per_step!r}."
            )
        if self.structure.diagonal and self.rank is not None:
            raise ValueError(
                "rank applies to 'full' and block structures; structure='diagonal' has one "
                "scale per coordinate. Drop rank= or choose another structure."
            )
        if self.rank is None and not self.structure.diagonal:
            self.rank = default_rank(d)
        if not self.structure.diagonal and not (is_integer(self.rank, 1) and self.rank <= d):
            raise ValueError(
                f"rank must be an integer between 1 and D = {d} (the number of unconstrained "
                f"coordinates), got {self.rank!r}."
            )
        scale = positive("init_scale", self.init_scale)
        mean = self._initial_centre(self.init).astype(self.target.dtype)
        if self.structure.diagonal:
            factors = [np.full(d, scale, dtype=self.target.dtype)]
        else:
            factors = [
                scale * np.eye(len(b), min(self.rank, len(b)), dtype=self.target.dtype)
                for b in self.structure.blocks
            ]
        return GFApproximation(self, mean, factors)

    def constructor_options(self) -> dict:
        return {
            "rank": None if self.rank is None else int(self.rank),
            "draws_per_step": self.draws_per_step
            if self.draws_per_step == AUTO
            else int(self.draws_per_step),
            "structure": self._structure_option,
            "natural_mean": self.natural_mean,
            "init": self.init,
            "init_scale": float(self.init_scale),
        }

    def settings(self) -> dict:
        """The options of this fit, as stored in the DataTree's ``gf`` group."""
        out = {
            "rank": self.rank,
            "ranks": [f.shape[-1] for f in self.approx.factors],
            "draws_per_step": self.resolved_draws(self.fit_options),
            "structure": self.structure.describe(),
            "natural_mean": self._natural_mean(self.fit_options),
            "init": self.init,
            "init_scale": self.init_scale,
            "random_seed": self.random_seed,
            "n_steps": len(self.hist),
        }
        if self.fit_options is not None:
            out.update(self.fit_options.settings())
        return out

    def _natural_mean(self, options: FitOptions | None) -> bool:
        if self.natural_mean is not None:
            return self.natural_mean
        return options is not None and options.auto

    def _pairs(self, options: FitOptions | None) -> int:
        if self.draws_per_step != AUTO:
            return (int(self.draws_per_step) + 1) // 2
        ranks = [f.shape[-1] for f in self.approx.factors]
        return default_pairs(max(ranks))

    def resolved_draws(self, options: FitOptions | None) -> int:
        """Draws of q each step: ``draws_per_step``, or its automatic value."""
        if options is not None and options.auto:
            return 2 * self._pairs(options)
        return 10 if self.draws_per_step == AUTO else int(self.draws_per_step)

    def _build_step(self, options: FitOptions) -> StepGraph:
        if options.auto:
            if self.natural_mean is False:
                raise ValueError(
                    "natural_mean=False needs a fixed learning_rate: the automatic step size "
                    "uses natural-gradient steps. Drop natural_mean or pass a learning_rate."
                )
            return self._natural_step(options)
        approx = self.approx
        mean, factors = approx.shared_mean, approx.shared_factors
        s = self.resolved_draws(options)
        noise = [self.standard_normal((s, f.type.shape[-1])) for f in factors]
        deviations = flow.deviations(factors, noise, self.structure)
        points = mean + deviations
        logp, grad_logp, hyper = self.target.logp_and_grads(points, options.more_obj_params)
        grads = -grad_logp
        eta1, eta2 = self.learning_rates
        shift = flow.mean_direction(grads, factors, self.structure, self._natural_mean(options))
        shift, updates = transform_direction(options.chain(), shift, mean.type.shape, "gf_mean")
        new_mean = (mean - eta1 * shift).astype(mean.dtype)
        updates[mean] = new_mean
        new_factors = []
        directions = flow.factor_directions(grads, deviations, factors, self.structure)
        for f, direction in zip(factors, directions, strict=True):
            # a dimension-wise optimiser shares its scale across the K columns: an affine
            # preconditioner of Gamma's rows, as GPF shares it across particles
            chain = options.chain(particle_axes=(1,) if f.ndim == 2 else ())
            direction, opt_updates = transform_direction(chain, direction, f.type.shape, f.name)
            updates.update(opt_updates)
            updates[f] = (f - eta2 * direction).astype(f.dtype)
            new_factors.append(updates[f])
        return StepGraph(
            free_energy=flow.free_energy(logp, factors, self.structure),
            points=points,
            logp=logp,
            grad=grad_logp,
            positions=new_mean + flow.deviations(new_factors, noise, self.structure),
            updates=updates,
            hyper_grads=[-h / s for h in hyper],
        )

    def _evaluations_per_step(self) -> tuple[int, int]:
        return self.resolved_draws(self.fit_options), 0

    def _natural_step(self, options: FitOptions) -> StepGraph:
        approx = self.approx
        mean, factors = approx.shared_mean, approx.shared_factors
        pairs = self._pairs(options)
        if self.structure.diagonal:
            noise = [flow.standardised_antithetic(self.standard_normal((pairs, self.target.ndim)))]
        else:
            noise = [
                flow.whitened_antithetic(self.standard_normal((pairs, f.type.shape[-1])))
                for f in factors
            ]
        deviations = flow.deviations(factors, noise, self.structure)
        points = mean + deviations
        logp, grad_logp, _ = self.target.logp_and_grads(points)
        free_energy = flow.free_energy(logp, factors, self.structure)
        shift, directions, dec_mean, dec_cov, spectral = flow.natural_directions(
            -grad_logp, noise, factors, self.structure
        )
        rank = sum(f.type.shape[-1] for f in factors)
        step = self.learning_rates[0]
        eta_mean = cap(step, pt.sqrt(dec_mean), float(np.sqrt(rank)))
        eta_factor = cap(0.5 * step, spectral, MAX_SCALE_STEP)
        new_mean = mean - eta_mean * shift
        new_factors = [f - eta_factor * d for f, d in zip(factors, directions, strict=True)]
        accepted = pt.isfinite(free_energy) & pt.all(pt.isfinite(new_mean))
        for f in new_factors:
            accepted = accepted & pt.all(pt.isfinite(f))
        previous = pytensor.shared(
            np.asarray(np.inf, dtype=self.target.dtype), name="gf_free_energy"
        )

        def keep(new, old):
            return pt.switch(accepted, new, old).astype(old.dtype)

        recorded = keep(free_energy, previous)
        updates = {mean: keep(new_mean, mean), previous: recorded}
        updates.update({f: keep(nf, f) for f, nf in zip(factors, new_factors, strict=True)})
        return StepGraph(
            free_energy=recorded,
            points=points,
            logp=logp,
            grad=grad_logp,
            positions=updates[mean]
            + flow.deviations([updates[f] for f in factors], noise, self.structure),
            updates=updates,
            info={"accepted": accepted, "step_size": eta_mean, "decrement": dec_mean + dec_cov},
            guarded=False,
        )
