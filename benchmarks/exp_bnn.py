"""A Bayesian neural network on scikit-learn's digits (the GPF paper's Table 1 analogue).

The 8×8 digits (1797 images, 10 classes; one fixed 80/20 split), networks with one and
two tanh hidden layers, prior ``N(0, 1)`` on every weight and bias, minibatches of 128 rows
(``pm.Minibatch`` with ``total_size``; PyMC's SVGD refuses minibatches, so it sees the full
training set). Every method gets the same wall-clock budget; the test NLL, accuracy and
expected calibration error of the posterior predictive (averaged over draws of q) are
read along the fit and at the end.
"""

from __future__ import annotations

import itertools

from dataclasses import dataclass

import numpy as np

from benchmarks import common, realdata
from benchmarks.common import FitRun, MethodSpec, fit_method, quick_full
from benchmarks.realdata import BNNArchitecture
from benchmarks.suite import fit_cost

NAME = "bnn"
TITLE = "Bayesian neural network on digits: NLL, accuracy, calibration (paper Table 1)"

BATCH = 128
PRIOR_SD = 1.0
TEST_FRACTION = 0.2
CHECK_DRAWS = 50
FINAL_DRAWS = 500
ECE_BINS = 10


@dataclass(frozen=True)
class Settings(common.Settings):
    architectures: tuple[tuple[int, ...], ...] = quick_full(((16,),), ((20,), (20, 20)))  # hidden
    budget: float = quick_full(3.0, 15.0)  # seconds of stepping per fit
    methods: tuple[str, ...] | None = quick_full(
        ("GPF variables (N = 11)", "ADVI (adam 0.01)"), None
    )


def method_specs() -> list[MethodSpec]:
    rms = {"optimizer": "rmsprop", "learning_rate": 1e-2}
    adam = common.pymc_optimizer("adam", 1e-2)
    return [
        MethodSpec("GPF full (N = 11)", "gpf", {"n_particles": 11}, rms),
        MethodSpec(
            "GPF variables (N = 11)", "gpf", {"n_particles": 11, "structure": "variables"}, rms
        ),
        MethodSpec(
            "GPF diagonal (N = 11)", "gpf", {"n_particles": 11, "structure": "diagonal"}, rms
        ),
        MethodSpec("GF rank 5 (S = 10)", "gf", {"rank": 5}, rms),
        MethodSpec("GF rank 10 (S = 10)", "gf", {"rank": 10}, rms),
        MethodSpec("GF diagonal (S = 10)", "gf", {"structure": "diagonal"}, rms),
        MethodSpec("ADVI (default)", "advi"),
        MethodSpec("ADVI (adam 0.01)", "advi", {}, adam),
        MethodSpec("SVGD (10 particles, adam 0.01)", "svgd", {"n_particles": 10}, adam),
        MethodSpec("Deep ensemble (defaults, N = 20; full batch)", "ensemble", {"kind": "deep"}),
        MethodSpec("Langevin ensemble (defaults, N = 20; SGLD)", "ensemble"),
        MethodSpec(
            "Repulsive ensemble (defaults, N = 20; SGLD)", "ensemble", {"kind": "repulsive"}
        ),
    ]


# ------------------------------------------------------------------------------ data
@dataclass
class Digits:
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def digits_split(seed: int = 0) -> Digits:
    x, y = realdata.digits()
    ((train, test),) = realdata.random_splits(len(y), TEST_FRACTION, 1, seed)
    return Digits(x[train], y[train], x[test], y[test])


def initial_weights(arch: BNNArchitecture, seed: int = 0) -> dict[str, np.ndarray]:
    """Random initial weights (``N(0, 1 / fan_in)``, zero biases), the start of every
    method: the model's own initial point (all zeros) is a saddle of a tanh network where
    only the output bias has a gradient (the paper also starts at a random network)."""
    rng = np.random.default_rng(seed)
    start = {}
    for layer, (a, b) in enumerate(itertools.pairwise(arch.widths)):
        start[f"W{layer}"] = rng.normal(0.0, 1.0 / np.sqrt(a), size=(a, b))
        start[f"b{layer}"] = np.zeros(b)
    return start


# ------------------------------------------------------------------------------ fits
def predict(approx, target, arch: BNNArchitecture, x: np.ndarray, draws: int, seed: int):
    flat = realdata.flat_sample(approx, draws, seed)
    return realdata.bnn_probabilities(realdata.split_flat(flat, target), arch, x)


def fit_network(
    spec: MethodSpec, model, arch: BNNArchitecture, data: Digits, budget: float
) -> FitRun:
    """One method for ``budget`` seconds; the final test metrics and predictive
    probabilities (``probs``) in ``final``."""
    import pymc_gpf

    target = pymc_gpf.BatchedTarget(model)

    def metrics(approx) -> dict[str, float]:
        probs = predict(approx, target, arch, data.x_test, CHECK_DRAWS, 0)
        return realdata.classification_metrics(probs, data.y_test, ECE_BINS)

    run = fit_method(
        spec,
        model,
        realdata.MAX_STEPS,
        seed=1,
        check=metrics,
        check_at=common.geometric_steps(realdata.MAX_STEPS, per_decade=6),
        max_seconds=budget,
    )
    probs = predict(run.approx, target, arch, data.x_test, FINAL_DRAWS, 1)
    run.final = realdata.classification_metrics(probs, data.y_test, ECE_BINS)
    run.final["probs"] = probs
    return run


# --------------------------------------------------------------------------- the run
def run(ctx) -> str:
    settings = Settings.of(ctx.quick)
    data = digits_split()
    fits: dict[str, list[FitRun]] = {}
    archs: dict[str, BNNArchitecture] = {}
    for hidden in settings.architectures:
        arch = BNNArchitecture(data.x_train.shape[1], hidden, 10)
        archs[arch.describe()] = arch
        minibatched = realdata.bnn_model(data.x_train, data.y_train, arch, PRIOR_SD, BATCH)
        full_batch = None
        fits[arch.describe()] = []
        start = initial_weights(arch)  # every method starts at the same random network
        for spec in common.select_specs(method_specs(), settings.methods, start):
            print(f"   {arch.describe()}: {spec.label}", flush=True)
            # PyMC's SVGD refuses pm.Minibatch; a deep ensemble's line search needs all rows
            if spec.method == "svgd" or spec.inf_kwargs.get("kind") == "deep":
                if full_batch is None:
                    full_batch = realdata.bnn_model(data.x_train, data.y_train, arch, PRIOR_SD)
                model = full_batch
            else:
                model = minibatched
            fit = fit_network(spec, model, arch, data, settings.budget)
            fits[arch.describe()].append(fit)
            record(ctx, fit, arch)
    curves = curves_figure(ctx, fits)
    calibration = calibration_figure(ctx, fits, data)
    return report(settings, data, archs, fits, curves, calibration)


def record(ctx, fit: FitRun, arch: BNNArchitecture) -> None:
    case = f"digits {arch.describe()} (D = {arch.n_weights})"
    note = fit.failure or ""
    metrics = [
        ("test_nll", fit.final["nll"], "nats/point"),
        ("test_accuracy", fit.final["accuracy"], "fraction"),
        ("test_ece", fit.final["ece"], "fraction"),
    ]
    grads = float(fit.steps * fit.grads_per_step)
    cost = fit_cost(fit.steps, grads, fit.seconds, fit.first_call_seconds)
    ctx.record_many(case, fit.label, metrics + cost, note)
    for row in fit.checks:
        where = f"step={row['step']} seconds={row['seconds']:.4g}"
        ctx.record(case, fit.label, "curve_test_nll", row["nll"], "nats/point", where)
        ctx.record(case, fit.label, "curve_test_accuracy", row["accuracy"], "fraction", where)


# ------------------------------------------------------------------------ the report


LINESTYLES = {"full": "-", "rank 10": "-", "variables": "--", "rank 5": "--", "diagonal": ":"}


def style(label: str) -> str:
    for key, value in LINESTYLES.items():
        if key in label:
            return value
    return "-." if "default" in label else "-"


def curves_figure(ctx, fits: dict[str, list[FitRun]]) -> str:
    plt = common.pyplot()
    archs = list(fits)
    fig, axes = plt.subplots(2, len(archs), figsize=(5.2 * len(archs), 6.6), squeeze=False)
    for col, arch in enumerate(archs):
        for fit in fits[arch]:
            rows = [r for r in fit.checks if r["seconds"] > 0]
            if not rows:
                continue
            colour = common.METHOD_COLOURS.get(common.method_key(fit.label), "C7")
            seconds = [r["seconds"] for r in rows]
            for row, key in enumerate(("nll", "accuracy")):
                axes[row, col].plot(
                    seconds,
                    [r[key] for r in rows],
                    style(fit.label),
                    color=colour,
                    lw=1.3,
                    label=fit.label,
                )
        axes[0, col].set(yscale="log", ylabel="test NLL (nats / point)", title=f"digits {arch}")
        axes[1, col].set(ylabel="test accuracy", ylim=(0, 1))
        for ax in axes[:, col]:
            ax.set(xscale="log", xlabel="wall time (s, compilation excluded)")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, frameon=False)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    path, markdown = ctx.figure("curves")
    fig.savefig(path)
    plt.close(fig)
    return markdown


def calibration_figure(ctx, fits: dict[str, list[FitRun]], data: Digits) -> str:
    """Reliability diagrams (accuracy against confidence) of the deepest network."""
    plt = common.pyplot()
    arch = list(fits)[-1]
    chosen = fits[arch]
    ncols = min(5, len(chosen))
    nrows = -(-len(chosen) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(2.6 * ncols, 2.7 * nrows), squeeze=False)
    edges = np.linspace(0, 1, ECE_BINS + 1)
    for ax, fit in zip(axes.flat, chosen, strict=False):
        _, accuracy, count = realdata.reliability(fit.final["probs"], data.y_test, ECE_BINS)
        seen = count > 0
        ax.bar(edges[:-1][seen], accuracy[seen], width=1 / ECE_BINS, align="edge", alpha=0.7)
        ax.plot([0, 1], [0, 1], "k:", lw=0.8)
        ax.set(xlim=(0, 1), ylim=(0, 1), title=f"{fit.label}\nECE {fit.final['ece']:.3f}")
        ax.set(xlabel="confidence", ylabel="accuracy")
    for ax in list(axes.flat)[len(chosen) :]:
        ax.axis("off")
    path, markdown = ctx.figure("calibration")
    common.save_figure(fig, path)
    return markdown


def table(fits: list[FitRun]) -> str:
    fmt = common.fmt
    rows = [
        [
            f.label,
            fmt(f.final["nll"], 3),
            fmt(f.final["accuracy"], 3),
            fmt(f.final["ece"], 3),
            fmt(f.steps, 3),
            fmt(float(f.steps * f.grads_per_step), 3),
            fmt(f.ms_per_step, 3),
            fmt(f.first_call_seconds, 2),
            f.failure or "",
        ]
        for f in fits
    ]
    headers = [
        "method",
        "test NLL",
        "accuracy",
        "ECE",
        "steps",
        "grad evals",
        "ms / step",
        "first call (s)",
        "note",
    ]
    return common.md_table(headers, rows)


def report(settings, data, archs, fits, curves, calibration) -> str:
    names = ", ".join(f"{a} (D = {arch.n_weights})" for a, arch in archs.items())
    biggest = max(arch.n_weights for arch in archs.values())
    setup = (
        f"scikit-learn's digits, {len(data.y_train)} training and {len(data.y_test)} test "
        f"images (pixels / 16), networks {names} with tanh hidden layers and a softmax output, "
        f"prior N(0, {PRIOR_SD:g}) on every weight and bias. Every method gets "
        f"{settings.budget:g} s of stepping (compilation excluded) from the same random "
        "network (weights N(0, 1/fan-in), zero biases; the model's all-zero initial point "
        f"is a saddle), seed 1, and minibatches of {BATCH} rows (PyMC's SVGD: full batch; it "
        "refuses `pm.Minibatch`; so does our deep ensemble, whose line search compares "
        "log-densities). Ours use the paper's set-up: N = L + 1 = 11 particles "
        "(rank 10) for GPF, rank 5 or 10 and S = 10 draws for GF, and dimension-wise RMSProp "
        "with learning rate 0.01; PyMC's ADVI runs at its default and with Adam 0.01, SVGD "
        "with 10 particles and Adam 0.01 (its default 100 particles with a scan over them are "
        "too slow here). The ensembles (Wild et al. 2023) run at their defaults, N = 20 "
        "members started at the network plus N(0, 1) noise: deep (per-particle "
        "backtracking ascent), Langevin and repulsive Langevin (SGLD on the minibatches, "
        "preconditioned by the ensemble's covariance; their draws after burn-in, or their "
        "current particles while still burning in). "
        f"Test metrics from {FINAL_DRAWS} draws of q (SVGD: its particles); "
        f"ECE with {ECE_BINS} equal-width confidence bins. No NUTS column: a {biggest}-dimensional "
        "multimodal posterior is out of its reach in this budget."
    )
    caption = f"Test metrics of q after {settings.budget:g} s of stepping, and what the fit cost."
    parts = [setup]
    for arch, chosen in fits.items():
        parts += [f"### digits {arch}", caption, table(chosen)]
    parts += [
        curves,
        "Test NLL and accuracy along the fit (50 draws of q per point).",
        calibration,
        "Reliability diagrams of the deepest network: accuracy per confidence bin (the "
        "dotted diagonal is perfect calibration).",
    ]
    return "\n\n".join(parts)
