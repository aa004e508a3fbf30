"""A minibatch regression at defaults: ``pm.Minibatch`` + ``total_size``, every method.

Linear regression with a known noise sd and ``N(0, 10^2)`` priors, so the posterior is
Gaussian in closed form; ``n`` rows seen in minibatches of 100. Ours run with no argument
(they stop by themselves, at most 100 000 steps with minibatch data); PyMC's ADVI and
FullRankADVI with PyMC's defaults (10 000 steps).
"""

from __future__ import annotations

import time
import warnings

from dataclasses import dataclass

import numpy as np

from benchmarks import common
from benchmarks.common import quick_full

NAME = "minibatch"
TITLE = "A minibatch regression at defaults (closed-form posterior)"
BATCH = 100


@dataclass(frozen=True)
class Settings(common.Settings):
    rows: int = quick_full(2_000, 20_000)
    methods: tuple[str, ...] = quick_full(
        ("gpf", "gf"), ("gpf", "gf", "wvgd", "advi", "fullrank_advi")
    )


def data(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 5))
    y = 0.5 + x @ np.array([1.0, -2.0, 0.5, 3.0, 0.0]) + rng.normal(size=n)
    design = np.column_stack([np.ones(n), x])
    cov = np.linalg.inv(design.T @ design + np.eye(6) / 100)
    return x, y, cov @ design.T @ y, np.sqrt(np.diag(cov))


def model(x, y):
    import pymc as pm

    with pm.Model() as m:
        xb, yb = pm.Minibatch(x, y, batch_size=BATCH)
        a = pm.Normal("a", 0, 10)
        b = pm.Normal("b", 0, 10, shape=x.shape[1])
        pm.Normal("y", a + xb @ b, 1.0, observed=yb, total_size=len(y))
    return m


def run(ctx) -> str:
    import pymc as pm

    import pymc_gpf

    s = Settings.of(ctx.quick)
    n = s.rows
    x, y, mean, sd = data(n)
    rows = []
    for method in s.methods:
        print(f"   {method}", flush=True)
        start = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            approx = pm.fit(
                method=method,
                model=model(x, y),
                random_seed=1,
                progressbar=False,
                backend=common.backend(),
            )
        seconds = time.perf_counter() - start
        draws = approx.sample(20_000, random_seed=0, return_inferencedata=False)
        flat = np.column_stack([draws["a"].reshape(-1), draws["b"]])
        eps_mean = float(np.max(np.abs(flat.mean(0) - mean) / sd))
        eps_sd = float(np.max(np.abs(flat.std(0) / sd - 1)))
        outcome = getattr(approx, "outcome", None)
        stop = outcome.reason if outcome is not None else "n steps"
        verdict = (outcome.verdict or "") if outcome is not None else ""
        steps = len(approx.hist)
        warned = any(issubclass(w.category, pymc_gpf.FitWarning) for w in caught)
        accurate = eps_mean < 0.1 and eps_sd < 0.1
        ctx.record_many(
            f"n={n}",
            method,
            [
                ("max_abs_eps_mean", eps_mean, "posterior sd"),
                ("max_abs_eps_sd", eps_sd, "fraction"),
                ("steps", steps, "steps"),
                ("seconds", seconds, "s"),
                ("silent", float(not accurate and not warned), ""),
            ],
            f"{stop} {verdict}".strip(),
        )
        rows.append(
            [
                method,
                common.fmt(eps_mean, 2),
                f"{common.fmt(100 * eps_sd, 2)} %",
                common.fmt(steps, 3),
                common.fmt(seconds, 3),
                stop,
                verdict,
                "yes" if warned else "no",
                "" if accurate or warned else "**SILENT**",
            ]
        )
    headers = [
        "method", "max abs ε_μ", "max abs ε_σ", "steps", "wall (s)", "stop", "verdict",
        "warned", "silent",
    ]  # fmt: skip
    caption = (
        f"y = a + X b + N(0, 1) noise, n = {n} rows, 6 coefficients, minibatches of {BATCH}; "
        "errors against the closed-form posterior from 20 000 draws of q; every method at "
        "its defaults (`pm.fit(method=...)`, seed 1), wall time including compilation. "
        "*Warned*: a `pymc_gpf.FitWarning` (PyMC's methods give none); *silent*: inaccurate "
        "(max |ε_μ| ≥ 0.1 or max |ε_σ| ≥ 10 %) and not warned."
    )
    return caption + "\n\n" + common.md_table(headers, rows)
