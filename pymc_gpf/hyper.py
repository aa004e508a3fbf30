"""Type-II maximum likelihood at the automatic step size: ``more_obj_params`` between
convergences of q.

The free energy minimised over q at fixed hyperparameters θ, ``F*(θ) = min_q F(q, θ)``, is
``-ELBO`` of the best q: ``-log p(y | θ)`` exactly when q can be exact (GPF's particles on a
Gaussian posterior with ``N > D``), a bound otherwise. Its gradient is that of ``F`` at the
minimising q (the envelope theorem), ``∇F*(θ) = -E_q[∇_θ log p(x, y; θ)]``. So q is fitted to
convergence by the method's own automatic step at fixed θ, then θ takes one quasi-Newton step
on ``F*``, and q converges again from where it was; the fit stops when q has converged and the
step θ would take is within ``tol``.

The step: ``d = -B^{-1} g`` with ``B`` a BFGS approximation of ``F*``'s Hessian, started at the
Hessian of ``F`` in θ at fixed q (``-E_q[∇²_θ log p]``, an upper bound of ``F*``'s, so the first
steps are short rather than long) and updated by the secant pairs of successive steps (the
damped update of Powell keeps it positive definite). Near the optimum ``B^{-1}`` is the
Laplace covariance of θ under ``p(y | θ)``, so the **Newton decrement** ``g^T B^{-1} g`` is the
squared distance to the optimum in units of θ's own uncertainty: the hyperparameters have
converged when it is below ``tol²``, the same units as q's test, and the Newton step taken
from there has been followed by q (or, for Monte Carlo estimates, when it is below four
times its own noise with the most draws). A step longer than one such unit is shortened to
one (a trust region). The expectations are over q's points: GPF's particles (its own
quadrature, exact for ``F̃``), or fresh draws of q for GF and WVGD, whose Monte Carlo error
is estimated from batch means.
"""

from __future__ import annotations

import math

from collections.abc import Sequence

import numpy as np
import pytensor
import pytensor.tensor as pt

from pytensor.compile.sharedvalue import SharedVariable

from pymc_gpf.control import Saved
from pymc_gpf.target import BatchedTarget, compile_function

__all__ = ["HyperSearch", "compile_hyper_moments", "flat_values", "set_flat_values"]

NOISE_FACTOR = 4.0  # converged when the decrement is within this many times its noise


def flat_values(params: Sequence[SharedVariable]) -> np.ndarray:
    """The hyperparameters' values as one flat vector."""
    return np.concatenate([np.ravel(p.get_value()) for p in params]).astype(float)


def set_flat_values(params: Sequence[SharedVariable], values: np.ndarray) -> None:
    """Set the hyperparameters from a flat vector (in :func:`flat_values`' order)."""
    offset = 0
    for p in params:
        current = np.asarray(p.get_value())
        size = current.size
        p.set_value(values[offset : offset + size].reshape(current.shape).astype(current.dtype))
        offset += size


def compile_hyper_moments(
    target: BatchedTarget, params: Sequence[SharedVariable], backend: str | None, kwargs: dict
):
    """``points (S, D) -> (g (k,), H (k, k))``: the gradient and Hessian in the flat
    hyperparameters of ``-sum_s log p(x_s, y; θ)`` (the free energy's θ-dependent part,
    times ``S``)."""
    points = pt.matrix("points", dtype=target.dtype)
    _, _, grads = target.logp_and_grads(points, list(params))
    flat = pt.concatenate([pt.flatten(-g) for g in grads])
    columns = pytensor.gradient.jacobian(flat, list(params))
    hessian = pt.concatenate([pt.reshape(c, (flat.shape[0], -1)) for c in columns], axis=1)
    # random_seed=False: the minibatch generators are the fit's and continue across compiles
    return compile_function([points], [flat, hessian], backend, kwargs, random_seed=False)


class HyperSearch(Saved):
    """θ's quasi-Newton search on ``F*`` (module docstring): the Hessian approximation ``B``,
    the last gradient and step, the last decrement and its noise, and the number of steps."""

    saved = (
        "_damped", "decrement", "gradient", "hessian", "noise", "step_taken", "steps",
        "stopped_by_noise", "stuck", "tol",
    )  # fmt: skip

    def __init__(self, tol: float):
        self.tol = tol
        self.hessian: np.ndarray | None = None
        self.gradient: np.ndarray | None = None
        self.step_taken: np.ndarray | None = None
        self.decrement = float("inf")
        self.noise = 0.0
        self.steps = 0
        self._damped = False  # the last BFGS update was damped (Powell)
        self.stopped_by_noise = False
        self.stuck = False  # θ's gradient was not finite at q's points

    def assess(
        self, gradient: np.ndarray, curvature: np.ndarray, noise: np.ndarray | None = None
    ) -> tuple[float, float]:
        """The decrement ``g^T B^{-1} g`` and its Monte Carlo noise ``tr(B^{-1} Σ)`` that
        :meth:`propose` would find (nothing changes)."""
        hessian = self._updated(gradient, np.asarray(curvature, dtype=float))
        decrement = float(gradient @ np.linalg.solve(hessian, gradient))
        spread = 0.0 if noise is None else float(np.trace(np.linalg.solve(hessian, noise)))
        return decrement, spread

    def unclear(self, gradient, curvature, noise) -> bool:
        """Whether more draws could tell: the decrement is above ``tol²`` but within its
        noise of it."""
        decrement, spread = self.assess(gradient, curvature, noise)
        return self.tol**2 <= decrement < NOISE_FACTOR * spread

    def propose(
        self, gradient: np.ndarray, curvature: np.ndarray, noise: np.ndarray | None = None
    ) -> np.ndarray | None:
        """The step for the envelope ``gradient`` with the fixed-q ``curvature`` (and the
        gradient's Monte Carlo covariance ``noise``), or ``None`` when θ has converged.

        Converged: the decrement is below ``tol²`` and either below ``tol⁴`` or already was
        below ``tol²`` before the last step (so the last, Newton, step from within ``tol``
        has been taken and q refitted after it: θ's error is then second order), or it is
        within its noise."""
        decrement, spread = self.assess(gradient, curvature, noise)
        self.hessian = self._updated(gradient, np.asarray(curvature, dtype=float))
        close = decrement < self.tol**2
        # after a damped update B has not learnt the curvature along the last step, so its
        # decrement may understate the distance: one more step, not the final stop
        final = close and (
            decrement < self.tol**4 or (self.decrement < self.tol**2 and not self._damped)
        )
        self.decrement, self.noise = decrement, spread
        self.gradient = np.array(gradient, dtype=float)
        self.stopped_by_noise = not final and not close and decrement < NOISE_FACTOR * spread
        if final or self.stopped_by_noise:
            self.step_taken = None
            return None
        step = -np.linalg.solve(self.hessian, gradient)
        length = math.sqrt(decrement)
        if length > 1.0:  # at most one unit of θ's own uncertainty per step
            step = step / length
        self.step_taken = step
        self.steps += 1
        return step

    def _updated(self, gradient: np.ndarray, curvature: np.ndarray) -> np.ndarray:
        """``B``: the fixed-q curvature at the start (made positive definite), then Powell's
        damped BFGS update from the last step and the change of the gradient."""
        if self.hessian is None or self.gradient is None or self.step_taken is None:
            return _positive_definite(curvature)
        s, y = self.step_taken, gradient - self.gradient
        b = self.hessian
        sbs = float(s @ b @ s)
        sy = float(s @ y)
        if sbs <= 0:
            return b
        if self.steps == 1 and sy > 0:
            # Shanno-Phua: the fixed-q curvature bounds F*'s from above, by an unknown
            # factor; rescale it to the first secant pair, so damping stays the exception
            b = b * (sy / sbs)
            sbs = sy
        bs = b @ s
        theta = 1.0 if sy >= 0.2 * sbs else 0.8 * sbs / (sbs - sy)
        self._damped = theta < 1.0
        r = theta * y + (1.0 - theta) * bs
        return b - np.outer(bs, bs) / sbs + np.outer(r, r) / float(s @ r)

    def describe(self) -> str:
        if self.stopped_by_noise:
            return (
                f"the hyperparameters' Newton decrement, {self.decrement:.2g}, is within "
                f"{NOISE_FACTOR:g} times its Monte Carlo noise ({self.noise:.2g}) with the most "
                f"draws, after {self.steps} steps of theirs"
            )
        return (
            f"the hyperparameters' Newton decrement is {self.decrement:.2g} < tol^2 = "
            f"{self.tol**2:.3g} after {self.steps} steps of theirs, the last a Newton step "
            "from within tol"
        )


def _positive_definite(matrix: np.ndarray) -> np.ndarray:
    matrix = 0.5 * (matrix + matrix.T)
    values, vectors = np.linalg.eigh(matrix)
    floor = max(float(np.max(np.abs(values))) * 1e-8, 1e-12)
    return (vectors * np.maximum(np.abs(values), floor)) @ vectors.T
