"""Quickstart: Bayesian logistic regression on the German credit data with GPF.

Fits the 25 weights with ``pm.fit(method="gpf")`` at its defaults: no step size, number of
steps or number of particles to choose. The fit takes natural-gradient steps sized by a
backtracking line search and stops by itself when it has converged (a few dozen steps here).
The script prints how the fit ended, a short posterior summary and the final free energy,
compares with the Stan reference posterior shipped with the data, and saves the free-energy
trace and the step sizes to ``gpf_free_energy.png``.

Run: ``python examples/quickstart.py [--steps N] [--out FILE] [--quick]``. ``--steps`` caps the
number of steps (default: pymc-gpf's own maximum, 10 000). The fit stops by itself long
before, so ``--quick`` (or the environment variable ``PYMC_GPF_EXAMPLES_QUICK=1``, for the test
suite) only hides the progress bar.
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
    parser.add_argument("--steps", type=int, default=None, help="maximum number of steps")
    parser.add_argument("--out", default="gpf_free_energy.png")
    parser.add_argument("--quick", action="store_true", help="no progress bar, for tests")
    args = parser.parse_args()
    quick = args.quick or os.environ.get("PYMC_GPF_EXAMPLES_QUICK") == "1"

    model = german_credit_model()
    with model:
        # n (the first argument) is only a maximum: the fit stops when it has converged
        approx = pm.fit(args.steps, method="gpf", random_seed=1, progressbar=not quick)
    idata = approx.sample(10_000, random_seed=2)
    outcome = approx.outcome  # converged?, why it stopped, after how many steps
    print(f"{len(approx.particles)} particles, {outcome.step} steps: {outcome.message}")
    print(f"verdict: {outcome.verdict_message}\n")  # whether to trust it, and why

    print(az.summary(idata, var_names=["w"], kind="stats").head(8))
    print(f"\nfinal free energy: {approx.free_energy:.3f}  (-ELBO, nats; lower is better)")

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

    # the fit group: free energy and step size of every step (a refused trial of the line
    # search keeps the state, so the free energy repeats and the next step size is halved)
    fit = idata["fit"]
    fig = Figure(figsize=(6, 5))
    top, bottom = fig.subplots(2, 1, sharex=True)
    top.plot(fit["step"], fit["free_energy"], ".-", lw=1)
    top.set(ylabel="free energy (nats)", title="GPF on German credit")
    bottom.step(fit["step"], fit["step_size"], where="mid")
    bottom.set(xlabel="step", ylabel="step size")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"free-energy trace saved to {args.out}")


if __name__ == "__main__":
    main()
