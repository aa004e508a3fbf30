"""Per-step cost and time to the first step: GPF vs the bare batched gradient vs PyMC.

Logistic regression, n = 2000 observations, D = 50 weights, N = 20 particles. In one run:

* warm per-step time (compilation excluded, median of repeats): the bare batched log-density
  and gradient for all N particles (``BatchedTarget.compile_logp_dlogp``), a GPF step, PyMC's
  SVGD step (N = 20) and PyMC's ADVI step, each driven through its public ``refine``;
* with ``--cold``: time from ``pm.fit`` to the end of the first step on a cold PyTensor cache
  (each in a fresh process with its own empty ``base_compiledir``).

Run: ``python -m benchmarks.step_time [--backend numba|c] [--cold] [--steps 2000]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

N_OBS, N_DIM, N_PARTICLES = 2000, 50, 20
METHODS = ("bare", "gpf", "svgd", "advi")


def logistic_model():
    import pymc as pm
    import pytensor.tensor as pt

    rng = np.random.default_rng(0)
    X = rng.normal(size=(N_OBS, N_DIM))
    w = 0.3 * rng.normal(size=N_DIM)
    y = rng.random(N_OBS) < 1 / (1 + np.exp(-X @ w))
    with pm.Model() as model:
        weights = pm.Normal("w", 0, 1, shape=N_DIM)
        pm.Bernoulli("y", logit_p=pt.as_tensor(X) @ weights, observed=y)
    return model


def make_stepper(method: str, model, backend: str | None):
    """Return ``step(n)`` running n iterations of `method` (after its first compile)."""
    import pymc as pm

    import pymc_gpf

    if method == "bare":
        logp_dlogp = pymc_gpf.BatchedTarget(model).compile_logp_dlogp(backend=backend)
        particles = 0.1 * np.random.default_rng(1).normal(size=(N_PARTICLES, N_DIM))
        logp_dlogp(particles)

        def step(n):
            for _ in range(n):
                logp_dlogp(particles)

        return step
    inference = {
        "gpf": lambda: pymc_gpf.GPF(N_PARTICLES, model=model, random_seed=1),
        "svgd": lambda: pm.SVGD(n_particles=N_PARTICLES, model=model, random_seed=1),
        "advi": lambda: pm.ADVI(model=model, random_seed=1),
    }[method]()
    fit_kwargs = {"progressbar": False}
    if backend is not None:
        fit_kwargs["backend"] = backend
    inference.fit(1, **fit_kwargs)

    def step(n):
        inference.refine(n, progressbar=False)

    return step


def time_per_step(step, steps: int, repeats: int = 5) -> float:
    step(max(steps // 10, 1))  # warm caches and any lazy JIT
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step(steps)
        times.append((time.perf_counter() - start) / steps)
    return float(np.median(times))


def first_step_seconds(method: str, backend: str | None) -> float:
    """Wall time of the first step on a cold cache, measured in a fresh process."""
    with tempfile.TemporaryDirectory() as compiledir:
        env = dict(os.environ)
        flags = env.get("PYTENSOR_FLAGS", "")
        env["PYTENSOR_FLAGS"] = ",".join(f for f in (flags, f"base_compiledir={compiledir}") if f)
        argv = [sys.executable, "-m", "benchmarks.step_time", "--first-step", method]
        if backend:
            argv += ["--backend", backend]
        out = subprocess.run(argv, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["seconds"]


def _first_step_child(method: str, backend: str | None) -> None:
    model = logistic_model()
    start = time.perf_counter()
    make_stepper(method, model, backend)
    print(json.dumps({"seconds": time.perf_counter() - start}))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default=None, help="c, numba or jax (default: PyMC's)")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--cold", action="store_true", help="also time cold first steps")
    parser.add_argument("--first-step", choices=METHODS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.first_step:
        _first_step_child(args.first_step, args.backend)
        return

    import pymc
    import pytensor

    model = logistic_model()
    per_step = {m: time_per_step(make_stepper(m, model, args.backend), args.steps) for m in METHODS}
    print(
        f"Logistic regression n={N_OBS}, D={N_DIM}, N={N_PARTICLES} particles; "
        f"backend={args.backend or 'PyMC default'}; PyMC {pymc.__version__}, "
        f"PyTensor {pytensor.__version__}\n"
    )
    print("| method | step (ms) | / bare logp+grad | GPF / method |")
    print("|---|---:|---:|---:|")
    for m in METHODS:
        ms = 1e3 * per_step[m]
        print(
            f"| {m} | {ms:.3f} | {per_step[m] / per_step['bare']:.2f} | "
            f"{per_step['gpf'] / per_step[m]:.2f} |"
        )
    if args.cold:
        print("\n| method | first step, cold cache (s) | GPF / method |")
        print("|---|---:|---:|")
        cold = {m: first_step_seconds(m, args.backend) for m in METHODS}
        for m in METHODS:
            print(f"| {m} | {cold[m]:.1f} | {cold['gpf'] / cold[m]:.2f} |")


if __name__ == "__main__":
    main()
