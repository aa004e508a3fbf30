"""Gaussian Flow (GF, "GDP" in the 2020 preprint): the equations of Galy-Fajou, Perrone &
Opper (Entropy 2021, §3.2, eq. 11).

``q = N(mu, Gamma Gamma^T)`` with explicit parameters: the mean ``mu`` ``(D,)`` and one factor
per block of the structure, ``Gamma_b`` ``(D_b, K_b)`` (``K_b < D_b`` is low rank); for the
diagonal (mean-field) structure a single vector of scales ``sigma`` ``(D,)``. Each step
draws ``S`` standard normals ``z_s`` per block, ``x_s = mu + Gamma z_s``, and moves

``mu <- mu - eta1 g_bar`` (``Gamma Gamma^T g_bar`` with the natural mean),
``Gamma <- Gamma - eta2 [(1/S) sum_s g_s (x_s - mu)^T Gamma - Gamma]``,

with ``g = grad phi = -grad log p``. Algorithm 1 of the paper prints ``phi`` for ``grad phi``
and drops the ``- Gamma`` term; eq. 11 (used here) has both. No inverse, no Hessian, no
``D x D`` matrix: every product is ordered to cost ``O(S D K)``.

Pure functions in PyTensor; ``factors`` is always a list (one entry for "full" and
"diagonal").
"""

from __future__ import annotations

import pytensor.tensor as pt

from pytensor.graph.basic import Variable

from pymc_gpf.gaussian import LOG_2PI_E, logdet_spd
from pymc_gpf.structure import Structure, assemble_columns, take_columns

__all__ = ["deviations", "factor_directions", "free_energy", "log_det_factor", "mean_direction"]


def deviations(factors: list[Variable], noise: list[Variable], structure: Structure) -> Variable:
    """``x_s - mu = Gamma z_s`` for every draw (the reparametrisation of eq. 3 with
    ``x_0 - m_0 = z``), ``(S, D)``; ``noise[b]`` is ``(S, K_b)``."""
    if structure.diagonal:
        return noise[0] * factors[0]
    parts = [pt.dot(z, f.T) for z, f in zip(noise, factors, strict=True)]
    return assemble_columns(parts, structure)


def mean_direction(
    grads: Variable, factors: list[Variable], structure: Structure, natural: bool = False
) -> Variable:
    """``g_bar = (1/S) sum_s g_s``, or ``Gamma Gamma^T g_bar`` with ``natural`` (eq. 11)."""
    g_bar = grads.mean(axis=0)
    if not natural:
        return g_bar
    if structure.diagonal:
        return pt.square(factors[0]) * g_bar
    parts = [
        pt.dot(f, pt.dot(f.T, take_columns(g_bar, b)))
        for f, b in zip(factors, structure.blocks, strict=True)
    ]
    return assemble_columns(parts, structure)


def factor_directions(
    grads: Variable, deviations: Variable, factors: list[Variable], structure: Structure
) -> list[Variable]:
    """``(psi - I) Gamma`` per block with ``psi = (1/S) sum_s g_s (x_s - mu)^T`` (eq. 11).

    Mean field keeps only the diagonal of ``psi``: ``(psi_dd - 1) sigma_d`` (the published
    code multiplies the full ``psi`` by the vector of scales, which is not this update).
    """
    n_draws = grads.shape[0]
    if structure.diagonal:
        return [(pt.mean(grads * deviations, axis=0) - 1.0) * factors[0]]
    out = []
    for f, b in zip(factors, structure.blocks, strict=True):
        g, dev = take_columns(grads, b), take_columns(deviations, b)
        out.append(pt.dot(g.T, pt.dot(dev, f)) / n_draws - f)  # D_b x K_b, never D_b x D_b
    return out


def log_det_factor(factors: list[Variable], structure: Structure) -> Variable:
    """``log|Gamma|`` of eq. 4, summed over blocks: ``1/2 log det(Gamma_b^T Gamma_b)``
    (``K_b x K_b``),
    which is ``log|det Gamma_b|`` for a square factor; ``sum log|sigma_d|`` for mean field."""
    if structure.diagonal:
        return pt.sum(pt.log(pt.abs(factors[0])))
    total = 0.0
    for f in factors:
        total = total + 0.5 * logdet_spd(pt.dot(f.T, f))
    return total


def free_energy(logp: Variable, factors: list[Variable], structure: Structure) -> Variable:
    """Eq. 4 plus its constant: ``F = E_q[phi] - log|Gamma| - D/2 (1 + log 2 pi)`` = minus
    the ELBO, the expectation
    a Monte Carlo average over the step's draws. For a low-rank factor ``log|Gamma|`` is
    ``1/2 log det(Gamma^T Gamma)``: a regularised free energy, as GPF's with ``N <= D``
    (q is degenerate, so the ELBO itself is ``-inf``)."""
    return -pt.mean(logp) - log_det_factor(factors, structure) - 0.5 * structure.ndim * LOG_2PI_E
