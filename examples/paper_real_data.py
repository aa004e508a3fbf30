"""The papers' real-data experiments, as sections of the benchmark report: Bayesian logistic
regression (GPF paper Fig. 6: test NLL against wall time), a Bayesian neural network on
scikit-learn's digits (GPF paper Table 1: NLL, accuracy, calibration) and WVGD's Lloyd–Max check
and evidence bound against the number of particles (WVGD paper §10.2).

The benchmark runner fits, times and counts them like its own sections (``benchmarks/README.md``)
and writes their tables and figures into the report, ``docs/benchmarks.md`` (sections logistic,
bnn and wvgd). ``python -m benchmarks run`` runs them with the others; ``--quick`` leaves them to
the test suite (``tests/test_examples.py`` runs this script quick).

Run: ``python examples/paper_real_data.py [--quick] [--out DIR] [--backend B]`` (the options of
``python -m benchmarks run``; ``--quick`` writes ``build/benchmarks-quick/``, the full run, about
20 minutes on 2 cores, rewrites the report's three sections).
"""

from __future__ import annotations

import itertools
import sys
import time

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pymc as pm
import pytensor.tensor as pt

import pymc_gpf

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's benchmarks/

from benchmarks import cases, harness
from benchmarks.harness import Method, fmt, md_table

MAX_STEPS = 1_000_000  # step cap of the time-budgeted fits (the trace is preallocated)
ADAM = {"optimizer": "adam", "learning_rate": 1e-2}
RMS = {"optimizer": "rmsprop", "learning_rate": 1e-2}
DIAGONAL = {"structure": "diagonal", "natural_mean": True}
NLL, ACCURACY = ("test_nll", "nll", "nats/point"), ("test_accuracy", "accuracy", "fraction")
CURVE_NLL = ("curve_test_nll", "nll", "nats/point")  # (CSV metric, key of the metrics, unit)


# ----------------------------------------------------------------------------------- data
def standardise(train: np.ndarray, *others: np.ndarray) -> list[np.ndarray]:
    """Centred and scaled by the training columns' mean and sd (constant columns unscaled)."""
    mean, sd = train.mean(axis=0), train.std(axis=0)
    return [(a - mean) / np.where(sd > 0, sd, 1.0) for a in (train, *others)]


def binary_dataset(name: str) -> tuple[np.ndarray, np.ndarray]:
    """``iris`` (setosa vs rest), ``diabetes`` (above its median), ``breast_cancer``
    (benign), ``german_credit`` (bad credit)."""
    from sklearn import datasets

    if name == "german_credit":
        return cases.german_credit()
    data = getattr(datasets, f"load_{name}")()
    labels = {"iris": data.target == 0, "breast_cancer": data.target == 1}
    return data.data, labels.get(name, data.target > np.median(data.target)).astype(np.int64)


def digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn import datasets

    data = datasets.load_digits()
    return data.data / 16.0, data.target.astype(np.int64)


def random_splits(n: int, test_fraction: float, n_splits: int, seed: int) -> list:
    """``n_splits`` (train, test) index pairs of equal sizes (one compiled graph serves all)."""
    rng, n_test = np.random.default_rng(seed), round(n * test_fraction)
    orders = [rng.permutation(n) for _ in range(n_splits)]
    return [(np.sort(o[n_test:]), np.sort(o[:n_test])) for o in orders]


def logistic_probabilities(draws: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """``p(y = 1 | x)`` averaged over draws ``{"w": (S, P), "b": (S,)}``."""
    return np.mean(1.0 / (1.0 + np.exp(-(draws["w"] @ x.T + draws["b"][:, None]))), axis=0)


@dataclass(frozen=True)
class BNN:
    """A network ``inputs -> hidden... (tanh) -> classes (softmax)``."""

    inputs: int
    hidden: tuple[int, ...]
    classes: int

    widths = property(lambda self: [self.inputs, *self.hidden, self.classes])
    n_weights = property(lambda self: sum((a + 1) * b for a, b in itertools.pairwise(self.widths)))
    name = property(lambda self: "–".join(map(str, self.widths)))

    def model(self, x, y, prior_sd: float = 1.0, batch_size: int | None = None):
        """``N(0, prior_sd)`` weights ``W{l}`` and biases ``b{l}``; a categorical likelihood
        written with elementwise Ops (PyMC's ``Categorical`` indexes with ``arange``, which
        cannot be batched over particles); ``batch_size``: a ``pm.Minibatch`` of the rows."""
        onehot = np.eye(self.classes)[y]
        with pm.Model() as model:
            if batch_size is None:
                h, observed, total = pt.as_tensor(x), onehot, None
            else:
                (h, observed), total = pm.Minibatch(x, onehot, batch_size=batch_size), len(y)
            for layer, (a, b) in enumerate(itertools.pairwise(self.widths)):
                h = h @ pm.Normal(f"W{layer}", 0.0, prior_sd, shape=(a, b))
                h = h + pm.Normal(f"b{layer}", 0.0, prior_sd, shape=b)
                h = pt.tanh(h) if layer < len(self.widths) - 2 else h

            def logp(value, logits):
                return pt.sum(value * (logits - pt.logsumexp(logits, -1, keepdims=True)), -1)

            pm.CustomDist("obs", h, logp=logp, signature="(k)->(k)", observed=observed,
                          total_size=total)  # fmt: skip
        return model

    def probabilities(self, weights: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
        """Class probabilities ``(n, classes)`` averaged over draws of the weights."""
        h = np.broadcast_to(x, (len(weights["W0"]), *x.shape))
        layers = len(self.widths) - 1
        for layer in range(layers):
            h = h @ weights[f"W{layer}"] + weights[f"b{layer}"][:, None, :]
            h = np.tanh(h) if layer < layers - 1 else h
        probs = np.exp(h - h.max(axis=-1, keepdims=True))
        return (probs / probs.sum(axis=-1, keepdims=True)).mean(axis=0)


def reliability(probs: np.ndarray, y: np.ndarray, bins: int = 10):
    """Per equal-width confidence bin: mean confidence, accuracy and count."""
    confidence, correct = probs.max(axis=1), (probs.argmax(axis=1) == y).astype(float)
    which = np.clip((confidence * bins).astype(int), 0, bins - 1)
    count = np.bincount(which, minlength=bins)
    safe = np.maximum(count, 1)
    mean_conf = np.bincount(which, confidence, minlength=bins) / safe
    return mean_conf, np.bincount(which, correct, minlength=bins) / safe, count


def classification_metrics(probs: np.ndarray, y: np.ndarray, bins: int = 10) -> dict[str, float]:
    """Test NLL (nats per point), accuracy and expected calibration error (Guo et al. 2017)."""
    probs = np.asarray(probs)
    if probs.ndim == 1:
        probs = np.stack([1.0 - probs, probs], axis=1)
    p_true = probs[np.arange(len(y)), y]
    mean_conf, accuracy, count = reliability(probs, y, bins)
    return {
        "nll": float(-np.mean(np.log(np.clip(p_true, 1e-300, None)))),
        "accuracy": float(np.mean(probs.argmax(axis=1) == y)),
        "ece": float(np.sum(count * np.abs(accuracy - mean_conf)) / count.sum()),
    }


def split_flat(flat: np.ndarray, target) -> dict[str, np.ndarray]:
    """Flat draws ``(S, D)`` as ``{value variable: (S, *shape)}``."""
    return {c.value_name: flat[:, c.start : c.stop].reshape(len(flat), *c.shape)
            for c in target.coordinates}  # fmt: skip


def fit_budgeted(method: Method, model, metrics, seed: int, budget: float, per_decade: int,
                 draws: int, final_draws: int, final_seed: int) -> harness.FitRun:  # fmt: skip
    """``method`` for ``budget`` seconds of stepping, ``metrics(draws)`` along the fit and at
    the end (``final``)."""
    target = pymc_gpf.BatchedTarget(model)

    def measure(approx, draws: int, seed: int) -> dict[str, float]:
        return metrics(split_flat(harness.flat_sample(approx, draws, seed), target))

    run = harness.fit_method(method, model, MAX_STEPS, seed + 1,
                             check=lambda approx: measure(approx, draws, seed),
                             check_at=harness.geometric_steps(MAX_STEPS, per_decade),
                             max_seconds=budget)  # fmt: skip
    run.final = measure(run.approx, final_draws, final_seed)
    return run


def record_fit(ctx, case: str, fit: harness.FitRun, finals, curves, note: str, where: str = "",
               extra=()) -> None:  # fmt: skip
    """The final metrics ``finals`` and the curves along the fit (``(metric, key, unit)``), the
    cost, and ``extra`` numbers (``(metric, value, unit)``)."""
    values = [(metric, fit.final[key], unit) for metric, key, unit in finals]
    cost = [("steps", fit.steps, "steps"), ("grad_evals", fit.grads, "gradients"),
            ("seconds", fit.seconds, "s"),
            ("first_call_seconds", fit.first_call_seconds, "s")]  # fmt: skip
    ctx.record_many(case, fit.label, [*values, *cost, *extra], note)
    for row in fit.checks:
        at = f"{where}step={row['step']} seconds={row['seconds']:.4g}"
        for metric, key, unit in curves:
            ctx.record(case, fit.label, metric, row[key], unit, at)


def plot_curves(ax, fits: list[harness.FitRun], key: str, style) -> None:
    """Each method's ``key`` against seconds of stepping, the median over its fits."""
    for label in dict.fromkeys(f.label for f in fits):
        curves = [f.checks for f in fits if f.label == label and f.checks]
        n = min(len(c) for c in curves)
        seconds = np.median([[r["seconds"] for r in c[:n]] for c in curves], axis=0)
        values = np.median([[r[key] for r in c[:n]] for c in curves], axis=0)
        if (seconds > 0).any():
            ax.plot(seconds[seconds > 0], values[seconds > 0], style(label), lw=1.4,
                    color=harness.colour(label), label=label)  # fmt: skip
    ax.set(xscale="log", xlabel="wall time (s, compilation excluded)")


# ------------------------------------------------------------------------------- logistic
LOGISTIC_METHODS = [
    Method("GPF diagonal (N = 11)", "gpf", {**DIAGONAL, "n_particles": 11}, ADAM),
    Method("GF diagonal (S = 10)", "gf", DIAGONAL, ADAM),
    Method("ADVI (default)", "advi"),
    Method("ADVI (adam 0.01)", "advi", {}, harness.pymc_optimizer("adam", 1e-2)),
    Method("GPF (N = 11, rank 10)", "gpf", {"n_particles": 11}, ADAM),
    Method("GF rank 10 (S = 10)", "gf", {"rank": 10}, ADAM),
    Method("FullRankADVI (default)", "fullrank_advi"),
    Method("SVGD (default, 100 particles)", "svgd"),
]


def family(run: harness.FitRun) -> str:
    diagonal = run.method.method == "advi" or run.method.inf_kwargs.get("structure") == "diagonal"
    return "mean-field" if diagonal else "low-rank"


def close(fit: harness.FitRun, reference: float) -> float:
    """Seconds at the first check within 0.01 nats of NUTS's test NLL."""
    return next((float(r["seconds"]) for r in fit.checks if r["nll"] <= reference + 0.01), np.inf)


def logistic(ctx) -> str:
    datasets = ctx.pick(("breast_cancer",), ("breast_cancer", "german_credit"))
    n_splits, budget = ctx.pick(1, 3), ctx.pick(1.5, 5.0)
    labels = ctx.pick(("GPF diagonal (N = 11)", "ADVI (default)"), None)
    fits, nuts, parts = {}, {}, []
    for name in datasets:
        x, y = binary_dataset(name)
        splits = [[*standardise(x[a], x[b]), y[a], y[b]]
                  for a, b in random_splits(len(y), 0.2, n_splits, 0)]  # fmt: skip
        model = cases.logistic_model(splits[0][0], splits[0][2], float(np.sqrt(10.0)))
        fits[name], nuts[name] = [], []
        for i, (x_train, x_test, y_train, y_test) in enumerate(splits):
            pm.set_data({"x": x_train, "y": y_train}, model=model)

            def metrics(draws, x_test=x_test, y_test=y_test) -> dict[str, float]:
                probs = logistic_probabilities(draws, x_test)
                return {k: v for k, v in classification_metrics(probs, y_test).items()
                        if k != "ece"}  # fmt: skip

            for method in harness.select(LOGISTIC_METHODS, labels):
                print(f"   {name} split {i}: {method.label}", flush=True)
                fits[name].append(fit_budgeted(method, model, metrics, i, budget, 8, 300, 2000, i))
            if not ctx.quick:
                print(f"   {name} split {i}: NUTS", flush=True)
                run = harness.nuts(model, i + 1, 500, 500, compute_convergence_checks=False,
                                   discard_tuned_samples=True)  # fmt: skip
                draws = {"w": run.values["w"], "b": run.values["b"].ravel()}
                nuts[name].append((*metrics(draws).values(), run.seconds))
        reference = [n[0] for n in nuts[name]]
        for fit in fits[name]:
            split = fit.seed - 1
            note = f"split {split}" + (f"; {fit.failure}" if fit.failure else "")
            extra = ([("seconds_to_nuts_nll", close(fit, reference[split]), "s")] if reference
                     else [])  # fmt: skip
            record_fit(ctx, name, fit, [NLL, ACCURACY], [CURVE_NLL], note, f"split {split}; ",
                       extra)  # fmt: skip
        for split, (nll, acc, seconds) in enumerate(nuts[name]):
            values = [("test_nll", nll, "nats/point"), ("test_accuracy", acc, "fraction")]
            values.append(("seconds", seconds, "s"))
            ctx.record_many(name, "NUTS", values, f"split {split}; 2 chains x 500 draws")
        rows = []
        for label in dict.fromkeys(f.label for f in fits[name]):
            mine = [f for f in fits[name] if f.label == label]
            nll = np.array([f.final["nll"] for f in mine])
            times = [close(f, reference[f.seed - 1]) for f in mine] if reference else []
            ok = np.isfinite(nll).any()
            rows.append([
                label, family(mine[0]), fmt(float(np.nanmedian(nll)) if ok else np.nan, 4),
                f"{fmt(np.nanmin(nll), 4)}–{fmt(np.nanmax(nll), 4)}" if ok else "—",
                fmt(float(np.nanmedian([f.final["accuracy"] for f in mine]))),
                *(fmt(float(np.median([getattr(f, k) for f in mine])))
                  for k in ("steps", "grads", "ms_per_step")),
                f"{fmt(float(np.median(times)), 2)} ({sum(np.isfinite(times))}/{len(mine)})"
                if reference else "—",
                "; ".join(sorted({f.failure for f in mine if f.failure})),
            ])  # fmt: skip
        if reference:
            rows.append(["NUTS (2 × 500 draws)", "exact", fmt(float(np.median(reference)), 4),
                         f"{fmt(min(reference), 4)}–{fmt(max(reference), 4)}",
                         fmt(float(np.median([n[1] for n in nuts[name]])), 3), "", "", "",
                         f"{fmt(float(np.median([n[2] for n in nuts[name]])), 2)} (total)",
                         ""])  # fmt: skip
        parts += [f"### {name}",
                  f"Medians over the splits; test NLL and accuracy after {budget:g} s.",
                  md_table("method | family | test NLL (median) | range over splits | accuracy "
                           "| steps | grad evals | ms / step | s to NUTS | failures",
                           rows)]  # fmt: skip
    families = list(dict.fromkeys(family(f) for name in datasets for f in fits[name]))
    plt = harness.pyplot()
    fig, axes = plt.subplots(len(families), len(datasets), squeeze=False,
                             figsize=(5 * len(datasets), 3.3 * len(families)))  # fmt: skip
    for (row, kind), (col, name) in itertools.product(enumerate(families), enumerate(datasets)):
        ax = axes[row, col]
        plot_curves(ax, [f for f in fits[name] if family(f) == kind], "nll",
                    lambda label: "--" if "default" in label else "-")  # fmt: skip
        if nuts[name]:
            ax.axhline(np.median([n[0] for n in nuts[name]]), color="k", lw=0.9, ls=":",
                       label="NUTS")  # fmt: skip
        ax.set(yscale="log", ylabel="test NLL (nats / point)", title=f"{name}: {kind}")
        ax.legend(loc="upper right")
    setup = ctx.text("logistic", splits=n_splits, datasets=", ".join(datasets), budget=budget)
    setup += "" if ctx.quick else " " + ctx.text("logistic_nuts")
    return "\n\n".join([setup, harness.save_figure(ctx, fig, "test_nll"), *parts])


# ------------------------------------------------------------------------------------ bnn
BNN_METHODS = [
    Method("GF (defaults)", "gf"),
    Method("GPF (defaults)", "gpf"),
    Method("GPF full (N = 11)", "gpf", {"n_particles": 11}, RMS),
    Method("GPF variables (N = 11)", "gpf", {"n_particles": 11, "structure": "variables"}, RMS),
    Method("GPF diagonal (N = 11)", "gpf", {"n_particles": 11, "structure": "diagonal"}, RMS),
    Method("GF rank 5 (S = 10)", "gf", {"rank": 5}, RMS),
    Method("GF rank 10 (S = 10)", "gf", {"rank": 10}, RMS),
    Method("GF diagonal (S = 10)", "gf", {"structure": "diagonal"}, RMS),
    Method("ADVI (default)", "advi"),
    Method("ADVI (adam 0.01)", "advi", {}, harness.pymc_optimizer("adam", 1e-2)),
    Method("SVGD (10 particles, adam 0.01)", "svgd", {"n_particles": 10},
           harness.pymc_optimizer("adam", 1e-2)),
    Method("Deep ensemble (defaults, N = 20; full batch)", "ensemble", {"kind": "deep"}),
    Method("Langevin ensemble (defaults, N = 20; SGLD)", "ensemble"),
    Method("Repulsive ensemble (defaults, N = 20; SGLD)", "ensemble", {"kind": "repulsive"}),
]  # fmt: skip
BNN_STYLES = {"full": "-", "rank 10": "-", "variables": "--", "rank 5": "--", "diagonal": ":"}


def bnn(ctx) -> str:
    x, y = digits()
    ((train, test),) = random_splits(len(y), 0.2, 1, 0)
    budget = ctx.pick(3.0, 15.0)
    labels = ctx.pick(("GPF variables (N = 11)", "ADVI (adam 0.01)"), None)
    fits, nets = {}, {}
    for hidden in ctx.pick(((16,),), ((20,), (20, 20))):
        net = nets[BNN(x.shape[1], hidden, 10).name] = BNN(x.shape[1], hidden, 10)
        models = {True: net.model(x[train], y[train], 1.0, 128), False: None}
        rng = np.random.default_rng(0)  # one random network starts every method (0 is a saddle)
        start = {}
        for layer, (a, b) in enumerate(itertools.pairwise(net.widths)):
            start[f"W{layer}"] = rng.normal(0.0, 1.0 / np.sqrt(a), size=(a, b))
            start[f"b{layer}"] = np.zeros(b)
        fits[net.name] = []
        for method in harness.select(BNN_METHODS, labels, start):
            print(f"   {net.name}: {method.label}", flush=True)
            # PyMC's SVGD refuses pm.Minibatch; a deep ensemble's line search needs all rows
            batched = method.method != "svgd" and method.inf_kwargs.get("kind") != "deep"
            if models[batched] is None:
                models[batched] = net.model(x[train], y[train], 1.0)

            def metrics(draws, net=net) -> dict:
                probs = net.probabilities(draws, x[test])
                return {**classification_metrics(probs, y[test], 10), "probs": probs}

            fit = fit_budgeted(method, models[batched], metrics, 0, budget, 6, 50, 500, 1)
            for row in fit.checks:
                del row["probs"]
            fits[net.name].append(fit)
            record_fit(ctx, f"digits {net.name} (D = {net.n_weights})", fit,
                       [NLL, ACCURACY, ("test_ece", "ece", "fraction")],
                       [CURVE_NLL, ("curve_test_accuracy", "accuracy", "fraction")],
                       fit.failure or "")  # fmt: skip
    names = ", ".join(f"{a} (D = {net.n_weights})" for a, net in nets.items())
    parts = [ctx.text("bnn", train=len(train), test=len(test), names=names, budget=budget,
                      biggest=max(net.n_weights for net in nets.values()))]  # fmt: skip
    for arch, chosen in fits.items():
        rows = [[f.label, *(fmt(f.final[k], 3) for k in ("nll", "accuracy", "ece")),
                 fmt(f.steps, 3), fmt(float(f.grads), 3), fmt(f.ms_per_step, 3),
                 fmt(f.first_call_seconds, 2), f.failure or ""] for f in chosen]  # fmt: skip
        parts += [f"### digits {arch}",
                  f"Test metrics of q after {budget:g} s of stepping, and what the fit cost.",
                  md_table("method | test NLL | accuracy | ECE | steps | grad evals | ms / step | "
                           "first call (s) | note", rows)]  # fmt: skip
    plt = harness.pyplot()
    fig, axes = plt.subplots(2, len(fits), figsize=(5.2 * len(fits), 6.6), squeeze=False)
    for col, (arch, chosen) in enumerate(fits.items()):
        for row, key in enumerate(("nll", "accuracy")):
            plot_curves(axes[row, col], chosen, key, lambda label: next(
                (v for k, v in BNN_STYLES.items() if k in label),
                "-." if "default" in label else "-"))  # fmt: skip
        axes[0, col].set(yscale="log", ylabel="test NLL (nats / point)", title=f"digits {arch}")
        axes[1, col].set(ylabel="test accuracy", ylim=(0, 1))
    fig.legend(*axes[0, 0].get_legend_handles_labels(), loc="lower center", ncol=3, frameon=False)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    parts += [harness.save_figure(ctx, fig, "curves", tight=False),
              "Test NLL and accuracy along the fit (50 draws of q per point)."]  # fmt: skip
    chosen = list(fits.values())[-1]  # reliability diagrams of the deepest network
    ncols = min(5, len(chosen))
    fig, axes = plt.subplots(-(-len(chosen) // ncols), ncols, squeeze=False,
                             figsize=(2.6 * ncols, 2.7 * -(-len(chosen) // ncols)))  # fmt: skip
    for ax, fit in zip(axes.flat, chosen, strict=False):
        _, accuracy, count = reliability(fit.final["probs"], y[test], 10)
        edges = np.linspace(0, 1, 11)[:-1]
        ax.bar(edges[count > 0], accuracy[count > 0], width=0.1, align="edge", alpha=0.7)
        ax.plot([0, 1], [0, 1], "k:", lw=0.8)
        ax.set(xlim=(0, 1), ylim=(0, 1), title=f"{fit.label}\nECE {fit.final['ece']:.3f}",
               xlabel="confidence", ylabel="accuracy")  # fmt: skip
    for ax in list(axes.flat)[len(chosen) :]:
        ax.axis("off")
    parts += [harness.save_figure(ctx, fig, "calibration"),
              "Reliability diagrams of the deepest network: accuracy per confidence bin (the "
              "dotted diagonal is perfect calibration)."]  # fmt: skip
    return "\n\n".join(parts)


# ----------------------------------------------------------------------------------- wvgd
LLOYD_MAX = {  # optimal quantisers of N(0, 1) (Lloyd 1982, Max 1960): centroids, cell masses
    2: (np.array([-0.7979, 0.7979]), np.array([0.5, 0.5])),
    3: (np.array([-1.2240, 0.0, 1.2240]), np.array([0.2703, 0.4595, 0.2703])),
    4: (np.array([-1.5104, -0.4528, 0.4528, 1.5104]), np.array([0.1631, 0.3369, 0.3369, 0.1631])),
}


def lloyd_max(ctx, particles: tuple[int, ...]) -> tuple[str, str]:
    """WVGD on ``N(0, 1)`` at its defaults (the automatic step and stop, whitened by GF):
    where its particles and cell weights end against the Lloyd-Max quantiser."""
    with pm.Model() as model:
        pm.Normal("x", 0.0, 1.0)
    plt = harness.pyplot()
    fig, axes = plt.subplots(1, len(particles), figsize=(3.6 * len(particles), 2.8), squeeze=False)
    rows, grid = [], np.linspace(-3.5, 3.5, 400)
    for ax, j in zip(axes.flat, particles, strict=True):
        inference = pymc_gpf.WVGD(n_particles=j, model=model, random_seed=1 + j)
        start = time.perf_counter()
        approx = inference.fit(progressbar=False, backend=harness.BACKEND)
        seconds = time.perf_counter() - start
        order = np.argsort(approx.particles[:, 0])
        positions, weights = approx.particles[order, 0], approx.cell_weights[order]
        optimal, masses = LLOYD_MAX[j]
        errors = [float(np.max(np.abs(positions - optimal))),
                  float(np.max(np.abs(weights - masses)))]  # fmt: skip
        record = lambda *args, case=f"N(0,1), J = {j}": ctx.record(case, "WVGD", *args)  # noqa: E731
        record("max_abs_position_error", errors[0])
        record("max_abs_weight_error", errors[1])
        record("steps", approx.outcome.step, "", approx.outcome.reason)
        record("seconds", seconds, "s", "fit incl. compilation")
        for k, (z, b) in enumerate(zip(positions, weights, strict=True)):
            record(f"particle[{k}]", z, "", f"optimal {optimal[k]}")
            record(f"cell_weight[{k}]", b, "", f"optimal {masses[k]}")
        outcome = f"{approx.outcome.step} ({approx.outcome.reason})"
        rows.append([j, ", ".join(f"{z:+.3f}" for z in positions),
                     ", ".join(f"{z:+.4f}" for z in optimal), fmt(errors[0], 2),
                     ", ".join(f"{b:.3f}" for b in weights), ", ".join(f"{b:.4f}" for b in masses),
                     fmt(errors[1], 2), outcome])  # fmt: skip
        ax.plot(grid, np.exp(-0.5 * grid**2) / np.sqrt(2 * np.pi), color="grey", lw=1)
        for z in optimal:
            ax.axvline(z, color="k", ls=":", lw=1)
        for b in (positions[:-1] + positions[1:]) / 2:
            ax.axvline(b, color="C6", ls="-", lw=0.6, alpha=0.5)
        ax.plot(positions, np.zeros_like(positions), "o", color="C6", label="WVGD particles")
        ax.set(title=f"J = {j}", xlabel="x", yticks=[])
    axes.flat[0].legend(loc="upper left")
    markdown = harness.save_figure(ctx, fig, "lloyd_max")
    table = md_table("J | particles | Lloyd–Max | max error | cell weights β | cell masses | "
                     "max error | steps", rows)  # fmt: skip
    return table, markdown


def mean_se(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    n = values.shape[0]
    se = values.std(axis=0, ddof=1) / np.sqrt(n) if n > 1 else np.full(values.shape[1:], np.nan)
    return values.mean(axis=0), se


def wvgd(ctx) -> str:
    particles, repeats = ctx.pick((1, 2), (1, 2, 3, 4, 5)), ctx.pick(1, 3)
    steps, advi_steps = ctx.pick(400, 1500), ctx.pick(0, 5000)
    print("   Lloyd–Max", flush=True)
    lloyd_particles = ctx.pick((2,), (2, 3, 4))
    table1, figure1 = lloyd_max(ctx, lloyd_particles)
    bounds, rows = {}, []
    for name in ctx.pick(("iris",), ("iris", "diabetes", "breast_cancer")):
        print(f"   bound vs J: {name}", flush=True)
        x, y = binary_dataset(name)
        model, bound, advi = None, np.empty((repeats, len(particles))), np.full(repeats, np.nan)
        start = time.perf_counter()
        for r in range(repeats):
            subset = np.random.default_rng(r).choice(len(y), 50, replace=False)
            (xs,) = standardise(x[subset])
            if model is None:
                model = cases.logistic_model(xs, y[subset], prior_sd=1.0)
            else:
                pm.set_data({"x": xs, "y": y[subset]}, model=model)
            for k, j in enumerate(particles):
                approx = pm.fit(steps, method="wvgd", model=model, random_seed=r, progressbar=False,
                                inf_kwargs={"n_particles": j, "draws_per_particle": 100},
                                backend=harness.BACKEND, learning_rate=0.01)  # fmt: skip
                bound[r, k] = -np.mean(approx.hist[-200:])
            if advi_steps:
                approx = pm.fit(advi_steps, method="advi", model=model, random_seed=r,
                                progressbar=False, obj_optimizer=pm.adam(learning_rate=1e-2),
                                backend=harness.BACKEND)  # fmt: skip
                advi[r] = -np.mean(approx.hist[-1000:])
        seconds, bounds[name] = time.perf_counter() - start, bound
        mean, se = mean_se(bound)
        gain_mean, gain_se = mean_se((bound[:, -1] - bound[:, 0])[:, None])
        for k, j in enumerate(particles):
            for r in range(repeats):
                ctx.record(name, f"WVGD J={j}", "elbo", bound[r, k], "nats", f"subset {r}")
            ctx.record(name, f"WVGD J={j}", "elbo_mean", mean[k], "nats")
            ctx.record(name, f"WVGD J={j}", "elbo_se", se[k], "nats")
        ctx.record(name, "WVGD", f"gain_J{particles[-1]}_vs_J1", gain_mean[0], "nats")
        ctx.record(name, "WVGD", f"gain_J{particles[-1]}_vs_J1_se", gain_se[0], "nats")
        ctx.record(name, "WVGD", "seconds", seconds, "s", "all fits of this data set")
        advi_cell = "—"
        if np.isfinite(advi).all():
            a_mean, diff = advi.mean(), (advi - bound[:, 0]).mean()
            ctx.record(name, "ADVI (adam 0.01)", "elbo_mean", a_mean, "nats")
            ctx.record(name, "ADVI (adam 0.01)", "elbo_minus_wvgd_J1", diff, "nats")
            advi_cell = f"{a_mean:.2f} ({diff:+.2f} vs J = 1)"
        rows.append([name, *(f"{m:.2f} ± {s:.2f}" if np.isfinite(s) else f"{m:.2f}"
                             for m, s in zip(mean, se, strict=True)),
                     f"{gain_mean[0]:+.3f}"
                     + (f" ± {gain_se[0]:.3f}" if np.isfinite(gain_se[0]) else ""),
                     advi_cell])  # fmt: skip
    table2 = md_table(["data set", *[f"J = {j}" for j in particles],
                       f"gain J = {particles[-1]} − J = 1 (paired)", "PyMC ADVI (mean field)"],
                      rows)  # fmt: skip
    plt = harness.pyplot()
    fig, axes = plt.subplots(1, len(bounds), figsize=(3.6 * len(bounds), 3.0), squeeze=False)
    for ax, (name, bound) in zip(axes.flat, bounds.items(), strict=True):
        mean, se = mean_se(bound - bound[:, :1])
        ax.errorbar(particles, mean, yerr=np.nan_to_num(se), marker="o", color="C6", capsize=3)
        ax.set(title=name, xlabel="particles J", ylabel="bound − bound(J = 1) (nats)")
        ax.set_xticks(particles)
    figure2 = harness.save_figure(ctx, fig, "bound_vs_particles")
    text = ctx.text("wvgd_bound", repeats=repeats, first=particles[0], last=particles[-1],
                    steps=steps)  # fmt: skip
    if advi_steps:
        text += " " + ctx.text("wvgd_advi", steps=advi_steps)
    lloyd = ", ".join(map(str, lloyd_particles))
    lloyd = ctx.text("wvgd_lloyd", particles=lloyd)
    return "\n\n".join(["### Lloyd–Max check", lloyd, table1, figure1,
                        "### Evidence bound vs number of particles", text, table2,
                        figure2])  # fmt: skip


SECTIONS = {
    "logistic": ("Bayesian logistic regression: test NLL vs time (paper Fig. 6)", logistic),
    "bnn": ("Bayesian neural network on digits: NLL, accuracy, calibration (paper Table 1)", bnn),
    "wvgd": ("WVGD: Lloyd–Max check and evidence bound vs particles (WVGD paper §10.2)", wvgd),
}

if __name__ == "__main__":  # the benchmark runner, restricted to these sections
    from benchmarks.__main__ import main

    sys.exit(main(["run", "--only", *SECTIONS, *sys.argv[1:]]))
