"""Large models (issue 29): a hierarchical normal with J = 10^2 to 10^4 groups (D = J + 2),
every method at its defaults, against a long NUTS run of the centred model (the same
posterior); and a model without group effects above D = 1000 (a Gaussian with a
diagonal-plus-low-rank covariance, exact answer known). Wall time and peak memory of each
cell in a fresh process."""

from __future__ import annotations

import logging
import tempfile
import time
import warnings

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


def columns(posterior) -> np.ndarray:
    """``(draws, 2 + J)``: mu, tau and every theta_j of a posterior group."""
    flat = [posterior[k].values.reshape(-1, *posterior[k].shape[2:]) for k in PARAMETERS]
    return np.column_stack([f.reshape(len(f), -1) for f in flat])


def large_child(payload: dict) -> dict:
    """One cell: ``payload["method"]`` on J groups (or the reference, saved to a file)."""
    from benchmarks.speed import memory_mb

    warnings.simplefilter("ignore")
    logging.getLogger("pymc").setLevel(logging.ERROR)
    groups, method = payload["groups"], payload["method"]
    if method == "reference":
        draws, chains = payload["reference_draws"], payload["reference_chains"]
        centred = cases.hierarchical_normal(groups, centred=True)
        idata = pm.sample(draws, tune=1000, chains=chains, cores=1, random_seed=7,
                          progressbar=False, model=centred)  # fmt: skip
        values = columns(idata.posterior)
        np.savez(payload["path"], mean=values.mean(0), sd=values.std(0, ddof=1))
        return {}
    model = cases.hierarchical_normal(groups)
    start, out = time.perf_counter(), {}
    if method == "gf_steps":  # the step alone, on a second fit without the verdict
        harness.fit_defaults("gf", model, check_draws=0)
        again = time.perf_counter()
        refit = harness.fit_defaults("gf", model, seed=2, check_draws=0)
        return {"ms_per_step": 1e3 * (time.perf_counter() - again) / refit.steps}
    if method == "nuts":
        run = harness.nuts(model, draws=payload["nuts_draws"], tune=payload["nuts_draws"])
        values, out["warned"], out["seconds"] = run.values, run.warned, run.seconds
        values = np.column_stack([values[k].reshape(len(values[k]), -1) for k in PARAMETERS])
        out["ends"] = f"{run.divergences} divergences"
    else:
        kind = "gf" if method == "gf_full" else method
        kwargs = {"inf_kwargs": {"structure": "full"}} if method == "gf_full" else {}
        fit = harness.fit_defaults(kind, model, **kwargs)
        values = columns(fit.approx.sample(2000, random_seed=2).posterior)
        out |= {"warned": fit.warned, "ends": f"{fit.stop}; {fit.verdict}".strip("; "),
                "steps": fit.steps, "seconds": time.perf_counter() - start}  # fmt: skip
        if method == "gf":  # ms per step of a second, warm fit without the verdict
            again = time.perf_counter()
            refit = harness.fit_defaults("gf", model, seed=2, check_draws=0)
            out["ms_per_step"] = 1e3 * (time.perf_counter() - again) / refit.steps
    out.setdefault("seconds", time.perf_counter() - start)
    reference = np.load(payload["path"])
    eps_mu, eps_sd = harness.max_errors(values, reference["mean"], reference["sd"])
    return out | {"eps_mu": eps_mu, "eps_sd": eps_sd, "peak_mb": memory_mb()["VmHWM"]}


LOW_RANK_LABELS = {"gf": "GF (defaults)", "gpf": "GPF (defaults)",
                   "advi": "ADVI (PyMC, 10 000 steps)", "pathfinder": "Pathfinder (pymc-extras)",
                   "nutpie": "nutpie (2 chains, one core)"}  # fmt: skip


def low_rank_child(payload: dict) -> dict:
    """One cell of the low-rank section: ``payload["method"]`` on the Gaussian of
    :func:`benchmarks.cases.low_rank_gaussian`, errors of ``draws`` draws against the exact
    answer."""
    from benchmarks.speed import memory_mb

    warnings.simplefilter("ignore")
    logging.getLogger("pymc").setLevel(logging.ERROR)
    model, mean, sd = cases.low_rank_gaussian(payload["ndim"])
    method, draws, start, out = payload["method"], payload["draws"], time.perf_counter(), {}
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
        values = fit.approx.sample(draws, random_seed=2, return_inferencedata=False)["x"]
        out |= {"warned": fit.warned, "steps": fit.steps, "grads": fit.grads,
                "ends": f"{fit.stop}; {fit.verdict}".strip("; ")}  # fmt: skip
        if method in ("gf", "gpf"):
            q = fit.approx.gaussian()  # q's own errors, without the draws' Monte Carlo error
            out["q_eps_mu"] = float(np.max(np.abs(q.mean - mean) / sd))
            out["q_eps_sd"] = float(np.max(np.abs(np.sqrt(q.marginal_variances()) / sd - 1)))
            out["structure"] = fit.approx.inference.structure.kind
    out.setdefault("seconds", time.perf_counter() - start)
    values = np.asarray(values).reshape(-1, len(mean))
    eps_mu, eps_sd = harness.max_errors(values, mean, sd)
    return out | {"eps_mu": eps_mu, "eps_sd": eps_sd, "peak_mb": memory_mb()["VmHWM"]}


def low_rank(ctx) -> str:
    ndim, draws = ctx.pick(1001, 1200), 4000
    rows = []
    # an untimed fit first: the compilation cache (C or numba, on disk) is then as warm for
    # the first method as for the others
    harness.run_child(dict(kind="low_rank", ndim=ndim, method="gf", draws=10))
    # quick (CI's smoke run): ours and Pathfinder; ADVI and nutpie take minutes each
    for method in ctx.pick(["gf", "gpf", "pathfinder"], list(LOW_RANK_LABELS)):
        base = dict(kind="low_rank", ndim=ndim, method=method, draws=draws, nuts_draws=1000)
        out = harness.run_child(base)
        label, case = LOW_RANK_LABELS[method], f"D = {ndim}"
        if "error" in out:
            ctx.record(case, method, "failure", 1.0, note=out["error"])
            rows.append([label, "failed", "", "", "", "", "", "", "", "", out["error"][:80]])
            continue
        ctx.record_many(case, method, [
            ("seconds", out["seconds"], "s"), ("peak_memory", out["peak_mb"], "MB"),
            ("max_abs_eps_mu", out["eps_mu"], "sd"), ("max_abs_eps_sd", out["eps_sd"], ""),
            ("warned", float(out["warned"]), "")], note=out["ends"])  # fmt: skip
        exact = "—"
        if "q_eps_mu" in out:
            exact = f"{fmt(out['q_eps_mu'], 2)} / {pct(out['q_eps_sd'])} ({out['structure']})"
        accurate = out["eps_mu"] < 0.1 and out["eps_sd"] < 0.1
        silent = not (accurate or out["warned"])
        rows.append([label, fmt(out["seconds"]), f"{out['peak_mb']:.0f}", fmt(out["eps_mu"], 2),
                     pct(out["eps_sd"]), "yes" if accurate else "no", exact,
                     fmt(out.get("grads", np.nan)), "yes" if out["warned"] else "no",
                     "**SILENT**" if silent else "", out["ends"]])  # fmt: skip
        print(f"  low-rank {method}: {out['seconds']:.1f} s", flush=True)
    table = md_table(["method", "seconds", "peak memory (MB)", "max ε_μ", "max ε_σ", "accurate",
                      "q's own ε_μ / ε_σ", "grad evals", "warned", "silent", "ends; verdict"],
                     rows)  # fmt: skip
    return ctx.text("low_rank", ndim=ndim, draws=draws, table=table) + "\n"


def large(ctx) -> str:
    sizes = ctx.pick([100], [100, 1000, 10_000])
    settings = {"reference_draws": ctx.pick(1000, 2000), "reference_chains": ctx.pick(2, 4),
                "nuts_draws": ctx.pick(500, 1000)}  # fmt: skip
    methods = ctx.pick(["nuts", "gf", "advi"], list(LABELS))  # NUTS first: the ratios
    rows, per_step = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for groups in sizes:
            case, path = f"J = {groups}", str(Path(tmp) / f"reference_{groups}.npz")
            base = dict(settings, kind="large", groups=groups, path=path)
            ref = harness.run_child(dict(base, method="reference"))
            if "error" in ref:
                rows.append(["reference", f"{groups}", "failed", "", "", "", ref["error"][:80]])
                continue
            nuts_seconds = np.nan
            for method in methods:
                if groups > UP_TO[method]:
                    continue
                out = harness.run_child(dict(base, method=method))
                if "error" in out:
                    ctx.record(case, method, "failure", 1.0, note=out["error"])
                    rows.append([LABELS[method], f"{groups}", "failed", "", "", "",
                                 out["error"][:80]])  # fmt: skip
                    continue
                ctx.record_many(case, method, [
                    ("seconds", out["seconds"], "s"), ("peak_memory", out["peak_mb"], "MB"),
                    ("max_abs_eps_mu", out["eps_mu"], "sd"), ("max_abs_eps_sd", out["eps_sd"], ""),
                    ("warned", float(out["warned"]), "")], note=out["ends"])  # fmt: skip
                if method == "nuts":
                    nuts_seconds = out["seconds"]
                if "ms_per_step" in out:
                    per_step[groups + 2] = ctx.record(case, method, "ms_per_step",
                                                      out["ms_per_step"], "ms")  # fmt: skip
                ratio = out["seconds"] / nuts_seconds if method != "nuts" else np.nan
                rows.append([LABELS[method], f"{groups}", fmt(out["seconds"]), fmt(ratio, 2),
                             f"{out['peak_mb']:.0f}", fmt(out["eps_mu"], 2), pct(out["eps_sd"]),
                             out["ends"] + ("" if out["warned"] else "; silent")])  # fmt: skip
                print(f"  J = {groups} {method}: {out['seconds']:.1f} s", flush=True)
    for groups in ctx.pick([], [100_000]):  # GF's step only: NUTS would take hours
        out = harness.run_child(dict(kind="large", groups=groups, method="gf_steps"))
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


SECTIONS = {
    "large": ("Large models: a hierarchical normal with up to 10 000 groups", large),
    "low_rank": ("Large models without group effects: a Gaussian of the low-rank family", low_rank),
}
