"""Real data for the benchmarks: loaders, PyMC models, reference posteriors and metrics.

- **Classification data** that ship with a package or with this repository: scikit-learn's
  bundled iris, diabetes, breast cancer and digits, and the German credit data of
  ``examples/data`` (no download at run time).
- **Models**: Bayesian logistic regression, a Bayesian neural network (tanh hidden layers,
  softmax output), and PyMC translations of the posteriordb Stan models and of the
  inference-gym German credit target (``benchmarks/data/README.md`` says where the reference
  draws come from). The translations keep the Stan priors and parameterisation (improper
  flat priors as ``pm.Flat``/``pm.HalfFlat``) so the reference draws are their ground truth.
- **Metrics**, vectorised over draws: standardised errors of means and sds, a sliced
  Wasserstein distance on standardised draws, and the predictive NLL, accuracy and expected
  calibration error of a classifier.
"""

from __future__ import annotations

import csv
import gzip
import itertools
import json

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = Path(__file__).resolve().parent / "data"
POSTERIORDB_DIR = DATA_DIR / "posteriordb"
GERMAN_DIR = ROOT / "examples" / "data"

# step cap of the time-budgeted fits (PyMC and pymc-gpf preallocate the loss trace for the
# steps asked for, so "unlimited" must stay a modest number)
MAX_STEPS = 1_000_000


# ----------------------------------------------------------------- classification data
def standardise(train: np.ndarray, *others: np.ndarray) -> list[np.ndarray]:
    """Columns centred and scaled by the training set's mean and (population) sd; constant
    columns are left unscaled."""
    mean, sd = train.mean(axis=0), train.std(axis=0)
    sd = np.where(sd > 0, sd, 1.0)
    return [(a - mean) / sd for a in (train, *others)]


def german_credit() -> tuple[np.ndarray, np.ndarray]:
    """German credit (UCI Statlog, numeric): 24 raw features and ``y = 1`` for bad credit."""
    raw = np.loadtxt(GERMAN_DIR / "german.data-numeric")
    return raw[:, :24], (raw[:, 24] == 2).astype(np.int64)


def binary_dataset(name: str) -> tuple[np.ndarray, np.ndarray]:
    """Raw features and 0/1 labels: ``iris`` (setosa vs rest), ``diabetes`` (progression
    above its median), ``breast_cancer`` (benign), ``german_credit`` (bad credit)."""
    from sklearn import datasets

    if name == "german_credit":
        return german_credit()
    if name == "iris":
        data = datasets.load_iris()
        return data.data, (data.target == 0).astype(np.int64)
    if name == "diabetes":
        data = datasets.load_diabetes()
        return data.data, (data.target > np.median(data.target)).astype(np.int64)
    if name == "breast_cancer":
        data = datasets.load_breast_cancer()
        return data.data, (data.target == 1).astype(np.int64)
    raise ValueError(f"unknown data set {name!r}")


def digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 8×8 digits (1797 images, 10 classes), pixels scaled to [0, 1]."""
    from sklearn import datasets

    data = datasets.load_digits()
    return data.data / 16.0, data.target.astype(np.int64)


def random_splits(
    n: int, test_fraction: float, n_splits: int, seed: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """``n_splits`` random (train, test) index pairs, all of the same sizes (so every split
    reuses the same compiled graphs)."""
    rng = np.random.default_rng(seed)
    n_test = round(n * test_fraction)
    out = []
    for _ in range(n_splits):
        order = rng.permutation(n)
        out.append((np.sort(order[n_test:]), np.sort(order[:n_test])))
    return out


# ------------------------------------------------------------------------- models
def logistic_model(
    x: np.ndarray, y: np.ndarray, prior_sd: float, *, intercept: bool = True, as_data: bool = True
):
    """``y ~ Bernoulli(logit = x w + b)``, ``w, b ~ Normal(0, prior_sd)`` (no ``b`` without
    ``intercept``); ``x`` and ``y`` are ``pm.Data`` (``pm.set_data`` swaps in another split of
    the same size), or constants of the graph without ``as_data``."""
    import pymc as pm
    import pytensor.tensor as pt

    with pm.Model() as model:
        if as_data:
            x_data, y_data = pm.Data("x", x), pm.Data("y", y)
        else:
            x_data, y_data = pt.as_tensor(x), y
        w = pm.Normal("w", 0.0, prior_sd, shape=x.shape[1])
        logit = x_data @ w
        if intercept:
            logit = logit + pm.Normal("b", 0.0, prior_sd)
        pm.Bernoulli("obs", logit_p=logit, observed=y_data)
    return model


def logistic_probabilities(draws: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """Posterior predictive ``p(y = 1 | x)`` averaged over draws ``{"w": (S, P), "b": (S,)}``."""
    logits = draws["w"] @ x.T + draws["b"][:, None]  # (S, n)
    return np.mean(1.0 / (1.0 + np.exp(-logits)), axis=0)


@dataclass(frozen=True)
class BNNArchitecture:
    """A fully connected network ``inputs -> hidden... (tanh) -> classes (softmax)``."""

    inputs: int
    hidden: tuple[int, ...]
    classes: int

    @property
    def widths(self) -> list[int]:
        return [self.inputs, *self.hidden, self.classes]

    @property
    def n_weights(self) -> int:
        w = self.widths
        return sum((a + 1) * b for a, b in itertools.pairwise(w))

    def describe(self) -> str:
        return "–".join(map(str, self.widths))


def onehot_categorical_logp(value, logits):
    """``log softmax(logits)[y]`` for one-hot rows ``value``: the categorical likelihood
    written with elementwise Ops only (PyMC's ``Categorical`` indexes with ``arange``, which
    pymc-gpf cannot batch over particles and then loops)."""
    import pytensor.tensor as pt

    log_probs = logits - pt.logsumexp(logits, axis=-1, keepdims=True)
    return pt.sum(value * log_probs, axis=-1)


def bnn_model(
    x: np.ndarray,
    y: np.ndarray,
    arch: BNNArchitecture,
    prior_sd: float = 1.0,
    batch_size: int | None = None,
):
    """Bayesian neural network: weights ``W{l}`` and biases ``b{l}`` per layer, all
    ``Normal(0, prior_sd)``, tanh hidden layers, a categorical likelihood on the softmax
    (:func:`onehot_categorical_logp`); with ``batch_size`` the likelihood sees a
    ``pm.Minibatch`` of the rows each step, scaled to the full data (``total_size``)."""
    import pymc as pm
    import pytensor.tensor as pt

    onehot = np.eye(arch.classes)[y]
    with pm.Model() as model:
        if batch_size is None:
            h, observed, total = pt.as_tensor(x), onehot, None
        else:
            h, observed = pm.Minibatch(x, onehot, batch_size=batch_size)
            total = len(y)
        widths = arch.widths
        for layer, (a, b) in enumerate(itertools.pairwise(widths)):
            weight = pm.Normal(f"W{layer}", 0.0, prior_sd, shape=(a, b))
            bias = pm.Normal(f"b{layer}", 0.0, prior_sd, shape=b)
            h = h @ weight + bias
            if layer < len(widths) - 2:
                h = pt.tanh(h)
        pm.CustomDist(
            "obs",
            h,
            logp=onehot_categorical_logp,
            signature="(k)->(k)",
            observed=observed,
            total_size=total,
        )
    return model


def bnn_probabilities(
    weights: dict[str, np.ndarray], arch: BNNArchitecture, x: np.ndarray
) -> np.ndarray:
    """Predictive class probabilities ``(n, classes)`` averaged over draws of the weights
    (``{"W0": (S, a, b), "b0": (S, b), ...}``)."""
    h = np.broadcast_to(x, (len(weights["W0"]), *x.shape))
    n_layers = len(arch.widths) - 1
    for layer in range(n_layers):
        h = h @ weights[f"W{layer}"]
        h = h + weights[f"b{layer}"][:, None, :]
        if layer < n_layers - 1:
            h = np.tanh(h)
    h = h - h.max(axis=-1, keepdims=True)
    probs = np.exp(h)
    probs /= probs.sum(axis=-1, keepdims=True)
    return probs.mean(axis=0)


def split_flat(flat: np.ndarray, target) -> dict[str, np.ndarray]:
    """Flat unconstrained draws ``(S, D)`` as ``{value-variable name: (S, *shape)}`` (the
    identity for unconstrained variables such as network weights)."""
    return {
        c.value_name: flat[:, c.start : c.stop].reshape(len(flat), *c.shape)
        for c in target.coordinates
    }


# ------------------------------------------------------------------- classifier metrics
def classification_metrics(probs: np.ndarray, y: np.ndarray, bins: int = 10) -> dict[str, float]:
    """Test NLL (nats per point), accuracy and expected calibration error of predictive
    probabilities ``(n, K)`` (or ``(n,)`` for ``p(y = 1)``)."""
    probs = np.asarray(probs)
    if probs.ndim == 1:
        probs = np.stack([1.0 - probs, probs], axis=1)
    p_true = probs[np.arange(len(y)), y]
    return {
        "nll": float(-np.mean(np.log(np.clip(p_true, 1e-300, None)))),
        "accuracy": float(np.mean(probs.argmax(axis=1) == y)),
        "ece": expected_calibration_error(probs, y, bins),
    }


def reliability(probs: np.ndarray, y: np.ndarray, bins: int = 10):
    """Per confidence bin (equal width on [0, 1]): mean confidence, accuracy and count."""
    confidence = probs.max(axis=1)
    correct = (probs.argmax(axis=1) == y).astype(float)
    which = np.clip((confidence * bins).astype(int), 0, bins - 1)
    count = np.bincount(which, minlength=bins)
    safe = np.maximum(count, 1)
    mean_conf = np.bincount(which, confidence, minlength=bins) / safe
    accuracy = np.bincount(which, correct, minlength=bins) / safe
    return mean_conf, accuracy, count


def expected_calibration_error(probs: np.ndarray, y: np.ndarray, bins: int = 10) -> float:
    """ECE (Guo et al. 2017): ``sum_b (n_b / n) |accuracy_b - confidence_b|`` over equal-width
    bins of the top-class probability."""
    mean_conf, accuracy, count = reliability(probs, y, bins)
    return float(np.sum(count * np.abs(accuracy - mean_conf)) / count.sum())


# ------------------------------------------------------------ posterior-accuracy metrics
def standardised_errors(
    mean: np.ndarray, sd: np.ndarray, ref_mean: np.ndarray, ref_sd: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """``eps_mu = (m - mu_ref) / sd_ref`` and ``eps_sigma = (s - sd_ref) / sd_ref``."""
    return (mean - ref_mean) / ref_sd, (sd - ref_sd) / ref_sd


def sliced_wasserstein(
    a: np.ndarray, b: np.ndarray, n_projections: int = 200, seed: int = 0, levels: int = 1000
) -> float:
    """Sliced 2-Wasserstein distance between samples ``a (n, P)`` and ``b (m, P)``: the root
    mean over random unit directions of the squared W2 of the projected samples, each 1-D
    W2 from ``levels`` quantiles (samples of any sizes)."""
    rng = np.random.default_rng(seed)
    directions = rng.standard_normal((a.shape[1], n_projections))
    directions /= np.linalg.norm(directions, axis=0)
    u = (np.arange(levels) + 0.5) / levels
    qa = np.quantile(a @ directions, u, axis=0)
    qb = np.quantile(b @ directions, u, axis=0)
    return float(np.sqrt(np.mean((qa - qb) ** 2)))


# ------------------------------------------------------------------ reference posteriors
@dataclass
class ReferenceCase:
    """A posterior with outside ground truth: the model, the reference parameters (their
    names, and where each sits in the model's constrained variables), means, sds and, when
    available, reference draws ``(n, P)``."""

    name: str
    title: str
    source: str
    build: Callable[[], object]
    parameters: list[str]
    locations: list[tuple[str, int]]  # (model variable, flat index) per parameter
    ref_mean: np.ndarray
    ref_sd: np.ndarray
    ref_draws: np.ndarray | None = None
    ref_chains: np.ndarray | None = None
    notes: str = ""
    _model: object = field(default=None, repr=False)

    @property
    def model(self):
        if self._model is None:
            self._model = self.build()
        return self._model

    def columns(self, values: dict[str, np.ndarray]) -> np.ndarray:
        """Constrained draws ``{name: (S, *shape)}`` as the reference columns ``(S, P)``."""
        n = len(next(iter(values.values())))
        flat = {k: np.asarray(v).reshape(n, -1) for k, v in values.items()}
        return np.stack([flat[var][:, i] for var, i in self.locations], axis=1)


def _read_reference(folder: Path) -> tuple[list[str], np.ndarray, np.ndarray]:
    with open(folder / "reference_mean_sd.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    names = [r["parameter"] for r in rows]
    return (
        names,
        np.array([float(r["mean"]) for r in rows]),
        np.array([float(r["sd"]) for r in rows]),
    )


def _read_draws(folder: Path, names: list[str]) -> tuple[np.ndarray, np.ndarray]:
    with gzip.open(folder / "reference_draws.csv.gz", "rt") as fh:
        header = fh.readline().strip().split(",")
        table = np.loadtxt(fh, delimiter=",")
    columns = [header.index(n) for n in names]
    return table[:, columns], table[:, header.index("chain")].astype(int)


def _stan_locations(names: list[str], base: int = 1) -> list[tuple[str, int]]:
    """``"beta[3]"`` -> ``("beta", 2)`` (Stan is 1-based), ``"sigma"`` -> ``("sigma", 0)``;
    anything after ``]`` is a label (``"w[24]_intercept"``)."""
    out = []
    for name in names:
        if "[" in name:
            var, rest = name.split("[", 1)
            out.append((var, int(rest.split("]", 1)[0]) - base))
        else:
            out.append((name, 0))
    return out


def _eight_schools(data: dict):
    import pymc as pm

    y, sigma = np.array(data["y"], float), np.array(data["sigma"], float)
    with pm.Model() as model:
        theta_trans = pm.Normal("theta_trans", 0.0, 1.0, shape=data["J"])
        mu = pm.Normal("mu", 0.0, 5.0)
        tau = pm.HalfCauchy("tau", 5.0)
        theta = pm.Deterministic("theta", mu + tau * theta_trans)
        pm.Normal("y", theta, sigma, observed=y)
    return model


def _ark(data: dict):
    import pymc as pm

    y, k = np.array(data["y"], float), int(data["K"])
    t = len(y)
    lags = np.stack([y[k - j : t - j] for j in range(1, k + 1)], axis=1)  # y[t - j], t >= K
    with pm.Model() as model:
        alpha = pm.Normal("alpha", 0.0, 10.0)
        beta = pm.Normal("beta", 0.0, 10.0, shape=k)
        sigma = pm.HalfCauchy("sigma", 2.5)
        pm.Normal("y", alpha + lags @ beta, sigma, observed=y[k:])
    return model


def _nes(data: dict):
    import pymc as pm

    age = np.array(data["age_discrete"])
    columns = [
        np.ones(len(age)),
        data["real_ideo"],
        data["race_adj"],
        age == 2,
        age == 3,
        age == 4,
        data["educ1"],
        data["gender"],
        data["income"],
    ]
    x = np.column_stack(columns).astype(float)
    with pm.Model() as model:
        beta = pm.Flat("beta", shape=9)
        sigma = pm.HalfFlat("sigma")
        pm.Normal("partyid7", x @ beta, sigma, observed=np.array(data["partyid7"], float))
    return model


def _blr(data: dict):
    import pymc as pm

    x, y = np.array(data["X"], float), np.array(data["y"], float)
    with pm.Model() as model:
        beta = pm.Normal("beta", 0.0, 10.0, shape=x.shape[1])
        sigma = pm.HalfNormal("sigma", 10.0)
        pm.Normal("y", x @ beta, sigma, observed=y)
    return model


def _logmesquite(data: dict):
    import pymc as pm

    def log(key):
        return np.log(np.array(data[key], float))

    x = np.column_stack(
        [
            np.ones(data["N"]),
            log("diam1"),
            log("diam2"),
            log("canopy_height"),
            log("total_height"),
            log("density"),
            np.array(data["group"], float),
        ]
    )
    with pm.Model() as model:
        beta = pm.Flat("beta", shape=7)
        sigma = pm.HalfFlat("sigma")
        pm.Normal("log_weight", x @ beta, sigma, observed=log("weight"))
    return model


def german_credit_reference_model():
    """The inference-gym target: standardised features (population sd) with a constant-1
    column last, ``w ~ Normal(0, 1)`` (25 weights), ``y = bad credit ~ Bernoulli(logit X w)``."""
    import pymc as pm

    x, y = german_credit()
    x = (x - x.mean(axis=0)) / x.std(axis=0)
    x = np.hstack([x, np.ones((len(x), 1))])
    with pm.Model() as model:
        w = pm.Normal("w", 0.0, 1.0, shape=25)
        pm.Bernoulli("bad_credit", logit_p=x @ w, observed=y)
    return model


POSTERIORDB = {
    # folder: (builder, short description)
    "eight_schools-eight_schools_noncentered": (
        _eight_schools,
        "hierarchical, non-centred; funnel in tau; theta derived",
    ),
    "arK-arK": (_ark, "AR(5) time series"),
    "nes2000-nes": (_nes, "linear regression, improper flat priors"),
    "sblrc-blr": (_blr, "linear regression, correlated betas with sd ≈ 1e-3"),
    "mesquite-logmesquite": (_logmesquite, "log-log regression, improper flat priors"),
}


def posteriordb_case(folder: str) -> ReferenceCase:
    path = POSTERIORDB_DIR / folder
    builder, notes = POSTERIORDB[folder]
    data = json.loads((path / "data.json").read_text())
    names, mean, sd = _read_reference(path)
    draws, chains = _read_draws(path, names)
    return ReferenceCase(
        name=folder,
        title=folder,
        source="posteriordb (Stan NUTS, 10 000 draws)",
        build=lambda: builder(data),
        parameters=names,
        locations=_stan_locations(names),
        ref_mean=mean,
        ref_sd=sd,
        ref_draws=draws,
        ref_chains=chains,
        notes=notes,
    )


def german_credit_case() -> ReferenceCase:
    names, mean, sd = _read_reference(GERMAN_DIR)
    return ReferenceCase(
        name="german_credit",
        title="german_credit (inference-gym)",
        source="inference-gym (Stan; means and sds only)",
        build=german_credit_reference_model,
        parameters=names,
        locations=_stan_locations(names, base=0),
        ref_mean=mean,
        ref_sd=sd,
        notes="logistic regression on 1000 rows",
    )


def reference_cases() -> list[ReferenceCase]:
    """Every posterior with outside ground truth shipped in the repository."""
    return [posteriordb_case(f) for f in POSTERIORDB] + [german_credit_case()]


# ------------------------------------------------------------- reading and timing fits
def flat_sample(approx, draws: int, seed: int) -> np.ndarray:
    """Points of a fitted q in flat unconstrained space ``(S, D)``, cheaply and for any
    method: ``draws`` draws of pymc-gpf's approximations and of PyMC's Gaussian ones (read
    from their parameters with NumPy, no compilation), the particles themselves for PyMC's
    SVGD (equally weighted, so no resampling noise), and those of a Langevin ensemble still
    burning in (no draws yet). NaN rows if q cannot be sampled (a WVGD cell that rejects
    all its local Gaussian's draws)."""
    import pymc_gpf

    rng = np.random.default_rng(seed)
    if isinstance(approx, pymc_gpf.approximation.FlowApproximation):
        try:
            return approx.draw(draws, rng)
        except RuntimeError:  # WVGD: a cell whose local Gaussian misses it; a failed read
            return np.full((draws, approx.target.ndim), np.nan)
        except ValueError:  # a Langevin ensemble still burning in: its current particles
            if not isinstance(approx, pymc_gpf.EnsembleApproximation):
                raise
            return approx.particles[rng.integers(len(approx.particles), size=draws)]
    if hasattr(approx, "histogram"):  # PyMC's Empirical (SVGD)
        return np.asarray(approx.histogram.get_value())
    mean, scale = pymc_gaussian(approx)
    noise = rng.standard_normal((draws, len(mean)))
    return mean + (noise * scale if scale.ndim == 1 else noise @ scale.T)


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x)


def pymc_gaussian(approx) -> tuple[np.ndarray, np.ndarray]:
    """Mean and scale of PyMC's ADVI (``(D,)`` sds) or FullRankADVI (``(D, D)`` Cholesky
    factor), from the shared parameters (``sd = softplus(rho)``, PyMC's ``rho2sigma``)."""
    (group,) = approx.groups
    params = {k: np.asarray(v.get_value()) for k, v in group.params_dict.items()}
    if "rho" in params:
        return params["mu"], _softplus(params["rho"])
    d = len(params["mu"])
    chol = np.zeros((d, d))
    chol[np.tril_indices(d)] = params["L_tril"]
    chol[np.diag_indices(d)] = _softplus(np.diag(chol))
    return params["mu"], chol
