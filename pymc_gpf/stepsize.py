"""Step sizes that need no tuning, as small pure PyTensor functions every method shares.

* **Backtracking** (deterministic objectives: GPF on full data). A trial step is accepted
  only if it lowers the free energy by at least a fraction of the decrease its direction
  predicts (Armijo); a rejected trial shrinks the step, an accepted one lets it grow back
  up to ``max_step``. The trial is evaluated by the same call that computes the next
  direction, so an accepted step costs one batched log-density-and-gradient evaluation and
  a rejected one the same again, nothing more.
* **Trust region** (stochastic objectives: GF's fresh draws, minibatches, WVGD). A natural
  step is capped so that, in units of q's own spread, it moves the mean by at most
  ``max_mean`` and scales the spread by at most ``1 ± max_scale``: a noisy or far-off
  gradient can never throw q out of range. The base step comes from the fit's schedule
  (:mod:`pymc_gpf.control`).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytensor.tensor as pt

from pytensor.graph.basic import Variable

__all__ = ["Backtracking", "accept_trial", "cap", "next_step_size"]


@dataclass(frozen=True)
class Backtracking:
    """Settings of the backtracking line search. The natural steps of the methods are
    Newton-like at ``1``, hence ``max_step = 1``."""

    first_step: float = 1.0
    max_step: float = 1.0
    grow: float = 2.0
    shrink: float = 0.5
    armijo: float = 1e-4  # fraction of the predicted decrease an accepted step must achieve


def accept_trial(
    trial_free_energy: Variable,
    free_energy: Variable,
    step_size: Variable,
    slope: Variable,
    finite: Variable,
    settings: Backtracking,
) -> Variable:
    """Armijo's test: ``F(trial) <= F - c * eta * slope`` (``slope >= 0`` the predicted
    decrease per unit step), and the trial finite. From ``F = inf`` (no state yet) any
    finite trial is accepted."""
    wanted = free_energy - settings.armijo * step_size * slope
    return finite & pt.isfinite(trial_free_energy) & (trial_free_energy <= wanted)


def next_step_size(step_size: Variable, accepted: Variable, settings: Backtracking) -> Variable:
    """Grow after an accepted trial (the first one, at step size 0, starts at
    ``first_step``), shrink after a rejected one."""
    grown = pt.switch(
        pt.eq(step_size, 0.0),
        settings.first_step,
        pt.minimum(step_size * settings.grow, settings.max_step),
    )
    return pt.switch(accepted, grown, step_size * settings.shrink)


def cap(step_size: Variable, size: Variable, limit: float) -> Variable:
    """``step_size``, reduced so that ``step_size * size <= limit`` (``size >= 0``)."""
    return pt.minimum(step_size, limit / pt.maximum(size, 1e-300))
