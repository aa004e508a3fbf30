"""Checks of user input and seeds shared by every module (imports nothing of the package)."""

from __future__ import annotations

import numbers
import warnings

from typing import Any

import numpy as np

__all__ = ["check_particles", "is_integer", "positive", "renamed", "seed_sequence"]


def positive(name: str, value: Any) -> float:
    """``value`` as a float, or a clear error if it is not a positive finite number."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not np.isfinite(value):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}.")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}.")
    return float(value)


def check_particles(particles, dtype: str, labels: list[str], symbol: str, at_least: int = 1):
    """Explicit starting particles ``(symbol, D)``, checked: at least ``at_least`` of them,
    finite, and (where the method needs a spread, ``at_least > 1``) not identical in any
    coordinate, where they would never separate."""
    particles = np.array(particles, dtype=dtype)
    d = len(labels)
    if particles.ndim != 2 or particles.shape[1] != d or particles.shape[0] < at_least:
        more = f" with {symbol} >= {at_least}" if at_least > 1 else ""
        raise ValueError(
            f"initial_particles must have shape ({symbol}, {d}){more} (flat unconstrained "
            f"coordinates {labels}), got {particles.shape}."
        )
    if not np.all(np.isfinite(particles)):
        raise ValueError("initial_particles contains non-finite values.")
    frozen = np.ptp(particles, axis=0) == 0
    if at_least > 1 and frozen.any():
        raise ValueError(
            f"initial_particles are identical along {np.asarray(labels)[frozen]}"
            "; particles that coincide in a coordinate never separate. Add noise."
        )
    return particles


def is_integer(value: Any, minimum: int) -> bool:
    """``value`` is an integer (not a bool) and at least ``minimum``."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= minimum


def seed_sequence(random_seed: Any) -> np.random.SeedSequence:
    """PyMC accepts ints, sequences of ints, SeedSequences and Generators as seeds."""
    if isinstance(random_seed, np.random.SeedSequence):
        return random_seed
    if isinstance(random_seed, np.random.Generator):
        return np.random.SeedSequence(int(random_seed.integers(2**63)))
    if isinstance(random_seed, np.random.RandomState):
        return np.random.SeedSequence(int(random_seed.randint(2**31)))
    return np.random.SeedSequence(random_seed)


def renamed(method: str, old: str, new: str, old_value: Any, new_value: Any, default: Any) -> Any:
    """The value of option ``new``, formerly called ``old``: the old name keeps working for
    one release, with a ``FutureWarning``."""
    if old_value is None:
        return new_value
    if new_value != default:
        raise TypeError(f"{method} got both {old}= (its old name) and {new}=; pass {new} only.")
    warnings.warn(
        f"{method}({old}=...) is now {method}({new}=...); {old} will be removed in the next "
        "release.",
        FutureWarning,
        stacklevel=3,
    )
    return old_value
