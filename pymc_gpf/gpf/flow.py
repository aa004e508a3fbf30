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

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import pytensor.tensor as pt

from pytensor.graph.basic import Variable

from pymc_gpf.gaussian import LOG_2PI_E, GaussianQ, logdet_spd
from pymc_gpf.structure import Structure, assemble_columns, take_columns

__all__ = [
    "NaturalFlow",
    "centre",
    "covariance",
    "free_energy",
    "gaussian_q",
    "linear_flow",
    "log_pseudo_det",
    "mean_shift",
    "natural_flow",
    "natural_free_energy",
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


# ------------------------------------------------------- the natural flow (tuning-free)
class NaturalFlow(NamedTuple):
    """The natural-gradient flow at the current particles (see :func:`natural_flow`)."""

    shift: Variable  # (D,): C g_bar, the natural mean step
    linear: Variable  # (N, D): C g^_c,i - z_i, the natural linear part per particle
    decrement_mean: Variable  # g_bar^T C g_bar >= 0
    decrement_cov: Variable  # ||C^(1/2) (psi - I) C^(+1/2)||_F^2 >= 0
    log_pdet: Variable  # sum of log of the non-zero eigenvalues of C (per block)

    @property
    def decrement(self) -> Variable:
        """Squared distance to the fixed point in the natural metric: for a Gaussian target
        about ``|m - mu|^2`` in posterior sds plus ``|C Sigma^-1 - I|_F^2``."""
        return self.decrement_mean + self.decrement_cov


def _natural_block(
    z: Variable, g: Variable, rank: int
) -> tuple[Variable, Variable, Variable, Variable]:
    """Shift, linear part, their squared sizes and ``log pdet C`` for one block of rank
    ``rank``: full rank through the ``D_b x D_b`` covariance, else through the ``N x N``
    Gram matrix (never ``D_b x D_b``), with the ridge of :func:`natural_flow`."""
    n = z.shape[0].astype(z.dtype)
    d = z.type.shape[-1]
    g_bar = g.mean(axis=0)
    trace_psi = pt.sum(g * z) / n
    if rank == d:
        cov = pt.dot(z.T, z) / n
        chol = pt.linalg.cholesky(cov, on_error="nan")
        psi_t = pt.dot(z.T, g) / n
        # C g^_c for every particle, g^_c = Z C^-1 psi^T the affine regression of g on z
        coef = pt.linalg.cho_solve((chol, True), psi_t, check_finite=False)
        fitted = pt.dot(z, pt.dot(coef, cov))
        shift = pt.dot(cov, g_bar)
        log_pdet = 2.0 * pt.sum(pt.log(pt.diagonal(chol)))
    else:
        gram = pt.dot(z, z.T) / n
        values, vectors = pt.linalg.eigh(gram)
        values, vectors = values[-rank:], vectors[:, -rank:]
        # K^+ on the cloud's span; ridge: C's smallest non-zero eigenvalue (Theorem 3: the
        # directions the cloud lacks have at most that variance on a Gaussian target)
        gram_pinv = pt.dot(vectors / values, vectors.T)
        ridge = pt.min(values)
        g_c = pt.dot(vectors, pt.dot(vectors.T, g))

        def cov_ridge(rows):
            in_span = pt.dot(pt.dot(rows, z.T), z) / n
            projected = pt.dot(pt.dot(pt.dot(rows, z.T), gram_pinv), z) / n
            return in_span + ridge * (rows - projected)

        fitted = cov_ridge(g_c)
        shift = cov_ridge(g_bar[None, :])[0]
        log_pdet = pt.sum(pt.log(values))
    decrement_mean = pt.dot(g_bar, shift)
    decrement_cov = pt.sum(g * fitted) / n - 2.0 * trace_psi + rank
    return shift, fitted - z, decrement_mean, decrement_cov, log_pdet


def natural_flow(
    deviations: Variable, grads: Variable, structure: Structure, ranks: Sequence[int]
) -> NaturalFlow:
    """The flow of eq. 13 preconditioned by the particle covariance on both parts.

    Mean: ``C g_bar`` (the natural mean step after Theorem 2). Linear part: ``B z_i`` with
    ``B = C (psi - I) C^+``, which for particles is ``C g^_i - z_i``, ``g^`` the affine
    regression of the gradients on the particles (``g`` itself when ``N <= D + 1``). With
    ``B = P A Q`` for positive definite ``P = C``, ``Q = C^+`` and ``A = psi - I``,
    ``dF~/dt = -g_bar^T C g_bar - ||C^(1/2) A C^(+1/2)||^2 <= 0``: a descent direction of the
    regularised free energy for every target and ``N``, with the paper's fixed points, and
    affine invariant. On a Gaussian target its linearisation contracts the covariance error
    at rate ``1 - 2 eta2`` in every direction, whatever the conditioning (the paper's
    linear part needs ``eta2 < 2 / (kappa + 1 / kappa)``), and ``eta1 = 1`` moves the mean
    to the target's once ``C`` is right: a Newton-like step.

    A block whose cloud spans ``rank < D_b`` directions uses ``C + lambda (I - P)``
    (``P`` the projector on the span, ``lambda`` the smallest fitted variance) in place of
    ``C``, so the cloud can turn towards the directions it lacks (Theorem 3's top
    eigenspace); ``ranks`` are the blocks' ranks (static). Mean field: ``C`` diagonal.
    """
    n = deviations.shape[0].astype(deviations.dtype)
    if structure.diagonal:
        var = pt.mean(pt.square(deviations), axis=0)
        g_bar = grads.mean(axis=0)
        psi = pt.sum(grads * deviations, axis=0) / n
        shift = var * g_bar
        return NaturalFlow(
            shift,
            deviations * (psi - 1.0),
            pt.dot(g_bar, shift),
            pt.sum(pt.square(psi - 1.0)),
            pt.sum(pt.log(var)),
        )
    parts = [
        _natural_block(take_columns(deviations, b), take_columns(grads, b), rank)
        for b, rank in zip(structure.blocks, ranks, strict=True)
    ]
    shifts, linears, dec_mean, dec_cov, log_pdets = zip(*parts, strict=True)
    return NaturalFlow(
        assemble_columns(list(shifts), structure),
        assemble_columns(list(linears), structure),
        sum(dec_mean),
        sum(dec_cov),
        sum(log_pdets),
    )


def natural_free_energy(logp: Variable, log_pdet: Variable, ndim: int) -> Variable:
    """:func:`free_energy` from a precomputed ``log pdet C``."""
    return -pt.mean(logp) - 0.5 * log_pdet - 0.5 * ndim * LOG_2PI_E
