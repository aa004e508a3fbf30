"""Wasserstein variational gradient descent (WVGD)."""

from pymc_gpf.wvgd.method import WVGD, WVGDApproximation

__all__ = ["WVGD", "WVGDApproximation"]
