"""What the result modules read of a fitted approximation, as a structural type.

:mod:`pymc_gpf.diagnostics` and :mod:`pymc_gpf.persistence` work on any
:class:`~pymc_gpf.approximation.FlowApproximation`, which itself calls them (``sample(psis=True)``,
``save``): they name this protocol rather than the class, so imports only point down.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import numpy as np
import pymc as pm
import xarray as xr

from pymc_gpf.config import MethodConfig
from pymc_gpf.gaussian import GaussianQ
from pymc_gpf.options import FitOptions
from pymc_gpf.stepgraph import StepGraph
from pymc_gpf.structure import Structure
from pymc_gpf.target import BatchedTarget

__all__ = ["Density", "FittedApproximation", "Initialised", "Method"]


class Density(Protocol):
    """What importance sampling draws from (q, a Gaussian or WVGD's mixture): its
    dimension, draws and log-density on the flat coordinates."""

    @property
    def ndim(self) -> int: ...

    def sample(self, draws: int, rng: np.random.Generator) -> np.ndarray: ...

    def logpdf(self, points: np.ndarray) -> np.ndarray: ...


class FittedApproximation(Protocol):
    """A fitted pymc-gpf approximation (:class:`~pymc_gpf.approximation.FlowApproximation`)."""

    inference: Method  # the inference that fitted it (a pymc_gpf.engine.FlowInference)
    # the last pymc_gpf.diagnose result (a pymc_gpf.diagnostics.Diagnosis, which reads this
    # protocol), or None
    diagnosis: object | None

    @property
    def model(self) -> pm.Model: ...

    @property
    def target(self) -> BatchedTarget: ...

    @property
    def hist(self) -> np.ndarray: ...

    def gaussian(self) -> GaussianQ: ...

    def proposal(
        self, ridge: bool | float | None, rng: np.random.Generator
    ) -> tuple[Density | None, str | None]: ...  # (q to draw from or None, why not)

    def log_density(self, points: np.ndarray) -> np.ndarray: ...

    # log p for importance weights of the proposal's draws: log_density, or an estimate of
    # it (pymc_gpf.subsample; its rows from rng)
    def weights_log_density(
        self, proposal: Density, rng: np.random.Generator
    ) -> Callable[[np.ndarray], np.ndarray]: ...

    def refine(self, n: int, **kwargs) -> FittedApproximation: ...

    def sample(self, draws: int = ..., **kwargs) -> xr.DataTree: ...

    def fit_group(self) -> xr.Dataset: ...

    def method_group(self) -> xr.Dataset: ...


class Initialised(NamedTuple):
    """What a method's ``_initialise`` decided; the engine keeps each field as the
    inference's attribute of the same name (``approx``: the inference's ``approx``), at
    construction and again where ``pm.fit``'s ``random_seed`` or ``start`` reset a fit."""

    approx: FittedApproximation  # q at the start (its ``params`` hold the fitted state)
    # the options as the fit resolved them (GPF's particle count, GF's rank); None: ``config``
    resolved: MethodConfig | None = None
    structure: Structure | None = None  # q's block structure (GF, GPF)
    # what the method keeps over its fits besides the engine's record, one object whose
    # fields it updates (GPF's GPFState, WVGD's WVGDState, the ensemble's EnsembleStart)
    own: Any = None


class Method(Protocol):
    """What a method provides to the engine (:class:`pymc_gpf.engine.FlowInference`), the
    registry, persistence and diagnostics. A subclass of ``FlowInference`` that sets
    ``name`` and defines these is a complete method (``tests/test_toy_method.py`` is one
    in a single module)."""

    name: str
    config: MethodConfig  # the constructor's options, frozen (handed to the engine's __init__)
    resolved: MethodConfig  # the options as the fit resolved them (from _initialise's answer)

    def _initialise(self) -> Initialised:
        """Where the fit starts, decided from the inference as built (``config``, the
        start, the initial stream): the approximation and what else the method resolved,
        which the engine keeps. It assigns no attribute of the inference."""

    def _build_step(self, options: FitOptions) -> StepGraph | None:
        """One iteration for the fit keywords ``options`` (:class:`pymc_gpf.options.FitOptions`):
        the method's pure ``step(state, noise, target, rates, static) -> (State, Info)`` (one
        of its ``steps``) applied to its state in shared variables, as
        ``StepGraph(state, new, info)`` (:mod:`pymc_gpf.stepgraph`); ``None``: no step of its
        own, the method runs its fits elsewhere (``FlowInference.run_elsewhere``)."""
