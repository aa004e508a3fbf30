"""Results as ArviZ 1.x data: an ``xarray.DataTree`` laid out as PyMC and pymc-extras do.

Groups: ``posterior`` (chain=1, draw), ``observed_data``, ``constant_data`` (as
``pm.sample``), ``fit`` (the optimisation trace on a ``step`` dim, as pymc-extras' ADVI) and
one group named after the method with its fitted state and settings.
"""

from __future__ import annotations

import warnings

from types import SimpleNamespace
from typing import Any

import numpy as np
import pymc as pm
import xarray as xr

from arviz_base import dict_to_dataset
from pymc.backends.arviz import (
    coords_and_dims_for_inferencedata,
    dict_to_dataset_drop_incompatible_coords,
    find_constants,
    find_observations,
)

from pymc_gpf.version import __version__

__all__ = ["build_datatree", "fit_group", "settings_attrs"]


def fit_group(
    method: str, free_energy: np.ndarray, step_size: np.ndarray, attrs: dict[str, Any]
) -> xr.Dataset:
    """The optimisation trace on a ``step`` dim (pymc-extras' convention): the free energy
    and the step size of every step; how the fit ended in the attributes."""
    n = len(free_energy)
    return xr.Dataset(
        {
            "free_energy": ("step", np.asarray(free_energy, dtype=float)),
            "step_size": ("step", np.asarray(step_size, dtype=float)[:n]),
        },
        coords={"step": np.arange(n)},
        attrs={
            "method": method,
            "definition": "free energy = -ELBO (full-data scale)",
            **settings_attrs(attrs),
        },
    )


# what ArviZ records as the inference library (its name and version), without importing the
# package root from inside it
LIBRARY = SimpleNamespace(__name__="pymc_gpf", __version__=__version__)


def settings_attrs(settings: dict[str, Any]) -> dict[str, Any]:
    """Settings as netCDF-safe attributes (numbers, strings; None and objects as text)."""
    out = {}
    for key, value in settings.items():
        if isinstance(value, bool):
            out[key] = str(value)
        elif isinstance(value, int | float | str | np.integer | np.floating):
            out[key] = value
        elif isinstance(value, tuple | list) and all(isinstance(v, int | float) for v in value):
            out[key] = np.asarray(value)
        else:
            out[key] = repr(value)
    return out


def build_datatree(
    model: pm.Model,
    posterior: dict[str, np.ndarray] | None,
    *,
    fit: xr.Dataset,
    method: str,
    method_group: xr.Dataset,
    chains: bool = False,
) -> xr.DataTree:
    """Assemble the DataTree; ``posterior`` values have a leading draw axis, or leading
    chain and draw axes with ``chains`` (``None``: no posterior group)."""
    coords, dims = coords_and_dims_for_inferencedata(model)
    groups = {}
    if posterior is not None:
        with warnings.catch_warnings():
            # an ensemble's chains are its particles: more chains than draws is by design
            warnings.filterwarnings("ignore", "Found chain dimension to be longer", UserWarning)
            groups["posterior"] = dict_to_dataset_drop_incompatible_coords(
                {name: value if chains else value[None, ...] for name, value in posterior.items()},
                inference_library=LIBRARY,
                coords=coords,
                dims=dims,
            )
    groups |= {
        "fit": fit,
        method: method_group,
    }
    for name, values in (
        ("observed_data", find_observations(model)),
        ("constant_data", find_constants(model)),
    ):
        if values:
            groups[name] = dict_to_dataset(
                values, inference_library=LIBRARY, coords=coords, dims=dims, sample_dims=[]
            )
    return xr.DataTree.from_dict({f"/{k}": v for k, v in groups.items()})
