"""Importance sampling with q as proposal, streamed: a pool of draws kept as the generator
states that reproduce them, with their log-densities (memory ``O(S + D)``, never ``O(S D)``).

One pool serves the verdict's importance check (:func:`pymc_gpf.verdict.importance_check`)
and the PSIS-corrected draws of ``approx.sample()``: the default draws of a family-limited
fit are resampled from the very pool its verdict judged, extended when more draws are
asked for, so they cost no second pass of log-densities over the data.

The pool is a defensive mixture (Hesterberg 1995): every batch holds draws of the proposal
and, for a Gaussian one, :data:`~pymc_gpf.diagnostics.WIDE_SHARE` of the batch from the
proposal with :data:`~pymc_gpf.diagnostics.WIDE_SCALE` times its sds, so that where q is
narrower than the posterior the weights ``p / g`` (``g`` the mixture's density) stay
bounded where the wider component covers it.
"""

from __future__ import annotations

import warnings

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from scipy.special import logsumexp

from pymc_gpf.diagnostics import WIDE_SCALE, WIDE_SHARE, khat_threshold, smoothed_log_weights

__all__ = ["FIRST_DRAWS", "ImportancePool", "capped", "defensive"]

FIRST_DRAWS = 4096  # the first batch of q's draws; each later batch doubles the pool
# at most this many numbers of draws (S D) by default: fewer draws for a large model, each
# a log-density of the whole data set
LARGE_POOL = 2**24


def defensive(q):
    """q with :data:`WIDE_SCALE` times its sds, or ``None`` where q is no Gaussian."""
    widened = getattr(q, "widened", None)
    return widened(WIDE_SCALE) if widened is not None else None


def capped(largest: int, ndim: int) -> int:
    """At most ``largest`` draws, and for a large model no more than :data:`LARGE_POOL`
    numbers of draws (but :data:`FIRST_DRAWS`)."""
    return min(int(largest), max(FIRST_DRAWS, LARGE_POOL // max(int(ndim), 1)))


@dataclass(frozen=True)
class _Batch:
    """A batch of draws (``size`` of the proposal, then ``wide`` of the defensive component)
    and the generator states that reproduce it (and q's own draws, for a degenerate q)."""

    size: int
    wide: int
    state: dict
    own_state: dict | None


class ImportancePool:
    """Draws of ``proposal`` (and of its defensive widening) in batches, with ``log p``
    (``log_density``, the model's), the proposal's and the wide component's log-densities.
    ``own`` is q itself where the proposal is a proper Gaussian around a degenerate q: its
    own draws (for q's moments) come from a stream of their own, batch by batch."""

    def __init__(self, proposal, log_density: Callable, rng: np.random.Generator, own=None):
        self.proposal, self.own, self.log_density = proposal, own, log_density
        self.wide = defensive(proposal)
        self._draw_rng, self._own_rng = rng.spawn(2)
        self.batches: list[_Batch] = []
        self._parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    @property
    def size(self) -> int:
        """Draws of the proposal (the defensive ones not counted)."""
        return sum(b.size for b in self.batches)

    def add(self, size: int) -> np.ndarray:
        """One more batch: ``size`` draws of the proposal and their defensive share (returned,
        for a caller that uses them at once)."""
        rng = self._draw_rng
        extra = 0 if self.wide is None else round(size * WIDE_SHARE / (1.0 - WIDE_SHARE))
        own_state = self._own_rng.bit_generator.state if self.own is not None else None
        self.batches.append(_Batch(size, extra, rng.bit_generator.state, own_state))
        points = self.proposal.sample(size, rng)
        if extra:
            points = np.concatenate([points, self.wide.sample(extra, rng)])
        if self.own is not None:
            self.own.sample(size, self._own_rng)  # advance: regenerated when needed
        log_q, log_wide = self._log_densities(points)
        self._parts.append((self.log_density(points), log_q, log_wide))
        self.__dict__.pop("arrays", None)
        return points

    def copy(self) -> ImportancePool:
        """A pool with the same draws, whose further batches are drawn as this one's would
        be (extending the copy leaves this pool as it is)."""
        other = ImportancePool.__new__(ImportancePool)
        other.__dict__.update(self.__dict__)
        other.batches, other._parts = list(self.batches), list(self._parts)
        other._draw_rng, other._own_rng = (_clone(r) for r in (self._draw_rng, self._own_rng))
        return other

    def grow_to(self, size: int) -> ImportancePool:
        """Add batches, each doubling the pool, until it holds ``size`` draws of the
        proposal (the last batch only what is missing)."""
        while self.size < size:
            self.add(min(max(self.size, FIRST_DRAWS), size - self.size))
        return self

    def _log_densities(self, points: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``log q`` and ``log q_wide``; for a Gaussian, the second from the first's
        whitened squared distance (one pass over the points)."""
        if self.wide is None:
            log_q = self.proposal.logpdf(points)
            return log_q, log_q
        both = getattr(self.proposal, "logpdf_widened", None)
        if both is not None:
            return both(points, WIDE_SCALE)
        return self.proposal.logpdf(points), self.wide.logpdf(points)

    @cached_property
    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``log p``, ``log q``, ``log q_wide`` of every draw, and whether it is the
        proposal's (not the defensive component's)."""
        log_p, log_q, log_wide = (np.concatenate(x) for x in zip(*self._parts, strict=True))
        from_q = np.concatenate([np.arange(b.size + b.wide) < b.size for b in self.batches])
        return log_p, log_q, log_wide, from_q

    def mixture_log_density(self) -> np.ndarray:
        """``log g``: the density of the mixture the whole pool is drawn from."""
        _, log_q, log_wide, from_q = self.arrays
        share = from_q.mean()
        if share == 1.0:
            return log_q
        return np.logaddexp(np.log(share) + log_q, np.log1p(-share) + log_wide)

    def mixture_weights(self) -> tuple[np.ndarray, float]:
        """Pareto-smoothed normalised log weights ``p / g`` of every draw and their k̂."""
        return smoothed_log_weights(self.arrays[0], self.mixture_log_density())

    def regenerate(self, index: int) -> np.ndarray:
        """The draws of batch ``index``, from its generator state."""
        batch = self.batches[index]
        rng = np.random.default_rng()
        rng.bit_generator.state = batch.state
        points = self.proposal.sample(batch.size, rng)
        if batch.wide:
            points = np.concatenate([points, self.wide.sample(batch.wide, rng)])
        return points

    def regenerate_own(self, index: int) -> np.ndarray:
        """q's own draws of batch ``index`` (a degenerate q)."""
        rng = np.random.default_rng()
        rng.bit_generator.state = self.batches[index].own_state
        return self.own.sample(self.batches[index].size, rng)

    def take(self, rows: np.ndarray) -> np.ndarray:
        """The draws at ``rows`` (indices into the pool), regenerating only the batches
        they fall in."""
        rows = np.asarray(rows)
        out = np.empty((len(rows), self.proposal.ndim), dtype=float)
        start = 0
        for index, batch in enumerate(self.batches):
            stop = start + batch.size + batch.wide
            inside = (rows >= start) & (rows < stop)
            if inside.any():
                out[inside] = self.regenerate(index)[rows[inside] - start]
            start = stop
        return out

    def resample(self, draws: int, rng: np.random.Generator) -> np.ndarray:
        """``draws`` points drawn with replacement with probabilities the smoothed weights
        (sampling-importance-resampling), with a warning when k̂ makes them unreliable."""
        log_weights, k = self.mixture_weights()
        limit = khat_threshold(len(log_weights))
        if k >= limit:
            warnings.warn(
                f"Pareto k̂ = {k:.2f} ≥ {limit:.2f}: the PSIS-corrected draws are not reliable.",
                UserWarning,
                stacklevel=3,
            )
        probabilities = np.exp(log_weights - logsumexp(log_weights))
        return self.take(rng.choice(len(log_weights), size=int(draws), p=probabilities))


def _clone(rng: np.random.Generator) -> np.random.Generator:
    out = np.random.default_rng()
    out.bit_generator.state = rng.bit_generator.state
    return out
