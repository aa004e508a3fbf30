"""A method's constructor options: a frozen dataclass that checks and normalises itself.

A method reads its options from ``inference.config`` (as given; never replaced) and
``inference.resolved`` (as the fit resolved them, e.g. a particle count; set at construction,
and again where ``pm.fit``'s ``random_seed`` or ``start`` restart an inference not yet fitted;
never replaced once it has fitted: what changes later, the start narrowed mid-fit or a loaded
fit's init, is in ``inference.adjusted``); the engine saves ``options_in_effect.options()``
(the two together) with a fit and rebuilds the method from them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

__all__ = ["MethodConfig"]


@dataclass(frozen=True)
class MethodConfig:
    """Base of the methods' configs; subclasses check their fields in ``__post_init__``."""

    def options(self) -> dict[str, Any]:
        """The options as JSON-able constructor keywords (what a saved fit rebuilds from)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def _normalise(self, **values: Any) -> None:
        """Store checked values (``__post_init__`` of a frozen dataclass)."""
        for name, value in values.items():
            object.__setattr__(self, name, value)
