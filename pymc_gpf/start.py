"""Where a fit starts: the model's initial point (updated by ``start``) or the MAP found
from there."""

from __future__ import annotations

import inspect

from collections.abc import Callable

import numpy as np
import pymc as pm

from pymc_gpf.errors import InitialPointError
from pymc_gpf.options import INITS
from pymc_gpf.target import BatchedTarget

__all__ = [
    "check_start",
    "curvature_scales",
    "find_map",
    "initial_centre",
    "initial_cloud",
    "nonfinite_gradient",
]

MAX_CURVATURE_DIM = 2048  # 2 D points of D numbers: at most 8.4 million


def check_start(target: BatchedTarget, centre: np.ndarray) -> None:
    """:class:`InitialPointError` naming the terms whose log-density is not finite at the
    starting point, found before anything is compiled for the fit (a function compiled
    without C code, in tens of milliseconds)."""
    point = target.point(centre)
    if np.isfinite(target.check_logp()(point)):
        return
    terms = target.explain_nonfinite(centre)
    names = [c.rv_name for c in target.coordinates]
    raise InitialPointError(
        f"The fit cannot start: at the model's initial point (updated by `start`) the "
        f"log-density is not finite for {terms or 'some terms'}. Give `start` values inside "
        f"each variable's support where the density is positive (e.g. start={{{names[0]!r}: "
        "...}), or change the variables' initval; init='map' starts its search from the "
        "same point, so it cannot help here."
    )


def initial_centre(
    target: BatchedTarget, start: dict | None, init: str, rng: np.random.Generator
) -> np.ndarray:
    """The flat unconstrained starting point: the model's initial point (updated by
    ``start``) or, with ``init="map"``, the MAP found from there. ``rng`` seeds both."""
    if init not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {init!r}.")
    centre = target.start_vector(start, random_seed=rng.integers(2**30))
    check_start(target, centre)
    if init == "map":
        centre = find_map(target, centre, start, int(rng.integers(2**30)))
    return centre


def nonfinite_gradient(target: BatchedTarget, point: np.ndarray) -> list[str]:
    """The free variables whose log-density gradient is not finite at ``point`` (flat,
    unconstrained), from a function compiled without C code (a few calls, on an error path)."""
    with np.errstate(all="ignore"):
        try:
            grad = target.quick_gradient()(np.asarray(point, dtype=target.dtype)[None, :])[0]
        except ArithmeticError:  # an Op that raises where C and NumPy give inf or nan
            return [c.rv_name for c in target.coordinates]
    return target.variables_at(~np.isfinite(grad))


def find_map(
    target: BatchedTarget, centre: np.ndarray, start: dict | None, seed: int,
    from_centre: bool = False,
):  # fmt: skip
    """PyMC's ``find_MAP`` started exactly at ``centre`` (PyMC 6.4 and 6.3 spell it
    differently; 6.3 takes the model's initial point unless ``start`` or ``from_centre``)."""
    if "initvals" in inspect.signature(pm.find_MAP).parameters:
        found = pm.find_MAP(
            initvals=target.point(centre),
            model=target.model,
            progressbar=False,
            jitter=False,  # start exactly where `start` / the initial point says
            random_seed=seed,
            return_inferencedata=True,
            idata_kwargs={"include_transformed": True},
        ).posterior
        point = {c.value_name: found[c.value_name].values[0, 0] for c in target.coordinates}
    else:  # PyMC 6.3: start values in constrained space, no jitter
        constrained_start = None
        if start or from_centre:
            constrained = target.compile_constrained()(centre[None, :])
            constrained_start = {c.rv_name: constrained[c.rv_name][0] for c in target.coordinates}
        point = pm.find_MAP(
            start=constrained_start,
            model=target.model,
            progressbar=False,
            seed=seed,
            include_transformed=True,
        )
    return target.flatten(point)


def initial_cloud(
    target: BatchedTarget,
    start: dict | None,
    rng: np.random.Generator,
    *,
    n_particles: int,
    init_scale: float,
    init: str,
    spread: Callable[[int, np.random.Generator], np.ndarray] | None = None,
    centre: np.ndarray | None = None,
) -> np.ndarray:
    """``n_particles`` points ``(N, D)`` around ``centre`` (default :func:`initial_centre`):
    the centre plus ``init_scale`` times deviations ``spread(N, rng)`` (default standard
    normal noise), in the target's dtype."""
    if centre is None:
        centre = initial_centre(target, start, init, rng)
    if spread is None:
        deviations = rng.standard_normal((n_particles, target.ndim))
    else:
        deviations = spread(n_particles, rng)
    return (centre + init_scale * deviations).astype(target.dtype)


def curvature_scales(
    values_and_gradients: Callable, centre: np.ndarray, scale: float, step: float
) -> np.ndarray:
    """Per coordinate ``min(scale, 1 / sqrt(-H_ii))``, ``H_ii`` the log-density's curvature
    at ``centre`` by central differences of its gradient (``2 D`` points in one batched
    call of ``values_and_gradients``, ``(S, D) -> (log p, gradient)``): a start no wider
    than the log-density allows in any coordinate (a slope on a predictor in the hundreds
    has a posterior sd of 1e-4). ``scale`` where the curvature is not finite and positive."""
    d = len(centre)
    offsets = step * np.eye(d)
    log_p, grad = values_and_gradients(np.concatenate([centre + offsets, centre - offsets]))
    diagonal = np.arange(d)
    curvature = -(grad[diagonal, diagonal] - grad[d + diagonal, diagonal]) / (2.0 * step)
    known = np.isfinite(log_p[:d]) & np.isfinite(log_p[d:]) & (curvature > 0)
    scales = np.full(d, float(scale))
    scales[known] = np.minimum(scale, 1.0 / np.sqrt(curvature[known]))
    return scales
