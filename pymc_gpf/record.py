"""What a fit has done, over all its ``fit`` and ``refine`` calls: the one record the engine
keeps, persistence saves and restores, and each run of the loop (:func:`pymc_gpf.loop.run_steps`)
returns a fragment of, which the engine merges into it."""

from __future__ import annotations

import json

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import xarray as xr

from pymc_gpf.control import Outcome

__all__ = ["ARRAYS", "FitRecord"]

ARRAYS = ("step_size", "hyper_trace")  # the record's arrays in a checkpoint


def _empty() -> np.ndarray:
    return np.zeros(0)


@dataclass
class FitRecord:
    """The free energy and step size of every accepted step, how the last call ended
    (``outcome``), the cost so far (``gradient_evaluations``: points where the log-density
    and its gradient were evaluated; ``density_evaluations``: without gradient) and, with
    ``more_obj_params``, their flat values after every step (``hyper_trace``).

    A fragment of one run of the loop also says why it stopped (``reason``), the step
    (counted over all runs) whose move failed (``failure``) and whether the guard rolled back
    the step before that one too (``rolled_back``); :meth:`merge` adds it to the fit's
    record."""

    free_energy: np.ndarray = field(default_factory=_empty)
    step_sizes: np.ndarray = field(default_factory=_empty)
    outcome: Outcome | None = None
    gradient_evaluations: int = 0
    density_evaluations: int = 0
    hyper_trace: list[np.ndarray] = field(default_factory=list)
    # one run of the loop, as it ended (a fragment; not saved)
    reason: str = "max_steps"
    failure: int | None = None
    rolled_back: bool = False

    @property
    def steps(self) -> int:
        return len(self.free_energy)

    def count(self, gradients: int = 0, densities: int = 0) -> None:
        """Add evaluations of the log-density with (``gradients``) and without its gradient."""
        self.gradient_evaluations += int(gradients)
        self.density_evaluations += int(densities)

    def extend(self, free_energies: np.ndarray, step_sizes: np.ndarray, drop_last: bool) -> None:
        """Append one run's steps; ``drop_last``: the guard rolled back the step before the
        run's failure too, so its entries (and its hyperparameters') go."""
        hist = np.concatenate([self.free_energy, free_energies])
        sizes = np.concatenate([self.step_sizes, step_sizes])
        if drop_last and len(hist):
            hist, sizes = hist[:-1], sizes[:-1]
            if self.hyper_trace:
                self.hyper_trace.pop()
        self.free_energy, self.step_sizes = hist, sizes

    def merge(self, run: FitRecord) -> None:
        """Add one run's fragment: its steps (less the one its guard rolled back) and its
        evaluations."""
        self.extend(run.free_energy, run.step_sizes, run.rolled_back)
        self.count(run.gradient_evaluations, run.density_evaluations)

    def conclude(self, outcome: Outcome) -> None:
        self.outcome = outcome

    def judged(self, verdict: str, message: str, checks: dict[str, Any]) -> None:
        """The verdict on the fit as it ended (:mod:`pymc_gpf.verdict`)."""
        self.outcome = replace(self.outcome, verdict=verdict, verdict_message=message,
                               checks=checks)  # fmt: skip

    # ------------------------------------------------------------------------ persistence
    def checkpoint(self) -> tuple[dict[str, xr.DataArray], dict[str, Any]]:
        """The record's arrays and (JSON-able) attributes in a saved checkpoint (the
        free-energy trace is the ``fit`` group's)."""
        arrays = {"step_size": xr.DataArray(np.asarray(self.step_sizes), dims=["step_size_dim0"])}
        if self.hyper_trace:
            arrays["hyper_trace"] = xr.DataArray(
                np.asarray(self.hyper_trace), dims=["hyper_trace_dim0", "hyper_trace_dim1"]
            )
        attrs = {
            "outcome": None if self.outcome is None else vars(self.outcome),
            "evaluations": [int(self.gradient_evaluations), int(self.density_evaluations)],
        }
        return arrays, attrs

    @classmethod
    def load(cls, free_energy: np.ndarray, checkpoint: xr.Dataset) -> FitRecord:
        """The record :meth:`checkpoint` saved."""
        attrs = checkpoint.attrs
        outcome = json.loads(attrs["outcome"])
        gradients, densities = json.loads(attrs["evaluations"])
        trace = checkpoint["hyper_trace"].values if "hyper_trace" in checkpoint else ()
        return cls(
            np.asarray(free_energy, dtype=float),
            np.asarray(checkpoint["step_size"].values, dtype=float),
            None if outcome is None else Outcome(**outcome),
            gradients,
            densities,
            list(np.asarray(trace, dtype=float)),
        )
