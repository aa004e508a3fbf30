"""Low-bias point sets for Gaussian expectations: antithetic, exactly whitened clouds.

A cloud ``E`` of ``n`` points in ``R^r`` made of pairs ``+u, -u`` has sample mean 0 and zero
sample odd moments; whitening it (a linear map making its sample covariance the identity)
keeps the pairs. Every affine image ``m + E L^T`` then has sample mean ``m`` and sample
covariance ``L L^T`` exactly, and averages over it integrate every polynomial of degree up to
3 exactly under ``N(m, L L^T)``: a randomised spherical cubature rule (for ``n = 2r`` it is
the ``2r``-point rule of the unscented transform, randomly rotated). GPF's flow moves
particles by affine maps, so a cloud started this way stays such a rule at every step.

Pure NumPy; used to start GPF's particles, for GF's draws and for the independent
("validation") clouds that detect GPF's finite-``N`` bias.
"""

from __future__ import annotations

import numpy as np

__all__ = ["antithetic_cloud", "cloud_rank", "matching_cloud"]


def cloud_rank(n: int, r: int) -> int:
    """Directions an antithetic cloud of ``n`` points spans in ``R^r``: one per pair."""
    return min(n // 2, r)


def antithetic_cloud(n: int, r: int, rng: np.random.Generator) -> np.ndarray:
    """``(n, r)`` points: ``n // 2`` antithetic pairs of standard normals (and the origin when
    ``n`` is odd), whitened so the sample mean is 0 and the sample covariance (``1/n``) is
    the identity on the ``min(n // 2, r)`` directions the pairs span (all of ``R^r`` when
    ``n >= 2r``; otherwise a random subspace, the pairs inside it)."""
    if n < 2:
        raise ValueError(f"an antithetic cloud needs at least 2 points, got {n}")
    half = rng.standard_normal((n // 2, r))
    points = np.concatenate([half, -half, np.zeros((n % 2, r))])
    k = cloud_rank(n, r)
    # whiten on the span of the pairs: the top-k right singular vectors of the cloud
    _, s, vt = np.linalg.svd(points, full_matrices=False)
    basis, scale = vt[:k], s[:k] / np.sqrt(n)
    return (points @ basis.T / scale) @ basis


def matching_cloud(deviations: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """Weights ``W`` ``(n, N)`` such that ``W @ deviations`` is a new antithetic, whitened
    cloud with *exactly* the sample covariance of ``deviations`` ``(N, D)`` (centred rows),
    independent of it otherwise.

    Written as a combination of the rows, it follows any affine map applied to them: the
    new cloud stays a cubature rule for the same Gaussian while the particles move, so
    comparing the free energy on both tells how much the flow has fitted to the particular
    points (finite-``N`` bias) rather than to the Gaussian.
    """
    u, s, _ = np.linalg.svd(deviations, full_matrices=False)
    rank = int(np.sum(s > s[0] * max(deviations.shape) * np.finfo(float).eps)) if len(s) else 0
    if n // 2 < rank:
        raise ValueError(f"a matching cloud of rank {rank} needs at least {2 * rank} points")
    e = antithetic_cloud(n, rank, rng)
    # deviations = U S V^T, so U^T deviations = S V^T and (e U^T / sqrt(N)) deviations has
    # sample covariance V S e^T e S V^T / (N n) = deviations^T deviations / N
    return e @ u[:, :rank].T / np.sqrt(len(deviations))
