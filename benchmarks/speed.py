"""Speed sections: cost per step against the bare batched gradient and scaling with D and N
(speed), time to the first step on a cold and a warm PyTensor cache (startup), GPF's step on JAX
with the particles split across devices (scale); cells in fresh processes (``README.md``)."""

from __future__ import annotations

import re
import tempfile
import time

import numpy as np
import pymc as pm

import pymc_gpf

from benchmarks import anchors, cases, harness
from benchmarks.harness import Method, fmt, md_table
from pymc_gpf.approximation import LOGP_TERMS, MAX_CHUNK, MIN_CHUNK

BATCH, SCALING_BATCH, SCALING_DIM, FULL_RANK_MAX_D = 20, 10, 1000, 1000
LABELS = {"bare": "bare logp+grad", "gpf": "GPF", "gf": "GF full rank", "gf_diag": "GF diagonal",
          "gf_lowrank": "GF rank 10", "wvgd": "WVGD", "advi": "ADVI", "advi_1": "ADVI obj_n_mc=1",
          "fullrank_advi": "FullRankADVI", "svgd": "SVGD"}  # fmt: skip
STEP_MODELS = {"logistic n=2000, D=50": {"kind": "logistic"},
               "Gaussian D=20, κ=10": {"kind": "gaussian", "d": 20}}  # fmt: skip


def stepper(method: str, model, n: int, backend, default_jitter: bool = False, devices: int = 1):
    """``step(k)`` runs k steps of ``method`` with ``n`` points each after a first call that
    compiles; the gradients one step evaluates; the inference. Ours take the fixed-step update
    (every step asked for runs); PyMC's their default optimiser."""
    if method == "bare":
        target, wait = pymc_gpf.BatchedTarget(model), lambda out: out
        if backend == "jax":
            import jax

            from pymc_gpf.jaxlink import row_sharding

            target.row_sharding = sharding = row_sharding(devices)
        fn = target.compile_logp_dlogp(backend=backend)
        points = 0.1 * np.random.default_rng(1).normal(size=(n, target.ndim))
        if backend == "jax":
            fn.trust_input, wait = True, jax.block_until_ready  # a device array goes in as is
            if sharding is not None and n % devices:  # uneven: copies, split in XLA
                sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
            points = jax.device_put(points, sharding)
        wait(fn(points))

        def step(k: int) -> None:
            for _ in range(k - 1):
                fn(points)
            wait(fn(points))

        return step, n, None
    d = pymc_gpf.BatchedTarget(model).ndim  # only D: a target kept alive would count in memory
    # GPF's init_scale 0.1, times sqrt(N/D) for N ≤ D (the speed section's note says why)
    jitter = 0.1 if default_jitter else 0.1 * min(1.0, float(np.sqrt(n / d)))
    fixed = {"learning_rate": 1e-3, "check_draws": 0}  # each refine would judge the fit
    kind, inf_kwargs, fit_kwargs = {
        "gpf": ("gpf", {"n_particles": n, "init_scale": jitter, "devices": devices}, fixed),
        "gf": ("gf", {"draws_per_step": n}, fixed),
        "gf_diag": ("gf", {"draws_per_step": n, "structure": "diagonal"}, fixed),
        "gf_lowrank": ("gf", {"rank": 10, "draws_per_step": n}, fixed),
        # at WVGD's own default 0.01 the logistic regression diverges inside the timing window
        "wvgd": ("wvgd", {"n_particles": 4, "draws_per_particle": max(n // 4, 1)}, fixed),
        "advi": ("advi", {}, {"obj_n_mc": n}),
        "advi_1": ("advi", {}, {"obj_n_mc": 1}),
        "fullrank_advi": ("fullrank_advi", {}, {"obj_n_mc": n}),
        "svgd": ("svgd", {"n_particles": n}, {}),
    }[method]  # fmt: skip
    if backend != "jax":
        inf_kwargs.pop("devices", None)
    inference = Method(LABELS[method], kind, inf_kwargs, fit_kwargs).build(model, seed=1)
    if method == "fullrank_advi":  # L = 0.1 I: from PyMC's softplus(1) I its first gradient is NaN
        group = inference.approx.groups[0]
        value = group.params_dict["L_tril"].get_value()
        value[np.cumsum(np.arange(1, group.ddim + 1)) - 1] = np.log(np.expm1(0.1))
        group.params_dict["L_tril"].set_value(value)
    inference.fit(1, progressbar=False, backend=backend, **fit_kwargs)
    n_mc = fit_kwargs.get("obj_n_mc", 1)
    before = harness.evaluations(inference, 0, n_mc)
    inference.refine(1, progressbar=False)
    grads = harness.evaluations(inference, 1, n_mc) - before

    def step(k: int) -> None:  # ours read the free energy: waits for the step
        inference.refine(k, progressbar=False)

    return step, grads, inference


# ---------------------------------------------------------------------------------- speed
def step_cell(payload: dict) -> dict:
    """A fresh process: the first step (warm cache), warm ms per step and resident memory."""
    model = cases.speed_model(payload["model"])
    baseline, start = harness.memory_mb()["VmRSS"], time.perf_counter()
    step, _, _ = stepper(payload["method"], model, payload["n"], payload["backend"],
                         payload.get("default_jitter", False))  # fmt: skip
    out = {"first_step_seconds": time.perf_counter() - start, "baseline_rss_mb": baseline,
           "first_step_peak_rss_mb": harness.memory_mb()["VmHWM"]}  # fmt: skip
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # resets the high-water mark
        reset = True
    except OSError:
        reset = False
    out["ms_per_step"] = 1e3 * harness.time_per_call(step, payload["steps_seconds"], 3)
    out["stepping_peak_rss_mb"] = harness.memory_mb()["VmHWM"] if reset else float("nan")
    return out


def per_step_table(ctx, repeat_seconds: float, repeats: int) -> str:
    """Warm ms per step of every method against the bare batched gradient, in this process."""
    rows = []
    for backend in dict.fromkeys(b or ctx.backend for b in ctx.pick((None,), (None, "c"))):
        name = harness.backend_name(backend)
        for model_name in ctx.pick(tuple(STEP_MODELS)[:1], tuple(STEP_MODELS)):
            model, ms, grads = cases.speed_model(STEP_MODELS[model_name]), {}, {}
            for method in ctx.pick(("bare", "gpf", "advi_1"), tuple(LABELS)):
                try:
                    step, grads[method], _ = stepper(method, model, BATCH, backend)
                    ms[method] = 1e3 * harness.time_per_call(step, repeat_seconds, repeats)
                except FloatingPointError as err:
                    ms[method], grads[method] = float("nan"), float("nan")
                    ctx.record(model_name, method, "failure", 1.0, note=str(err)[:200])
            case = f"{model_name}; {name}"
            for method, value in ms.items():
                per_grad = value / grads[method] / (ms["bare"] / BATCH)
                ctx.record(case, method, "ms_per_step", value, "ms")
                ctx.record(case, method, "ms_per_step_over_bare", value / ms["bare"])
                ctx.record(case, method, "ms_per_gradient_over_bare", per_grad)
                rows.append([model_name, name, LABELS[method], fmt(grads[method]), fmt(value),
                             fmt(value / ms["bare"]), fmt(per_grad)])  # fmt: skip
            print(f"  per step: {model_name}, {name}: done", flush=True)
    return md_table("model | backend | method | gradients / step | ms / step | step / bare | "
                    "per gradient / bare", rows, left=3)  # fmt: skip


def scaling_cell(ctx, case: str, method: str, payload: dict) -> dict | None:
    """:func:`step_cell` in a fresh process, its numbers recorded (None: skipped)."""
    if method == "fullrank_advi" and payload["model"]["d"] > FULL_RANK_MAX_D:
        ctx.record(case, method, "skipped", 1.0, note="memory: D(D+1)/2 parameters")
        return None
    out = harness.run_child(step_cell, {**payload, "method": method, "backend": ctx.backend})
    if "error" in out:
        ctx.record(case, method, "failure", 1.0, note=out["error"])
        return out
    ctx.record_many(case, method, [
        ("ms_per_step", out["ms_per_step"], "ms"),
        ("first_step_seconds", out["first_step_seconds"], "s"),
        ("baseline_rss", out["baseline_rss_mb"], "MB"),
        ("stepping_peak_rss", out["stepping_peak_rss_mb"], "MB"),
        ("stepping_peak_over_baseline", out["stepping_peak_rss_mb"] - out["baseline_rss_mb"], "MB"),
        ("first_step_peak_rss", out["first_step_peak_rss_mb"], "MB")])  # fmt: skip
    return out


def jitter_note(ctx, d: int, repeat_seconds: float) -> str:
    """Whether GPF at its default init_scale diverges on the largest diagonal Gaussian."""
    payload = {"model": {"kind": "diagonal", "d": d}, "method": "gpf", "n": SCALING_BATCH,
               "backend": ctx.backend, "steps_seconds": repeat_seconds,
               "default_jitter": True}  # fmt: skip
    out = harness.run_child(step_cell, payload)
    case = f"diagonal Gaussian D={d}, N={SCALING_BATCH}, default init_scale 0.1"
    if found := re.search(r"diverged at step (\d+)", out.get("error", "")):
        step = ctx.record(case, "gpf", "diverged_at_step", int(found.group(1)))
        return (
            f"at D = {d:,}, N = {SCALING_BATCH}, GPF with the default init_scale and learning "
            f"rate 0.001 diverged at step {step} on this target (this run)"
        )
    if "error" in out:
        ctx.record(case, "gpf", "failure", 1.0, note=out["error"])
        return f"at D = {d:,} GPF with the default init_scale failed: {out['error'][:120]}"
    ctx.record(case, "gpf", "ms_per_step", out["ms_per_step"], "ms")
    return f"at D = {d:,}, N = {SCALING_BATCH} the default init_scale ran without diverging here"


def loop_cell(payload: dict) -> dict:
    """A fresh process: one method's warm default fit (verdict off, the same seed each time) of
    the logistic regression with n = 1000, D = 26, and the same numbers of batched log-density
    evaluations, with and without gradient, compiled in C and called bare."""
    model = cases.speed_model({"kind": "logistic", "d": 26})
    options = {"method": payload["method"], "model": model, "progressbar": False,
               "check_draws": 0, "random_seed": 1}  # fmt: skip
    pm.fit(**options)  # compiles
    totals, firsts = [], []
    for _ in range(payload["fits"]):
        marks, start = [], time.perf_counter()
        approx = pm.fit(callbacks=[lambda *_, m=marks: m.append(time.perf_counter())], **options)
        totals.append(time.perf_counter() - start)
        firsts.append(marks[0] - start)
    steps, inference = len(approx.hist), approx.inference
    grads, densities = inference.gradient_evaluations, inference.density_evaluations
    # the loop from the end of the first step, extended by one step: setup is the rest
    loop = float(np.median(np.subtract(totals, firsts))) * steps / (steps - 1)
    target, rng = pymc_gpf.BatchedTarget(model), np.random.default_rng(0)
    gradient, log_density = target.compile_logp_dlogp(backend="c"), target.compile_logp(backend="c")
    points = 0.1 * rng.normal(size=(round(grads / steps), target.ndim))
    cloud = 0.1 * rng.normal(size=(densities, target.ndim))
    chunk = int(np.clip(LOGP_TERMS // target.data_size, MIN_CHUNK, MAX_CHUNK))  # as log_density
    bare_gradients = harness.time_per_call(lambda k: [gradient(points) for _ in range(steps * k)],
                                           0.2, 5)  # fmt: skip
    bare_densities = harness.time_per_call(
        lambda k: [log_density(cloud[i : i + chunk]) for _ in range(k)
                   for i in range(0, densities, chunk)], 0.2, 5)  # fmt: skip
    return {"steps": steps, "gradients": grads, "densities": densities, "loop": loop,
            "setup": float(np.median(totals)) - loop, "bare_gradients": bare_gradients,
            "bare_densities": bare_densities}  # fmt: skip


def loop_table(ctx) -> str:
    """Warm default GPF and GF fits: their loop against the bare cost of what they evaluated."""
    rows = []
    for method in ("gpf", "gf"):
        out = harness.run_child(loop_cell, {"method": method, "fits": ctx.pick(3, 7)})
        if "error" in out:
            ctx.record("logistic n=1000, D=26", method, "failure", 1.0, note=out["error"])
            continue
        bare = out["bare_gradients"] + out["bare_densities"]
        ctx.record_many("logistic n=1000, D=26", method, [
            ("loop_seconds", out["loop"], "s"), ("setup_seconds", out["setup"], "s"),
            ("loop_over_bare_gradients", out["loop"] / out["bare_gradients"], ""),
            ("loop_over_bare_evaluations", out["loop"] / bare, "")])  # fmt: skip
        rows.append([f"{method.upper()} (defaults)", out["steps"], out["gradients"],
                     out["densities"], fmt(out["setup"]), fmt(out["loop"]),
                     fmt(out["bare_gradients"]), fmt(out["bare_densities"]),
                     fmt(out["loop"] / out["bare_gradients"]),
                     fmt(out["loop"] / bare)])  # fmt: skip
    return md_table("method | steps | gradient evaluations | log-density evaluations | setup (s) | "
                    "loop (s) | bare gradients (s) | bare log-densities (s) | loop / bare "
                    "gradients | loop / bare evaluations", rows)  # fmt: skip


def speed(ctx) -> str:
    repeat_seconds, repeats = ctx.pick(0.1, 0.3), ctx.pick(3, 5)
    dims = ctx.pick((100, 10_000), (100, 1000, 10_000, 100_000))
    dim_methods = ctx.pick(("gpf",), ("bare", "gpf", "gf_lowrank", "advi_1", "fullrank_advi",
                                      "svgd"))  # fmt: skip
    particles = ctx.pick((), (10, 100, 1000))
    particle_methods = ctx.pick((), ("bare", "gpf", "gf_diag", "advi", "svgd"))
    parts = ["### Cost per step against the bare batched gradient",
             ctx.text("speed_step", repeats=repeats, seconds=repeat_seconds),
             per_step_table(ctx, repeat_seconds, repeats),
             "### A default fit's loop against its own evaluations", ctx.text("speed_loop"),
             loop_table(ctx)]  # fmt: skip
    panels = [p for p in (("D", dims, dim_methods), ("N", particles, particle_methods)) if p[1]]
    results = {}
    for axis, values, methods in panels:
        for value in values:
            d, n = (value, SCALING_BATCH) if axis == "D" else (SCALING_DIM, value)
            payload = {"model": {"kind": "diagonal", "d": d}, "n": n,
                       "steps_seconds": repeat_seconds}  # fmt: skip
            for method in methods:
                case = f"diagonal Gaussian D={d}, N={n}"
                results[axis, method, value] = scaling_cell(ctx, case, method, payload)
            print(f"  scaling {axis}={value}: done", flush=True)
    jitter = jitter_note(ctx, max(dims), repeat_seconds)
    baselines = [o["baseline_rss_mb"] for o in results.values() if o and "error" not in o]
    extra = (f", and N ∈ {{{', '.join(map(str, particles))}}} at D = {SCALING_DIM:,} (ADVI with "
             "`obj_n_mc` = N)") if particles else ""  # fmt: skip
    parts += ["### Scaling with D and N",
              ctx.text("speed_scaling", dims=", ".join(f"{d:,}" for d in dims), particles=extra,
                       low=fmt(min(baselines, default=float("nan"))),
                       high=fmt(max(baselines, default=float("nan"))))]  # fmt: skip
    plt = harness.pyplot()
    fig, axes = plt.subplots(2, len(panels), figsize=(5.2 * len(panels), 6.4), squeeze=False)
    for col, (axis, values, methods) in enumerate(panels):
        for key, what in (("ms_per_step", "Warm ms per step"),
                          ("stepping_peak_rss_mb", "Peak resident memory while stepping (MB)"),
                          ("first_step_seconds", "First step, warm cache (s)")):  # fmt: skip
            rows = [[LABELS[m], *("not run (memory)" if (o := results[axis, m, v]) is None
                                  else "failed" if "error" in o else fmt(o[key])
                                  for v in values)] for m in methods]  # fmt: skip
            header = ["method", *(f"{axis} = {v:,}" for v in values)]
            parts += [f"{what} against {axis}:", md_table(header, rows)]
        for method in methods:
            done = [(v, o) for v in values if (o := results[axis, method, v]) and "error" not in o]
            style = "o" + ("--" if method in ("gf_lowrank", "advi") else "-")
            xs = [v for v, _ in done]
            line = {"color": harness.colour(LABELS[method]), "label": LABELS[method]}
            axes[0, col].loglog(xs, [o["ms_per_step"] for _, o in done], style, **line)
            axes[1, col].semilogx(xs, [o["stepping_peak_rss_mb"] for _, o in done], style, **line)
        fixed = f"N = {SCALING_BATCH}" if axis == "D" else f"D = {SCALING_DIM:,}"
        axes[0, col].set(title=f"time per step vs {axis} ({fixed}; diagonal Gaussian)",
                         ylabel="ms / step", xlabel=axis)  # fmt: skip
        axes[1, col].set(title=f"peak resident memory while stepping vs {axis}", ylabel="MB",
                         xlabel=axis)  # fmt: skip
        axes[0, col].legend(fontsize=7)
    parts += [harness.save_figure(ctx, fig, "scaling"),
              "Time per step (top) and peak resident memory while stepping (bottom) against D and "
              "N: one fresh process per point.", ctx.text("speed_note", jitter=jitter)]  # fmt: skip
    return "\n\n".join(parts)


# -------------------------------------------------------------------------------- startup
STARTUP_LABELS = {"bare": "bare batched logp+grad", "gpf": "GPF", "gf": "GF", "wvgd": "WVGD",
                  "advi": "PyMC ADVI", "svgd": "PyMC SVGD", "dadvi": "pymc-extras DADVI",
                  "pathfinder": "pymc-extras Pathfinder"}  # fmt: skip
MODELS = {"logistic": "logistic regression (n = 2000, D = 50; the speed section's)",
          "german_credit": "German credit (the quickstart's; D = 25)",
          "eight_schools": "eight schools, non-centred (D = 10)"}  # fmt: skip


def first_step(method: str, model, backend: str | None, seed: int = 1) -> tuple[float, str]:
    """``method`` at its defaults: seconds to the end of its first step (NaN without a step to
    time) and a note; the fit is followed by 1000 draws."""
    start = time.perf_counter()
    if method == "bare":
        target = pymc_gpf.BatchedTarget(model)
        target.compile_logp_dlogp(backend=backend)(np.zeros((20, target.ndim)))
        return time.perf_counter() - start, ""
    if method in ("dadvi", "pathfinder"):
        return float("nan"), getattr(anchors, f"run_{method}")(model, seed).status
    first = []
    approx = pm.fit(method=method, model=model, random_seed=seed, progressbar=False,
                    callbacks=[lambda *_: first or first.append(time.perf_counter() - start)],
                    **({} if backend is None else {"backend": backend}))  # fmt: skip
    approx.sample(1000, random_seed=2)
    if method not in ("gpf", "gf", "wvgd"):
        return first[0], "10 000 steps (pm.fit's default)"
    compiled = approx.inference.fit_options.compile_backend or "numba"
    return first[0], f"{len(approx.hist)} steps, {approx.outcome.reason}; {compiled}"


def startup_cell(payload: dict) -> dict:
    """A fresh process: the first fit's first step and result, then a second fit's result."""
    model = cases.speed_model({"kind": payload["model"]})
    start = time.perf_counter()
    first, note = first_step(payload["method"], model, payload["backend"])
    middle = time.perf_counter()  # a second fit of the model in this process, new seed
    first_step(payload["method"], model, payload["backend"], seed=2)
    return {"first_step": first, "result": middle - start, "note": note,
            "refit": time.perf_counter() - middle}  # fmt: skip


def startup(ctx) -> str:
    cells = ctx.pick((("bare", None), ("gpf", None)), (
        *((m, None) for m in STARTUP_LABELS), ("gpf", "numba"), ("gf", "numba"), ("wvgd", "numba"),
        ("bare", "c"), ("advi", "c")))  # fmt: skip
    tables = []
    for model in ctx.pick(("eight_schools",), tuple(MODELS)):
        rows = []
        for method, backend in cells:
            payload = {"model": model, "method": method, "backend": backend}
            with tempfile.TemporaryDirectory(prefix="pytensor-cold-") as compiledir:
                env = {"PYTENSOR_FLAGS": f"base_compiledir={compiledir}"}
                cold, warm = (harness.run_child(startup_cell, payload, **env) for _ in "cw")
                similar = {} if model != "logistic" else harness.run_child(
                    startup_cell, dict(payload, model="german_credit"), **env)  # fmt: skip
            name = backend or "default"
            if "error" in cold or "error" in warm:
                note = cold.get("error") or warm.get("error")
                ctx.record(model, method, "failure", 1.0, note=note)
                rows.append([STARTUP_LABELS[method], name, "failed", "", "", "", "", note[:60]])
                continue
            for run_name, out in (("cold", cold), ("warm", warm)):
                for key in ("first_step", "result", "refit"):
                    ctx.record(f"{model}; {name}", method, f"{key}_{run_name}_seconds", out[key],
                               "s", out["note"])  # fmt: skip
            rows.append([STARTUP_LABELS[method], name, fmt(cold["first_step"]),
                         fmt(cold["result"]), fmt(warm["first_step"]), fmt(warm["result"]),
                         fmt(warm["refit"]), fmt(similar["result"]) if "result" in similar else "",
                         cold["note"]])  # fmt: skip
            print(f"  {model} {method} ({name}): {cold['result']:.0f} s cold", flush=True)
        similar = "result, German credit next (s)" if model == "logistic" else ""
        tables.append(f"**{MODELS[model]}**\n\n" + md_table(
            ["method", "backend", "first step, cold (s)", "result, cold (s)",
             "first step, warm (s)", "result, warm (s)", "result, refit (s)", similar, "fit"],
            rows, left=2))  # fmt: skip
    return "\n\n".join([ctx.text("startup"), *tables])


# ---------------------------------------------------------------------------------- scale
def scale_cell(payload: dict) -> dict:
    """A fresh process whose JAX sees ``payload["devices"]`` devices: ms per step, the memory
    the busiest device holds and, split, the collectives of the step."""
    import jax

    step, _, inference = stepper(payload["method"], cases.speed_model(payload["model"]),
                                 payload["n"], "jax", devices=payload["devices"])  # fmt: skip
    seconds = harness.time_per_call(step, payload["seconds"], payload["repeats"])
    out = {"platform": jax.devices()[0].platform, "ms_per_step": 1e3 * seconds}
    held: dict = {}  # what the live arrays hold on each device
    for array in jax.live_arrays():
        for shard in array.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    out["device_mb"] = max(held.values(), default=0) / 2**20
    if inference is not None and payload["devices"] > 1:
        try:
            out.update(collectives(inference))
        except Exception as err:  # PyTensor internals: report, do not fail the run
            out["collectives_error"] = repr(err)[:200]
    return out


def collectives(inference) -> dict[str, int]:
    """How many of each collective XLA compiled into the step, and how many numbers their
    results hold in all (an all-gather's result counts whole)."""
    compiled = [c.cell_contents for c in inference.step.fn.__closure__ or ()]
    fn = next(iter(next(v for v in compiled if isinstance(v, dict) and v).values()))
    for cell in getattr(fn, "_fn", fn).vm.__closure__ or ():
        if callable(cell.cell_contents) and hasattr(cell.cell_contents, "inputs"):
            thunk = cell.cell_contents
            jit, inputs = thunk.__defaults__[0], [x[0] for x in thunk.inputs]
    text = jit.lower(*inputs).compile().as_text()
    out = {"collective_numbers": 0}
    for op in ("all-gather", "all-reduce", "all-to-all", "collective-permute"):
        lines = [line for line in text.splitlines() if f" {op}(" in line or f" {op}-start(" in line]
        out[op] = len(lines)
        for line in lines:  # the result, e.g. " (f64[40,200]{1,0}, f64[]) "
            for dims in re.findall(r"\w+\[([\d,]*)\]", line.split("=", 1)[1].split(op)[0]):
                out["collective_numbers"] += int(np.prod([int(n) for n in dims.split(",") if n]))
    return out


def side_by_side(payload: dict) -> dict:
    """Every method at its defaults on one closed-form Gaussian (D = 20, κ = 100), in one
    process with 4 host devices: seconds including compilation, largest errors in sds."""
    model, mean, sd = cases.gaussian_model(20, 100.0)

    def errors(draws) -> dict[str, float]:
        values = harness.max_errors(np.asarray(draws).reshape(-1, len(mean)), mean, sd)
        return dict(zip(("mean_error", "sd_error"), values, strict=True))

    rows = []
    for label, method, options, backend in [
        ("GPF", "gpf", {}, None), ("GPF", "gpf", {}, "jax"),
        ("GPF ×4 devices", "gpf", {"devices": 4}, "jax"), ("GF", "gf", {}, None),
        ("GF", "gf", {}, "jax"), ("GF ×4 devices", "gf", {"devices": 4}, "jax"),
        ("WVGD", "wvgd", {}, None), ("WVGD", "wvgd", {}, "jax"),
        ("Langevin ensemble", "ensemble", {}, None), ("Langevin ensemble", "ensemble", {}, "jax"),
        ("ADVI (PyMC)", "advi", {}, None), ("ADVI (PyMC)", "advi", {}, "jax"),
    ]:  # fmt: skip
        try:
            fit = harness.fit_defaults(method, model, inf_kwargs=options, backend=backend)
            draws = harness.flat_sample(fit.approx, 20_000, 0)
        except Exception as err:  # PyMC's own JAX path is reported broken: say how
            message = f"{type(err).__name__}: {str(err).splitlines()[0][:90]}"
            rows.append({"label": label, "backend": backend, "error": message})
            continue
        status = "ran 10000 steps" if fit.stop == "n steps" else f"{fit.stop}, {fit.steps} steps"
        rows.append({"label": label, "backend": backend or "default", "seconds": fit.seconds,
                     "status": status, **errors(draws)})  # fmt: skip
    start = time.perf_counter()
    dadvi = anchors.run_dadvi(model, random_seed=1)
    rows.append({"label": "DADVI (pymc-extras)", "backend": "default", "status": dadvi.status,
                 "seconds": time.perf_counter() - start, **errors(dadvi.draws["x"])})  # fmt: skip
    run = harness.nuts(model, 1, discard_tuned_samples=True)
    rows.append({"label": "NUTS (PyMC)", "backend": "default", "status": "2 x 1000 draws",
                 "seconds": run.seconds, **errors(run.values["x"])})  # fmt: skip
    return {"rows": rows}


def on_devices(cell, payload: dict, device: str) -> dict:
    """``cell`` in a fresh process whose JAX runs on ``device`` (CPU: as many host devices as
    ``payload["devices"]``)."""
    env = {"JAX_PLATFORMS": device}
    if device == "cpu":
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={payload['devices']}"
    return harness.run_child(cell, payload, **env)


def side_by_side_table(ctx) -> str:
    out = on_devices(side_by_side, {"devices": 4}, ctx.device)
    rows = []
    for row in out.get("rows", []):
        if "error" in row:
            rows.append([row["label"], row["backend"], "fails", "—", "—", row["error"]])
            continue
        label = f"{row['label']} {row['backend']}"
        for metric, unit in (("seconds", "s"), ("mean_error", "sd"), ("sd_error", "")):
            ctx.record("gaussian D=20", label, metric, row[metric], unit)
        rows.append([row["label"], row["backend"], fmt(row["seconds"]), fmt(row["mean_error"], 2),
                     fmt(row["sd_error"], 2), row["status"]])  # fmt: skip
    if rows:
        return md_table("method (defaults) | backend | seconds | max mean error (sd) | max sd "
                        "error | how it ended", rows, left=2)  # fmt: skip
    return f"The side-by-side run failed: {out.get('error')}" if "error" in out else ""


def scale(ctx) -> str:
    try:
        import jax  # noqa: F401
    except ImportError:
        return 'JAX is not installed (`pip install -e ".[jax]"`): this section was skipped.'
    devices, seconds, repeats = (1, 4), ctx.pick(0.3, 1.0), ctx.pick(2, 3)
    configs = [(f"logistic N={n}, D=100", {"kind": "logistic", "d": 100}, n)
               for n in ctx.pick((10, 100), (10, 100, 1000, 10_000))]  # fmt: skip
    configs += [(f"Gaussian N=12, D={d}", {"kind": "diagonal", "d": d}, 12)
                for d in ctx.pick((1000,), (100, 10_000, 1_000_000))]  # fmt: skip
    table = "(the full run only)" if ctx.quick else side_by_side_table(ctx)
    results = {}
    for case, spec, n in configs:
        for d, method in ((d, m) for d in devices for m in ("bare", "gpf")):
            payload = {"model": spec, "n": n, "method": method, "devices": d,
                       "seconds": seconds, "repeats": repeats}  # fmt: skip
            out = results[case, d, method] = on_devices(scale_cell, payload, ctx.device)
            if "error" in out:
                print(f"   {case} {d} {method}: {out['error']}", flush=True)
                continue
            ctx.record(case, f"{method} x{d}", "ms_per_step", out["ms_per_step"], "ms")
            ctx.record(case, f"{method} x{d}", "device_mb", out["device_mb"], "MB")
            if "collective_numbers" in out:
                numbers = out["collective_numbers"]
                ctx.record(case, f"{method} x{d}", "collective_numbers", numbers, "")
            print(f"   {case} x{d} {method}: {out['ms_per_step']:.3g} ms "
                  f"{out.get('collectives_error', '')}", flush=True)  # fmt: skip
    rows = []
    for case, _, _ in configs:
        row = [case]
        for d in devices:
            bare, gpf = results[case, d, "bare"], results[case, d, "gpf"]
            ok = "error" not in bare and "error" not in gpf
            ms, base = (gpf["ms_per_step"], bare["ms_per_step"]) if ok else (np.nan, np.nan)
            row += [fmt(base), fmt(ms), fmt(ms / base, 2), fmt(gpf.get("device_mb", np.nan))]
        one, many = results[case, devices[0], "gpf"], results[case, devices[-1], "gpf"]
        n, d = map(int, re.findall(r"\d+", case))
        row += [fmt(one.get("ms_per_step", np.nan) / many.get("ms_per_step", np.nan), 2),
                fmt(many.get("collective_numbers", np.nan) / (n * d), 2)]  # fmt: skip
        rows.append(row)
    headers = ["case", *(f"{h} ×{d}" for d in devices
                         for h in ("bare ms", "GPF ms", "GPF/bare", "MB/device")),
               f"×{devices[0]} / ×{devices[-1]} time", f"crossing ×{devices[-1]} / ND"]  # fmt: skip
    found = "; ".join(
        f"{case}: {r['all-gather']} all-gathers, {r['all-reduce']} all-reduces, "
        f"{r['all-to-all']} all-to-alls"
        for (case, d, m), r in results.items()
        if m == "gpf" and d > 1 and "all-gather" in r)  # fmt: skip
    platforms = ", ".join(sorted({r["platform"] for r in results.values() if "platform" in r}))
    return ctx.text("scale", platforms=platforms or "no", device=ctx.device, one=devices[0],
                    many=devices[-1], table=md_table(headers, rows), side_by_side=table,
                    collectives=found) + "\n"  # fmt: skip


SECTIONS = {
    "speed": ("Speed: cost per step, scaling with D and N", speed),
    "startup": ("Speed: time to the first step and to a result, cold and warm PyTensor cache",
                startup),
    "scale": ("Scale: JAX, particles split across devices", scale),
}  # fmt: skip
