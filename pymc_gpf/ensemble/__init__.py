"""Deep, Langevin and repulsive Langevin ensembles (Wild et al., NeurIPS 2023)."""

from pymc_gpf.ensemble.method import Ensemble, EnsembleApproximation

__all__ = ["Ensemble", "EnsembleApproximation"]
