"""Exceptions raised by pymc-gpf, each naming what to fix."""

from __future__ import annotations

from typing import Any


class ModelNotSupportedError(ValueError):
    """The model has no free variables, or has some no flow can move (discrete ones)."""


class InitialPointError(ValueError):
    """The log-density or its gradient is not finite at the initial particles."""


class CheckpointError(ValueError):
    """A file or DataTree given to :func:`pymc_gpf.load` is not a pymc-gpf checkpoint, is
    truncated or corrupted (its checksum does not match), or was written by another format
    version; nothing of it is loaded."""


class DivergenceError(FloatingPointError):
    """A step produced non-finite values; the approximation keeps the last finite state.

    ``approx`` is that approximation: ``err.approx.refine(n)`` continues from it once a
    smaller ``learning_rate`` (or ``clip_norm``) has been set with ``err.approx.fit(...)``.
    """

    def __init__(self, message: str, approx: Any = None):
        super().__init__(message)
        self.approx = approx


class FitWarning(UserWarning):
    """A fit that should not be trusted as it is: it did not converge, or q cannot
    represent the posterior (``approx.outcome.verdict``). The message names the cause and
    a remedy."""
