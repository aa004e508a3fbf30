"""GF as a PyMC inference: ``pm.fit(method="gf")`` or ``pm.fit(method=GF(...))``."""

from __future__ import annotations

import warnings

from collections.abc import Sequence
from dataclasses import replace
from functools import cached_property, partial
from typing import ClassVar

import numpy as np
import pymc as pm
import pytensor.tensor as pt
import xarray as xr

from pymc_gpf.approximation import HESSIAN_STEP, GaussianApproximation
from pymc_gpf.checks import renamed
from pymc_gpf.datatree import settings_attrs
from pymc_gpf.engine import FlowInference
from pymc_gpf.errors import FitWarning
from pymc_gpf.gaussian import GaussianQ
from pymc_gpf.gf import flow, step
from pymc_gpf.gf.config import GFConfig
from pymc_gpf.gf.parameters import (
    MAX_ROTATION_DIM,
    automatic_structure,
    check_rank,
    draw_pairs,
    initial_factors,
    standardised_pairs,
)
from pymc_gpf.options import AUTO, FitOptions, resolve_natural_mean
from pymc_gpf.protocols import Initialised
from pymc_gpf.start import (
    MAX_CURVATURE_DIM,
    curvature_scales,
    find_map,
    initial_centre,
    nonfinite_gradient,
)
from pymc_gpf.stepgraph import StepGraph, share, share_init, standard_normal, values
from pymc_gpf.structure import Structure, find_locals, parse_structure

__all__ = ["GF", "GFApproximation", "arrow_points", "fit_inside", "model_locals"]

# a start whose gradient is not finite at the initial mean moves by a uniform jitter of this
# fraction of the initial spread (GF._retry_start)
START_JITTER = 1e-3
# accepted steps in a row cut short by the trust region before the automatic fit restarts
# from the MAP (pymc_gpf.control.Stochastic.crawl)
CRAWL_STEPS = 100


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
        self.state = share(step.GFState(mean, tuple(factors)), "gf")  # gf_mean, gf_factor0, ...
        self.shared_mean, self.shared_factors = self.state.mean, list(self.state.factor)

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
        if self.structure.low_rank:  # [U, diag(s)], D x (K + D)
            loadings, scales = self.factors
            return np.concatenate([loadings, np.diag(scales)], axis=1)
        if self.structure.hierarchical:  # the arrow, D x D
            (lower, coupling, scales), (g, loc) = self.factors, self.structure.blocks
            out = np.zeros((self.target.ndim, self.target.ndim), dtype=self.target.dtype)
            out[np.ix_(g, g)], out[np.ix_(loc, g)], out[loc, loc] = lower, coupling, scales
            return out
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
        if self.structure.low_rank:
            loadings, scales = self.shared_factors
            return pt.sqrt(pt.sum(pt.square(loadings), axis=1) + pt.square(scales))
        if self.structure.hierarchical:
            lower, coupling, scales = self.shared_factors
            g, loc = self.structure.blocks
            out = pt.zeros((self.target.ndim,), dtype=self.target.dtype)
            out = pt.set_subtensor(out[g], pt.sqrt(pt.sum(pt.square(lower), axis=1)))
            local = pt.sum(pt.square(coupling), axis=1) + pt.square(scales)
            return pt.set_subtensor(out[loc], pt.sqrt(local))
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
        if self.structure.low_rank:
            loadings, scales = self.shared_factors
            return pt.dot(loadings, loadings.T) + pt.diag(pt.square(scales))
        if self.structure.hierarchical:
            (lower, coupling, scales), (g, loc) = self.shared_factors, self.structure.blocks
            arrow = pt.zeros((d, d), dtype=self.target.dtype)
            arrow = pt.set_subtensor(arrow[np.ix_(g, g)], lower)
            arrow = pt.set_subtensor(arrow[np.ix_(loc, g)], coupling)
            arrow = pt.set_subtensor(arrow[loc, loc], scales)
            return pt.dot(arrow, arrow.T)
        out = pt.zeros((d, d), dtype=self.target.dtype)
        for f, b in zip(self.shared_factors, self.structure.blocks, strict=True):
            out = pt.set_subtensor(out[np.ix_(b, b)], pt.dot(f, f.T))
        return out

    def _blocks(self) -> list[np.ndarray]:
        if self.structure.diagonal or self.structure.low_rank:
            return [np.arange(self.target.ndim)]
        return list(self.structure.blocks)

    def _why_singular(self) -> str:
        return f"its factor Gamma has rank {self.inference.resolved.rank}"

    def gaussian(self) -> GaussianQ:
        """The fitted ``q = N(mu, Gamma Gamma^T)`` (NumPy; degenerate when ``K < D``)."""
        mean = self.shared_mean.get_value()
        if self.structure.hierarchical:
            lower, coupling, scales = self.factors
            return GaussianQ(mean, self.structure.blocks, (lower, scales), coupling=coupling)
        if self.structure.low_rank:
            loadings, scales = self.factors
            return GaussianQ(mean, tuple(self._blocks()), (scales,), loadings=loadings)
        return GaussianQ(mean, tuple(self._blocks()), tuple(self.factors))

    def _method_group(self) -> xr.Dataset:
        labels = np.asarray(self.target.labels)
        std = np.sqrt(self.gaussian().marginal_variances())
        data = {"mean": ("coordinate", self.shared_mean.get_value()), "std": ("coordinate", std)}
        coords = {"coordinate": labels}
        if self.structure.hierarchical:
            lower, coupling, scales = self.factors
            g, loc = self.structure.blocks
            data |= {
                "global_factor": (("global_coordinate", "global_rank"), lower),
                "coupling": (("local_coordinate", "global_rank"), coupling),
                "local_scale": ("local_coordinate", scales),
            }
            coords |= {"global_coordinate": labels[g], "local_coordinate": labels[loc]}
        elif self.structure.low_rank:
            loadings, scales = self.factors
            data |= {
                "loadings": (("coordinate", "rank"), loadings),
                "scale": ("coordinate", scales),
            }
        elif not self.structure.diagonal:
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
        GPF's with ``N <= D``). With ``structure="low-rank"``, the rank of ``U``,
        ``1 <= K < D``, default ``round(sqrt(D))`` (at most 50).
    draws_per_step
        Draws ``S >= 1`` of q per step (Monte Carlo for the update and the free energy).
        ``"auto"`` (default): with the automatic step size, the ``2 max(K, 10) + 1`` (at
        most 1001) points of a stochastic spherical-radial rule
        (:func:`pymc_gpf.gf.flow.spherical_radial`), which integrates every polynomial of
        degree up to 3 exactly under q and every other function without bias (``K`` is
        ``G + 1`` for the hierarchical structure; mean field above ``D = 200``: 20
        standardised draws; ``"low-rank"``: ``4 max(K, 10) + 2``,
        :func:`pymc_gpf.gf.flow.low_rank_rule`); with a fixed ``learning_rate``, 10
        independent draws. An explicit number is honoured (at the automatic step size
        rounded up to whole rules: ``S/2`` directions and the centre).
        Called ``n_samples`` before 0.2 (still accepted, with a warning).
    structure
        ``"full"``, ``"diagonal"`` (mean field), ``"variables"`` (one block per free
        variable), a list of lists of variable names (block-diagonal, §3.5), or
        ``"hierarchical"``: the free variables whose coordinates do not interact given
        the rest (a hierarchical model's group effects) are locals, the others globals, and
        the factor is the arrow ``[[L, 0], [C, diag(s)]]``, ``O(D G)`` memory and work per
        draw for ``G`` globals. It holds the full-rank optimum (whose precision has the
        posterior Hessian's arrow pattern) and needs the automatic step size.
        ``"low-rank"``: ``q = N(mu, U U^T + diag(s^2))`` with ``U`` ``(D, K)`` (numpyro's
        ``AutoLowRankMultivariateNormal``), ``O(S D K)`` a step and ``O(D K)`` memory, the
        automatic step size only; it holds a posterior's few strong correlations and every
        marginal scale, not a full covariance (the verdict says when that matters).
        ``"auto"`` (default): ``"hierarchical"`` above ``D = 64`` where the model has locals
        and at most 200 globals, else ``"full"`` up to ``D = 1000`` and ``"low-rank"`` above
        (``"full"`` with a given ``rank``).
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
    model, random_seed, start, devices
        As in ``pm.fit``; ``devices`` as in :class:`~pymc_gpf.engine.FlowInference`.

    Notes
    -----
    The automatic step (fresh spherical-radial draws, natural-gradient steps in a trust
    region, :class:`pymc_gpf.control.Stochastic`'s schedule) is :mod:`pymc_gpf.gf.step`.
    The fit keywords are those of :meth:`pymc_gpf.GPF.fit`.
    """

    name = "gf"
    steps = (step.fixed_step, step.natural_step)
    inits = (step.init_fixed, step.init_natural)
    renamed_options: ClassVar[dict[str, str]] = {"n_samples": "draws_per_step"}
    default_learning_rate = 1e-3
    spread_option = "init_scale"
    start_points = "draws of q"

    def __init__(
        self,
        rank: int | None = None,
        *,
        draws_per_step: int | str = AUTO,
        structure: str | Sequence[Sequence[str]] = AUTO,
        natural_mean: bool | None = None,
        init: str = "initial_point",
        init_scale: float = 0.1,
        model: pm.Model | None = None,
        random_seed=None,
        start: dict | None = None,
        devices=None,
        n_samples: int | str | None = None,
    ):
        draws = renamed("GF", "n_samples", "draws_per_step", n_samples, draws_per_step, AUTO)
        config = GFConfig(rank, draws, structure, natural_mean, init, init_scale)
        super().__init__(
            config=config, model=model, random_seed=random_seed, start=start, devices=devices
        )

    def _initialise(self) -> Initialised:
        config, d = self.config, self.target.ndim
        mean = initial_centre(self.target, self._start, config.init, self._init_rng)
        find = partial(self._find_locals, mean)
        if config.structure == AUTO:
            structure = automatic_structure(self.target, find, config.rank is not None)
        else:
            structure = parse_structure(config.structure, self.target, find)
        rank = check_rank(config.rank, structure, d)
        factors = initial_factors(structure, rank, config.init_scale, d, self.target.dtype)
        approx = GFApproximation(self, mean.astype(self.target.dtype), factors)
        return Initialised(approx, replace(config, rank=rank), structure)

    def _find_locals(self, centre: np.ndarray) -> Structure | None:
        return model_locals(self.target, centre)

    def _retry_start(self, attempt: int) -> tuple[str, str] | None:
        """Every step evaluates q's mean (the centre of its spherical-radial rules): where
        the gradient is not finite at the initial mean itself (a singularity of measure zero,
        e.g. ``phi ** k`` at ``phi = 0``, the initial point of ``Uniform(-1, 1)``), the mean
        moves by a uniform jitter of :data:`START_JITTER` of the initial spread (ten times
        more at each retry), as PyMC's samplers jitter their start; else the spread narrows."""
        mean = self.approx.shared_mean
        bad = nonfinite_gradient(self.target, mean.get_value())
        if not bad:
            return super()._retry_start(attempt)
        size = START_JITTER * 10**attempt * self.options_in_effect.init_scale
        jitter = self._init_rng.uniform(-size, size, size=mean.get_value().shape)
        mean.set_value((mean.get_value() + jitter).astype(mean.dtype))
        return "jittered", (
            f"the gradient of the log-density was not finite for {bad} at the initial point, "
            f"which every step of GF evaluates, so the fit started from it moved by up to "
            f"{size:.2g} in each coordinate"
        )

    def _narrow_start(self, factor: float) -> bool:
        for f in self.approx.shared_factors:
            f.set_value(f.get_value() * np.asarray(factor, dtype=f.dtype))
        return True

    @property
    def crawl_steps(self) -> int | None:
        """The crawl test's steps (:class:`~pymc_gpf.control.Stochastic`); none on
        minibatches, where the restart's MAP would be one minibatch's."""
        return None if self.target.minibatch else CRAWL_STEPS

    def _on_stop(self, reason: str, step_count: int) -> str | None:
        """The automatic fit starts again with sds from the curvature
        (:func:`~pymc_gpf.start.curvature_scales`; narrowed by :attr:`narrowing` above
        :data:`~pymc_gpf.start.MAX_CURVATURE_DIM`): after a stall (every draw batch reaching
        where the log-density is not finite) from its initial mean, after a crawl (natural
        steps cut short by the trust region, :class:`~pymc_gpf.control.Stochastic`) or a
        second stall from the MAP found from q's mean. A Gamma regression on a predictor in
        the hundreds, started 0.1 wide in its slope (posterior sd 1.5e-4), threw its mean
        1 500 sds out and stalled at every seed; a regression with flat priors and a
        response in the tens of thousands crawled, q 10^-5 wide in the noise scale's log
        where the posterior is 7.8 away (and at another seed stalled twice)."""
        if reason not in ("stalled", "crawling") or not self.fit_options.auto:
            return reason
        # 1: from the initial mean (a first stall); 2: from the MAP (a crawl, a second stall)
        restarted = 1 if reason == "stalled" and not self.control_state.restarted else 2
        if self.control_state.restarted >= restarted or (restarted == 2 and self.target.minibatch):
            return reason  # a MAP of one minibatch's log-density is no MAP
        centre, dtype = self._start_mean, self.target.dtype
        if restarted == 2:
            centre = self._map_from(self.approx.shared_mean.get_value())
        scale = self.options_in_effect.init_scale
        if len(centre) <= MAX_CURVATURE_DIM:
            step = HESSIAN_STEP[np.dtype(dtype).itemsize < 8]
            evaluate = self.approx.full_log_densities_and_gradients
            scale = curvature_scales(evaluate, centre.astype(float), scale, step)
        else:
            scale = scale * self.narrowing
        factors = initial_factors(self.structure, self.resolved.rank, scale, len(centre), dtype)
        self.approx.shared_mean.set_value(centre.astype(dtype))
        for shared, value in zip(self.approx.shared_factors, factors, strict=True):
            shared.set_value(value)
        self.revise_control(lambda state: self.control.init()._replace(restarted=restarted))
        return None

    def _map_from(self, mean: np.ndarray) -> np.ndarray:
        """PyMC's MAP found from ``mean``; ``mean`` where the search ends where the
        log-density is not finite."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the search's own warnings: the fit judges it
            found = find_map(self.target, mean.astype(float), None, seed=0, from_centre=True)
        log_p, _ = self.approx.full_log_densities_and_gradients(found[None, :])
        return found if np.isfinite(log_p[0]) else mean

    def _fitted_settings(self) -> dict:
        return {
            "ranks": [self.resolved.rank]
            if self.structure.low_rank
            else [f.shape[-1] for f in self.approx.factors],
            "draws_per_step": self.resolved_draws(self.fit_options),
            "structure": self.structure.describe(),
            "natural_mean": resolve_natural_mean(self.config.natural_mean, self.fit_options),
        }

    @property
    def _standardised_draws(self) -> bool:
        """Mean field in many dimensions: antithetic pairs standardised per coordinate
        (``O(S D)``, a bias of order ``1/S`` in moments of degree 4) rather than a random
        rotation (``O(D^3)`` per step)."""
        return self.structure.diagonal and self.target.ndim > MAX_ROTATION_DIM

    def _rule_shape(self) -> tuple[int, int, int]:
        """The automatic step's spherical-radial rules: ``(R, r, K)``, ``K`` the total rank
        of the factors (mean field: ``D``), ``R`` rules of ``r`` directions each."""
        rank, draws = sum(f.shape[-1] for f in self.approx.factors), self.config.draws_per_step
        if self.structure.low_rank:  # the loadings' columns (the scales' draws standardised)
            rank = self.resolved.rank
            if draws != AUTO:  # four points per pair of spokes: S / 4 pairs for S draws
                draws = -(-int(draws) // 2)
        if self.structure.hierarchical:  # a rule in the globals and one local
            rank = len(self.structure.blocks[0]) + 1
        pairs = draw_pairs(draws, rank)
        return (*flow.spherical_radial_shape(pairs, rank), rank)

    def resolved_draws(self, options: FitOptions | None) -> int:
        """Draws of q each step: ``draws_per_step``, or its automatic value."""
        if options is not None and options.auto:
            if self._standardised_draws:
                return 2 * standardised_pairs(self.config.draws_per_step)
            n_rules, r, _ = self._rule_shape()
            if self.structure.low_rank:  # four points per pair of spokes, two at the centre
                return 4 * n_rules * r + 2
            return 2 * n_rules * r + 1
        return 10 if self.config.draws_per_step == AUTO else int(self.config.draws_per_step)

    def _build_step(self, options: FitOptions) -> StepGraph:
        q = self.approx.state
        if not options.auto and (self.structure.hierarchical or self.structure.low_rank):
            raise ValueError(
                f"structure={self.structure.kind!r} takes GF's automatic step size (its "
                "natural flow keeps the factor of that shape); drop learning_rate=, or use "
                "structure='full'."
            )
        if not options.auto:
            # a dimension-wise optimiser shares its scale across a factor's K columns: an
            # affine preconditioner of Gamma's rows, as GPF shares it across particles
            transforms = (
                options.chain(),
                [options.chain(particle_axes=(1,) if f.ndim == 2 else ()) for f in q.factor],
            )
            natural_mean = resolve_natural_mean(self.config.natural_mean, options)
            static = step.GFStatic(
                self.structure, natural_mean, transforms, options.more_obj_params
            )
            init = step.init_fixed(values(q), static, self.target.dtype)
            moments = [(f.name, f.type.shape) for f in q.factor]
            state = share_init(
                init,
                q,
                {"mean_moments": ("gf_mean", q.mean.type.shape), "factor_moments": moments},
                self.noise_rng,
            )
            s, rng, noise = self.resolved_draws(options), state.rng, []
            for f in q.factor:  # each block's draws from the generator its last left
                rng, z = standard_normal(rng, (s, f.type.shape[-1]))
                noise.append(z)
            new, info = step.fixed_step(
                state, step.Noise(noise), self.target, self.learning_rates, static
            )
            return StepGraph(state, new._replace(rng=rng), info)
        resolve_natural_mean(self.config.natural_mean, options)  # refuses natural_mean=False here
        static = step.GFStatic(self.structure)
        init = step.init_natural(values(q), static, self.target.dtype)
        state = share_init(init, q, {"free_energy": "gf_free_energy"}, self.noise_rng)
        weights = None
        if self._standardised_draws:
            pairs = standardised_pairs(self.config.draws_per_step)
            rng, draws = standard_normal(state.rng, (pairs, self.target.ndim))
            noise = [flow.standardised_antithetic(draws)]
        elif self.structure.low_rank:
            n_rules, r, rank = self._rule_shape()
            size, groups = n_rules * (r + 1) * (rank + 2), n_rules * r + 1
            # one draw from the generator per step: directions, radii and the diagonal's draws
            rng, draws = standard_normal(state.rng, (size + groups * self.target.ndim,))
            rules = draws[:size].reshape((n_rules, r + 1, rank + 2))
            diagonal = draws[size:].reshape((groups, self.target.ndim))
            noise, weights = flow.low_rank_rule(rules[:, :r, :rank], rules[:, r], diagonal)
        elif self.structure.hierarchical:
            n_rules, r, rank = self._rule_shape()
            size, locals_ = n_rules * (r + 1) * (rank + 2), len(self.structure.blocks[1])
            # one draw from the generator per step: directions, radii and the locals' signs
            rng, draws = standard_normal(state.rng, (size + locals_,))
            rules = draws[:size].reshape((n_rules, r + 1, rank + 2))
            noise, weights = flow.hierarchical_rule(rules[:, :r, :rank], rules[:, r], draws[size:])
        else:
            n_rules, r, rank = self._rule_shape()
            # one draw from the generator per step: directions and radii are its columns
            rng, draws = standard_normal(state.rng, (n_rules, r + 1, rank + 2))
            points, weights = flow.spherical_radial(draws[:, :r, :rank], draws[:, r])
            ends = np.cumsum([f.type.shape[-1] for f in q.factor])
            noise = [
                points[:, end - f.type.shape[-1] : end]
                for f, end in zip(q.factor, ends, strict=True)
            ]
        new, info = step.natural_step(
            state,
            step.Noise(noise, weights),
            self.target,
            self.learning_rates,
            static,
        )
        return StepGraph(state, new._replace(rng=rng), info)


def model_locals(target, centre: np.ndarray) -> Structure | None:
    """The hierarchical structure of the model (:func:`pymc_gpf.structure.find_locals`),
    probed once per model (from ``centre``)."""
    return target.remember(
        "hierarchical",
        lambda: find_locals(
            target, lambda x: target.quick_gradient()(x), centre, np.random.default_rng(0)
        ),
    )


def arrow_points(q: GaussianQ, noise: np.ndarray, structure: Structure) -> np.ndarray:
    """``mu + Gamma z`` for standard normals ``noise`` ``(S, G + D_l)`` (globals' columns
    first) and the arrow factor of the hierarchical structure, ``O(S D G)``."""
    (g, loc), (lower, scales), coupling = structure.blocks, q.factors, q.coupling
    z_g, z_l = noise[:, : len(g)], noise[:, len(g) :]
    out = np.empty((len(noise), q.ndim), dtype=q.mean.dtype)
    out[:, g] = q.mean[g] + z_g @ lower.T
    out[:, loc] = q.mean[loc] + z_g @ coupling.T + z_l * scales
    return out


def fit_inside(
    gf: GF, n: int | None = None, options: FitOptions | None = None, **keywords
) -> GFApproximation:
    """Fit ``gf`` as a stage of another method's fit (GPF's continuation, WVGD's whitening,
    an ensemble's start): no progress bar of its own unless ``progressbar=True`` (inside
    the outer fit's loop, a line of its display) and no FitWarning of its own (the outer
    fit states the outcome), with the outer fit's ``tol``, ``backend`` and
    ``compile_kwargs`` (``options``) unless ``keywords`` say otherwise."""
    if options is not None:
        outer = {"tol": options.tol, "backend": options.backend}
        keywords = outer | {"compile_kwargs": options.compile_kwargs} | keywords
    keywords = {"progressbar": False} | keywords
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FitWarning)
        return gf.fit(n, **keywords)
