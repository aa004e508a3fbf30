"""GF's constructor options."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pymc_gpf.checks import is_integer, positive
from pymc_gpf.config import MethodConfig
from pymc_gpf.options import AUTO

__all__ = ["GFConfig"]


@dataclass(frozen=True)
class GFConfig(MethodConfig):
    """See :class:`pymc_gpf.GF` for each option. ``rank`` is checked against the model's
    dimension and structure when the factors are built."""

    rank: int | None = None
    draws_per_step: int | str = AUTO
    structure: str | Sequence[Sequence[str]] = AUTO
    natural_mean: bool | None = None
    init: str = "initial_point"
    init_scale: float = 0.1

    def __post_init__(self):
        draws = AUTO if self.draws_per_step is None else self.draws_per_step
        if draws != AUTO and not is_integer(draws, 1):
            raise ValueError(
                f"draws_per_step must be 'auto' or an integer >= 1 (draws of q per step), got "
                f"{draws!r}."
            )
        self._normalise(
            rank=int(self.rank) if is_integer(self.rank, 0) else self.rank,
            draws_per_step=draws if draws == AUTO else int(draws),
            natural_mean=None if self.natural_mean is None else bool(self.natural_mean),
            init_scale=positive("init_scale", self.init_scale),
        )
