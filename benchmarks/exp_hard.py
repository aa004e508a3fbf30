"""Hard posteriors the defaults were never tuned on (``benchmarks/hard_models.py``).

Every method at its defaults, as a user runs it (``pm.fit(method=...)``, seed 1, warnings
recorded), against a long NUTS reference computed by the suite and cached (nutpie, 4 × 5000
draws). Beside them the exact Gaussian-VI optimum (``benchmarks/gaussian_optimum.py``,
started from the reference's moments: a centred hierarchical model has no MAP), the verdict
each fit gave (``approx.outcome.verdict``), whether it warned, and the *silent* column: an
inaccurate fit (max |ε_μ| ≥ 0.1 or max |ε_σ| ≥ 10 %) that did not warn. For GPF, GF and
WVGD the PSIS-corrected draws (``approx.sample(psis=True)``) are scored too.
"""

from __future__ import annotations

import time
import warnings

from dataclasses import dataclass, field

import numpy as np

from benchmarks import anchors, common, gaussian_optimum, hard_models
from benchmarks.common import quick_full

NAME = "hard"
TITLE = "Hard posteriors: unscaled predictors, funnels, GPs, GARCH, ARMA, mixtures, random walks"

GOOD_MEAN, GOOD_SD = 0.1, 0.1
DRAWS = 10_000
OURS = {
    "GPF": ("gpf", {}),
    "GF": ("gf", {}),
    "WVGD": ("wvgd", {}),
    "Langevin ensemble": ("ensemble", {}),
    "Repulsive ensemble": ("ensemble", {"kind": "repulsive"}),
}
OPTIMUM = "exact Gaussian-VI optimum"


@dataclass(frozen=True)
class Settings(common.Settings):
    cases: tuple[str, ...] = quick_full(("unscaled_interaction",), tuple(hard_models.CASES))
    methods: tuple[str, ...] = quick_full(
        ("GPF", "GF"), (*OURS, "ADVI (PyMC)", "Pathfinder (pymc-extras)", "NUTS (PyMC)")
    )
    optimum_draws: int | None = quick_full(2**10, None)  # None: the case's own


@dataclass
class Row:
    label: str
    max_mean: float = np.nan
    max_sd: float = np.nan
    seconds: float = np.nan
    grads: float = np.nan
    steps: float = np.nan
    stop: str = ""
    verdict: str = ""
    warned: bool | None = None  # None: the method has no warnings to give
    check_seconds: float = np.nan
    khat: float = np.nan
    psis: tuple[float, float] = (np.nan, np.nan)
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def accurate(self) -> bool:
        return bool(self.max_mean < GOOD_MEAN and self.max_sd < GOOD_SD)

    @property
    def silent(self) -> bool:
        return not self.accurate and not self.warned


def _errors(ref: hard_models.Reference, case, values) -> tuple[float, float]:
    return ref.errors({k: values[k] for k in case.parameters}, case.parameters)


def fit_ours(case, ref, label: str) -> Row:
    import pymc as pm

    method, kwargs = OURS[label]
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            approx = pm.fit(
                method=method, model=case.build(), random_seed=1, progressbar=False,
                inf_kwargs=kwargs, backend=common.backend(),
            )  # fmt: skip
        except (FloatingPointError, ValueError) as err:
            return Row(label, note=f"{type(err).__name__}: {str(err)[:80]}", warned=True)
    seconds = time.perf_counter() - start
    import pymc_gpf

    warned = any(issubclass(w.category, pymc_gpf.FitWarning) for w in caught)
    outcome = approx.outcome
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if method == "ensemble":
            values = approx.sample(return_inferencedata=False)
            values = {k: v.reshape(-1, *v.shape[2:]) for k, v in values.items()}
        else:
            values = approx.sample(DRAWS, random_seed=2, return_inferencedata=False)
    max_mean, max_sd = _errors(ref, case, values)
    row = Row(
        label, max_mean, max_sd, seconds, approx.inference.gradient_evaluations,
        len(approx.hist), outcome.reason, outcome.verdict or "", warned,
        outcome.checks.get("seconds", np.nan), outcome.checks.get("pareto_k", np.nan),
    )  # fmt: skip
    if method != "ensemble":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            corrected = approx.sample(DRAWS, random_seed=3, psis=True, return_inferencedata=False)
        row.psis = _errors(ref, case, corrected)
        row.extra["psis_khat"] = approx.diagnosis.pareto_k
    return row


def fit_advi(case, ref) -> Row:
    import pymc as pm

    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        approx = pm.fit(model=case.build(), random_seed=1, progressbar=False)
    seconds = time.perf_counter() - start
    values = approx.sample(DRAWS, random_seed=2, return_inferencedata=False)
    max_mean, max_sd = _errors(ref, case, values)
    warned = any(issubclass(w.category, UserWarning) for w in caught)
    return Row("ADVI (PyMC)", max_mean, max_sd, seconds, 10_000, 10_000, "n steps", "", warned)


def fit_pathfinder(case, ref) -> Row:
    out = anchors.run_pathfinder(case.build(), random_seed=1)
    if not out.draws:
        return Row("Pathfinder (pymc-extras)", note=out.status[:80], warned=True)
    max_mean, max_sd = _errors(ref, case, out.draws)
    # it reports its PSIS k̂ with the result: a value of 0.7 or more is its warning
    khat = out.info.get("pareto_k")
    warned = khat is not None and np.isfinite(khat) and khat >= 0.7
    return Row(
        "Pathfinder (pymc-extras)", max_mean, max_sd, out.wall_time, out.grad_evals,
        stop=out.status[:40], warned=warned,
    )  # fmt: skip


def fit_nuts(case, ref) -> Row:
    """PyMC's ``pm.sample`` at its defaults on one core (2 chains × (1000 + 1000))."""
    import pymc as pm

    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with case.build():
            idata = pm.sample(
                chains=2, cores=1, random_seed=1, progressbar=False,
                discard_tuned_samples=False,
            )  # fmt: skip
    seconds = time.perf_counter() - start
    post = idata.posterior
    values = {k: post[k].values.reshape(-1, *post[k].shape[2:]) for k in case.parameters}
    max_mean, max_sd = _errors(ref, case, values)
    grads = float(idata.sample_stats["n_steps"].sum() + idata.warmup_sample_stats["n_steps"].sum())
    warned = any(issubclass(w.category, UserWarning) for w in caught) or bool(
        idata.sample_stats["diverging"].sum()
    )
    return Row("NUTS (PyMC)", max_mean, max_sd, seconds, grads, 2000, "", "", warned)


def optimum_row(case, ref, draws: int) -> Row:
    model = case.build()
    opt = gaussian_optimum.gaussian_optimum(
        model, draws=draws, check_draws=max(draws, 2**12),
        initial=hard_models.flat_moments(case.name),
    )  # fmt: skip
    values = gaussian_optimum.constrained_draws(model, opt, DRAWS, seed=1)
    max_mean, max_sd = _errors(ref, case, values)
    note = f"ELBO {opt.elbo:.3f} ± {opt.elbo_mcse:.3f}; seed-to-seed {opt.agreement:.1g}"
    return Row(OPTIMUM, max_mean, max_sd, opt.wall_time, opt.grad_evals, note=note)


def run(ctx) -> str:
    s = Settings.of(ctx.quick)
    tables = []
    summary: dict[str, list[Row]] = {}
    for name in s.cases:
        case = hard_models.CASES[name]
        ref = hard_models.reference(name)
        print(f"   {name}: Gaussian-VI optimum", flush=True)
        rows = [optimum_row(case, ref, s.optimum_draws or case.optimum_draws)]
        for label in s.methods:
            print(f"   {name}: {label}", flush=True)
            if label in OURS:
                rows.append(fit_ours(case, ref, label))
            elif label.startswith("ADVI"):
                rows.append(fit_advi(case, ref))
            elif label.startswith("Pathfinder"):
                rows.append(fit_pathfinder(case, ref))
            else:
                rows.append(fit_nuts(case, ref))
        for r in rows:
            summary.setdefault(r.label, []).append(r)
            ctx.record_many(
                name,
                r.label,
                [
                    ("max_abs_eps_mean", r.max_mean, "ref sd"),
                    ("max_abs_eps_sd", r.max_sd, "fraction"),
                    ("seconds", r.seconds, "s"),
                    ("grad_evals", r.grads, "gradients"),
                    ("silent", float(r.silent) if r.label != OPTIMUM else np.nan, ""),
                    ("psis_max_abs_eps_mean", r.psis[0], "ref sd"),
                    ("psis_max_abs_eps_sd", r.psis[1], "fraction"),
                    ("check_seconds", r.check_seconds, "s"),
                    ("pareto_khat", r.khat, ""),
                ],
                f"{r.stop} {r.verdict} {r.note}".strip(),
            )
        tables.append(_case_table(case, ref, rows))
    return "\n\n".join([_setup(), "### Summary", _summary(summary, s.cases), *tables])


def _setup() -> str:
    return (
        "Synthetic data from our own generators and seeds (`benchmarks/hard_models.py`). "
        "Reference: nutpie, 4 chains × (2000 tuning + 5000 draws), cached in "
        "`benchmarks/data/hard/`. Every method at its defaults, seed 1, wall time including "
        "compilation and (ours) the end-of-fit verdict, whose own time is *check (s)*. "
        "*Accurate*: max |ε_μ| < 0.1 and max |ε_σ| < 10 % over every scalar of the free "
        f"variables, from {DRAWS} draws on the constrained scale (the ensembles: their draws). "
        "*Warned*: ours, a `pymc_gpf.FitWarning`; others, any warning (NUTS: also "
        "divergences). *Silent*: inaccurate and not warned. *PSIS*: the errors of "
        "`approx.sample(psis=True)` draws."
    )


def _case_table(case, ref, rows: list[Row]) -> str:
    fmt = common.fmt
    body = []
    for r in rows:
        is_opt = r.label == OPTIMUM
        body.append(
            [
                r.label,
                fmt(r.max_mean, 2),
                f"{fmt(100 * r.max_sd, 2)} %" if np.isfinite(r.max_sd) else "—",
                "" if is_opt else ("yes" if r.accurate else "no"),
                r.verdict,
                "" if is_opt or r.warned is None else ("yes" if r.warned else "no"),
                "" if is_opt else ("**SILENT**" if r.silent else ""),
                fmt(r.psis[0], 2) if np.isfinite(r.psis[0]) else "",
                f"{fmt(100 * r.psis[1], 2)} %" if np.isfinite(r.psis[1]) else "",
                fmt(r.khat, 2) if np.isfinite(r.khat) else "",
                fmt(r.grads, 3),
                fmt(r.seconds, 3),
                fmt(r.check_seconds, 2) if np.isfinite(r.check_seconds) else "",
                r.stop,
                r.note,
            ]
        )
    info = ref.info
    caption = (
        f"### {case.name}\n\n{case.description}; {len(ref.labels)} scalars compared. "
        f"Reference: {info['sampler']}, {info['seconds']} s, smallest ESS "
        f"{info['min_ess']:.0f}, largest R-hat {info['max_rhat']}, "
        f"{info['divergences']} divergences."
    )
    headers = [
        "method", "max abs ε_μ", "max abs ε_σ", "accurate", "verdict", "warned", "silent",
        "PSIS ε_μ", "PSIS ε_σ", "k̂", "grad evals", "wall (s)", "check (s)", "stop", "note",
    ]  # fmt: skip
    return caption + "\n\n" + common.md_table(headers, body)


def _summary(summary: dict[str, list[Row]], cases) -> str:
    optimum = summary.get(OPTIMUM, [])
    reachable = [i for i, r in enumerate(optimum) if r.accurate]
    body = []
    for label, rows in summary.items():
        if label == OPTIMUM:
            continue
        trusted = [r for r in rows if r.verdict == "trustworthy"]
        body.append(
            [
                label,
                f"{sum(r.accurate for r in rows)}/{len(rows)}",
                f"{sum(rows[i].accurate for i in reachable)}/{len(reachable)}",
                f"{sum(r.silent for r in rows)}",
                f"{sum(r.accurate for r in trusted)}/{len(trusted)}" if trusted else "—",
                common.fmt(float(np.nanmedian([r.seconds for r in rows])), 3),
            ]
        )
    headers = [
        "method", "accurate", "accurate where the Gaussian optimum is", "silent failures",
        "accurate when trustworthy", "median wall (s)",
    ]  # fmt: skip
    return common.md_table(headers, body) + (
        f"\n\n{len(cases)} posteriors; the exact Gaussian-VI optimum is accurate on "
        f"{len(reachable)}."
    )
