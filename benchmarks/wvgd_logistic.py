"""WVGD evidence bound vs number of particles: the WVGD paper's §10.2 set-up.

Bayesian logistic regression (standardised features, intercept, N(0, 1) priors) on
scikit-learn's iris (setosa vs rest), diabetes (target above its median) and breast cancer,
each fitted on ``--repeats`` random subsets of n = 50 points with J = 1..5 particles (J = 1 is
mean-field VI). Reported: the mixture evidence bound ``-F`` (mean of the last 200 steps), its
mean over subsets with the standard error, and the mean paired gain over J = 1. One compiled
graph per dataset serves every J and subset (J is dynamic, the data are ``pm.Data``).

Run: ``python -m benchmarks.wvgd_logistic [--repeats 20] [--steps 2000] [--quick]``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

PARTICLES = (1, 2, 3, 4, 5)
N_POINTS = 50


def load(name: str) -> tuple[np.ndarray, np.ndarray]:
    from sklearn import datasets

    if name == "iris":
        data = datasets.load_iris()
        x, y = data.data, data.target == 0
    elif name == "diabetes":
        data = datasets.load_diabetes()
        x, y = data.data, data.target > np.median(data.target)
    elif name == "breast_cancer":
        data = datasets.load_breast_cancer()
        x, y = data.data, data.target == 1
    else:
        raise ValueError(name)
    return (x - x.mean(0)) / x.std(0), y.astype(float)


def logistic_model(x: np.ndarray, y: np.ndarray):
    import pymc as pm

    with pm.Model() as model:
        xd, yd = pm.Data("x", x), pm.Data("y", y)
        w = pm.Normal("w", 0, 1, shape=x.shape[1])
        b = pm.Normal("b", 0, 1)
        pm.Bernoulli("obs", logit_p=xd @ w + b, observed=yd)
    return model


def bounds(name: str, repeats: int, steps: int, particles=PARTICLES) -> np.ndarray:
    """``(repeats, len(particles))`` evidence bounds."""
    import pymc as pm

    import pymc_gpf  # noqa: F401

    x, y = load(name)
    model = None
    out = np.empty((repeats, len(particles)))
    for r in range(repeats):
        subset = np.random.default_rng(r).choice(len(x), N_POINTS, replace=False)
        if model is None:
            model = logistic_model(x[subset], y[subset])
        else:
            pm.set_data({"x": x[subset], "y": y[subset]}, model=model)
        for k, j in enumerate(particles):
            approx = pm.fit(
                steps,
                method="wvgd",
                model=model,
                inf_kwargs={"n_particles": j, "n_samples": 100},
                random_seed=r,
                progressbar=False,
            )
            out[r, k] = -approx.hist[-200:].mean()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--quick", action="store_true", help="3 subsets, 1000 steps")
    args = parser.parse_args()
    repeats, steps = (3, 1000) if args.quick else (args.repeats, args.steps)
    print(f"WVGD mixture evidence bound, n = {N_POINTS} points, {repeats} subsets, {steps} steps\n")
    header = " | ".join(f"{j}p" for j in PARTICLES)
    print(f"| dataset | {header} | gain 5p vs 1p (paired) |")
    print("|---|" + "---:|" * (len(PARTICLES) + 1))
    for name in ("iris", "diabetes", "breast_cancer"):
        start = time.perf_counter()
        values = bounds(name, repeats, steps)
        se = values.std(0, ddof=1) / np.sqrt(repeats) if repeats > 1 else np.zeros(len(PARTICLES))
        gain = values[:, -1] - values[:, 0]
        gain_se = gain.std(ddof=1) / np.sqrt(repeats) if repeats > 1 else 0.0
        cells = " | ".join(f"{m:.2f} ± {s:.2f}" for m, s in zip(values.mean(0), se, strict=True))
        print(
            f"| {name} | {cells} | {gain.mean():+.3f} ± {gain_se:.3f} |"
            f"  <!-- {time.perf_counter() - start:.0f} s -->",
            flush=True,
        )


if __name__ == "__main__":
    main()
