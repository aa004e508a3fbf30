"""Block structure of the Gaussian approximation (Galy-Fajou et al. 2021, §3.5).

The flat coordinates are partitioned into blocks; the linear part of the flow (and hence the
covariance) is block-diagonal, so blocks are independent under q. ``"full"`` is one block,
``"diagonal"`` is one block per coordinate (mean field), ``"variables"`` one block per PyMC
free variable (the paper's "GPF (Layers)"), and a list of lists of variable names groups
variables explicitly; variables not listed get a block each.

``"hierarchical"`` is not block-diagonal: the coordinates are split into globals ``g`` and
locals ``l`` that are conditionally independent of each other given the globals (the group
effects of a hierarchical model), and the factor of the covariance is the arrow
``[[L, 0], [C, diag(s)]]``. Its precision has the posterior Hessian's arrow pattern, so the
family holds the full-rank Gaussian-VI optimum (whose precision is ``E_q[-grad^2 log p]``)
at ``O(D G)`` memory. :func:`find_locals` reads the locals off the log-density's gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pytensor.tensor as pt

from pytensor.graph.basic import Variable

from pymc_gpf.target import BatchedTarget

__all__ = ["Structure", "assemble_columns", "find_locals", "parse_structure", "take_columns"]

HIERARCHICAL = "hierarchical"
LOW_RANK = "low-rank"


@dataclass(frozen=True)
class Structure:
    """A partition of the ``ndim`` flat coordinates into blocks of a block-diagonal A."""

    # "full", "diagonal", "blocks", "hierarchical" (blocks: globals, locals) or "low-rank"
    # (GF's diagonal plus a low-rank factor over all coordinates; no blocks)
    kind: str
    ndim: int
    blocks: tuple[np.ndarray, ...] = ()  # sorted coordinate indices; unused for "diagonal"
    names: tuple[tuple[str, ...], ...] = ()

    @property
    def diagonal(self) -> bool:
        return self.kind == "diagonal"

    @property
    def hierarchical(self) -> bool:
        return self.kind == HIERARCHICAL

    @property
    def low_rank(self) -> bool:
        return self.kind == LOW_RANK

    def block_sizes(self) -> list[int]:
        if self.low_rank:
            return [self.ndim]
        return [1] * self.ndim if self.diagonal else [len(b) for b in self.blocks]

    def mask(self) -> np.ndarray:
        """``(D, D)`` boolean mask of the block-diagonal pattern (hierarchical: of the
        factor's arrow), for reporting only."""
        if self.diagonal:
            return np.eye(self.ndim, dtype=bool)
        if self.low_rank:
            return np.ones((self.ndim, self.ndim), dtype=bool)
        mask = np.zeros((self.ndim, self.ndim), dtype=bool)
        if self.hierarchical:
            globals_, locals_ = self.blocks
            mask[np.ix_(globals_, globals_)] = True
            mask[np.ix_(locals_, globals_)] = True
            mask[locals_, locals_] = True
            return mask
        for b in self.blocks:
            mask[np.ix_(b, b)] = True
        return mask

    def describe(self) -> str:
        if self.kind in ("full", "diagonal", LOW_RANK):
            return self.kind
        if self.hierarchical:
            return f"hierarchical (locals {list(self.names[1])})"
        return repr([list(n) for n in self.names])


def parse_structure(
    structure: str | Sequence[Sequence[str]],
    target: BatchedTarget,
    locals_: Callable[[], Structure | None] | None = None,
) -> Structure:
    """Turn the user's ``structure`` option into a :class:`Structure`, with clear errors;
    ``locals_`` finds the hierarchical structure (methods without one refuse it)."""
    d = target.ndim
    free = [c.rv_name for c in target.coordinates]
    if isinstance(structure, str):
        kind = structure.lower()
        if kind == HIERARCHICAL:
            if locals_ is None:
                raise ValueError(
                    "structure='hierarchical' is a structure of GF and GPF; this method "
                    "takes 'full', 'diagonal', 'variables' or a list of lists of names."
                )
            found = locals_()
            if found is None:
                raise ValueError(
                    "structure='hierarchical' found no free variable whose coordinates are "
                    "conditionally independent of each other given the rest (the group "
                    f"effects of a hierarchical model) among {free}; use 'full' or 'diagonal'."
                )
            return found
        if kind == "full":
            return Structure("full", d, (np.arange(d),), (tuple(free),))
        if kind in ("diagonal", "mean_field", "meanfield"):
            return Structure("diagonal", d)
        if kind in (LOW_RANK, "low_rank", "lowrank"):
            return Structure(LOW_RANK, d)
        if kind in ("variables", "layers"):
            groups = [[c.rv_name] for c in target.coordinates]
            return _blocks(groups, target)
        raise ValueError(
            f"Unknown structure {structure!r}: use 'full', 'diagonal', 'variables', "
            "'hierarchical', 'low-rank' (GF and GPF), or a list "
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


def find_locals(
    target: BatchedTarget,
    grads: Callable[[np.ndarray], np.ndarray],
    centre: np.ndarray,
    rng: np.random.Generator,
    splits: int = 8,
) -> Structure | None:
    """The hierarchical structure whose locals are the largest set of free variables
    (of two or more coordinates) whose coordinates do not interact in ``log p``, or ``None``.

    Coordinates ``i != j`` do not interact when ``d^2 log p / dx_i dx_j = 0`` everywhere;
    then moving some of them leaves the gradient along the others unchanged, exactly (not
    only to first order). Each of ``splits`` random halvings ``(A, B)`` of the set moves
    ``A`` and then ``B`` and compares the gradient along the other half, so a pair that
    interacts escapes all of them with probability ``2^-splits``. ``grads`` maps points
    ``(N, D)`` to gradients; one call per variable tried, variables tried largest first
    and kept while the set passes."""
    candidates = sorted((c for c in target.coordinates if c.size > 1), key=lambda c: -c.size)
    x = centre + 0.5 * rng.standard_normal(centre.shape).astype(centre.dtype)
    tol = 10 * np.sqrt(np.finfo(centre.dtype).eps)
    chosen: list = []
    for coord in candidates:
        in_set = np.zeros(target.ndim, dtype=bool)
        for c in [*chosen, coord]:
            in_set[c.start : c.stop] = True
        half = (rng.random((splits, target.ndim)) < 0.5) & in_set
        other = ~half & in_set
        move = 0.5 * rng.standard_normal((splits, target.ndim))
        moved = np.concatenate([x[None], x + move * half, x + move * other])
        g = grads(moved.astype(centre.dtype))
        g0, g_half, g_other = g[:1], g[1 : 1 + splits], g[1 + splits :]
        # the gradient along the half that stayed
        change = np.where(other, g_half - g0, 0.0) + np.where(half, g_other - g0, 0.0)
        scale = np.abs(g0) + np.abs(g_half) + np.abs(g_other) + 1.0
        if np.all(np.isfinite(g)) and np.all(np.abs(change) <= tol * scale):
            chosen.append(coord)
    if not chosen:
        return None
    if len(chosen) == len(target.coordinates):  # no globals: independent coordinates
        return Structure("diagonal", target.ndim)
    local_names = {c.rv_name for c in chosen}
    locals_ = np.sort(np.concatenate([np.arange(c.start, c.stop) for c in chosen]))
    globals_ = np.setdiff1d(np.arange(target.ndim), locals_)
    names = (
        tuple(c.rv_name for c in target.coordinates if c.rv_name not in local_names),
        tuple(c.rv_name for c in target.coordinates if c.rv_name in local_names),
    )
    return Structure(HIERARCHICAL, target.ndim, (globals_, locals_), names)


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
