"""Speed: per-step cost against the bare batched gradient, and how time and memory grow with
the dimension D and the number of particles or samples N (the time to the first step is the
``startup`` section, :mod:`benchmarks.exp_startup`, which uses this module's children).

Scaling runs happen in fresh processes (``python -m benchmarks.exp_speed child JSON``);
memory is the process's resident set read from ``/proc/self/status``: its peak while stepping
(the high-water mark is reset once the first step is done).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from benchmarks import common, realdata
from benchmarks.common import MethodSpec, fmt, md_table, quick_full

NAME = "speed"
TITLE = "Speed: cost per step, scaling with D and N"

N_OBS, N_WEIGHTS = 2000, 50  # the logistic regression of the per-step table
BATCH = 20  # points per step in the per-step table (particles, samples, obj_n_mc)
SCALING_BATCH = 10  # N in the D-scaling runs
SCALING_DIM = 1000  # D in the N-scaling runs
FULL_RANK_MAX_D = 1000  # FullRankADVI keeps D(D+1)/2 parameters and a window of 10 gradients

METHOD_LABELS = {
    "bare": "bare logp+grad",
    "gpf": "GPF",
    "gf": "GF full rank",
    "gf_diag": "GF diagonal",
    "gf_lowrank": "GF rank 10",
    "wvgd": "WVGD",
    "advi": "ADVI",
    "advi_1": "ADVI obj_n_mc=1",
    "fullrank_advi": "FullRankADVI",
    "svgd": "SVGD",
}


ALL = ("bare", "gpf", "gf", "gf_diag", "wvgd", "advi", "advi_1", "fullrank_advi", "svgd")


@dataclass(frozen=True)
class Settings(common.Settings):
    per_step_models: tuple[str, ...] = quick_full(("logistic",), ("logistic", "gaussian"))
    per_step_methods: tuple[str, ...] = quick_full(("bare", "gpf", "advi_1"), ALL)
    # None: the run's backend
    per_step_backends: tuple[str | None, ...] = quick_full((None,), (None, "c"))
    repeat_seconds: float = quick_full(0.1, 0.3)
    repeats: int = quick_full(3, 5)
    dims: tuple[int, ...] = quick_full((100, 10_000), (100, 1000, 10_000, 100_000))
    dim_methods: tuple[str, ...] = quick_full(
        ("gpf",), ("bare", "gpf", "gf_lowrank", "advi_1", "fullrank_advi", "svgd")
    )
    particles: tuple[int, ...] = quick_full((), (10, 100, 1000))
    particle_methods: tuple[str, ...] = quick_full((), ("bare", "gpf", "gf_diag", "advi", "svgd"))


# ----------------------------------------------------------------------------- models
def logistic_data() -> tuple[np.ndarray, np.ndarray]:
    """n = 2000 observations of D = 50 standard normal features, labels from weights
    0.3·N(0, 1) (the model: ``realdata.logistic_model`` with N(0, 1) priors, no intercept)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N_OBS, N_WEIGHTS))
    w = 0.3 * rng.normal(size=N_WEIGHTS)
    y = rng.random(N_OBS) < 1 / (1 + np.exp(-x @ w))
    return x, y


def diagonal_gaussian_model(d: int):
    """``x ~ N(mu, diag(sigma²))`` in D dimensions: a gradient costs O(D)."""
    import pymc as pm

    rng = np.random.default_rng(d)
    with pm.Model() as model:
        pm.Normal("x", rng.normal(size=d), np.exp(rng.normal(scale=0.5, size=d)), shape=d)
    return model


def build_model(spec: dict):
    if spec["kind"] == "logistic":
        return realdata.logistic_model(*logistic_data(), 1.0, intercept=False, as_data=False)
    if spec["kind"] == "gaussian":
        target = common.gaussian_target(common.condition_spectrum(spec["d"], 10.0), 0)
        return common.gaussian_model(target)
    return diagonal_gaussian_model(spec["d"])


# --------------------------------------------------------------------------- steppers
def method_spec(method: str, n: int, d: int, default_jitter: bool = False) -> MethodSpec:
    """``method`` with ``n`` points per step on a D = ``d`` model. Ours take the fixed-step
    update, which runs every step asked for (an automatic fit stops once converged, so
    refine(k) would not time k steps; the reference section reports what the automatic fits
    cost in all); PyMC's methods at their default optimiser."""
    fixed = {"learning_rate": 1e-3}
    init_scale = 0.1 if default_jitter else gpf_jitter(n, d)
    specs = {
        "gpf": ("gpf", {"n_particles": n, "init_scale": init_scale}, fixed),
        "gf": ("gf", {"draws_per_step": n}, fixed),
        "gf_diag": ("gf", {"draws_per_step": n, "structure": "diagonal"}, fixed),
        "gf_lowrank": ("gf", {"rank": 10, "draws_per_step": n}, fixed),
        # at WVGD's own default 0.01 the logistic regression diverges at step 543, inside
        # the timing window (no cell keeps a draw); the step size does not change the cost
        "wvgd": ("wvgd", {"n_particles": 4, "draws_per_particle": max(n // 4, 1)}, fixed),
        "advi": ("advi", {}, {"obj_n_mc": n}),
        "advi_1": ("advi", {}, {"obj_n_mc": 1}),
        "fullrank_advi": ("fullrank_advi", {}, {"obj_n_mc": n}),
        "svgd": ("svgd", {"n_particles": n}, {}),
    }
    kind, inf_kwargs, fit_kwargs = specs[method]
    return MethodSpec(METHOD_LABELS[method], kind, inf_kwargs, fit_kwargs)


def make_stepper(
    method: str, model, n: int, backend: str | None, default_jitter: bool = False
) -> tuple[Callable[[int], None], int]:
    """``step(k)`` runs k iterations of ``method`` with ``n`` points per step, after one
    first call that compiles (and, for the fits, takes one step); and the gradient
    evaluations per step."""
    import pymc_gpf

    if method == "bare":
        target = pymc_gpf.BatchedTarget(model)
        logp_dlogp = target.compile_logp_dlogp(backend=backend)
        points = 0.1 * np.random.default_rng(1).normal(size=(n, target.ndim))
        logp_dlogp(points)

        def step(k: int) -> None:
            for _ in range(k):
                logp_dlogp(points)

        return step, n
    # only D: a target kept alive would count in the memory measured
    spec = method_spec(method, n, pymc_gpf.BatchedTarget(model).ndim, default_jitter)
    inference = spec.build(model, seed=1)
    if method == "fullrank_advi":
        common.scale_full_rank_init(inference, 0.1)
    inference.fit(1, progressbar=False, backend=backend, **spec.fit_kwargs)

    def step(k: int) -> None:
        inference.refine(k, progressbar=False)

    return step, spec.grads_per_step(inference)


def gpf_jitter(n: int, d: int) -> float:
    """0.1 (GPF's default) for N > D; 0.1·sqrt(N/D) for N ≤ D, so that the N − 1 non-zero
    eigenvalues of the particles' covariance are about 0.01 whatever D. (With the default,
    they are about 0.01·D/N: at D = 10⁵, N = 10, the default learning rate diverged within 6
    steps on the diagonal Gaussian.)"""
    return 0.1 * min(1.0, float(np.sqrt(n / d)))


# ------------------------------------------------------------------ child processes
def _memory_mb() -> dict[str, float]:
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(("VmRSS", "VmHWM")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) / 1024
    return out


def _reset_peak_memory() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def child(payload: dict) -> dict:
    """Runs in a fresh process: import, build the model, first step (compilation), then
    warm steps; times and resident memory."""
    start = time.perf_counter()
    import pymc  # noqa: F401
    import scipy.linalg  # noqa: F401

    from threadpoolctl import threadpool_limits

    import pymc_gpf  # noqa: F401

    threadpool_limits(1, user_api="blas")  # the parent also sets OPENBLAS_NUM_THREADS=1
    logging.getLogger("pymc").setLevel(logging.ERROR)
    imported = time.perf_counter() - start
    model = build_model(payload["model"])
    baseline = _memory_mb()["VmRSS"]
    start = time.perf_counter()
    step, _ = make_stepper(
        payload["method"],
        model,
        payload["n"],
        payload["backend"],
        payload.get("default_jitter", False),
    )
    first = time.perf_counter() - start
    first_peak = _memory_mb()["VmHWM"]
    out = {"import_seconds": imported, "first_step_seconds": first}
    out.update({"baseline_rss_mb": baseline, "first_step_peak_rss_mb": first_peak})
    if payload.get("steps_seconds"):
        reset = _reset_peak_memory()
        out["ms_per_step"] = 1e3 * common.time_per_call(step, payload["steps_seconds"], 3)
        out["stepping_peak_rss_mb"] = _memory_mb()["VmHWM"] if reset else float("nan")
    return out


def run_in_child(payload: dict, compiledir: str | None = None) -> dict:
    """``child(payload)`` in a fresh process; with ``compiledir`` as PyTensor's
    ``base_compiledir`` (its C modules and compiled numba functions; numba's own cache of its
    library functions stays where it is)."""
    extra = {}
    if compiledir is not None:
        flags = os.environ.get("PYTENSOR_FLAGS", "")
        extra["PYTENSOR_FLAGS"] = ",".join(f for f in (flags, f"base_compiledir={compiledir}") if f)
    return common.run_child("benchmarks.exp_speed", payload, common.single_thread_env(extra))


# ------------------------------------------------------------------- the measurements
def per_step_table(ctx, s: Settings) -> str:
    """Warm ms/step of every method at N = BATCH, side by side, per model and backend."""
    models = {
        f"logistic n={N_OBS}, D={N_WEIGHTS}": {"kind": "logistic"},
        "Gaussian D=20, κ=10": {"kind": "gaussian", "d": 20},
    }
    models = {k: v for k, v in models.items() if v["kind"] in s.per_step_models}
    rows = []
    for backend in dict.fromkeys(b or ctx.backend for b in s.per_step_backends):
        name = common.backend_name(backend)
        for model_name, model_spec in models.items():
            model = build_model(model_spec)
            ms, grads = {}, {}
            for method in s.per_step_methods:
                try:
                    step, grads[method] = make_stepper(method, model, BATCH, backend)
                    ms[method] = 1e3 * common.time_per_call(step, s.repeat_seconds, s.repeats)
                except FloatingPointError as err:
                    ms[method], grads[method] = float("nan"), float("nan")
                    ctx.record(model_name, method, "failure", 1.0, note=str(err)[:200])
            case = f"{model_name}; {name}"
            bare_per_grad = ms["bare"] / BATCH
            for method, value in ms.items():
                per_grad = value / grads[method]
                ctx.record(case, method, "ms_per_step", value, "ms")
                ctx.record(case, method, "ms_per_step_over_bare", value / ms["bare"])
                ctx.record(case, method, "ms_per_gradient_over_bare", per_grad / bare_per_grad)
                rows.append(
                    [
                        model_name,
                        name,
                        METHOD_LABELS[method],
                        fmt(grads[method]),
                        fmt(value),
                        fmt(value / ms["bare"]),
                        fmt(per_grad / bare_per_grad),
                    ]
                )
            print(f"  per step: {model_name}, {name}: done", flush=True)
    table = md_table(
        [
            "model",
            "backend",
            "method",
            "gradients / step",
            "ms / step",
            "step / bare",
            "per gradient / bare",
        ],
        rows,
        left=3,
    )
    return table


def scaling_runs(ctx, s: Settings, axis: str) -> dict:
    """One fresh process per (method, D) or (method, N): warm ms/step and memory."""
    values = s.dims if axis == "D" else s.particles
    methods = s.dim_methods if axis == "D" else s.particle_methods
    results = {}
    for value in values:
        d, n = (value, SCALING_BATCH) if axis == "D" else (SCALING_DIM, value)
        for method in methods:
            case = f"diagonal Gaussian D={d}, N={n}"
            if method == "fullrank_advi" and d > FULL_RANK_MAX_D:
                results[method, value] = None
                ctx.record(case, method, "skipped", 1.0, note="memory: D(D+1)/2 parameters")
                continue
            payload = {
                "model": {"kind": "diagonal", "d": d},
                "method": method,
                "n": n,
                "backend": ctx.backend,
                "steps_seconds": s.repeat_seconds,
            }
            out = run_in_child(payload)
            results[method, value] = out
            if "error" in out:
                ctx.record(case, method, "failure", 1.0, note=out["error"])
                continue
            extra = out["stepping_peak_rss_mb"] - out["baseline_rss_mb"]
            ctx.record(case, method, "ms_per_step", out["ms_per_step"], "ms")
            ctx.record(case, method, "first_step_seconds", out["first_step_seconds"], "s")
            ctx.record(case, method, "baseline_rss", out["baseline_rss_mb"], "MB")
            ctx.record(case, method, "stepping_peak_rss", out["stepping_peak_rss_mb"], "MB")
            ctx.record(case, method, "stepping_peak_over_baseline", extra, "MB")
            ctx.record(case, method, "first_step_peak_rss", out["first_step_peak_rss_mb"], "MB")
        print(f"  scaling {axis}={value}: done", flush=True)
    return results


def scaling_table(results: dict, s: Settings, axis: str, key: str) -> str:
    """One metric (``ms_per_step``, ``stepping_peak_rss_mb``, ``first_step_seconds``) of
    every method against D or N."""
    values = s.dims if axis == "D" else s.particles
    methods = s.dim_methods if axis == "D" else s.particle_methods
    rows = []
    for method in methods:
        cells = []
        for value in values:
            out = results.get((method, value))
            if out is None:
                cells.append("not run (memory)")
            elif "error" in out:
                cells.append("failed")
            else:
                cells.append(fmt(out[key]))
        rows.append([METHOD_LABELS[method], *cells])
    label = "D" if axis == "D" else "N"
    return md_table(["method", *(f"{label} = {v:,}" for v in values)], rows)


def plot_scaling(ctx, s: Settings, by_dim: dict, by_n: dict) -> str:
    plt = common.pyplot()
    panels = [("D", s.dims, s.dim_methods, by_dim)]
    if s.particles:
        panels.append(("N", s.particles, s.particle_methods, by_n))
    fig, axes = plt.subplots(2, len(panels), figsize=(5.2 * len(panels), 6.4), squeeze=False)
    for col, (axis, values, methods, results) in enumerate(panels):
        for method in methods:
            colour = common.METHOD_COLOURS.get(method.split("_")[0], None)
            if method.startswith("fullrank"):
                colour = common.METHOD_COLOURS["fullrank_advi"]
            style = "--" if method in ("gf_lowrank", "advi") else "-"
            xs, times, mems = [], [], []
            for value in values:
                out = results.get((method, value))
                if out is None or "error" in out:
                    continue
                xs.append(value)
                times.append(out["ms_per_step"])
                mems.append(out["stepping_peak_rss_mb"])
            axes[0, col].loglog(xs, times, "o" + style, color=colour, label=METHOD_LABELS[method])
            axes[1, col].semilogx(xs, mems, "o" + style, color=colour, label=METHOD_LABELS[method])
        fixed = f"N = {SCALING_BATCH}" if axis == "D" else f"D = {SCALING_DIM:,}"
        axes[0, col].set_title(f"time per step vs {axis} ({fixed}; diagonal Gaussian)")
        axes[1, col].set_title(f"peak resident memory while stepping vs {axis}")
        axes[0, col].set_ylabel("ms / step")
        axes[1, col].set_ylabel("MB")
        for row in (0, 1):
            axes[row, col].set_xlabel(axis)
        axes[0, col].legend(fontsize=7)
    path, markdown = ctx.figure("scaling")
    common.save_figure(fig, path)
    return markdown


# ------------------------------------------------------------------------------ run
def default_jitter_check(ctx, d: int, s: Settings) -> str:
    """GPF at the largest D with its default init_scale: does the default learning rate hold?"""
    payload = {
        "model": {"kind": "diagonal", "d": d},
        "method": "gpf",
        "n": SCALING_BATCH,
        "backend": ctx.backend,
        "steps_seconds": s.repeat_seconds,
        "default_jitter": True,
    }
    out = run_in_child(payload)
    case = f"diagonal Gaussian D={d}, N={SCALING_BATCH}, default init_scale 0.1"
    found = re.search(r"diverged at step (\d+)", out.get("error", ""))
    if found:
        step = ctx.record(case, "gpf", "diverged_at_step", int(found.group(1)))
        return (
            f"at D = {d:,}, N = {SCALING_BATCH}, GPF with the default init_scale and learning rate "
            f"0.001 diverged at step {step} on this target (this run)"
        )
    if "error" in out:
        ctx.record(case, "gpf", "failure", 1.0, note=out["error"])
        return f"at D = {d:,} GPF with the default init_scale failed: {out['error'][:120]}"
    ctx.record(case, "gpf", "ms_per_step", out["ms_per_step"], "ms")
    return f"at D = {d:,}, N = {SCALING_BATCH} the default init_scale ran without diverging here"


def scaling_tables(results: dict, s: Settings, axis: str) -> list[str]:
    label = "D" if axis == "D" else "N"
    return [
        f"Warm ms per step against {label}:",
        scaling_table(results, s, axis, "ms_per_step"),
        f"Peak resident memory while stepping (MB) against {label}:",
        scaling_table(results, s, axis, "stepping_peak_rss_mb"),
        f"First step, warm cache (s) against {label}:",
        scaling_table(results, s, axis, "first_step_seconds"),
    ]


def run(ctx) -> str:
    s = Settings.of(ctx.quick)
    per_step = per_step_table(ctx, s)
    by_dim = scaling_runs(ctx, s, "D")
    by_n = scaling_runs(ctx, s, "N") if s.particles else {}
    figure = plot_scaling(ctx, s, by_dim, by_n)
    jitter_note = default_jitter_check(ctx, max(s.dims), s)
    baselines = [o["baseline_rss_mb"] for o in (*by_dim.values(), *by_n.values()) if _ok(o)]
    parts = [
        "### Cost per step against the bare batched gradient",
        (
            f"Warm time per step (compilation excluded; median of {s.repeats} repeats of about "
            f"{s.repeat_seconds:g} s each) with N = {BATCH} points per step, every method "
            "driven through its public `refine` in one process, side by side: the bare "
            "batched log-density and gradient of N points (`BatchedTarget.compile_logp_dlogp` "
            "called from Python on an (N, D) array), GPF with N particles, GF with S = N draws "
            "(full rank and diagonal), WVGD with J = 4 particles × M = N/4 draws, ADVI and "
            "FullRankADVI with `obj_n_mc` = N (and ADVI with its default 1), SVGD with N "
            "particles; ours take their fixed-step update at learning_rate 0.001 (an automatic "
            "fit stops once converged), every method at its default optimiser (FullRankADVI "
            "started from "
            "L = 0.1 I: from PyMC's default its gradient is NaN in the first step on the "
            'logistic regression). "per gradient / bare" divides each step by its gradient '
            "evaluations and compares with the bare cost per point. Models: a logistic "
            f"regression (n = {N_OBS}, D = {N_WEIGHTS}: the gradient dominates) and the D = 20, "
            "κ = 10 Gaussian of the first section (the gradient is cheap: fixed costs show)."
        ),
        per_step,
        "### Scaling with D and N",
        (
            f"A diagonal Gaussian N(μ, diag σ²) in D dimensions (a gradient costs O(D)); "
            f"D ∈ {{{', '.join(f'{d:,}' for d in s.dims)}}} with N = {SCALING_BATCH} points "
            "per step (GPF particles, GF draws, SVGD particles; ADVI with its default "
            "`obj_n_mc=1`)"
            + (
                f", and N ∈ {{{', '.join(map(str, s.particles))}}} at D = {SCALING_DIM:,} "
                "(ADVI with `obj_n_mc` = N)"
                if s.particles
                else ""
            )
            + ". Each cell is one fresh process with a warm PyTensor cache. Memory is the "
            "process's peak resident set while stepping (the high-water mark is reset after "
            "the first step), everything included: the process holds "
            f"{fmt(min(baselines, default=float('nan')))}–"
            f"{fmt(max(baselines, default=float('nan')))} MB after the imports and the model, "
            "before any method runs, and compilation leaves more behind. GPF starts its "
            "particles with init_scale 0.1·sqrt(N/D) when N ≤ D (see the note under the "
            f"tables). FullRankADVI runs only up to D = {FULL_RANK_MAX_D:,}: it keeps "
            "D(D+1)/2 parameters plus PyMC's `adagrad_window` state of 10 gradients of that "
            "size (4.4 GB at D = 10⁴)."
        ),
        *scaling_tables(by_dim, s, "D"),
    ]
    if s.particles:
        parts += scaling_tables(by_n, s, "N")
    parts += [
        figure,
        "Time per step (top) and peak resident memory while stepping (bottom) against D and N: "
        "one fresh process per point.",
        "Note: with GPF's default init_scale 0.1 the N − 1 non-zero eigenvalues of the initial "
        "particle covariance are about 0.01·D/N (N ≪ D particles in general position are "
        "nearly orthogonal), so the stable step size shrinks with D/N: " + jitter_note + ".",
    ]
    return "\n\n".join(parts)


def _ok(out: dict | None) -> bool:
    return bool(out) and "error" not in out


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "child":
        print(json.dumps(child(json.loads(sys.argv[2]))))
    else:
        sys.exit("usage: python -m benchmarks.exp_speed child JSON (run by the suite)")
