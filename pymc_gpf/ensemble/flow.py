"""Wasserstein-gradient-flow ensembles: the equations of Wild, Ghalebikesabi, Sejdinovic &
Knoblauch (NeurIPS 2023; ``gvi-slides-2024``), as pure PyTensor functions of the particle
matrix ``X`` (``N`` rows, one per particle; ``D`` columns).

Generalised VI with the regulariser ``lambda1 MMD^2(Q, P) + lambda2 KL(Q, P)`` is the
Wasserstein gradient flow of

``L(Q) = int V dQ + (lambda1 / 2) int int kappa dQ dQ + lambda2 int q log q``,
``V = -log p(theta, y)``,

implemented by interacting particles (the slides' "Implementing the Wasserstein Gradient
Flow", step 2):

``d theta_n = -(grad V(theta_n) + (lambda1 / N) sum_j grad_1 kappa(theta_n, theta_j)) dt
+ sqrt(2 lambda2) dB_n``.

``lambda1 = lambda2 = 0`` is a deep ensemble (independent MAP descents), ``lambda1 = 0`` a
Langevin ensemble (``N`` unadjusted Langevin chains, stationary law ``p^(1 / lambda2)``),
``lambda1 > 0`` a repulsive Langevin ensemble. The interaction costs ``O(N^2 D)`` through
the ``N x N`` kernel matrix; nothing loops over particles.
"""

from __future__ import annotations

import numpy as np
import pytensor.tensor as pt

from pytensor.graph.basic import Variable

__all__ = [
    "drift_cap",
    "euler_maruyama",
    "factor_rows",
    "interaction_drift",
    "interaction_energy",
    "median_bandwidth",
    "precondition",
    "preconditioned_noise",
    "rbf_kernel",
    "squared_distances",
    "ula_gaussian_covariance",
    "ula_gaussian_variance",
]


# the longest drift move, in the preconditioner's sds times sqrt(D): a stable step moves a
# particle at most 0.1 of its distance from the mode (eta L <= 0.1), about 0.1 sqrt(D) sds
MAX_DRIFT_MOVE = 10.0


def squared_distances(particles: Variable) -> Variable:
    """``||theta_i - theta_j||^2`` for every pair, ``(N, N)``, through the Gram matrix."""
    sq = pt.sum(pt.square(particles), axis=1)
    gram = pt.dot(particles, particles.T)
    return pt.maximum(sq[:, None] + sq[None, :] - 2.0 * gram, 0.0)


def median_bandwidth(distances: Variable) -> Variable:
    """The median heuristic: ``h = med_{i != j} ||theta_i - theta_j||^2 / (2 log(N + 1))``,
    so that a particle's kernel weights on the others sum to about one (Liu & Wang's SVGD
    heuristic; the ensembles' reference code uses the same ``log(N + 1)``)."""
    n = distances.shape[0]
    off_diagonal = distances[~pt.eye(n, dtype="bool")]
    median = pt.sort(off_diagonal)[off_diagonal.shape[0] // 2]
    return pt.maximum(median, 1e-300) / (2.0 * pt.log(n.astype(distances.dtype) + 1.0))


def rbf_kernel(distances: Variable, bandwidth: Variable) -> Variable:
    """``kappa(theta_i, theta_j) = exp(-||theta_i - theta_j||^2 / (2 h))``, ``(N, N)``."""
    return pt.exp(-distances / (2.0 * bandwidth))


def interaction_drift(particles: Variable, kernel: Variable, bandwidth: Variable) -> Variable:
    """``-(1 / N) sum_j grad_1 kappa(theta_n, theta_j)`` for every particle, ``(N, D)``: with
    the RBF kernel ``grad_1 kappa(x, y) = -kappa(x, y) (x - y) / h``, so this pushes each
    particle away from the others, ``(1 / (N h)) (theta_n sum_j K_nj - (K theta)_n)``."""
    n = particles.shape[0].astype(particles.dtype)
    weights = pt.sum(kernel, axis=1)
    return (particles * weights[:, None] - pt.dot(kernel, particles)) / (n * bandwidth)


def interaction_energy(kernel: Variable) -> Variable:
    """``(1 / 2) int int kappa dQ dQ`` of the empirical measure: ``mean_ij K_ij / 2``."""
    return 0.5 * pt.mean(kernel)


def euler_maruyama(
    particles: Variable,
    drift: Variable,
    noise: Variable,
    step_size: Variable,
    temperature: float,
) -> Variable:
    """One Euler-Maruyama step of the SDE, ``theta + eta drift + sqrt(2 lambda2 eta) xi``
    with ``drift = grad log p - lambda1 (1/N) sum_j grad_1 kappa`` and ``xi ~ N(0, I)``
    (``noise``)."""
    moved = particles + step_size * drift
    if temperature:
        moved = moved + pt.sqrt(2.0 * temperature * step_size) * noise
    return moved


def drift_cap(drift: Variable, preconditioned: Variable, step_size: Variable) -> Variable:
    """The factor, per particle ``(N,)``, that shortens the drift's move ``eta M g``
    (``g``: ``drift``, ``M g``: ``preconditioned``) to at most :data:`MAX_DRIFT_MOVE`
    ``sqrt(D)`` in the metric ``M^(-1)``, where it is ``eta sqrt(g^T M g)``; exactly 1 on
    every shorter move. A tamed scheme (Brosse et al. 2019) that no stable move meets; it
    keeps a particle that landed where the gradient is huge from jumping on to
    ``log p ~ -1e218`` (a horseshoe's chains did)."""
    longest = MAX_DRIFT_MOVE * pt.sqrt(pt.cast(drift.shape[1], drift.dtype))
    length = step_size * pt.sqrt(pt.sum(drift * preconditioned, axis=1))
    return pt.switch(length > longest, longest / length, 1.0)


DENSE_FACTOR = 4  # a factor of D rows up to D = 4 N still costs O(N^2 D) per step


def factor_rows(n_particles: int, ndim: int) -> int:
    """``K``, the rows of the preconditioner's factor: ``D`` (a full-rank factor) while
    ``O(N K D)`` stays ``O(N^2 D)``, otherwise ``N`` (the ensemble's span)."""
    return ndim if ndim <= DENSE_FACTOR * n_particles else n_particles


def precondition(vectors: Variable, diagonal: Variable, factor: Variable) -> Variable:
    """``M v`` for every row ``v`` of ``vectors`` with ``M = diag(diagonal) + F^T F`` (``F``:
    ``factor``, ``K x D``): ``O(N K D)``, ``M`` never formed. A constant ``M`` leaves the
    stationary law of ``d theta = M grad log p dt + sqrt(2 M) dB`` unchanged (and the fixed
    points of the interacting flow, which it follows in the metric ``M^(-1)``)."""
    return vectors * diagonal + pt.dot(pt.dot(vectors, factor.T), factor)


def preconditioned_noise(
    noise: Variable, factor_noise: Variable, diagonal: Variable, factor: Variable
) -> Variable:
    """Rows distributed ``N(0, M)`` from ``noise ~ N(0, I_D)`` and ``factor_noise ~ N(0, I_K)``
    (one row per particle): ``sqrt(diagonal) xi + F^T zeta``."""
    return noise * pt.sqrt(diagonal) + pt.dot(factor_noise, factor)


def ula_gaussian_covariance(
    covariance: np.ndarray, step_size: float, preconditioner: np.ndarray | None = None,
    temperature: float = 1.0,
) -> np.ndarray:  # fmt: skip
    """The stationary covariance of the preconditioned unadjusted Langevin scheme on
    ``N(mu, Sigma)``, ``theta' = theta - eta M Sigma^(-1) (theta - mu) + sqrt(2 lambda2 eta)
    M^(1/2) xi``: with ``M = L L^T`` and ``B = L^T Sigma^(-1) L``, ``u = L^(-1) theta`` is an
    AR(1) process with ``a = I - eta B``, so ``Cov = lambda2 L B^(-1) (I - eta B / 2)^(-1)
    L^T`` (:func:`ula_gaussian_variance` in every eigendirection of ``B``)."""
    d = len(covariance)
    root = np.linalg.cholesky(np.eye(d) if preconditioner is None else preconditioner)
    b = root.T @ np.linalg.solve(covariance, root)
    values, vectors = np.linalg.eigh(0.5 * (b + b.T))
    if not np.all((0 < step_size * values) & (step_size * values < 2.0)):
        return np.full((d, d), np.inf)
    inner = (vectors / (values * (1.0 - step_size * values / 2.0))) @ vectors.T
    return temperature * root @ inner @ root.T


def ula_gaussian_variance(variance: float, step_size: float, temperature: float = 1.0) -> float:
    """The stationary variance of the unadjusted Langevin scheme on ``N(mu, sigma^2)``:
    ``theta' = theta - eta (theta - mu) / sigma^2 + sqrt(2 lambda2 eta) xi`` is an AR(1)
    process with ``a = 1 - eta / sigma^2``, so ``Var = 2 lambda2 eta / (1 - a^2)
    = lambda2 sigma^2 / (1 - eta / (2 sigma^2))``: the ``O(eta)`` bias of the unadjusted
    scheme (the mean is unbiased). Stable for ``eta < 2 sigma^2``."""
    if not 0 < step_size < 2.0 * variance:
        return float(np.inf)
    return temperature * variance / (1.0 - step_size / (2.0 * variance))
