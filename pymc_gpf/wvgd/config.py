"""WVGD's constructor options."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pymc_gpf.checks import is_integer, positive
from pymc_gpf.config import MethodConfig

__all__ = ["DEFAULT_INIT_SCALE", "WVGDConfig"]

DEFAULT_INIT_SCALE = 0.1


@dataclass(frozen=True)
class WVGDConfig(MethodConfig):
    """See :class:`pymc_gpf.WVGD` for each option."""

    @property
    def spread(self) -> float:
        """The initial spread of the particles and sd of the local Gaussians."""
        return DEFAULT_INIT_SCALE if self.init_scale is None else self.init_scale

    n_particles: int = 5
    draws_per_particle: int = 50
    init_scale: float | None = None  # None: DEFAULT_INIT_SCALE, in GF's sds when whitening
    init: str = "initial_point"
    weight_memory: float = 100.0
    whiten: bool = True

    def __post_init__(self):
        if not is_integer(self.n_particles, 1):
            raise ValueError(f"n_particles must be an integer >= 1, got {self.n_particles!r}.")
        if not is_integer(self.draws_per_particle, 1):
            raise ValueError(
                f"draws_per_particle must be an integer >= 1 (draws per particle and step), "
                f"got {self.draws_per_particle!r}."
            )
        scale = None if self.init_scale is None else positive("init_scale", self.init_scale)
        if not isinstance(self.whiten, bool | np.bool_):
            raise ValueError(f"whiten must be True or False, got {self.whiten!r}.")
        if not (positive("weight_memory", self.weight_memory) >= 1):
            raise ValueError(f"weight_memory must be >= 1 step, got {self.weight_memory!r}.")
        self._normalise(
            n_particles=int(self.n_particles),
            draws_per_particle=int(self.draws_per_particle),
            init_scale=scale,
            weight_memory=float(self.weight_memory),
            whiten=bool(self.whiten),
        )
