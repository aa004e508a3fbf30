"""Large models: a hierarchical normal with J = 10^2 to 10^4 groups (D = J + 2) against a long
NUTS run of the centred model, a Gaussian of the diagonal-plus-low-rank family above
D = 1000 (exact answer known), and logistic regressions on 10^4 to 10^6 rows (big data);
every method at its defaults, each cell in a fresh process."""

from __future__ import annotations

import tempfile
import time

from pathlib import Path

import numpy as np
import pymc as pm

from benchmarks import anchors, cases, harness
from benchmarks.harness import fmt, md_table, pct

PARAMETERS = ("mu", "tau", "theta")
LABELS = {"nuts": "NUTS (PyMC, 2 chains, one core)", "gf": "GF (defaults)",
          "gf_full": "GF full rank (the Gaussian optimum)", "gpf": "GPF (defaults)",
          "advi": "ADVI", "fullrank_advi": "FullRankADVI"}  # fmt: skip
# the largest J each method runs on (README.md says why)
UP_TO = {"gf": 10**4, "gf_full": 10**2, "gpf": 10**4, "nuts": 10**4, "advi": 10**4,
         "fullrank_advi": 10**3}  # fmt: skip
LOW_RANK_LABELS = {"gf": "GF (defaults)", "gpf": "GPF (defaults)",
                   "advi": "ADVI (PyMC, 10 000 steps)", "pathfinder": "Pathfinder (pymc-extras)",
                   "nutpie": "nutpie (2 chains, one core)"}  # fmt: skip


def columns(posterior) -> np.ndarray:
    """``(draws, 2 + J)``: mu, tau and every theta_j of a posterior group."""
    flat = [posterior[k].values.reshape(-1, *posterior[k].shape[2:]) for k in PARAMETERS]
    return np.column_stack([f.reshape(len(f), -1) for f in flat])


def refit_ms_per_step(model) -> float:
    """GF's ms per step on a further fit of ``model`` (warm: compiled), without the verdict."""
    start = time.perf_counter()
    refit = harness.fit_defaults("gf", model, seed=2, check_draws=0)
    return 1e3 * (time.perf_counter() - start) / refit.steps


def reference_cell(payload: dict) -> dict:
    """NUTS on the centred model of J groups: the means and sds of mu, tau, theta, saved."""
    centred = cases.hierarchical_normal(payload["groups"], centred=True)
    idata = pm.sample(payload["reference_draws"], tune=1000, chains=payload["reference_chains"],
                      cores=1, random_seed=7, progressbar=False, model=centred)  # fmt: skip
    values = columns(idata.posterior)
    np.savez(payload["path"], mean=values.mean(0), sd=values.std(0, ddof=1))
    return {}


def gf_step_cell(payload: dict) -> dict:
    """GF's step alone on J groups: a first fit without the verdict, then a timed one."""
    model = cases.hierarchical_normal(payload["groups"])
    harness.fit_defaults("gf", model, check_draws=0)
    return {"ms_per_step": refit_ms_per_step(model)}


def large_cell(payload: dict) -> dict:
    """``payload["method"]`` at its defaults on J groups against the saved reference."""
    model, method = cases.hierarchical_normal(payload["groups"]), payload["method"]
    start, out = time.perf_counter(), {}
    if method == "nuts":
        run = harness.nuts(model, draws=payload["nuts_draws"], tune=payload["nuts_draws"])
        values, out["warned"], out["seconds"] = run.values, run.warned, run.seconds
        values = np.column_stack([values[k].reshape(len(values[k]), -1) for k in PARAMETERS])
        out["ends"] = f"{run.divergences} divergences"
    else:
        kind = "gf" if method == "gf_full" else method
        kwargs = {"inf_kwargs": {"structure": "full"}} if method == "gf_full" else {}
        fit = harness.fit_defaults(kind, model, **kwargs)
        # to the fit done, as NUTS's (its draws and the DataTree after are not timed)
        out |= {"warned": fit.warned, "ends": f"{fit.stop}; {fit.verdict}".strip("; "),
                "steps": fit.steps, "seconds": time.perf_counter() - start}  # fmt: skip
        values = columns(fit.approx.sample(2000, random_seed=2).posterior)
        if method == "gf":
            out["ms_per_step"] = refit_ms_per_step(model)
    reference = np.load(payload["path"])
    return out | errors_and_memory(values, reference["mean"], reference["sd"])


def low_rank_cell(payload: dict) -> dict:
    """``payload["method"]`` at its defaults on :func:`benchmarks.cases.low_rank_gaussian`,
    errors of ``draws`` draws (ours also q's own errors) against the exact answer."""
    model, mean, sd = cases.low_rank_gaussian(payload["ndim"])
    method, start, out = payload["method"], time.perf_counter(), {}
    if method == "nutpie":
        import nutpie

        steps = payload["nuts_draws"]
        trace = nutpie.sample(nutpie.compile_pymc_model(model), draws=steps, tune=steps,
                              chains=2, cores=1, seed=1, progress_bar=False)  # fmt: skip
        values = trace.posterior["x"].values.reshape(-1, len(mean))
        divergences = int(trace.sample_stats["diverging"].sum())
        out |= {"warned": divergences > 0, "ends": f"{divergences} divergences"}
    elif method == "pathfinder":
        result = anchors.run_pathfinder(model, random_seed=1)
        if not result.draws:
            return {"error": result.status}
        values = result.draws["x"]
        out |= {"warned": result.warned, "ends": result.status[:40]}
    else:
        fit = harness.fit_defaults(method, model)
        out["seconds"] = time.perf_counter() - start
        values = fit.approx.sample(payload["draws"], random_seed=2, return_inferencedata=False)["x"]
        out |= {"warned": fit.warned, "steps": fit.steps, "grads": fit.grads,
                "ends": f"{fit.stop}; {fit.verdict}".strip("; ")}  # fmt: skip
        if method in ("gf", "gpf"):
            q = fit.approx.gaussian()  # q's own errors, without the draws' Monte Carlo error
            out["q_eps_mu"] = float(np.max(np.abs(q.mean - mean) / sd))
            out["q_eps_sd"] = float(np.max(np.abs(np.sqrt(q.marginal_variances()) / sd - 1)))
            out["structure"] = fit.approx.inference.structure.kind
    out.setdefault("seconds", time.perf_counter() - start)
    return out | errors_and_memory(np.asarray(values).reshape(-1, len(mean)), mean, sd)


def errors_and_memory(values, mean, sd) -> dict:
    """The largest errors of draws ``(S, P)`` and this process's peak resident memory."""
    eps_mu, eps_sd = harness.max_errors(values, mean, sd)
    return {"eps_mu": eps_mu, "eps_sd": eps_sd, "peak_mb": harness.memory_mb()["VmHWM"]}


def run_cell(ctx, cell, case: str, payload: dict) -> dict:
    """``cell`` in a fresh process; its time, memory, errors and warning recorded."""
    out, method = harness.run_child(cell, payload), payload["method"]
    if "error" in out:
        ctx.record(case, method, "failure", 1.0, note=out["error"])
        return out
    ctx.record_many(case, method, [
        ("seconds", out["seconds"], "s"), ("peak_memory", out["peak_mb"], "MB"),
        ("max_abs_eps_mu", out["eps_mu"], "sd"), ("max_abs_eps_sd", out["eps_sd"], ""),
        ("warned", float(out["warned"]), "")], note=out["ends"])  # fmt: skip
    print(f"  {case} {method}: {out['seconds']:.1f} s", flush=True)
    return out


def low_rank(ctx) -> str:
    ndim, draws = ctx.pick(1001, 1200), 4000
    rows, case = [], f"D = {ndim}"
    # an untimed fit first: the compilation cache (C or numba, on disk) is then as warm for
    # the first method as for the others
    harness.run_child(low_rank_cell, dict(ndim=ndim, method="gf", draws=10))
    # quick (CI's smoke run): ours and Pathfinder; ADVI and nutpie take minutes each
    for method in ctx.pick(["gf", "gpf", "pathfinder"], list(LOW_RANK_LABELS)):
        payload = dict(ndim=ndim, method=method, draws=draws, nuts_draws=1000)
        out, label = run_cell(ctx, low_rank_cell, case, payload), LOW_RANK_LABELS[method]
        if "error" in out:
            rows.append([label, "failed", "", "", "", "", "", "", "", "", out["error"][:80]])
            continue
        exact = "—"
        if "q_eps_mu" in out:
            exact = f"{fmt(out['q_eps_mu'], 2)} / {pct(out['q_eps_sd'])} ({out['structure']})"
        accurate = out["eps_mu"] < 0.1 and out["eps_sd"] < 0.1
        silent = not (accurate or out["warned"])
        rows.append([label, fmt(out["seconds"]), f"{out['peak_mb']:.0f}", fmt(out["eps_mu"], 2),
                     pct(out["eps_sd"]), "yes" if accurate else "no", exact,
                     fmt(out.get("grads", np.nan)), "yes" if out["warned"] else "no",
                     "**SILENT**" if silent else "", out["ends"]])  # fmt: skip
    table = md_table(["method", "seconds", "peak memory (MB)", "max ε_μ", "max ε_σ", "accurate",
                      "q's own ε_μ / ε_σ", "grad evals", "warned", "silent", "ends; verdict"],
                     rows)  # fmt: skip
    return ctx.text("low_rank", ndim=ndim, draws=draws, table=table) + "\n"


def large(ctx) -> str:
    settings = {"reference_draws": ctx.pick(1000, 2000), "reference_chains": ctx.pick(2, 4),
                "nuts_draws": ctx.pick(500, 1000)}  # fmt: skip
    methods = ctx.pick(["nuts", "gf", "advi"], list(LABELS))  # NUTS first: the ratios
    rows, per_step = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for groups in ctx.pick([100], [100, 1000, 10_000]):
            case, path = f"J = {groups}", str(Path(tmp) / f"reference_{groups}.npz")
            base = dict(settings, groups=groups, path=path)
            ref = harness.run_child(reference_cell, base)
            if "error" in ref:
                rows.append(["reference", f"{groups}", "failed", "", "", "", "",
                             ref["error"][:80]])  # fmt: skip
                continue
            nuts_seconds = np.nan
            for method in (m for m in methods if groups <= UP_TO[m]):
                out = run_cell(ctx, large_cell, case, dict(base, method=method))
                if "error" in out:
                    rows.append([LABELS[method], f"{groups}", "failed", "", "", "", "",
                                 out["error"][:80]])  # fmt: skip
                    continue
                if method == "nuts":
                    nuts_seconds = out["seconds"]
                if "ms_per_step" in out:
                    per_step[groups + 2] = ctx.record(case, method, "ms_per_step",
                                                      out["ms_per_step"], "ms")  # fmt: skip
                ratio = out["seconds"] / nuts_seconds if method != "nuts" else np.nan
                rows.append([LABELS[method], f"{groups}", fmt(out["seconds"]), fmt(ratio, 2),
                             f"{out['peak_mb']:.0f}", fmt(out["eps_mu"], 2), pct(out["eps_sd"]),
                             out["ends"] + ("" if out["warned"] else "; silent")])  # fmt: skip
    for groups in ctx.pick([], [100_000]):  # GF's step only: NUTS would take hours
        out = harness.run_child(gf_step_cell, dict(groups=groups))
        if "ms_per_step" in out:
            per_step[groups + 2] = ctx.record(f"J = {groups}", "gf", "ms_per_step",
                                              out["ms_per_step"], "ms")  # fmt: skip
    table = md_table(["method", "J", "seconds", "÷ NUTS", "peak memory (MB)", "max ε_μ",
                      "max ε_σ", "ends; verdict"], rows, left=2)  # fmt: skip
    exponent = "—"
    if len(per_step) > 1:
        dims, ms = np.array(list(per_step)), np.array(list(per_step.values()))
        exponent = f"{np.polyfit(np.log(dims), np.log(ms), 1)[0]:.2f}"
        ctx.record("GF step time", "gf", "exponent_in_D", float(exponent), "")
    steps = ", ".join(f"{fmt(v)} ms at D = {d}" for d, v in per_step.items())
    return ctx.text("large", table=table, steps=steps or "—", exponent=exponent) + "\n"


# ------------------------------------------------------------------------------ big data
BIG_LABELS = {"gpf": "GPF (defaults, full data)", "gf": "GF (defaults, full data)",
              "gf_minibatch": "GF (defaults, minibatches of 1000)",
              "advi_minibatch": "ADVI (PyMC, minibatches of 1000, 10 000 steps)",
              "nutpie": "nutpie (2 chains, one core)"}  # fmt: skip
BIG_UP_TO = {"nutpie": 10**5}  # nutpie on 10^6 rows: about 20 minutes


def big_logistic(rows: int, minibatch: bool = False, reference: bool = False, dim: int = 20,
                 seed: int = 31):  # fmt: skip
    """A logistic regression on ``rows`` rows and ``dim`` standardised predictors (and an
    intercept; true weights N(0, 0.5^2)), N(0, 2^2) priors; with ``pm.Minibatch`` batches
    of 1000 rows if ``minibatch``. Returns the model and, if ``reference``, the posterior
    means and sds: the Laplace approximation at the MAP (exact Hessian) corrected by Pareto-smoothed
    importance sampling (:func:`pymc_gpf.diagnostics.smoothed_log_weights`), since its own
    error is of order D / sqrt(rows) sds (0.13 at 10^4 rows)."""
    from scipy import optimize, special

    from pymc_gpf.diagnostics import smoothed_log_weights

    rng = np.random.default_rng(seed)
    x = np.column_stack([np.ones(rows), rng.normal(size=(rows, dim))])
    y = (rng.random(rows) < special.expit(x @ rng.normal(0.0, 0.5, dim + 1))).astype(float)
    with pm.Model() as model:
        xb, yb = pm.Minibatch(x, y, batch_size=1000) if minibatch else (x, y)
        w = pm.Normal("w", 0.0, 2.0, shape=dim + 1)
        pm.Bernoulli("y", logit_p=xb @ w, observed=yb, total_size=rows if minibatch else None)
    if not reference:
        return model, None, None

    def log_posterior(w):  # at the rows of w (K, D): log p (K,), and the logits (rows, K)
        logit = x @ w.T
        value = -np.sum(np.logaddexp(0.0, logit) - y[:, None] * logit, axis=0)
        return value - np.sum(w**2, axis=1) / 8.0, logit

    def negative(w):  # -log p and its gradient at one point, for the MAP
        value, logit = log_posterior(w[None])
        return -value[0], x.T @ (special.expit(logit[:, 0]) - y) + w / 4.0

    mode = optimize.minimize(negative, np.zeros(dim + 1), jac=True).x
    p = special.expit(x @ mode)
    chol = np.linalg.cholesky(np.linalg.inv((x.T * (p * (1 - p))) @ x + np.eye(dim + 1) / 4.0))
    z = np.random.default_rng(seed + 1).normal(size=(min(20_000, 4 * 10**9 // rows), dim + 1))
    draws = mode + z @ chol.T
    # 50 draws at a time: (rows, 50) logits, 0.4 GB at 10^6 rows
    log_p = np.concatenate(
        [log_posterior(w)[0] for w in np.array_split(draws, max(1, len(draws) // 50))]
    )
    log_w, _ = smoothed_log_weights(log_p, -0.5 * np.sum(z**2, axis=1))
    weights = np.exp(log_w - log_w.max())
    weights /= weights.sum()
    mean = weights @ draws
    return model, mean, np.sqrt(weights @ (draws - mean) ** 2)


def big_reference_cell(payload: dict) -> dict:
    """:func:`big_logistic`'s reference on ``payload["rows"]`` rows, saved."""
    _, mean, sd = big_logistic(payload["rows"], reference=True)
    np.savez(payload["path"], mean=mean, sd=sd)
    return {}


def big_cell(payload: dict) -> dict:
    """``payload["method"]`` at its defaults on :func:`big_logistic`: wall time from the model
    built to the fit done, errors of 4000 draws against :func:`big_reference_cell`'s."""
    method = payload["method"]
    model, _, _ = big_logistic(payload["rows"], minibatch=method.endswith("minibatch"))
    reference = np.load(payload["path"])
    mean, sd = reference["mean"], reference["sd"]
    start, out = time.perf_counter(), {}
    if method == "nutpie":
        import nutpie

        trace = nutpie.sample(nutpie.compile_pymc_model(model), draws=1000, tune=1000,
                              chains=2, cores=1, seed=1, progress_bar=False)  # fmt: skip
        out["seconds"] = time.perf_counter() - start
        values = trace.posterior["w"].values.reshape(-1, len(mean))
        divergences = int(trace.sample_stats["diverging"].sum())
        out |= {"warned": divergences > 0, "ends": f"{divergences} divergences"}
    else:
        kind = method.removesuffix("_minibatch")
        fit = harness.fit_defaults(kind, model, backend=None if kind == "advi" else harness.BACKEND)
        out["seconds"] = time.perf_counter() - start
        values = fit.approx.sample(4000, random_seed=2, return_inferencedata=False)["w"]
        out |= {"warned": fit.warned and kind != "advi", "steps": fit.steps, "grads": fit.grads,
                "ends": f"{fit.stop}; {fit.verdict}".strip("; ")}  # fmt: skip
    return out | errors_and_memory(np.asarray(values).reshape(-1, len(mean)), mean, sd)


def big_data_rows(ctx, n: int, path: str) -> list[list]:
    """The table's rows for ``n`` rows, its reference saved at ``path`` first."""
    out, rows = harness.run_child(big_reference_cell, dict(rows=n, path=path)), []
    if "error" in out:
        return [["reference", f"{n:.0e}", "failed", "", "", "", "", "", out["error"][:80]]]
    methods = ctx.pick(["gpf", "gf_minibatch"], list(BIG_LABELS))
    for method in (m for m in methods if n <= BIG_UP_TO.get(m, n)):
        out = run_cell(ctx, big_cell, f"n = {n}", dict(rows=n, method=method, path=path))
        label = BIG_LABELS[method]
        if "error" in out:
            rows.append([label, f"{n:.0e}", "failed", "", "", "", "", "", out["error"][:80]])
            continue
        accurate = out["eps_mu"] < 0.1 and out["eps_sd"] < 0.1
        rows.append([label, f"{n:.0e}", fmt(out["seconds"]), f"{out['peak_mb']:.0f}",
                     fmt(out["eps_mu"], 2), pct(out["eps_sd"]), fmt(out.get("grads", np.nan)),
                     "yes" if accurate else "no", out["ends"]
                     + ("" if accurate or out["warned"] else "; **SILENT**")])  # fmt: skip
    return rows


def big_data(ctx) -> str:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in ctx.pick([10**4], [10**4, 10**5, 10**6]):
            rows += big_data_rows(ctx, n, str(Path(tmp) / f"reference_{n}.npz"))
    table = md_table(["method", "rows", "seconds", "peak memory (MB)", "max ε_μ", "max ε_σ",
                      "grad evals", "accurate", "ends; verdict"], rows, left=2)  # fmt: skip
    return ctx.text("big_data", table=table) + "\n"


SECTIONS = {
    "large": ("Large models: a hierarchical normal with up to 10 000 groups", large),
    "big_data": ("Big data: logistic regressions on 10⁴ to 10⁶ rows", big_data),
    "low_rank": ("Large models without group effects: a Gaussian of the low-rank family", low_rank),
}
