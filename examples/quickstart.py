"""Quickstart: Bayesian logistic regression on the German credit data with GPF.

Fits the 25 weights with ``pm.fit(method="gpf")``, prints a short posterior summary and the
final free energy, compares with the Stan reference posterior shipped with the data, and
saves the free-energy trace to ``gpf_free_energy.png``.

Run: ``python examples/quickstart.py [--steps N] [--out FILE] [--quick]``. ``--quick`` (or the
environment variable ``PYMC_GPF_EXAMPLES_QUICK=1``) runs 5000 steps, for the test suite.
"""

import argparse
import os

from pathlib import Path

import arviz as az
import numpy as np
import pymc as pm

from matplotlib.figure import Figure

import pymc_gpf  # noqa: F401  (registers method="gpf" with pm.fit)

DATA = Path(__file__).parent / "data"


def german_credit_model() -> pm.Model:
    raw = np.loadtxt(DATA / "german.data-numeric")
    features = (raw[:, :24] - raw[:, :24].mean(0)) / raw[:, :24].std(0)
    X = np.hstack([features, np.ones((len(raw), 1))])  # w[24] is the intercept
    bad_credit = (raw[:, 24] == 2).astype(int)
    with pm.Model(coords={"feature": [f"x{k}" for k in range(24)] + ["intercept"]}) as model:
        X_data = pm.Data("X", X)
        w = pm.Normal("w", 0, 1, dims="feature")
        pm.Bernoulli("bad_credit", logit_p=X_data @ w, observed=bad_credit)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="default 10000 (5000 quick)")
    parser.add_argument("--out", default="gpf_free_energy.png")
    parser.add_argument("--quick", action="store_true", help="few steps, for tests")
    args = parser.parse_args()
    quick = args.quick or os.environ.get("PYMC_GPF_EXAMPLES_QUICK") == "1"
    steps = args.steps or (5000 if quick else 10_000)

    model = german_credit_model()
    with model:
        approx = pm.fit(
            steps,
            method="gpf",
            inf_kwargs={"natural_mean": True},
            random_seed=1,
            progressbar=not quick,
        )
    idata = approx.sample(10_000, random_seed=2)

    print(az.summary(idata, var_names=["w"], kind="stats").head(8))
    print(f"\nfinal free energy: {approx.hist[-1]:.3f}  (-ELBO, nats; lower is better)")

    reference = np.loadtxt(
        DATA / "reference_mean_sd.csv", delimiter=",", skiprows=1, usecols=(1, 2)
    )
    w = idata.posterior["w"]
    mean_error = (w.mean(("chain", "draw")).values - reference[:, 0]) / reference[:, 1]
    sd_error = w.std(("chain", "draw")).values / reference[:, 1] - 1
    print(
        f"vs Stan reference: max |mean error| = {np.abs(mean_error).max():.3f} posterior sd, "
        f"max |sd error| = {100 * np.abs(sd_error).max():.1f} %"
    )

    trace = idata["fit"]["free_energy"]
    fig = Figure(figsize=(6, 3.5))
    ax = fig.subplots()
    ax.plot(trace["step"], trace, lw=1)
    ax.set(xlabel="step", ylabel="free energy (nats)", xscale="log", title="GPF on German credit")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"free-energy trace saved to {args.out}")


if __name__ == "__main__":
    main()
