"""Hard posteriors the defaults were never tuned on: synthetic data, our own generators.

Each case builds a PyMC model from data drawn with its own seed, as a user would write it
(priors as in the usual textbook or posteriordb form of the model): regressions on unscaled
predictors, a centred hierarchical model, a latent GP, GARCH(1,1), ARMA(1,1), a two-component
mixture and Gaussian random walks. :func:`reference` gives each a long NUTS run (nutpie if
installed, else PyMC's NUTS), computed once and cached in ``benchmarks/data/hard/``: the
means and sds of every scalar of the free variables on the constrained scale.
"""

from __future__ import annotations

import json
import time

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CACHE_DIR = Path(__file__).resolve().parent / "data" / "hard"
REFERENCE_CHAINS, REFERENCE_DRAWS, REFERENCE_TUNE = 4, 5_000, 2_000


@dataclass(frozen=True)
class HardCase:
    """A model builder and what it is; ``parameters`` are the free variables compared."""

    name: str
    description: str
    build: Callable[[], object]
    parameters: tuple[str, ...]
    target_accept: float = 0.9
    # the exact Gaussian-VI optimum's draws: fewer where each log-density runs a scan
    optimum_draws: int = 2**14


# --------------------------------------------------------------------------- data
def _unscaled_interaction_data(seed: int = 101):
    """A kid-score-like regression: an IQ-like predictor in the hundreds, a 0/1 predictor and
    their interaction, n = 434 (as the kidiq data)."""
    rng = np.random.default_rng(seed)
    n = 434
    iq = rng.normal(100.0, 15.0, n)
    hs = (rng.random(n) < 0.79).astype(float)
    y = -11.5 + 51.3 * hs + 0.97 * iq - 0.48 * hs * iq + rng.normal(0.0, 18.0, n)
    return iq, hs, y


def unscaled_interaction():
    import pymc as pm

    iq, hs, y = _unscaled_interaction_data()
    with pm.Model() as model:
        beta = pm.Flat("beta", shape=4)
        sigma = pm.HalfCauchy("sigma", 2.5)
        mu = beta[0] + beta[1] * hs + beta[2] * iq + beta[3] * hs * iq
        pm.Normal("y", mu, sigma, observed=y)
    return model


def unscaled_earnings():
    """Earnings in dollars on height in inches and a 0/1 indicator: parameters on scales
    from 1 to 1e4 (the intercept's sd is about 1e4, sigma about 2e4)."""
    import pymc as pm

    rng = np.random.default_rng(202)
    n = 1059
    male = (rng.random(n) < 0.4).astype(float)
    height = rng.normal(64.5 + 5.0 * male, 3.0, n)
    earn = -60_000.0 + 1_300.0 * height + 10_000.0 * male + rng.normal(0.0, 19_000.0, n)
    with pm.Model() as model:
        beta = pm.Normal("beta", 0.0, 1e5, shape=3)
        sigma = pm.HalfNormal("sigma", 1e5)
        pm.Normal("earn", beta[0] + beta[1] * height + beta[2] * male, sigma, observed=earn)
    return model


def radon_centred():
    """Radon-like: 85 counties of very unequal size (1 to ~100 houses), a floor effect,
    centred county intercepts."""
    import pymc as pm

    rng = np.random.default_rng(303)
    j = 85
    sizes = np.maximum(1, np.round(rng.lognormal(1.9, 1.0, j))).astype(int)
    county = np.repeat(np.arange(j), sizes)
    n = len(county)
    floor = (rng.random(n) < 0.17).astype(float)
    a = rng.normal(1.5, 0.33, j)
    y = a[county] - 0.66 * floor + rng.normal(0.0, 0.73, n)
    with pm.Model() as model:
        mu_a = pm.Normal("mu_a", 0.0, 10.0)
        sigma_a = pm.HalfNormal("sigma_a", 1.0)
        a_j = pm.Normal("a", mu_a, sigma_a, shape=j)
        b = pm.Normal("b", 0.0, 10.0)
        sigma_y = pm.HalfNormal("sigma_y", 1.0)
        pm.Normal("y", a_j[county] + b * floor, sigma_y, observed=y)
    return model


def gp_poisson():
    """A latent GP (squared exponential, length-scale and amplitude learnt) under Poisson
    counts: 30 points, D = 32."""
    import pymc as pm

    rng = np.random.default_rng(404)
    n = 30
    x = np.sort(rng.uniform(0.0, 10.0, n))
    f = 1.0 + np.sin(x) * 0.9
    counts = rng.poisson(np.exp(f))
    with pm.Model() as model:
        ell = pm.InverseGamma("ell", 5.0, 5.0)
        eta = pm.HalfNormal("eta", 1.5)
        mean = pm.Normal("mean", 0.0, 2.0)
        cov = eta**2 * pm.gp.cov.ExpQuad(1, ell)
        gp = pm.gp.Latent(cov_func=cov)
        latent = gp.prior("f", X=x[:, None])
        pm.Poisson("counts", pm.math.exp(mean + latent), observed=counts)
    return model


def garch11():
    """GARCH(1,1) returns, T = 300: sigma_t^2 = omega + alpha r_{t-1}^2 + beta sigma_{t-1}^2."""
    import pymc as pm
    import pytensor
    import pytensor.tensor as pt

    rng = np.random.default_rng(505)
    t = 300
    omega, alpha, beta = 0.1, 0.15, 0.75
    r = np.zeros(t)
    var = omega / (1 - alpha - beta)
    for i in range(t):
        r[i] = np.sqrt(var) * rng.standard_normal()
        var = omega + alpha * r[i] ** 2 + beta * var
    with pm.Model() as model:
        mu = pm.Normal("mu", 0.0, 1.0)
        omega_ = pm.HalfNormal("omega", 1.0)
        alpha_ = pm.Uniform("alpha", 0.0, 1.0)
        beta_ = pm.Uniform("beta", 0.0, 1.0 - alpha_)
        ret = pt.as_tensor(r)

        def recursion(r_prev, var_prev, om, al, be, m):
            return om + al * (r_prev - m) ** 2 + be * var_prev

        var = pytensor.scan(
            recursion,
            sequences=[ret[:-1]],
            outputs_info=[omega_ / (1.0 - alpha_ - beta_)],
            non_sequences=[omega_, alpha_, beta_, mu],
            return_updates=False,
        )
        var = pt.concatenate([[omega_ / (1.0 - alpha_ - beta_)], var])
        pm.Normal("r", mu, pt.sqrt(var), observed=r)
    return model


def arma11():
    """ARMA(1,1), T = 200: y_t = mu + phi y_{t-1} + theta e_{t-1} + e_t (posteriordb's
    arma11 form, priors as there)."""
    import pymc as pm
    import pytensor
    import pytensor.tensor as pt

    rng = np.random.default_rng(606)
    t = 200
    mu, phi, theta, sigma = 0.5, 0.7, 0.3, 1.0
    y = np.zeros(t)
    err_prev, y_prev = 0.0, mu / (1 - phi)
    for i in range(t):
        e = sigma * rng.standard_normal()
        y[i] = mu + phi * y_prev + theta * err_prev + e
        err_prev, y_prev = e, y[i]
    with pm.Model() as model:
        mu_ = pm.Normal("mu", 0.0, 10.0)
        phi_ = pm.Normal("phi", 0.0, 2.0)
        theta_ = pm.Normal("theta", 0.0, 2.0)
        sigma_ = pm.HalfCauchy("sigma", 2.5)
        obs = pt.as_tensor(y)

        def error(y_t, y_prev, err_prev, m, ph, th):
            return y_t - (m + ph * y_prev + th * err_prev)

        first = obs[0] - (mu_ + phi_ * mu_)
        rest = pytensor.scan(
            error,
            sequences=[obs[1:], obs[:-1]],
            outputs_info=[first],
            non_sequences=[mu_, phi_, theta_],
            return_updates=False,
        )
        errors = pt.concatenate([[first], rest])
        # the errors are a unit-Jacobian function of y given the parameters
        pm.Potential("likelihood", pm.logp(pm.Normal.dist(0.0, sigma_), errors).sum())
    return model


def mixture():
    """Two-component 1-D normal mixture with ordered means, weights and sds learnt;
    n = 200, the minor component 30 %."""
    import pymc as pm

    rng = np.random.default_rng(707)
    n = 200
    minor = rng.random(n) < 0.3
    y = np.where(minor, rng.normal(-1.5, 0.8, n), rng.normal(2.0, 1.0, n))
    with pm.Model() as model:
        w = pm.Dirichlet("w", np.ones(2))
        mu = pm.Normal(
            "mu", 0.0, 5.0, shape=2, transform=pm.distributions.transforms.ordered,
            initval=np.array([-1.0, 1.0]),
        )  # fmt: skip
        sigma = pm.HalfNormal("sigma", 2.0, shape=2)
        pm.NormalMixture("y", w, mu, sigma, observed=y)
    return model


def random_walks():
    """Three Gaussian random walks of length 100 (one shared innovation sd each) observed
    with noise: D = 304."""
    import pymc as pm

    rng = np.random.default_rng(808)
    t, k = 100, 3
    innovations = np.array([0.1, 0.3, 0.2])
    walks = np.cumsum(rng.normal(0.0, innovations, (t, k)), axis=0)
    y = walks + rng.normal(0.0, 0.5, (t, k))
    with pm.Model() as model:
        sigma = pm.HalfNormal("sigma", 0.5, shape=k)
        walk = pm.GaussianRandomWalk(
            "walk", sigma=sigma, init_dist=pm.Normal.dist(0.0, 1.0), shape=(k, t)
        )
        obs_sd = pm.HalfNormal("obs_sd", 1.0)
        pm.Normal("y", walk.T, obs_sd, observed=y)
    return model


CASES: dict[str, HardCase] = {
    case.name: case
    for case in (
        HardCase(
            "unscaled_interaction",
            "regression, predictors in the hundreds and 0/1 with their interaction, flat priors",
            unscaled_interaction,
            ("beta", "sigma"),
        ),
        HardCase(
            "unscaled_earnings",
            "regression, dollars on inches: parameter scales from 1 to 1e4",
            unscaled_earnings,
            ("beta", "sigma"),
        ),
        HardCase(
            "radon_centred",
            "centred hierarchical, 85 groups of 1 to ~100 observations",
            radon_centred,
            ("mu_a", "sigma_a", "a", "b", "sigma_y"),
            target_accept=0.95,
            optimum_draws=2**12,
        ),
        HardCase(
            "gp_poisson",
            "latent GP (length-scale, amplitude learnt), Poisson counts, D = 33",
            gp_poisson,
            ("ell", "eta", "mean", "f"),
            target_accept=0.95,
            optimum_draws=2**12,
        ),
        HardCase(
            "garch11",
            "GARCH(1,1), T = 300",
            garch11,
            ("mu", "omega", "alpha", "beta"),
            optimum_draws=2**11,
        ),
        HardCase(
            "arma11",
            "ARMA(1,1), T = 200",
            arma11,
            ("mu", "phi", "theta", "sigma"),
            optimum_draws=2**11,
        ),
        HardCase(
            "mixture", "two-component 1-D mixture, ordered means", mixture, ("w", "mu", "sigma")
        ),
        HardCase(
            "random_walks",
            "three Gaussian random walks of 100 steps observed with noise, D = 304",
            random_walks,
            ("sigma", "walk", "obs_sd"),
            optimum_draws=2**12,
        ),
    )
}


# ---------------------------------------------------------------------- references
def _flatten(draws: dict[str, np.ndarray], parameters) -> tuple[list[str], np.ndarray]:
    """``(labels, (S, P))``: every scalar of ``parameters`` from ``{name: (S, *shape)}``."""
    labels, columns = [], []
    for name in parameters:
        values = np.asarray(draws[name], dtype=float)
        flat = values.reshape(len(values), -1)
        shape = values.shape[1:]
        for k in range(flat.shape[1]):
            index = np.unravel_index(k, shape) if shape else ()
            labels.append(name + "".join(f"[{i}]" for i in index))
            columns.append(flat[:, k])
    return labels, np.column_stack(columns)


@dataclass
class Reference:
    labels: list[str]
    mean: np.ndarray
    sd: np.ndarray
    info: dict

    def errors(self, draws: dict[str, np.ndarray], parameters) -> tuple[float, float]:
        """max |eps_mu| (in reference sds) and max |eps_sigma| (relative) of draws."""
        labels, columns = _flatten(draws, parameters)
        if labels != self.labels:
            raise ValueError("draws do not match the reference's parameters")
        columns = columns[np.all(np.isfinite(columns), axis=1)]
        eps_mean = (columns.mean(0) - self.mean) / self.sd
        eps_sd = columns.std(0, ddof=1) / self.sd - 1.0
        return float(np.max(np.abs(eps_mean))), float(np.max(np.abs(eps_sd)))


def reference(name: str, *, recompute: bool = False) -> Reference:
    """The long NUTS reference of case ``name`` (computed and cached on first use)."""
    path = CACHE_DIR / f"{name}.json"
    if path.exists() and not recompute:
        raw = json.loads(path.read_text())
        return Reference(raw["labels"], np.array(raw["mean"]), np.array(raw["sd"]), raw["info"])
    case = CASES[name]
    draws, info, flat = _nuts(case)
    labels, columns = _flatten(draws, case.parameters)
    ref = Reference(labels, columns.mean(0), columns.std(0, ddof=1), info)
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    if flat is not None:
        np.savez_compressed(
            CACHE_DIR / f"{name}_flat.npz", mean=flat.mean(0), cov=np.cov(flat, rowvar=False)
        )
    payload = {"labels": labels, "mean": ref.mean.tolist(), "sd": ref.sd.tolist(), "info": info}
    path.write_text(json.dumps(payload, indent=1) + "\n")
    return ref


def _nuts(case: HardCase) -> tuple[dict[str, np.ndarray], dict, np.ndarray | None]:
    """Long NUTS draws of the parameters, what the run was, and its draws in the flat
    unconstrained coordinates of ``pymc_gpf.BatchedTarget`` (nutpie only, else ``None``)."""
    import arviz_stats  # noqa: F401  (the .azstats accessor)
    import pymc as pm

    model = case.build()
    start = time.perf_counter()
    flat = None
    try:
        import nutpie
    except ImportError:
        nutpie = None
    if nutpie is not None:
        compiled = nutpie.compile_pymc_model(model)
        idata = nutpie.sample(
            compiled, draws=REFERENCE_DRAWS, tune=REFERENCE_TUNE, chains=REFERENCE_CHAINS,
            cores=1, seed=20261124, progress_bar=False, store_unconstrained=True,
            target_accept=case.target_accept,
        )  # fmt: skip
        raw = idata.sample_stats["unconstrained_draw"].values
        flat = raw.reshape(-1, raw.shape[-1])
    else:
        with model:
            idata = pm.sample(
                REFERENCE_DRAWS, tune=REFERENCE_TUNE, chains=REFERENCE_CHAINS, cores=1,
                random_seed=20261124, target_accept=case.target_accept, progressbar=False,
                compute_convergence_checks=False,
            )  # fmt: skip
    seconds = time.perf_counter() - start
    post = idata.posterior
    draws = {name: post[name].values.reshape(-1, *post[name].shape[2:]) for name in case.parameters}
    if flat is not None and not _same_coordinates(model, flat, draws, case.parameters):
        flat = None
    rhat = max(float(post[name].azstats.rhat().max()) for name in case.parameters)
    ess = min(float(post[name].azstats.ess().min()) for name in case.parameters)
    diverging = 0
    if "sample_stats" in idata.children and "diverging" in idata.sample_stats:
        diverging = int(idata.sample_stats["diverging"].sum())
    info = {
        "sampler": "nutpie" if nutpie is not None else "pymc",
        "chains": REFERENCE_CHAINS,
        "draws": REFERENCE_DRAWS,
        "tune": REFERENCE_TUNE,
        "target_accept": case.target_accept,
        "seconds": round(seconds, 1),
        "max_rhat": round(rhat, 4),
        "min_ess": round(ess, 1),
        "divergences": diverging,
    }
    return draws, info, flat


def _same_coordinates(model, flat: np.ndarray, draws: dict, parameters) -> bool:
    """Whether nutpie's unconstrained draws are in ``BatchedTarget``'s coordinate order
    (they map back to the constrained draws)."""
    import pymc_gpf

    some = slice(0, 50)
    values = pymc_gpf.BatchedTarget(model).compile_constrained()(flat[some])
    return all(np.allclose(values[name], draws[name][some], atol=1e-8) for name in parameters)


def flat_moments(name: str) -> tuple[np.ndarray, np.ndarray] | None:
    """Mean and covariance of the reference draws in ``BatchedTarget``'s flat unconstrained
    coordinates (``None`` if the reference was not drawn with nutpie)."""
    path = CACHE_DIR / f"{name}_flat.npz"
    if not path.exists():
        reference(name)
    if not path.exists():
        return None
    with np.load(path) as data:
        return data["mean"], data["cov"]


if __name__ == "__main__":
    import sys

    names = [a for a in sys.argv[1:] if not a.startswith("--")]
    for name in names or list(CASES):
        ref = reference(name, recompute="--recompute" in sys.argv)
        print(name, ref.info)
