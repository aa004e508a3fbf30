"""Gaussian Flow: full-rank and mean-field fits of a regression, and the evidence bound.

A linear regression with eight correlated predictors and a known noise scale, so the
posterior is Gaussian and the log evidence is closed-form. ``pm.fit(method="gf")`` fits it at
full rank and as mean field (``structure="diagonal"``). The script prints each fit's bound,
-F averaged over the last steps, against the exact answers: log p(y) for full rank and the best
mean-field ELBO. It also prints the largest errors in the posterior means and sds, and saves
both free-energy traces to ``gf_evidence.png``.

Run: ``python examples/gf_evidence.py [--steps N] [--out FILE] [--quick]``. ``--quick`` (or
``PYMC_GPF_EXAMPLES_QUICK=1``) runs 1500 steps, for the test suite.
"""

import argparse
import os

import numpy as np
import pymc as pm

from matplotlib.figure import Figure
from scipy import stats

import pymc_gpf  # noqa: F401  (registers method="gf" with pm.fit)


def regression():
    rng = np.random.default_rng(3)
    n, d = 50, 8
    corr = 0.9 ** np.abs(np.subtract.outer(np.arange(d), np.arange(d)))
    X = rng.multivariate_normal(np.zeros(d), corr, size=n)
    y = X @ rng.normal(size=d) + rng.normal(size=n)
    with pm.Model() as model:
        w = pm.Normal("w", 0, 1, shape=d)
        pm.Normal("y", X @ w, 1.0, observed=y)
    precision = X.T @ X + np.eye(d)
    cov = np.linalg.inv(precision)
    exact = {
        "mean": cov @ X.T @ y,
        "sd": np.sqrt(np.diag(cov)),
        "log_evidence": stats.multivariate_normal(np.zeros(n), X @ X.T + np.eye(n)).logpdf(y),
    }
    # the best mean-field Gaussian has variances 1 / precision_dd; its ELBO in closed form
    exact["mean_field_elbo"] = exact["log_evidence"] - 0.5 * (
        np.sum(np.log(np.diag(precision))) - np.linalg.slogdet(precision)[1]
    )
    return model, exact


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="default 6000 (1500 quick)")
    parser.add_argument("--out", default="gf_evidence.png")
    parser.add_argument("--quick", action="store_true", help="few steps, for tests")
    args = parser.parse_args()
    quick = args.quick or os.environ.get("PYMC_GPF_EXAMPLES_QUICK") == "1"
    steps = args.steps or (1500 if quick else 6000)
    last = steps // 3

    model, exact = regression()
    fits = {}
    for label, structure in (("full rank", "full"), ("mean field", "diagonal")):
        fits[label] = pm.fit(
            steps,
            method="gf",
            model=model,
            inf_kwargs={"structure": structure, "n_samples": 20, "natural_mean": True},
            learning_rate=0.01,
            random_seed=4,
            progressbar=not quick,
        )
    full, mean_field = fits["full rank"], fits["mean field"]
    mean_error = np.abs(full.mean.eval() - exact["mean"]) / exact["sd"]
    sd_error = np.abs(full.std.eval() / exact["sd"] - 1)
    print(f"{steps} steps; bounds are -F averaged over the last {last} steps")
    print(
        f"full rank:  bound {-full.hist[-last:].mean():.3f}   "
        f"exact log evidence {exact['log_evidence']:.3f}"
    )
    print(
        f"mean field: bound {-mean_field.hist[-last:].mean():.3f}   "
        f"exact best mean-field ELBO {exact['mean_field_elbo']:.3f}"
    )
    print(
        f"full rank vs exact posterior: max |mean error| = {mean_error.max():.3f} sd, "
        f"max |sd error| = {100 * sd_error.max():.1f} %"
    )
    ratio = mean_field.std.eval() / exact["sd"]
    print(f"mean-field sd / exact sd: min {ratio.min():.2f}, max {ratio.max():.2f}")

    fig = Figure(figsize=(6, 3.5))
    ax = fig.subplots()
    for label, approx in fits.items():
        ax.plot(approx.hist, lw=0.5, label=label)
    ax.axhline(-exact["log_evidence"], color="k", ls="--", lw=1, label="-log p(y)")
    ax.axhline(-exact["mean_field_elbo"], color="C1", ls=":", lw=1.5, label="best mean field")
    low = -exact["log_evidence"]
    ax.set(xlabel="step", ylabel="free energy F (nats)", ylim=(low - 5, low + 30))
    ax.set_title("GF on a correlated regression")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"free-energy traces saved to {args.out}")


if __name__ == "__main__":
    main()
