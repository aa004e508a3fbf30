"""What the result modules read of a fitted approximation, as a structural type.

:mod:`pymc_gpf.diagnostics` and :mod:`pymc_gpf.persistence` work on any
:class:`~pymc_gpf.approximation.FlowApproximation`, which itself calls them (``sample(psis=True)``,
``save``): they name this protocol rather than the class, so imports only point down.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import pymc as pm
import xarray as xr

__all__ = ["FittedApproximation", "Method"]


class FittedApproximation(Protocol):
    """A fitted pymc-gpf approximation (:class:`~pymc_gpf.approximation.FlowApproximation`)."""

    inference: Any  # the FlowInference that fitted it
    diagnosis: Any  # the last pymc_gpf.diagnose result, or None

    @property
    def model(self) -> pm.Model: ...

    @property
    def target(self) -> Any: ...

    @property
    def hist(self) -> np.ndarray: ...

    def gaussian(self) -> Any: ...

    def proposal(self, ridge: bool | float | None, rng: np.random.Generator) -> Any: ...

    def log_density(self, points: np.ndarray) -> np.ndarray: ...

    def refine(self, n: int, **kwargs) -> Any: ...

    def sample(self, draws: int = ..., **kwargs) -> Any: ...

    def fit_group(self) -> xr.Dataset: ...

    def method_group(self) -> xr.Dataset: ...


class Method(Protocol):
    """What a method provides to the engine (:class:`pymc_gpf.engine.FlowInference`), the
    registry, persistence and diagnostics. A subclass of ``FlowInference`` that sets
    ``name`` and defines these is a complete method (``tests/test_toy_method.py`` is one
    in a single module)."""

    name: str
    config: Any  # a frozen pymc_gpf.config.MethodConfig: the constructor's options

    def _initialise(self) -> Any:
        """The approximation at the starting point (its ``params`` hold the fitted state)."""

    def _build_step(self, options: Any) -> Any:
        """One iteration for the fit keywords ``options`` (:class:`pymc_gpf.options.FitOptions`):
        the method's pure ``step(state, noise, target, ...) -> (State, Info)`` applied to
        its state in shared variables, as ``StepGraph(state, new, info)``
        (:mod:`pymc_gpf.stepgraph`)."""

    def _evaluations_per_step(self) -> tuple[int, int]:
        """Points where one step evaluates the log-density with its gradient, and without."""
