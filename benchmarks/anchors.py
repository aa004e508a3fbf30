"""pymc-extras' variational anchors, run on any PyMC model at their default settings.

:func:`run_dadvi` calls ``pymc_extras.inference.fit_dadvi`` (deterministic ADVI, Giordano,
Ingram & Broderick 2024: mean-field Gaussian, a fixed set of ``n_fixed_draws = 30``
standard-normal draws, scipy's ``trust-ncg`` with exact gradients and Hessian-vector
products) and :func:`run_pathfinder` calls ``pymc_extras.inference.fit_pathfinder``
(Zhang et al. 2022: 4 L-BFGS paths, run in worker processes, ELBO-selected Gaussian per path,
PSIS over the paths' draws) with ``progressbar=False`` and nothing else changed. Each returns
an :class:`AnchorResult`; an exception becomes a result with ``status = "error: ..."``.

What is counted (both anchors compile their functions inside the call; the compiled
functions are wrapped with counters for the duration of the call, through
``unittest.mock.patch`` on the names pymc-extras looks up, so nothing else changes):

- **DADVI.** Every call of the fused objective (value and gradient of the 30-draw DADVI
  objective) is ``n_fixed_draws`` log-density gradient evaluations, and every call of its
  Hessian-vector product is ``n_fixed_draws`` Hessian-vector products of the log density.
  ``grad_evals = 30 * fused calls`` (all calls, including better_optimize's one probing call
  at the start, which scipy's ``nfev`` does not count), ``hvp_evals = 30 * hessp calls``:
  all that were computed, which is more than the optimiser used, because better_optimize
  also spends one Hessian-vector product per objective evaluation on a Rayleigh quotient
  ``g^T H g / |g|^2`` for its progress display, even with ``progressbar=False`` (so
  ``hessp calls = nhev + nfev``). scipy's own ``nit``/``nfev``/``njev``/``nhev``, status and
  message go to ``info``.
- **Pathfinder.** ``grad_evals``: calls of the compiled ``(x) -> (-logp, -dlogp)`` used by
  L-BFGS (one point each: line-search points, the streaming callback's call at the start,
  better_optimize's probing call), summed over paths and init retries. ``logp_evals``: the
  log densities (no gradient) of the ELBO draws, ``num_elbo_draws = 10`` per accepted L-BFGS
  step. The ``num_draws_per_path = 1000`` final draws of each path, whose log densities feed
  the importance weights, are counted apart in ``info["logp_evals_final"]``. Paths run in
  worker processes, so each path writes its counts to a temporary file that the parent sums;
  ``info["paths_counted"]`` says how many paths reported (a worker that dies reports none).

Times: ``wall_time`` is the whole call (graph building, compilation, optimisation,
sampling, post-processing). PyMC's default backend is numba, which compiles each function
just in time at its first call (and caches it on disk, so a second process is much faster:
time a cold and a warm cache apart). For DADVI, ``compile_time`` is PyTensor's compilation
of the objective, gradient and Hessian-vector product plus the first call of each (the JIT;
``info["first_call_time"]``) and ``optimise_time`` the rest of the time inside the
optimiser. For Pathfinder they are pymc-extras' own ``compile_time`` (building the per-path
functions, before the JIT) and ``compute_time`` (running the paths: worker start-up and each
worker's JIT included, paths in parallel); the first-call time of each path is in
``info["first_call_time"]``.
"""

from __future__ import annotations

import inspect
import json
import os
import tempfile
import time

from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np


@dataclass
class AnchorResult:
    """One anchor fit: constrained draws ``{var: (S, ...)}``, cost and what it reports."""

    method: str
    draws: dict[str, np.ndarray]
    wall_time: float
    compile_time: float | None = None
    optimise_time: float | None = None
    grad_evals: int = 0  # log-density gradients (one point each)
    hvp_evals: int = 0  # log-density Hessian-vector products (DADVI)
    logp_evals: int = 0  # log densities without gradient (Pathfinder's ELBO draws)
    status: str = "ok"
    info: dict[str, Any] = field(default_factory=dict)


class _Counted:
    """A compiled function that counts its calls and, with ``rows_arg``, the rows of that
    argument (the number of points evaluated)."""

    def __init__(self, fn: Callable, rows_arg: int | None = None):
        self.fn = fn
        self.rows_arg = rows_arg
        self.calls = 0
        self.rows: list[int] = []
        self.first_call = 0.0  # seconds: includes numba's just-in-time compilation

    def __call__(self, *args):
        self.calls += 1
        if self.rows_arg is not None:
            self.rows.append(len(args[self.rows_arg]))
        if self.calls > 1:
            return self.fn(*args)
        t0 = time.perf_counter()
        out = self.fn(*args)
        self.first_call = time.perf_counter() - t0
        return out


def posterior_draws(idata) -> dict[str, np.ndarray]:
    """The ``posterior`` group of a DataTree as ``{var: (chain * draw, ...)}``."""
    posterior = idata["posterior"].to_dataset()
    out = {}
    for name, da in posterior.data_vars.items():
        values = np.asarray(da.transpose("chain", "draw", ...))
        out[str(name)] = values.reshape(-1, *values.shape[2:])
    return out


def _default(fn: Callable, name: str) -> Any:
    return inspect.signature(fn).parameters[name].default


def _failed(method: str, start: float, err: BaseException) -> AnchorResult:
    return AnchorResult(
        method, {}, time.perf_counter() - start, status=f"error: {type(err).__name__}: {err}"
    )


def run_dadvi(model, random_seed: int | None = None) -> AnchorResult:
    """``pymc_extras.inference.fit_dadvi(model, random_seed=..., progressbar=False)``."""
    from pymc_extras.inference import fit_dadvi
    from pymc_extras.inference.dadvi import dadvi as module

    n_fixed = _default(fit_dadvi, "n_fixed_draws")
    made: list[_Counted | None] = []
    clock = {"compile": 0.0, "optimise": 0.0}
    compile_funcs, minimize = module.scipy_optimize_funcs_from_loss, module.minimize

    def counted_compile(*args, **kwargs):
        t0 = time.perf_counter()
        fused, hessp = compile_funcs(*args, **kwargs)
        clock["compile"] += time.perf_counter() - t0
        made[:] = [_Counted(fused), None if hessp is None else _Counted(hessp)]
        return made[0], made[1]

    def timed_minimize(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return minimize(*args, **kwargs)
        finally:
            clock["optimise"] += time.perf_counter() - t0

    start = time.perf_counter()
    try:
        with ExitStack() as stack:
            stack.enter_context(
                mock.patch.object(module, "scipy_optimize_funcs_from_loss", counted_compile)
            )
            stack.enter_context(mock.patch.object(module, "minimize", timed_minimize))
            idata = fit_dadvi(model, random_seed=random_seed, progressbar=False)
        wall = time.perf_counter() - start
        draws = posterior_draws(idata)
    except Exception as err:
        return _failed("dadvi", start, err)
    opt = idata["optimizer_result"].to_dataset()
    info: dict[str, Any] = {"n_fixed_draws": n_fixed}
    for key in ("method", "success", "status", "message", "nit", "nfev", "njev", "nhev", "fun"):
        if key in opt:
            info[key] = opt[key].values.item()
    fused, hessp = made
    jit = fused.first_call + (0.0 if hessp is None else hessp.first_call)
    info["first_call_time"] = jit
    return AnchorResult(
        "dadvi",
        draws,
        wall,
        compile_time=clock["compile"] + jit,
        optimise_time=clock["optimise"] - jit,
        grad_evals=n_fixed * fused.calls,
        hvp_evals=0 if hessp is None else n_fixed * hessp.calls,
        status="ok" if info.get("success", True) else f"not converged: {info.get('message')}",
        info=info,
    )


def _status_counts(da) -> dict[str, int]:
    """A pymc-extras status-count DataArray as ``{status: count}`` (non-zero counts only)."""
    labels = np.asarray(da[da.dims[0]]).tolist()
    return {str(k): int(v) for k, v in zip(labels, np.asarray(da).tolist(), strict=True) if v}


def run_pathfinder(model, random_seed: int | None = None) -> AnchorResult:
    """``pymc_extras.inference.fit_pathfinder(model, random_seed=..., progressbar=False)``.

    The default ``parallel=True`` runs the paths in worker processes (``min(4, cores,
    num_paths)`` at a time, the platform's default start method: fork on Linux)."""
    from pymc_extras.inference import fit_pathfinder
    from pymc_extras.inference.pathfinder import multipath, single_path

    grad_factory = single_path.get_neg_logp_dlogp_of_ravel_inputs
    sample_factory = single_path.make_pathfinder_sample_fn
    make_path = multipath.make_single_pathfinder_fn
    made: dict[str, _Counted] = {}

    def counted_grad_factory(*args, **kwargs):
        made["grad"] = _Counted(grad_factory(*args, **kwargs))
        return made["grad"]

    def counted_sample_factory(*args, **kwargs):  # (x, g, alpha, s, z, u (M, N))
        made["sample"] = _Counted(sample_factory(*args, **kwargs), rows_arg=5)
        return made["sample"]

    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:

        def counting_make_path(*args, **kwargs):
            path_fn = make_path(*args, **kwargs)
            grad, sample, n_elbo = made["grad"], made["sample"], kwargs["num_elbo_draws"]

            def counted_path(seed, progress_callback=None):
                calls, done = grad.calls, len(sample.rows)
                try:
                    return path_fn(seed, progress_callback)
                finally:  # in the worker process: report this path's counts to the parent
                    rows = sample.rows[done:]
                    counts = {
                        "first_call": (grad.first_call if calls == 0 else 0.0)
                        + (sample.first_call if done == 0 else 0.0),
                        "grad": grad.calls - calls,
                        "elbo": sum(r for r in rows if r == n_elbo),
                        "final": sum(r for r in rows if r != n_elbo),
                    }
                    name = f"{os.getpid()}-{seed}.json"
                    (Path(tmp) / name).write_text(json.dumps(counts))

            return counted_path

        try:
            with ExitStack() as stack:
                patch = stack.enter_context
                patch(
                    mock.patch.object(
                        single_path, "get_neg_logp_dlogp_of_ravel_inputs", counted_grad_factory
                    )
                )
                patch(
                    mock.patch.object(
                        single_path, "make_pathfinder_sample_fn", counted_sample_factory
                    )
                )
                patch(mock.patch.object(multipath, "make_single_pathfinder_fn", counting_make_path))
                idata = fit_pathfinder(model, random_seed=random_seed, progressbar=False)
            wall = time.perf_counter() - start
            draws = posterior_draws(idata)
        except Exception as err:
            return _failed("pathfinder", start, err)
        paths = [json.loads(f.read_text()) for f in Path(tmp).glob("*.json")]

    pf = idata["pathfinder"].to_dataset()
    lbfgs = idata["lbfgs"].to_dataset()
    info: dict[str, Any] = {
        "paths_counted": len(paths),
        "logp_evals_final": sum(p["final"] for p in paths),
        "first_call_time": [round(p["first_call"], 2) for p in paths],
        "warnings": list(pf.attrs.get("warnings", [])),
    }
    for key in ("pareto_k", "num_paths", "num_successful_paths", "elbo_argmax"):
        if key in pf:
            info[key] = np.asarray(pf[key]).tolist()
    if "niter" in lbfgs:
        info["lbfgs_niter"] = np.asarray(lbfgs["niter"]).tolist()
    if "path_status_counts" in pf:
        info["path_status"] = _status_counts(pf["path_status_counts"])
    if "status_counts" in lbfgs:
        info["lbfgs_status"] = _status_counts(lbfgs["status_counts"])
    return AnchorResult(
        "pathfinder",
        draws,
        wall,
        compile_time=float(pf["compile_time"]) if "compile_time" in pf else None,
        optimise_time=float(pf["compute_time"]) if "compute_time" in pf else None,
        grad_evals=sum(p["grad"] for p in paths),
        logp_evals=sum(p["elbo"] for p in paths),
        info=info,
    )
