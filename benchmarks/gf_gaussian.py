"""Gaussian Flow (GF) on a Gaussian target: time to accuracy, and cost per step.

Two tables, every number measured in the same run (PyMC's default backend):

1. **Time to accuracy.** Target ``N(mu, Sigma)`` in D = 20 dimensions with condition number
   kappa = 10: ``mu ~ N(0, I)``, ``Sigma = Q diag(10^linspace(-1, -1 + log10 kappa, D)) Q^T``
   with a random rotation Q (the recipe of ``tests/conftest.py``), as one ``pm.MvNormal``
   (so the flat unconstrained space is the identity). For GF (``pymc_gpf.GF``, full rank,
   natural mean step, plain SGD or Adam), PyMC's ``FullRankADVI`` and GPF (``D + 1``
   particles, the deterministic reference): the steps, gradient evaluations (GF: S per step,
   FullRankADVI: ``obj_n_mc`` per step, default 1; GPF: N per step) and wall time until
   ``||C - Sigma||_F < 0.05`` is first met, C the fitted covariance, checked every
   ``CHECK_EVERY`` steps from a callback (the check's own time is subtracted), up to
   ``MAX_STEPS`` steps. The wall time starts after the first ``fit(1)`` call, whose time
   (compilation included; it depends on the state of the PyTensor cache) is a separate
   column. Median over seeds of the fit (the target is fixed); "best" is the smallest
   error seen at the checks, i.e. about the noise floor of a fit that does not get there.
2. **Cost per step vs the bare batched gradient, at equal S.** Logistic regression
   (``benchmarks.step_time.logistic_model``, n = 2000, D = 50) and the Gaussian above: warm
   ms/step of the bare batched log-density + gradient for S points
   (``BatchedTarget.compile_logp_dlogp`` on an ``(S, D)`` array), a GF step with
   ``n_samples=S`` (full rank and diagonal) and a ``FullRankADVI`` step with ``obj_n_mc=S``
   (started from ``L = 0.1 I``, see :func:`scale_full_rank_init`), each driven through its
   public ``refine`` after a first call (compilation excluded); median of repeats.

BLAS runs on one thread (``--blas-threads``), so that the timings do not depend on what else
runs on the machine (two BLAS threads next to a busy process ran 10x slower here).

Run: ``python -m benchmarks.gf_gaussian [--quick] [--blas-threads 1]`` (``--quick``: one
seed, fewer configurations, S = 10 only). The tables are printed and written to
``benchmarks/results/gf_gaussian.md`` (``gf_gaussian_quick.md`` with ``--quick``). A cold
PyTensor cache adds ~20 s of compilation per configuration (numba); the "first fit(1) call"
column shows it.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import time

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from benchmarks.step_time import N_DIM, N_OBS, logistic_model, time_per_step

D, KAPPA, TOL = 20, 10.0, 0.05
MAX_STEPS, CHECK_EVERY = 20_000, 10
SEEDS = (1, 2, 3)
RESULTS = Path(__file__).parent / "results" / "gf_gaussian.md"  # --quick: gf_gaussian_quick.md


# ----------------------------------------------------------------------------- target
def gaussian_target(d: int = D, kappa: float = KAPPA, seed: int = 0):
    """``mu ~ N(0, I)``, ``Sigma = Q diag(eigenvalues) Q^T`` (as ``tests/conftest.py``)."""
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.uniform(size=(d, d)))
    eigenvalues = 10 ** np.linspace(-1, -1 + np.log10(kappa), d)
    return rng.normal(size=d), q @ np.diag(eigenvalues) @ q.T


def mvnormal_model(mu: np.ndarray, cov: np.ndarray):
    import pymc as pm

    with pm.Model() as model:
        pm.MvNormal("x", mu=mu, cov=cov)
    return model


# ------------------------------------------------------------------ methods and their q
def gf_cov(approx) -> np.ndarray:
    factor = approx.factor  # == approx.cov.eval(), without a PyTensor call
    return factor @ factor.T


def gpf_cov(approx) -> np.ndarray:
    return np.cov(approx.particles.T, bias=True)  # == approx.cov.eval()


def advi_cov(approx) -> np.ndarray:
    return approx.cov.eval()  # L L^T with a softplus diagonal; eval caches its function


@dataclass
class Config:
    label: str
    make: Callable  # (model, seed) -> inference
    grads_per_step: int
    cov: Callable  # approximation -> (D, D) covariance in flat unconstrained space
    fit_kwargs: dict = field(default_factory=dict)
    is_gf: bool = False


def gf(n_samples: int, lr: float, optimizer: str = "sgd") -> Config:
    import pymc_gpf

    def make(model, seed):
        return pymc_gpf.GF(n_samples=n_samples, natural_mean=True, model=model, random_seed=seed)

    return Config(
        f"GF S={n_samples}, {optimizer} η={lr:g}",
        make,
        n_samples,
        gf_cov,
        {"learning_rate": lr, "optimizer": optimizer},
        is_gf=True,
    )


def gpf(lr: float) -> Config:
    import pymc_gpf

    def make(model, seed):
        return pymc_gpf.GPF(D + 1, natural_mean=True, model=model, random_seed=seed)

    return Config(f"GPF N={D + 1}, sgd η={lr:g}", make, D + 1, gpf_cov, {"learning_rate": lr})


def full_rank_advi(adam_lr: float | None = None, n_mc: int = 1) -> Config:
    import pymc as pm

    def make(model, seed):
        return pm.FullRankADVI(model=model, random_seed=seed)

    kwargs = {"obj_n_mc": n_mc}
    if adam_lr is None:
        label = "FullRankADVI, default adagrad_window η=0.001"
    else:
        label = f"FullRankADVI, adam η={adam_lr:g}"
        kwargs["obj_optimizer"] = pm.adam(learning_rate=adam_lr)  # a partial: no state
    if n_mc != 1:
        label += f", obj_n_mc={n_mc}"
    return Config(label, make, n_mc, advi_cov, kwargs)


def accuracy_configs(quick: bool) -> list[Config]:
    if quick:
        return [gf(10, 0.01), gf(10, 3e-4), gf(50, 1e-3), full_rank_advi(0.01), gpf(0.01)]
    return [
        gf(10, 0.01),
        gf(10, 1e-3),
        gf(10, 3e-4),
        gf(21, 5e-4),
        gf(50, 1e-3),
        gf(10, 1e-3, "adam"),
        full_rank_advi(),
        full_rank_advi(0.01),
        full_rank_advi(1e-3),
        full_rank_advi(1e-3, n_mc=10),
        gpf(0.01),
        gpf(0.03),
    ]


# ------------------------------------------------------------------- time to accuracy
class Checker:
    """Callback: counts steps; every ``every`` steps checks ``||C - Sigma||_F < tol`` and
    stops the fit (``StopIteration``, honoured by PyMC and pymc-gpf) when it is met."""

    def __init__(self, cov: Callable, sigma: np.ndarray, every: int):
        self.cov, self.sigma, self.every = cov, sigma, every
        self.steps, self.spent, self.best, self.hit = 0, 0.0, np.inf, None

    def __call__(self, approx, hist, i):
        self.steps += 1
        if self.steps % self.every:
            return
        start = time.perf_counter()
        error = float(np.linalg.norm(self.cov(approx) - self.sigma))
        self.best = min(self.best, error)
        self.spent += time.perf_counter() - start
        if error < TOL:
            self.hit = self.steps
            raise StopIteration(f"||C - Sigma||_F = {error:.4f} < {TOL} at step {self.steps}")


@dataclass
class Run:
    steps: int | None  # None: not reached
    best: float
    seconds: float  # wall time of the iterations after the first call (checks excluded)
    total_steps: int
    first_call: float
    failure: str | None = None


def run_to_accuracy(config: Config, model, sigma: np.ndarray, seed: int) -> Run:
    checker = Checker(config.cov, sigma, CHECK_EVERY)
    inference = config.make(model, seed)
    start = time.perf_counter()
    inference.fit(1, progressbar=False, callbacks=[checker], **config.fit_kwargs)
    first_call = time.perf_counter() - start
    failure = None
    start = time.perf_counter()
    try:
        inference.refine(MAX_STEPS - 1, progressbar=False)
    except FloatingPointError as err:  # PyMC's NaN error; pymc-gpf's DivergenceError
        failure = f"{type(err).__name__} at step {checker.steps}"
    seconds = time.perf_counter() - start - checker.spent
    return Run(checker.hit, checker.best, seconds, checker.steps, first_call, failure)


def accuracy_table(configs: list[Config], seeds: tuple[int, ...]) -> str:
    mu, sigma = gaussian_target()
    model = mvnormal_model(mu, sigma)
    rows = []
    for config in configs:
        runs = [run_to_accuracy(config, model, sigma, seed) for seed in seeds]
        steps = np.array([r.steps if r.steps is not None else np.inf for r in runs], dtype=float)
        wall = np.array([r.seconds if r.steps is not None else np.inf for r in runs])
        timed_steps = sum(r.total_steps - 1 for r in runs)  # after the first fit(1) call
        rows.append(
            {
                "config": config,
                "reached": int(np.isfinite(steps).sum()),
                "steps": float(np.median(steps)),
                "grads": float(np.median(steps)) * config.grads_per_step,
                "wall": float(np.median(wall)),
                "ms_step": 1e3 * sum(r.seconds for r in runs) / max(timed_steps, 1),
                "best": float(np.median([r.best for r in runs])),
                "first_call": runs[0].first_call,
                "failures": [r.failure for r in runs if r.failure],
            }
        )
        print(
            f"  {config.label}: {rows[-1]['reached']}/{len(seeds)} reached; first call "
            f"{runs[0].first_call:.1f} s, iterations {sum(r.seconds for r in runs):.1f} s",
            flush=True,
        )
    reached_gf = [r for r in rows if r["config"].is_gf and np.isfinite(r["wall"])]
    ref = min(reached_gf, key=lambda r: r["wall"]) if reached_gf else None
    lines = [
        f"Gaussian target D={D}, κ={KAPPA:g}; criterion ‖C − Σ‖_F < {TOL} checked every "
        f"{CHECK_EVERY} steps, at most {MAX_STEPS} steps; median over seeds {list(seeds)} "
        f"(‖Σ‖_F = {np.linalg.norm(sigma):.2f}). Ratios are to the fastest GF row that "
        f"reached ({ref['config'].label if ref else 'none'}).",
        "",
        "| method | reached | steps | grad evals | wall (s) | ms/step | best ‖C − Σ‖_F "
        "| wall / GF | grad evals / GF | first fit(1) call (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        n_seeds = len(seeds)
        if np.isfinite(r["steps"]):
            steps, grads, wall = f"{r['steps']:.0f}", f"{r['grads']:.0f}", f"{r['wall']:.2f}"
            ratio_wall = f"{r['wall'] / ref['wall']:.3g}"
            ratio_grads = f"{r['grads'] / ref['grads']:.3g}"
        else:
            steps, grads, wall = f"not reached in {MAX_STEPS}", "—", "—"
            ratio_wall = ratio_grads = "—"
        note = f" ({'; '.join(r['failures'])})" if r["failures"] else ""
        lines.append(
            f"| {r['config'].label}{note} | {r['reached']}/{n_seeds} | {steps} | {grads} | "
            f"{wall} | {r['ms_step']:.3f} | {r['best']:.3f} | {ratio_wall} | {ratio_grads} | "
            f"{r['first_call']:.1f} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------- cost per step
def cost_stepper(method: str, model, n_samples: int, seed: int = 1):
    """``step(n)`` running n iterations (after the first call, which compiles)."""
    import pymc as pm

    import pymc_gpf

    if method == "bare":
        target = pymc_gpf.BatchedTarget(model)
        logp_dlogp = target.compile_logp_dlogp()
        points = 0.1 * np.random.default_rng(seed).normal(size=(n_samples, target.ndim))
        logp_dlogp(points)

        def step(n):
            for _ in range(n):
                logp_dlogp(points)

        return step
    if method in ("gf_full", "gf_diag"):
        structure = "full" if method == "gf_full" else "diagonal"
        inference = pymc_gpf.GF(
            n_samples=n_samples,
            structure=structure,
            natural_mean=True,
            model=model,
            random_seed=seed,
        )
        inference.fit(1, learning_rate=3e-4, progressbar=False)
    else:
        inference = pm.FullRankADVI(model=model, random_seed=seed)
        scale_full_rank_init(inference, 0.1)
        inference.fit(1, obj_n_mc=n_samples, progressbar=False)

    def step(n):
        inference.refine(n, progressbar=False)

    return step


COST_METHODS = ("bare", "gf_full", "gf_diag", "advi")


def scale_full_rank_init(inference, scale: float) -> None:
    """Start FullRankADVI at ``L = scale I`` (GF's ``init_scale``) instead of PyMC's
    ``softplus(1) I``: from that default its gradient is NaN in the first step on the
    logistic regression (all entries, any optimiser), although the model's own ``dlogp`` is
    finite there."""
    group = inference.approx.groups[0]
    l_tril = group.params_dict["L_tril"]
    value = l_tril.get_value()
    d = group.ddim
    value[np.cumsum(np.arange(1, d + 1)) - 1] = np.log(np.expm1(scale))  # softplus^-1
    l_tril.set_value(value)


def cost_table(sample_sizes: tuple[int, ...], steps: int, repeats: int) -> str:
    models = {
        f"logistic n={N_OBS}, D={N_DIM}": logistic_model(),
        f"Gaussian D={D}, κ={KAPPA:g}": mvnormal_model(*gaussian_target()),
    }
    lines = [
        "Warm ms/step (compilation excluded), median of "
        f"{repeats} × {steps} steps; GF with natural_mean=True, sgd; FullRankADVI with "
        "obj_n_mc=S, its default optimiser and L = 0.1 I at the start (from PyMC's default "
        "its gradient is NaN on the logistic regression).",
        "",
        "| model | S | bare logp+grad | GF full | GF diagonal | FullRankADVI "
        "| GF full / bare | GF diag / bare | GF full / FullRankADVI |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, model in models.items():
        for s in sample_sizes:
            ms = {
                m: 1e3 * time_per_step(cost_stepper(m, model, s), steps, repeats)
                for m in COST_METHODS
            }
            lines.append(
                f"| {name} | {s} | {ms['bare']:.3f} | {ms['gf_full']:.3f} | "
                f"{ms['gf_diag']:.3f} | {ms['advi']:.3f} | {ms['gf_full'] / ms['bare']:.2f} | "
                f"{ms['gf_diag'] / ms['bare']:.2f} | {ms['gf_full'] / ms['advi']:.2f} |"
            )
            print(f"  {name}, S={s}: done", flush=True)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one seed, fewer configurations")
    parser.add_argument(
        "--blas-threads", type=int, default=1, help="BLAS threads (default 1: stable timings)"
    )
    args = parser.parse_args(argv)
    import pymc
    import pytensor

    from threadpoolctl import threadpool_info, threadpool_limits  # a PyMC dependency

    import pymc_gpf

    # after the imports: limits apply to the BLAS libraries loaded so far (NumPy's and
    # SciPy's OpenBLAS, the latter used by numba-compiled functions)
    threadpool_limits(args.blas_threads, user_api="blas")
    blas = max(i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas")
    # PyMC logs "Finished [100%]" at every refine, pymc-gpf the StopIteration of a check;
    # set after the import (pymc sets its logger to INFO)
    logging.getLogger("pymc").setLevel(logging.WARNING)
    logging.getLogger("pymc_gpf").setLevel(logging.WARNING)

    start = time.perf_counter()
    seeds = SEEDS[:1] if args.quick else SEEDS
    print("Time to accuracy ...", flush=True)
    accuracy = accuracy_table(accuracy_configs(args.quick), seeds)
    print("Cost per step ...", flush=True)
    sizes = (10,) if args.quick else (10, 50)
    cost = cost_table(sizes, steps=100 if args.quick else 200, repeats=3 if args.quick else 5)
    header = (
        f"Measured {datetime.date.today()} with `python -m benchmarks.gf_gaussian"
        f"{' --quick' if args.quick else ''}` (PyMC {pymc.__version__}, PyTensor "
        f"{pytensor.__version__}, pymc-gpf {pymc_gpf.__version__}, PyMC's default backend, "
        f"BLAS threads: {blas}; run time {time.perf_counter() - start:.0f} s)."
    )
    text = f"{header}\n\n### Time to accuracy\n\n{accuracy}\n\n### Cost per step\n\n{cost}\n"
    print()
    print(text)
    out = RESULTS.with_stem(RESULTS.stem + "_quick") if args.quick else RESULTS
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"written to {out}")


if __name__ == "__main__":
    main()
