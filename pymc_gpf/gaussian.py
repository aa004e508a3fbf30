"""Gaussian helpers shared by the methods whose q is a Gaussian (GPF, GF).

:class:`GaussianQ` is the fitted ``q = N(m, C)`` with a block-diagonal ``C = F_b F_b^T`` given
by factors (GPF: ``F = Z^T / sqrt(N)``, eq. 16; GF: ``F = Gamma``), in NumPy: draws, the
density, and a regularised density for a degenerate ``C``. Nothing forms a ``D x D`` matrix.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np
import pytensor.tensor as pt

from pytensor.graph.basic import Variable

__all__ = ["LOG_2PI", "LOG_2PI_E", "GaussianQ", "logdet_spd"]

LOG_2PI = float(np.log(2 * np.pi))
LOG_2PI_E = LOG_2PI + 1.0


def logdet_spd(a: Variable) -> Variable:
    """``log det A`` of a symmetric positive definite matrix (``nan`` if it is not)."""
    return 2.0 * pt.sum(pt.log(pt.diagonal(pt.linalg.cholesky(a, on_error="nan"))))


@dataclass(frozen=True)
class _Basis:
    """A factor's column space: orthonormal ``u`` ``(D_b, r)`` and the standard deviations
    ``s`` ``(r,)`` of q along it (the non-zero singular values of the factor)."""

    u: np.ndarray
    s: np.ndarray


@dataclass(frozen=True)
class GaussianQ:
    """``N(mean, C)`` with ``C`` block-diagonal: block ``b`` (coordinates ``blocks[b]``) has
    covariance ``F_b F_b^T`` for a factor ``F_b`` ``(D_b, K_b)``, or ``diag(F_b^2)`` for a
    vector of scales ``F_b`` ``(D_b,)`` (mean field).

    When a factor has rank ``r_b < D_b`` (GPF with ``N <= D_b``, GF with ``K_b < D_b``) q is
    degenerate: it lives on an affine subspace and has no density on ``R^D``.
    ``ridge=lam`` then gives the proper Gaussian ``N(m, C + lam (I - P))``, ``P`` the projector
    on ``C``'s range: the fitted directions unchanged and variance ``lam`` in the ``D_b - r_b``
    missing ones (with ``lam = 1`` its entropy is the regularised one of the free energy).

    ``coupling`` ``C`` ``(D_1, K_0)`` adds ``C xi_0`` to block 1 (``xi_0`` block 0's standard
    normals): the arrow factor ``[[F_0, 0], [C, diag(F_1)]]`` of GF's hierarchical
    structure, whose block 0 is square and of full rank.

    ``loadings`` ``U`` ``(D, K)`` adds ``U xi`` (``xi`` ``K`` standard normals of its own) to
    every coordinate: with one block of scales, ``C = U U^T + diag(s^2)``, GF's low-rank
    structure (density by Woodbury's identity, ``O(S D K)``).
    """

    mean: np.ndarray
    blocks: tuple[np.ndarray, ...]
    factors: tuple[np.ndarray, ...]
    ridge: float | None = None
    coupling: np.ndarray | None = None
    loadings: np.ndarray | None = None

    @cached_property
    def _bases(self) -> tuple[_Basis | None, ...]:
        """SVD of every matrix factor (``None`` for a vector of scales)."""
        out = []
        for f in self.factors:
            if f.ndim == 1:
                out.append(None)
                continue
            u, s, _ = np.linalg.svd(f, full_matrices=False)
            keep = s > max(f.shape) * np.finfo(f.dtype).eps * (s[0] if len(s) else 0.0)
            out.append(_Basis(u[:, keep], s[keep]))
        return tuple(out)

    @property
    def ndim(self) -> int:
        return len(self.mean)

    @property
    def ranks(self) -> list[int]:
        """Rank of each block's covariance."""
        return [
            int(np.count_nonzero(f)) if b is None else len(b.s)
            for f, b in zip(self.factors, self._bases, strict=True)
        ]

    @property
    def rank(self) -> int:
        return sum(self.ranks)

    @property
    def degenerate(self) -> bool:
        """True when C is singular (and no ``ridge`` makes the density proper)."""
        return self.rank < self.ndim and self.ridge is None

    def smallest_variance(self) -> float:
        """The smallest non-zero eigenvalue of C (the default ridge: by Theorem 3 the
        eigenvalues GPF leaves out of a Gaussian target are at most this)."""
        values = [
            np.square(f[f != 0]) if b is None else np.square(b.s)
            for f, b in zip(self.factors, self._bases, strict=True)
        ]
        return float(np.min(np.concatenate(values)))

    def marginal_variances(self) -> np.ndarray:
        """The diagonal of C (``(D,)``)."""
        out = np.empty(self.ndim, dtype=self.mean.dtype)
        for b, f in zip(self.blocks, self.factors, strict=True):
            out[b] = np.square(f) if f.ndim == 1 else np.sum(np.square(f), axis=1)
        if self.coupling is not None:
            out[self.blocks[1]] += np.sum(np.square(self.coupling), axis=1)
        if self.loadings is not None:
            out += np.sum(np.square(self.loadings), axis=1)
        return out

    def covariance(self) -> np.ndarray:
        """C as a dense ``(D, D)`` matrix (with the ridge, if any): for models small enough
        to afford one (the mode search, :mod:`pymc_gpf.modes`)."""
        out = np.zeros((self.ndim, self.ndim))
        for b, f, basis in zip(self.blocks, self.factors, self._bases, strict=True):
            f = f.astype(float)
            out[np.ix_(b, b)] = np.diag(f**2) if f.ndim == 1 else f @ f.T
            if self.ridge is not None and basis is not None and basis.u.shape[1] < len(b):
                out[np.ix_(b, b)] += self.ridge * (np.eye(len(b)) - basis.u @ basis.u.T)
        if self.coupling is not None:  # the arrow factor's off-diagonal block
            first, second = self.blocks[0], self.blocks[1]
            cross = self.coupling @ self.factors[0].T
            out[np.ix_(second, second)] += self.coupling @ self.coupling.T
            out[np.ix_(second, first)] += cross
            out[np.ix_(first, second)] += cross.T
        if self.loadings is not None:
            out += self.loadings @ self.loadings.T
        return out

    def with_ridge(self, ridge: float) -> GaussianQ:
        return replace(self, ridge=float(ridge))

    def widened(self, factor: float) -> GaussianQ:
        """The same Gaussian with ``factor`` times its standard deviations."""

        def times(a):
            return None if a is None else a * factor

        ridge = None if self.ridge is None else self.ridge * factor**2
        factors = tuple(f * factor for f in self.factors)
        return GaussianQ(
            self.mean, self.blocks, factors, ridge, times(self.coupling), times(self.loadings)
        )

    # ----------------------------------------------------------------------- draws
    def sample(self, draws: int, rng: np.random.Generator) -> np.ndarray:
        """``(draws, D)``: ``m_b + F_b xi`` per block, ``xi ~ N(0, I_{K_b})`` (eq. 16 for
        GPF), plus ``sqrt(ridge)`` times noise projected off C's range."""
        out = np.empty((draws, self.ndim), dtype=self.mean.dtype)
        first = None
        for b, f in zip(self.blocks, self.factors, strict=True):
            if f.ndim == 1:
                out[:, b] = self.mean[b] + rng.standard_normal((draws, len(b))) * f
            else:
                xi = rng.standard_normal((draws, f.shape[1]))
                out[:, b] = self.mean[b] + xi @ f.T
                first = xi if first is None else first
        if self.coupling is not None:
            out[:, self.blocks[1]] += first @ self.coupling.T
        if self.loadings is not None:
            out += rng.standard_normal((draws, self.loadings.shape[1])) @ self.loadings.T
        if self.ridge is not None:
            for b, basis in zip(self.blocks, self._bases, strict=True):
                if basis is not None and basis.u.shape[1] < len(b):
                    eps = rng.standard_normal((draws, len(b)))
                    off = eps - (eps @ basis.u) @ basis.u.T
                    out[:, b] += np.sqrt(self.ridge) * off
        return out

    # --------------------------------------------------------------------- density
    def logpdf(self, points: np.ndarray, rtol: float = 1e-8) -> np.ndarray:
        """``log q(x)`` for rows of ``points`` ``(S, D)``. For a degenerate q without a
        ridge: the density on its affine support (w.r.t. Lebesgue measure there), ``-inf``
        off it. ``O(S D r)``."""
        squared, constant = self._whitened(points, rtol)
        return constant - 0.5 * squared

    def logpdf_widened(self, points: np.ndarray, factor: float) -> tuple[np.ndarray, np.ndarray]:
        """``log q(x)`` and the log-density of :meth:`widened` ``(factor)`` at the same
        points, from one whitening of them."""
        squared, constant = self._whitened(points)
        dims = self.ndim if self.ridge is not None else self.rank
        wide = constant - 0.5 * squared / factor**2 - dims * np.log(factor)
        return constant - 0.5 * squared, wide

    def distance(self, points: np.ndarray) -> np.ndarray:
        """The Mahalanobis distance of each row of ``points`` ``(S, D)`` from q's mean, in
        q's metric (on a degenerate q without a ridge: within its support)."""
        return np.sqrt(self._whitened(points)[0])

    def _whitened(self, points: np.ndarray, rtol: float = 1e-8) -> tuple[np.ndarray, np.ndarray]:
        """Per point the squared Mahalanobis distance from the mean and the log-density's
        constant (``-inf`` off the support of a degenerate q without a ridge)."""
        dev = np.atleast_2d(points) - self.mean
        if self.coupling is not None:  # block 1 given block 0's standard normals
            dev = dev.copy()
            xi = np.linalg.solve(self.factors[0], dev[:, self.blocks[0]].T).T
            dev[:, self.blocks[1]] -= xi @ self.coupling.T
        squared = np.zeros(len(dev))
        constant = np.zeros(len(dev))
        if self.loadings is not None:  # Woodbury: minus the part the loadings explain
            whitened = self.loadings / self.factors[0][:, None]
            chol = np.linalg.cholesky(np.eye(whitened.shape[1]) + whitened.T @ whitened)
            explained = np.linalg.solve(chol, ((dev / self.factors[0]) @ whitened).T).T
            squared -= np.sum(np.square(explained), axis=1)
            constant -= np.sum(np.log(np.diag(chol)))
        for b, f, basis in zip(self.blocks, self.factors, self._bases, strict=True):
            x = dev[:, b]
            if basis is None:
                squared += np.sum((x / f) ** 2, axis=1)
                constant -= np.sum(np.log(np.abs(f))) + 0.5 * len(b) * LOG_2PI
                continue
            coef = x @ basis.u
            squared += np.sum((coef / basis.s) ** 2, axis=1)
            constant -= np.sum(np.log(basis.s)) + 0.5 * len(basis.s) * LOG_2PI
            missing = len(b) - len(basis.s)
            if missing:
                residual = np.sum((x - coef @ basis.u.T) ** 2, axis=1)
                if self.ridge is None:
                    scale = np.sum(x**2, axis=1) + np.sum(basis.s**2)
                    constant = np.where(residual <= rtol**2 * scale, constant, -np.inf)
                else:
                    squared += residual / self.ridge
                    constant -= 0.5 * missing * (LOG_2PI + np.log(self.ridge))
        return squared, constant
