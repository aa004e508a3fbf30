"""GPF's constructor options."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pymc_gpf.checks import is_integer
from pymc_gpf.config import MethodConfig
from pymc_gpf.gpf.particles import check_init_scale, resolve_cloud
from pymc_gpf.options import AUTO

__all__ = ["GPFConfig"]


@dataclass(frozen=True)
class GPFConfig(MethodConfig):
    """See :class:`pymc_gpf.GPF` for each option. ``n_particles`` is checked against the
    model's dimension when the particles are drawn."""

    n_particles: int | str = AUTO
    structure: str | Sequence[Sequence[str]] = AUTO
    natural_mean: bool | None = None
    cloud: str = "auto"
    init: str = "initial_point"
    init_scale: float = 0.1

    def __post_init__(self):
        n = AUTO if self.n_particles is None else self.n_particles
        resolve_cloud(self.cloud, n)  # checks it
        self._normalise(
            n_particles=int(n) if is_integer(n, 0) else n,
            natural_mean=None if self.natural_mean is None else bool(self.natural_mean),
            init_scale=check_init_scale(self.init_scale),
        )

    @property
    def auto_particles(self) -> bool:
        """Whether the number of particles is chosen (and grown) by the fit."""
        return isinstance(self.n_particles, str) and self.n_particles == AUTO

    @property
    def resolved_cloud(self) -> str:
        """The starting cloud ``"auto"`` stands for: antithetic with the automatic
        ``n_particles``, random with a number."""
        return resolve_cloud(self.cloud, self.n_particles)
