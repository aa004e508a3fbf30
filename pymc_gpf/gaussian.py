"""Gaussian helpers shared by the methods whose q is a Gaussian (GPF, GF)."""

from __future__ import annotations

import numpy as np
import pytensor.tensor as pt

from pytensor.graph.basic import Variable
from scipy.linalg import solve_triangular

__all__ = ["LOG_2PI", "LOG_2PI_E", "factor_logpdf", "logdet_spd"]

LOG_2PI = float(np.log(2 * np.pi))
LOG_2PI_E = LOG_2PI + 1.0


def logdet_spd(a: Variable) -> Variable:
    """``log det A`` of a symmetric positive definite matrix (``nan`` if it is not)."""
    return 2.0 * pt.sum(pt.log(pt.diagonal(pt.linalg.cholesky(a, on_error="nan"))))


def factor_logpdf(deviations: np.ndarray, factor: np.ndarray, rtol: float = 1e-8) -> np.ndarray:
    """``log N(x; mu, F F^T)`` for rows ``x - mu`` of ``deviations`` ``(S, D)``, ``F`` ``(D, K)``.

    For ``K < D`` the Gaussian is degenerate: this is its density on the ``K``-dimensional
    affine support (w.r.t. Lebesgue measure there), ``-inf`` for points off the support.
    Uses ``F = Q R`` (no ``D x D`` matrix): ``z = R^{-1} Q^T (x - mu)``.
    """
    d, k = factor.shape
    q, r = np.linalg.qr(factor)
    proj = deviations @ q
    z = solve_triangular(r, proj.T).T
    out = -0.5 * np.sum(z**2, axis=1) - np.sum(np.log(np.abs(np.diag(r)))) - 0.5 * k * LOG_2PI
    if k < d:
        residual = np.linalg.norm(deviations - proj @ q.T, axis=1)
        scale = np.linalg.norm(deviations, axis=1) + np.sqrt(np.sum(factor**2))
        out = np.where(residual <= rtol * scale, out, -np.inf)
    return out
