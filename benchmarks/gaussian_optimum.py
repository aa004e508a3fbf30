"""The exact full-rank Gaussian variational optimum of a PyMC model, as ground truth.

``q* = N(m*, L* L*^T)`` on the flat unconstrained coordinates of
``pymc_gpf.BatchedTarget(model)`` maximises ``ELBO(q) = E_q[log p(x)] + H[q]`` over all
Gaussians (``log p`` is ``model.logp()``, log-Jacobians included): the best any Gaussian VI
can do. It is computed independently of pymc-gpf's fitting code, only from the batched
``(logp, dlogp)`` of ``BatchedTarget.compile_logp_dlogp``:

1. **MAP** ``m0`` by scipy's L-BFGS-B from the model's initial point, and the Hessian of
   ``-log p`` there by central differences of the gradient (one batched call of 2D rows);
   ``L0 = chol(H^-1)`` (eigenvalues clipped to stay positive definite) whitens the problem.
2. **Sample-average approximation.** ``q = N(m0 + L0 a, (L0 B)(L0 B)^T)`` with ``B`` lower
   triangular (log-diagonal), so ``L = L0 B`` is the Cholesky factor. A fixed set of ``S``
   standard-normal draws ``z`` (scrambled Sobol points mapped by the normal quantile, and
   their negatives: antithetic, so odd moments cancel exactly) turns the ELBO into the
   deterministic ``mean_s log p(m0 + L0 (a + B z_s)) + sum log B_ii`` (+ constants), whose
   reparameterisation gradient is ``mean_s h_s`` for ``a`` and ``tril(mean_s h_s z_s^T) +
   diag(1 / B_ii)`` for ``B`` (``h_s = L0^T grad log p``, the chain rule of
   ``d/dm = mean grad``, ``d/dL = mean grad z^T + L^-T``). It is maximised by scipy's L-BFGS-B
   from ``a = 0, B = I`` (the Laplace approximation) to a tight gradient tolerance.
3. **Checks.** With a fresh set of independent i.i.d. draws: the ELBO and its Monte Carlo
   standard error, and the norm of the ELBO gradient in the whitened parameters next to the
   norm Monte Carlo noise alone would give at an exact optimum (``grad_noise``). A second
   optimisation with another scrambling gives the seed-to-seed agreement: the largest
   difference of means in units of the optimum's sds (``seed_dmean``) and the largest
   relative difference of sds (``seed_dsd``).

``grad_evals`` counts every point at which the log density and its gradient were evaluated
(MAP, Hessian, both optimisations, the checks); ``info`` splits it by stage.
"""

from __future__ import annotations

import time

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from scipy import optimize, stats

_LOG_2PI = float(np.log(2.0 * np.pi))


@dataclass
class GaussianOptimum:
    """``q* = N(mean, chol chol^T)`` on the flat unconstrained coordinates ``labels``."""

    mean: np.ndarray
    chol: np.ndarray
    labels: list[str]
    elbo: float
    elbo_mcse: float
    grad_norm: float
    grad_noise: float
    seed_dmean: float
    seed_dsd: float
    grad_evals: int
    wall_time: float
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def sd(self) -> np.ndarray:
        return np.sqrt(np.sum(self.chol**2, axis=1))

    @property
    def agreement(self) -> float:
        """Seed-to-seed agreement: ``max(seed_dmean, seed_dsd)``."""
        return max(self.seed_dmean, self.seed_dsd)


class _Counted:
    """The batched ``X (N, D) -> (logp, dlogp)``, in chunks of at most ``chunk`` rows (to
    bound memory), counting the points it evaluates."""

    def __init__(self, fn, chunk: int = 8192):
        self.fn = fn
        self.chunk = chunk
        self.points = 0

    def __call__(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        self.points += len(x)
        parts = [
            self.fn(np.ascontiguousarray(x[i : i + self.chunk]))
            for i in range(0, len(x), self.chunk)
        ]
        logp = np.concatenate([np.asarray(p[0], dtype=float) for p in parts])
        return logp, np.concatenate([np.asarray(p[1], dtype=float) for p in parts])


def normal_draws(n: int, dim: int, seed: int | list[int]) -> np.ndarray:
    """``n`` antithetic quasi-random standard-normal draws ``(n, dim)``: ``n / 2`` scrambled
    Sobol points (a power of two) mapped by the normal quantile, then their negatives."""
    half = n // 2
    if half < 1 or half & (half - 1):
        raise ValueError(f"draws must be twice a power of two, got {n}")
    u = stats.qmc.Sobol(dim, scramble=True, rng=np.random.default_rng(seed)).random(half)
    z = stats.norm.ppf(u)
    return np.concatenate([z, -z])


def _map(f: _Counted, x: np.ndarray, restarts: int = 20) -> tuple[np.ndarray, bool]:
    """The mode of ``log p`` by scipy's L-BFGS-B, restarted while it improves (a trial point
    with a non-finite density stops a run early: a restart begins with a short step), then
    polished by Newton steps. Returns the mode and whether the last run converged."""

    def loss(x):
        logp, grad = f(x[None])
        if not np.isfinite(logp[0]):
            return np.inf, np.zeros_like(x)
        return -logp[0], -grad[0]

    best = np.inf
    for _ in range(restarts):
        res = optimize.minimize(
            loss,
            x,
            jac=True,
            method="L-BFGS-B",
            options={"maxiter": 10_000, "maxfun": 20_000, "gtol": 1e-10, "ftol": 1e-15},
        )
        x, improved = res.x, best - res.fun > 1e-12 * max(1.0, abs(res.fun))
        best = min(best, res.fun)
        if not improved:
            break
    return _newton(f, x), bool(res.success)


def _newton(f: _Counted, x: np.ndarray, steps: int = 20) -> np.ndarray:
    """Newton steps on the finite-difference Hessian (eigenvalues made positive), halved
    until the log density increases."""
    logp = f(x[None])[0][0]
    for _ in range(steps):
        hess, grad = _hessian(f, x)
        eigval, eigvec = np.linalg.eigh(hess)
        eigval = np.maximum(np.abs(eigval), 1e-12 * np.abs(eigval).max())
        step = eigvec @ ((eigvec.T @ grad) / eigval)
        for _ in range(30):
            new = f((x + step)[None])[0][0]
            if new > logp:
                break
            step = step / 2
        else:
            break
        x, logp = x + step, new
    return x


def _hessian(f: _Counted, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Hessian of ``-log p`` at ``x`` by central differences of the gradient (one batched
    call of ``2 D + 1`` points), and the gradient of ``log p`` there."""
    dim = len(x)
    h = 1e-5 * np.maximum(1.0, np.abs(x))
    steps = np.diag(h)
    _, grad = f(np.concatenate([x + steps, x - steps, x[None]]))
    hess = -(grad[:dim] - grad[dim : 2 * dim]) / (2.0 * h[:, None])
    return 0.5 * (hess + hess.T), grad[-1]


def _laplace_chol(f: _Counted, m0: np.ndarray) -> tuple[np.ndarray, bool]:
    """Cholesky factor of the inverse Hessian of ``-log p`` at ``m0`` (central differences of
    the gradient; eigenvalues clipped at ``1e-8`` of the largest) and whether it was PD."""
    hess, _ = _hessian(f, m0)
    eigval, eigvec = np.linalg.eigh(hess)
    positive = bool(eigval.min() > 0)
    eigval = np.maximum(eigval, 1e-8 * max(eigval.max(), 1e-300))
    cov = (eigvec / eigval) @ eigvec.T
    return np.linalg.cholesky(0.5 * (cov + cov.T)), positive


class _Whitened:
    """``q = N(m0 + L0 a, (L0 B)(L0 B)^T)`` packed as ``theta = (a, tril(B))`` with a log
    diagonal; minus the ELBO over fixed draws, and its gradient."""

    def __init__(self, f: _Counted, m0: np.ndarray, chol0: np.ndarray):
        self.f, self.m0, self.chol0 = f, m0, chol0
        self.dim = dim = len(m0)
        self.rows, self.cols = np.tril_indices(dim)
        self.diag = self.rows == self.cols
        self.const = float(np.sum(np.log(np.diag(chol0)))) + 0.5 * dim * (1.0 + _LOG_2PI)

    def start(self) -> np.ndarray:
        return np.zeros(self.dim + len(self.rows))

    def unpack(self, theta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        b = np.zeros((self.dim, self.dim))
        v = theta[self.dim :]
        b[self.rows, self.cols] = np.where(self.diag, np.exp(v), v)
        return theta[: self.dim], b

    def gaussian(self, theta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        a, b = self.unpack(theta)
        return self.m0 + self.chol0 @ a, self.chol0 @ b

    def terms(self, theta: np.ndarray, z: np.ndarray):
        """Per-draw ``log p``, whitened gradients ``h = L0^T grad``, and ``B``."""
        a, b = self.unpack(theta)
        logp, grad = self.f(self.m0 + (a + z @ b.T) @ self.chol0.T)
        return logp, grad @ self.chol0, b

    def gradient(self, h: np.ndarray, z: np.ndarray, b: np.ndarray) -> np.ndarray:
        """ELBO gradient in ``theta`` from per-draw whitened gradients ``h``."""
        gb = (h.T @ z) / len(z)
        gb[np.diag_indices(self.dim)] = np.diag(gb) * np.diag(b) + 1.0
        return np.concatenate([h.mean(axis=0), gb[self.rows, self.cols]])

    def loss(self, theta: np.ndarray, z: np.ndarray) -> tuple[float, np.ndarray]:
        logp, h, b = self.terms(theta, z)
        if not np.all(np.isfinite(logp)) or not np.all(np.isfinite(h)):
            return np.inf, np.zeros_like(theta)
        elbo = logp.mean() + np.sum(theta[self.dim :][self.diag])
        return -float(elbo), -self.gradient(h, z, b)

    def fit(self, z: np.ndarray, maxiter: int, restarts: int = 5) -> optimize.OptimizeResult:
        """L-BFGS-B from the Laplace approximation, restarted while it improves (as
        :func:`_map`); ``nit`` sums the iterations of all runs."""
        theta, best, nit = self.start(), np.inf, 0
        for _ in range(restarts):
            res = optimize.minimize(
                self.loss,
                theta,
                args=(z,),
                jac=True,
                method="L-BFGS-B",
                options={"maxiter": maxiter, "maxfun": 2 * maxiter, "gtol": 1e-8, "ftol": 1e-15},
            )
            theta, nit = res.x, nit + res.nit
            improved = best - res.fun > 1e-12 * max(1.0, abs(res.fun))
            best = min(best, res.fun)
            if not improved:
                break
        res.nit = nit
        return res

    def check(self, theta: np.ndarray, z: np.ndarray) -> dict[str, float]:
        """Fresh i.i.d. draws: ELBO, its standard error, gradient norm and noise norm."""
        logp, h, b = self.terms(theta, z)
        log_det = float(np.sum(theta[self.dim :][self.diag]))
        log_q = -0.5 * np.sum(z**2, axis=1) - 0.5 * self.dim * _LOG_2PI
        ratio = logp - log_q  # per-draw log p - log q, up to log det L (added below)
        n = len(z)
        var_a = h.var(axis=0)
        second = (h**2).T @ (z**2) / n - ((h.T @ z) / n) ** 2  # var of h_i z_j
        scale = np.where(self.diag, np.exp(2.0 * theta[self.dim :]), 1.0)
        var_b = second[self.rows, self.cols] * scale
        return {
            "elbo": float(ratio.mean()) + log_det + float(np.sum(np.log(np.diag(self.chol0)))),
            "elbo_mcse": float(ratio.std(ddof=1) / np.sqrt(n)),
            "grad_norm": float(np.linalg.norm(self.gradient(h, z, b))),
            "grad_noise": float(np.sqrt((var_a.sum() + var_b.sum()) / n)),
        }


def gaussian_optimum(
    model,
    draws: int = 2**16,
    seed: int = 0,
    check_draws: int = 2**15,
    maxiter: int = 5000,
    backend: str | None = "c",
    initial: tuple[np.ndarray, np.ndarray] | None = None,
) -> GaussianOptimum:
    """The full-rank Gaussian VI optimum of ``model`` (see the module docstring): ``draws``
    antithetic Sobol draws for the optimisation (two independent scramblings, from ``seed``),
    ``check_draws`` fresh i.i.d. draws for the checks. ``start = (mean, cov)`` (e.g. a
    reference sample's moments) replaces the MAP and its Laplace approximation as the
    starting Gaussian and whitening: a centred hierarchical model has no MAP (its density
    grows without bound as the group scale shrinks)."""
    from pymc_gpf import BatchedTarget

    start = time.perf_counter()
    target = BatchedTarget(model)
    f = _Counted(target.compile_logp_dlogp(backend=backend))
    compiled = time.perf_counter()
    counts: dict[str, int] = {}

    def stage(name: str, before: int) -> None:
        counts[name] = f.points - before

    if initial is None:
        m0, map_converged = _map(f, target.start_vector())
        stage("map", 0)
        before = f.points
        chol0, positive = _laplace_chol(f, m0)
        stage("hessian", before)
    else:
        m0, map_converged, positive = np.asarray(initial[0], dtype=float), None, None
        chol0 = np.linalg.cholesky(np.asarray(initial[1], dtype=float))
    problem = _Whitened(f, m0, chol0)

    fits = []
    for k in range(2):
        before = f.points
        res = problem.fit(normal_draws(draws, problem.dim, [seed, k]), maxiter)
        stage(f"fit{k + 1}", before)
        fits.append(res)
    (mean, chol), (mean2, chol2) = (problem.gaussian(r.x) for r in fits)
    sd, sd2 = np.sqrt(np.sum(chol**2, axis=1)), np.sqrt(np.sum(chol2**2, axis=1))

    before = f.points
    fresh = np.random.default_rng([seed, 2]).standard_normal((check_draws, problem.dim))
    check = problem.check(fits[0].x, fresh)
    stage("check", before)

    info = {
        "compile_time": compiled - start,
        "evals": counts,
        "map_converged": map_converged,
        "laplace_pd": positive,
        "nit": [int(r.nit) for r in fits],
        "success": [bool(r.success) for r in fits],
        "message": [str(r.message) for r in fits],
        "saa_elbo": [problem.const - float(r.fun) for r in fits],
        "saa_grad_max": [float(np.max(np.abs(r.jac))) for r in fits],
    }
    return GaussianOptimum(
        mean=mean,
        chol=chol,
        labels=list(target.labels),
        elbo=check["elbo"],
        elbo_mcse=check["elbo_mcse"],
        grad_norm=check["grad_norm"],
        grad_noise=check["grad_noise"],
        seed_dmean=float(np.max(np.abs(mean - mean2) / sd)),
        seed_dsd=float(np.max(np.abs(sd - sd2) / sd)),
        grad_evals=f.points,
        wall_time=time.perf_counter() - start,
        info=info,
    )


def flat_draws(opt: GaussianOptimum, draws: int, seed: int) -> np.ndarray:
    """I.i.d. draws ``(draws, D)`` of ``q*`` on the flat unconstrained coordinates."""
    z = np.random.default_rng(seed).standard_normal((draws, len(opt.mean)))
    return opt.mean + z @ opt.chol.T


def constrained_draws(
    model, opt: GaussianOptimum, draws: int = 10_000, seed: int = 0, backend: str | None = "c"
) -> dict[str, np.ndarray]:
    """Draws of ``q*`` as constrained free variables and deterministics ``{var: (S, ...)}``
    (``BatchedTarget.compile_constrained``), to compare with a reference like any fit."""
    from pymc_gpf import BatchedTarget

    target = BatchedTarget(model)
    if list(target.labels) != opt.labels:
        raise ValueError("the optimum was computed on another model's coordinates")
    return target.compile_constrained(backend=backend)(flat_draws(opt, draws, seed))
