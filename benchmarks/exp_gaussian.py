"""Paper Fig. 2: Gaussian targets in D = 20, error of the mean and covariance against wall time
and against gradient evaluations, for every method side by side."""

from __future__ import annotations

import time

from dataclasses import dataclass

import numpy as np

from benchmarks import common
from benchmarks.common import FitRun, GaussianTarget, MethodSpec, fmt, md_table, quick_full

NAME = "gaussian"
TITLE = "Gaussian targets, D = 20 (paper Fig. 2)"

D = 20
N = D + 1  # particles / samples per step, as in the paper
REL_TOL = 0.05  # "reached": ‖C − Σ‖_F < 5 % of ‖Σ‖_F
EXACT = 1e-10  # GPF stops once both errors are below this (it is deterministic and exact)


QUICK_METHODS = (
    "GPF, sgd 0.01",
    "GPF natural mean, sgd 0.01",
    "GF S=21, rmsprop 0.01",
    "ADVI (PyMC defaults)",
    "FullRankADVI (PyMC defaults)",
    "SVGD N=21 (PyMC defaults)",
)


@dataclass(frozen=True)
class Settings(common.Settings):
    kappas: tuple[float, ...] = (1, 10, 100)
    seeds: tuple[int, ...] = quick_full((1,), (1, 2))
    max_steps: int = quick_full(3000, 30_000)
    max_seconds: float = quick_full(0.4, 6.0)  # the time budget of every fit (compilation excluded)
    nuts_draws: int = quick_full(200, 1000)
    methods: tuple[str, ...] | None = quick_full(QUICK_METHODS, None)


def method_specs() -> list[MethodSpec]:
    """The paper's settings (§4.1: N = S = D + 1, plain descent η = 0.01 for particle
    methods, RMSProp 0.01 for stochastic ones) and PyMC's defaults."""
    gpf, sgd = {"n_particles": N}, {"learning_rate": 0.01}
    paper = (" S=21, rmsprop 0.01", common.pymc_optimizer("rmsprop", 0.01, obj_n_mc=N))
    tuned = {
        "advi": paper,
        "fullrank_advi": paper,
        "svgd": (", sgd 0.01", common.pymc_optimizer("sgd", 0.01)),
    }
    return [
        MethodSpec("GPF, sgd 0.01", "gpf", gpf, sgd),
        MethodSpec("GPF natural mean, sgd 0.01", "gpf", {**gpf, "natural_mean": True}, sgd),
        MethodSpec(
            "GF S=21, rmsprop 0.01",
            "gf",
            {"draws_per_step": N},
            {"learning_rate": 0.01, "optimizer": "rmsprop"},
        ),
        MethodSpec(
            "GF S=21 natural mean, sgd 0.001",
            "gf",
            {"draws_per_step": N, "natural_mean": True},
            {"learning_rate": 1e-3},
        ),
        *common.pymc_specs(N, tuned),
    ]


def start_point(seed: int) -> dict:
    """Every method of one seed starts its mean at the same random point ~ N(0, I)."""
    return {"x": np.random.default_rng(1000 + seed).normal(size=D)}


def fit_one(spec: MethodSpec, model, target: GaussianTarget, seed: int, s: Settings) -> FitRun:
    def exact(row: dict) -> bool:
        return spec.method == "gpf" and row["mean_error"] < EXACT and row["cov_error"] < EXACT

    return common.fit_method(
        spec,
        model,
        s.max_steps,
        seed,
        check=lambda approx: common.moment_errors(approx, target),
        check_at=common.geometric_steps(s.max_steps),
        stop_when=exact,
        max_seconds=s.max_seconds,
    )


@dataclass
class NutsRun:
    seconds: float  # sampling (tuning included), compilation excluded
    grads: int  # leapfrog steps, tuning included
    mean_error: float
    cov_error: float


def run_nuts(model, target: GaussianTarget, seed: int, draws: int) -> NutsRun:
    """One NUTS chain (PyMC's defaults, ``draws`` tuning steps and draws); the errors of the
    sample mean and covariance (1/n) of the draws."""
    import pymc as pm

    idata = pm.sample(
        draws,
        tune=draws,
        chains=1,
        random_seed=seed,
        progressbar=False,
        initvals=start_point(seed),
        discard_tuned_samples=False,
        compute_convergence_checks=False,
        model=model,
        backend=common.backend(),
    )
    x = idata.posterior["x"].values[0]
    z = x - x.mean(axis=0)
    steps = np.concatenate(
        [idata.warmup_sample_stats["n_steps"].values[0], idata.sample_stats["n_steps"].values[0]]
    )
    return NutsRun(
        float(idata.posterior.attrs["sampling_time"]),
        int(steps.sum()),
        float(np.linalg.norm(x.mean(axis=0) - target.mean)),
        float(np.linalg.norm(z.T @ z / len(x) - target.cov)),
    )


# ------------------------------------------------------------------------- the report
def _median(values) -> float:
    values = np.asarray(list(values), dtype=float)
    return float(np.median(values)) if len(values) else float("nan")


def summarise(ctx, case: str, label: str, runs: list[FitRun], sigma_norm: float) -> dict:
    """Record every seed's numbers and the medians; return the medians."""
    tol = REL_TOL * sigma_norm
    per_seed = {
        "final_mean_error": [r.checks[-1]["mean_error"] for r in runs],
        "final_cov_error": [r.checks[-1]["cov_error"] for r in runs],
        "steps": [r.steps for r in runs],
        "ms_per_step": [r.ms_per_step for r in runs],
        "seconds_to_tol": [r.first_below("cov_error", tol) for r in runs],
        "grads_to_tol": [r.first_below("cov_error", tol, "grads") for r in runs],
        "first_call_seconds": [r.first_call_seconds for r in runs],
    }
    units = {"ms_per_step": "ms", "seconds_to_tol": "s", "first_call_seconds": "s"}
    out = {"method": runs[0].spec.method, "grads_per_step": runs[0].grads_per_step}
    for metric, values in per_seed.items():
        for run, value in zip(runs, values, strict=True):
            ctx.record(case, label, metric, value, units.get(metric, ""), f"seed {run.seed}")
        out[metric] = ctx.record(
            case, label, metric, _median(values), units.get(metric, ""), "median over seeds"
        )
    out["reached"] = int(np.isfinite(per_seed["seconds_to_tol"]).sum())
    out["failures"] = [r.failure for r in runs if r.failure]
    return out


def table(rows: dict[str, dict], n_seeds: int) -> str:
    headers = [
        "method",
        "grads/step",
        "steps",
        "ms/step",
        "‖m−μ‖ at end",
        "‖C−Σ‖_F at end",
        f"reached {REL_TOL:.0%}",
        f"time to {REL_TOL:.0%} (s)",
        f"grad evals to {REL_TOL:.0%}",
        "first fit(1) call (s)",
    ]
    lines = []
    for label, r in rows.items():
        note = f" ({'; '.join(r['failures'])})" if r.get("failures") else ""
        if label.startswith("NUTS"):
            errors = [fmt(r["mean_error"]), fmt(r["cov_error"])]
            cost = [f"{fmt(r['seconds'])} (all draws)", fmt(r["grads"])]
            lines.append([label, "—", "—", "—", *errors, "—", *cost, "—"])
            continue
        lines.append(
            [
                label + note,
                r["grads_per_step"],
                f"{r['steps']:.0f}",
                fmt(r["ms_per_step"]),
                fmt(r["final_mean_error"]),
                fmt(r["final_cov_error"]),
                f"{r['reached']}/{n_seeds}",
                fmt(r["seconds_to_tol"]),
                fmt(r["grads_to_tol"]),
                fmt(r["first_call_seconds"]),
            ]
        )
    return md_table(headers, lines)


def line_style(spec: MethodSpec) -> str:
    """Dashed: natural mean (as the paper); dotted: PyMC's defaults; dash-dot: PyMC with the
    paper's optimiser."""
    if "natural_mean" in spec.inf_kwargs:
        return "--"
    if spec.method in common.PYMC_METHODS:
        return ":" if "defaults" in spec.label else "-."
    return "-"


def plot(ctx, results: dict, nuts: dict, axis: str, s: Settings) -> str:
    """Errors against ``axis`` ("seconds" or "grads"): rows mean/covariance, columns κ."""
    plt = common.pyplot()
    fig, axes = plt.subplots(2, len(s.kappas), figsize=(4.2 * len(s.kappas), 6.4), squeeze=False)
    for col, kappa in enumerate(s.kappas):
        for row, metric in enumerate(("mean_error", "cov_error")):
            ax = axes[row, col]
            for label, runs in results[kappa].items():
                colour = common.METHOD_COLOURS[runs[0].spec.method]
                style = line_style(runs[0].spec)
                for i, run in enumerate(runs):
                    x, y = run.column(axis), run.column(metric)
                    keep = (x > 0) & np.isfinite(y)
                    ax.loglog(
                        x[keep],
                        np.maximum(y[keep], 1e-16),
                        style,
                        color=colour,
                        lw=1.2,
                        alpha=0.85,
                        label=label if i == 0 else None,
                    )
            for i, run in enumerate(nuts[kappa]):
                ax.loglog(
                    run.seconds if axis == "seconds" else run.grads,
                    getattr(run, metric),
                    "k*",
                    ms=8,
                    label=f"NUTS ({s.nuts_draws} + {s.nuts_draws} tune)" if i == 0 else None,
                )
            ax.set_title(f"κ = {kappa:g}: {'‖m − μ‖' if row == 0 else '‖C − Σ‖_F'}")
            ax.set_xlabel("wall time (s)" if axis == "seconds" else "gradient evaluations")
    common.legend_below(fig, axes, ncol=3)
    path, markdown = ctx.figure(f"errors_vs_{axis}")
    common.save_figure(fig, path)
    return markdown


def run(ctx) -> str:
    s = Settings.of(ctx.quick)
    specs = method_specs()
    targets = {k: common.gaussian_target(common.condition_spectrum(D, k), 0) for k in s.kappas}
    model = common.gaussian_model(targets[s.kappas[0]])
    results: dict[float, dict[str, list[FitRun]]] = {}
    nuts: dict[float, list[NutsRun]] = {}
    rows: dict[float, dict[str, dict]] = {}
    sections = []
    for kappa in s.kappas:
        target = targets[kappa]
        common.set_gaussian(model, target)
        case = f"kappa={kappa:g}"
        sigma_norm = float(np.linalg.norm(target.cov))
        ctx.record(case, "target", "cov_frobenius_norm", sigma_norm)
        results[kappa] = {}
        for seed in s.seeds:
            for spec in common.select_specs(specs, s.methods, start_point(seed)):
                start = time.perf_counter()
                run_ = fit_one(spec, model, target, seed, s)
                results[kappa].setdefault(spec.label, []).append(run_)
                print(
                    f"  κ={kappa:g} seed {seed} {spec.label}: {run_.steps} steps, "
                    f"cov error {run_.checks[-1]['cov_error']:.3g} "
                    f"({time.perf_counter() - start:.1f} s)",
                    flush=True,
                )
        nuts[kappa] = [run_nuts(model, target, seed, s.nuts_draws) for seed in s.seeds]
        rows[kappa] = {
            label: summarise(ctx, case, label, runs, sigma_norm)
            for label, runs in results[kappa].items()
        }
        nuts_label = f"NUTS, 1 chain, {s.nuts_draws} tune + {s.nuts_draws} draws"
        nuts_row = {}
        for field_ in ("seconds", "grads", "mean_error", "cov_error"):
            values = [getattr(r, field_) for r in nuts[kappa]]
            for seed, value in zip(s.seeds, values, strict=True):
                ctx.record(
                    case,
                    nuts_label,
                    field_,
                    value,
                    "s" if field_ == "seconds" else "",
                    f"seed {seed}",
                )
            nuts_row[field_] = ctx.record(
                case,
                nuts_label,
                field_,
                _median(values),
                "s" if field_ == "seconds" else "",
                "median over seeds",
            )
        rows[kappa][nuts_label] = nuts_row
        sections.append(
            f"**κ = {kappa:g}** (‖Σ‖_F = {fmt(sigma_norm)}; {REL_TOL:.0%} of it = "
            f"{fmt(REL_TOL * sigma_norm)}):\n\n{table(rows[kappa], len(s.seeds))}"
        )
    fig_time = plot(ctx, results, nuts, "seconds", s)
    fig_grads = plot(ctx, results, nuts, "grads", s)
    setup = (
        f"Target N(μ, Σ) in D = {D}: μ ~ N(0, I), Σ = U Λ Uᵀ with U from the QR of a U(0, 1) "
        f"matrix and log10 Λ_ii evenly from −1 to −1 + log10 κ, κ ∈ "
        f"{{{', '.join(f'{k:g}' for k in s.kappas)}}} (paper §4.1), written as a flat prior plus "
        "a potential so the unconstrained space is x itself; μ and the precision factor are "
        "`pm.Data`, so all targets share one compiled graph per method. Every method of a seed "
        f"starts its mean at the same point ~ N(0, I) (seeds {list(s.seeds)}) with its own "
        "default initial spread (GPF init_scale 0.1, GF 0.1 I, ADVI σ = softplus(0), FullRankADVI "
        "L = softplus(1) I, SVGD jitter 1). The paper's settings: N = S = D + 1 = "
        f"{N} particles or samples, plain descent η = 0.01 for the particle methods, RMSProp "
        "0.01 for the stochastic ones; next to them PyMC's defaults (`adagrad_window`, η = "
        "0.001, `obj_n_mc=1`). Each fit runs at most "
        f"{s.max_steps} steps (the paper's 30 000) or {s.max_seconds:g} s of stepping "
        "(compilation excluded; the first `fit(1)` call is timed separately), whichever comes "
        "first; GPF stops once both errors are below 1e-10. Errors are checked at steps spread "
        "evenly in log(step), their cost excluded from the time axis. C is the fitted "
        "covariance (GPF, SVGD: particle covariance with 1/N; GF: ΓΓᵀ; ADVI: its diagonal "
        "Gaussian). NUTS (PyMC's defaults, one chain) is a point: the errors of its draws' "
        f"mean and covariance, at its sampling time. "
        'Tables: medians over seeds; "time to 5 %" is the wall time at the first check '
        "with ‖C − Σ‖_F below 5 % of ‖Σ‖_F."
    )
    caption = "Errors against wall time, then against gradient evaluations: a line per seed."
    return "\n\n".join([setup, *sections, fig_time, fig_grads, caption])
