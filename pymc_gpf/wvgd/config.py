"""WVGD's constructor options."""

from __future__ import annotations

from dataclasses import dataclass

from pymc_gpf.checks import is_integer, positive
from pymc_gpf.config import MethodConfig

__all__ = ["WVGDConfig"]


@dataclass(frozen=True)
class WVGDConfig(MethodConfig):
    """See :class:`pymc_gpf.WVGD` for each option."""

    n_particles: int = 5
    draws_per_particle: int = 50
    init_scale: float = 0.1
    init: str = "initial_point"
    weight_memory: float = 100.0

    def __post_init__(self):
        if not is_integer(self.n_particles, 1):
            raise ValueError(f"n_particles must be an integer >= 1, got {self.n_particles!r}.")
        if not is_integer(self.draws_per_particle, 1):
            raise ValueError(
                f"draws_per_particle must be an integer >= 1 (draws per particle and step), "
                f"got {self.draws_per_particle!r}."
            )
        scale = positive("init_scale", self.init_scale)
        if not (positive("weight_memory", self.weight_memory) >= 1):
            raise ValueError(f"weight_memory must be >= 1 step, got {self.weight_memory!r}.")
        self._normalise(
            n_particles=int(self.n_particles),
            draws_per_particle=int(self.draws_per_particle),
            init_scale=scale,
            weight_memory=float(self.weight_memory),
        )
