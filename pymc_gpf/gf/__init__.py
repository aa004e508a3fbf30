"""Gaussian Flow (GF)."""

from pymc_gpf.gf.method import GF, GFApproximation

__all__ = ["GF", "GFApproximation"]
