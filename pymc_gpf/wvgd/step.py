"""One WVGD step as a pure function of an explicit state (Ambrogioni et al. 2018, §5-8):
evaluate the cells (:func:`evaluate`), then move the particles and local Gaussians with the
fit's optimiser and fixed step sizes (:func:`fixed_step`, eq. 20-21) or by natural-gradient
moves inside a trust region (:func:`natural_step`, the automatic step size). The equations
are :mod:`pymc_gpf.wvgd.flow`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import pytensor.tensor as pt

from pytensor.graph.basic import Variable

from pymc_gpf.optimizers import Transform
from pymc_gpf.stepgraph import Info
from pymc_gpf.target import BatchedTarget
from pymc_gpf.wvgd import flow
from pymc_gpf.wvgd.mixture import EMPTY_LOG_MASS

__all__ = [
    "Cells",
    "FixedState",
    "NaturalState",
    "WVGDState",
    "WVGDStatic",
    "Whitened",
    "evaluate",
    "fixed_step",
    "init_fixed",
    "init_natural",
    "init_state",
    "natural_step",
    "whitened",
]

# trust region of the automatic step: a local mean moves at most 0.2 local sds per step and
# coordinate, a local sd changes by at most a factor e^0.1
MAX_MEAN_STEP, MAX_LOG_SCALE_STEP = 0.2, 0.1
MIN_ACCEPTANCE = 0.02  # below it a cell's local Gaussian is re-centred on its particle


class WVGDState(NamedTuple):
    """The particles ``z_j``, their local Gaussians ``N(m_j, diag(exp(2 log s_j)))`` (the
    fitted q), and the running importance-sampling estimates (exponentially weighted over
    steps): each cell's log posterior mass and its weight count, its accepted-draw rate, and
    its ELBO."""

    particles: Variable  # (J, D)
    local_means: Variable  # (J, D)
    local_log_scales: Variable  # (J, D)
    log_mass: Variable  # (J,)
    mass_count: Variable  # (J,)
    accepted_sum: Variable  # (J,)
    step_count: Variable  # ()
    cell_elbos: Variable  # (J,)
    # the coordinates everything above lives in: x = shift + u factor^T (Whitened)
    shift: Variable  # (D,)
    factor: Variable  # (D, D), or (0, D): the model's own coordinates
    log_det: Variable  # () log |det factor|


def init_state(particles: np.ndarray, local_scale: float, whiten: bool = False) -> WVGDState:
    """Local Gaussians centred on the particles with sd ``local_scale``; no estimates yet;
    the identity map, held as a ``(D, D)`` factor with ``whiten`` (to be set by the
    whitening fit), else an empty one."""
    j, d = particles.shape
    dtype = particles.dtype
    return WVGDState(
        particles,
        particles.copy(),
        np.full((j, d), np.log(local_scale), dtype=dtype),
        np.full(j, EMPTY_LOG_MASS, dtype=dtype),
        np.zeros(j, dtype=dtype),
        np.zeros(j, dtype=dtype),
        np.zeros((), dtype=dtype),
        np.zeros(j, dtype=dtype),
        np.zeros(d, dtype=dtype),
        np.eye(d if whiten else 0, d, dtype=dtype),
        np.zeros((), dtype=dtype),
    )


class Whitened(NamedTuple):
    """The target in the coordinates ``u`` of ``x = shift + factor u`` (a Gaussian fit's
    mean and Cholesky factor, so that a near-Gaussian posterior is near ``N(0, I)`` in
    ``u``): ``log p(x(u)) + log |det factor|`` and its gradient ``factor^T grad log p``."""

    target: BatchedTarget
    shift: Variable
    factor: Variable
    log_det: Variable

    @property
    def minibatch(self) -> bool:
        return self.target.minibatch

    def to_x(self, u: Variable) -> Variable:
        return self.shift + pt.dot(u, self.factor.T)

    def logp_and_grads(
        self, u: Variable, wrt: Sequence[Variable] = ()
    ) -> tuple[Variable, Variable, list[Variable]]:
        logp, grad, hyper = self.target.logp_and_grads(self.to_x(u), wrt)
        return logp + self.log_det, pt.dot(grad, self.factor), hyper


def whitened(target: BatchedTarget, state: WVGDState) -> BatchedTarget | Whitened:
    """``target`` seen in ``state``'s coordinates (itself where the factor is empty)."""
    if state.factor.type.shape[0] == 0:
        return target
    return Whitened(target, state.shift, state.factor, state.log_det)


class Cells(NamedTuple):
    """What one evaluation says about the cells: the draws' log-densities and gradients
    (flat, for diagnostics), which draws each cell accepted, the cell weights ``beta``, the
    free energy and the directions of the particles, local means and log-scales."""

    points: Variable  # (J M, D)
    logp: Variable  # (J, M)
    grad: Variable  # (J, M, D)
    accepted: Variable  # (J, M)
    has: Variable  # (J,) any accepted draw
    rate: Variable  # (J,) acceptance rate this step
    weights: Variable
    free_energy: Variable
    directions: tuple[Variable, Variable, Variable]


def evaluate(
    state: WVGDState, noise: Variable, m: int, target: BatchedTarget, decay: float
) -> tuple[WVGDState, Cells]:
    """Draw ``m_j + s_j * noise`` ``(J, M + K, D)``, evaluate the first ``M = m`` of each
    cell in one batched call, keep each cell's own (rejection sampling of ``q~_j``), and
    update the running estimates; the other ``K`` only steady the particles' centroids
    (:func:`flow.particle_direction`). Returns the state with its estimates updated
    (particles and local Gaussians unchanged) and the cells' statistics."""
    particles, means, log_scales = state.particles, state.local_means, state.local_log_scales
    j, d = particles.shape[0], target.ndim
    every = flow.local_draws(means, log_scales, noise)
    every_accepted = flow.accepted_draws(every, particles)
    # the control draws (none with one cell): the centroids' plain mean and the truncation
    # correction use them all, the log-density only the first m
    controls = every.type.shape[1] != m
    pooled = (every, every_accepted) if controls else None
    pooled_noise = (noise, every_accepted) if controls else None
    draws, accepted, noise = every[:, :m], every_accepted[:, :m], noise[:, :m]
    points = draws.reshape((j * m, d))
    seen = whitened(target, state)
    logp, grad_logp, _ = seen.logp_and_grads(points)
    logp, grad_logp = logp.reshape((j, m)), grad_logp.reshape((j, m, d))
    logq = flow.local_logq(log_scales, noise)
    has = pt.any(accepted, axis=1)
    log_mass, count = flow.running_log_mean(
        state.log_mass, state.mass_count, flow.cell_log_mass(logp, logq, accepted), has, decay
    )
    rate = pt.mean(pt.cast(accepted, logp.dtype), axis=1)
    elbos = pt.switch(has, flow.cell_elbos(logp, logq, accepted), state.cell_elbos)
    weights = flow.cell_weights(log_mass, count)
    estimated = state._replace(
        log_mass=log_mass,
        mass_count=count,
        accepted_sum=decay * state.accepted_sum + rate,
        step_count=decay * state.step_count + 1.0,
        cell_elbos=elbos,
    )
    d_means, d_log_scales = flow.local_gradients(
        grad_logp, noise, log_scales, accepted, pooled_noise
    )
    # with pm.Minibatch data log p is a noisy estimate, and exp of it a biased one: the
    # centroid then weights the cell's accepted draws equally (q~_j's own mean, the
    # "biased" centroid of the authors' code), which the local fit keeps consistent
    centroid_logp = logq if target.minibatch else logp
    d_particles = flow.particle_direction(particles, draws, centroid_logp, logq, accepted, pooled)
    # with no accepted draw in any cell the bound is stale and nothing can move
    # (e.g. local Gaussians thrown far off by a too-large step)
    free_energy = pt.switch(pt.any(has), -flow.mixture_elbo(elbos, weights), np.nan)
    if seen is not target:  # where the model was evaluated, for messages naming variables
        points = seen.to_x(points)
    cells = Cells(
        points, logp, grad_logp, accepted, has, rate, weights, free_energy,
        (d_particles, d_means, d_log_scales),
    )  # fmt: skip
    return estimated, cells


class FixedState(NamedTuple):
    """Eq. 20-21's state: the particles, local Gaussians and estimates, and the optimiser's
    state for the particles, the local means and the local log-scales."""

    q: WVGDState
    moments: tuple
    rng: Variable | None = None  # the generator of the noise (set by the method, not the step)


class NaturalState(NamedTuple):
    """The automatic step's state: ``q`` and the free energy of the last accepted step."""

    q: WVGDState
    free_energy: Variable
    rng: Variable | None = None  # the generator of the noise (set by the method, not the step)


def _info(cells: Cells, new: WVGDState, noise: Variable, free_energy: Variable, **more) -> Info:
    j, (m, d) = cells.grad.shape[0], noise.type.shape[1:]
    positions = flow.local_draws(new.local_means, new.local_log_scales, noise)
    if new.factor.type.shape[0] != 0:
        positions = new.shift + pt.dot(positions, new.factor.T)
    return Info(
        free_energy=free_energy,
        points=cells.points,
        logp=cells.logp.reshape((j * m,)),
        grad=cells.grad.reshape((j * m, d)),
        positions=positions.reshape((j * m, d)),
        **more,
    )


class WVGDStatic(NamedTuple):
    """What is fixed for the graph of a step: the running estimates' ``decay`` per step,
    (fixed step sizes) the optimisers of the particles, local means and local log-scales
    and the hyperparameters ``more_obj_params``, and how many of each cell's draws per step
    only steady its centroid (the last ``control_draws`` of the noise's)."""

    decay: float
    transforms: Sequence[Transform] = ()
    more_obj_params: Sequence[Variable] = ()
    control_draws: int = 0

    def evaluated(self, noise: Variable) -> int:
        """``M``: the draws per cell whose log-density a step evaluates."""
        return noise.type.shape[1] - self.control_draws


def init_fixed(q: WVGDState, static: WVGDStatic, dtype: str) -> FixedState:
    """The fixed step's initial state at q's arrays ``q``: the optimisers' own initial
    states (``static.transforms``) of the particles, local means and local log-scales."""
    fields = (q.particles, q.local_means, q.local_log_scales)
    moments = tuple(t.init(np.shape(v)) for t, v in zip(static.transforms, fields, strict=True))
    return FixedState(q, moments)


def init_natural(q: WVGDState, static: WVGDStatic, dtype: str) -> NaturalState:
    """The automatic step's initial state at q's arrays ``q``: no step accepted yet (the
    recorded free energy infinite)."""
    return NaturalState(q, np.asarray(np.inf, dtype=dtype))


def fixed_step(
    state: FixedState,
    noise: Variable,
    target: BatchedTarget,
    rates: tuple[Variable, Variable],
    static: WVGDStatic,
) -> tuple[FixedState, Info]:
    """Eq. 20-21 with the optimisers ``static.transforms`` (of the particles, local means
    and local log-scales; dimension-wise Adam by default) and the fixed step sizes ``rates =
    (eta1, eta2)`` of the particles and the local Gaussians, from the local draws of
    ``noise`` ``(J, M + K, D)`` (:func:`evaluate`); a cell without accepted draws keeps its
    particle and local Gaussian this step. The free energy is the mixture's at the state
    before the step."""
    decay, transforms, more_obj_params, _ = static
    m = static.evaluated(noise)
    estimated, cells = evaluate(state.q, noise, m, target, decay)
    eta1, eta2 = rates
    moved, moments = [], []
    fields = (estimated.particles, estimated.local_means, estimated.local_log_scales)
    parts = zip(
        fields, cells.directions, (eta1, eta2, eta2), transforms, state.moments, strict=True
    )
    for var, direction, eta, transform, opt_state in parts:
        direction, opt_state = transform.update(direction, opt_state)
        moments.append(opt_state)
        moved.append(pt.switch(cells.has[:, None], var - eta * direction, var))
    new = estimated._replace(particles=moved[0], local_means=moved[1], local_log_scales=moved[2])
    hyper = flow.hyper_grads(cells.logp, cells.accepted, cells.weights, more_obj_params)
    info = _info(cells, new, noise[:, :m], cells.free_energy, hyper_grads=tuple(hyper))
    return FixedState(new, tuple(moments)), info


def natural_step(
    state: NaturalState,
    noise: Variable,
    target: BatchedTarget,
    rates: tuple[Variable, Variable],
    static: WVGDStatic,
) -> tuple[NaturalState, Info]:
    """Natural-gradient moves (the automatic step size) from the local draws of ``noise``
    ``(J, M + K, D)``: each particle moves a fraction ``eta`` of the way to its cell's centroid
    (a damped Lloyd step, eq. 20), each local
    Gaussian ``N(m, s^2)`` by its Fisher-preconditioned gradient ``(s^2 d_m, d_log_s / 2)``
    scaled by the cell's acceptance rate (few accepted draws: a poor estimate) and capped
    per coordinate at 0.2 local sds for the mean and a factor ``e^0.1`` for the scale; a
    local Gaussian that accepts under 2 % of its draws is re-centred on its particle.
    The base step ``rates[0]`` comes from :class:`pymc_gpf.control.Stochastic`. A non-finite
    step is refused (the whole state and the recorded free energy kept; the schedule then
    shrinks the step)."""
    natural, decay, step = state, static.decay, rates[0]
    state = natural.q
    m = static.evaluated(noise)
    estimated, cells = evaluate(state, noise, m, target, decay)
    particles, means, log_scales = state.particles, state.local_means, state.local_log_scales
    d_particles, d_means, d_log_scales = cells.directions
    acceptance = cells.rate
    scale = pt.exp(log_scales)
    local_step = step * acceptance[:, None]
    mean_step = local_step * pt.square(scale) * d_means
    mean_step = mean_step / pt.maximum(1.0, pt.abs(mean_step) / (MAX_MEAN_STEP * scale))
    scale_step = pt.clip(0.5 * local_step * d_log_scales, -MAX_LOG_SCALE_STEP, MAX_LOG_SCALE_STEP)
    # a local Gaussian whose draws almost all land in other cells (the cells moved)
    # cannot improve from its own draws: it starts again on its particle
    orphan = (acceptance < MIN_ACCEPTANCE)[:, None]
    moves = (
        particles - 0.5 * pt.minimum(step, 1.0) * d_particles,
        pt.switch(orphan, particles, means - mean_step),
        log_scales - scale_step,
    )
    accepted = pt.any(cells.has) & pt.isfinite(cells.free_energy)
    for new in moves:
        accepted = accepted & pt.all(pt.isfinite(new))
    kept = [pt.switch(accepted, new, old) for new, old in zip(estimated, state, strict=True)]
    has = cells.has[:, None]
    for i, (new, movable) in enumerate(zip(moves, (has, has | orphan, has), strict=True)):
        kept[i] = pt.switch(accepted & movable, new, state[i])
    new = NaturalState(
        WVGDState(*kept), pt.switch(accepted, cells.free_energy, natural.free_energy)
    )
    info = _info(cells, new.q, noise[:, :m], new.free_energy, accepted=accepted, step_size=step)
    return new, info
