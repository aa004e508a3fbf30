"""GPF, GF and PyMC's VI on Gaussian targets with a closed-form answer (paper Figs. 2 and 4).

Fig. 2 (the default): N(μ, Σ) in D = 20 with Σ = U Λ Uᵀ, U a random rotation and log10 Λ_ii
evenly from −1 to −1 + log10 κ, κ ∈ {1, 10, 100} (paper §4.1). The paper's settings: GPF with
N = D + 1 = 21 particles and plain descent η = 0.01, GF with S = 21 draws and RMSProp 0.01;
PyMC's ADVI, FullRankADVI and SVGD (21 particles) at their defaults. With N = D + 1 particles
GPF's fixed point is exactly N(μ, Σ): its errors fall to rounding, whereas the stochastic
methods stop at their Monte Carlo noise and ADVI at the best diagonal Gaussian.

Fig. 4 (``--lowrank``): D = 500 and Σ of effective rank K ∈ {10, 20, 30} (Λ_ii = |N(2, 1)| for
i ≤ K, 1e-8 otherwise, paper §4.3), fitted at rank 20 (GPF with N = 21 particles, GF rank 20,
both RMSProp 0.01 from an initial spread of 1). The best any rank-20 covariance can do is
‖C − Σ‖_F = the norm of Σ's eigenvalues beyond the 20th (Eckart–Young), printed next to each fit.

The script prints ‖m − μ‖ and ‖C − Σ‖_F at the end of each fit next to the closed-form answer
and saves the errors against gradient evaluations to ``gpf_gaussians.png``.

Run: ``python examples/gpf_gaussians.py [--lowrank] [--steps N] [--out FILE] [--quick]``.
``--quick`` (or ``PYMC_GPF_EXAMPLES_QUICK=1``) fits κ = 10 (K = 20 with ``--lowrank``) with
GPF, GF and ADVI only, for a tenth of the paper's steps.
"""

import argparse
import os
import warnings

import numpy as np
import pymc as pm
import pytensor.tensor as pt

from matplotlib.figure import Figure

import pymc_gpf


def gaussian_model(mean: np.ndarray, eigenvalues: np.ndarray, seed: int):
    """x ~ N(mean, U diag(eigenvalues) Uᵀ) as a flat prior plus a potential; and Σ."""
    q, _ = np.linalg.qr(np.random.default_rng(seed).uniform(size=(len(mean),) * 2))
    with pm.Model() as model:
        x = pm.Flat("x", shape=len(mean), initval=np.zeros(len(mean)))
        factor = q / np.sqrt(eigenvalues)  # W W^T = Σ^-1
        pm.Potential("gaussian", -0.5 * pt.sum(pt.square(pt.dot(x - mean, factor))))
    return model, (q * eigenvalues) @ q.T


def moments(approx) -> tuple[np.ndarray, np.ndarray]:
    """Mean and covariance of any fitted q in x's space."""
    if isinstance(approx, pymc_gpf.GPFApproximation):
        z = approx.particles - approx.particles.mean(0)
        return approx.particles.mean(0), z.T @ z / len(z)
    if isinstance(approx, pymc_gpf.GFApproximation):
        return approx.shared_mean.get_value(), approx.factor @ approx.factor.T
    params = {k: v.get_value() for k, v in approx.groups[0].params_dict.items()}
    if "histogram" in params:  # SVGD's particles
        z = params["histogram"] - params["histogram"].mean(0)
        return params["histogram"].mean(0), z.T @ z / len(z)
    if "rho" in params:  # mean field: sd = softplus(rho)
        return params["mu"], np.diag(np.logaddexp(0, params["rho"]) ** 2)
    d = len(params["mu"])
    factor = np.zeros((d, d))
    factor[np.tril_indices(d)] = params["L_tril"]
    factor[np.diag_indices(d)] = np.logaddexp(0, np.diag(factor))
    return params["mu"], factor @ factor.T


def methods(d: int, lowrank: bool, quick: bool) -> dict[str, tuple]:
    """label -> (method, constructor keywords, fit keywords, gradients per step)."""
    if lowrank:
        rms = {"optimizer": "rmsprop", "learning_rate": 0.01}
        out = {
            "GPF N=21": ("gpf", {"n_particles": 21, "init_scale": 1.0}, rms, 21),
            "GF rank 20": ("gf", {"rank": 20, "draws_per_step": 20, "init_scale": 1.0}, rms, 20),
            "ADVI (PyMC defaults)": ("advi", {}, {}, 1),
        }
    else:
        out = {
            "GPF N=21, sgd 0.01": ("gpf", {"n_particles": d + 1}, {"learning_rate": 0.01}, d + 1),
            "GF S=21, rmsprop 0.01": (
                "gf",
                {"draws_per_step": d + 1},
                {"optimizer": "rmsprop", "learning_rate": 0.01},
                d + 1,
            ),
            "ADVI (PyMC defaults)": ("advi", {}, {}, 1),
            "FullRankADVI (PyMC defaults)": ("fullrank_advi", {}, {}, 1),
            "SVGD N=21 (PyMC defaults)": ("svgd", {"n_particles": d + 1}, {}, d + 1),
        }
    return {k: v for k, v in out.items() if not quick or k.startswith(("GPF", "GF", "ADVI"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lowrank", action="store_true", help="paper Fig. 4: D = 500, rank 20")
    parser.add_argument("--steps", type=int, default=None, help="steps per fit")
    parser.add_argument("--out", default="gpf_gaussians.png")
    parser.add_argument("--quick", action="store_true", help="one target, three methods")
    args = parser.parse_args()
    # fixed steps without a convergence test, on purpose: no FitWarning about it
    warnings.simplefilter("ignore", pymc_gpf.FitWarning)
    quick = args.quick or os.environ.get("PYMC_GPF_EXAMPLES_QUICK") == "1"
    d = 500 if args.lowrank else 20
    steps = args.steps or (5000 if args.lowrank else 30_000) // (10 if quick else 1)
    if args.lowrank:
        cases = {f"K = {k}": k for k in ((20,) if quick else (10, 20, 30))}
    else:
        cases = {f"κ = {k}": k for k in ((10,) if quick else (1, 10, 100))}
    mean = np.random.default_rng(0).normal(size=d)
    fig = Figure(figsize=(4.2 * len(cases), 3.4))
    axes = fig.subplots(1, len(cases), squeeze=False)[0]
    for ax, (case, k) in zip(axes, cases.items(), strict=True):
        if args.lowrank:
            eigenvalues = np.full(d, 1e-8)
            eigenvalues[:k] = np.abs(np.random.default_rng(500 + k).normal(2.0, 1.0, size=k))
            floor = float(np.sqrt(np.sum(np.sort(eigenvalues)[::-1][20:] ** 2)))
        else:
            eigenvalues, floor = 10 ** np.linspace(-1, -1 + np.log10(k), d), 0.0
        model, cov = gaussian_model(mean, eigenvalues, seed=k)
        print(f"{case}: ‖Σ‖_F = {np.linalg.norm(cov):.3g}; best possible ‖C − Σ‖_F = {floor:.3g}")
        for label, (method, inf_kwargs, fit_kwargs, per_step) in methods(
            d, args.lowrank, quick
        ).items():
            errors = []

            def record(approx, hist, i, errors=errors, per_step=per_step, cov=cov):
                if i % max(steps // 100, 1) == 0:
                    errors.append((i * per_step, np.linalg.norm(moments(approx)[1] - cov)))

            if method == "svgd":
                np.random.seed(1)  # noqa: NPY002  (PyMC's SVGD jitters with NumPy's global seed)
            approx = pm.fit(steps, method=method, model=model, random_seed=1, progressbar=not quick,
                            inf_kwargs=inf_kwargs, callbacks=[record], **fit_kwargs)  # fmt: skip
            m, c = moments(approx)
            error = np.linalg.norm(c - cov)
            print(f"  {label}: ‖m − μ‖ = {np.linalg.norm(m - mean):.3g}, "
                  f"‖C − Σ‖_F = {error:.3g} (closed form: {floor:.3g})")  # fmt: skip
            grads, error = np.array(errors).T
            ax.loglog(grads, error, label=label)
        ax.axhline(max(floor, 1e-16), color="k", ls="--", lw=0.8)
        ax.set(title=case, xlabel="gradient evaluations", ylabel="‖C − Σ‖_F")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"errors saved to {args.out}")


if __name__ == "__main__":
    main()
