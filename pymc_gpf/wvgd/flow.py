"""Wasserstein variational gradient descent: the equations of Ambrogioni, Güçlü & van Gerven
(2018), §5-8.

``J`` particles ``z_j`` split the flat unconstrained space into Voronoi cells ``L_j`` (squared
Euclidean cost ``c(z, x) = ||z - x||^2``; ties go to the lowest index). Each particle carries
a local factorised Gaussian ``q_j = N(m_j, diag(s_j^2))`` (parameters ``m_j`` and
``log s_j``), restricted to its cell: ``q~_j = q_j 1[L_j] / Z_j``. Each step draws ``M``
points per particle, ``x_jm = m_j + s_j * eps_jm``, and keeps those in the particle's own cell
(rejection sampling of ``q~_j``). Notation: ``logp`` and ``logq`` are ``(J, M)``, ``accepted``
a boolean ``(J, M)``.

Pure functions in PyTensor; empty cells (no accepted draw) give zero directions and are
reported through ``counts``, so the method can skip them.
"""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt

from pytensor.gradient import disconnected_grad
from pytensor.graph.basic import Variable

from pymc_gpf.gaussian import LOG_2PI

__all__ = [
    "accepted_draws",
    "cell_elbos",
    "cell_log_mass",
    "cell_weights",
    "hyper_grads",
    "local_draws",
    "local_gradients",
    "local_logq",
    "mixture_elbo",
    "nearest_particle",
    "particle_direction",
    "running_log_mean",
]


def local_draws(means: Variable, log_scales: Variable, noise: Variable) -> Variable:
    """The draws ``zeta^m ~ q_j`` of eq. 20, ``x_jm = m_j + s_j * eps_jm``, ``(J, M, D)``
    from noise ``(J, M, D)``."""
    return means[:, None, :] + pt.exp(log_scales)[:, None, :] * noise


def local_logq(log_scales: Variable, noise: Variable) -> Variable:
    """``log q(x_jm; theta_j)`` of the untruncated local Gaussian (eq. 22 without the
    indicator and ``Z_j``), ``(J, M)``."""
    d = noise.shape[-1]
    return (
        -0.5 * pt.sum(pt.square(noise), axis=-1)
        - pt.sum(log_scales, axis=-1)[:, None]
        - 0.5 * d * LOG_2PI
    )


def nearest_particle(points: Variable, particles: Variable) -> Variable:
    """Index of the nearest particle (squared Euclidean) for every row of ``points``
    ``(K, D)``: the Voronoi cell each point lies in (eq. 8). ``O(K J D)``."""
    sq = (
        pt.sum(pt.square(points), axis=1)[:, None]
        - 2.0 * pt.dot(points, particles.T)
        + pt.sum(pt.square(particles), axis=1)[None, :]
    )
    return pt.argmin(sq, axis=1)


def accepted_draws(draws: Variable, particles: Variable) -> Variable:
    """``(J, M)``: draw ``m`` of particle ``j`` lies in ``L_j`` (eq. 8), i.e. it is a draw of
    the truncated ``q~_j`` (eq. 22) by rejection."""
    j, m, d = draws.shape
    cells = nearest_particle(draws.reshape((j * m, d)), particles).reshape((j, m))
    # each row's own index, 0 .. J - 1, without arange(J): JAX needs arange's length at trace
    # time, and J (the number of particles) is a dynamic dimension of the compiled step
    own = pt.cumsum(pt.ones_like(cells), axis=0) - 1
    return pt.eq(cells, own)


def _masked_log_weights(logp: Variable, logq: Variable, accepted: Variable) -> Variable:
    return pt.switch(accepted, logp - logq, -pt.inf)


def _softmax_rows(log_weights: Variable) -> Variable:
    """Self-normalised weights within each row; an all ``-inf`` row gives zeros."""
    top = pt.max(log_weights, axis=1, keepdims=True)
    top = pt.switch(pt.isfinite(top), top, 0.0)
    w = pt.exp(log_weights - top)
    return w / pt.maximum(pt.sum(w, axis=1, keepdims=True), 1e-300)


def _accepted_mean(draws: Variable, accepted: Variable) -> Variable:
    acc = pt.cast(accepted, draws.dtype)[:, :, None]
    return pt.sum(acc * draws, axis=1) / pt.maximum(pt.sum(acc, axis=1), 1.0)


def particle_direction(
    particles: Variable,
    draws: Variable,
    logp: Variable,
    logq: Variable,
    accepted: Variable,
    pooled: tuple[Variable, Variable] | None = None,
) -> Variable:
    """The gradient ``sum_m alpha_m grad_z c(z_j, x_jm) / sum_m alpha_m`` of eq. 20,
    ``alpha_m = p(x_jm, y) / q_j(x_jm)`` over the accepted draws: ``2 (z_j - centroid_j)``,
    the centroid being the importance-sampled posterior mean of the cell (Theorem 3).

    ``pooled``: every draw of the local Gaussians this step ``(J, M + K, D)``, the ``M``
    above first and ``K`` more with no log-density, and which of them their cells accept, as
    a control variate. The centroid is q~_j's mean plus the importance weights' correction
    to it, ``sum_m alpha_m x_m / sum_m alpha_m - mean_m x_m``; that mean, whose Monte Carlo
    noise the correction does not need, is taken over all ``M + K`` accepted draws. Where
    q~_j is the cell's posterior the correction vanishes and the centroid's noise falls by
    ``M / (M + K)`` in variance."""
    w = _softmax_rows(_masked_log_weights(logp, logq, accepted))
    centroid = pt.sum(w[:, :, None] * draws, axis=1)
    if pooled is not None:
        centroid = centroid - _accepted_mean(draws, accepted) + _accepted_mean(*pooled)
    has = pt.any(accepted, axis=1)[:, None]
    return pt.switch(has, 2.0 * (particles - centroid), 0.0)


def local_gradients(
    grad_logp: Variable,
    noise: Variable,
    log_scales: Variable,
    accepted: Variable,
    pooled_noise: tuple[Variable, Variable] | None = None,
) -> tuple[Variable, Variable]:
    """Gradients of ``KL(q~_j || p_j)`` w.r.t. ``m_j`` and ``log s_j`` (eq. 24-26).

    Reparameterised over the accepted draws (the cells do not depend on ``q_j``'s
    parameters), plus the truncation correction ``-grad log Z_j = -E_q~[score]`` of Theorem 4.
    Since ``E_q[score] = 0`` the correction is estimated by the rejected draws,
    ``E_q~[score] ~ -(1/A_j) sum_rejected score``: it is exactly zero when nothing is
    rejected, so one particle is exactly mean-field Gaussian VI. The scores are
    ``eps / s`` (mean) and ``eps^2 - 1`` (log-scale).

    ``pooled_noise``: the noise of every draw this step ``(J, M + K, D)`` and which of them
    their cells accept. The correction needs no log-density, so it is estimated from all of them:
    from the ``M`` alone, a local Gaussian much wider than its cell (few accepted draws) got
    a correction whose noise outgrew its pull back to the cell's width, and its scale drifted
    up without bound (three particles on N(0, 1): the middle cell's sd 1 -> 480).
    """
    acc = pt.cast(accepted, grad_logp.dtype)[:, :, None]
    count = pt.maximum(pt.sum(acc, axis=1), 1.0)  # (J, 1)
    scale = pt.exp(log_scales)
    every, every_accepted = (noise, accepted) if pooled_noise is None else pooled_noise
    every_acc = pt.cast(every_accepted, grad_logp.dtype)[:, :, None]
    rej = 1.0 - every_acc
    every_count = pt.maximum(pt.sum(every_acc, axis=1), 1.0)
    d_mean = -pt.sum(acc * grad_logp, axis=1) / count + pt.sum(rej * every, axis=1) / (
        scale * every_count
    )
    d_log_scale = (
        -pt.sum(acc * grad_logp * noise, axis=1) * scale / count
        + pt.sum(rej * (pt.square(every) - 1.0), axis=1) / every_count
        - 1.0
    )
    has = pt.any(accepted, axis=1)[:, None]
    return pt.switch(has, d_mean, 0.0), pt.switch(has, d_log_scale, 0.0)


def cell_elbos(logp: Variable, logq: Variable, accepted: Variable) -> Variable:
    """``ELBO_j = E_q~j[log p(x, y) - log q~_j(x)]`` per cell (the terms of eq. 27), ``(J,)``,
    with
    ``log q~_j = log q_j - log Z_j`` and ``Z_j`` estimated by the acceptance fraction.
    Undefined (``nan``) for a cell without accepted draws."""
    acc = pt.cast(accepted, logp.dtype)
    count = pt.sum(acc, axis=1)
    mean = pt.sum(acc * (logp - logq), axis=1) / count
    return mean + pt.log(count / logp.shape[1])


def cell_log_mass(logp: Variable, logq: Variable, accepted: Variable) -> Variable:
    """``log((1/M) sum_accepted p(x, y) / q_j(x))``: an unbiased importance-sampling
    estimate of ``int_{L_j} p(x, y) dx``, i.e. of the cell's posterior mass times the
    evidence (eq. 10); ``-inf`` for a cell without accepted draws."""
    log_w = _masked_log_weights(logp, logq, accepted)
    top = pt.max(log_w, axis=1)
    safe = pt.switch(pt.isfinite(top), top, 0.0)
    return safe + pt.log(pt.sum(pt.exp(log_w - safe[:, None]), axis=1) / logp.shape[1])


def mixture_elbo(elbos: Variable, weights: Variable) -> Variable:
    """The ELBO of the mixture ``sum_j beta_j q~_j``: since the cells are disjoint,
    ``sum_j beta_j ELBO_j + H(beta)`` (the PELBO of eq. 27 plus the entropy of the weights).
    Cells with ``beta_j = 0`` contribute nothing."""
    used = weights > 0
    safe = pt.switch(used, weights, 1.0)
    return pt.sum(pt.switch(used, weights * (elbos - pt.log(safe)), 0.0))


def cell_weights(log_mass: pt.TensorVariable, count: pt.TensorVariable) -> pt.TensorVariable:
    """Normalised ``beta`` from the running estimates; cells never estimated get 0."""
    seen = count > 0
    log_est = pt.switch(seen, log_mass - pt.log(pt.switch(seen, count, 1.0)), -pt.inf)
    return pt.special.softmax(log_est)


def running_log_mean(log_sum, count, new_log, keep, decay):
    """Exponentially weighted running sum (log domain) and count, for cells where
    ``keep``; an empty cell leaves its estimate as it was."""
    top = pt.maximum(log_sum + np.log(decay), new_log)
    summed = top + pt.log(pt.exp(log_sum + np.log(decay) - top) + pt.exp(new_log - top))
    return pt.switch(keep, summed, log_sum), pt.switch(keep, decay * count + 1.0, count)


def hyper_grads(logp, accepted, weights, params) -> list:
    """``d F / d theta = -sum_j beta_j E_q~j[d log p / d theta]`` (q and beta held fixed),
    the expectation over each cell's accepted draws."""
    if not params:
        return []
    acc = pt.cast(accepted, logp.dtype)
    share = acc * (weights / pt.maximum(pt.sum(acc, axis=1), 1.0))[:, None]
    weighted = pt.sum(disconnected_grad(share) * logp)
    return [-g for g in pytensor.grad(weighted, list(params))]
