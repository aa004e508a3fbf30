"""Gaussian Flow: full-rank and mean-field fits of a regression, and the evidence bound.

A linear regression with eight correlated predictors and a known noise scale, so the
posterior is Gaussian and the log evidence is closed-form. ``pm.fit(method="gf")`` fits it at
full rank and as mean field (``structure="diagonal"``), at its defaults: every step draws
whitened antithetic pairs of q, takes a natural-gradient step inside a trust region, and the
fit stops by itself when the free energy has stopped falling and q is known to ``tol``
(returning the average of its last iterates). The script prints each fit's evidence bound, the
ELBO of the returned q estimated by ``pymc_gpf.diagnose`` from 20 000 fresh draws, against the
exact answers: log p(y) for full rank and the best mean-field ELBO. It also prints the largest
errors in the posterior means and sds, and saves both free-energy traces to
``gf_evidence.png``.

Run: ``python examples/gf_evidence.py [--steps N] [--out FILE] [--quick]``. ``--steps`` caps the
number of steps (default: pymc-gpf's maximum, 10 000). ``--quick`` (or
``PYMC_GPF_EXAMPLES_QUICK=1``, for the test suite) only hides the progress bars.
"""

import argparse
import os

import numpy as np
import pymc as pm

from matplotlib.figure import Figure
from scipy import stats

import pymc_gpf  # registers method="gf" with pm.fit


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
    parser.add_argument("--steps", type=int, default=None, help="maximum number of steps")
    parser.add_argument("--out", default="gf_evidence.png")
    parser.add_argument("--quick", action="store_true", help="no progress bar, for tests")
    args = parser.parse_args()
    quick = args.quick or os.environ.get("PYMC_GPF_EXAMPLES_QUICK") == "1"

    model, exact = regression()
    fits, bounds = {}, {}
    for label, structure in (("full rank", "full"), ("mean field", "diagonal")):
        fits[label] = approx = pm.fit(
            args.steps,
            method="gf",
            model=model,
            inf_kwargs={"structure": structure},
            random_seed=4,
            progressbar=not quick,
        )
        print(f"{label}: {approx.outcome.step} steps, {approx.outcome.message}")
        # the ELBO of the returned q (an average of iterates) from fresh draws, with its error
        diagnosis = pymc_gpf.diagnose(approx, 20_000, random_seed=5)
        bounds[label] = (diagnosis.elbo, diagnosis.elbo_mcse)
    full, mean_field = fits["full rank"], fits["mean field"]
    mean_error = np.abs(full.mean.eval() - exact["mean"]) / exact["sd"]
    sd_error = np.abs(full.std.eval() / exact["sd"] - 1)
    print("bounds: the ELBO of each fitted q (Monte Carlo se in brackets)")
    print(
        f"full rank:  bound {bounds['full rank'][0]:.3f} ({bounds['full rank'][1]:.1g})   "
        f"exact log evidence {exact['log_evidence']:.3f}"
    )
    print(
        f"mean field: bound {bounds['mean field'][0]:.3f} ({bounds['mean field'][1]:.1g})   "
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
        ax.plot(np.arange(1, len(approx.hist) + 1), approx.hist, lw=0.8, label=label)
    ax.axhline(-exact["log_evidence"], color="k", ls="--", lw=1, label="-log p(y)")
    ax.axhline(-exact["mean_field_elbo"], color="C1", ls=":", lw=1.5, label="best mean field")
    low = -exact["log_evidence"]
    ax.set(xlabel="step", ylabel="free energy F (nats)", xscale="log", ylim=(low - 5, low + 30))
    ax.set_title("GF on a correlated regression")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"free-energy traces saved to {args.out}")


if __name__ == "__main__":
    main()
