"""WVGD's constructor options."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pymc_gpf.checks import is_integer, positive
from pymc_gpf.config import MethodConfig
from pymc_gpf.options import AUTO

__all__ = ["DEFAULT_INIT_SCALE", "DEFAULT_PARTICLES", "WVGDConfig"]

DEFAULT_INIT_SCALE = 0.1
DEFAULT_PARTICLES = 5  # the cells of n_particles="auto" where one Gaussian is not enough


@dataclass(frozen=True)
class WVGDConfig(MethodConfig):
    """See :class:`pymc_gpf.WVGD` for each option."""

    @property
    def spread(self) -> float:
        """The initial spread of the particles and sd of the local Gaussians."""
        return DEFAULT_INIT_SCALE if self.init_scale is None else self.init_scale

    n_particles: int | str = AUTO
    draws_per_particle: int = 50
    init_scale: float | None = None  # None: DEFAULT_INIT_SCALE, in GF's sds when whitening
    init: str = "initial_point"
    weight_memory: float = 100.0
    whiten: bool = True

    @property
    def auto_particles(self) -> bool:
        """Whether the number of cells is chosen by the fit (one where the Gaussian fit it
        runs in is trustworthy, else :data:`DEFAULT_PARTICLES`)."""
        return isinstance(self.n_particles, str) and self.n_particles == AUTO

    @property
    def particles_at_start(self) -> int:
        """The particles the fit starts with."""
        return DEFAULT_PARTICLES if self.auto_particles else int(self.n_particles)

    def __post_init__(self):
        n = AUTO if self.n_particles is None else self.n_particles
        if not (is_integer(n, 1) or (isinstance(n, str) and n == AUTO)):
            raise ValueError(
                f"n_particles must be an integer >= 1 or 'auto' (the default), got {n!r}."
            )
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
            n_particles=n if isinstance(n, str) else int(n),
            draws_per_particle=int(self.draws_per_particle),
            init_scale=scale,
            weight_memory=float(self.weight_memory),
            whiten=bool(self.whiten),
        )
