"""The ensembles' constructor options."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pymc_gpf.checks import is_integer, positive
from pymc_gpf.config import MethodConfig

__all__ = ["ENSEMBLE_INITS", "KINDS", "EnsembleConfig"]

KINDS = ("deep", "langevin", "repulsive")
ENSEMBLE_INITS = ("auto", "gaussian", "initial_point", "map")


@dataclass(frozen=True)
class EnsembleConfig(MethodConfig):
    """See :class:`pymc_gpf.Ensemble` for each option."""

    kind: str = "langevin"
    n_particles: int = 20
    temperature: float = 1.0
    repulsion: float = 1.0
    bandwidth: float | str = "median"
    init: str = "auto"
    init_scale: float = 1.0
    thin: int = 1
    target_ess: int | str = "auto"
    precondition: bool = True

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}.")
        if not is_integer(self.n_particles, 2):
            raise ValueError(
                f"n_particles must be an integer >= 2 (the ensemble's members; R-hat needs "
                f"two chains), got {self.n_particles!r}."
            )
        if self.init not in ENSEMBLE_INITS:
            raise ValueError(f"init must be one of {ENSEMBLE_INITS}, got {self.init!r}.")
        if self.bandwidth != "median":
            self._normalise(bandwidth=positive("bandwidth", self.bandwidth))
        if not is_integer(self.thin, 1):
            raise ValueError(f"thin must be a positive integer, got {self.thin!r}.")
        if self.target_ess != "auto" and not is_integer(self.target_ess, 1):
            raise ValueError(
                f"target_ess must be 'auto' or a positive integer, got {self.target_ess!r}."
            )
        if not isinstance(self.precondition, bool | np.bool_):
            raise ValueError(f"precondition must be True or False, got {self.precondition!r}.")
        self._normalise(
            precondition=bool(self.precondition),
            n_particles=int(self.n_particles),
            temperature=positive("temperature", self.temperature),
            repulsion=positive("repulsion", self.repulsion),
            init_scale=positive("init_scale", self.init_scale),
            thin=int(self.thin),
        )
        if self.target_ess != "auto":
            self._normalise(target_ess=int(self.target_ess))

    @property
    def resolved_init(self) -> str:
        """``"auto"`` is ``"initial_point"``: particles spread around one point reach every
        mode near it, so that chains stuck in different modes show in R-hat (started at
        draws of a Gaussian fit, ``"gaussian"``, they burn in faster but all sit in its
        mode, and a mode q never visits is invisible to its own importance check)."""
        return "initial_point" if self.init == "auto" else self.init

    @property
    def temperature_used(self) -> float:
        """``lambda2``: 0 for the deep ensemble (no noise, no entropy)."""
        return 0.0 if self.kind == "deep" else self.temperature

    @property
    def repulsion_used(self) -> float:
        """``lambda1``: the MMD weight, for the repulsive kind only."""
        return self.repulsion if self.kind == "repulsive" else 0.0
