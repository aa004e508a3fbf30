"""GPF on a banana: particles and optimisers against the exact Gaussian VI optimum (paper Fig. 5).

The target p(x) ∝ exp(−½(0.01 x₁² + 0.1(x₂ + 0.1 x₁² − 10)²)) is curved, so no Gaussian fits it;
the best one, N(m*, C*), is computed exactly here: log p is a polynomial of degree 4, so the free
energy F = −ELBO of a Gaussian is exact by Gauss–Hermite quadrature, minimised with BFGS. GPF
with N particles drawn from N(0, I₂) (the same cloud for every optimiser) runs the paper's
three optimisers: descent (momentum 0.1 after clipping each update to norm 10), elementwise
Adam 0.1 and dimension-wise Adam 0.1 (App. H). Descent and dimension-wise Adam move the cloud
by one affine map per step (the *affine residual* of the final particles regressed on the
initial ones is 0 up to rounding) and, with enough particles, end at the optimum; elementwise
Adam twists the cloud and ends worse. The script prints F(N(m, C)) − F* ≥ 0 (how much worse
the particles' Gaussian is than the optimum, a KL divergence) and the affine residual per
optimiser and N, and saves the clouds to ``gpf_banana.png``.

Run: ``python examples/gpf_banana.py [--steps N] [--out FILE] [--quick]``. ``--quick`` (or
``PYMC_GPF_EXAMPLES_QUICK=1``, for the test suite) runs N = 10 and 50 for 500 steps instead of
N = 3, 5, 10, 20, 50 for the paper's 2000.
"""

import argparse
import os
import warnings

import numpy as np
import pymc as pm

from matplotlib.figure import Figure
from scipy import optimize

import pymc_gpf

NODES, WEIGHTS = np.polynomial.hermite_e.hermegauss(8)  # exact up to degree 15


def banana_logp(x: np.ndarray) -> np.ndarray:
    return -0.5 * (0.01 * x[..., 0] ** 2 + 0.1 * (x[..., 1] + 0.1 * x[..., 0] ** 2 - 10) ** 2)


def free_energy(mean: np.ndarray, cov: np.ndarray) -> float:
    """F(q) = −E_q log p − H(q) of q = N(mean, cov), exact by quadrature."""
    nodes = np.stack(np.meshgrid(NODES, NODES, indexing="ij"), axis=-1).reshape(-1, 2)
    weights = np.outer(WEIGHTS, WEIGHTS).ravel() / WEIGHTS.sum() ** 2
    expected = weights @ banana_logp(mean + nodes @ np.linalg.cholesky(cov).T)
    return float(-expected - 0.5 * np.linalg.slogdet(cov)[1] - (1 + np.log(2 * np.pi)))


def gaussian_vi_optimum() -> tuple[np.ndarray, np.ndarray, float]:
    def factor(p):
        return np.array([[np.exp(p[2]), 0.0], [p[3], np.exp(p[4])]])

    res = optimize.minimize(
        lambda p: free_energy(p[:2], factor(p) @ factor(p).T),
        np.zeros(5),
        method="BFGS",
        options={"gtol": 1e-10},
    )
    return res.x[:2], factor(res.x) @ factor(res.x).T, float(res.fun)


def affine_residual(before: np.ndarray, after: np.ndarray) -> float:
    design = np.hstack([before, np.ones((len(before), 1))])
    coef, *_ = np.linalg.lstsq(design, after, rcond=None)
    return float(np.linalg.norm(design @ coef - after) / np.linalg.norm(after - after.mean(0)))


def ellipse(ax, mean, cov, **kwargs) -> None:
    """The 2σ ellipse of N(mean, cov)."""
    values, vectors = np.linalg.eigh(cov)
    angle = np.linspace(0, 2 * np.pi, 200)
    circle = np.stack([np.cos(angle), np.sin(angle)], 1) * 2 * np.sqrt(np.maximum(values, 0))
    path = mean + circle @ vectors.T
    ax.plot(path[:, 0], path[:, 1], **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="steps (default 2000)")
    parser.add_argument("--out", default="gpf_banana.png")
    parser.add_argument("--quick", action="store_true", help="N = 10, 50 and 500 steps")
    args = parser.parse_args()
    # fixed steps without a convergence test, on purpose: no FitWarning about it
    warnings.simplefilter("ignore", pymc_gpf.FitWarning)
    quick = args.quick or os.environ.get("PYMC_GPF_EXAMPLES_QUICK") == "1"
    particles = (10, 50) if quick else (3, 5, 10, 20, 50)
    steps = args.steps or (500 if quick else 2000)

    with pm.Model() as model:
        x = pm.Flat("x", shape=2)
        pm.Potential("banana", -0.5 * (0.01 * x[0] ** 2 + 0.1 * (x[1] + 0.1 * x[0] ** 2 - 10) ** 2))
    m_star, c_star, f_star = gaussian_vi_optimum()
    print(f"exact Gaussian VI optimum: m* = {np.round(m_star, 3)}, diag C* = "
          f"{np.round(np.diag(c_star), 3)}, F* = {f_star:.4f}")  # fmt: skip
    optimisers = {
        "descent": {"optimizer": "momentum", "clip_norm": 10.0},
        "elementwise Adam": {"optimizer": pymc_gpf.optimizers.Adam(dimension_wise=False)},
        "dimension-wise Adam": {"optimizer": "adam"},
    }
    fig = Figure(figsize=(2.6 * len(particles) + 0.4, 2.5 * len(optimisers)))
    axes = fig.subplots(len(optimisers), len(particles), squeeze=False)
    g1, g2 = np.meshgrid(np.linspace(-25, 25, 200), np.linspace(-25, 20, 200))
    density = np.exp(banana_logp(np.stack([g1, g2], axis=-1)))
    for row, (name, kwargs) in enumerate(optimisers.items()):
        for col, n in enumerate(particles):
            start = np.random.default_rng(n).normal(size=(n, 2))
            inference = pymc_gpf.GPF(initial_particles=start, model=model, random_seed=1)
            inference.fit(steps, learning_rate=0.1, progressbar=not quick, **kwargs)
            cloud = inference.approx.particles
            mean, z = cloud.mean(0), cloud - cloud.mean(0)
            cov = z.T @ z / n
            excess, residual = free_energy(mean, cov) - f_star, affine_residual(start, cloud)
            print(f"{name}, N = {n}: F - F* = {excess:.4g}, affine residual {residual:.3g}")
            ax = axes[row, col]
            ax.contourf(g1, g2, density, levels=12, cmap="Greys", alpha=0.6)
            ellipse(ax, m_star, c_star, color="k", ls="--", lw=1)
            ax.plot(cloud[:, 0], cloud[:, 1], ".", color="C0", ms=4)
            ellipse(ax, mean, cov, color="C3", lw=1.2)
            ax.set(xlim=(-25, 25), ylim=(-25, 20), aspect="equal", title=f"N = {n}")
            if col == 0:
                ax.set_ylabel(name)
    fig.suptitle("GPF particles (dots), their N(m, C) (red),\nthe Gaussian VI optimum (dashed)")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"particle clouds saved to {args.out}")


if __name__ == "__main__":
    main()
