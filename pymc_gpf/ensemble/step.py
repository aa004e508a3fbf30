"""One ensemble step as a pure function of an explicit state (:mod:`pymc_gpf.ensemble.flow`).

* **Deep ensemble** (``lambda1 = lambda2 = 0``): every particle climbs ``log p`` by gradient
  steps with its own backtracking step size (Armijo, as :mod:`pymc_gpf.stepsize`): a trial is
  kept if it raises ``log p`` by a fraction of what its gradient predicts, the step then
  doubles; otherwise the step halves. The first trial is predicted to raise ``log p`` by
  0.1 nats (``eta = 0.1 / |g|^2``): a local move whatever the posterior's scale, from which
  doubling reaches the curvature's scale in a few steps.
* **Langevin and repulsive Langevin** (``lambda2 > 0``): one Euler-Maruyama step of the SDE
  with the step size ``eta`` the controller sets, preconditioned by the constant matrix
  ``M = diag(d) + F^T F`` the state carries (:func:`pymc_gpf.ensemble.flow.precondition`;
  the identity unless the controller sets it). The state carries the drift at the current
  particles, so a step evaluates the batched log-density and gradient once, at the moved
  particles.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import numpy as np
import pytensor.tensor as pt

from pytensor.graph.basic import Variable

from pymc_gpf.ensemble import flow
from pymc_gpf.stepgraph import Info, keep_if
from pymc_gpf.stepsize import Backtracking
from pymc_gpf.target import BatchedTarget

__all__ = [
    "DeepState",
    "EnsembleStatic",
    "LangevinState",
    "deep_step",
    "init_deep",
    "init_langevin",
    "langevin_step",
]

BACKTRACKING = Backtracking()
MAX_DEEP_STEP = 1e8  # a particle at a mode keeps doubling its accepted steps: bound them
FIRST_GAIN = 0.1  # nats: what the first trial step of a deep ensemble predicts


class LangevinState(NamedTuple):
    """The particles, ``log p`` there and the drift of the SDE there (before preconditioning);
    ``ready = 0`` until the first step has evaluated them; the preconditioner
    ``M = diag(preconditioner_diagonal) + F^T F`` with ``F = preconditioner_factor``."""

    particles: Variable  # (N, D)
    logp: Variable  # (N,)
    drift: Variable  # (N, D)
    ready: Variable  # ()
    preconditioner_diagonal: Variable  # (D,)
    preconditioner_factor: Variable  # (K, D), K = flow.factor_rows(N, D)
    rng: Variable | None = None  # the generator of the noise (set by the method, not the step)


class DeepState(NamedTuple):
    """The particles, ``log p`` and its gradient there, and each particle's step size."""

    particles: Variable  # (N, D)
    logp: Variable  # (N,)
    grad: Variable  # (N, D)
    step_size: Variable  # (N,)
    ready: Variable  # ()


def _repulsion(particles: Variable, bandwidth: float | str) -> tuple[Variable, Variable, Variable]:
    """The interaction drift, the kernel matrix and its bandwidth at ``particles``."""
    distances = flow.squared_distances(particles)
    h = flow.median_bandwidth(distances) if bandwidth == "median" else pt.as_tensor(bandwidth)
    kernel = flow.rbf_kernel(distances, h)
    return flow.interaction_drift(particles, kernel, h), kernel, h


class EnsembleStatic(NamedTuple):
    """What is fixed for the graph of a Langevin step: the SDE's ``temperature``
    (``lambda2``), the MMD weight ``repulsion`` (``lambda1``; 0: plain Langevin) and the
    kernel's ``bandwidth`` (a number or ``"median"``). A deep ensemble's step has none."""

    temperature: float = 0.0
    repulsion: float = 0.0
    bandwidth: float | str = "median"


def init_langevin(particles: np.ndarray, static: EnsembleStatic, dtype: str) -> LangevinState:
    """The Langevin step's state at ``particles``, nothing evaluated yet (the first step
    evaluates them)."""
    n, d = particles.shape
    ones = np.ones(d, dtype)
    factor = np.zeros((flow.factor_rows(n, d), d), dtype)
    logp = np.full(n, -np.inf, dtype=dtype)
    zero = np.zeros((), dtype=dtype)
    return LangevinState(particles, logp, np.zeros_like(particles), zero, ones, factor)


def init_deep(particles: np.ndarray, static: EnsembleStatic, dtype: str) -> DeepState:
    """The deep ensemble's step's state at ``particles``, nothing evaluated yet (the first
    step evaluates them)."""
    n = len(particles)
    logp = np.full(n, -np.inf, dtype=dtype)
    zero = np.zeros((), dtype=dtype)
    return DeepState(particles, logp, np.zeros_like(particles), np.zeros(n, dtype), zero)


def langevin_step(
    state: LangevinState,
    noise: tuple[Variable, Variable | None],
    target: BatchedTarget,
    rates: tuple[Variable, Variable],
    static: EnsembleStatic,
) -> tuple[LangevinState, Info]:
    """Move by the drift of the state at the step size ``rates[0]`` (the drift's move
    capped, :func:`~pymc_gpf.ensemble.flow.drift_cap`), evaluate there; a non-finite move
    is refused (the state kept). ``noise`` is ``N(0, I)`` draws ``(N, D)``
    and, to precondition, ``(N, K)`` more for the factor (``None``: the paper's plain scheme,
    ``M = I``). The info's free energy is the objective (mean ``V`` plus the MMD term); its
    extras ``mean_v``, ``mmd`` and ``bandwidth``."""
    temperature, repulsion, bandwidth = static
    eta = rates[0] * state.ready  # 0 on the first call: evaluate where the particles are
    drift, xi = state.drift, noise[0]
    if noise[1] is not None:
        diagonal, factor = state.preconditioner_diagonal, state.preconditioner_factor
        drift = flow.precondition(drift, diagonal, factor)
        xi = flow.preconditioned_noise(xi, noise[1], diagonal, factor)
    cap = flow.drift_cap(state.drift, drift, eta)
    moved = flow.euler_maruyama(state.particles, cap[:, None] * drift, xi, eta, temperature)
    logp, grad_logp, _ = target.logp_and_grads(moved)
    if repulsion:
        interaction, kernel, h = _repulsion(moved, bandwidth)
        drift = grad_logp + repulsion * interaction
        mmd = repulsion * flow.interaction_energy(kernel)
    else:
        drift, mmd, h = grad_logp, pt.as_tensor(0.0), pt.as_tensor(np.nan)
    finite = pt.all(pt.isfinite(logp)) & pt.all(pt.isfinite(drift))

    keep = partial(keep_if, finite)
    new = LangevinState(
        keep(moved, state.particles),
        keep(logp, state.logp),
        keep(drift, state.drift),
        keep(pt.ones_like(state.ready), state.ready),
        state.preconditioner_diagonal,
        state.preconditioner_factor,
    )
    objective = keep(-pt.mean(logp) + mmd, -pt.mean(state.logp))
    extra = (("mean_v", -pt.mean(new.logp)), ("mmd", mmd), ("bandwidth", h))
    return new, Info(objective, moved, logp, grad_logp, new.particles, finite, extra=extra)


def deep_step(
    state: DeepState,
    noise: None,
    target: BatchedTarget,
    rates: tuple[Variable, Variable],
    static: EnsembleStatic,
) -> tuple[DeepState, Info]:
    """Per-particle backtracking gradient ascent of ``log p`` (see the module docstring):
    no noise, and each particle's step size is its own (the state's, not ``rates``), nor
    any setting of ``static``. The info's ``decrement`` is the largest increase of ``log p``
    a particle's next step predicts (nats): small once every particle sits at a mode."""
    eta = state.step_size * state.ready
    trial = state.particles + eta[:, None] * state.grad
    logp, grad_logp, _ = target.logp_and_grads(trial)
    finite = pt.isfinite(logp) & pt.all(pt.isfinite(grad_logp), axis=1)
    predicted = eta * pt.sum(pt.square(state.grad), axis=1)
    armijo = logp >= state.logp + BACKTRACKING.armijo * predicted
    accepted = finite & (armijo | (state.ready <= 0))
    first = FIRST_GAIN / pt.maximum(pt.sum(pt.square(grad_logp), axis=1), 1e-300)
    grown = pt.minimum(state.step_size * BACKTRACKING.grow, MAX_DEEP_STEP)
    step_size = pt.switch(
        state.ready > 0,
        pt.switch(accepted, grown, state.step_size * BACKTRACKING.shrink),
        first,
    )
    kept = accepted[:, None]
    new = DeepState(
        pt.switch(kept, trial, state.particles),
        pt.switch(accepted, logp, state.logp),
        pt.switch(kept, grad_logp, state.grad),
        step_size,
        pt.ones_like(state.ready),
    )
    return new, Info(
        free_energy=-pt.mean(new.logp),
        points=trial,
        logp=logp,
        grad=grad_logp,
        positions=new.particles,
        accepted=pt.any(accepted),
        step_size=pt.max(new.step_size),
        decrement=pt.max(new.step_size * pt.sum(pt.square(new.grad), axis=1)),
        extra=(("max_grad", pt.max(pt.sqrt(pt.sum(pt.square(new.grad), axis=1)))),),
    )
