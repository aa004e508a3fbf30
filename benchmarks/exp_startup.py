"""Time to the first step and to a result, on a cold and on a warm PyTensor cache.

Each cell is a fresh process (``python -m benchmarks.exp_startup child JSON``) whose
PyTensor ``base_compiledir`` (its C modules and its numba cache) is an empty folder (cold),
then a second fresh process reusing that folder (warm). Every method runs at its defaults
(ours: ``pm.fit(method=...)``, stopping by itself; PyMC's ADVI and SVGD: ``pm.fit`` with its
10 000 steps; pymc-extras' DADVI and Pathfinder: ``fit_dadvi`` / ``fit_pathfinder``), then
1 000 draws. A separate section from ``speed`` because cold compilation dominates its run
time.
"""

from __future__ import annotations

import json
import logging
import sys
import tempfile
import time

from dataclasses import dataclass

from benchmarks import common
from benchmarks.common import fmt, md_table, quick_full

NAME = "startup"
TITLE = "Speed: time to the first step and to a result, cold and warm PyTensor cache"

LABELS = {
    "bare": "bare batched logp+grad",
    "gpf": "GPF",
    "gf": "GF",
    "wvgd": "WVGD",
    "advi": "PyMC ADVI",
    "svgd": "PyMC SVGD",
    "dadvi": "pymc-extras DADVI",
    "pathfinder": "pymc-extras Pathfinder",
}
MODELS = {
    "logistic": "logistic regression (n = 2000, D = 50; the speed section's)",
    "german_credit": "German credit (the quickstart's; D = 25)",
    "eight_schools": "eight schools, non-centred (D = 10)",
}
OURS = ("gpf", "gf", "wvgd")
SIMILAR = {"logistic": "german_credit"}  # a new model on a cache another one filled


# every method at its default backend; ours with PyMC's default named; the bare gradient and
# ADVI in C
ALL_CELLS = (
    *((m, None) for m in LABELS),
    *(("gpf", "numba"), ("gf", "numba"), ("wvgd", "numba"), ("bare", "c"), ("advi", "c")),
)


@dataclass(frozen=True)
class Settings(common.Settings):
    models: tuple[str, ...] = quick_full(("eight_schools",), tuple(MODELS))
    # (method, backend); None: its default
    cells: tuple[tuple[str, str | None], ...] = quick_full(
        (("bare", None), ("gpf", None)), ALL_CELLS
    )


# ------------------------------------------------------------------- the child process
def build_model(name: str):
    from benchmarks import exp_speed, realdata

    if name == "logistic":
        return exp_speed.build_model({"kind": "logistic"})
    if name == "german_credit":
        return realdata.german_credit_reference_model()
    return realdata.posteriordb_case("eight_schools-eight_schools_noncentered").model


def _fit(method: str, model, backend: str | None) -> tuple[float, str]:
    """Run ``method`` at its defaults; the seconds to the end of its first step (NaN where
    the method has no step to time) and a short note."""
    import numpy as np
    import pymc as pm

    import pymc_gpf

    from benchmarks import anchors

    start = time.perf_counter()
    if method == "bare":
        target = pymc_gpf.BatchedTarget(model)
        target.compile_logp_dlogp(backend=backend)(np.zeros((20, target.ndim)))
        return time.perf_counter() - start, ""
    if method in ("dadvi", "pathfinder"):
        result = (anchors.run_dadvi if method == "dadvi" else anchors.run_pathfinder)(model, 1)
        return float("nan"), result.status
    first = []

    def first_step(approx, hist, i):
        if not first:
            first.append(time.perf_counter() - start)

    kwargs = {} if backend is None else {"backend": backend}
    approx = pm.fit(
        method=method,
        model=model,
        random_seed=1,
        progressbar=False,
        callbacks=[first_step],
        **kwargs,
    )
    approx.sample(1000, random_seed=2)
    if method not in OURS:
        return first[0], "10 000 steps (pm.fit's default)"
    compiled = approx.inference.fit_options.compile_backend or "numba"
    return first[0], f"{len(approx.hist)} steps, {approx.outcome.reason}; {compiled}"


def child(payload: dict) -> dict:
    start = time.perf_counter()
    import pymc  # noqa: F401

    import pymc_gpf  # noqa: F401

    logging.getLogger("pymc").setLevel(logging.ERROR)
    imported = time.perf_counter() - start
    model = build_model(payload["model"])
    start = time.perf_counter()
    first, note = _fit(payload["method"], model, payload["backend"])
    result = time.perf_counter() - start
    return {"import": imported, "first_step": first, "result": result, "note": note}


def run_cell(payload: dict) -> tuple[dict, dict, dict]:
    """Cold then warm child runs sharing one fresh ``base_compiledir``, then the first run
    of another model (``SIMILAR``) on the cache they filled."""
    with tempfile.TemporaryDirectory(prefix="pytensor-cold-") as compiledir:
        env = common.single_thread_env({"PYTENSOR_FLAGS": f"base_compiledir={compiledir}"})
        cold = common.run_child("benchmarks.exp_startup", payload, env)
        warm = common.run_child("benchmarks.exp_startup", payload, env)
        similar = {}
        if payload["model"] in SIMILAR:
            other = dict(payload, model=SIMILAR[payload["model"]])
            similar = common.run_child("benchmarks.exp_startup", other, env)
    return cold, warm, similar


# ----------------------------------------------------------------------------- section
def run(ctx) -> str:
    s = Settings.of(ctx.quick)
    tables = []
    for model in s.models:
        rows = []
        for method, backend in s.cells:
            payload = {"model": model, "method": method, "backend": backend}
            cold, warm, similar = run_cell(payload)
            name = backend or "default"
            if "error" in cold or "error" in warm:
                note = cold.get("error") or warm.get("error")
                ctx.record(model, method, "failure", 1.0, note=note)
                rows.append([LABELS[method], name, "failed", "", "", "", "", note[:60]])
                continue
            for run_name, out in (("cold", cold), ("warm", warm)):
                for key in ("first_step", "result"):
                    metric = f"{key}_{run_name}_seconds"
                    ctx.record(f"{model}; {name}", method, metric, out[key], "s", out["note"])
            rows.append(
                [
                    LABELS[method],
                    name,
                    fmt(cold["first_step"]),
                    fmt(cold["result"]),
                    fmt(warm["first_step"]),
                    fmt(warm["result"]),
                    fmt(similar["result"]) if "result" in similar else "",
                    cold["note"],
                ]
            )
            print(f"  {model} {method} ({name}): {cold['result']:.0f} s cold", flush=True)
        table = md_table(
            [
                "method",
                "backend",
                "first step, cold (s)",
                "result, cold (s)",
                "first step, warm (s)",
                "result, warm (s)",
                "result, German credit next (s)" if model in SIMILAR else "",
                "fit",
            ],
            rows,
            left=2,
        )
        tables.append(f"**{MODELS[model]}**\n\n{table}")
    caption = (
        "Seconds from the start of the fit (model built, packages imported) to the end of its "
        "first step, and to a result (fit done and 1 000 draws), in a fresh process on an "
        "empty PyTensor cache (cold) and again on the cache that run filled (warm); one run "
        "per cell, on the machine named above. Methods at their defaults (backend "
        '"default": none named; ours then compile an automatic full-data fit with '
        "`quick_c`, PyTensor's C backend with the nodes NumPy runs as fast left to NumPy, and "
        "anything else with PyMC's default, numba; the fit column says which); the bare "
        "batched "
        "log-density and gradient of 20 points is one call. DADVI and Pathfinder have no "
        "step to time. On the logistic regression, a third process then fits the German "
        "credit model on the cache the first two filled: the first run of a new, similar "
        "model."
    )
    return "\n\n".join([caption, *tables])


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "child":
        print(json.dumps(child(json.loads(sys.argv[2]))))
    else:
        sys.exit("usage: python -m benchmarks.exp_startup child JSON (run by the suite)")
