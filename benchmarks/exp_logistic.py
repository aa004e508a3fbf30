"""Bayesian logistic regression: test NLL against wall time (the GPF paper's Fig. 6).

Data that ship with a package or with this repository: scikit-learn's breast cancer
(569 × 30) and German credit (1000 × 24, ``examples/data``). Features standardised on the
training part of each random 80/20 split, an intercept, the paper's prior ``w ~ N(0, 10 I)``
(sd √10), full-batch gradients. Mean-field methods (GPF and GF ``structure="diagonal"``,
ADVI) and low-rank / full-rank ones (GPF with N = 11 particles, GF rank 10, FullRankADVI,
SVGD) get the same wall-clock budget per split; the test NLL of the posterior predictive
is read at log-spaced steps. NUTS on the same split gives the exact posterior predictive's
NLL as the reference line.
"""

from __future__ import annotations

import time

from dataclasses import dataclass

import numpy as np

from benchmarks import common, realdata
from benchmarks.common import FitRun, MethodSpec, fit_method, quick_full
from benchmarks.suite import fit_cost

NAME = "logistic"
TITLE = "Bayesian logistic regression: test NLL vs time (paper Fig. 6)"

PRIOR_SD = float(np.sqrt(10.0))
TEST_FRACTION = 0.2
CHECK_DRAWS = 300
FINAL_DRAWS = 2_000
CLOSE = 0.01  # nats per test point: "converged" = within this of NUTS's test NLL


@dataclass(frozen=True)
class Settings(common.Settings):
    datasets: tuple[str, ...] = quick_full(("breast_cancer",), ("breast_cancer", "german_credit"))
    splits: int = quick_full(1, 3)
    budget: float = quick_full(1.5, 5.0)  # seconds of stepping per fit
    nuts: bool = quick_full(False, True)
    methods: tuple[str, ...] | None = quick_full(("GPF diagonal (N = 11)", "ADVI (default)"), None)


def method_specs() -> list[MethodSpec]:
    """Mean-field methods (:func:`family`), then low-rank and full-rank ones."""
    adam = {"optimizer": "adam", "learning_rate": 1e-2}
    diagonal = {"structure": "diagonal", "natural_mean": True}
    return [
        MethodSpec("GPF diagonal (N = 11)", "gpf", {**diagonal, "n_particles": 11}, adam),
        MethodSpec("GF diagonal (S = 10)", "gf", diagonal, adam),
        MethodSpec("ADVI (default)", "advi"),
        MethodSpec("ADVI (adam 0.01)", "advi", {}, common.pymc_optimizer("adam", 1e-2)),
        MethodSpec("GPF (N = 11, rank 10)", "gpf", {"n_particles": 11}, adam),
        MethodSpec("GF rank 10 (S = 10)", "gf", {"rank": 10}, adam),
        MethodSpec("FullRankADVI (default)", "fullrank_advi"),
        MethodSpec("SVGD (default, 100 particles)", "svgd"),
    ]


def family(run: FitRun) -> str:
    """A fit's family: "mean-field" (a diagonal structure, ADVI) or "low-rank" (the others)."""
    spec = run.spec
    diagonal = spec.method == "advi" or spec.inf_kwargs.get("structure") == "diagonal"
    return "mean-field" if diagonal else "low-rank"


def split_of(run: FitRun) -> int:
    """The split a fit ran on (split i is fitted with seed i + 1)."""
    return run.seed - 1


# ------------------------------------------------------------------------------ fits
@dataclass
class SplitData:
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def splits(name: str, n_splits: int, seed: int = 0) -> list[SplitData]:
    x, y = realdata.binary_dataset(name)
    out = []
    for train, test in realdata.random_splits(len(y), TEST_FRACTION, n_splits, seed):
        x_train, x_test = realdata.standardise(x[train], x[test])
        out.append(SplitData(x_train, y[train], x_test, y[test]))
    return out


def predictive(flat: np.ndarray, target, data: SplitData) -> dict[str, float]:
    draws = realdata.split_flat(flat, target)
    probs = realdata.logistic_probabilities({"w": draws["w"], "b": draws["b"]}, data.x_test)
    return realdata.classification_metrics(probs, data.y_test)


def fit_split(
    model, target, spec: MethodSpec, data: SplitData, split: int, budget: float
) -> FitRun:
    """One method on one split for ``budget`` seconds (a divergence ends the fit; the last
    finite state is evaluated and the failure noted); the final test NLL and accuracy in
    ``final``."""

    def metrics(approx) -> dict[str, float]:
        flat = realdata.flat_sample(approx, CHECK_DRAWS, split)
        return {"nll": predictive(flat, target, data)["nll"]}

    run = fit_method(
        spec,
        model,
        realdata.MAX_STEPS,
        seed=split + 1,
        check=metrics,
        check_at=common.geometric_steps(realdata.MAX_STEPS, per_decade=8),
        max_seconds=budget,
    )
    run.final = predictive(realdata.flat_sample(run.approx, FINAL_DRAWS, split), target, data)
    return run


def nuts_nll(model, target, data: SplitData, split: int) -> tuple[float, float, float]:
    """Test NLL and accuracy of NUTS's posterior predictive (2 chains × 500 draws), and its
    wall time."""
    import pymc as pm

    start = time.perf_counter()
    with model:
        idata = pm.sample(
            500,
            tune=500,
            chains=2,
            cores=1,
            random_seed=split + 1,
            progressbar=False,
            compute_convergence_checks=False,
        )
    seconds = time.perf_counter() - start
    post = idata.posterior
    draws = {"w": post["w"].values.reshape(-1, data.x_test.shape[1]), "b": post["b"].values.ravel()}
    probs = realdata.logistic_probabilities(draws, data.x_test)
    metrics = realdata.classification_metrics(probs, data.y_test)
    return metrics["nll"], metrics["accuracy"], seconds


def seconds_to_close(fit: FitRun, reference: float) -> float:
    for row in fit.checks:
        if row["nll"] <= reference + CLOSE:
            return float(row["seconds"])
    return float("inf")


# --------------------------------------------------------------------------- the run
def run(ctx) -> str:
    import pymc as pm

    import pymc_gpf

    settings = Settings.of(ctx.quick)
    specs = common.select_specs(method_specs(), settings.methods)
    fits: dict[str, list[FitRun]] = {}
    nuts: dict[str, list[tuple[float, float, float]]] = {}
    for name in settings.datasets:
        data = splits(name, settings.splits)
        model = realdata.logistic_model(data[0].x_train, data[0].y_train, PRIOR_SD)
        target = pymc_gpf.BatchedTarget(model)
        fits[name], nuts[name] = [], []
        for i, split in enumerate(data):
            pm.set_data({"x": split.x_train, "y": split.y_train}, model=model)
            for spec in specs:
                print(f"   {name} split {i}: {spec.label}", flush=True)
                fits[name].append(fit_split(model, target, spec, split, i, settings.budget))
            if settings.nuts:
                print(f"   {name} split {i}: NUTS", flush=True)
                nuts[name].append(nuts_nll(model, target, split, i))
        record(ctx, name, fits[name], nuts[name])
    figure = nll_figure(ctx, fits, nuts)
    return report(settings, fits, nuts, figure)


def record(ctx, name: str, fits: list[FitRun], nuts: list[tuple[float, float, float]]) -> None:
    for fit in fits:
        split = split_of(fit)
        note = f"split {split}" + (f"; {fit.failure}" if fit.failure else "")
        metrics = [
            ("test_nll", fit.final["nll"], "nats/point"),
            ("test_accuracy", fit.final["accuracy"], "fraction"),
        ]
        grads = float(fit.steps * fit.grads_per_step)
        cost = fit_cost(fit.steps, grads, fit.seconds, fit.first_call_seconds)
        ctx.record_many(name, fit.label, metrics + cost, note)
        if nuts:
            close = seconds_to_close(fit, nuts[split][0])
            ctx.record(name, fit.label, "seconds_to_nuts_nll", close, "s", note)
        for row in fit.checks:
            where = f"split {split}; step={row['step']} seconds={row['seconds']:.4g}"
            ctx.record(name, fit.label, "curve_test_nll", row["nll"], "nats/point", where)
    for split, (nll, acc, seconds) in enumerate(nuts):
        note = f"split {split}; 2 chains x 500 draws"
        ctx.record(name, "NUTS", "test_nll", nll, "nats/point", note)
        ctx.record(name, "NUTS", "test_accuracy", acc, "fraction", note)
        ctx.record(name, "NUTS", "seconds", seconds, "s", note)


# ------------------------------------------------------------------------ the report
def median_curve(fits: list[FitRun]) -> tuple[np.ndarray, np.ndarray]:
    """Median over splits of time and NLL at each common check step."""
    curves = [f.checks for f in fits if f.checks]
    if not curves:
        return np.array([]), np.array([])
    n = min(len(c) for c in curves)
    seconds = np.median([[r["seconds"] for r in c[:n]] for c in curves], axis=0)
    nll = np.median([[r["nll"] for r in c[:n]] for c in curves], axis=0)
    return seconds, nll


def nll_figure(ctx, fits, nuts) -> str:
    plt = common.pyplot()
    names = list(fits)
    families = list(dict.fromkeys(family(f) for name in names for f in fits[name]))
    fig, axes = plt.subplots(
        len(families), len(names), figsize=(5 * len(names), 3.3 * len(families)), squeeze=False
    )
    for col, name in enumerate(names):
        for row, kind in enumerate(families):
            ax = axes[row, col]
            labels = dict.fromkeys(f.label for f in fits[name] if family(f) == kind)
            for label in labels:
                seconds, nll = median_curve([f for f in fits[name] if f.label == label])
                keep = seconds > 0
                if not keep.any():
                    continue
                colour = common.METHOD_COLOURS.get(common.method_key(label), "C7")
                style = "--" if "default" in label else "-"
                ax.plot(seconds[keep], nll[keep], style, color=colour, lw=1.4, label=label)
            if nuts[name]:
                reference = np.median([n[0] for n in nuts[name]])
                ax.axhline(reference, color="k", lw=0.9, ls=":", label="NUTS")
            ax.set(xscale="log", yscale="log", xlabel="wall time (s, compilation excluded)")
            ax.set(ylabel="test NLL (nats / point)", title=f"{name}: {kind}")
            ax.legend(loc="upper right")
    path, markdown = ctx.figure("test_nll")
    common.save_figure(fig, path)
    return markdown


def summary_rows(name, fits, nuts):
    labels = list(dict.fromkeys(f.label for f in fits))
    rows, stats = [], {}
    reference = [n[0] for n in nuts]
    for label in labels:
        mine = [f for f in fits if f.label == label]
        nll = np.array([f.final["nll"] for f in mine])
        close = [seconds_to_close(f, reference[split_of(f)]) for f in mine] if reference else []
        stats[label] = {
            "nll": float(np.nanmedian(nll)) if np.isfinite(nll).any() else np.nan,
            "close": float(np.median(close)) if close else np.nan,
            "reached": sum(np.isfinite(close)),
            "ms_per_step": float(np.median([f.ms_per_step for f in mine])),
        }
        failures = sorted({f.failure for f in mine if f.failure})
        rows.append(
            [
                label,
                family(mine[0]),
                common.fmt(stats[label]["nll"], 4),
                f"{common.fmt(np.nanmin(nll), 4)}–{common.fmt(np.nanmax(nll), 4)}"
                if np.isfinite(nll).any()
                else "—",
                common.fmt(float(np.nanmedian([f.final["accuracy"] for f in mine])), 3),
                common.fmt(float(np.median([f.steps for f in mine])), 3),
                common.fmt(float(np.median([f.steps * f.grads_per_step for f in mine])), 3),
                common.fmt(stats[label]["ms_per_step"], 3),
                close_cell(stats[label], len(mine)) if reference else "—",
                "; ".join(failures),
            ]
        )
    if reference:
        rows.append(
            [
                "NUTS (2 × 500 draws)",
                "exact",
                common.fmt(float(np.median(reference)), 4),
                f"{common.fmt(min(reference), 4)}–{common.fmt(max(reference), 4)}",
                common.fmt(float(np.median([n[1] for n in nuts])), 3),
                "",
                "",
                "",
                f"{common.fmt(float(np.median([n[2] for n in nuts])), 2)} (total)",
                "",
            ]
        )
    return rows


def close_cell(stats: dict, n: int) -> str:
    return f"{common.fmt(stats['close'], 2)} ({stats['reached']}/{n})"


def report(settings, fits, nuts, figure) -> str:
    setup = (
        f"{settings.splits} random 80/20 train/test split(s) per data set "
        f"({', '.join(settings.datasets)}); features standardised on the training part, an "
        f"intercept, prior N(0, 10) on every weight (the paper's), full-batch gradients. "
        f"Every method gets {settings.budget:g} s of stepping per split (compilation "
        "excluded) from the model's initial point; ours use dimension-wise Adam with "
        "learning rate 0.01 and `natural_mean=True` for the diagonal fits (not for the "
        "low-rank ones, where it would confine the mean to the span of the factor); PyMC's "
        "methods use their defaults (ADVI also Adam 0.01). The test NLL is that of the "
        "posterior predictive p(y | x) averaged over "
        f"{CHECK_DRAWS} draws of q along the fit ({FINAL_DRAWS} at the end; SVGD: its "
        "particles), median over splits."
    )
    if settings.nuts:
        setup += (
            f" NUTS (2 chains × 500 draws) gives the exact predictive's NLL; 's to NUTS' is the "
            f"median time at which a method's test NLL first comes within {CLOSE} nats of it "
            "(splits that got there in brackets)."
        )
    headers = [
        "method",
        "family",
        "test NLL (median)",
        "range over splits",
        "accuracy",
        "steps",
        "grad evals",
        "ms / step",
        "s to NUTS",
        "failures",
    ]
    caption = f"Medians over the splits; test NLL and accuracy after {settings.budget:g} s."
    parts = [setup, figure]
    for name in fits:
        rows = summary_rows(name, fits[name], nuts[name])
        parts += [f"### {name}", caption, common.md_table(headers, rows)]
    return "\n\n".join(parts)
