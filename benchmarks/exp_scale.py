"""Scale: GPF's step on PyTensor's JAX backend with the particles split across devices.

Time per step and per bare batched log-density-and-gradient call against the number of
particles N and the dimension D, on 1 device and on 4 (on a CPU, XLA's host devices:
``XLA_FLAGS=--xla_force_host_platform_device_count=4``), the memory the live arrays hold on
the busiest device, and where XLA puts the step's collectives. Every configuration runs in a
fresh process (the number of host devices is fixed when JAX starts).

``python -m benchmarks run --only scale --device gpu`` runs the same measurements on a GPU
(``JAX_PLATFORMS=gpu``, as many devices as asked for); the report names the device.
"""

from __future__ import annotations

import json
import re
import sys
import time

from dataclasses import dataclass

import numpy as np

from benchmarks import common, exp_speed, realdata
from benchmarks.common import fmt, md_table, quick_full

NAME = "scale"
TITLE = "Scale: JAX, particles split across devices"

N_DIM = 100  # D of the N sweep: a logistic regression ...
N_ROWS = 1000  # ... on this many observations, so a gradient costs O(n D) per particle
D_PARTICLES = 12  # N of the D sweep (a diagonal Gaussian: a gradient costs O(D)): 3 a device


@dataclass(frozen=True)
class Settings(common.Settings):
    particles: tuple[int, ...] = quick_full((10, 100), (10, 100, 1000, 10_000))
    dims: tuple[int, ...] = quick_full((1000,), (100, 10_000, 1_000_000))
    devices: tuple[int, ...] = (1, 4)
    seconds: float = quick_full(0.3, 1.0)
    repeats: int = quick_full(2, 3)


def _model(spec: dict):
    if spec["kind"] == "logistic":
        rng = np.random.default_rng(0)
        x = rng.normal(size=(N_ROWS, spec["d"]))
        y = rng.random(N_ROWS) < 1 / (1 + np.exp(-x @ (0.3 * rng.normal(size=spec["d"]))))
        return realdata.logistic_model(x, y, 1.0, intercept=False, as_data=False)
    return exp_speed.diagonal_gaussian_model(spec["d"])


def _per_device_mb() -> float:
    """Megabytes the live JAX arrays hold on the busiest device."""
    import jax

    held: dict = {}
    for array in jax.live_arrays():
        for shard in array.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return max(held.values(), default=0) / 2**20


def _bare(model, n: int, devices: int):
    """The batched log-density and gradient, its input placed on the devices beforehand."""
    import jax

    import pymc_gpf

    from pymc_gpf.jaxlink import row_sharding

    target = pymc_gpf.BatchedTarget(model)
    target.row_sharding = sharding = row_sharding(devices)
    fn = target.compile_logp_dlogp(backend="jax")
    fn.trust_input = True  # a device array goes in as it is
    points = 0.1 * np.random.default_rng(1).normal(size=(n, target.ndim))
    if sharding is not None and n % devices:  # uneven: a copy on every device, split in XLA
        sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    points = jax.device_put(points, sharding)
    jax.block_until_ready(fn(points))

    def step(k: int) -> None:
        for _ in range(k):
            out = fn(points)
        jax.block_until_ready(out)

    return step


def _gpf(model, n: int, devices: int):
    """GPF's fixed-step update (every step asked for runs; the speed section's reason)."""
    import pymc_gpf

    d = pymc_gpf.BatchedTarget(model).ndim
    inference = pymc_gpf.GPF(n_particles=n, init_scale=exp_speed.gpf_jitter(n, d), model=model,
                             random_seed=1, devices=devices)  # fmt: skip
    inference.fit(1, progressbar=False, backend="jax", learning_rate=1e-3)

    def step(k: int) -> None:
        inference.refine(k, progressbar=False)  # reads the free energy: waits for the step

    return step, inference


def _collectives(inference) -> dict[str, int]:
    """How many of each collective XLA compiled into the step, and how many numbers their
    results hold in all (an all-gather's result counts whole)."""
    compiled = [c.cell_contents for c in inference.step.fn.__closure__ or ()]
    functions = next(v for v in compiled if isinstance(v, dict) and v)
    fn = next(iter(functions.values()))
    fn = getattr(fn, "_fn", fn)
    jit, inputs = None, None
    for cell in fn.vm.__closure__ or ():
        if callable(cell.cell_contents) and hasattr(cell.cell_contents, "inputs"):
            thunk = cell.cell_contents
            jit, inputs = thunk.__defaults__[0], [x[0] for x in thunk.inputs]
    text = jit.lower(*inputs).compile().as_text()
    out = {"collective_numbers": 0}
    for op in ("all-gather", "all-reduce", "all-to-all", "collective-permute"):
        lines = [line for line in text.splitlines() if f" {op}(" in line or f" {op}-start(" in line]
        out[op] = len(lines)
        for line in lines:
            result = line.split("=", 1)[1].split(op)[0]  # e.g. " (f64[40,200]{1,0}, f64[]) "
            for dims in re.findall(r"\w+\[([\d,]*)\]", result):
                out["collective_numbers"] += int(np.prod([int(n) for n in dims.split(",") if n]))
    return out


GAUSSIAN_DIM, GAUSSIAN_KAPPA = 20, 100.0  # the side-by-side target: N(mu, Sigma), cond. 100


def _side_by_side(payload: dict) -> dict:
    """Every method at its defaults on one closed-form Gaussian, in one process (4 host
    devices: the unsplit JAX fits use the first): seconds including compilation, and the
    largest errors of the means and sds in posterior sds."""
    import pymc as pm

    from benchmarks import anchors

    target = common.gaussian_target(common.condition_spectrum(GAUSSIAN_DIM, GAUSSIAN_KAPPA), 0)
    model = common.gaussian_model(target)
    sd = np.sqrt(np.diag(target.cov))
    ours = [("GPF", "gpf", {}, None), ("GPF", "gpf", {}, "jax"),
            ("GPF ×4 devices", "gpf", {"devices": 4}, "jax"), ("GF", "gf", {}, None),
            ("GF", "gf", {}, "jax"), ("GF ×4 devices", "gf", {"devices": 4}, "jax"),
            ("WVGD", "wvgd", {}, None), ("WVGD", "wvgd", {}, "jax"),
            ("Langevin ensemble", "ensemble", {}, None),
            ("Langevin ensemble", "ensemble", {}, "jax"),
            ("ADVI (PyMC)", "advi", {}, None), ("ADVI (PyMC)", "advi", {}, "jax")]  # fmt: skip
    rows = []
    for label, method, options, backend in ours:
        start = time.perf_counter()
        try:
            with model:
                approx = pm.fit(method=method, random_seed=1, progressbar=False,
                                inf_kwargs=options, backend=backend)  # fmt: skip
            draws = common.flat_draws(approx, 20_000, 0)
            outcome = getattr(approx, "outcome", None)
            status = (
                "ran 10000 steps"
                if outcome is None
                else f"{outcome.reason}, {len(approx.hist)} steps"
            )
        except Exception as err:  # PyMC's own JAX path is reported broken: say how
            message = f"{type(err).__name__}: {str(err).splitlines()[0][:90]}"
            rows.append({"label": label, "backend": backend, "error": message})
            continue
        seconds = time.perf_counter() - start
        rows.append({"label": label, "backend": backend or "default", "seconds": seconds,
                     "status": status, **_errors(draws, target.mean, sd)})  # fmt: skip
    start = time.perf_counter()
    dadvi = anchors.run_dadvi(model, random_seed=1)
    rows.append({"label": "DADVI (pymc-extras)", "backend": "default", "status": dadvi.status,
                 "seconds": time.perf_counter() - start,
                 **_errors(dadvi.draws["x"], target.mean, sd)})  # fmt: skip
    start = time.perf_counter()
    with model:
        trace = pm.sample(1000, tune=1000, chains=2, cores=1, random_seed=1, progressbar=False)
    draws = trace.posterior["x"].values.reshape(-1, GAUSSIAN_DIM)
    seconds = time.perf_counter() - start
    rows.append({"label": "NUTS (PyMC)", "backend": "default", "status": "2 x 1000 draws",
                 "seconds": seconds, **_errors(draws, target.mean, sd)})  # fmt: skip
    return {"rows": rows}


def _errors(draws: np.ndarray, mean: np.ndarray, sd: np.ndarray) -> dict[str, float]:
    draws = np.asarray(draws).reshape(-1, len(mean))
    return {
        "mean_error": float(np.max(np.abs(draws.mean(axis=0) - mean) / sd)),
        "sd_error": float(np.max(np.abs(draws.std(axis=0) / sd - 1))),
    }


def child(payload: dict) -> dict:
    """One configuration, in a process whose JAX sees ``payload["devices"]`` devices."""
    import logging
    import warnings

    import pymc_gpf  # noqa: F401

    logging.getLogger("pymc").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    import jax

    if payload.get("side_by_side"):
        return _side_by_side(payload)
    model = _model(payload["model"])
    start = time.perf_counter()
    if payload["method"] == "bare":
        step, inference = _bare(model, payload["n"], payload["devices"]), None
    else:
        step, inference = _gpf(model, payload["n"], payload["devices"])
    out = {"first_seconds": time.perf_counter() - start, "platform": jax.devices()[0].platform}
    out["ms_per_step"] = 1e3 * common.time_per_call(step, payload["seconds"], payload["repeats"])
    out["device_mb"] = _per_device_mb()
    if inference is not None and payload["devices"] > 1:
        try:
            out.update(_collectives(inference))
        except Exception as err:  # PyTensor internals: report, do not fail the run
            out["collectives_error"] = repr(err)[:200]
    return out


def _run(payload: dict, device: str) -> dict:
    extra = {"JAX_PLATFORMS": device}
    if device == "cpu":
        extra["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={payload['devices']}"
    return common.run_child("benchmarks.exp_scale", payload, common.single_thread_env(extra))


def _measure(ctx, s: Settings, configs: list[tuple[str, dict, int]]) -> dict:
    results = {}
    for case, spec, n in configs:
        for devices in s.devices:
            for method in ("bare", "gpf"):
                payload = {"model": spec, "n": n, "method": method, "devices": devices,
                           "seconds": s.seconds, "repeats": s.repeats}  # fmt: skip
                out = _run(payload, ctx.device)
                results[(case, devices, method)] = out
                if "error" in out:
                    print(f"   {case} {devices} {method}: {out['error']}", flush=True)
                    continue
                for metric, unit in (("ms_per_step", "ms"), ("device_mb", "MB")):
                    ctx.record(case, f"{method} x{devices}", metric, out[metric], unit)
                if "collective_numbers" in out:
                    numbers = out["collective_numbers"]
                    ctx.record(case, f"{method} x{devices}", "collective_numbers", numbers, "")
                print(f"   {case} x{devices} {method}: {out['ms_per_step']:.3g} ms", flush=True)
    return results


def _table(results: dict, configs: list, s: Settings) -> str:
    rows = []
    for case, _, _ in configs:
        row = [case]
        for devices in s.devices:
            bare, gpf = results[(case, devices, "bare")], results[(case, devices, "gpf")]
            ok = "error" not in bare and "error" not in gpf
            ms, base = (gpf["ms_per_step"], bare["ms_per_step"]) if ok else (np.nan, np.nan)
            row += [fmt(base), fmt(ms), fmt(ms / base, 2), fmt(gpf.get("device_mb", np.nan))]
        one, four = (results[(case, d, "gpf")] for d in (s.devices[0], s.devices[-1]))
        speedup = one.get("ms_per_step", np.nan) / four.get("ms_per_step", np.nan)
        n, d = map(int, re.findall(r"\d+", case))
        row += [fmt(speedup, 2), fmt(four.get("collective_numbers", np.nan) / (n * d), 2)]
        rows.append(row)
    headers = ["case"]
    for devices in s.devices:
        headers += [f"bare ms ×{devices}", f"GPF ms ×{devices}", f"GPF/bare ×{devices}",
                    f"MB/device ×{devices}"]  # fmt: skip
    last = s.devices[-1]
    return md_table([*headers, f"×{s.devices[0]} / ×{last} time", f"crossing ×{last} / ND"], rows)


def _side_by_side_table(ctx) -> str:
    out = _run({"side_by_side": True, "devices": 4}, ctx.device)
    if "error" in out:
        return f"The side-by-side run failed: {out['error']}"
    rows = []
    for row in out["rows"]:
        if "error" in row:
            rows.append([row["label"], row["backend"], "fails", "—", "—", row["error"]])
            continue
        for metric, unit in (("seconds", "s"), ("mean_error", "sd"), ("sd_error", "")):
            label = f"{row['label']} {row['backend']}"
            ctx.record("gaussian D=20", label, metric, row[metric], unit)
        rows.append([row["label"], row["backend"], fmt(row["seconds"]), fmt(row["mean_error"], 2),
                     fmt(row["sd_error"], 2), row["status"]])  # fmt: skip
    headers = ["method (defaults)", "backend", "seconds", "max mean error (sd)",
               "max sd error", "how it ended"]  # fmt: skip
    return md_table(headers, rows, left=2)


def run(ctx) -> str:
    s = Settings.of(ctx.quick)
    try:
        import jax  # noqa: F401
    except ImportError:
        return 'JAX is not installed (`pip install -e ".[jax]"`): this section was skipped.'
    by_n = [(f"logistic N={n}, D={N_DIM}", {"kind": "logistic", "d": N_DIM}, n)
            for n in s.particles]  # fmt: skip
    by_d = [(f"Gaussian N={D_PARTICLES}, D={d}", {"kind": "diagonal", "d": d}, D_PARTICLES)
            for d in s.dims]  # fmt: skip
    side_by_side = "" if ctx.quick else _side_by_side_table(ctx)
    results = _measure(ctx, s, by_n + by_d)
    platforms = {r.get("platform") for r in results.values() if "platform" in r}
    collectives = "; ".join(
        f"{case}: {r['all-gather']} all-gathers, {r['all-reduce']} all-reduces, "
        f"{r['all-to-all']} all-to-alls"
        for (case, d, m), r in results.items()
        if m == "gpf" and d > 1 and "all-gather" in r
    )
    return f"""\
Every figure below comes from **{", ".join(sorted(platforms)) or "no"}** devices
(`--device {ctx.device}`). GPF's fixed-step update (every step asked for runs) on
PyTensor's JAX backend, against the bare batched log-density and gradient of the same N
points compiled with JAX, on {s.devices[0]} and on {s.devices[-1]} devices
(`inf_kwargs={{"devices": {s.devices[-1]}}}`; on a CPU these are XLA host devices sharing its
cores, so the table shows what splitting costs, not what it gains; the gain needs devices
with their own compute). The N sweep is a logistic regression with D = {N_DIM} weights on
n = {N_ROWS} observations (a gradient costs O(nD) per particle); the D sweep a diagonal
Gaussian (a gradient costs O(D)) with N = {D_PARTICLES}. *MB/device* is what the live JAX
arrays hold on the busiest device between steps (the fit's state, split by rows, and any
whole copies JAX keeps on the first device; XLA's temporaries inside a step are not
counted).

{_table(results, by_n + by_d, s)}

GPF's flow costs O(N D min(N, D)): with N ≤ D the N × N Gram, beyond it the D × D
covariance. On the logistic regression a gradient reads n = 1000 rows, and the flow never
dominates it: GPF/bare stays near 1 from N = 10 to N = 100 D. The diagonal Gaussian's gradient
is a few operations per coordinate, so there the flow's algebra and the per-step control (tens
of microseconds of Python) are most of the step until D is large.

**Defaults, side by side.** Every method at its defaults on one closed-form Gaussian
(D = {GAUSSIAN_DIM}, condition number {GAUSSIAN_KAPPA:g}), in one process with 4 host
devices. Seconds include compilation. The errors are the largest over the 20 coordinates,
in posterior sds, from 20,000 draws of q (NUTS: its 2,000 draws; ADVI is mean field, so its
sds are the conditional ones). The methods that draw noise (GF, WVGD, the ensemble) draw
different numbers on JAX for the same seed, so their rows differ by Monte Carlo error:

{side_by_side or "(the full run only)"}

The Langevin ensemble needs close to its 10,000-step default cap on this target (its chains
cross a condition number of 100). Whether it reaches ESS 400 before the cap depends on the
draws, so one backend's run may stop by itself and the other's may not. PyMC's own ADVI does
not compile with `backend="jax"`.

**What crosses devices.** *crossing / ND* is the number of numbers in the results of the
collectives XLA compiled into one split step (an all-gather's result counted whole), over the
N × D numbers of the particles. The collectives: {collectives}. The log-density and gradient of
each particle stay on its device. With N ≤ D the flow goes through the N × N Gram of a
row-split N × D matrix, which needs the other devices' rows: XLA all-gathers the deviations
once per step and all-reduces products contracted over the particles, about three times the
particles' size in all. With N > D the D × D covariance is a sum over particles, and the
all-reduces carry D × D numbers, D-vectors and scalars. Splitting the N ≤ D algebra by columns
instead (the particles and gradients constrained to a column layout before the flow) was
tried on GPF's step: XLA's propagation then moved 27 % fewer numbers at N = 40, D = 200, and
twice as many once the state was constrained too, so the layout is left to XLA. When N does
not divide by the number of devices, XLA pads inside the step and keeps the particles whole
between steps: every device then holds all of them.
"""


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "child":
        print(json.dumps(child(json.loads(sys.argv[2]))))
    else:
        sys.exit("usage: python -m benchmarks.exp_scale child JSON (run by the suite)")
