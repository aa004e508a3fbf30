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

from typing import NamedTuple

import numpy as np
import pytensor.tensor as pt

from pytensor.graph.basic import Variable

from pymc_gpf.clouds import matching_cloud
from pymc_gpf.gpf import flow
from pymc_gpf.options import FitOptions, resolve_natural_mean
from pymc_gpf.stepgraph import StepGraph, assign, share, transform_direction, updates
from pymc_gpf.stepsize import Backtracking, accept_trial, cap, next_step_size
from pymc_gpf.structure import Structure
from pymc_gpf.target import BatchedTarget

__all__ = [
    "AutoStep",
    "NaturalState",
    "SearchState",
    "build",
    "fixed_step",
    "init_natural",
    "natural_step",
]

BACKTRACKING = Backtracking()
# trust region of the stochastic (minibatch) natural step, in units of q's spread
MAX_MEAN_STEP, MAX_SCALE_STEP = 1.0, 0.5


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


def init_natural(
    particles: np.ndarray, structure: Structure, rng: np.random.Generator | None
) -> tuple[NaturalState, SearchState | None]:
    """The states of the automatic step at ``particles``, nothing evaluated yet (the first
    call evaluates them, at step size 0); with ``rng`` (full data) the line search's, its
    independent cloud drawn from ``rng``."""
    n, d = particles.shape
    dtype = particles.dtype
    inf = np.asarray(np.inf, dtype=dtype)
    zero = np.zeros((), dtype=dtype)
    natural = NaturalState(np.zeros(d, dtype=dtype), np.zeros((n, d), dtype=dtype), inf, zero, zero)
    if rng is None:
        return natural, None
    z = particles - particles.mean(axis=0)
    rank = int(np.sum(block_ranks(particles, structure))) if not structure.diagonal else d
    weights = matching_cloud(z, 2 * max(rank, 1), rng)
    search = SearchState(zero, weights.astype(dtype), inf, particles.copy(), inf, inf, zero)
    return natural, search


def _validation(search: SearchState, accepted, trial, centred, free_energy, natural, logp, ndim):
    """Track the free energy of the independent cloud: the best state, and the accepted
    steps since it last improved."""
    mean, deviations = centred
    validation_points = mean + pt.dot(search.validation_weights, deviations)
    validation = flow.natural_free_energy(logp(validation_points), natural.log_pdet, ndim)
    validation = pt.switch(pt.isfinite(validation), validation, np.inf)
    improved = accepted & (validation < search.best_validation)
    since = pt.switch(
        improved, 0.0, pt.switch(accepted, search.since_best + 1.0, search.since_best)
    )
    step = search.step_size
    new = SearchState(
        next_step_size(step, accepted, BACKTRACKING).astype(step.dtype),
        # unchanged by the step, but part of the state a saved fit must restore
        search.validation_weights,
        pt.switch(accepted, validation, search.validation_free_energy),
        pt.switch(improved, trial, search.best_particles),
        pt.switch(improved, validation, search.best_validation),
        pt.switch(improved, free_energy, search.best_free_energy),
        since.astype(step.dtype),
    )
    info = {
        "step_size": step,
        "since_best": since,
        "validation": validation,
        "best_validation": new.best_validation,
    }
    return new, info


def natural_step(
    particles: Variable,
    state: NaturalState,
    search: SearchState | None,
    base_step: Variable,
    target: BatchedTarget,
    structure: Structure,
    ranks: list[int],
) -> tuple[Variable, NaturalState, SearchState | None, dict[str, Variable], tuple]:
    """Move the particles along the flow of the previous step, then evaluate the flow at
    the trial. With ``search`` the step size comes from backtracking (Armijo on the free
    energy); without, ``base_step`` (the controller's) capped to a trust region in units
    of q's spread. A refused trial keeps every state. Returns the new particles and
    states, the step's ``info`` and the evaluation ``(points, logp, grad)``."""
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

    def keep(new, old):
        return pt.switch(accepted, new, old).astype(old.dtype)

    new_state = NaturalState(
        keep(natural.shift, state.shift),
        keep(natural.linear, state.linear),
        keep(free_energy, state.free_energy),
        keep(natural.decrement_mean, state.decrement_mean),
        keep(natural.decrement_cov, state.decrement_cov),
    )
    decrement = keep(natural.decrement, state.decrement_mean + state.decrement_cov)
    info = {"accepted": accepted, "decrement": decrement}
    if search is not None:
        search, more = _validation(
            search, accepted, trial, (mean, deviations), free_energy, natural, target.logp, d
        )
        info |= more
    else:
        info |= {"step_size": eta_mean}
    return keep(trial, particles), new_state, search, info, (trial, logp, grad_logp)


def fixed_step(
    shared: Variable,
    target: BatchedTarget,
    structure: Structure,
    natural_mean: bool,
    options: FitOptions,
    rates: tuple[Variable, Variable],
) -> StepGraph:
    """Algorithm 2: eq. 13 with fixed step sizes ``(eta1, eta2)`` and the fit's optimiser;
    the free energy (App. D) at the particles before the step."""
    n, d = shared.get_value(borrow=True).shape
    particles = pt.specify_shape(shared, (n, d))
    logp, grad_logp, hyper = target.logp_and_grads(particles, options.more_obj_params)
    grads = -grad_logp
    _, deviations = flow.centre(particles)
    shift = flow.mean_shift(deviations, grads, structure, natural_mean)
    linear = flow.linear_flow(deviations, grads, structure)
    shift, up_shift = transform_direction(options.chain(), shift, (d,), "gpf_shift")
    linear, up_linear = transform_direction(
        options.chain(particle_axes=(0,)), linear, (n, d), "gpf_linear"
    )
    eta1, eta2 = rates
    new = (particles - eta1 * shift - eta2 * linear).astype(shared.dtype)
    return StepGraph(
        free_energy=flow.free_energy(logp, deviations, structure),
        points=particles,
        logp=logp,
        grad=grad_logp,
        positions=new,
        updates={shared: new, **up_shift, **up_linear},
        hyper_grads=[-h / n for h in hyper],
    )


class AutoStep:
    """The automatic step's states held in shared variables named ``gpf_<field>`` (the
    number of particles may change between stages: that dimension stays dynamic)."""

    def __init__(self, particles, structure: Structure, rng: np.random.Generator | None):
        self.particles, self.structure, self.rng = particles, structure, rng
        natural, search = init_natural(particles.get_value(), structure, rng)
        d = natural.shift.shape[0]

        def shape(name, value):
            if name == "validation_weights":
                return (None, None)
            return ((None, d), (d,), ())[2 - value.ndim]

        self.natural = share(natural, "gpf", shape)
        self.search = None if search is None else share(search, "gpf", shape)

    def graph(self, base_step: Variable, target: BatchedTarget) -> StepGraph:
        """The step from the current states (see :func:`natural_step`)."""
        ranks = block_ranks(self.particles.get_value(), self.structure)
        moved, natural, search, info, (points, logp, grad) = natural_step(
            self.particles, self.natural, self.search, base_step, target, self.structure, ranks
        )
        new = {self.particles: moved, **updates(self.natural, natural)}
        if search is not None:
            new |= updates(self.search, search)
        return StepGraph(
            natural.free_energy, points, logp, grad, moved, new, info=info, guarded=False
        )

    def validation_draws(self) -> int:
        """Points of the independent cloud, evaluated (without gradient) every step."""
        return self.search.validation_weights.get_value(borrow=True).shape[0]

    def finish(self, restore_best: bool) -> float:
        """The free energy of the state the fit ends on; with ``restore_best`` the particles
        go back to where the independent cloud's free energy was lowest."""
        if not restore_best:
            return float(self.natural.free_energy.get_value())
        self.particles.set_value(self.search.best_particles.get_value())
        best = float(self.search.best_free_energy.get_value())
        self.reset()
        return best

    def restart(self, particles: np.ndarray) -> None:
        """Go on from new particles (e.g. more of them, same Gaussian)."""
        self.particles.set_value(particles)
        self.reset()

    def reset(self) -> None:
        """Nothing evaluated at the current particles (after they were set from outside)."""
        natural, search = init_natural(self.particles.get_value(), self.structure, self.rng)
        assign(self.natural, natural)
        if search is not None:
            assign(self.search, search)


def build(
    particles,
    target: BatchedTarget,
    structure: Structure,
    natural_mean: bool | None,
    options: FitOptions,
    rates: tuple[Variable, Variable],
    rng: np.random.Generator | None,
) -> tuple[StepGraph, AutoStep | None]:
    """The step for the fit keywords ``options``: Algorithm 2 with a fixed ``learning_rate``
    (the mean step natural if ``natural_mean``), else the automatic step, whose states it
    returns too (with ``rng`` the line search's)."""
    if not options.auto:
        natural = resolve_natural_mean(natural_mean, options)
        return fixed_step(particles, target, structure, natural, options, rates), None
    if natural_mean is False:
        raise ValueError(
            "natural_mean=False needs a fixed learning_rate: the automatic step size "
            "uses the natural flow, whose mean step is C g_bar. Drop natural_mean or "
            "pass e.g. learning_rate=1e-3."
        )
    auto = AutoStep(particles, structure, rng)
    return auto.graph(rates[0], target), auto
