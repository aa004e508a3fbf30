"""Gaussian Flow (GF)."""

from pymc_gpf.gf.method import GF, GFApproximation, fit_inside

__all__ = ["GF", "GFApproximation", "fit_inside"]
