"""pymc-extras' DADVI and Pathfinder at their defaults, with what they evaluated counted by
wrapping the compiled functions (what each count means: ``benchmarks/README.md``)."""

from __future__ import annotations

import inspect
import json
import os
import tempfile
import time

from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import numpy as np


@dataclass
class AnchorResult:
    draws: dict[str, np.ndarray]  # constrained, {var: (S, ...)}
    wall_time: float
    grad_evals: int = 0
    hvp_evals: int = 0
    logp_evals: int = 0
    pareto_k: float | None = None
    status: str = "ok"

    @property
    def warned(self) -> bool:
        """Pathfinder's own warning: a reported k̂ of 0.7 or more."""
        k = self.pareto_k
        return k is not None and bool(np.isfinite(k)) and k >= 0.7


class _Counted:
    """A compiled function counting its calls and the rows of argument ``rows_arg``."""

    def __init__(self, fn, rows_arg: int | None = None):
        self.fn, self.rows_arg, self.calls, self.rows = fn, rows_arg, 0, []

    def __call__(self, *args):
        self.calls += 1
        if self.rows_arg is not None:
            self.rows.append(len(args[self.rows_arg]))
        return self.fn(*args)


def _draws(idata) -> dict[str, np.ndarray]:
    post = idata["posterior"].to_dataset()
    values = {str(k): np.asarray(v.transpose("chain", "draw", ...)) for k, v in post.items()}
    return {k: v.reshape(-1, *v.shape[2:]) for k, v in values.items()}


def _run(fit, model, seed, patches) -> tuple[object, AnchorResult]:
    """``fit`` with ``patches`` applied: its InferenceData (None if it failed) and draws."""
    start = time.perf_counter()
    try:
        with ExitStack() as stack:
            for module, name, new in patches:
                stack.enter_context(mock.patch.object(module, name, new))
            idata = fit(model, random_seed=seed, progressbar=False)
        draws = _draws(idata)
    except Exception as err:
        status = f"error: {type(err).__name__}: {err}"
        return None, AnchorResult({}, time.perf_counter() - start, status=status)
    return idata, AnchorResult(draws, time.perf_counter() - start)


def run_dadvi(model, random_seed: int | None = None) -> AnchorResult:
    from pymc_extras.inference import fit_dadvi
    from pymc_extras.inference.dadvi import dadvi as module

    n_fixed = inspect.signature(fit_dadvi).parameters["n_fixed_draws"].default
    made: list = [None, None]
    compile_funcs = module.scipy_optimize_funcs_from_loss

    def counted_compile(*args, **kwargs):
        fused, hessp = compile_funcs(*args, **kwargs)
        made[:] = [_Counted(fused), None if hessp is None else _Counted(hessp)]
        return made[0], made[1]

    patches = [(module, "scipy_optimize_funcs_from_loss", counted_compile)]
    idata, result = _run(fit_dadvi, model, random_seed, patches)
    if idata is None:
        return result
    opt = idata["optimizer_result"].to_dataset()
    if "success" in opt and not bool(opt["success"].values.item()):
        message = opt["message"].values.item() if "message" in opt else None
        result.status = f"not converged: {message}"
    fused, hessp = made
    result.grad_evals = n_fixed * fused.calls
    result.hvp_evals = 0 if hessp is None else n_fixed * hessp.calls
    return result


def run_pathfinder(model, random_seed: int | None = None) -> AnchorResult:
    from pymc_extras.inference import fit_pathfinder
    from pymc_extras.inference.pathfinder import multipath, single_path

    grad_factory = single_path.get_neg_logp_dlogp_of_ravel_inputs
    sample_factory = single_path.make_pathfinder_sample_fn
    make_path = multipath.make_single_pathfinder_fn
    made: dict[str, _Counted] = {}

    def counted_grad(*args, **kwargs):
        made["grad"] = _Counted(grad_factory(*args, **kwargs))
        return made["grad"]

    def counted_sample(*args, **kwargs):  # (x, g, alpha, s, z, u (M, N))
        made["sample"] = _Counted(sample_factory(*args, **kwargs), rows_arg=5)
        return made["sample"]

    with tempfile.TemporaryDirectory() as tmp:

        def counting_make_path(*args, **kwargs):
            path_fn, grad, sample = make_path(*args, **kwargs), made["grad"], made["sample"]

            def counted_path(seed, progress_callback=None):
                calls, done = grad.calls, len(sample.rows)
                try:
                    return path_fn(seed, progress_callback)
                finally:  # in the worker process: this path's counts for the parent
                    counts = {"grad": grad.calls - calls, "logp": sum(sample.rows[done:])}
                    (Path(tmp) / f"{os.getpid()}-{seed}.json").write_text(json.dumps(counts))

            return counted_path

        patches = [(single_path, "get_neg_logp_dlogp_of_ravel_inputs", counted_grad),
                   (single_path, "make_pathfinder_sample_fn", counted_sample),
                   (multipath, "make_single_pathfinder_fn", counting_make_path)]  # fmt: skip
        idata, result = _run(fit_pathfinder, model, random_seed, patches)
        if idata is None:
            return result
        paths = [json.loads(f.read_text()) for f in Path(tmp).glob("*.json")]
    pf = idata["pathfinder"].to_dataset()
    result.pareto_k = np.asarray(pf["pareto_k"]).tolist() if "pareto_k" in pf else None
    result.grad_evals = sum(p["grad"] for p in paths)
    result.logp_evals = sum(p["logp"] for p in paths)
    return result
