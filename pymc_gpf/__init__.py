"""pymc-gpf: particle and Gaussian-flow variational inference for PyMC models.

``import pymc_gpf`` makes ``pm.fit(method="gpf")``, ``"gf"``, ``"wvgd"`` and ``"ensemble"``
available (``pymc_gpf.unregister()`` undoes it).
"""

from pymc_gpf import optimizers
from pymc_gpf.diagnostics import Diagnosis, diagnose
from pymc_gpf.ensemble import Ensemble, EnsembleApproximation
from pymc_gpf.errors import (
    CheckpointError,
    DivergenceError,
    FitWarning,
    InitialPointError,
    ModelNotSupportedError,
)
from pymc_gpf.gf import GF, GFApproximation
from pymc_gpf.gpf import GPF, GPFApproximation
from pymc_gpf.persistence import load
from pymc_gpf.registry import register, register_method, unregister
from pymc_gpf.target import BatchedTarget
from pymc_gpf.verdict import Verdict
from pymc_gpf.version import __version__
from pymc_gpf.wvgd import WVGD, WVGDApproximation

__all__ = [
    "GF",
    "GPF",
    "WVGD",
    "BatchedTarget",
    "CheckpointError",
    "Diagnosis",
    "DivergenceError",
    "Ensemble",
    "EnsembleApproximation",
    "FitWarning",
    "GFApproximation",
    "GPFApproximation",
    "InitialPointError",
    "ModelNotSupportedError",
    "Verdict",
    "WVGDApproximation",
    "__version__",
    "diagnose",
    "load",
    "optimizers",
    "register",
    "register_method",
    "unregister",
]

register_method("gpf", GPF)
register_method("gf", GF)
register_method("wvgd", WVGD)
register_method("ensemble", Ensemble)
register()
