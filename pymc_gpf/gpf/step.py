"""One GPF step as a pure function of an explicit state: the paper's fixed-step update
(Algorithm 2, eq. 13) and the automatic natural step (:func:`pymc_gpf.gpf.flow.natural_flow`
with a backtracking line search on full data, a trust region on minibatches).

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

The states are ``NamedTuple`` s of arrays (NumPy to start, symbolic inside the step); the
method holds them in shared variables named after their fields
(:func:`pymc_gpf.stepgraph.share`).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import NamedTuple

import numpy as np
import pytensor.tensor as pt

from pytensor.graph.basic import Variable
from pytensor.ifelse import ifelse

from pymc_gpf.clouds import matching_cloud
from pymc_gpf.control import NEAR
from pymc_gpf.gpf import flow
from pymc_gpf.optimizers import Transform
from pymc_gpf.stepgraph import Info, keep_if
from pymc_gpf.stepsize import Backtracking, accept_trial, cap, next_step_size
from pymc_gpf.structure import Structure
from pymc_gpf.target import BatchedTarget

__all__ = [
    "AutoState",
    "FixedState",
    "GPFStatic",
    "NaturalState",
    "SearchState",
    "fixed_step",
    "init_fixed",
    "init_natural",
    "natural_step",
]

BACKTRACKING = Backtracking()
# trust region of the stochastic (minibatch) natural step, in units of q's spread
MAX_MEAN_STEP, MAX_SCALE_STEP = 1.0, 0.5
# the independent cloud is evaluated on every FAR_VALIDATION-th accepted step since it last
# improved far from the fixed point (decrement >= NEAR), where only a stall of
# Deterministic.far_patience (50) steps ends a fit, and on every NEAR_VALIDATION-th near it
# (patience 10): an improvement is seen at most 4 resp. 1 steps late. On a logistic
# regression (D = 26, 24 steps, 14 of them far) the cloud had 1248 of the fit's 2508
# log-density evaluations, and a step that evaluated it took 1.7 times as long
FAR_VALIDATION = 5
NEAR_VALIDATION = 2


class NaturalState(NamedTuple):
    """The natural flow at the particles, computed by the previous step (the next step
    moves along it): nothing evaluated yet is ``free_energy = inf``."""

    shift: Variable  # (D,) C g_bar
    linear: Variable  # (N, D) C g^_i - z_i
    free_energy: Variable
    decrement_mean: Variable
    decrement_cov: Variable


class SearchState(NamedTuple):
    """The line search (full data) and the early stop on an independent cloud of the same
    Gaussian (finite-N bias): its weights on the particles' deviations, its free energy,
    and the best state it has seen."""

    step_size: Variable
    validation_weights: Variable  # (2 rank, N)
    validation_free_energy: Variable
    best_particles: Variable
    best_validation: Variable
    best_free_energy: Variable
    since_best: Variable  # accepted steps since the independent free energy last improved


def block_ranks(particles: np.ndarray, structure: Structure) -> list[int]:
    """Directions the cloud spans in each block (static for the compiled step: every
    affine step preserves them)."""
    z = particles - particles.mean(axis=0)
    blocks = [np.arange(z.shape[1])] if structure.diagonal else structure.blocks
    ranks = []
    for b in blocks:
        s = np.linalg.svd(z[:, b], compute_uv=False)
        tol = s[0] * max(z.shape) * np.finfo(z.dtype).eps if len(s) else 0.0
        ranks.append(int(np.sum(s > tol)))
    return ranks


def _validation(search: SearchState, accepted, trial, centred, free_energy, natural, logp, ndim):
    """Track the free energy of the independent cloud: the best state, and the accepted
    steps since it last improved; also the points evaluated (none when not due, see
    :data:`FAR_VALIDATION`)."""
    mean, deviations = centred
    validation_points = mean + pt.dot(search.validation_weights, deviations)
    every = pt.switch(natural.decrement < NEAR, NEAR_VALIDATION, FAR_VALIDATION)
    due = accepted & (pt.eq((search.since_best + 1) % every, 0) | pt.isinf(search.best_validation))
    # lazy on the log-densities (the scalar fused with the condition would be computed
    # whether or not the step is due): a step that is not due evaluates no point of the cloud
    cloud_logp = ifelse(due, logp(validation_points), pt.zeros_like(validation_points[:, 0]))
    validation = flow.natural_free_energy(cloud_logp, natural.log_pdet, ndim)
    validation = pt.switch(
        due, pt.switch(pt.isfinite(validation), validation, np.inf), search.validation_free_energy
    )
    improved = due & (validation < search.best_validation)
    since = pt.switch(
        improved, 0.0, pt.switch(accepted, search.since_best + 1.0, search.since_best)
    )
    step = search.step_size
    new = SearchState(
        next_step_size(step, accepted, BACKTRACKING).astype(step.dtype),
        # unchanged by the step, but part of the state a saved fit must restore
        search.validation_weights,
        validation,
        pt.switch(improved, trial, search.best_particles),
        pt.switch(improved, validation, search.best_validation),
        pt.switch(improved, free_energy, search.best_free_energy),
        since.astype(step.dtype),
    )
    extra = (
        ("since_best", since),
        ("validation", validation),
        ("best_validation", new.best_validation),
    )
    return new, extra, due * search.validation_weights.shape[0]


class AutoState(NamedTuple):
    """The automatic step's state: the particles, the flow at them and (full data) the
    line search's."""

    particles: Variable
    natural: NaturalState
    search: SearchState | None


class FixedState(NamedTuple):
    """Algorithm 2's state: the particles and the optimiser's state of each flow term."""

    particles: Variable
    shift_moments: tuple
    linear_moments: tuple


class GPFStatic(NamedTuple):
    """What is fixed for the graph of a step: the structure, and the directions the cloud
    spans in each block (:func:`block_ranks`; the automatic step), or (fixed step sizes) the
    particles' ``shape`` ``(N, D)``, whether the mean's step is natural, the optimisers (of
    the mean shift, of the linear term) and the hyperparameters ``more_obj_params``."""

    structure: Structure
    ranks: Sequence[int] = ()
    shape: tuple[int, int] | None = None
    natural_mean: bool = True
    transforms: tuple[Transform, Transform] | None = None
    more_obj_params: Sequence[Variable] = ()


def init_fixed(particles: np.ndarray, static: GPFStatic, dtype: str) -> FixedState:
    """Algorithm 2's initial state at ``particles``: the optimisers' own initial states
    (``static.transforms``) of the shift ``(D,)`` and of the linear map ``(N, D)``."""
    shape = np.shape(particles)
    shift, linear = static.transforms
    return FixedState(particles, shift.init(shape[1:]), linear.init(shape))


def init_natural(
    particles: np.ndarray, static: GPFStatic, dtype: str, rng: np.random.Generator | None = None
) -> AutoState:
    """The automatic step's state at ``particles``, nothing evaluated yet (the first call
    evaluates them, at step size 0); with ``rng`` (full data) the line search's, its
    independent cloud drawn from ``rng`` (else ``search`` is ``None``)."""
    n, d = particles.shape
    inf = np.asarray(np.inf, dtype=dtype)
    zero = np.zeros((), dtype=dtype)
    natural = NaturalState(np.zeros(d, dtype=dtype), np.zeros((n, d), dtype=dtype), inf, zero, zero)
    if rng is None:
        return AutoState(particles, natural, None)
    z = particles - particles.mean(axis=0)
    structure = static.structure
    rank = int(np.sum(block_ranks(particles, structure))) if not structure.diagonal else d
    weights = matching_cloud(z, 2 * max(rank, 1), rng)
    search = SearchState(zero, weights.astype(dtype), inf, particles.copy(), inf, inf, zero)
    return AutoState(particles, natural, search)


def natural_step(
    state: AutoState,
    noise: None,
    target: BatchedTarget,
    rates: tuple[Variable, Variable],
    static: GPFStatic,
) -> tuple[AutoState, Info]:
    """Move the particles along the flow of the previous step, then evaluate the flow at
    the trial (no noise: the particles are a fixed cubature rule). With a line search the
    step size comes from backtracking (Armijo on the free energy); without, ``rates[0]``
    (the controller's) capped to a trust region in units of q's spread. A refused trial
    keeps the whole state."""
    particles, state, search = state  # the flow at the particles: a NaturalState
    base_step, structure, ranks = rates[0], static.structure, list(static.ranks)
    d = target.ndim
    if search is not None:
        step = search.step_size
        eta_mean, eta_linear = step, 0.5 * step
    else:
        step = base_step
        eta_mean = cap(step, pt.sqrt(state.decrement_mean), MAX_MEAN_STEP)
        eta_linear = cap(0.5 * step, pt.sqrt(state.decrement_cov), MAX_SCALE_STEP)
    trial = particles - eta_mean * state.shift[None, :] - eta_linear * state.linear
    logp, grad_logp, _ = target.logp_and_grads(trial)
    mean, deviations = flow.centre(trial)
    natural = flow.natural_flow(deviations, -grad_logp, structure, ranks)
    free_energy = flow.natural_free_energy(logp, natural.log_pdet, d)
    finite = (
        pt.isfinite(free_energy)
        & pt.all(pt.isfinite(grad_logp))
        & pt.isfinite(natural.decrement)
        & pt.all(pt.isfinite(natural.linear))
    )
    if search is not None:
        slope = state.decrement_mean + 0.5 * state.decrement_cov
        accepted = accept_trial(free_energy, state.free_energy, step, slope, finite, BACKTRACKING)
    else:
        accepted = finite

    keep = partial(keep_if, accepted)
    new_state = NaturalState(
        keep(natural.shift, state.shift),
        keep(natural.linear, state.linear),
        keep(free_energy, state.free_energy),
        keep(natural.decrement_mean, state.decrement_mean),
        keep(natural.decrement_cov, state.decrement_cov),
    )
    decrement = keep(natural.decrement, state.decrement_mean + state.decrement_cov)
    extra, densities = (), 0
    if search is not None:
        search, extra, densities = _validation(
            search, accepted, trial, (mean, deviations), free_energy, natural, target.logp, d
        )
    moved = keep(trial, particles)
    info = Info(
        free_energy=new_state.free_energy,
        points=trial,
        logp=logp,
        grad=grad_logp,
        positions=moved,
        accepted=accepted,
        step_size=step if search is not None else eta_mean,
        decrement=decrement,
        extra=extra,
        densities=densities,
    )
    return AutoState(moved, new_state, search), info


def fixed_step(
    state: FixedState,
    noise: None,
    target: BatchedTarget,
    rates: tuple[Variable, Variable],
    static: GPFStatic,
) -> tuple[FixedState, Info]:
    """Algorithm 2: eq. 13 with fixed step sizes ``rates`` ``(eta1, eta2)`` and the
    optimisers ``static.transforms`` (of the mean shift, of the linear term) for
    ``static.shape`` ``(N, D)`` particles (no noise); the free energy (App. D) at the
    particles before the step."""
    structure, _, shape, natural_mean, transforms, more_obj_params = static
    particles = pt.specify_shape(state.particles, shape)
    logp, grad_logp, hyper = target.logp_and_grads(particles, more_obj_params)
    grads = -grad_logp
    _, deviations = flow.centre(particles)
    shift = flow.mean_shift(deviations, grads, structure, natural_mean)
    linear = flow.linear_flow(deviations, grads, structure)
    shift, shift_moments = transforms[0].update(shift, state.shift_moments)
    linear, linear_moments = transforms[1].update(linear, state.linear_moments)
    eta1, eta2 = rates
    new = (particles - eta1 * shift - eta2 * linear).astype(particles.dtype)
    return FixedState(new, shift_moments, linear_moments), Info(
        free_energy=flow.free_energy(logp, deviations, structure),
        points=particles,
        logp=logp,
        grad=grad_logp,
        positions=new,
        hyper_grads=tuple(-h / shape[0] for h in hyper),
    )
