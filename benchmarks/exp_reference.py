"""Posteriors with outside ground truth: posteriordb reference draws and inference-gym.

Every method gets the same wall-clock budget per posterior (compilation excluded; the first
``fit(1)`` call is timed on its own), starts from the model's initial point and uses one
setting for every posterior. Along the way its q is read at log-spaced times; at the end it
is compared with the reference on the constrained scale, for exactly the reference
parameters: standardised errors of means and sds, a sliced Wasserstein distance on
standardised draws, gradient evaluations and wall time. NUTS (PyMC's ``pm.sample``) runs
on every translated model as a check of the translation and as the sampler's column.
"""

from __future__ import annotations

import time

from dataclasses import dataclass

import numpy as np

from benchmarks import common, realdata
from benchmarks.common import MethodSpec, fit_method
from benchmarks.realdata import ReferenceCase
from benchmarks.suite import fit_cost

NAME = "reference"
TITLE = "Posteriors with outside ground truth (posteriordb, inference-gym)"

CHECK_DRAWS = 2_000
FINAL_DRAWS = 10_000
DIAGNOSE_DRAWS = 4_000  # pymc_gpf.diagnose of our fits at the end
MEAN_NOISE, SD_NOISE = 0.03, 0.02  # the references' own Monte Carlo error (README)
GOOD_MEAN, GOOD_SD = 0.1, 0.1  # "accurate": max |eps_mu| < 0.1 and max |eps_sigma| < 10 %


@dataclass(frozen=True)
class Settings:
    budget: float  # seconds of stepping per method and posterior
    cases: tuple[str, ...]  # case names; () = all
    nuts: bool


QUICK = Settings(budget=2.0, cases=("sblrc-blr",), nuts=False)
FULL = Settings(budget=8.0, cases=(), nuts=True)


def method_specs(quick: bool) -> list[MethodSpec]:
    """Every method at its defaults plus one alternative optimiser, one setting for every
    posterior (ours always with ``natural_mean=True``, which the docs recommend)."""
    import pymc as pm

    adam = {"optimizer": "adam", "learning_rate": 1e-2}
    natural = {"natural_mean": True}
    specs = [
        MethodSpec("GPF (default sgd 0.001)", "gpf", natural),
        MethodSpec("GPF (adam 0.01)", "gpf", natural, adam),
        MethodSpec("GF (default sgd 0.001)", "gf", natural),
        MethodSpec("GF (adam 0.01)", "gf", natural, adam),
        MethodSpec("WVGD (default, J = 5)", "wvgd"),
        MethodSpec("ADVI (default)", "advi"),
        MethodSpec("ADVI (adam 0.01)", "advi", {}, {"obj_optimizer": pm.adam(learning_rate=1e-2)}),
        MethodSpec("FullRankADVI (default)", "fullrank_advi"),
        MethodSpec(
            "FullRankADVI (adam 0.001)",
            "fullrank_advi",
            {},
            {"obj_optimizer": pm.adam(learning_rate=1e-3)},
        ),
        MethodSpec("SVGD (default)", "svgd"),
    ]
    if quick:
        return [specs[1], specs[5]]
    return specs


# ------------------------------------------------------------------------ evaluation
@dataclass
class Accuracy:
    eps_mean: np.ndarray
    eps_sd: np.ndarray
    wasserstein: float  # sliced W2 on standardised draws; nan without reference draws

    @property
    def max_mean(self) -> float:
        return float(np.max(np.abs(self.eps_mean)))

    @property
    def max_sd(self) -> float:
        return float(np.max(np.abs(self.eps_sd)))

    @property
    def median_mean(self) -> float:
        return float(np.median(np.abs(self.eps_mean)))

    @property
    def median_sd(self) -> float:
        return float(np.median(np.abs(self.eps_sd)))

    @property
    def good(self) -> bool:
        return self.max_mean < GOOD_MEAN and self.max_sd < GOOD_SD


def accuracy(case: ReferenceCase, columns: np.ndarray, wasserstein: bool) -> Accuracy:
    """Compare draws of the reference parameters ``(S, P)`` with the reference."""
    finite = np.all(np.isfinite(columns), axis=1)
    if not finite.any():
        nan = np.full(len(case.parameters), np.nan)
        return Accuracy(nan, nan, np.nan)
    columns = columns[finite]
    eps_mean, eps_sd = realdata.standardised_errors(
        columns.mean(axis=0), columns.std(axis=0, ddof=1), case.ref_mean, case.ref_sd
    )
    distance = np.nan
    if wasserstein and case.ref_draws is not None:
        distance = realdata.sliced_wasserstein(
            (columns - case.ref_mean) / case.ref_sd,
            (case.ref_draws - case.ref_mean) / case.ref_sd,
        )
    return Accuracy(eps_mean, eps_sd, distance)


def reference_floor(case: ReferenceCase) -> float:
    """Sliced W2 between the reference's chains 1-5 and 6-10: the metric's noise level."""
    if case.ref_draws is None:
        return np.nan
    z = (case.ref_draws - case.ref_mean) / case.ref_sd
    first = case.ref_chains <= case.ref_chains.max() // 2
    return realdata.sliced_wasserstein(z[first], z[~first])


@dataclass
class Result:
    label: str
    steps: int
    grads: float
    seconds: float
    first_call: float
    accuracy: Accuracy
    curve: list[dict[str, float]]
    failure: str | None
    # pymc_gpf.diagnose of ours (nan for the others): Pareto k̂ and -ELBO - F
    khat: float = np.nan
    gap: float = np.nan
    finite_n_bias: bool = False


def fit_case(case: ReferenceCase, spec: MethodSpec, budget: float, seed: int) -> Result:
    """Fit one method on one posterior for ``budget`` seconds of stepping (a divergence
    ends the fit; the last finite state is evaluated and the failure noted)."""
    import pymc_gpf

    constrained = pymc_gpf.BatchedTarget(case.model).compile_constrained(backend=common.backend())

    def columns(approx, draws: int) -> np.ndarray:
        return case.columns(constrained(realdata.flat_sample(approx, draws, seed)))

    def metrics(approx) -> dict[str, float]:
        acc = accuracy(case, columns(approx, CHECK_DRAWS), wasserstein=False)
        return {"max_eps_mean": acc.max_mean, "max_eps_sd": acc.max_sd}

    run = fit_method(
        spec,
        case.model,
        realdata.MAX_STEPS,
        seed,
        check=metrics,
        check_at=common.geometric_steps(realdata.MAX_STEPS, per_decade=6),
        max_seconds=budget,
    )
    final = accuracy(case, columns(run.approx, FINAL_DRAWS), wasserstein=True)
    failure = run.failure
    diagnosis = None
    if spec.method in common.OURS:
        if failure:
            failure += " (wall time includes pymc-gpf's diagnosis of it)"
        try:
            diagnosis = pymc_gpf.diagnose(run.approx, DIAGNOSE_DRAWS, random_seed=seed)
        except (FloatingPointError, ValueError) as err:  # e.g. no finite log p at any draw
            failure = (failure + "; " if failure else "") + f"diagnose: {str(err)[:80]}"
    return Result(
        spec.label,
        run.steps,
        float(run.steps * run.grads_per_step),
        run.seconds,
        run.first_call_seconds,
        final,
        run.checks,
        failure,
        khat=diagnosis.pareto_k if diagnosis else np.nan,
        gap=diagnosis.free_energy_gap if diagnosis else np.nan,
        finite_n_bias=bool(diagnosis and diagnosis.finite_n_bias),
    )


def run_nuts(case: ReferenceCase, seed: int) -> Result:
    """PyMC's NUTS, 2 chains × (1000 tuning + 1000 draws), one core; its wall time includes
    PyMC's set-up (graph rewrites, loading the compiled function from the cache)."""
    import pymc as pm

    start = time.perf_counter()
    with case.model:
        idata = pm.sample(
            1000,
            tune=1000,
            chains=2,
            cores=1,
            random_seed=seed,
            progressbar=False,
            compute_convergence_checks=False,
            discard_tuned_samples=False,
        )
    seconds = time.perf_counter() - start
    post = idata.posterior
    values = {k: post[k].values.reshape(-1, *post[k].shape[2:]) for k in post.data_vars}
    grads = float(idata.sample_stats["n_steps"].sum() + idata.warmup_sample_stats["n_steps"].sum())
    divergences = int(idata.sample_stats["diverging"].sum())
    acc = accuracy(case, case.columns(values), wasserstein=True)
    note = f"{divergences} divergences" if divergences else None
    return Result("NUTS (PyMC, 2 × 1000 draws)", 2000, grads, seconds, np.nan, acc, [], note)


# --------------------------------------------------------------------------- the run
def selected_cases(settings: Settings) -> list[ReferenceCase]:
    cases = realdata.reference_cases()
    return [c for c in cases if not settings.cases or c.name in settings.cases]


def record(ctx, case: ReferenceCase, result: Result) -> None:
    acc = result.accuracy
    method = result.label
    note = result.failure or ""
    cost = fit_cost(result.steps, result.grads, result.seconds, result.first_call)
    metrics = [
        ("max_abs_eps_mean", acc.max_mean, "ref sd"),
        ("median_abs_eps_mean", acc.median_mean, "ref sd"),
        ("max_abs_eps_sd", acc.max_sd, "fraction"),
        ("median_abs_eps_sd", acc.median_sd, "fraction"),
        ("sliced_w2", acc.wasserstein, "ref sd"),
        ("seconds_to_accurate", seconds_to_accurate(result), "s"),
        ("pareto_khat", result.khat, ""),
        ("free_energy_gap", result.gap, "nats"),
    ]
    ctx.record_many(case.name, method, cost + metrics, note)
    for name, em, es in zip(case.parameters, acc.eps_mean, acc.eps_sd, strict=True):
        ctx.record(case.name, method, f"eps_mean[{name}]", em, "ref sd", note)
        ctx.record(case.name, method, f"eps_sd[{name}]", es, "fraction", note)
    for row in result.curve:
        where = f"step={row['step']} seconds={row['seconds']:.4g}"
        ctx.record(
            case.name, method, "curve_max_abs_eps_mean", row["max_eps_mean"], "ref sd", where
        )
        ctx.record(case.name, method, "curve_max_abs_eps_sd", row["max_eps_sd"], "fraction", where)


def seconds_to_accurate(result: Result) -> float:
    """Stepping time at the first check with max |eps_mu| < 0.1 and max |eps_sigma| < 10 %."""
    for row in result.curve:
        if row["max_eps_mean"] < GOOD_MEAN and row["max_eps_sd"] < GOOD_SD:
            return float(row["seconds"])
    return float("inf")


def run(ctx) -> str:
    settings = QUICK if ctx.quick else FULL
    specs = method_specs(ctx.quick)
    cases = selected_cases(settings)
    results: dict[str, list[Result]] = {}
    floors: dict[str, float] = {}
    for case in cases:
        floors[case.name] = reference_floor(case)
        results[case.name] = []
        for spec in specs:
            print(f"   {case.name}: {spec.label}", flush=True)
            result = fit_case(case, spec, settings.budget, seed=1)
            results[case.name].append(result)
            record(ctx, case, result)
        if settings.nuts:
            print(f"   {case.name}: NUTS", flush=True)
            result = run_nuts(case, seed=1)
            results[case.name].append(result)
            record(ctx, case, result)
        if np.isfinite(floors[case.name]):
            note = "reference chains 1-5 vs 6-10"
            ctx.record(case.name, "reference", "sliced_w2", floors[case.name], "ref sd", note)
    figures = [curves_figure(ctx, cases, results, key) for key in ("max_eps_mean", "max_eps_sd")]
    return report(settings, cases, results, floors, figures)


# ------------------------------------------------------------------------ the report


def curves_figure(ctx, cases, results, key: str) -> str:
    plt = common.pyplot()
    ncols = min(3, len(cases))
    nrows = -(-len(cases) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.2 * nrows), squeeze=False)
    styles = {}
    for ax, case in zip(axes.flat, cases, strict=False):
        for result in results[case.name]:
            rows = [r for r in result.curve if r["seconds"] > 0 and np.isfinite(r[key])]
            if not rows:
                continue
            colour = common.METHOD_COLOURS.get(common.method_key(result.label), "C7")
            style = styles.setdefault(result.label, "-" if "default" not in result.label else "--")
            ax.plot(
                [r["seconds"] for r in rows],
                [r[key] for r in rows],
                style,
                color=colour,
                lw=1.3,
                label=result.label,
            )
        ax.axhline(GOOD_MEAN if key == "max_eps_mean" else GOOD_SD, color="grey", lw=0.8, ls=":")
        ax.set(
            xscale="log",
            yscale="log",
            title=case.title,
            xlabel="wall time (s, compilation excluded)",
        )
        ax.set_ylabel("max |ε_μ| (reference sds)" if key == "max_eps_mean" else "max |ε_σ|")
    for ax in list(axes.flat)[len(cases) :]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), frameon=False)
    fig.subplots_adjust(bottom=0.2)
    path, markdown = ctx.figure(key)
    fig.tight_layout(rect=(0, 0.08 if nrows > 1 else 0.16, 1, 1))
    fig.savefig(path)
    plt.close(fig)
    return markdown


def combined(result: Result) -> float:
    """The worse of max |eps_mu| and max |eps_sigma| (nan after a failure)."""
    return max(result.accuracy.max_mean, result.accuracy.max_sd)


def case_table(results: list[Result]) -> str:
    fmt = common.fmt
    rows = []
    for r in results:
        acc = r.accuracy
        rows.append(
            [
                r.label,
                fmt(r.steps, 3),
                fmt(r.grads, 3),
                fmt(r.seconds, 3),
                fmt(r.first_call, 2),
                fmt(acc.max_mean, 2),
                fmt(acc.median_mean, 2),
                f"{fmt(100 * acc.max_sd, 2)} %" if np.isfinite(acc.max_sd) else "—",
                f"{fmt(100 * acc.median_sd, 2)} %" if np.isfinite(acc.median_sd) else "—",
                fmt(acc.wasserstein, 2),
                fmt(seconds_to_accurate(r), 2),
                fmt(r.khat, 2) if np.isfinite(r.khat) else "",
                (fmt(r.gap, 2) + (" (flagged)" if r.finite_n_bias else ""))
                if np.isfinite(r.gap)
                else "",
                r.failure or "",
            ]
        )
    headers = [
        "method",
        "steps",
        "grad evals",
        "wall (s)",
        "first call (s)",
        "max abs ε_μ",
        "median abs ε_μ",
        "max abs ε_σ",
        "median abs ε_σ",
        "sliced W2",
        "s to accurate",
        "k̂",
        "−ELBO − F",
        "note",
    ]
    return common.md_table(headers, rows)


def summary(cases, results) -> tuple[str, dict[str, dict[str, float]]]:
    labels = [r.label for r in results[cases[0].name]]
    stats: dict[str, dict[str, float]] = {}
    rows = []
    for i, label in enumerate(labels):
        per_case = [results[c.name][i] for c in cases]
        good = sum(r.accuracy.good for r in per_case)
        failed = sum(r.failure is not None and "divergences" not in r.failure for r in per_case)
        med = {
            key: float(np.nanmedian([getattr(r.accuracy, key) for r in per_case]))
            if any(np.isfinite(getattr(r.accuracy, key)) for r in per_case)
            else np.nan
            for key in ("max_mean", "max_sd", "wasserstein")
        }
        stats[label] = {"good": good, "failed": failed, **med}
        rows.append(
            [
                label,
                f"{good}/{len(cases)}",
                common.fmt(med["max_mean"], 2),
                f"{common.fmt(100 * med['max_sd'], 2)} %",
                common.fmt(med["wasserstein"], 2),
                str(failed),
            ]
        )
    headers = [
        "method",
        "accurate (max abs ε_μ < 0.1, max abs ε_σ < 10 %)",
        "median max abs ε_μ",
        "median max abs ε_σ",
        "median sliced W2",
        "failed fits",
    ]
    return common.md_table(headers, rows), stats


def findings(cases, results, stats) -> str:
    """Sentences computed from the numbers."""
    n = len(cases)
    vi = [label for label in stats if not label.startswith("NUTS")]
    ours = [label for label in vi if common.method_key(label) in common.OURS]
    theirs = [label for label in vi if common.method_key(label) in common.PYMC_METHODS]
    counts = ", ".join(f"{label} {stats[label]['good']}/{n}" for label in vi)
    lines = [f"Accurate on every reference parameter at the end of the budget: {counts}."]
    if "NUTS (PyMC, 2 × 1000 draws)" in stats:
        s = stats["NUTS (PyMC, 2 × 1000 draws)"]
        lines.append(
            f"NUTS, the check of the translations, is accurate on {s['good']}/{n} "
            f"(median max |ε_μ| {common.fmt(s['max_mean'], 2)}, about the Monte Carlo error "
            "of 2000 correlated draws)."
        )
    best_per_case = []
    for c in cases:
        finite = [r for r in results[c.name] if r.label in vi and np.isfinite(combined(r))]
        if finite:
            best_per_case.append(f"{c.name}: {min(finite, key=combined).label}")
    lines.append(
        "Smallest worst-case error among the VI methods — " + "; ".join(best_per_case) + "."
    )
    if ours and theirs:
        ratios = []
        for label in ours:
            i = [r.label for r in results[cases[0].name]].index(label)
            per_case = []
            for c in cases:
                best_theirs = min(
                    (
                        combined(r)
                        for r in results[c.name]
                        if r.label in theirs and np.isfinite(combined(r))
                    ),
                    default=np.nan,
                )
                per_case.append(combined(results[c.name][i]) / best_theirs)
            ratio = np.nanmedian(per_case) if np.any(np.isfinite(per_case)) else np.nan
            wins = int(np.sum(np.array(per_case) < 1))
            ratios.append(
                f"{label}: median ratio {common.fmt(ratio, 2)}, smaller on {wins}/{n} posteriors"
            )
        lines.append(
            "Worst-case error of ours relative to the best PyMC VI method on the same "
            "posterior (below 1: ours is closer to the reference) — " + "; ".join(ratios) + "."
        )
    flagged = [f"{r.label} on {c.name}" for c in cases for r in results[c.name] if r.finite_n_bias]
    lines.append(
        "`pymc_gpf.diagnose` (columns k̂ and −ELBO − F, from "
        f"{DIAGNOSE_DRAWS} draws of q) flagged finite-N bias — the particles' free energy F "
        "significantly below an independent −ELBO, a q k̂ may still call good — for: "
        + ("; ".join(flagged) if flagged else "none")
        + "."
    )
    return " ".join(lines)


def drifts(cases, results) -> str:
    """Fits that got much closer to the reference along the way than where they ended."""
    found = []
    for c in cases:
        for r in results[c.name]:
            seen = [max(row["max_eps_mean"], row["max_eps_sd"]) for row in r.curve]
            best = min((v for v in seen if np.isfinite(v)), default=np.nan)
            end = combined(r)
            if np.isfinite(best) and (not np.isfinite(end) or end > 3 * best) and best < 1:
                found.append(
                    f"{r.label} on {c.name} (worst-parameter error {common.fmt(best, 2)} at "
                    f"best, {common.fmt(end, 2)} at the end)"
                )
    if not found:
        return ""
    return (
        "Got within reach and then moved away (more than 3× the best error seen along the "
        "fit; a divergence or, without one, a drift): " + "; ".join(found) + "."
    )


def report(settings, cases, results, floors, figures) -> str:
    table, stats = summary(cases, results)
    floor_text = ", ".join(
        f"{c.name} {common.fmt(floors[c.name], 2)}" for c in cases if np.isfinite(floors[c.name])
    )
    setup = (
        f"Every method gets {settings.budget:g} s of stepping per posterior (the first "
        "`fit(1)` call, which compiles, is timed separately), starts from the model's "
        "initial point with seed 1 and uses one setting on every posterior: its defaults "
        "and one alternative optimiser (ours with `natural_mean=True`, as the docs "
        "recommend: GPF with its default N = max(D + 1, 50) particles, GF full rank with "
        "S = 10 draws per step, WVGD with J = 5, M = 50; the alternative is dimension-wise "
        "Adam 0.01; PyMC's ADVI with Adam 0.01, FullRankADVI with Adam 0.001). "
        f"{len(cases)} posterior(s) from the reference set in `benchmarks/data/` and "
        "`examples/data/`; the PyMC models are translations of the Stan models (same "
        "priors and parameterisation, flat priors as `pm.Flat`), compared on the "
        "constrained scale for exactly the reference parameters. ε_μ = (m − μ_ref)/σ_ref and "
        "ε_σ = (s − σ_ref)/σ_ref per parameter from "
        f"{FINAL_DRAWS} draws of q (SVGD: its particles); the sliced W2 is the root mean "
        "squared 1-D Wasserstein-2 distance over 200 random directions between the "
        "standardised draws of q and the reference draws. The references' own noise is "
        f"about {MEAN_NOISE} sd in means and {100 * SD_NOISE:g} % in sds; the sliced W2 "
        f"between two halves of each reference is {floor_text}."
    )
    if settings.nuts:
        setup += (
            " NUTS is PyMC's `pm.sample` (2 chains × 1000 tuning + 1000 draws, one core; its "
            "wall time includes PyMC's set-up and its gradient count the tuning steps)."
        )
    parts = [setup, "### Summary", table, findings(cases, results, stats), drifts(cases, results)]
    parts = [p for p in parts if p] + figures
    parts.append(
        "Curves: the worst parameter's error along the fit (2000 draws of q at log-spaced "
        "steps); dotted line: the 'accurate' threshold; dashed: a method at its defaults."
    )
    for c in cases:
        parts.append(
            f"### {c.title}\n\n{c.notes}; D = {len(c.parameters)} reference parameters; {c.source}."
        )
        parts.append(case_table(results[c.name]))
    return "\n\n".join(parts)
