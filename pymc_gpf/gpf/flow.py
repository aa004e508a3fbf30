"""Gaussian Particle Flow: the equations of Galy-Fajou, Perrone & Opper (Entropy 2021).

Pure functions of the particle matrix ``X`` (``N`` rows, one per particle; ``D`` columns),
written in PyTensor so the method can fuse them into one compiled step. Notation: ``phi =
-log p``, ``G = grad phi`` row-wise, ``m`` the particle mean, ``Z = X - m`` the deviations,
``C = Z^T Z / N`` (the biased 1/N covariance, as in the paper). No function forms a ``D x D``
matrix when ``N <= D``: everything goes through the ``N x N`` Gram matrix ``Z Z^T``.

The fitted q and its draws (eq. 16 with the typo fixed: the noise is one *scalar* per
particle) are NumPy.
"""

from __future__ import annotations

import numpy as np
import pytensor.tensor as pt

from pytensor.graph.basic import Variable

from pymc_gpf.gaussian import LOG_2PI_E, GaussianQ, logdet_spd
from pymc_gpf.structure import Structure, assemble_columns, take_columns

__all__ = [
    "centre",
    "covariance",
    "free_energy",
    "gaussian_q",
    "linear_flow",
    "log_pseudo_det",
    "mean_shift",
]


def _n_rows(x: Variable) -> int:
    n = x.type.shape[0]
    if n is None:
        raise ValueError("the number of particles must be static (use pt.specify_shape)")
    return int(n)


def centre(particles: Variable) -> tuple[Variable, Variable]:
    """The particle mean ``m`` and deviations ``Z = X - m`` (the ``m^t`` and ``x_i^t - m^t``
    of eq. 13)."""
    mean = particles.mean(axis=0)
    return mean, particles - mean


def _block_linear(z: Variable, g: Variable, n: int) -> Variable:
    if n <= z.type.shape[-1]:
        return pt.dot(pt.dot(z, z.T), g) / n - z  # N x N Gram: O(N^2 D_b)
    return pt.dot(z, pt.dot(z.T, g) / n) - z  # D_b x D_b when it is the smaller one


def linear_flow(deviations: Variable, grads: Variable, structure: Structure) -> Variable:
    """``(psi - I)(x_i - m)`` for every particle, with ``psi = (1/N) sum_i g_i (x_i - m)^T``
    restricted to the blocks of ``structure`` (eq. 13, §3.5). Shape ``(N, D)``."""
    n = _n_rows(deviations)
    if structure.diagonal:
        return deviations * (pt.mean(grads * deviations, axis=0) - 1.0)
    parts = [
        _block_linear(take_columns(deviations, b), take_columns(grads, b), n)
        for b in structure.blocks
    ]
    return assemble_columns(parts, structure)


def mean_shift(
    deviations: Variable, grads: Variable, structure: Structure, natural: bool = False
) -> Variable:
    """The shift ``g_bar = (1/N) sum_i g_i`` of eq. 13, or ``C g_bar`` with ``natural``
    (the preconditioned mean step discussed after Theorem 2). Shape ``(D,)``."""
    g_bar = grads.mean(axis=0)
    if not natural:
        return g_bar
    n = _n_rows(deviations)
    if structure.diagonal:
        return pt.mean(pt.square(deviations), axis=0) * g_bar
    parts = []
    for b in structure.blocks:
        z = take_columns(deviations, b)
        parts.append(pt.dot(z.T, pt.dot(z, take_columns(g_bar, b))) / n)
    return assemble_columns(parts, structure)


def log_pseudo_det(deviations: Variable, structure: Structure) -> Variable:
    """``sum over blocks of sum_{lambda > 0} log lambda(C_b)`` (App. D).

    For ``N <= D_b + 1`` through the ``N x N`` identity ``log|Z_b Z_b^T / N + J / N|``
    (J the all-ones matrix lifts the zero eigenvalue of the centring); for ``N > D_b + 1``
    that matrix is singular and ``log|C_b|`` is used instead. The lifted eigenvalue is set
    to the cloud's own scale ``s`` (and ``log s`` subtracted) so the matrix stays well
    conditioned whatever the units.
    """
    n = _n_rows(deviations)
    if structure.diagonal:
        return pt.sum(pt.log(pt.mean(pt.square(deviations), axis=0)))
    total = 0.0
    for b in structure.blocks:
        z = take_columns(deviations, b)
        if n <= len(b) + 1:
            gram = pt.dot(z, z.T) / n
            scale = pt.mean(pt.diagonal(gram))
            total = total + logdet_spd(gram + scale / n) - pt.log(scale)
        else:
            total = total + logdet_spd(pt.dot(z.T, z) / n)
    return total


def free_energy(logp: Variable, deviations: Variable, structure: Structure) -> Variable:
    """Regularised free energy (§3.4.1, App. D), as minus an evidence lower bound:

    ``F = mean_i phi(x_i) - 1/2 sum_{lambda>0} log lambda(C) - D/2 (1 + log 2 pi)``.

    The paper's ``F~`` omits the constant ``D/2 (1 + log 2 pi)``; with it, at the exact
    solution for a Gaussian target and ``N >= D + 1``, ``F = -log Z`` (the log evidence).
    """
    d = deviations.type.shape[-1]
    return -pt.mean(logp) - 0.5 * log_pseudo_det(deviations, structure) - 0.5 * d * LOG_2PI_E


# ----------------------------------------------------------------- NumPy: the fitted q
def covariance(deviations: np.ndarray, structure: Structure) -> np.ndarray:
    """The fitted covariance ``C = Z^T Z / N`` (eq. 15, with ``1/N``), block-diagonal as the
    structure says (§3.5)."""
    cov = deviations.T @ deviations / len(deviations)
    return cov if structure.kind == "full" else cov * structure.mask()


def gaussian_q(particles: np.ndarray, structure: Structure) -> GaussianQ:
    """``q = N(m, C)`` of the particles, sampled without factorising ``C`` (eq. 16,
    corrected): ``x = m + Z_b^T xi / sqrt(N)`` with one *scalar* ``xi_i ~ N(0, 1)`` per
    particle, drawn independently for every block; mean field: ``m + sd * xi``."""
    mean = particles.mean(axis=0)
    z = particles - mean
    if structure.diagonal:
        return GaussianQ(mean, (np.arange(len(mean)),), (np.sqrt(np.mean(z**2, axis=0)),))
    n = len(particles)
    return GaussianQ(
        mean, structure.blocks, tuple(z[:, b].T / np.sqrt(n) for b in structure.blocks)
    )
