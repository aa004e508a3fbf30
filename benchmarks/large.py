"""Large models: a hierarchical normal with J = 10^2 to 10^4 groups (D = J + 2) against a long
NUTS run of the centred model, and a Gaussian of the diagonal-plus-low-rank family above
D = 1000 (exact answer known); every method at its defaults, each cell in a fresh process."""

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


SECTIONS = {
    "large": ("Large models: a hierarchical normal with up to 10 000 groups", large),
    "low_rank": ("Large models without group effects: a Gaussian of the low-rank family", low_rank),
}
