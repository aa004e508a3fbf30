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

The hierarchical structure's factor is the arrow ``Gamma = [[L, 0], [C, diag(s)]]`` on
(globals, locals): ``factors = [L, C, s]`` and ``noise = [z_g, z_l]``. Only its natural flow
exists (the automatic step size): ``Gamma <- Gamma (I - eta M)`` with ``M`` the projection
of ``A = Gamma^T psi_eps - I`` on the arrow pattern (``sym`` of its global block, its
local-global block, the diagonal of its local block), a product that stays an arrow. The
free energy falls along it at rate ``<A, M> = |M|^2`` and ``M = 0`` is the family's
stationary point, ``O(S D G)`` per step.

The low-rank structure's covariance is ``U U^T + diag(s^2)``, the factor ``Gamma = [U,
diag(s)]`` ``(D, K + D)`` (``factors = [U, s]``, ``noise = [z_u, z_d]``), with more columns
than rows: the entropy's gradient is then ``Sigma^{-1} Gamma`` rather than ``Gamma^{-T}``,
so its natural flow uses ``A = Gamma^T psi_eps - P``, ``P = Gamma^T Sigma^{-1} Gamma``, and
``M`` the projection of ``A`` on the pattern that keeps ``Gamma`` of that shape (``sym`` of
its ``K x K`` block, its ``D x K`` block, the diagonal of its ``D x D`` block): the free
energy falls at rate ``|M|^2`` and ``M = 0`` is the family's stationary point. Woodbury's
identity gives every product in ``O(S D K + D K^2)``.

Pure functions in PyTensor; ``factors`` is always a list (one entry for "full" and
"diagonal").
"""

from __future__ import annotations

import numpy as np
import pytensor.tensor as pt

from pytensor.graph.basic import Variable

from pymc_gpf.gaussian import LOG_2PI_E, logdet_spd
from pymc_gpf.structure import Structure, assemble_columns, take_columns

__all__ = [
    "deviations",
    "factor_directions",
    "free_energy",
    "hierarchical_rule",
    "log_det_factor",
    "low_rank_rule",
    "mean_direction",
    "natural_directions",
    "spherical_radial",
    "spherical_radial_shape",
    "standardised_antithetic",
]


def deviations(factors: list[Variable], noise: list[Variable], structure: Structure) -> Variable:
    """``x_s - mu = Gamma z_s`` for every draw (the reparametrisation of eq. 3 with
    ``x_0 - m_0 = z``), ``(S, D)``; ``noise[b]`` is ``(S, K_b)``."""
    if structure.diagonal:
        return noise[0] * factors[0]
    if structure.low_rank:
        (loadings, scales), (z_u, z_d) = factors, noise
        return pt.dot(z_u, loadings.T) + z_d * scales
    if structure.hierarchical:
        (lower, coupling, scales), (z_g, z_l) = factors, noise
        parts = [pt.dot(z_g, lower.T), pt.dot(z_g, coupling.T) + z_l * scales]
        return assemble_columns(parts, structure)
    parts = [pt.dot(z, f.T) for z, f in zip(noise, factors, strict=True)]
    return assemble_columns(parts, structure)


def _arrow_covariance_times(factors: list[Variable], v: Variable, structure: Structure):
    """``Gamma Gamma^T v`` for the hierarchical arrow factor, ``O(D G)``."""
    lower, coupling, scales = factors
    v_g, v_l = (take_columns(v, b) for b in structure.blocks)
    y_g = pt.dot(lower.T, v_g) + pt.dot(coupling.T, v_l)
    y_l = scales * v_l
    return assemble_columns([pt.dot(lower, y_g), pt.dot(coupling, y_g) + scales * y_l], structure)


def _low_rank_covariance_times(factors: list[Variable], v: Variable) -> Variable:
    """``(U U^T + diag(s^2)) v`` for the low-rank structure, ``O(D K)``."""
    loadings, scales = factors
    return pt.dot(loadings, pt.dot(loadings.T, v)) + pt.square(scales) * v


def mean_direction(
    grads: Variable, factors: list[Variable], structure: Structure, natural: bool = False
) -> Variable:
    """``g_bar = (1/S) sum_s g_s``, or ``Gamma Gamma^T g_bar`` with ``natural`` (eq. 11)."""
    g_bar = grads.mean(axis=0)
    if not natural:
        return g_bar
    if structure.diagonal:
        return pt.square(factors[0]) * g_bar
    if structure.low_rank:
        return _low_rank_covariance_times(factors, g_bar)
    if structure.hierarchical:
        return _arrow_covariance_times(factors, g_bar, structure)
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
    if structure.low_rank:  # 1/2 log det(U U^T + diag(s^2)), by the determinant lemma
        loadings, scales = factors
        return pt.sum(pt.log(pt.abs(scales))) + 0.5 * logdet_spd(_capacitance(loadings, scales))
    if structure.hierarchical:
        lower, _, scales = factors
        return 0.5 * logdet_spd(pt.dot(lower.T, lower)) + pt.sum(pt.log(pt.abs(scales)))
    total = 0.0
    for f in factors:
        total = total + 0.5 * logdet_spd(pt.dot(f.T, f))
    return total


def free_energy(
    logp: Variable, factors: list[Variable], structure: Structure, weights: Variable | None = None
) -> Variable:
    """Eq. 4 plus its constant: ``F = E_q[phi] - log|Gamma| - D/2 (1 + log 2 pi)`` = minus
    the ELBO, the expectation
    a Monte Carlo average over the step's draws. For a low-rank factor ``log|Gamma|`` is
    ``1/2 log det(Gamma^T Gamma)``: a regularised free energy, as GPF's with ``N <= D``
    (q is degenerate, so the ELBO itself is ``-inf``). ``weights`` are those of a
    quadrature rule (default: equal)."""
    expected = pt.mean(logp) if weights is None else pt.dot(weights, logp)
    return -expected - log_det_factor(factors, structure) - 0.5 * structure.ndim * LOG_2PI_E


# ----------------------------------------------------- the natural flow (tuning-free)
def spherical_radial(directions: Variable, radii: Variable) -> tuple[Variable, Variable]:
    """Genz & Monahan's (1998) stochastic spherical-radial rule for ``E[f(z)]``,
    ``z ~ N(0, I_K)``: points ``(2 R r + 1, K)`` and weights summing to 1.

    Each of the ``R`` rules takes ``r <= K`` directions ``u_j``, each uniform on the sphere
    and orthonormal when ``r = K`` (from the standard normals ``directions`` ``(R, r, K)``),
    a radius
    ``rho ~ chi(K + 2)`` (from ``radii`` ``(R, K + 2)``), the points ``+- rho u_j`` with
    weight ``K / (2 r rho^2)`` and the centre with weight ``1 - K / rho^2``. The rule is
    unbiased for every ``f`` (so the fit's fixed point is q's optimum, with no bias of order
    ``1/S`` in the moments of degree 4 and higher that draws on a sphere of fixed radius
    leave) and, with ``r = K``, exact for polynomials of degree up to 3 (so a step on a
    Gaussian target is exact).
    """
    _, r, k = directions.type.shape
    n_rules = directions.shape[0]
    if r == k:  # a random rotation: rows made orthonormal (Gram-Schmidt by Cholesky)
        chol = pt.linalg.cholesky(pt.matmul(directions, directions.mT), on_error="nan")
        units = pt.linalg.solve_triangular(chol, directions, lower=True, check_finite=False)
    else:  # fewer directions than K: each uniform on the sphere is what unbiasedness needs
        units = directions / pt.linalg.norm(directions, axis=-1, keepdims=True)
    rho2 = pt.sum(pt.square(radii), axis=-1)  # chi^2(K + 2), (R,)
    spokes = (pt.sqrt(rho2)[:, None, None] * units).reshape((-1, k))
    spoke_weights = pt.repeat(k / (2.0 * r * rho2 * n_rules), r)
    centre_weight = pt.mean(1.0 - k / rho2)
    points = pt.concatenate([pt.zeros((1, k), dtype=spokes.dtype), spokes, -spokes], axis=0)
    weights = pt.concatenate([centre_weight[None], spoke_weights, spoke_weights])
    return points, weights.astype(spokes.dtype)


def spherical_radial_shape(pairs: int, rank: int) -> tuple[int, int]:
    """Rules ``R`` and directions per rule ``r`` for about ``pairs`` antithetic pairs in
    ``rank`` dimensions: whole rotations (``r = rank``) when ``pairs >= rank``."""
    r = min(pairs, rank)
    return -(-pairs // r), r


def hierarchical_rule(
    directions: Variable, radii: Variable, signs: Variable
) -> tuple[list[Variable], Variable]:
    """Points for the hierarchical structure's ``G`` globals and ``D_l`` locals: one
    spherical-radial rule in ``G + 1`` dimensions (``directions`` ``(R, r, G + 1)``,
    ``radii`` ``(R, G + 3)``), its last coordinate the draw of every local, times a random
    sign per local (``signs`` ``(D_l,)``, standard normals). Given the globals the locals do
    not interact, so ``log p`` and its gradient are sums of terms in ``(x_g, x_j)`` and each
    term's expectation is that of a ``G + 1``-dimensional rule: unbiased, and exact to
    degree 3 (a Gaussian target's step is exact) with ``O(G)`` points for any ``D``.
    Returns ``[z_g, z_l]`` and the weights."""
    points, weights = spherical_radial(directions, radii)
    g = directions.type.shape[-1] - 1
    return [points[:, :g], points[:, g:] * pt.sign(signs)[None, :]], weights


def low_rank_rule(
    directions: Variable, radii: Variable, diagonal: Variable
) -> tuple[list[Variable], Variable]:
    """Points for the low-rank structure's ``K + D`` standard normals ``(z_u, z_d)``: one
    spherical-radial rule in ``K`` dimensions for ``z_u`` (``directions`` ``(R, r, K)``,
    ``radii`` ``(R, K + 2)``) and, for its centre and each pair of opposite spokes ``+-p``,
    its own ``z_d`` (``diagonal`` ``(R r + 1, D)``) at the four points ``(+-p, +-z_d)``,
    each with half a spoke's weight (the centre: ``(0, +-z_d)``, half each), ``z_d``'s
    second moments made exact per coordinate (the centre's ``+-1``, the spokes' columns
    standardised: a bias of order ``1/S`` in moments of degree 4, as mean field's standardised
    pairs). Given ``z_u``, ``z_d`` is otherwise an independent draw, and for a Gaussian
    target the sign pattern cancels ``z_d`` from ``psi_u`` and ``z_u`` from ``psi_dd``
    exactly: with plain draws their cross products, ``D K`` terms of order ``1/sqrt(S)``,
    swamped ``U``'s direction (a 400-dimensional Gaussian: ``U`` stayed at a fifth of its
    size). Returns ``[z_u, z_d]`` ``(4 R r + 2, K)``, ``(4 R r + 2, D)`` and the weights."""
    points, weights = spherical_radial(directions, radii)
    spokes = directions.shape[0] * directions.shape[1]
    plus, centre_weight = points[1 : spokes + 1], weights[0]
    spoke_weights = weights[1 : spokes + 1]  # each of +p and -p; a pair's is twice that
    # z_d's second moments made exact in every coordinate (as mean field's standardised
    # pairs): the centre's entries +-1, the spokes' columns scaled to their weights' sum; a
    # Gaussian target's free energy is then exact (plain draws left noise of order sqrt(D))
    z_0 = pt.sign(diagonal[:1])
    z_s = diagonal[1:]
    moments = pt.dot(spoke_weights, pt.square(z_s)) / pt.sum(spoke_weights)
    z_s = z_s / pt.sqrt(moments)
    zeros = pt.zeros((2, points.shape[1]), dtype=points.dtype)
    z_u = pt.concatenate([zeros, plus, plus, -plus, -plus], axis=0)
    z_d = pt.concatenate([z_0, -z_0, z_s, -z_s, z_s, -z_s], axis=0)
    half_centre = pt.repeat(0.5 * centre_weight[None], 2)
    out_weights = pt.concatenate([half_centre, *[0.5 * spoke_weights] * 4])
    return [z_u, z_d], out_weights.astype(points.dtype)


def standardised_antithetic(noise: Variable) -> Variable:
    """Mean field: pairs ``+-u`` with every column scaled to sample variance exactly 1."""
    noise = noise / pt.sqrt(pt.mean(pt.square(noise), axis=0))
    return pt.concatenate([noise, -noise], axis=0)


def natural_directions(
    grads: Variable,
    noise: list[Variable],
    factors: list[Variable],
    structure: Structure,
    weights: Variable | None = None,
) -> tuple[Variable, list[Variable], Variable, Variable, Variable]:
    """Eq. 11 preconditioned by ``C = Gamma Gamma^T`` on both parts (the natural flow of
    :func:`pymc_gpf.gpf.flow.natural_flow` in GF's parameters).

    With ``A = Gamma^T psi_eps - I``, ``psi_eps = (1/S) sum_s g_s eps_s^T``: the mean moves
    along ``C g_bar`` and the factor along ``Gamma sym(A)`` (the antisymmetric part only
    rotates ``Gamma``'s columns, which leaves q unchanged, so it is dropped). Both are descent
    directions of the free energy: the directional derivatives are ``g_bar^T C g_bar`` and
    ``|sym(A)|_F^2``. A low-rank factor (``K_b < D_b``) also moves along
    ``lambda (I - P) psi_eps``, ``P`` the projector on its span and ``lambda`` its smallest
    variance, so it can turn towards the top eigenspace. Returns the mean direction, the
    factor directions, their squared sizes and the largest ``|eigenvalue|`` of the
    ``sym(A)`` (for the trust region). The averages over draws use a quadrature rule's
    ``weights`` (default: equal).
    """
    if weights is None:
        weights = pt.ones(grads.shape[0], dtype=grads.dtype) / grads.shape[0]
    g_bar = pt.dot(weights, grads)
    weighted = weights[:, None] * grads
    if structure.diagonal:
        sd = factors[0]
        a = sd * pt.sum(weighted * noise[0], axis=0) - 1.0
        shift = pt.square(sd) * g_bar
        return shift, [sd * a], pt.dot(g_bar, shift), pt.sum(pt.square(a)), pt.max(pt.abs(a))
    if structure.hierarchical or structure.low_rank:
        rule = _arrow_directions if structure.hierarchical else _low_rank_directions
        shift, directions, dec_cov, spectral = rule(g_bar, weighted, noise, factors, structure)
        return shift, directions, pt.dot(g_bar, shift), dec_cov, spectral
    shifts, directions, dec_cov, spectral = [], [], 0.0, 0.0
    for f, e, b in zip(factors, noise, structure.blocks, strict=True):
        psi = pt.dot(take_columns(weighted, b).T, e)  # D_b x K_b
        a = pt.dot(f.T, psi) - pt.eye(f.type.shape[1])
        a = 0.5 * (a + a.T)
        g_b = take_columns(g_bar, b)
        shift = pt.dot(f, pt.dot(f.T, g_b))
        direction = pt.dot(f, a)
        dec_cov = dec_cov + pt.sum(pt.square(a))
        d_b, k_b = f.type.shape
        if k_b < d_b:
            gram = pt.dot(f.T, f)
            ridge = pt.min(pt.linalg.eigh(gram)[0])

            def off_span(v, f=f, gram=gram):
                return v - pt.dot(
                    f, pt.linalg.solve(gram, pt.dot(f.T, v), assume_a="pos", check_finite=False)
                )

            shift = shift + ridge * off_span(g_b[:, None])[:, 0]
            turn = off_span(psi)
            direction = direction + ridge * turn
            dec_cov = dec_cov + ridge * pt.sum(pt.square(turn))
        spectral = pt.maximum(spectral, _largest_abs_eigenvalue(a))
        shifts.append(shift)
        directions.append(direction)
    shift = assemble_columns(shifts, structure)
    return shift, directions, pt.dot(g_bar, shift), dec_cov, spectral


def _arrow_directions(g_bar, weighted, noise, factors, structure):
    """The natural directions of the hierarchical arrow factor (module docstring): the
    blocks of ``A`` it needs, ``A_gg = L^T psi_gg + C^T psi_lg - I``, ``A_lg = diag(s)
    psi_lg`` and ``diag(A_ll) = s psi_ll - 1``, and ``Gamma M`` block by block. The trust
    region reads ``M``'s eigenvalues (those of ``sym(A_gg)`` and ``diag(A_ll)``) and the
    largest shear of a local, ``max_j |A_lg[j]|``."""
    (lower, coupling, scales), (z_g, z_l) = factors, noise
    w_g, w_l = (take_columns(weighted, b) for b in structure.blocks)
    psi_gg, psi_lg = pt.dot(w_g.T, z_g), pt.dot(w_l.T, z_g)
    a_gg = pt.dot(lower.T, psi_gg) + pt.dot(coupling.T, psi_lg) - pt.eye(lower.type.shape[0])
    m_gg = 0.5 * (a_gg + a_gg.T)
    a_lg = scales[:, None] * psi_lg
    a_ll = scales * pt.sum(w_l * z_l, axis=0) - 1.0
    directions = [
        pt.dot(lower, m_gg),
        pt.dot(coupling, m_gg) + scales[:, None] * a_lg,
        scales * a_ll,
    ]
    shift = _arrow_covariance_times(factors, g_bar, structure)
    dec_cov = pt.sum(pt.square(m_gg)) + pt.sum(pt.square(a_lg)) + pt.sum(pt.square(a_ll))
    shear = pt.sqrt(pt.max(pt.sum(pt.square(a_lg), axis=1)))
    spectral = pt.maximum(_largest_abs_eigenvalue(m_gg), pt.maximum(pt.max(pt.abs(a_ll)), shear))
    return shift, directions, dec_cov, spectral


def _capacitance(loadings: Variable, scales: Variable) -> Variable:
    """``I_K + W^T W`` with ``W = diag(1/s) U``: ``det(U U^T + diag(s^2)) = det(diag(s^2))
    det(I_K + W^T W)`` and Woodbury's inverse goes through it."""
    whitened = loadings / scales[:, None]
    return pt.eye(loadings.type.shape[1]) + pt.dot(whitened.T, whitened)


def _low_rank_directions(g_bar, weighted, noise, factors, structure):
    """The natural directions of the low-rank structure's ``Gamma = [U, diag(s)]`` (module
    docstring). With ``W = U / s`` and ``B = I + W^T W`` (:func:`_capacitance`), Woodbury
    gives ``P_uu = W^T W B^-1``, ``P_du = W B^-1`` and ``diag(P_dd) = 1 - rowsum(W B^-1 * W)``,
    so ``A_uu = U^T psi_u - P_uu``, ``A_du = s psi_u - P_du`` and ``diag(A_dd) = s psi_dd -
    diag(P_dd)`` (``psi_u``, ``psi_dd`` the blocks of ``psi_eps`` it needs), and ``Gamma M =
    [U sym(A_uu) + s A_du, s diag(A_dd)]``. The trust region reads ``sym(A_uu)``'s
    eigenvalues, ``diag(A_dd)`` and the largest shear ``max_j |A_du[j]|``."""
    (loadings, scales), (z_u, z_d) = factors, noise
    whitened = loadings / scales[:, None]
    solved = pt.linalg.solve(  # W B^-1, (D, K)
        _capacitance(loadings, scales), whitened.T, assume_a="pos", check_finite=False
    ).T
    psi_u = pt.dot(weighted.T, z_u)  # D x K
    a_uu = pt.dot(loadings.T, psi_u) - pt.dot(whitened.T, solved)
    m_uu = 0.5 * (a_uu + a_uu.T)
    a_du = scales[:, None] * psi_u - solved
    a_dd = scales * pt.sum(weighted * z_d, axis=0) - 1.0 + pt.sum(solved * whitened, axis=1)
    directions = [
        _without_rotation(loadings, pt.dot(loadings, m_uu) + scales[:, None] * a_du),
        scales * a_dd,
    ]
    shift = _low_rank_covariance_times(factors, g_bar)
    dec_cov = pt.sum(pt.square(m_uu)) + pt.sum(pt.square(a_du)) + pt.sum(pt.square(a_dd))
    shear = pt.sqrt(pt.max(pt.sum(pt.square(a_du), axis=1)))
    spectral = pt.maximum(_largest_abs_eigenvalue(m_uu), pt.maximum(pt.max(pt.abs(a_dd)), shear))
    return shift, directions, dec_cov, spectral


def _without_rotation(loadings: Variable, direction: Variable) -> Variable:
    """``direction`` minus its part ``U Omega`` (``Omega`` antisymmetric) that only rotates
    ``U``'s columns: it leaves q unchanged and the free energy's rate with it, but noise
    along it would turn ``U`` at random, and the average of a turning ``U`` shrinks
    towards zero. ``Omega`` solves ``G Omega + Omega G = 2 antisym(U^T direction)``,
    ``G = U^T U``, in ``G``'s eigenbasis (``K x K``)."""
    gram = pt.dot(loadings.T, loadings)
    lam, vecs = pt.linalg.eigh(gram)
    product = pt.dot(loadings.T, direction)
    turn = pt.dot(vecs.T, pt.dot(product - product.T, vecs))  # 2 antisym, eigenbasis
    omega = turn / pt.maximum(lam[:, None] + lam[None, :], 1e-300)
    return direction - pt.dot(loadings, pt.dot(vecs, pt.dot(omega, vecs.T)))


def _largest_abs_eigenvalue(sym: Variable) -> Variable:
    """``max |eig|`` of a symmetric ``K x K`` matrix; its Frobenius norm (an upper bound) when
    ``K`` is large, where an eigendecomposition per step would dominate the cost."""
    if sym.type.shape[0] > 200:
        return pt.sqrt(pt.sum(pt.square(sym)))
    # a draw with a non-finite gradient must reach the step's guard (which refuses the step),
    # not LAPACK, which raises on it
    finite = pt.all(pt.isfinite(sym))
    largest = pt.max(pt.abs(pt.linalg.eigh(pt.switch(finite, sym, 0.0))[0]))
    return pt.switch(finite, largest, np.nan)
