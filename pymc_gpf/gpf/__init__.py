"""Gaussian Particle Flow (GPF)."""

from pymc_gpf.gpf.method import GPF, GPFApproximation

__all__ = ["GPF", "GPFApproximation"]
