"""Gaussian Flow (GF)."""

from pymc_gpf.gf.method import GF, GFApproximation, arrow_points, fit_inside, model_locals

__all__ = ["GF", "GFApproximation", "arrow_points", "fit_inside", "model_locals"]
