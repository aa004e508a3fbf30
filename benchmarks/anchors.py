"""pymc-extras' DADVI and Pathfinder at their defaults, with what they evaluated counted.

``run_dadvi`` calls ``fit_dadvi(model, random_seed=..., progressbar=False)`` (mean-field
Gaussian, ``n_fixed_draws = 30`` fixed draws, scipy's ``trust-ncg``): every call of its fused
objective is 30 log-density gradients and every Hessian-vector-product call 30 products,
counted by wrapping the compiled functions (``unittest.mock.patch`` on the names pymc-extras
looks up). The count includes better_optimize's probing call and the Hessian-vector product it
spends on a progress display per objective evaluation, even with ``progressbar=False``.

``run_pathfinder`` calls ``fit_pathfinder(model, random_seed=..., progressbar=False)`` (4 L-BFGS
paths in worker processes): ``grad_evals`` are the calls of the L-BFGS ``(x) -> (-logp, -dlogp)``
over paths and retries, ``logp_evals`` the ELBO draws' log densities (10 per accepted step),
``logp_evals_final`` the final draws' (1000 per path). Each worker writes its path's counts to
a temporary file that the parent sums. Any exception becomes ``status = "error: ..."``.
"""

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
    logp_evals_final: int = 0
    pareto_k: float | None = None
    status: str = "ok"


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


def _run(fit, model, seed, patches) -> tuple:
    start = time.perf_counter()
    try:
        with ExitStack() as stack:
            for module, name, new in patches:
                stack.enter_context(mock.patch.object(module, name, new))
            idata = fit(model, random_seed=seed, progressbar=False)
        return idata, _draws(idata), time.perf_counter() - start
    except Exception as err:
        return None, {}, AnchorResult({}, time.perf_counter() - start,
                                      status=f"error: {type(err).__name__}: {err}")  # fmt: skip


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
    idata, draws, wall = _run(fit_dadvi, model, random_seed, patches)
    if idata is None:
        return wall
    opt = idata["optimizer_result"].to_dataset()
    success = "success" not in opt or bool(opt["success"].values.item())
    message = opt["message"].values.item() if "message" in opt else None
    fused, hessp = made
    hvp = 0 if hessp is None else n_fixed * hessp.calls
    return AnchorResult(
        draws,
        wall,
        n_fixed * fused.calls,
        hvp,
        status="ok" if success else f"not converged: {message}",
    )


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
            path_fn, n_elbo = make_path(*args, **kwargs), kwargs["num_elbo_draws"]
            grad, sample = made["grad"], made["sample"]

            def counted_path(seed, progress_callback=None):
                calls, done = grad.calls, len(sample.rows)
                try:
                    return path_fn(seed, progress_callback)
                finally:  # in the worker process: this path's counts for the parent
                    rows = sample.rows[done:]
                    counts = {"grad": grad.calls - calls,
                              "elbo": sum(r for r in rows if r == n_elbo),
                              "final": sum(r for r in rows if r != n_elbo)}  # fmt: skip
                    (Path(tmp) / f"{os.getpid()}-{seed}.json").write_text(json.dumps(counts))

            return counted_path

        patches = [(single_path, "get_neg_logp_dlogp_of_ravel_inputs", counted_grad),
                   (single_path, "make_pathfinder_sample_fn", counted_sample),
                   (multipath, "make_single_pathfinder_fn", counting_make_path)]  # fmt: skip
        idata, draws, wall = _run(fit_pathfinder, model, random_seed, patches)
        if idata is None:
            return wall
        paths = [json.loads(f.read_text()) for f in Path(tmp).glob("*.json")]
    pf = idata["pathfinder"].to_dataset()
    khat = np.asarray(pf["pareto_k"]).tolist() if "pareto_k" in pf else None
    total = {k: sum(p[k] for p in paths) for k in ("grad", "elbo", "final")}
    return AnchorResult(draws, wall, total["grad"], 0, total["elbo"], total["final"], khat)
