"""Time to the first step: each method in a fresh process on an empty PyTensor cache (cold),
then again on the cache that run filled (warm).

A separate section from ``speed`` because cold numba compilation dominates its run time
(minutes per method), so ``--only speed`` can refresh the rest without it. The children are
:func:`benchmarks.exp_speed.child` runs.
"""

from __future__ import annotations

import tempfile

from dataclasses import dataclass

from benchmarks import common
from benchmarks.common import fmt, md_table
from benchmarks.exp_speed import BATCH, METHOD_LABELS, N_OBS, N_WEIGHTS, run_in_child

NAME = "startup"
TITLE = "Speed: time to the first step, cold and warm PyTensor cache"


@dataclass(frozen=True)
class Settings:
    methods: tuple[str, ...]  # with the run's backend
    c_methods: tuple[str, ...]  # also with backend="c" (when the run's backend is another)


def settings(quick: bool) -> Settings:
    if quick:
        return Settings(("bare",), ())
    return Settings(
        ("bare", "gpf", "gf", "wvgd", "advi_1", "fullrank_advi", "svgd"), ("bare", "gpf", "advi_1")
    )


def first_steps(method: str, backend: str | None) -> tuple[dict, dict]:
    """Cold then warm child runs sharing one fresh ``base_compiledir``."""
    payload = {"model": {"kind": "logistic"}, "method": method, "n": BATCH, "backend": backend}
    with tempfile.TemporaryDirectory(prefix="pytensor-cold-") as compiledir:
        cold = run_in_child(payload, compiledir)
        warm = run_in_child(payload, compiledir)
    return cold, warm


def run(ctx) -> str:
    s = settings(ctx.quick)
    runs = [(m, ctx.backend) for m in s.methods]
    if ctx.backend != "c":
        runs += [(m, "c") for m in s.c_methods]
    rows, results = [], {}
    for method, backend in runs:
        cold, warm = first_steps(method, backend)
        name = common.backend_name(backend)
        case = f"logistic n={N_OBS}, D={N_WEIGHTS}; {name}"
        if "error" in cold or "error" in warm:
            ctx.record(case, method, "failure", 1.0, note=cold.get("error") or warm.get("error"))
            rows.append([METHOD_LABELS[method], name, "failed", "failed", "", ""])
            continue
        values = {
            "first_step_cold_seconds": cold["first_step_seconds"],
            "first_step_warm_seconds": warm["first_step_seconds"],
            "import_seconds": warm["import_seconds"],
        }
        for metric, value in values.items():
            ctx.record(case, method, metric, value, "s", "fresh process")
        results[method, backend] = values
        rows.append(
            [
                METHOD_LABELS[method],
                name,
                fmt(values["first_step_cold_seconds"]),
                fmt(values["first_step_warm_seconds"]),
                fmt(values["first_step_cold_seconds"] / values["first_step_warm_seconds"]),
                fmt(values["import_seconds"]),
            ]
        )
        print(f"  {method} ({name}): {values['first_step_cold_seconds']:.0f} s cold", flush=True)
    table = md_table(
        [
            "method",
            "backend",
            "first step, cold cache (s)",
            "first step, warm cache (s)",
            "cold / warm",
            "import pymc + pymc_gpf (s)",
        ],
        rows,
        left=2,
    )
    setup = (
        "Wall time from constructing the inference to the end of its first step (`fit(1)`: "
        "graph building, compilation, one step) on the logistic regression of the speed "
        f"section (n = {N_OBS}, D = {N_WEIGHTS}, N = {BATCH} points per step, as there), in a "
        "fresh process whose PyTensor `base_compiledir` (PyTensor's C modules and compiled "
        "numba functions) is an empty folder (cold), then in a second fresh process reusing "
        "that folder (warm). Numba's own cache of its library functions is left as it is "
        "(warm, as on any machine that has run numba before). One run per cell; the import "
        "of pymc and pymc_gpf is timed apart."
    )
    return "\n\n".join([setup, table, "**What the numbers say.** " + findings(ctx, results)])


def span(values: list[float]) -> str:
    low, high = fmt(min(values)), fmt(max(values))
    return low if low == high else f"{low}–{high}"


def findings(ctx, results: dict) -> str:
    backend = ctx.backend
    name = common.backend_name(backend)
    ours = {m: v for (m, b), v in results.items() if b == backend}
    if not ours:
        return "No run succeeded."
    cold = {m: v["first_step_cold_seconds"] for m, v in ours.items()}
    warm = {m: v["first_step_warm_seconds"] for m, v in ours.items()}
    text = (
        f"With {name}, the first step on a cold cache takes "
        + ", ".join(f"{fmt(v)} s ({METHOD_LABELS[m]})" for m, v in cold.items())
        + f"; on a warm cache {span(list(warm.values()))} s."
    )
    c_runs = {m: v for (m, b), v in results.items() if b == "c"}
    both = [m for m in c_runs if m in ours and backend != "c"]
    if both:
        text += (
            ' With backend="c" the cold first step takes '
            + ", ".join(
                f"{fmt(c_runs[m]['first_step_cold_seconds'])} s ({METHOD_LABELS[m]}, "
                f"{fmt(ours[m]['first_step_cold_seconds'] / c_runs[m]['first_step_cold_seconds'])}"
                f"× faster)"
                for m in both
            )
            + "."
        )
    return text
