"""Why a step failed, in the model's terms: which variables and log-density terms were not
finite, and what to do about it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pymc_gpf.errors import DivergenceError, InitialPointError
from pymc_gpf.options import FitOptions
from pymc_gpf.target import BatchedTarget

__all__ = ["FailedStep", "explain_failure"]


@dataclass(frozen=True)
class FailedStep:
    """A step that produced non-finite values, and the fit it belongs to."""

    method: str  # e.g. "gpf"
    index: int  # the step, counted over all fit/refine calls
    evaluated: dict[str, np.ndarray]  # CompiledStep.diagnose
    options: FitOptions
    start_points: str  # what the first step evaluates, in words
    spread_option: str  # the option that sets the initial spread
    steps_kept: int


def _nonfinite_terms(target: BatchedTarget, points: np.ndarray, logp: np.ndarray) -> list[str]:
    bad = points[~np.isfinite(logp)][:3]
    return sorted({t for p in bad if np.isfinite(p).all() for t in target.explain_nonfinite(p)})


def _start_error(step: FailedStep, target: BatchedTarget) -> InitialPointError | None:
    info = step.evaluated
    bad_logp = ~np.isfinite(info["logp"])
    grads = target.variables_at(info["bad_grad"])
    if step.index != 0 or not (bad_logp.any() or grads):
        return None
    terms = _nonfinite_terms(target, info["points"], info["logp"])
    parts = []
    if bad_logp.any():
        parts.append(f"the log-density is not finite for {terms or 'some terms'}")
    if grads:
        parts.append(f"the gradient is not finite for {grads}")
    return InitialPointError(
        f"{step.method.upper()} cannot start: at the initial {step.start_points} "
        f"{'; '.join(parts)}. Check `start` values are inside each variable's support, "
        f"reduce `{step.spread_option}` (points may land where the density is zero), "
        "or use init='map'."
    )


def _where(step: FailedStep, target: BatchedTarget) -> str:
    info = step.evaluated
    terms = _nonfinite_terms(target, info["points"], info["logp"])
    terms += _nonfinite_terms(target, info["new_points"], info["new_logp"])
    variables = target.variables_at(info["bad_new"] | info["bad_grad"])
    terms = [t for t in dict.fromkeys(terms) if t not in variables]
    if variables and terms:
        return f" in {variables} (and the log-density terms {terms})"
    if variables or terms:
        return f" in {variables}" if variables else f" in the log-density terms {terms}"
    # only the free energy overflowed: point at the steepest variable
    steepest = target.variables_at(np.array([np.nanargmax(info["max_grad"])]))
    return f" in the free energy (the largest gradients are in {steepest})"


def explain_failure(step: FailedStep, target: BatchedTarget, approx) -> Exception:
    """An :class:`InitialPointError` when the start itself is not finite, else a
    :class:`DivergenceError` carrying ``approx`` (the last finite state)."""
    error = _start_error(step, target)
    if error is not None:
        return error
    if step.options.auto:
        advice = (
            "The automatic step size refuses non-finite steps, so this state came from the "
            "start: check the model's log-density there (start values inside each "
            f"variable's support, a smaller {step.spread_option})."
        )
    else:
        advice = (
            f"This fit used the fixed learning_rate {step.options.learning_rate}: "
            f"refit without it (pm.fit(method='{step.method}')) for the automatic step size, "
            "which adapts to the posterior's scales and never takes a non-finite step; "
            "or continue this state with a much smaller one: "
            "err.approx.refine(n, learning_rate=...)."
        )
    return DivergenceError(
        f"{step.method.upper()} diverged at step {step.index}: the update produced non-finite "
        f"values{_where(step, target)}. The approximation keeps the last state with a finite "
        f"free energy, after {step.steps_kept} steps (err.approx, with its history). {advice}",
        approx,
    )
