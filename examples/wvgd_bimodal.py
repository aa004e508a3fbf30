"""WVGD on a bimodal posterior: the WVGD paper's one-dimensional playground.

theta ~ N(0, 2^2) and three observations x ~ N(theta^2, 0.2^2). The sign of theta is not
identified, so the posterior has two mirror-image modes near +-sqrt(mean x). ``pm.fit(method=
"wvgd")`` with two particles puts one particle in each mode, with cell weights of about 1/2. The
step size is automatic (the default): natural-gradient steps inside a trust region, halved when
the free energy stops falling, and the fit stops by itself. The script prints the particles,
the weights and the evidence bound (the ELBO of the fitted mixture, estimated by
``pymc_gpf.diagnose`` from fresh draws), compared with log p(x) by quadrature and with one
particle (mean-field VI, one mode only). It saves the exact posterior and the fitted mixture
density (``approx.logq``) to ``wvgd_bimodal.png``.

Run: ``python examples/wvgd_bimodal.py [--steps N] [--out FILE] [--quick]``. ``--steps`` caps
the number of steps (default: pymc-gpf's maximum, 10 000). ``--quick`` (or
``PYMC_GPF_EXAMPLES_QUICK=1``, for the test suite) only hides the progress bars.
"""

import argparse
import os

import numpy as np
import pymc as pm

from matplotlib.figure import Figure
from scipy import stats
from scipy.special import logsumexp

import pymc_gpf  # registers method="wvgd" with pm.fit

X = np.array([1.9, 2.1, 2.3])  # observations, theta^2 ~ 2.1


def log_joint(theta: np.ndarray) -> np.ndarray:
    return stats.norm.logpdf(theta, 0, 2) + stats.norm.logpdf(X, theta[:, None] ** 2, 0.2).sum(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="maximum number of steps")
    parser.add_argument("--out", default="wvgd_bimodal.png")
    parser.add_argument("--quick", action="store_true", help="no progress bar, for tests")
    args = parser.parse_args()
    quick = args.quick or os.environ.get("PYMC_GPF_EXAMPLES_QUICK") == "1"

    with pm.Model() as model:
        theta = pm.Normal("theta", 0, 2)
        pm.Normal("x", theta**2, 0.2, observed=X)

    grid = np.linspace(-4, 4, 8001)
    log_evidence = logsumexp(log_joint(grid)) + np.log(grid[1] - grid[0])

    bounds = {}
    for n_particles in (1, 2):
        # init_scale spreads the particles and local Gaussians on the prior's scale, so that
        # they reach both modes
        approx = pm.fit(
            args.steps,
            method="wvgd",
            model=model,
            inf_kwargs={"n_particles": n_particles, "draws_per_particle": 100, "init_scale": 1.0},
            random_seed=2,
            progressbar=not quick,
        )
        print(f"{n_particles} particle(s): {approx.outcome.step} steps, {approx.outcome.message}")
        bounds[n_particles] = pymc_gpf.diagnose(approx, 20_000, random_seed=4).elbo
    # `approx` is now the two-particle fit
    order = np.argsort(approx.particles[:, 0])
    print("particles:", np.array2string(approx.particles[order, 0], precision=3))
    print("cell weights:", np.array2string(approx.cell_weights[order], precision=3))
    print(f"exact modes near +-{np.sqrt(X.mean()):.3f}")
    print(f"evidence bound, 1 particle (mean-field VI): {bounds[1]:.3f}")
    print(f"evidence bound, 2 particles: {bounds[2]:.3f}")
    print(f"exact log evidence (quadrature): {log_evidence:.3f}")

    density = np.exp(log_joint(grid) - log_evidence)
    fitted = np.exp(approx.logq(grid[:, None], random_seed=3))
    fig = Figure(figsize=(6, 3.5))
    ax = fig.subplots()
    ax.plot(grid, density, "k", lw=1, label="exact posterior")
    ax.plot(grid, fitted, lw=1.2, label="WVGD, 2 particles")
    for z in approx.particles[:, 0]:
        ax.axvline(z, color="C1", ls=":", lw=1)
    ax.axvline(approx.particles[:, 0].mean(), color="0.6", lw=0.8, label="cell boundary")
    ax.set(xlim=(-2.5, 2.5), xlabel="theta", ylabel="density")
    ax.set_title("WVGD: one particle per mode")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"densities saved to {args.out}")


if __name__ == "__main__":
    main()
