"""Optimisers as small composable transforms of an update direction (optax style).

A :class:`Transform` is a pair of pure functions: ``init(shape)`` gives the initial state
(NumPy arrays), ``update(direction, state)`` maps a symbolic direction and symbolic state to
the transformed direction and the new state. The methods keep the state in shared variables
and fuse the update into their one compiled step; nothing here knows about PyMC.

The particle methods need *dimension-wise* preconditioners (Galy-Fajou et al. 2021, App. H,
Algorithms A2, A4, A6): the second-moment estimate of a ``(N, D)`` particle update is averaged
over the particle axis, so every particle is scaled by the same diagonal matrix and the step
stays an affine map of the particle cloud. Elementwise versions (``dimension_wise=False``)
are provided for comparison; they break that affine structure.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import pytensor
import pytensor.tensor as pt

from pytensor.graph.basic import Variable

__all__ = [
    "SGD",
    "AdaGrad",
    "AdaGradState",
    "Adam",
    "AdamState",
    "Momentum",
    "MomentumState",
    "Optimizer",
    "RMSProp",
    "RMSPropState",
    "Transform",
    "chain",
    "clip_by_norm",
    "map_state",
    "named_leaves",
    "resolve",
    "scale",
    "scale_by_adagrad",
    "scale_by_adam",
    "scale_by_momentum",
    "scale_by_rmsprop",
    "state_leaves",
]

State = tuple[Variable, ...]


class Transform(NamedTuple):
    """``init(shape) -> state arrays``; ``update(direction, state) -> (direction, state)``."""

    init: Callable[[tuple[int, ...]], tuple[np.ndarray, ...]]
    update: Callable[[Variable, State], tuple[Variable, State]]


def _zeros(shape: tuple[int, ...]) -> np.ndarray:
    return np.zeros(shape, dtype=pytensor.config.floatX)


def _reduced(shape: tuple[int, ...], shared_axes: Sequence[int]) -> tuple[int, ...]:
    axes = {a % len(shape) for a in shared_axes} if shape else set()
    return tuple(1 if i in axes else s for i, s in enumerate(shape))


def _mean_square(direction: Variable, shared_axes: Sequence[int]) -> Variable:
    sq = pt.square(direction)
    return pt.mean(sq, axis=tuple(shared_axes), keepdims=True) if shared_axes else sq


def scale(factor: float) -> Transform:
    """Multiply the direction by a constant (the learning rate)."""
    return Transform(lambda shape: (), lambda u, state: (u * factor, state))


def clip_by_norm(max_norm: float) -> Transform:
    """Rescale the whole direction by one scalar so its Euclidean norm is at most ``max_norm``
    (a single scalar per array keeps affine structure intact)."""

    def update(u, state):
        norm = pt.sqrt(pt.sum(pt.square(u)))
        return u * pt.minimum(1.0, max_norm / pt.maximum(norm, 1e-300)), state

    return Transform(lambda shape: (), update)


class MomentumState(NamedTuple):
    momentum: Variable


class AdamState(NamedTuple):
    count: Variable
    mu: Variable  # first moment
    nu: Variable  # second moment (reduced over the shared axes)


class RMSPropState(NamedTuple):
    nu: Variable


class AdaGradState(NamedTuple):
    sum_of_squares: Variable


def scale_by_momentum(beta: float = 0.9) -> Transform:
    """Heavy-ball momentum: ``m <- beta m + u``; linear, hence affine-preserving."""

    def update(u, state):
        m = beta * state.momentum + u
        return m, MomentumState(m)

    return Transform(lambda shape: MomentumState(_zeros(shape)), update)


def scale_by_adam(
    b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, shared_axes: Sequence[int] = ()
) -> Transform:
    """Adam (App. H, Alg. A1); with ``shared_axes`` the second moment is averaged over those
    axes (dimension-wise Adam, Alg. A2)."""

    def init(shape):
        zeros = np.zeros((), dtype="float64")
        return AdamState(zeros, _zeros(shape), _zeros(_reduced(shape, shared_axes)))

    def update(u, state):
        count, m, v = state
        count = count + 1
        m = b1 * m + (1 - b1) * u
        v = b2 * v + (1 - b2) * _mean_square(u, shared_axes)
        m_hat = m / (1 - b1**count)
        v_hat = v / (1 - b2**count)
        return (m_hat / (pt.sqrt(v_hat) + eps)).astype(u.dtype), AdamState(count, m, v)

    return Transform(init, update)


def scale_by_rmsprop(
    decay: float = 0.9, eps: float = 1e-8, shared_axes: Sequence[int] = ()
) -> Transform:
    """RMSProp (App. H, Alg. A5); dimension-wise with ``shared_axes`` (Alg. A6)."""

    def update(u, state):
        v = decay * state.nu + (1 - decay) * _mean_square(u, shared_axes)
        return u / (pt.sqrt(v) + eps), RMSPropState(v)

    return Transform(lambda shape: RMSPropState(_zeros(_reduced(shape, shared_axes))), update)


def scale_by_adagrad(eps: float = 1e-8, shared_axes: Sequence[int] = ()) -> Transform:
    """AdaGrad (App. H, Alg. A3); dimension-wise with ``shared_axes`` (Alg. A4)."""

    def update(u, state):
        v = state.sum_of_squares + _mean_square(u, shared_axes)
        return u / (pt.sqrt(v) + eps), AdaGradState(v)

    return Transform(lambda shape: AdaGradState(_zeros(_reduced(shape, shared_axes))), update)


def chain(*transforms: Transform) -> Transform:
    """Apply transforms in order; the state is the tuple of their states."""

    def init(shape):
        return tuple(t.init(shape) for t in transforms)

    def update(u, state):
        new_state = []
        for t, s in zip(transforms, state, strict=True):
            u, s = t.update(u, s)
            new_state.append(s)
        return u, tuple(new_state)

    return Transform(init, update)


def map_state(fn: Callable, state):
    """Apply ``fn`` to every array of a (nested tuple) optimiser state, keeping its types."""
    if hasattr(state, "_fields"):
        return type(state)(*(map_state(fn, s) for s in state))
    if isinstance(state, tuple):
        return tuple(map_state(fn, s) for s in state)
    return fn(state)


def named_leaves(state, prefix: str) -> list[tuple[str, object]]:
    """The arrays of a (nested tuple) optimiser state with names from their state types'
    fields, e.g. ``f"{prefix}_adam_mu"``, in the order of :func:`state_leaves`."""
    if hasattr(state, "_fields"):
        kind = type(state).__name__.removesuffix("State").lower()
        fields = zip(state._fields, state, strict=True)
        return [(f"{prefix}_{kind}_{field}", leaf) for field, leaf in fields]
    if isinstance(state, tuple):
        return [pair for s in state for pair in named_leaves(s, prefix)]
    return [(prefix, state)]


def state_leaves(state) -> list:
    """The arrays of a (nested tuple) optimiser state, in order."""
    if isinstance(state, tuple):
        return [leaf for s in state for leaf in state_leaves(s)]
    return [state]


# ------------------------------------------------------------------- user-facing choices
@dataclass(frozen=True)
class Optimizer:
    """A preconditioner choice; :meth:`transform` builds it for one array.

    ``particle_axes`` are the axes along which points of one cloud are stacked; a
    ``dimension_wise`` optimiser shares its per-dimension scale across them.
    """

    dimension_wise: bool = True

    def transform(self, particle_axes: Sequence[int] = ()) -> Transform:
        raise NotImplementedError

    def _shared(self, particle_axes: Sequence[int]) -> tuple[int, ...]:
        return tuple(particle_axes) if self.dimension_wise else ()


@dataclass(frozen=True)
class SGD(Optimizer):
    """Plain gradient descent (the default): the direction is used as is, the step of
    Algorithm 2 (GPF) and eq. 11 (GF)."""

    def transform(self, particle_axes=()):
        return Transform(lambda shape: (), lambda u, state: (u, state))


@dataclass(frozen=True)
class Momentum(Optimizer):
    """Heavy-ball momentum, linear and hence affine-preserving (used with ``clip_norm`` for
    the paper's banana experiment, §4.4, Fig. 5)."""

    beta: float = 0.9

    def transform(self, particle_axes=()):
        return scale_by_momentum(self.beta)


@dataclass(frozen=True)
class Adam(Optimizer):
    """Dimension-wise Adam (App. H, Alg. A2); ``dimension_wise=False`` gives plain Adam."""

    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8

    def transform(self, particle_axes=()):
        return scale_by_adam(self.b1, self.b2, self.eps, self._shared(particle_axes))


@dataclass(frozen=True)
class RMSProp(Optimizer):
    """Dimension-wise RMSProp (App. H, Alg. A6)."""

    decay: float = 0.9
    eps: float = 1e-8

    def transform(self, particle_axes=()):
        return scale_by_rmsprop(self.decay, self.eps, self._shared(particle_axes))


@dataclass(frozen=True)
class AdaGrad(Optimizer):
    """Dimension-wise AdaGrad (App. H, Alg. A4)."""

    eps: float = 1e-8

    def transform(self, particle_axes=()):
        return scale_by_adagrad(self.eps, self._shared(particle_axes))


OPTIMIZERS: dict[str, type[Optimizer]] = {
    "sgd": SGD,
    "descent": SGD,
    "momentum": Momentum,
    "adam": Adam,
    "rmsprop": RMSProp,
    "adagrad": AdaGrad,
}


def resolve(optimizer: str | Optimizer) -> Optimizer:
    """An optimiser from its name (case-insensitive) or an :class:`Optimizer` instance."""
    if isinstance(optimizer, Optimizer):
        return optimizer
    if isinstance(optimizer, str) and optimizer.lower() in OPTIMIZERS:
        return OPTIMIZERS[optimizer.lower()]()
    raise ValueError(
        f"Unknown optimizer {optimizer!r}: use one of {sorted(OPTIMIZERS)} or an instance "
        "such as pymc_gpf.optimizers.Adam(b1=0.9, dimension_wise=True). PyMC's own "
        "optimizers (pm.adam, ...) work elementwise on parameter lists and are not accepted."
    )
