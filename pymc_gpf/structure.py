"""Block structure of the Gaussian approximation (Galy-Fajou et al. 2021, §3.5).

The flat coordinates are partitioned into blocks; the linear part of the flow (and hence the
covariance) is block-diagonal, so blocks are independent under q. ``"full"`` is one block,
``"diagonal"`` is one block per coordinate (mean field), ``"variables"`` one block per PyMC
free variable (the paper's "GPF (Layers)"), and a list of lists of variable names groups
variables explicitly; variables not listed get a block each.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pytensor.tensor as pt

from pytensor.graph.basic import Variable

from pymc_gpf.target import BatchedTarget

__all__ = ["Structure", "assemble_columns", "parse_structure", "take_columns"]


@dataclass(frozen=True)
class Structure:
    """A partition of the ``ndim`` flat coordinates into blocks of a block-diagonal A."""

    kind: str  # "full", "diagonal" or "blocks"
    ndim: int
    blocks: tuple[np.ndarray, ...] = ()  # sorted coordinate indices; unused for "diagonal"
    names: tuple[tuple[str, ...], ...] = ()

    @property
    def diagonal(self) -> bool:
        return self.kind == "diagonal"

    def block_sizes(self) -> list[int]:
        return [1] * self.ndim if self.diagonal else [len(b) for b in self.blocks]

    def mask(self) -> np.ndarray:
        """``(D, D)`` boolean mask of the block-diagonal pattern (for reporting only)."""
        if self.diagonal:
            return np.eye(self.ndim, dtype=bool)
        mask = np.zeros((self.ndim, self.ndim), dtype=bool)
        for b in self.blocks:
            mask[np.ix_(b, b)] = True
        return mask

    def describe(self) -> str:
        if self.kind in ("full", "diagonal"):
            return self.kind
        return repr([list(n) for n in self.names])


def parse_structure(structure: str | Sequence[Sequence[str]], target: BatchedTarget) -> Structure:
    """Turn the user's ``structure`` option into a :class:`Structure`, with clear errors."""
    d = target.ndim
    free = [c.rv_name for c in target.coordinates]
    if isinstance(structure, str):
        kind = structure.lower()
        if kind == "full":
            return Structure("full", d, (np.arange(d),), (tuple(free),))
        if kind in ("diagonal", "mean_field", "meanfield"):
            return Structure("diagonal", d)
        if kind in ("variables", "layers"):
            groups = [[c.rv_name] for c in target.coordinates]
            return _blocks(groups, target)
        raise ValueError(
            f"Unknown structure {structure!r}: use 'full', 'diagonal', 'variables', or a list "
            f"of lists of free-variable names (free variables: {free})."
        )
    if not isinstance(structure, Sequence) or not all(
        isinstance(g, Sequence) and not isinstance(g, str) for g in structure
    ):
        raise TypeError(
            "structure must be 'full', 'diagonal', 'variables' or a list of lists of variable "
            f"names such as [['a', 'b'], ['c']]; got {structure!r}."
        )
    seen: set[str] = set()
    groups = []
    for group in structure:
        names = []
        for name in group:
            try:
                coord = target.find(name)
            except KeyError:
                raise ValueError(
                    f"structure names {name!r}, which is not a free variable of the model; "
                    f"free variables are {free}."
                ) from None
            if coord.rv_name in seen:
                raise ValueError(f"structure lists {coord.rv_name!r} in more than one block.")
            seen.add(coord.rv_name)
            names.append(coord.rv_name)
        if not names:
            raise ValueError("structure contains an empty block; remove it.")
        groups.append(names)
    groups += [[name] for name in free if name not in seen]
    return _blocks(groups, target)


def _blocks(groups: list[list[str]], target: BatchedTarget) -> Structure:
    blocks = []
    for group in groups:
        idx = np.concatenate([np.arange(target.find(n).start, target.find(n).stop) for n in group])
        blocks.append(np.sort(idx))
    if len(blocks) == 1:
        return Structure("full", target.ndim, tuple(blocks), (tuple(groups[0]),))
    return Structure("blocks", target.ndim, tuple(blocks), tuple(tuple(g) for g in groups))


# ------------------------------------------------- symbolic helpers for block-wise maths
def _is_range(idx: np.ndarray) -> bool:
    return len(idx) > 0 and bool(np.all(np.diff(idx) == 1))


def take_columns(mat: Variable, idx: np.ndarray) -> Variable:
    """Columns ``idx`` of ``mat`` (a view when they are contiguous)."""
    if _is_range(idx):
        return mat[..., int(idx[0]) : int(idx[-1]) + 1]
    return mat[..., idx]


def assemble_columns(parts: list[Variable], structure: Structure) -> Variable:
    """Put per-block columns back in coordinate order."""
    order = np.concatenate(structure.blocks)
    out = parts[0] if len(parts) == 1 else pt.concatenate(parts, axis=-1)
    if np.array_equal(order, np.arange(len(order))):
        return out
    return out[..., np.argsort(order)]
