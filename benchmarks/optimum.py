"""The exact full-rank Gaussian variational optimum of a PyMC model: what no Gaussian VI can beat
(how it is computed: ``benchmarks/README.md``)."""

from __future__ import annotations

import time

from dataclasses import dataclass

import numpy as np

from scipy import optimize, stats

_LOG_2PI = float(np.log(2.0 * np.pi))


@dataclass
class GaussianOptimum:
    mean: np.ndarray
    chol: np.ndarray
    elbo: float
    elbo_mcse: float
    agreement: float  # seed to seed: max(largest mean difference in sds, relative sd difference)
    grad_evals: int
    wall_time: float


class _Counted:
    """The batched ``X (N, D) -> (logp, dlogp)`` in chunks, counting the points evaluated."""

    def __init__(self, fn, chunk: int = 8192):
        self.fn, self.chunk, self.points = fn, chunk, 0

    def __call__(self, x: np.ndarray):
        self.points += len(x)
        parts = [self.fn(np.ascontiguousarray(x[i : i + self.chunk]))
                 for i in range(0, len(x), self.chunk)]  # fmt: skip
        return tuple(np.concatenate([np.asarray(p[k], dtype=float) for p in parts]) for k in (0, 1))


def _minimize(loss, x, restarts: int, **options):
    """L-BFGS-B restarted while it improves (a non-finite trial point ends a run early)."""
    best = np.inf
    for _ in range(restarts):
        res = optimize.minimize(loss, x, jac=True, method="L-BFGS-B", options=options)
        x, improved = res.x, best - res.fun > 1e-12 * max(1.0, abs(res.fun))
        best = min(best, res.fun)
        if not improved:
            break
    return res


def _hessian(f: _Counted, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Hessian of ``-log p`` by central differences of the gradient, and the gradient."""
    dim, h = len(x), 1e-5 * np.maximum(1.0, np.abs(x))
    _, grad = f(np.concatenate([x + np.diag(h), x - np.diag(h), x[None]]))
    hess = -(grad[:dim] - grad[dim : 2 * dim]) / (2.0 * h[:, None])
    return 0.5 * (hess + hess.T), grad[-1]


def _map(f: _Counted, x: np.ndarray) -> np.ndarray:
    def loss(x):
        logp, grad = f(x[None])
        return (np.inf, np.zeros_like(x)) if not np.isfinite(logp[0]) else (-logp[0], -grad[0])

    x = _minimize(loss, x, 20, maxiter=10_000, maxfun=20_000, gtol=1e-10, ftol=1e-15).x
    logp = f(x[None])[0][0]
    for _ in range(20):  # Newton steps (eigenvalues made positive), halved until log p rises
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


def gaussian_optimum(model, draws: int = 2**16, seed: int = 0, check_draws: int = 2**15,
                     maxiter: int = 5000, initial=None) -> GaussianOptimum:  # fmt: skip
    """``draws`` antithetic Sobol draws per optimisation (two scramblings from ``seed``),
    ``check_draws`` fresh draws for the checks; ``initial = (mean, cov)`` replaces the MAP and
    its Laplace approximation as the start and whitening."""
    from pymc_gpf import BatchedTarget

    start = time.perf_counter()
    target = BatchedTarget(model)
    f = _Counted(target.compile_logp_dlogp(backend="c"))
    if initial is None:
        m0 = _map(f, target.start_vector())
        eigval, eigvec = np.linalg.eigh(_hessian(f, m0)[0])
        eigval = np.maximum(eigval, 1e-8 * max(eigval.max(), 1e-300))
        cov = (eigvec / eigval) @ eigvec.T
        chol0 = np.linalg.cholesky(0.5 * (cov + cov.T))
    else:
        m0, chol0 = np.asarray(initial[0], float), np.linalg.cholesky(np.asarray(initial[1], float))
    dim = len(m0)
    rows, cols = np.tril_indices(dim)
    diag = rows == cols

    def unpack(theta):  # B
        b = np.zeros((dim, dim))
        b[rows, cols] = np.where(diag, np.exp(theta[dim:]), theta[dim:])
        return b

    def terms(theta, z):  # per-draw log p, whitened gradients h = L0^T grad, and B
        b = unpack(theta)
        logp, grad = f(m0 + (theta[:dim] + z @ b.T) @ chol0.T)
        return logp, grad @ chol0, b

    def loss(theta, z):
        logp, h, b = terms(theta, z)
        if not np.all(np.isfinite(logp)) or not np.all(np.isfinite(h)):
            return np.inf, np.zeros_like(theta)
        gb = (h.T @ z) / len(z)
        gb[np.diag_indices(dim)] = np.diag(gb) * np.diag(b) + 1.0
        grad = np.concatenate([h.mean(axis=0), gb[rows, cols]])
        return -float(logp.mean() + np.sum(theta[dim:][diag])), -grad

    fits = []
    for k in range(2):
        sobol = stats.qmc.Sobol(dim, scramble=True, rng=np.random.default_rng([seed, k]))
        u = sobol.random(draws // 2)
        z = np.concatenate([stats.norm.ppf(u), -stats.norm.ppf(u)])  # antithetic
        theta = _minimize(lambda t, z=z: loss(t, z), np.zeros(dim + len(rows)), 5,
                          maxiter=maxiter, maxfun=2 * maxiter, gtol=1e-8, ftol=1e-15).x  # fmt: skip
        fits.append((theta, m0 + chol0 @ theta[:dim], chol0 @ unpack(theta)))
    (theta, mean, chol), (_, mean2, chol2) = fits
    sd, sd2 = np.sqrt(np.sum(chol**2, axis=1)), np.sqrt(np.sum(chol2**2, axis=1))
    z = np.random.default_rng([seed, 2]).standard_normal((check_draws, dim))
    logp, _, _ = terms(theta, z)
    ratio = logp + 0.5 * np.sum(z**2, axis=1) + 0.5 * dim * _LOG_2PI  # log p − log q + log det L
    elbo = float(ratio.mean()) + float(np.sum(theta[dim:][diag]) + np.sum(np.log(np.diag(chol0))))
    agreement = max(np.max(np.abs(mean - mean2) / sd), np.max(np.abs(sd - sd2) / sd))
    return GaussianOptimum(mean, chol, elbo, float(ratio.std(ddof=1) / np.sqrt(check_draws)),
                           float(agreement), f.points, time.perf_counter() - start)  # fmt: skip


def constrained_draws(model, opt: GaussianOptimum, draws: int, seed: int) -> dict[str, np.ndarray]:
    """I.i.d. draws of ``q*`` as constrained variables and deterministics ``{var: (S, ...)}``."""
    from pymc_gpf import BatchedTarget

    z = np.random.default_rng(seed).standard_normal((draws, len(opt.mean)))
    return BatchedTarget(model).compile_constrained(backend="c")(opt.mean + z @ opt.chol.T)
