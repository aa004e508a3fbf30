"""Where a fit starts: the model's initial point (updated by ``start``) or the MAP found
from there."""

from __future__ import annotations

import inspect

import numpy as np
import pymc as pm

from pymc_gpf.options import INITS
from pymc_gpf.target import BatchedTarget

__all__ = ["find_map", "initial_centre"]


def initial_centre(
    target: BatchedTarget, start: dict | None, init: str, rng: np.random.Generator
) -> np.ndarray:
    """The flat unconstrained starting point: the model's initial point (updated by
    ``start``) or, with ``init="map"``, the MAP found from there. ``rng`` seeds both."""
    if init not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {init!r}.")
    centre = target.start_vector(start, random_seed=rng.integers(2**30))
    if init == "map":
        centre = find_map(target, centre, start, int(rng.integers(2**30)))
    return centre


def find_map(target: BatchedTarget, centre: np.ndarray, start: dict | None, seed: int):
    """PyMC's ``find_MAP`` started exactly at ``centre`` (PyMC 6.4 and 6.3 spell it
    differently)."""
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
        if start:
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
