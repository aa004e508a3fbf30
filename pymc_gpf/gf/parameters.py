"""GF's parameters before the first step: the options checked, the default rank and number
of draws, and the initial ``q = N(mu, Gamma Gamma^T)`` (NumPy)."""

from __future__ import annotations

import math
import warnings

from collections.abc import Callable

import numpy as np

from pymc_gpf.checks import is_integer
from pymc_gpf.options import AUTO
from pymc_gpf.structure import Structure, parse_structure

__all__ = [
    "HIERARCHICAL_MIN_DIM",
    "MAX_ROTATION_DIM",
    "automatic_structure",
    "check_rank",
    "default_pairs",
    "default_rank",
    "draw_pairs",
    "initial_factors",
    "low_rank_rank",
    "standardised_pairs",
]

MAX_DEFAULT_RANK = 1000
MIN_DEFAULT_PAIRS, MAX_DEFAULT_PAIRS = 10, 500
# mean field draws a random rotation of its D coordinates up to this D (O(D^3) per step,
# under a millisecond); above, pairs standardised per coordinate, whose bias is O(1/D)
MAX_ROTATION_DIM = 200
HIERARCHICAL_MIN_DIM = 64  # "auto" looks for a hierarchical structure above this D
# "auto" without locals: full rank up to this D (as the default rank), the low-rank
# structure above. Not lower: on three Gaussian random walks (D = 304) full rank ends at the
# Gaussian optimum in 11 s, the low-rank structure (K = 17) had not converged after 10 000
# steps (100 s, its mean 3.0 sds from NUTS's)
MAX_FULL_RANK_DIM = MAX_DEFAULT_RANK
MAX_LOW_RANK = 50  # the low-rank structure's default rank: round(sqrt(D)), at most this


def default_pairs(rank: int) -> int:
    """Antithetic pairs of draws per step at the automatic step size: one per direction
    of the factor (the spherical-radial rule is then exact to degree 3), at least 10 and at
    most 500."""
    return min(max(rank, MIN_DEFAULT_PAIRS), MAX_DEFAULT_PAIRS)


def default_rank(ndim: int) -> int:
    """Full rank ``D``, capped at :data:`MAX_DEFAULT_RANK` with a warning (memory ``D K``)."""
    if ndim <= MAX_DEFAULT_RANK:
        return ndim
    warnings.warn(
        f"The model has D = {ndim} unconstrained dimensions; the default GF factor has rank "
        f"{MAX_DEFAULT_RANK} < D (a full-rank factor needs D^2 memory). Pass "
        "inf_kwargs={'rank': K} to choose, or structure='diagonal' for mean field.",
        UserWarning,
        stacklevel=3,
    )
    return MAX_DEFAULT_RANK


def low_rank_rank(rank: int | None, ndim: int) -> int:
    """The low-rank structure's rank ``K``: ``rank``, or ``round(sqrt(D))`` (numpyro's
    ``AutoLowRankMultivariateNormal``) capped at :data:`MAX_LOW_RANK` (cost ``O(S D K)``
    a step with ``S = 4 max(K, 10) + 2`` draws)."""
    if rank is None:
        return max(1, min(round(math.sqrt(ndim)), MAX_LOW_RANK, ndim - 1))
    if not (is_integer(rank, 1) and rank < ndim):
        raise ValueError(
            f"rank of structure='low-rank' must be an integer between 1 and D - 1 = "
            f"{ndim - 1} (D the number of unconstrained coordinates), got {rank!r}; "
            "structure='full' fits a full covariance."
        )
    return int(rank)


def draw_pairs(draws_per_step, rank: int) -> int:
    """Antithetic pairs per step at the automatic step size: half of ``draws_per_step``
    (rounded up), or :func:`default_pairs` of the total ``rank`` of the factors."""
    if draws_per_step != AUTO:
        return (int(draws_per_step) + 1) // 2
    return default_pairs(rank)


def standardised_pairs(draws_per_step) -> int:
    """Antithetic pairs per step of mean field above :data:`MAX_ROTATION_DIM`: half of
    ``draws_per_step``, or 10. Not more with ``D``: each scale's update reads only its own
    coordinate's draws, so its noise depends on their number, not on ``D``."""
    if draws_per_step != AUTO:
        return (int(draws_per_step) + 1) // 2
    return MIN_DEFAULT_PAIRS


def automatic_structure(
    target, find_locals: Callable[[], Structure | None], rank_given: bool = False
) -> Structure:
    """GF's ``structure="auto"``: the hierarchical structure (``find_locals``) above
    :data:`HIERARCHICAL_MIN_DIM` coordinates where the model has locals and at most
    :data:`MAX_ROTATION_DIM` globals, else full rank up to :data:`MAX_FULL_RANK_DIM`
    coordinates and the low-rank structure above; with a ``rank_given`` (GF's ``rank=``),
    full: the paper's ``K``-column factor, which neither of the others has. At ``D`` = 52
    the arrow and full rank cost the same on a hierarchical normal; at 102 the arrow is 2.3
    times faster, at 202 3.5 times (same q)."""
    if rank_given:
        return parse_structure("full", target)
    if target.ndim > HIERARCHICAL_MIN_DIM:
        found = find_locals()
        if found is not None and (found.diagonal or len(found.blocks[0]) <= MAX_ROTATION_DIM):
            return found
    if target.ndim > MAX_FULL_RANK_DIM:
        return parse_structure("low-rank", target)
    return parse_structure("full", target)


def check_rank(rank: int | None, structure: Structure, ndim: int) -> int | None:
    """``rank`` checked against the structure (``None`` for mean field), its default the full
    rank."""
    if structure.diagonal and rank is not None:
        raise ValueError(
            "rank applies to 'full' and block structures; structure='diagonal' has one "
            "scale per coordinate. Drop rank= or choose another structure."
        )
    if structure.low_rank:
        return low_rank_rank(rank, ndim)
    if structure.hierarchical:
        if rank is not None:
            raise ValueError(
                "rank applies to 'full' and block structures; structure='hierarchical' has "
                "a full factor of the globals and one scale per local. Drop rank=."
            )
        return None
    if rank is None and not structure.diagonal:
        rank = default_rank(ndim)
    if not structure.diagonal and not (is_integer(rank, 1) and rank <= ndim):
        raise ValueError(
            f"rank must be an integer between 1 and D = {ndim} (the number of unconstrained "
            f"coordinates), got {rank!r}."
        )
    return rank


def initial_factors(
    structure: Structure, rank: int | None, scale: float | np.ndarray, ndim: int, dtype: str
) -> list[np.ndarray]:
    """``Gamma`` per block: ``scale`` (a number, or one per coordinate) times the first ``K``
    columns of the identity (mean field: ``scale`` for every coordinate; low rank: ``scale``
    for every coordinate and ``U`` its first ``K`` columns, off zero, where ``U = 0`` is a
    stationary point of the flow)."""
    scale = np.broadcast_to(np.asarray(scale, dtype=dtype), (ndim,))
    if structure.diagonal:
        return [scale.copy()]
    if structure.low_rank:
        loadings = scale[:, None] * np.eye(ndim, rank, dtype=dtype)
        return [loadings, scale.copy()]
    if structure.hierarchical:  # the arrow [[L, 0], [C, diag(s)]], no coupling yet
        globals_, locals_ = structure.blocks
        eye = scale[globals_, None] * np.eye(len(globals_), dtype=dtype)
        coupling = np.zeros((len(locals_), len(globals_)), dtype=dtype)
        return [eye, coupling, scale[locals_].copy()]
    return [
        scale[b, None] * np.eye(len(b), min(rank, len(b)), dtype=dtype) for b in structure.blocks
    ]
