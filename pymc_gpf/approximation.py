"""What ``pm.fit`` returns: the fitted approximation, with PyMC's ``Approximation`` interface.

Common to all methods: ``hist`` (the free-energy trace), ``sample`` (an ArviZ DataTree),
``refine``, ``params`` (for PyMC's callbacks). Each method adds how to draw from its q and
what goes into its own DataTree group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import xarray as xr

from arviz_base import dict_to_dataset

from pymc_gpf.datatree import build_datatree, settings_attrs

if TYPE_CHECKING:
    from pymc_gpf.engine import FlowInference

__all__ = ["FlowApproximation"]


class FlowApproximation:
    """Base class of fitted approximations (see :class:`pymc_gpf.GPFApproximation`)."""

    def __init__(self, inference: FlowInference):
        self.inference = inference
        self._constrained_fns: dict[Any, Any] = {}

    # -------------------------------------------------------------- PyMC's interface
    @property
    def model(self):
        return self.inference.model

    @property
    def target(self):
        return self.inference.target

    @property
    def hist(self) -> np.ndarray:
        """The free-energy trace (``-ELBO``, full-data scale), one value per step."""
        return self.inference.hist

    @property
    def free_energy(self) -> float:
        """The last recorded free energy (``nan`` before any step)."""
        return float(self.hist[-1]) if len(self.hist) else float("nan")

    @property
    def params(self) -> list:
        """The shared variables holding the fitted state."""
        raise NotImplementedError

    def refine(self, n: int, **kwargs):
        """Continue fitting for ``n`` more steps (same settings)."""
        self.inference.refine(n, **kwargs)
        return self

    # --------------------------------------------------------------------- sampling
    def _draw(self, draws: int, rng: np.random.Generator) -> np.ndarray:
        """``draws`` points of q in flat unconstrained space, shape ``(draws, D)``."""
        raise NotImplementedError

    def _method_group(self) -> xr.Dataset:
        raise NotImplementedError

    def constrained(self, flat: np.ndarray, include_transformed: bool = False) -> dict:
        """Flat unconstrained points ``(S, D)`` as constrained variables and deterministics."""
        options = self.inference.fit_options
        backend = options.backend if options is not None else None
        key = (bool(include_transformed), backend)
        if key not in self._constrained_fns:
            self._constrained_fns[key] = self.target.compile_constrained(
                include_transformed, backend=backend
            )
        return self._constrained_fns[key](flat)

    def sample(
        self,
        draws: int = 500,
        *,
        random_seed=None,
        return_inferencedata: bool = True,
        include_transformed: bool | None = None,
    ):
        """Draw from the fitted q; an ArviZ DataTree as ``approx.sample`` in PyMC.

        Groups: ``posterior`` (chain=1, draw; free variables and deterministics),
        ``observed_data``, ``constant_data``, ``fit`` (``free_energy`` on ``step``) and the
        method's own group. With ``return_inferencedata=False`` a dict of arrays.
        """
        from pymc_gpf.engine import seed_sequence

        if isinstance(draws, bool) or not isinstance(draws, int | np.integer) or draws < 1:
            raise ValueError(f"draws must be a positive integer, got {draws!r}.")
        if include_transformed is None:
            options = self.inference.fit_options
            include_transformed = bool(options and options.include_transformed)
        rng = np.random.default_rng(seed_sequence(random_seed))
        values = self.constrained(self._draw(int(draws), rng), include_transformed)
        if not return_inferencedata:
            return values
        return build_datatree(
            self.model,
            values,
            free_energy=self.hist,
            method=self.inference.name,
            method_group=self._method_group(),
        )

    def _points_dataset(
        self, points: np.ndarray, dim: str, settings: dict[str, Any], extra: dict | None = None
    ) -> xr.Dataset:
        """A method group: ``points`` in constrained space on ``dim``, the same points
        unconstrained on ``(dim, coordinate)``, and the settings as attributes."""
        from pymc.backends.arviz import coords_and_dims_for_inferencedata

        coords, dims = coords_and_dims_for_inferencedata(self.model)
        values = self.constrained(points)
        ds = dict_to_dataset(values, coords=coords, dims=dims, sample_dims=[dim])
        ds = ds.assign(
            unconstrained=xr.DataArray(
                points, dims=(dim, "coordinate"), coords={"coordinate": self.target.labels}
            ),
            **(extra or {}),
        )
        ds.attrs = settings_attrs(settings)
        return ds
