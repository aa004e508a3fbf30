"""The case registry: data, PyMC models and their references (``benchmarks/data/README.md``):
the German credit data of ``examples/data``, posteriordb and
inference-gym references (the Stan models translated with their priors and parameterisation)
and :data:`HARD`, synthetic posteriors with long NUTS references cached in
``benchmarks/data/hard/`` (``python -m benchmarks.cases [--recompute]``)."""

from __future__ import annotations

import csv
import functools
import gzip
import json
import time

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pymc as pm
import pytensor
import pytensor.tensor as pt

import pymc_gpf

DATA = Path(__file__).resolve().parent / "data"
GERMAN_DIR = DATA.parent.parent / "examples" / "data"


# ------------------------------------------------------------------------ speed models
def gaussian_model(d: int, kappa: float):
    """The GPF paper's N(μ, Σ) (log10 eigenvalues evenly from −1 to −1 + log10 κ, a random
    rotation) as a flat prior plus a potential; and μ and the marginal sds."""
    rng = np.random.default_rng(0)
    rotation, _ = np.linalg.qr(rng.uniform(size=(d, d)))
    mean, eigenvalues = rng.normal(size=d), 10 ** np.linspace(-1, -1 + np.log10(kappa), d)
    with pm.Model() as model:
        mu = pm.Data("mean", mean)
        factor = pm.Data("precision_factor", rotation / np.sqrt(eigenvalues))
        x = pm.Flat("x", shape=d)
        pm.Potential("gaussian", -0.5 * pt.sum(pt.square(pt.dot(x - mu, factor))))
    return model, mean, np.sqrt(np.diag((rotation * eigenvalues) @ rotation.T))


def speed_model(spec: dict):
    """``logistic``: n observations of d standard-normal features, N(0, 1) priors, no
    intercept; ``gaussian``: :func:`gaussian_model` with κ = 10; ``german_credit``,
    ``eight_schools``: the reference cases'; else N(μ, diag σ²) in d."""
    if spec["kind"] == "logistic":  # speed's n = 2000, D = 50; scale's (d given) n = 1000
        rng, (n, d) = np.random.default_rng(0), (1000, spec["d"]) if "d" in spec else (2000, 50)
        x = rng.normal(size=(n, d))
        if "d" in spec:  # scale's draws the labels' uniforms before the weights
            u, w = rng.random(n), 0.3 * rng.normal(size=d)
        else:
            w, u = 0.3 * rng.normal(size=d), rng.random(n)
        return logistic_model(x, u < 1 / (1 + np.exp(-x @ w)), 1.0, intercept=False,
                              as_data=False)  # fmt: skip
    if spec["kind"] == "gaussian":
        return gaussian_model(spec["d"], 10.0)[0]
    if spec["kind"] == "german_credit":
        return german_credit_reference_model()
    if spec["kind"] == "eight_schools":
        return posteriordb_case("eight_schools-eight_schools_noncentered").model
    rng = np.random.default_rng(spec["d"])
    with pm.Model() as model:
        pm.Normal("x", rng.normal(size=spec["d"]), np.exp(rng.normal(scale=0.5, size=spec["d"])),
                  shape=spec["d"])  # fmt: skip
    return model


# ------------------------------------------------------------ logistic regression
def german_credit() -> tuple[np.ndarray, np.ndarray]:
    raw = np.loadtxt(GERMAN_DIR / "german.data-numeric")
    return raw[:, :24], (raw[:, 24] == 2).astype(np.int64)


def logistic_model(x, y, prior_sd: float, *, intercept: bool = True, as_data: bool = True):
    """``y ~ Bernoulli(logit = x w + b)``, ``w, b ~ N(0, prior_sd)``; ``x``, ``y`` are
    ``pm.Data`` (``pm.set_data`` swaps in another split) unless ``as_data=False``."""
    with pm.Model() as model:
        x_data, y_data = (pm.Data("x", x), pm.Data("y", y)) if as_data else (pt.as_tensor(x), y)
        logit = x_data @ pm.Normal("w", 0.0, prior_sd, shape=x.shape[1])
        if intercept:
            logit = logit + pm.Normal("b", 0.0, prior_sd)
        pm.Bernoulli("obs", logit_p=logit, observed=y_data)
    return model


def sliced_wasserstein(a, b, n_projections: int = 200, seed: int = 0, levels: int = 1000) -> float:
    """Sliced 2-Wasserstein distance of samples ``a (n, P)`` and ``b (m, P)``: root mean over
    random directions of the squared W2 of the projections, from ``levels`` quantiles."""
    directions = np.random.default_rng(seed).standard_normal((a.shape[1], n_projections))
    directions /= np.linalg.norm(directions, axis=0)
    u = (np.arange(levels) + 0.5) / levels
    qa, qb = np.quantile(a @ directions, u, axis=0), np.quantile(b @ directions, u, axis=0)
    return float(np.sqrt(np.mean((qa - qb) ** 2)))


# ---------------------------------------------------------------- reference posteriors
@dataclass
class ReferenceCase:
    """A posterior with outside ground truth: model, reference parameters (where each sits in
    the model's constrained variables), their means, sds and, where known, draws ``(n, P)``."""

    name: str
    title: str
    source: str
    build: Callable[[], object]
    parameters: list[str]
    locations: list[tuple[str, int]]  # (model variable, flat index) per parameter
    ref_mean: np.ndarray
    ref_sd: np.ndarray
    ref_draws: np.ndarray | None = None
    notes: str = ""

    @functools.cached_property
    def model(self):
        return self.build()

    def columns(self, values: dict[str, np.ndarray]) -> np.ndarray:
        """Constrained draws ``{name: (S, *shape)}`` as the reference columns ``(S, P)``."""
        n = len(next(iter(values.values())))
        flat = {k: np.asarray(v).reshape(n, -1) for k, v in values.items()}
        return np.stack([flat[var][:, i] for var, i in self.locations], axis=1)


def _reference(folder: Path, base: int = 1, draws: bool = True) -> dict:
    with open(folder / "reference_mean_sd.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    names = [r["parameter"] for r in rows]
    # "beta[3]" -> ("beta", 2) (Stan is 1-based); "sigma" -> ("sigma", 0); "w[24]_intercept"
    locations = [(n.split("[")[0], int(n.split("[")[1].split("]")[0]) - base) if "[" in n
                 else (n, 0) for n in names]  # fmt: skip
    out = {"parameters": names, "locations": locations,
           "ref_mean": np.array([float(r["mean"]) for r in rows]),
           "ref_sd": np.array([float(r["sd"]) for r in rows])}  # fmt: skip
    if draws:
        with gzip.open(folder / "reference_draws.csv.gz", "rt") as fh:
            header = fh.readline().strip().split(",")
            out["ref_draws"] = np.loadtxt(fh, delimiter=",")[:, [header.index(n) for n in names]]
    return out


def _eight_schools(data: dict):
    with pm.Model() as model:
        theta_trans = pm.Normal("theta_trans", 0.0, 1.0, shape=data["J"])
        mu, tau = pm.Normal("mu", 0.0, 5.0), pm.HalfCauchy("tau", 5.0)
        theta = pm.Deterministic("theta", mu + tau * theta_trans)
        pm.Normal("y", theta, np.array(data["sigma"], float), observed=np.array(data["y"], float))
    return model


def _ark(data: dict):
    y, k = np.array(data["y"], float), int(data["K"])
    lags = np.stack([y[k - j : len(y) - j] for j in range(1, k + 1)], axis=1)  # y[t - j]
    with pm.Model() as model:
        alpha, beta = pm.Normal("alpha", 0.0, 10.0), pm.Normal("beta", 0.0, 10.0, shape=k)
        pm.Normal("y", alpha + lags @ beta, pm.HalfCauchy("sigma", 2.5), observed=y[k:])
    return model


def _flat_regression(x: np.ndarray, name: str, y: np.ndarray):
    with pm.Model() as model:
        beta, sigma = pm.Flat("beta", shape=x.shape[1]), pm.HalfFlat("sigma")
        pm.Normal(name, x @ beta, sigma, observed=y)
    return model


def _nes(data: dict):
    age = np.array(data["age_discrete"])
    x = np.column_stack([np.ones(len(age)), data["real_ideo"], data["race_adj"], age == 2,
                         age == 3, age == 4, data["educ1"], data["gender"],
                         data["income"]])  # fmt: skip
    return _flat_regression(x.astype(float), "partyid7", np.array(data["partyid7"], float))


def _blr(data: dict):
    x, y = np.array(data["X"], float), np.array(data["y"], float)
    with pm.Model() as model:
        beta = pm.Normal("beta", 0.0, 10.0, shape=x.shape[1])
        pm.Normal("y", x @ beta, pm.HalfNormal("sigma", 10.0), observed=y)
    return model


def _logmesquite(data: dict):
    keys = ("diam1", "diam2", "canopy_height", "total_height", "density")
    x = np.column_stack([np.ones(data["N"]), *(np.log(np.array(data[k], float)) for k in keys),
                         np.array(data["group"], float)])  # fmt: skip
    return _flat_regression(x, "log_weight", np.log(np.array(data["weight"], float)))


def german_credit_reference_model():
    """inference-gym's target: standardised features and a constant-1 column, ``w ~ N(0, 1)``."""
    x, y = german_credit()
    x = np.hstack([(x - x.mean(axis=0)) / x.std(axis=0), np.ones((len(x), 1))])
    with pm.Model() as model:
        pm.Bernoulli("bad_credit", logit_p=x @ pm.Normal("w", 0.0, 1.0, shape=25), observed=y)
    return model


POSTERIORDB = {  # folder: (builder, short description)
    "eight_schools-eight_schools_noncentered": (
        _eight_schools, "hierarchical, non-centred; funnel in tau; theta derived"),
    "arK-arK": (_ark, "AR(5) time series"),
    "nes2000-nes": (_nes, "linear regression, improper flat priors"),
    "sblrc-blr": (_blr, "linear regression, correlated betas with sd ≈ 1e-3"),
    "mesquite-logmesquite": (_logmesquite, "log-log regression, improper flat priors"),
}  # fmt: skip


def posteriordb_case(folder: str) -> ReferenceCase:
    path, (builder, notes) = DATA / "posteriordb" / folder, POSTERIORDB[folder]
    data = json.loads((path / "data.json").read_text())
    return ReferenceCase(folder, folder, "posteriordb (Stan NUTS, 10 000 draws)",
                         lambda: builder(data), notes=notes, **_reference(path))  # fmt: skip


def reference_cases() -> list[ReferenceCase]:
    """Every posterior with outside ground truth shipped in the repository."""
    german = ReferenceCase(
        "german_credit", "german_credit (inference-gym)",
        "inference-gym (Stan; means and sds only)", german_credit_reference_model,
        notes="logistic regression on 1000 rows",
        **_reference(GERMAN_DIR, base=0, draws=False),
    )  # fmt: skip
    return [posteriordb_case(f) for f in POSTERIORDB] + [german]


# ------------------------------------------------------------------------ hard posteriors
def unscaled_interaction():
    rng = np.random.default_rng(101)
    iq, hs = rng.normal(100.0, 15.0, 434), (rng.random(434) < 0.79).astype(float)
    y = -11.5 + 51.3 * hs + 0.97 * iq - 0.48 * hs * iq + rng.normal(0.0, 18.0, 434)
    with pm.Model() as model:
        beta, sigma = pm.Flat("beta", shape=4), pm.HalfCauchy("sigma", 2.5)
        pm.Normal("y", beta[0] + beta[1] * hs + beta[2] * iq + beta[3] * hs * iq, sigma, observed=y)
    return model


def unscaled_earnings():
    rng = np.random.default_rng(202)
    male = (rng.random(1059) < 0.4).astype(float)
    height = rng.normal(64.5 + 5.0 * male, 3.0, 1059)
    earn = -60_000.0 + 1_300.0 * height + 10_000.0 * male + rng.normal(0.0, 19_000.0, 1059)
    with pm.Model() as model:
        beta, sigma = pm.Normal("beta", 0.0, 1e5, shape=3), pm.HalfNormal("sigma", 1e5)
        pm.Normal("earn", beta[0] + beta[1] * height + beta[2] * male, sigma, observed=earn)
    return model


def radon_centred():
    rng = np.random.default_rng(303)
    sizes = np.maximum(1, np.round(rng.lognormal(1.9, 1.0, 85))).astype(int)
    county = np.repeat(np.arange(85), sizes)
    floor = (rng.random(len(county)) < 0.17).astype(float)
    y = rng.normal(1.5, 0.33, 85)[county] - 0.66 * floor + rng.normal(0.0, 0.73, len(county))
    with pm.Model() as model:
        mu_a, sigma_a = pm.Normal("mu_a", 0.0, 10.0), pm.HalfNormal("sigma_a", 1.0)
        a_j = pm.Normal("a", mu_a, sigma_a, shape=85)
        b, sigma_y = pm.Normal("b", 0.0, 10.0), pm.HalfNormal("sigma_y", 1.0)
        pm.Normal("y", a_j[county] + b * floor, sigma_y, observed=y)
    return model


def low_rank_gaussian(ndim: int = 1200, factors: int = 5):
    """A Gaussian posterior with covariance ``V V^T + diag(t^2)`` (``factors`` columns of sd
    0.5, ``t`` uniform on 0.5-2: correlations up to 0.99, sds 0.5-8), a model without group
    effects whose exact answer is known and which GF's low-rank structure holds exactly:
    ``(model, mean, sds)``."""
    rng = np.random.default_rng(11)
    loadings, scales = 0.5 * rng.normal(size=(ndim, factors)), rng.uniform(0.5, 2.0, ndim)
    cov, mean = loadings @ loadings.T + np.diag(scales**2), 3 * rng.normal(size=ndim)
    with pm.Model() as model:  # cov as data: a large constant stops numba caching
        pm.MvNormal("x", mu=mean, cov=pm.Data("cov", cov))
    return model, mean, np.sqrt(np.diag(cov))


def hierarchical_normal(groups: int, centred: bool = False, per_group: int = 20):
    """``y_jk ~ N(theta_j, 1)``, ``theta_j = mu + tau z_j`` (non-centred, what a user
    writes; ``centred``: ``theta_j ~ N(mu, tau)``, the same posterior, the one NUTS mixes
    well on), ``per_group`` observations per group; ``D = groups + 2``."""
    rng = np.random.default_rng(5)
    theta = 1.0 + 0.5 * rng.normal(size=groups)
    y = theta[:, None] + rng.normal(size=(groups, per_group))
    with pm.Model() as model:
        mu, tau = pm.Normal("mu", 0.0, 5.0), pm.HalfNormal("tau", 2.0)
        if centred:
            theta = pm.Normal("theta", mu, tau, shape=groups)
        else:
            z = pm.Normal("z", 0.0, 1.0, shape=groups)
            theta = pm.Deterministic("theta", mu + tau * z)
        pm.Normal("y", theta[:, None], 1.0, observed=y)
    return model


def gp_poisson():
    rng = np.random.default_rng(404)
    x = np.sort(rng.uniform(0.0, 10.0, 30))
    counts = rng.poisson(np.exp(1.0 + np.sin(x) * 0.9))
    with pm.Model() as model:
        ell, eta = pm.InverseGamma("ell", 5.0, 5.0), pm.HalfNormal("eta", 1.5)
        mean = pm.Normal("mean", 0.0, 2.0)
        latent = pm.gp.Latent(cov_func=eta**2 * pm.gp.cov.ExpQuad(1, ell)).prior("f", X=x[:, None])
        pm.Poisson("counts", pm.math.exp(mean + latent), observed=counts)
    return model


def garch11():
    rng, r = np.random.default_rng(505), np.zeros(300)
    var = 0.1 / (1 - 0.15 - 0.75)
    for i in range(300):
        r[i] = np.sqrt(var) * rng.standard_normal()
        var = 0.1 + 0.15 * r[i] ** 2 + 0.75 * var
    with pm.Model() as model:
        mu, omega = pm.Normal("mu", 0.0, 1.0), pm.HalfNormal("omega", 1.0)
        alpha = pm.Uniform("alpha", 0.0, 1.0)
        beta = pm.Uniform("beta", 0.0, 1.0 - alpha)
        start = omega / (1.0 - alpha - beta)
        var = pytensor.scan(
            lambda r_prev, var_prev, om, al, be, m: om + al * (r_prev - m) ** 2 + be * var_prev,
            sequences=[pt.as_tensor(r)[:-1]], outputs_info=[start],
            non_sequences=[omega, alpha, beta, mu], return_updates=False,
        )  # fmt: skip
        pm.Normal("r", mu, pt.sqrt(pt.concatenate([[start], var])), observed=r)
    return model


def arma11():
    rng, y = np.random.default_rng(606), np.zeros(200)
    err_prev, y_prev = 0.0, 0.5 / (1 - 0.7)
    for i in range(200):
        e = rng.standard_normal()
        y[i] = 0.5 + 0.7 * y_prev + 0.3 * err_prev + e
        err_prev, y_prev = e, y[i]
    with pm.Model() as model:
        mu, phi = pm.Normal("mu", 0.0, 10.0), pm.Normal("phi", 0.0, 2.0)
        theta, sigma = pm.Normal("theta", 0.0, 2.0), pm.HalfCauchy("sigma", 2.5)
        obs = pt.as_tensor(y)
        first = obs[0] - (mu + phi * mu)
        rest = pytensor.scan(
            lambda y_t, y_prev, err_prev, m, ph, th: y_t - (m + ph * y_prev + th * err_prev),
            sequences=[obs[1:], obs[:-1]], outputs_info=[first], non_sequences=[mu, phi, theta],
            return_updates=False,
        )  # fmt: skip
        errors = pt.concatenate([[first], rest])  # a unit-Jacobian function of y
        pm.Potential("likelihood", pm.logp(pm.Normal.dist(0.0, sigma), errors).sum())
    return model


def mixture():
    rng = np.random.default_rng(707)
    minor = rng.random(200) < 0.3
    y = np.where(minor, rng.normal(-1.5, 0.8, 200), rng.normal(2.0, 1.0, 200))
    with pm.Model() as model:
        w = pm.Dirichlet("w", np.ones(2))
        mu = pm.Normal("mu", 0.0, 5.0, shape=2, transform=pm.distributions.transforms.ordered,
                       initval=np.array([-1.0, 1.0]))  # fmt: skip
        pm.NormalMixture("y", w, mu, pm.HalfNormal("sigma", 2.0, shape=2), observed=y)
    return model


def random_walks():
    rng = np.random.default_rng(808)
    walks = np.cumsum(rng.normal(0.0, np.array([0.1, 0.3, 0.2]), (100, 3)), axis=0)
    y = walks + rng.normal(0.0, 0.5, (100, 3))
    with pm.Model() as model:
        sigma = pm.HalfNormal("sigma", 0.5, shape=3)
        walk = pm.GaussianRandomWalk("walk", sigma=sigma, init_dist=pm.Normal.dist(0.0, 1.0),
                                     shape=(3, 100))  # fmt: skip
        pm.Normal("y", walk.T, pm.HalfNormal("obs_sd", 1.0), observed=y)
    return model


def truncated_normal():
    rng = np.random.default_rng(909)
    y = rng.normal(2.0, 1.5, 400)
    with pm.Model() as model:
        mu, sigma = pm.Normal("mu", 0.0, 5.0), pm.HalfNormal("sigma", 3.0)
        pm.Truncated("y", pm.Normal.dist(mu, sigma), lower=1.0, observed=y[y > 1.0][:80])
    return model


def hierarchical_logistic():
    rng = np.random.default_rng(1010)
    sizes = rng.integers(3, 20, 30)
    group = np.repeat(np.arange(30), sizes)
    x = rng.normal(size=len(group))
    logit = -0.5 + 0.8 * rng.normal(size=30)[group] + 0.7 * x
    y = (rng.random(len(group)) < 1.0 / (1.0 + np.exp(-logit))).astype(int)
    with pm.Model() as model:
        mu, tau = pm.Normal("mu", 0.0, 2.0), pm.HalfNormal("tau", 1.0)
        z, beta = pm.Normal("z", 0.0, 1.0, shape=30), pm.Normal("beta", 0.0, 2.0)
        pm.Bernoulli("y", logit_p=mu + tau * z[group] + beta * x, observed=y)
    return model


def banana():
    y = 1.0 + 0.5 * np.random.default_rng(1111).standard_normal(10)
    with pm.Model() as model:
        a, b = pm.Normal("a", 0.0, 1.0), pm.Normal("b", 0.0, 1.0)
        pm.Normal("y", a + b**2, 0.5, observed=y)
    return model


@dataclass(frozen=True)
class HardCase:
    name: str
    description: str
    build: Callable[[], object]
    parameters: tuple[str, ...]  # the free variables compared
    target_accept: float = 0.9
    optimum_draws: int = 2**14  # the Gaussian-VI optimum's draws (README.md says why)


HARD = {c.name: c for c in (
    HardCase("unscaled_interaction", "regression, predictors in the hundreds and 0/1 with their "
             "interaction, flat priors", unscaled_interaction, ("beta", "sigma")),
    HardCase("unscaled_earnings", "regression, dollars on inches: parameter scales from 1 to 1e4",
             unscaled_earnings, ("beta", "sigma")),
    HardCase("radon_centred", "centred hierarchical, 85 groups of 1 to ~100 observations",
             radon_centred, ("mu_a", "sigma_a", "a", "b", "sigma_y"), 0.95),
    HardCase("gp_poisson", "latent GP (length-scale, amplitude learnt), Poisson counts, D = 33",
             gp_poisson, ("ell", "eta", "mean", "f"), 0.95),
    HardCase("garch11", "GARCH(1,1), T = 300", garch11, ("mu", "omega", "alpha", "beta"),
             optimum_draws=2**11),
    HardCase("arma11", "ARMA(1,1), T = 200", arma11, ("mu", "phi", "theta", "sigma"),
             optimum_draws=2**11),
    HardCase("mixture", "two-component 1-D mixture, ordered means", mixture, ("w", "mu", "sigma")),
    HardCase("random_walks", "three Gaussian random walks of 100 steps observed with noise, "
             "D = 304", random_walks, ("sigma", "walk", "obs_sd"), optimum_draws=2**16),
    HardCase("truncated_normal", "normal truncated below at 1, 80 observations: sd and mean "
             "trade off", truncated_normal, ("mu", "sigma")),
    HardCase("hierarchical_logistic", "non-centred hierarchical logistic regression, 30 groups "
             "of 3-19 observations, D = 33", hierarchical_logistic, ("mu", "tau", "z", "beta")),
    HardCase("banana", "y ~ N(a + b^2, 0.5^2): a curved posterior with two modes in b",
             banana, ("a", "b")),
)}  # fmt: skip


def flatten(draws: dict[str, np.ndarray], parameters) -> tuple[list[str], np.ndarray]:
    """``(labels, (S, P))``: every scalar of ``parameters`` from ``{name: (S, *shape)}``."""
    labels, columns = [], []
    for name in parameters:
        values = np.asarray(draws[name], dtype=float)
        shape = values.shape[1:]
        for k, column in enumerate(values.reshape(len(values), -1).T):
            labels.append(name + "".join(f"[{i}]" for i in np.unravel_index(k, shape)))
            columns.append(column)
    return labels, np.column_stack(columns)


def hard_reference(name: str, recompute: bool = False) -> dict:
    """The cached long NUTS reference of a hard case: ``labels``, ``mean``, ``sd``, ``info``
    (nutpie, 4 × (2000 + 5000), computed on first use) and, with nutpie, ``flat`` moments in
    ``BatchedTarget``'s unconstrained coordinates (the Gaussian optimum's start)."""
    path = DATA / "hard" / f"{name}.json"
    if recompute or not path.exists():
        _recompute(HARD[name], path)
    out = json.loads(path.read_text())
    if path.with_name(f"{name}_flat.npz").exists():
        with np.load(path.with_name(f"{name}_flat.npz")) as data:
            out["flat"] = data["mean"], data["cov"]
    return out


def _recompute(case: HardCase, path: Path) -> None:
    import arviz_stats  # noqa: F401  (the .azstats accessor)
    import nutpie

    model, start = case.build(), time.perf_counter()
    idata = nutpie.sample(nutpie.compile_pymc_model(model), draws=5000, tune=2000, chains=4,
                          cores=1, seed=20261124, progress_bar=False, store_unconstrained=True,
                          target_accept=case.target_accept)  # fmt: skip
    post, raw = idata.posterior, idata.sample_stats["unconstrained_draw"].values
    draws = {k: post[k].values.reshape(-1, *post[k].shape[2:]) for k in case.parameters}
    flat = raw.reshape(-1, raw.shape[-1])
    labels, columns = flatten(draws, case.parameters)
    info = {"sampler": "nutpie", "chains": 4, "draws": 5000, "tune": 2000,
            "target_accept": case.target_accept, "seconds": round(time.perf_counter() - start, 1),
            "max_rhat": round(max(float(post[k].azstats.rhat().max()) for k in case.parameters), 4),
            "min_ess": round(min(float(post[k].azstats.ess().min()) for k in case.parameters), 1),
            "divergences": int(idata.sample_stats["diverging"].sum())}  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    values = pymc_gpf.BatchedTarget(model).compile_constrained()(flat[:50])
    if all(np.allclose(values[k], draws[k][:50], atol=1e-8) for k in case.parameters):
        np.savez_compressed(path.with_name(f"{case.name}_flat.npz"), mean=flat.mean(0),
                            cov=np.cov(flat, rowvar=False))  # fmt: skip
    payload = {"labels": labels, "mean": columns.mean(0).tolist(),
               "sd": columns.std(0, ddof=1).tolist(), "info": info}  # fmt: skip
    path.write_text(json.dumps(payload, indent=1) + "\n")


if __name__ == "__main__":
    import sys

    for name in [a for a in sys.argv[1:] if not a.startswith("--")] or list(HARD):
        print(name, hard_reference(name, recompute="--recompute" in sys.argv)["info"])
