"""What every experiment shares: one way to fit any method, time it and read its q.

:func:`fit_method` drives pymc-gpf's methods (GPF, GF, WVGD) and PyMC's (ADVI,
FullRankADVI, SVGD) the same way: the first ``fit(1)`` call (compilation included) is timed
on its own, then ``refine`` runs the remaining steps while a callback evaluates the
experiment's metrics at chosen steps, its own time subtracted from the wall clock.
Gradient evaluations are counted per method (GPF: N per step, GF: S, WVGD: J·M, ADVI and
FullRankADVI: ``obj_n_mc``, SVGD: its particles).

:func:`flat_moments` and :func:`flat_draws` read any fitted approximation in the model's
flat unconstrained space (column order ``pymc_gpf.BatchedTarget(model).labels``, which is
also PyMC's ``approx.mean`` order).

:class:`Settings` is every experiment's settings: one declaration per field with its
``--quick`` and full values (:func:`quick_full`). :func:`pymc_specs`, :func:`pymc_optimizer`
and :func:`select_specs` build the experiments' method lists.

Also here: the PyTensor backend of the run (:func:`set_backend`; ``--quick`` uses ``"c"``,
which compiles several times faster cold), Gaussian targets with closed-form moments
(:class:`GaussianTarget`, :func:`gaussian_model`), timing helpers and small report helpers
(markdown tables, figures).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Self

import numpy as np

PYMC_METHODS = ("advi", "fullrank_advi", "svgd")
OURS = ("gpf", "gf", "wvgd", "ensemble")


# ----------------------------------------------------------------------- settings
@dataclass(frozen=True)
class QuickFull:
    """A setting's value in ``--quick`` and in the full run."""

    quick: Any
    full: Any


def quick_full(quick: Any, full: Any) -> Any:
    """The default of a :class:`Settings` field whose value depends on the mode."""
    return QuickFull(quick, full)


class Settings:
    """Base of every experiment's settings: a frozen dataclass whose fields default to
    ``quick_full(quick, full)`` (or to one value for both modes), read with
    ``Settings.of(ctx.quick)``::

        @dataclass(frozen=True)
        class Settings(common.Settings):
            steps: int = quick_full(500, 2000)
            seeds: tuple[int, ...] = (1,)
    """

    @classmethod
    def of(cls, quick: bool) -> Self:
        values = {}
        for f in fields(cls):  # type: ignore[arg-type]
            value = f.default
            if isinstance(value, QuickFull):
                value = value.quick if quick else value.full
            values[f.name] = value
        return cls(**values)


# ------------------------------------------------------------------------ the backend
_BACKEND: dict[str, str | None] = {"backend": None}


def set_backend(backend: str | None) -> None:
    """The PyTensor backend every :func:`fit_method` call uses unless its spec names one
    (``None``: PyMC's default, numba)."""
    _BACKEND["backend"] = backend


def backend() -> str | None:
    return _BACKEND["backend"]


def backend_name(name: str | None = None) -> str:
    """The backend's name, e.g. ``"c"`` or ``"numba (PyMC's default)"``."""
    from pytensor.compile.mode import get_default_mode

    name = backend() if name is None else name
    if name:
        return name
    linker = type(get_default_mode().linker).__name__.removesuffix("Linker").lower()
    return f"{linker} (PyMC's default)"


# -------------------------------------------------------------------------- methods
@dataclass(frozen=True)
class MethodSpec:
    """A method and its settings, e.g. ``MethodSpec("GPF N=21", "gpf", {"n_particles": 21},
    {"learning_rate": 0.01})``. ``inf_kwargs`` go to the constructor, ``fit_kwargs`` to
    ``fit`` (PyMC: ``obj_optimizer``, ``obj_n_mc``, ...)."""

    label: str
    method: str
    inf_kwargs: dict = field(default_factory=dict)
    fit_kwargs: dict = field(default_factory=dict)

    def build(self, model, seed: int):
        import pymc as pm

        import pymc_gpf

        classes = {
            "gpf": pymc_gpf.GPF,
            "gf": pymc_gpf.GF,
            "wvgd": pymc_gpf.WVGD,
            "ensemble": pymc_gpf.Ensemble,
            "advi": pm.ADVI,
            "fullrank_advi": pm.FullRankADVI,
            "svgd": pm.SVGD,
        }
        if self.method == "svgd":
            # PyMC's Empirical jitters the initial particles with NumPy's global generator,
            # not with random_seed: seed it so SVGD runs are reproducible too
            np.random.seed(seed)  # noqa: NPY002
        return classes[self.method](model=model, random_seed=seed, **self.inf_kwargs)

    def grads_per_step(self, inference) -> int:
        if self.method == "gpf":
            return len(inference.approx.particles)
        if self.method == "gf":
            return inference.resolved_draws(inference.fit_options)
        if self.method == "wvgd":
            return int(inference.resolved.n_particles) * int(inference.config.draws_per_particle)
        if self.method == "svgd":
            return int(inference.approx.histogram.get_value().shape[0])
        if self.method == "ensemble":
            return int(inference.config.n_particles)
        return int(self.fit_kwargs.get("obj_n_mc", 1))


def pymc_optimizer(name: str, learning_rate: float, **fit_kwargs) -> dict:
    """PyMC ``fit`` keywords for one of its optimisers plus ``fit_kwargs``, e.g.
    ``pymc_optimizer("adam", 0.01)`` is ``{"obj_optimizer": pm.adam(learning_rate=0.01)}``."""
    import pymc as pm

    return {"obj_optimizer": getattr(pm, name)(learning_rate=learning_rate), **fit_kwargs}


def pymc_specs(
    svgd_particles: int,
    tuned: Mapping[str, tuple[str, dict]] | None = None,
    methods: Sequence[str] = PYMC_METHODS,
) -> list[MethodSpec]:
    """PyMC's ``methods`` at PyMC's defaults ("ADVI (PyMC defaults)", "SVGD N=20 (PyMC
    defaults)", ...), each followed by its tuned setting if ``tuned[method] = (label suffix,
    fit_kwargs)`` names one (labelled e.g. "ADVI" + ", rmsprop 0.01")."""
    names = {"advi": "ADVI", "fullrank_advi": "FullRankADVI", "svgd": f"SVGD N={svgd_particles}"}
    specs = []
    for method in methods:
        inf_kwargs = {"n_particles": svgd_particles} if method == "svgd" else {}
        specs.append(MethodSpec(f"{names[method]} (PyMC defaults)", method, inf_kwargs))
        if tuned and method in tuned:
            suffix, fit_kwargs = tuned[method]
            specs.append(MethodSpec(names[method] + suffix, method, inf_kwargs, fit_kwargs))
    return specs


def select_specs(
    specs: Iterable[MethodSpec], labels: Sequence[str] | None = None, start: dict | None = None
) -> list[MethodSpec]:
    """The specs labelled ``labels`` (all if ``None``) in their order, each starting at
    ``start`` (a point, added to its constructor's arguments) if given."""
    specs = list(specs)
    if labels is not None:
        unknown = set(labels) - {spec.label for spec in specs}
        if unknown:
            raise ValueError(f"no method labelled {sorted(unknown)}")
        specs = [spec for spec in specs if spec.label in labels]
    if start is not None:
        specs = [replace(spec, inf_kwargs={**spec.inf_kwargs, "start": start}) for spec in specs]
    return specs


@dataclass
class FitRun:
    """One fit: the approximation, its timings, and the metrics seen along the way."""

    spec: MethodSpec
    inference: Any
    steps: int
    grads_per_step: int
    first_call_seconds: float  # the first fit(1): compilation + one step
    seconds: float  # wall time of the steps after the first, checks excluded
    checks: list[dict[str, float]]  # {"step", "seconds", "grads", **metrics}
    failure: str | None = None
    seed: int = 0
    final: dict[str, Any] = field(default_factory=dict)  # what the experiment read off q

    @property
    def label(self) -> str:
        return self.spec.label

    @property
    def approx(self):
        return self.inference.approx

    @property
    def ms_per_step(self) -> float:
        return 1e3 * self.seconds / max(self.steps - 1, 1)

    def column(self, key: str) -> np.ndarray:
        """One metric (or ``step``/``seconds``/``grads``) over the checks."""
        return np.array([row[key] for row in self.checks], dtype=float)

    def first_below(self, key: str, threshold: float, along: str = "seconds") -> float:
        """``along`` (seconds, grads or step) at the first check where ``key < threshold``
        (``inf`` if never)."""
        for row in self.checks:
            if row[key] < threshold:
                return float(row[along])
        return float("inf")


class _Checker:
    """The fit's callback: counts steps, evaluates the metrics when due, enforces the time
    budget (``StopIteration`` ends a fit cleanly in PyMC and in pymc-gpf)."""

    def __init__(self, check, due: Callable[[int], bool], grads_per_step: int):
        self.check, self.due, self.grads = check, due, grads_per_step
        self.start: float | None = None  # set when the timed steps begin
        self.steps, self.spent, self.rows = 0, 0.0, []
        self.stop_when: Callable[[dict], bool] | None = None
        self.max_seconds: float | None = None
        self.stopped = False

    def clock(self) -> float:
        """Seconds of stepping since the first call, checks excluded."""
        if self.start is None:
            return 0.0
        return time.perf_counter() - self.start - self.spent

    def record(self, approx) -> dict:
        start = time.perf_counter()
        metrics = self.check(approx)
        # ours count their own evaluations (GPF's cloud may grow); others: steps x per step
        counted = getattr(getattr(approx, "inference", None), "gradient_evaluations", None)
        grads = counted if counted is not None else self.steps * self.grads
        row = {"step": self.steps, "seconds": self.clock(), "grads": grads}
        row.update(metrics)
        self.rows.append(row)
        self.spent += time.perf_counter() - start
        return row

    def stop(self, why: str):
        self.stopped = True
        raise StopIteration(f"{why} at step {self.steps}")

    def __call__(self, approx, hist, i):
        self.steps += 1
        out_of_time = self.max_seconds is not None and self.clock() > self.max_seconds
        if self.check is None or not (out_of_time or self.due(self.steps)):
            if out_of_time:
                self.stop("time budget reached")
            return
        row = self.record(approx)
        if out_of_time:
            self.stop("time budget reached")
        if self.stop_when is not None and self.stop_when(row):
            self.stop("target reached")


def geometric_steps(last: int, per_decade: int = 12) -> np.ndarray:
    """Check points spread evenly in log(step) from 1 to ``last`` (both included)."""
    grid = np.logspace(0, np.log10(max(last, 1)), int(per_decade * np.log10(max(last, 10))) + 1)
    return np.unique(np.round(grid).astype(int))


def fit_method(
    spec: MethodSpec,
    model,
    steps: int,
    seed: int = 1,
    *,
    check: Callable[[Any], dict[str, float]] | None = None,
    check_every: int = 100,
    stop_when: Callable[[dict], bool] | None = None,
    check_at: Iterable[int] | None = None,
    max_seconds: float | None = None,
) -> FitRun:
    """Fit ``spec`` on ``model`` for ``steps`` steps (fewer if ``stop_when(row)`` says so
    or after ``max_seconds`` of stepping).

    ``check(approx) -> {metric: value}`` runs before the first step (row ``step=0``), every
    ``check_every`` steps or at the steps in ``check_at`` (e.g. :func:`geometric_steps`),
    and at the last step; its time is excluded from ``seconds``. Rows carry ``seconds``, the
    wall time since the end of the first ``fit(1)`` call (which compiles). A divergence
    (pymc-gpf's ``DivergenceError``, PyMC's NaN ``FloatingPointError``) ends the fit and is
    reported in ``failure``; the metrics seen before it are kept. The backend is the run's
    (:func:`set_backend`) unless ``spec.fit_kwargs`` names one.
    """
    inference = spec.build(model, seed)
    if check_at is not None:
        at = {int(s) for s in check_at}

        def due(step: int) -> bool:
            return step in at
    else:

        def due(step: int) -> bool:
            return step % check_every == 0

    checker = _Checker(check, due, spec.grads_per_step(inference))
    checker.stop_when, checker.max_seconds = stop_when, max_seconds
    if check is not None:
        checker.record(inference.approx)  # the initial state, step 0
        checker.spent = 0.0  # that check came before the clock started
    fit_kwargs = {"backend": backend(), **spec.fit_kwargs}
    failure = None
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            # one step of an automatic fit has not converged: the rest decides
            warnings.simplefilter("ignore", UserWarning)
            inference.fit(1, progressbar=False, callbacks=[checker], **fit_kwargs)
    except FloatingPointError as err:
        failure = str(err)[:200]
        return FitRun(spec, inference, 1, checker.grads, 0.0, 0.0, checker.rows, failure, seed)
    first_call = time.perf_counter() - start - checker.spent
    checker.spent = 0.0
    checker.start = time.perf_counter()
    try:
        if steps > 1 and not checker.stopped:
            inference.refine(steps - 1, progressbar=False)
    except FloatingPointError as err:
        failure = f"{type(err).__name__} at step {checker.steps}"
    seconds = checker.clock()
    if check is not None and failure is None and checker.rows[-1]["step"] != checker.steps:
        checker.record(inference.approx)
    return FitRun(
        spec,
        inference,
        checker.steps,
        checker.grads,
        first_call,
        seconds,
        checker.rows,
        failure,
        seed,
    )


# ------------------------------------------------------------- reading any approximation
def _pymc_moments(approx) -> tuple[np.ndarray, np.ndarray] | None:
    """Mean and covariance of PyMC's MeanField / FullRank / Empirical from their parameters
    in NumPy (no PyTensor function to compile per approximation); None if not one of them."""
    groups = getattr(approx, "groups", None)
    if not groups or len(groups) != 1:
        return None
    params = {k: v.get_value() for k, v in groups[0].params_dict.items()}
    if set(params) == {"mu", "rho"}:  # MeanField: std = softplus(rho)
        return params["mu"], np.diag(np.logaddexp(0.0, params["rho"]) ** 2)
    if set(params) == {"mu", "L_tril"}:  # FullRank: L lower-triangular, softplus diagonal
        d = len(params["mu"])
        factor = np.zeros((d, d))
        factor[np.tril_indices(d)] = params["L_tril"]
        factor[np.diag_indices(d)] = np.logaddexp(0.0, np.diag(factor))
        return params["mu"], factor @ factor.T
    if set(params) == {"histogram"}:  # Empirical (SVGD): particles, 1/N covariance
        x = params["histogram"]
        z = x - x.mean(axis=0)
        return x.mean(axis=0), z.T @ z / len(x)
    return None


def flat_moments(approx) -> tuple[np.ndarray, np.ndarray | None]:
    """Mean and covariance of q in flat unconstrained space (``None`` for WVGD's mixture:
    use :func:`flat_draws`)."""
    import pymc_gpf

    if isinstance(approx, pymc_gpf.GPFApproximation):
        x = approx.particles
        m = x.mean(axis=0)
        z = x - m
        cov = z.T @ z / len(x)
        if approx.structure.kind != "full":
            cov = cov * approx.structure.mask()
        return m, cov
    if isinstance(approx, pymc_gpf.GFApproximation):
        factor = approx.factor
        return approx.shared_mean.get_value(), factor @ factor.T
    if isinstance(approx, pymc_gpf.WVGDApproximation):
        return np.asarray(flat_draws(approx, 20_000, 0).mean(axis=0)), None
    moments = _pymc_moments(approx)
    if moments is not None:
        return moments
    # any other PyMC approximation exposes symbolic mean and cov
    return np.asarray(approx.mean.eval()), np.asarray(approx.cov.eval())


def flat_draws(approx, draws: int, seed: int) -> np.ndarray:
    """``(draws, D)`` draws of q in flat unconstrained space (SVGD: its particles,
    resampled)."""
    import pymc_gpf

    rng = np.random.default_rng(seed)
    if isinstance(approx, pymc_gpf.approximation.FlowApproximation):
        return approx.draw(draws, rng)
    if hasattr(approx, "histogram"):  # PyMC's Empirical (SVGD)
        particles = approx.histogram.get_value()
        return particles[rng.integers(len(particles), size=draws)]
    mean, cov = flat_moments(approx)
    return rng.multivariate_normal(mean, cov, size=draws, method="cholesky")


def constrained_draws(approx, model, draws: int, seed: int) -> dict[str, np.ndarray]:
    """Draws of q mapped to the constrained space, deterministics included, as
    ``{name: (draws, *shape)}`` (pymc-gpf's own mapping, so every method is read alike)."""
    import pymc_gpf

    target = pymc_gpf.BatchedTarget(model)
    return target.compile_constrained()(flat_draws(approx, draws, seed))


def scale_full_rank_init(inference, scale: float) -> None:
    """Start FullRankADVI at ``L = scale I`` instead of PyMC's ``softplus(1) I`` (from that
    default its gradient is NaN in the first step on a logistic regression with 2000
    observations, although the model's own ``dlogp`` is finite there)."""
    group = inference.approx.groups[0]
    l_tril = group.params_dict["L_tril"]
    value = l_tril.get_value()
    d = group.ddim
    value[np.cumsum(np.arange(1, d + 1)) - 1] = np.log(np.expm1(scale))  # softplus^-1
    l_tril.set_value(value)


# ------------------------------------------------------------- Gaussian targets (truth)
@dataclass(frozen=True)
class GaussianTarget:
    """``N(mean, cov)`` with ``cov = Q diag(eigenvalues) Q^T``; the model uses the precision
    factor ``W = Q diag(eigenvalues^-1/2)`` (``W W^T = cov^-1``)."""

    mean: np.ndarray
    rotation: np.ndarray
    eigenvalues: np.ndarray

    @property
    def ndim(self) -> int:
        return len(self.mean)

    @property
    def cov(self) -> np.ndarray:
        return (self.rotation * self.eigenvalues) @ self.rotation.T

    @property
    def precision_factor(self) -> np.ndarray:
        return self.rotation / np.sqrt(self.eigenvalues)


def condition_spectrum(d: int, kappa: float) -> np.ndarray:
    """The paper's spectrum (§4.1): log10 eigenvalues evenly from -1 to -1 + log10(kappa)."""
    return 10 ** np.linspace(-1, -1 + np.log10(kappa), d)


def gaussian_target(eigenvalues: np.ndarray, seed: int) -> GaussianTarget:
    """``mean ~ N(0, I)`` and a random rotation from the QR of a U(0, 1) matrix (the
    paper's recipe, as ``tests/conftest.py``)."""
    rng = np.random.default_rng(seed)
    d = len(eigenvalues)
    q, _ = np.linalg.qr(rng.uniform(size=(d, d)))
    return GaussianTarget(rng.normal(size=d), q, np.asarray(eigenvalues, dtype=float))


def gaussian_model(target: GaussianTarget):
    """``x ~ N(mean, cov)`` as a flat prior plus a potential, with the mean and precision
    factor in ``pm.Data``: every target of one dimension shares one compiled graph
    (:func:`set_gaussian` swaps the target). ``x`` is its own unconstrained space."""
    import pymc as pm
    import pytensor.tensor as pt

    with pm.Model() as model:
        mean = pm.Data("mean", target.mean)
        factor = pm.Data("precision_factor", target.precision_factor)
        x = pm.Flat("x", shape=target.ndim)
        pm.Potential("gaussian", -0.5 * pt.sum(pt.square(pt.dot(x - mean, factor))))
    return model


def set_gaussian(model, target: GaussianTarget) -> None:
    import pymc as pm

    pm.set_data({"mean": target.mean, "precision_factor": target.precision_factor}, model=model)


def moment_errors(approx, target: GaussianTarget) -> dict[str, float]:
    """``‖m − μ‖₂`` and ``‖C − Σ‖_F`` of q against the target."""
    mean, cov = flat_moments(approx)
    return {
        "mean_error": float(np.linalg.norm(mean - target.mean)),
        "cov_error": float(np.linalg.norm(cov - target.cov)),
    }


# --------------------------------------------------------------------------- timing
def time_per_call(call: Callable[[int], Any], target_seconds: float, repeats: int = 5) -> float:
    """Median seconds per unit of ``call(n)`` (which runs ``n`` units, e.g. steps): ``n`` is
    calibrated so one repeat takes about ``target_seconds``, after a warm-up."""
    start = time.perf_counter()
    call(3)  # warm caches and any lazy JIT
    estimate = max((time.perf_counter() - start) / 3, 1e-6)
    n = int(np.clip(target_seconds / estimate, 3, 100_000))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call(n)
        times.append((time.perf_counter() - start) / n)
    return float(np.median(times))


def single_thread_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a child process: BLAS on one thread, plus ``extra``."""
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = "1"
    env.update(extra or {})
    return env


def run_child(module: str, payload: dict, env: dict[str, str] | None = None) -> dict:
    """Run ``python -m module child JSON`` in a fresh process; its last stdout line is the
    JSON result (``{"error": ...}`` if the child failed)."""
    argv = [sys.executable, "-m", module, "child", json.dumps(payload)]
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run(
        argv, env=env or single_thread_env(), cwd=root, capture_output=True, text=True
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {proc.returncode}: {tail[:300]}"}
    return json.loads(lines[-1])


# -------------------------------------------------------------------------- reports
def fmt(value: float, digits: int = 3) -> str:
    """A number with ``digits`` significant digits (``—`` for nan/inf)."""
    if value is None or not np.isfinite(value):
        return "—"
    if value == 0:
        return "0"
    if abs(value) >= 10 ** (digits + 2) or abs(value) < 1e-3:
        return f"{value:.{digits - 1}e}"
    return f"{value:.{digits}g}" if abs(value) < 10**digits else f"{value:.0f}"


def md_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], left: int = 1) -> str:
    """A markdown table; the first ``left`` columns left-aligned, the others right-aligned."""
    lines = [
        "| " + " | ".join(headers) + " |",
        "|" + "|".join([":---"] * left + ["---:"] * (len(headers) - left)) + "|",
    ]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def pyplot():
    """matplotlib's pyplot on the Agg backend, with the report's style."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update(
        {
            "figure.dpi": 110,
            "savefig.dpi": 110,
            "axes.grid": True,
            "grid.alpha": 0.3,
            "font.size": 9,
            "axes.titlesize": 10,
            "legend.fontsize": 8,
        }
    )
    return plt


def save_figure(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)


def legend_below(fig, axes, ncol: int = 4) -> None:
    """One legend for the whole figure, under it (collected from ``axes``' labelled lines)."""
    handles, labels = {}, []
    for ax in np.ravel(axes):
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            if label not in handles:
                handles[label] = handle
                labels.append(label)
    fig.legend(
        [handles[k] for k in labels],
        labels,
        loc="upper center",
        bbox_to_anchor=(0.5, 0.0),
        ncol=ncol,
        fontsize=8,
        frameon=False,
    )


METHOD_COLOURS = {
    "gpf": "C0",
    "gf": "C2",
    "wvgd": "C6",
    "ensemble": "C5",
    "advi": "C1",
    "fullrank_advi": "C3",
    "svgd": "C4",
    "nuts": "k",
    "bare": "C7",
}


def method_key(label: str) -> str:
    """``"gpf"``, ``"fullrank_advi"``, ... from a report label (for colours and grouping)."""
    low = label.lower()
    if "ensemble" in low:
        return "ensemble"
    for key in ("fullrankadvi", "advi", "gpf", "gf", "wvgd", "svgd", "nuts"):
        if low.startswith(key):
            return "fullrank_advi" if key == "fullrankadvi" else key
    return "bare"
