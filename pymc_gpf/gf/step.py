"""One GF step as a pure function of its parameters: eq. 11 with fixed step sizes, and the
automatic natural step (spherical-radial draws, natural-gradient directions inside a
trust region, :func:`pymc_gpf.gf.flow.natural_directions`).

At the automatic step size (the default) each step evaluates the points of a fresh
stochastic spherical-radial rule (:func:`pymc_gpf.gf.flow.spherical_radial`: exact to
degree 3, unbiased for every function), takes natural-gradient steps inside a trust region
(the mean moves at most ``sqrt(K)`` of q's sds and, in each coordinate, no further than
the draws reached; the spread changes by at most 50 %) and the
step size follows :class:`pymc_gpf.control.Stochastic`: halved when the free energy stops
falling, the fit ending on the average of its iterates at a step of at most 1/2 once that is
precise to ``tol`` sds and agrees with the average at twice the step. Fresh draws every step
mean the fit cannot adapt itself to particular points, so GF has no finite-N bias of GPF's
kind. Plain descent on ``Gamma`` (fixed steps) is stable for
``eta2 < 2 / kappa`` (``kappa`` the condition number of the posterior covariance); the
iterates fluctuate around the fixed point with a spread of order ``sqrt(eta / S)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import NamedTuple

import numpy as np
import pytensor.tensor as pt

from pytensor.graph.basic import Variable

from pymc_gpf.gf import flow
from pymc_gpf.optimizers import Transform
from pymc_gpf.stepgraph import Info, keep_if
from pymc_gpf.stepsize import cap
from pymc_gpf.structure import Structure
from pymc_gpf.target import BatchedTarget

__all__ = [
    "FixedState",
    "GFState",
    "GFStatic",
    "NaturalState",
    "Noise",
    "fixed_step",
    "init_fixed",
    "init_natural",
    "natural_step",
]

MAX_SCALE_STEP = 0.5  # trust region: one step scales q's spread by at most 1 +- this


class GFState(NamedTuple):
    """``q = N(mu, Gamma Gamma^T)``: the mean ``(D,)`` and one factor per block of the
    structure, ``(D_b, K_b)`` (mean field: one vector of scales ``(D,)``)."""

    mean: Variable
    factor: tuple[Variable, ...]


class FixedState(NamedTuple):
    """Eq. 11's state: q and the optimiser's state of its mean and of each factor."""

    q: GFState
    mean_moments: tuple
    factor_moments: tuple
    rng: Variable | None = None  # the generator of the noise (set by the method, not the step)


class NaturalState(NamedTuple):
    """The automatic step's state: q and the free energy of the last accepted step."""

    q: GFState
    free_energy: Variable
    rng: Variable | None = None  # the generator of the noise (set by the method, not the step)


class Noise(NamedTuple):
    """A step's random input: standard normal draws ``z``, one array ``(S, K_b)`` per block
    of the factor, and the weights of the quadrature rule they form (``None``: equal)."""

    z: Sequence[Variable]
    weights: Variable | None = None


class GFStatic(NamedTuple):
    """What is fixed for the graph of a step: the structure of q, and (fixed step sizes)
    whether the mean's step is natural, the optimisers ``(of the mean, of each factor)`` and
    the hyperparameters ``more_obj_params`` descended with q."""

    structure: Structure
    natural_mean: bool = True
    transforms: tuple[Transform, Sequence[Transform]] | None = None
    more_obj_params: Sequence[Variable] = ()


def init_fixed(q: GFState, static: GFStatic, dtype: str) -> FixedState:
    """Eq. 11's initial state at q's current arrays ``q``: the optimisers' own initial
    states (``static.transforms``) of the mean and of each factor."""
    mean_transform, factor_transforms = static.transforms
    return FixedState(
        q,
        mean_transform.init(np.shape(q.mean)),
        tuple(t.init(np.shape(f)) for t, f in zip(factor_transforms, q.factor, strict=True)),
    )


def init_natural(q: GFState, static: GFStatic, dtype: str) -> NaturalState:
    """The automatic step's initial state at q's arrays ``q``: no step accepted yet (the
    recorded free energy infinite)."""
    return NaturalState(q, np.asarray(np.inf, dtype=dtype))


def fixed_step(
    state: FixedState,
    noise: Noise,
    target: BatchedTarget,
    rates: tuple[Variable, Variable],
    static: GFStatic,
) -> tuple[FixedState, Info]:
    """Eq. 11 with fixed ``rates`` ``(eta1, eta2)`` and the optimisers ``static.transforms``
    (of the mean, of each factor), from the draws ``mu + Gamma z`` of ``noise.z`` (equal
    weights); the free energy at the parameters before the step."""
    structure, natural_mean, transforms, more_obj_params = static
    noise = list(noise.z)
    mean, factors = state.q.mean, list(state.q.factor)
    deviations = flow.deviations(factors, noise, structure)
    points = mean + deviations
    logp, grad_logp, hyper = target.logp_and_grads(points, more_obj_params)
    grads = -grad_logp
    eta1, eta2 = rates
    mean_transform, factor_transforms = transforms
    shift = flow.mean_direction(grads, factors, structure, natural_mean)
    shift, mean_moments = mean_transform.update(shift, state.mean_moments)
    new_mean = (mean - eta1 * shift).astype(mean.dtype)
    new_factors, factor_moments = [], []
    directions = flow.factor_directions(grads, deviations, factors, structure)
    parts = zip(factors, directions, factor_transforms, state.factor_moments, strict=True)
    for f, direction, transform, moments in parts:
        direction, moments = transform.update(direction, moments)
        new_factors.append((f - eta2 * direction).astype(f.dtype))
        factor_moments.append(moments)
    new = FixedState(GFState(new_mean, tuple(new_factors)), mean_moments, tuple(factor_moments))
    draws = noise[0].shape[0]
    return new, Info(
        free_energy=flow.free_energy(logp, factors, structure),
        points=points,
        logp=logp,
        grad=grad_logp,
        positions=new_mean + flow.deviations(new_factors, noise, structure),
        hyper_grads=tuple(-h / draws for h in hyper),
    )


def natural_step(
    state: NaturalState,
    noise: Noise,
    target: BatchedTarget,
    rates: tuple[Variable, Variable],
    static: GFStatic,
) -> tuple[NaturalState, Info]:
    """Natural-gradient steps from the draws of a quadrature rule ``noise`` (its weights
    default to equal), at the controller's base step ``rates[0]``: the mean moves at most
    ``sqrt(K)`` of q's sds, and in no coordinate further than the draws reached, the spread
    changes by at most :data:`MAX_SCALE_STEP`; a non-finite step is refused (q and the
    recorded free energy kept)."""
    structure, base_step = static.structure, rates[0]
    noise, weights = list(noise.z), noise.weights
    mean, factors = state.q.mean, list(state.q.factor)
    deviations = flow.deviations(factors, noise, structure)
    points = mean + deviations
    logp, grad_logp, _ = target.logp_and_grads(points)
    free_energy = flow.free_energy(logp, factors, structure, weights)
    shift, directions, dec_mean, dec_cov, spectral = flow.natural_directions(
        -grad_logp, noise, factors, structure, weights
    )
    rank = sum(f.type.shape[-1] for f in factors)
    eta_mean = cap(base_step, pt.sqrt(dec_mean), float(np.sqrt(rank)))
    # nor, in any coordinate, further than the draws reached: what lies beyond, this step
    # has not seen (without it, the log of a hierarchical scale whose q was far wider than
    # the posterior jumped 90 sds, into a flat neck where the fit stalled)
    reach = pt.max(pt.abs(deviations), axis=0)
    eta_mean = pt.minimum(eta_mean, pt.min(reach / pt.maximum(pt.abs(shift), 1e-300)))
    eta_factor = cap(0.5 * base_step, spectral, MAX_SCALE_STEP)
    new_mean = mean - eta_mean * shift
    new_factors = [f - eta_factor * d for f, d in zip(factors, directions, strict=True)]
    accepted = pt.isfinite(free_energy) & pt.all(pt.isfinite(new_mean))
    for f in new_factors:
        accepted = accepted & pt.all(pt.isfinite(f))
    keep = partial(keep_if, accepted)
    q = GFState(
        keep(new_mean, mean),
        tuple(keep(nf, f) for f, nf in zip(factors, new_factors, strict=True)),
    )
    new = NaturalState(q, keep(free_energy, state.free_energy))
    return new, Info(
        free_energy=new.free_energy,
        points=points,
        logp=logp,
        grad=grad_logp,
        positions=q.mean + flow.deviations(list(q.factor), noise, structure),
        accepted=accepted,
        step_size=eta_mean,
        decrement=dec_mean + dec_cov,
    )
