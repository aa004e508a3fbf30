"""Methods × runner × readers: one way to fit any method, time it, count what it cost (read, not
re-derived: ``benchmarks/README.md``) and read q; child processes; the report's table helpers."""

from __future__ import annotations

import importlib
import json
import logging
import os
import subprocess
import sys
import time
import warnings

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pymc as pm

import pymc_gpf

OURS = ("gpf", "gf", "wvgd", "ensemble")
CLASSES = {"gpf": pymc_gpf.GPF, "gf": pymc_gpf.GF, "wvgd": pymc_gpf.WVGD,
           "ensemble": pymc_gpf.Ensemble, "advi": pm.ADVI, "fullrank_advi": pm.FullRankADVI,
           "svgd": pm.SVGD}  # fmt: skip
BACKEND: str | None = None  # PyTensor backend of the fits (None: PyMC's default), set per section


def backend_name(name: str | None) -> str:
    """``"c"``, or e.g. ``"numba (PyMC's default)"``."""
    from pytensor.compile.mode import get_default_mode

    linker = type(get_default_mode().linker).__name__.removesuffix("Linker").lower()
    return name or f"{linker} (PyMC's default)"


# ------------------------------------------------------------------------------ methods
@dataclass(frozen=True)
class Method:
    """A label and how to fit it: ``inf_kwargs`` to the constructor, ``fit_kwargs`` to ``fit``."""

    label: str
    method: str
    inf_kwargs: dict = field(default_factory=dict)
    fit_kwargs: dict = field(default_factory=dict)

    def build(self, model, seed: int):
        if self.method == "svgd":  # PyMC's Empirical jitters with NumPy's global generator
            np.random.seed(seed)  # noqa: NPY002
        return CLASSES[self.method](model=model, random_seed=seed, **self.inf_kwargs)


def pymc_optimizer(name: str, learning_rate: float) -> dict:
    return {"obj_optimizer": getattr(pm, name)(learning_rate=learning_rate)}


def select(methods: Iterable[Method], labels=None, start: dict | None = None) -> list[Method]:
    """The methods labelled ``labels`` (all if ``None``), each started at ``start`` if given."""
    methods = [m for m in methods if labels is None or m.label in labels]
    if start is not None:
        methods = [replace(m, inf_kwargs={**m.inf_kwargs, "start": start}) for m in methods]
    return methods


def evaluations(inference, steps: int, obj_n_mc: int = 1) -> int:
    """Log-density gradients (one point each) ``steps`` steps of ``inference`` evaluated."""
    counted = getattr(inference, "gradient_evaluations", None)
    if counted is not None:  # ours: the fit group's count
        return int(counted)
    if hasattr(inference.approx, "histogram"):  # SVGD: every particle, every step
        return steps * int(inference.approx.histogram.get_value().shape[0])
    return steps * obj_n_mc


# ------------------------------------------------------------------------------- runner
@dataclass
class FitRun:
    """One fit: the inference, its cost, and the metrics read along the way."""

    method: Method
    inference: Any
    steps: int
    grads: int
    first_call_seconds: float  # the first fit(1): compilation and one step
    seconds: float  # the steps after the first, checks excluded
    checks: list[dict[str, float]]  # {"step", "seconds", "grads", **metrics}
    failure: str | None = None
    seed: int = 0
    final: dict[str, Any] = field(default_factory=dict)

    label = property(lambda self: self.method.label)
    approx = property(lambda self: self.inference.approx)
    ms_per_step = property(lambda self: 1e3 * self.seconds / max(self.steps - 1, 1))


def fit_method(method: Method, model, steps: int, seed: int = 1, *, check=None, check_at=(),
               max_seconds: float | None = None) -> FitRun:  # fmt: skip
    """Fit for ``steps`` steps (fewer if ours stop by themselves or after ``max_seconds`` of
    stepping); ``check(approx) -> {metric: value}`` before the first step, at the steps in
    ``check_at`` and at the end, its time excluded. A divergence ends the fit (``failure``)."""
    inference = method.build(model, seed)
    at, n_mc = {int(s) for s in check_at}, method.fit_kwargs.get("obj_n_mc", 1)
    state = {"steps": 0, "spent": 0.0, "start": None, "rows": [], "stopped": False}

    def clock() -> float:
        started = state["start"]
        return 0.0 if started is None else time.perf_counter() - started - state["spent"]

    def record() -> None:
        began = time.perf_counter()
        row = {"step": state["steps"], "seconds": clock(),
               "grads": evaluations(inference, state["steps"], n_mc)}  # fmt: skip
        state["rows"].append(row | check(inference.approx))
        state["spent"] += time.perf_counter() - began

    def callback(approx, hist, i) -> None:
        state["steps"] += 1
        late = max_seconds is not None and clock() > max_seconds
        if check is not None and (late or state["steps"] in at):
            record()
        if late:
            state["stopped"] = True
            raise StopIteration("time budget reached")

    if check is not None:
        record()
        state["spent"] = 0.0
    fit_kwargs, failure = {"backend": BACKEND, **method.fit_kwargs}, None
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # one step has not converged
            inference.fit(1, progressbar=False, callbacks=[callback], **fit_kwargs)
    except FloatingPointError as err:
        return FitRun(method, inference, 1, evaluations(inference, 1, n_mc), 0.0, 0.0,
                      state["rows"], str(err)[:200], seed)  # fmt: skip
    first_call = time.perf_counter() - start - state["spent"]
    state["spent"], state["start"] = 0.0, time.perf_counter()
    try:
        if steps > 1 and not state["stopped"]:
            inference.refine(steps - 1, progressbar=False)
    except FloatingPointError as err:
        failure = f"{type(err).__name__} at step {state['steps']}"
    seconds = clock()
    if check is not None and failure is None and state["rows"][-1]["step"] != state["steps"]:
        record()
    grads = evaluations(inference, state["steps"], n_mc)
    return FitRun(method, inference, state["steps"], grads, first_call, seconds, state["rows"],
                  failure, seed)  # fmt: skip


def geometric_steps(last: int, per_decade: int = 12) -> np.ndarray:
    """Check points spread evenly in log(step) from 1 to ``last``."""
    grid = np.logspace(0, np.log10(max(last, 1)), int(per_decade * np.log10(max(last, 10))) + 1)
    return np.unique(np.round(grid).astype(int))


@dataclass
class Fit:
    """``pm.fit(method=...)`` at its defaults: q, its cost, how it ended and whether it warned."""

    approx: Any
    seconds: float
    warned: bool
    steps: int = 0
    grads: float = np.nan
    stop: str = "n steps"
    verdict: str = ""
    check_seconds: float = np.nan
    khat: float = np.nan


def fit_defaults(method: str, model, seed: int = 1, **kwargs) -> Fit:
    """``pm.fit(method=method, model=model, ...)`` as a user runs it, warnings recorded (ours:
    a ``FitWarning``; PyMC's: any); the cost read off the fit (ADVI: one draw per step)."""
    kwargs.setdefault("backend", BACKEND)
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        approx = pm.fit(method=method, model=model, random_seed=seed, progressbar=False, **kwargs)
    seconds, outcome = time.perf_counter() - start, getattr(approx, "outcome", None)
    if outcome is None:
        warned = any(issubclass(w.category, UserWarning) for w in caught)
        return Fit(approx, seconds, warned, len(approx.hist), len(approx.hist))
    warned = any(issubclass(w.category, pymc_gpf.FitWarning) for w in caught)
    return Fit(approx, seconds, warned, len(approx.hist), approx.inference.gradient_evaluations,
               outcome.reason, outcome.verdict or "", outcome.checks.get("seconds", np.nan),
               outcome.checks.get("pareto_k", np.nan))  # fmt: skip


@dataclass
class Nuts:
    values: dict[str, np.ndarray]  # {var: (chains * draws, ...)}
    seconds: float
    grads: float  # leapfrog steps, tuning included
    divergences: int
    warned: bool


def nuts(model, seed: int = 1, draws: int = 1000, tune: int = 1000, **kwargs) -> Nuts:
    """PyMC's NUTS, 2 chains on one core, warnings recorded."""
    kwargs = {"chains": 2, "cores": 1, "discard_tuned_samples": False, **kwargs}
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught, model:
        warnings.simplefilter("always")
        idata = pm.sample(draws, tune=tune, random_seed=seed, progressbar=False, **kwargs)
    seconds = time.perf_counter() - start
    post, stats = idata.posterior, idata.sample_stats
    values = {k: post[k].values.reshape(-1, *post[k].shape[2:]) for k in post.data_vars}
    grads = float(stats["n_steps"].sum())
    if "warmup_sample_stats" in idata:
        grads += float(idata.warmup_sample_stats["n_steps"].sum())
    divergences = int(stats["diverging"].sum())
    warned = divergences > 0 or any(issubclass(w.category, UserWarning) for w in caught)
    return Nuts(values, seconds, grads, divergences, warned)


# ------------------------------------------------------------------------------ reading q
def flat_sample(approx, draws: int, seed: int) -> np.ndarray:
    """``(S, D)`` points of any fitted q in flat unconstrained space, without compiling: draws
    of ours and of PyMC's Gaussians, SVGD's particles, a burning-in ensemble's particles; NaN
    rows if q cannot be sampled (a WVGD cell whose local Gaussian misses it)."""
    rng = np.random.default_rng(seed)
    if isinstance(approx, pymc_gpf.approximation.FlowApproximation):
        try:
            return approx.draw(draws, rng)
        except RuntimeError:
            return np.full((draws, approx.target.ndim), np.nan)
        except ValueError:
            if not isinstance(approx, pymc_gpf.EnsembleApproximation):
                raise
            return approx.particles[rng.integers(len(approx.particles), size=draws)]
    if hasattr(approx, "histogram"):
        return np.asarray(approx.histogram.get_value())
    (group,) = approx.groups
    params = {k: np.asarray(v.get_value()) for k, v in group.params_dict.items()}
    noise = rng.standard_normal((draws, len(params["mu"])))
    if "rho" in params:  # sd = softplus(rho)
        return params["mu"] + noise * np.logaddexp(0.0, params["rho"])
    d = len(params["mu"])
    chol = np.zeros((d, d))
    chol[np.tril_indices(d)] = params["L_tril"]
    chol[np.diag_indices(d)] = np.logaddexp(0.0, np.diag(chol))
    return params["mu"] + noise @ chol.T


def max_errors(columns: np.ndarray, mean: np.ndarray, sd: np.ndarray) -> tuple[float, float]:
    """max |ε_μ| (in reference sds) and max |ε_σ| (relative) of draws ``(S, P)``."""
    columns = columns[np.all(np.isfinite(columns), axis=1)]
    if not len(columns):
        return np.nan, np.nan
    eps_sd = columns.std(0, ddof=1) / sd - 1
    return float(np.max(np.abs(columns.mean(0) - mean) / sd)), float(np.max(np.abs(eps_sd)))


# ------------------------------------------------------------------------- child processes
def time_per_call(call: Callable[[int], Any], target_seconds: float, repeats: int = 5) -> float:
    """Median seconds per unit of ``call(n)``, ``n`` calibrated to ``target_seconds``."""
    start = time.perf_counter()
    call(3)  # warm caches and any lazy JIT
    estimate = max((time.perf_counter() - start) / 3, 1e-6)
    n, times = int(np.clip(target_seconds / estimate, 3, 100_000)), []
    for _ in range(repeats):
        start = time.perf_counter()
        call(n)
        times.append((time.perf_counter() - start) / n)
    return float(np.median(times))


def run_child(cell: Callable[[dict], dict], payload: dict, **env: str) -> dict:
    """``cell(payload)`` in a fresh process with one BLAS thread and ``env``: its JSON result
    (``{"error": ...}`` if it failed)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1", **env}  # fmt: skip
    name = f"{cell.__module__}:{cell.__name__}"
    argv = [sys.executable, "-m", "benchmarks.harness", name, json.dumps(payload)]
    proc = subprocess.run(argv, env=env, cwd=Path(__file__).resolve().parent.parent,
                          capture_output=True, text=True)  # fmt: skip
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {proc.returncode}: {tail[:300]}"}
    return json.loads(lines[-1])


def child(name: str, payload: dict) -> dict:
    """The fresh process of :func:`run_child`: BLAS on one thread, PyMC and warnings quiet."""
    import scipy.linalg  # noqa: F401  (loads SciPy's OpenBLAS, then limited)

    from threadpoolctl import threadpool_limits

    threadpool_limits(1, user_api="blas")
    logging.getLogger("pymc").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    module, function = name.split(":")
    return getattr(importlib.import_module(module), function)(payload)


def memory_mb() -> dict[str, float]:
    """This process's resident set (``VmRSS``) and its high-water mark (``VmHWM``), in MB."""
    with open("/proc/self/status") as fh:
        lines = [line.split(":") for line in fh if line.startswith(("VmRSS", "VmHWM"))]
    return {key: int(value.split()[0]) / 1024 for key, value in lines}


# --------------------------------------------------------------------------------- report
def fmt(value: float, digits: int = 3, blank: str = "—") -> str:
    """``digits`` significant digits (``blank`` for nan/inf)."""
    if value is None or not np.isfinite(value):
        return blank
    if value == 0:
        return "0"
    if abs(value) >= 10 ** (digits + 2) or abs(value) < 1e-3:
        return f"{value:.{digits - 1}e}"
    return f"{value:.{digits}g}" if abs(value) < 10**digits else f"{value:.0f}"


def pct(value: float, digits: int = 2, blank: str = "—") -> str:
    return f"{fmt(100 * value, digits)} %" if np.isfinite(value) else blank


def md_table(headers: str | list[str], rows: Iterable, left: int = 1) -> str:
    """A markdown table (``headers`` a list or ``" | "``-separated), first ``left`` columns
    left-aligned."""
    headers = headers.split(" | ") if isinstance(headers, str) else headers
    lines = ["| " + " | ".join(headers) + " |",
             "|" + "|".join([":---"] * left + ["---:"] * (len(headers) - left)) + "|"]  # fmt: skip
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def pyplot():
    """matplotlib's pyplot on Agg, in the report's style."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"figure.dpi": 110, "savefig.dpi": 110, "axes.grid": True,
                         "grid.alpha": 0.3, "font.size": 9, "axes.titlesize": 10,
                         "legend.fontsize": 8})  # fmt: skip
    return plt


def save_figure(ctx, fig, stem: str, tight: bool = True) -> str:
    """Save ``fig`` as the section's figure ``stem``; the markdown that shows it."""
    path, markdown = ctx.figure(stem)
    if tight:
        fig.tight_layout()
    fig.savefig(path, bbox_inches="tight" if tight else None)
    pyplot().close(fig)
    return markdown


def colour(label: str) -> str:
    """The colour of a method's family, from its report label."""
    low = label.lower()
    if "ensemble" in low:
        return "C5"
    families = {"fullrankadvi": "C3", "advi": "C1", "gpf": "C0", "gf": "C2", "wvgd": "C6",
                "svgd": "C4", "nuts": "k"}  # fmt: skip
    return next((c for key, c in families.items() if low.startswith(key)), "C7")


if __name__ == "__main__":  # a cell of run_child
    print(json.dumps(child(sys.argv[1], json.loads(sys.argv[2]))))
