"""When a fit stops, and the step-size schedule of stochastic fits: plain Python between steps.

Each fit has one controller; after every step the engine hands it the free energy and the
step's ``info`` (with the fields of q the controller ``reads``) and it answers with a
:class:`Decision`: a stop code or ``None``, and what the engine is to change (q's
parameters, ...); it never acts on the fit itself. The codes and what they mean are
:data:`REASONS`. The rules:

* :class:`Deterministic` (GPF on full data, backtracking line search): **converged** when the
  natural-gradient decrement (squared distance to the fixed point in units of q's spread,
  :class:`pymc_gpf.gpf.flow.NaturalFlow`) stayed below ``tol**2`` for ``window`` accepted
  steps. Every early stop must pass the same test: when the free energy on an independent
  cloud of the same Gaussian has not improved for ``patience`` accepted steps near the
  fixed point (the particles have begun to fit their own positions: finite-N bias), the
  state with the best independent value is restored and re-evaluated, and the fit ends
  there only if its decrement is below ``tol**2`` (else GPF grows its cloud or continues
  with fresh draws; with an explicit ``n_particles`` it ends **overfitting**, not
  converged); **stalled** when backtracking shrank the step below ``1e-12`` without a
  decrease from a state that had not converged.
* :class:`Stochastic` (GF's fresh draws, minibatches, WVGD): the trace is cut into windows
  of ``max(20, 4 / rate)`` steps. When a window's mean free energy is not significantly
  below the previous one's (one-sided test at 5 %: while the free energy still falls by
  more than 1.645 standard errors of the difference per window, a plateau is declared with
  probability at most 5 %), the fit halves its step size, until the step is at most 1/2
  and the iterates' spread small; then it averages the iterates (Polyak-Ruppert) until the
  Monte Carlo error of the averaged location and log-scale of q (in units of q's spread,
  accounting for the iterates' correlation time: ``(2 - rate) / rate``, or longer where
  measured so) is below ``tol``,
  and is **converged**, returning that average, when it agrees with the average at twice
  the step (else the step halves and it averages again). A step size below ``min_rate``
  without settling is a **floor** (not converged).
* :class:`FixedSteps` (a numeric ``learning_rate``, Algorithm 2 / eq. 11 as printed): runs
  the ``n`` steps asked for; with ``tol`` it stops when the free energy of a window is not
  significantly below the previous window's and fell by less than ``tol**2`` nats.
"""

from __future__ import annotations

import math

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import numpy as np

__all__ = [
    "REASONS", "Control", "Decision", "Deterministic", "FixedSteps", "Outcome", "Saved",
    "Stochastic",
]  # fmt: skip

REASONS = {
    "converged": "converged",
    "overfitting": "finite-N bias: the particles had begun to fit their own positions",
    "stalled": "stalled: no step size lowered the free energy",
    "floor": "the step size reached its floor before the iterates settled",
    "max_steps": "reached the maximum number of steps before converging",
    "callback": "stopped by a callback",
    "interrupted": (
        "interrupted (KeyboardInterrupt): the fit so far is kept; approx.refine(n) continues it"
    ),
    "divergence": "diverged",
}
Z_ONE_SIDED_5 = 1.645
# the early stop on an independent cloud applies within about one sd of the fixed point
# (natural-gradient decrement < 1): farther out the flow's own progress dwarfs finite-N bias
NEAR = 1.0
Z_ONE_SIDED_005 = 3.29
# the largest lag-one autocorrelation the error estimate believes (a correlation time of 399)
MAX_LAG_ONE = 0.995
# the correlation times an average must span before its error is believed: over fewer, the
# iterates' variance and lag-one autocorrelation are too rough (GF's averages on a latent GP,
# six seeds, tol 0.03: 0.014-0.065 sds from the optimum over 5 of them with Z_BIAS 3,
# 0.014-0.044 with Z_BIAS 1; 0.003-0.032 over 10 with Z_BIAS 1, at 1.9 times the gradients)
SPAN = 10
# a window's mean that moved by less than this fraction of tol is at rest: a drift of that
# size per window would take a thousand windows to reach tol
AT_REST = 1e-3
# a window's mean moved when some coordinate moved by more than this many sds of its noise
# (the windows' iterates' variance times the step's correlation time over their number):
# two moves in a row within it are the windows' own noise, not a drift to extrapolate
Z_MOVE = 3.0
# two averages agree when within tol plus this many sds of their difference: the average at
# the smaller step keeps about that difference as bias, so a wide margin keeps a wide bias
Z_BIAS = 1.0
# while averaging, the average restarts only on a drop significant at 0.05 %: it is tested
# after every window, and a 5 % test would restart a long average by chance
_ARRAY = "__ndarray__"  # the key marking an array in a saved state


class Decision(NamedTuple):
    """A controller's answer to a step, which the engine carries out: ``stop``, a reason
    code (:data:`REASONS`) or ``None`` to go on; ``params``, q's parameters to set (the
    average a stochastic fit ends on); ``preconditioner``, an ensemble's ``(diagonal,
    factor)`` to set; ``restart``, ``(particles, sources)`` index arrays: an ensemble's
    particles that take the state of others. The step size is the controller's ``rate``,
    which the engine writes after every decision."""

    stop: str | None = None
    params: list[np.ndarray] | None = None
    preconditioner: tuple[np.ndarray, np.ndarray] | None = None
    restart: tuple[np.ndarray, np.ndarray] | None = None


GO_ON = Decision()


@dataclass
class Outcome:
    """How a fit ended: ``converged`` (``None`` when nothing was tested: a fixed step size
    without ``tol``), the ``reason`` code (:data:`REASONS`), the step count when it stopped
    and an explanation in words; then whether to trust it: the ``verdict``
    (:data:`pymc_gpf.verdict.WORDS`, ``None`` if unchecked), its explanation and remedy in
    ``verdict_message``, and the ``checks`` behind it (k̂, the estimated errors of q, ...,
    and what the check cost)."""

    converged: bool | None
    reason: str
    step: int
    message: str
    verdict: str | None = None
    verdict_message: str = ""
    checks: dict[str, Any] = field(default_factory=dict)

    @property
    def trustworthy(self) -> bool:
        return self.verdict == "trustworthy"

    def attrs(self) -> dict[str, Any]:
        checks = {f"check_{key}": value for key, value in self.checks.items()}
        return {
            "converged": "untested" if self.converged is None else str(self.converged),
            "stop_reason": self.reason,
            "stopped_at_step": self.step,
            "stop_message": self.message,
            "verdict": "unchecked" if self.verdict is None else self.verdict,
            "verdict_message": self.verdict_message,
        } | checks


class Saved:
    """An object whose attributes are its state, so that a saved fit continues exactly:
    :meth:`state` writes them as JSON (:func:`_to_json`); :meth:`load` restores them, with
    equal values and dtypes, loading nested saved objects in place."""

    # per class: the attributes a checkpoint holds; an undeclared one is an error when
    # saving, so a new one cannot change the checkpoint format unnoticed
    saved: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def _declared(cls, what: str) -> set[str]:
        return {name for klass in cls.__mro__ for name in vars(klass).get(what, ())}

    def state(self) -> dict[str, Any]:
        """JSON-able state: the declared attributes."""
        saved = self._declared("saved")
        undeclared = set(vars(self)) - saved
        if undeclared:
            raise RuntimeError(
                f"{type(self).__name__} has attributes {sorted(undeclared)} that are not "
                "saved: declare them (pymc_gpf.control.Saved)."
            )
        return {k: _to_json(getattr(self, k)) for k in sorted(saved) if hasattr(self, k)}

    def load(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state` wrote."""
        for key, value in state.items():
            current = getattr(self, key, None)
            if isinstance(current, Saved):
                current.load(value)
            else:
                setattr(self, key, _from_json(value))


class Control(Saved):
    """Base controller: never stops by itself. A controller that sets the step size holds
    it in ``rate``, the one place it lives: the engine writes it into the compiled step
    after every decision (``None``: the step size is not the controller's). ``reads``
    names the fields of q it needs in ``info`` beyond the step's own (e.g. ``"params"``),
    which the engine adds (:meth:`pymc_gpf.engine.FlowInference.observation`)."""

    saved = ("tol",)

    kind = "fixed"
    rate: float | None = None
    reads: ClassVar[tuple[str, ...]] = ()

    def __init__(self, tol: float | None):
        self.tol = tol

    def observe(self, free_energy: float, info: dict[str, Any]) -> Decision:
        return GO_ON

    def describe(self, reason: str) -> str:
        return REASONS.get(reason, reason)

    def progress(self) -> str:
        """Where the stop test stands, for the progress line (``""``: nothing to add)."""
        return ""

    def conclude(self, reason: str) -> str:
        """The reason the fit ends with, given the loop's (e.g. a last test at the step
        limit)."""
        return reason

    def finish(self, reason: str, info: dict[str, Any]) -> Decision:
        """The fit stops for ``reason`` (e.g. the step limit), ``info`` the fields it
        ``reads``: a last decision."""
        return GO_ON

    def resume(self) -> Decision:
        """The fit continues (``refine``): undo what :meth:`finish` decided."""
        return GO_ON


class FixedSteps(Control):
    """A fixed step size: ``n`` steps, or the trace test of :class:`Stochastic` with ``tol``."""

    saved = ("previous", "values", "window")

    def __init__(self, tol: float | None, window: int = 100):
        super().__init__(tol)
        self.window = window
        self.values: list[float] = []
        self.previous: list[float] | None = None

    def observe(self, free_energy, info):
        return Decision(self._test(free_energy))

    def _test(self, free_energy: float) -> str | None:
        if self.tol is None:
            return None
        self.values.append(float(free_energy))
        if len(self.values) < self.window:
            return None
        current, self.values = self.values, []
        previous, self.previous = self.previous, [_mean(current), _var_of_mean(current)]
        if previous is None:
            return None
        drop = previous[0] - self.previous[0]
        noise = math.sqrt(previous[1] + self.previous[1])
        if drop <= Z_ONE_SIDED_5 * noise and drop < self.tol**2:
            return "converged"
        return None

    def describe(self, reason):
        if reason == "converged":
            return (
                f"converged: over the last {self.window} steps the free energy fell by less "
                f"than tol^2 = {self.tol**2:.3g} nats"
            )
        return super().describe(reason)


class Deterministic(Control):
    """Backtracking fits: the decrement test, and early stopping that must pass it too.

    * **converged**: the natural-gradient decrement stayed below ``tol**2`` for ``window``
      accepted steps.
    * The free energy of an independent cloud (``info["since_best"]``) has not improved for
      ``patience`` accepted steps while the fit is near its fixed point (decrement below
      :data:`NEAR`, the best independent value finite): **overfitting** (finite-N bias), a
      request to the method to restore its best state. The next accepted step re-evaluates
      that state; it ends the fit as **converged** only if its decrement is below
      ``tol**2``, else as **unverified**: the method then grows its cloud, or stops there
      as **overfitting**, not converged.
    * **stalled**: backtracking shrank the step below ``min_step`` without a decrease
      (converged instead if the last decrement was already below ``tol**2``).
    """

    saved = ("decrements", "last_decrement", "min_step", "patience", "verifying", "window")

    kind = "deterministic"

    def __init__(self, tol: float, window: int = 3, patience: int = 10, min_step: float = 1e-12):
        super().__init__(tol)
        self.window, self.patience, self.min_step = window, patience, min_step
        self.decrements: list[float] = []
        self.last_decrement = float("inf")
        self.verifying = False  # the best state was restored: the next evaluation tests it

    def observe(self, free_energy, info):
        return Decision(self._test(info))

    def _test(self, info: dict[str, Any]) -> str | None:
        if info["accepted"]:
            self.last_decrement = float(info["decrement"])
            if self.verifying:
                self.verifying = False
                return "converged" if self.last_decrement < self.tol**2 else "unverified"
            self.decrements = [*self.decrements[-(self.window - 1) :], self.last_decrement]
            if len(self.decrements) == self.window and max(self.decrements) < self.tol**2:
                return "converged"
        near = self.last_decrement < NEAR and math.isfinite(info.get("best_validation", 0.0))
        if near and info.get("since_best", 0) >= self.patience:
            return "overfitting"
        if not info["accepted"] and info["step_size"] < self.min_step:
            return "converged" if self.last_decrement < self.tol**2 else "stalled"
        return None

    def verify(self) -> None:
        """The method restored a state: the next accepted evaluation decides."""
        self.verifying = True
        self.decrements = []

    def restart(self) -> None:
        self.decrements = []
        self.last_decrement = float("inf")
        self.verifying = False

    def describe(self, reason):
        if reason == "converged":
            return (
                f"converged: the natural-gradient decrement stayed below tol^2 = "
                f"{self.tol**2:.3g} for {self.window} steps (q within about tol = {self.tol:g} "
                "of its own sds from the fixed point)"
            )
        if reason == "overfitting":
            return (
                f"finite-N bias: the free energy of an independent cloud of the same Gaussian "
                f"stopped improving while the particles' own kept falling (they had begun to "
                f"fit their own positions), and where it was lowest q is not at the fixed "
                f"point (natural-gradient decrement {self.last_decrement:.2g} > tol^2 = "
                f"{self.tol**2:.3g}); q is that state, nearer the Gaussian optimum than the "
                "particles' own fixed point. More particles shrink the bias; method='gf' (fresh "
                "draws every step) has none"
            )
        if reason == "stalled":
            return (
                f"stalled: no step size down to {self.min_step:g} lowered the free energy "
                f"(natural-gradient decrement {self.last_decrement:.2g} > tol^2); the "
                "log-density may be non-smooth or not finite near q"
            )
        return super().describe(reason)


class Stochastic(Control):
    """Noisy objectives: windowed plateau test, step halving, Polyak-Ruppert averaging.

    It reads q's ``location`` and ``scale`` now (e.g. its mean and sds) and the ``params``
    to average; the average the fit ends on is its decision's ``params``; the step size is
    ``rate``.

    Two phases. *Adapting*: at each plateau of the trace the step is halved, until it is at
    most ``max_average_rate`` and the iterates' step-to-step spread is below ``max_spread``
    of q's sds. *Averaging*: the step stays fixed and every iterate enters a running average
    (:class:`_Average`); its Monte Carlo error is the iterates' pooled variance times their
    correlation time over their number (after at least four windows and ``span`` correlation
    times): per coordinate the larger of what the step implies, ``(2 - rate) / rate``, and
    the one measured from the iterates' lag-one autocorrelation (``measured``). Once that
    error is below ``tol`` the average is compared with the one at twice the step: the fit ends
    when they agree (every coordinate within ``tol`` plus ``margin`` sds of their difference),
    else the step halves and the fit averages afresh. A trace that starts falling again
    restarts the average. A window (at a step of at most ``max_average_rate``) whose
    iterates all lie within about ``tol`` of their average ends the fit at once, on that
    average, unless the windows' averages are still
    on the move (:meth:`_drifting`).

    The average of constant-step iterates is biased by O(step) (Dieuleveut, Durmus & Bach,
    2020), by an amount no fixed step bounds on every target: GF's average at rate 1/2 sat
    0.01 of q's sds from the exact Gaussian optimum on a latent GP posterior and 0.09 on a
    log-Gamma(1/2) one (0.01 at rate 1/8). With bias ``c * rate``, the gap between the
    averages at ``2 rate`` and ``rate`` is ``c * rate``, the bias that remains: so the
    comparison ends a fit only once that is within ``tol``. There is no average and no stop
    above ``max_average_rate`` (a full natural step is where the bias is largest), nor on one
    window's average, whose error estimate from a few correlated steps is too rough to end a
    fit on (unless the iterates themselves hardly move).
    """

    saved = (
        "_average", "_coarse", "_last_iterate", "_locations", "_scale", "_values",
        "_window_means", "_window_sums", "averaging", "max_average_rate",
        "margin", "max_rejections", "max_spread", "measured", "min_rate", "min_window",
        "min_windows", "previous", "rate", "rejections", "span",
    )  # fmt: skip

    kind = "stochastic"
    reads = ("location", "scale", "params")

    def __init__(
        self,
        tol: float,
        *,
        rate: float = 1.0,
        min_window: int = 20,
        min_rate: float = 1e-4,
        max_spread: float = 0.5,
        max_average_rate: float = 0.5,
        min_windows: int = 4,
        max_rejections: int = 30,
        measured: bool = True,
        span: float = SPAN,
        margin: float = Z_BIAS,
    ):
        super().__init__(tol)
        self.measured, self.span, self.margin = measured, span, margin
        self.rate, self.min_window, self.min_rate = rate, min_window, min_rate
        self.max_spread, self.min_windows = max_spread, min_windows
        self.max_average_rate = max_average_rate
        self.max_rejections = max_rejections
        self.rejections = 0
        self.averaging = False
        self.previous: list[float] | None = None
        self._scale = np.ones(1)  # q's sds at the last step: the unit of the errors
        self._last_iterate: list[np.ndarray] | None = None  # what finish replaced, for resume
        self._average = _Average()
        # the settled average at twice the step: q's location and its Monte Carlo errors
        self._coarse: list[np.ndarray] | None = None
        # q's mean location in the last windows and its noise, (2, ...) each
        self._window_means: list[np.ndarray] = []
        self._clear_window()

    @property
    def window_length(self) -> int:
        return max(self.min_window, math.ceil(4.0 / self.rate))

    @property
    def correlation_time(self) -> float:
        """Integrated autocorrelation time of the iterates: a natural step of size ``rate``
        contracts the distance to the fixed point by ``1 - rate``, an AR(1) process (a
        lower bound: slower modes show in :meth:`_Average.correlation_times`)."""
        return (2.0 - min(self.rate, 1.0)) / self.rate

    def _clear_window(self) -> None:
        self._values: list[float] = []
        self._locations: list[np.ndarray] = []
        self._window_sums: list[np.ndarray] | None = None

    def observe(self, free_energy, info):
        if not info["accepted"]:
            # a non-finite step was refused by the method (state kept): smaller steps
            self.rejections += 1
            self._new_rate(self.rate / 4)
            if self.rejections >= self.max_rejections or self.rate < self.min_rate:
                return Decision("stalled")
            return GO_ON
        self.rejections = 0
        self._scale = np.maximum(np.asarray(info["scale"], dtype=float), 1e-300)
        self._values.append(float(free_energy))
        self._locations.append(np.array(info["location"], dtype=float))
        params = [np.asarray(p, dtype=float) for p in info["params"]]
        self._window_sums = _add(self._window_sums, params)
        if self.averaging:
            self._average.add(params)
        if len(self._values) < self.window_length:
            return GO_ON
        return self._end_of_window()

    def _end_of_window(self) -> Decision:
        stats = [_mean(self._values), _var_of_mean(self._values)]
        previous, self.previous = self.previous, stats
        z = Z_ONE_SIDED_005 if self.averaging else Z_ONE_SIDED_5
        falling = previous is None or previous[0] - stats[0] > z * math.sqrt(previous[1] + stats[1])
        locations = np.asarray(self._locations)
        sds = np.std(locations, axis=0, ddof=1)
        noise = sds * math.sqrt(self.correlation_time / len(locations))  # the mean's sd
        drifting = self._drifting(locations.mean(axis=0), noise)
        if self.averaging:
            if falling:  # not stationary after all: average afresh from here, and
                # compare with no average of an earlier q
                self._average, self._coarse = _Average(), None
            else:
                self._average.add_window(locations)
                if self._average.windows >= self.min_windows and self._average_error() < self.tol:
                    return self._settled()
        elif not falling:
            spread = float(np.max(sds / self._scale))
            small_step = self.rate <= self.max_average_rate
            quiet = small_step and spread < self.tol
            if quiet and drifting is False:
                # every iterate of the window within about tol of its average, and the
                # windows' averages no longer moving: the average is that precise whatever
                # their correlation (e.g. GF on a Gaussian target)
                return self._stop(self._window_sums, len(locations), "converged")
            if quiet and drifting is None:
                pass  # quiet, but its drift at this step size is not known yet: one more window
            elif small_step and spread < self.max_spread:
                self.averaging = True
                self._average = _Average()
            else:
                sums = self._window_sums  # the new rate clears the window
                self._new_rate(self.rate / 2)
                if self.rate < self.min_rate:
                    return self._stop(sums, len(locations), "floor")
        self._clear_window()
        return GO_ON

    def _drifting(self, mean: np.ndarray, noise: np.ndarray | None = None) -> bool | None:
        """Whether the windows' mean locations are still on the move: the last window's
        moved ``d1`` (in q's sds) from the one before, which had moved ``d0``; a drift
        contracting by ``r = d1 / d0`` per window has ``d1 r / (1 - r)`` left to go. On the
        move unless both ``d1`` and that are below ``tol`` (or ``d1`` is below
        ``AT_REST * tol``: at rest, or neither move exceeded ``Z_MOVE`` sds of the windows'
        own noise in any coordinate, ``noise`` the sd of each window's mean: the ratio of two
        such moves is noise's); ``None``, not known yet, after one window and after two
        whose means differ by less than ``tol`` but more than at rest. A slow drift passes
        the spread test: WVGD's two particles on N(0, 1) ended 0.07 sds from the Lloyd-Max
        points when the last window's iterates spread by 0.027 sds while its mean had moved
        by 0.058. Only windows at the current step size count (:meth:`_new_rate` clears
        them)."""
        noise = np.zeros_like(mean) if noise is None else noise
        history = self._window_means
        self._window_means = [*history[-1:], np.stack([mean, noise])]
        if not history:
            return None
        d1 = float(np.max(np.abs(mean - history[-1][0]) / self._scale))
        if d1 <= AT_REST * self.tol:  # round-off (GF on a Gaussian target moves by 1e-13)
            return False
        if d1 >= self.tol:
            return True
        if len(history) < 2:
            return None
        if not (_moved(self._window_means[-1], history[-1]) or _moved(*history)):
            return False
        d0 = float(np.max(np.abs(history[-1][0] - history[-2][0]) / self._scale))
        r = d1 / d0 if d0 > 0 else math.inf
        return r >= 1 or d1 * r / (1 - r) >= self.tol

    def _settled(self) -> Decision:
        """The average is precise to ``tol``: stop on it if it agrees with the settled average
        at twice the step, else halve the step and average afresh."""
        location = self._average.location()
        errors = self._average.errors(self.correlation_time, self._scale, self.measured)
        coarse, self._coarse = self._coarse, [location, errors]
        if coarse is not None:
            gap = np.abs(location - coarse[0]) / self._scale
            if np.all(gap <= self.tol + self.margin * np.hypot(errors, coarse[1])):
                return self._stop(self._average.sums, self._average.count, "converged")
        if self.rate / 2 < self.min_rate:
            return self._stop(self._average.sums, self._average.count, "floor")
        self.averaging = False
        self._average = _Average()
        self._new_rate(self.rate / 2)
        return GO_ON

    def _stop(self, sums: list[np.ndarray], count: int, reason: str) -> Decision:
        """Stop for ``reason`` with q set to the average ``sums / count``
        (Polyak-Ruppert)."""
        self._clear_window()
        return Decision(reason, params=[s / count for s in sums])

    def _average_error(self) -> float:
        return self._average.error(
            self.correlation_time, self._scale, self.tol, self.measured, self.span
        )

    def progress(self) -> str:
        if self.tol is None:
            return ""
        if not self.averaging:
            return f"plateau test on windows of {self.window_length} steps"
        error = self._average_error()
        if not math.isfinite(error):
            return "averaging"
        return f"averaging, error {error:.2g} (tol {self.tol:g})"

    def _new_rate(self, rate: float) -> None:
        self.rate = rate
        self._clear_window()
        # a drift measured at another step size says nothing of the drift at this one
        self._window_means = []

    def finish(self, reason, info):
        if reason == "max_steps" and self.averaging and self._average.count:
            # the running average is the better estimate; refine resumes from the iterate
            self._last_iterate = [np.array(p) for p in info["params"]]
            return Decision(params=[s / self._average.count for s in self._average.sums])
        return GO_ON

    def resume(self):
        iterate, self._last_iterate = self._last_iterate, None
        return GO_ON if iterate is None else Decision(params=iterate)

    def describe(self, reason):
        return _stochastic_message(self, reason) or super().describe(reason)


class _Average(Saved):
    """The running (Polyak-Ruppert) average of a stochastic fit's parameters while it
    averages, and the moments of q's location over its whole windows, for the average's
    Monte Carlo error: their mean, variance and lag-one autocorrelation."""

    saved = (
        "count", "lagged", "last", "located", "location_squares", "location_sum", "origin",
        "sums", "windows",
    )  # fmt: skip

    def __init__(self):
        self.sums: list[np.ndarray] | None = None
        self.count = 0
        self.windows = 0
        self.location_sum = self.location_squares = self.lagged = 0.0
        self.last: np.ndarray | None = None  # the last location added, for the lag products
        # the first location: the moments are of the differences from it (no cancellation)
        self.origin: np.ndarray | None = None
        self.located = 0

    def add(self, params: list[np.ndarray]) -> None:
        self.sums, self.count = _add(self.sums, params), self.count + 1

    def add_window(self, locations: np.ndarray) -> None:
        """A window of q's locations ``(steps, ...)`` that passed the plateau test (the
        windows of one average are consecutive)."""
        self.windows += 1
        if self.origin is None:
            self.origin = np.array(locations[0])
        locations = locations - self.origin
        chain = locations if self.last is None else np.concatenate([self.last[None], locations])
        self.lagged = self.lagged + np.sum(chain[1:] * chain[:-1], axis=0)
        self.last = np.array(locations[-1])
        self.location_sum = self.location_sum + locations.sum(axis=0)
        self.location_squares = self.location_squares + np.square(locations).sum(axis=0)
        self.located += len(locations)

    def location(self) -> np.ndarray:
        """q's average location over the whole windows."""
        return self.origin + self._centred_mean()

    def _centred_mean(self) -> np.ndarray:
        return self.location_sum / self.located

    def _variances(self) -> np.ndarray:
        return np.maximum(self.location_squares / self.located - self._centred_mean() ** 2, 0.0)

    def correlation_times(self, correlation_time: float, measured: bool = True) -> np.ndarray:
        """Per coordinate, the larger of ``correlation_time`` (what the step implies) and,
        if ``measured``, the AR(1) one measured from the iterates' lag-one autocorrelation
        ``rho``, ``(1 + rho) / (1 - rho)``: a mode that the step contracts more slowly than
        it implies (two WVGD particles drifting together, seen in their cells' weights)
        shows in its own iterates."""
        if not measured:
            return np.full(np.shape(self.location_sum), float(correlation_time))
        mean = self._centred_mean()
        variance = self._variances()
        covariance = self.lagged / (self.located - 1) - np.square(mean)
        with np.errstate(divide="ignore", invalid="ignore"):
            rho = np.where(variance > 0, covariance / variance, 0.0)
        rho = np.clip(rho, 0.0, MAX_LAG_ONE)
        return np.maximum(correlation_time, (1.0 + rho) / (1.0 - rho))

    def errors(
        self, correlation_time: float, scale: np.ndarray, measured: bool = True
    ) -> np.ndarray:
        """Monte Carlo errors of :meth:`location`, per coordinate, in units of ``scale``
        (q's sds): the iterates' stationary variance (pooled over the averaging period)
        times their correlation time (:meth:`correlation_times`) over their number."""
        taus = self.correlation_times(correlation_time, measured)
        return np.sqrt(self._variances() * taus / self.located) / scale

    def error(
        self,
        correlation_time: float,
        scale: np.ndarray,
        tol: float,
        measured: bool = True,
        span: float = SPAN,
    ) -> float:
        """The largest of :meth:`errors`; ``inf`` until the period spans ``span``
        correlation times of the step, and ``span`` of each coordinate's own unless even the
        longest correlation time believed (``MAX_LAG_ONE``) would keep its error below ``tol``
        (a pooled variance over fewer correlation times is too small)."""
        n = self.located
        if n < max(2.0, span * correlation_time):
            return float("inf")
        taus, variances = self.correlation_times(correlation_time, measured), self._variances()
        longest = (1.0 + MAX_LAG_ONE) / (1.0 - MAX_LAG_ONE)
        if np.any((n < span * taus) & (np.sqrt(variances * longest / n) / scale >= tol)):
            return float("inf")
        return float(np.max(np.sqrt(variances * taus / n) / scale))


def _stochastic_message(control: Stochastic, reason: str) -> str | None:
    """:meth:`Stochastic.describe` for the reasons whose explanation needs its numbers."""
    if reason == "converged":
        how = (
            f"the Monte Carlo error of the averaged q, with its iterates' correlation time "
            f"(measured, at least the step's), is below tol = {control.tol:g} of its sds; q is "
            f"the average of the "
            f"iterates over the last {control._average.count} steps"
            if control.averaging
            else f"the iterates moved by less than tol = {control.tol:g} of q's sds over the "
            "last window; q is their average"
        )
        return (
            "converged: the free energy stopped decreasing (one-sided test at 5 % between "
            f"windows of {control.window_length} steps) and {how}"
        )
    if reason == "floor":
        return (
            f"the step size fell to {control.rate:.2g} (its floor) before the iterates "
            "settled within tol; q is the average of the last window"
        )
    if reason == "stalled":
        return (
            f"stalled: {control.rejections} consecutive steps produced non-finite values even "
            f"at step size {control.rate:.2g}"
        )
    if reason == "max_steps" and control.averaging and control._average.windows >= 2:
        error = control._average_error()
        if not math.isfinite(error):
            return (
                f"reached the maximum number of steps while averaging, over "
                f"{control._average.located} steps, too few for {control.span:g} correlation "
                "times of its slowest coordinates (their Monte Carlo error cannot be estimated yet)"
            )
        return (
            f"reached the maximum number of steps while averaging (Monte Carlo error of "
            f"the average {error:.2g} sds, tol {control.tol:g})"
        )
    return None


def _moved(window: np.ndarray, before: np.ndarray) -> bool:
    """Whether the mean of ``window`` (a ``(2, ...)`` stack: the mean, the sd of the mean)
    moved from that of ``before`` by more than ``Z_MOVE`` sds of their difference in some
    coordinate."""
    return bool(np.any(np.abs(window[0] - before[0]) > Z_MOVE * np.hypot(window[1], before[1])))


def _to_json(value: Any) -> Any:
    """``value`` as JSON-able data: arrays as ``{"__ndarray__": nested lists, "dtype",
    "shape"}`` (JSON writes floats with round-trip precision, so they load bit for bit),
    saved objects as their :meth:`Saved.state`, lists, tuples and dicts element-wise."""
    if isinstance(value, Saved):
        return value.state()
    if hasattr(value, "__array__") and not isinstance(value, np.ndarray | np.generic):
        value = np.asarray(value)  # a JAX array (backend="jax")
    if isinstance(value, np.ndarray):
        return {_ARRAY: value.tolist(), "dtype": value.dtype.str, "shape": list(value.shape)}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, list | tuple):
        return [_to_json(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_json(v) for k, v in value.items()}
    return value


def _from_json(value: Any) -> Any:
    """The inverse of :func:`_to_json` (saved objects are loaded in place by
    :meth:`Saved.load`)."""
    if isinstance(value, dict) and _ARRAY in value:
        return np.array(value[_ARRAY], dtype=value["dtype"]).reshape(value["shape"])
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    if isinstance(value, dict):
        return {k: _from_json(v) for k, v in value.items()}
    return value


def _add(sums: list[np.ndarray] | None, arrays: list[np.ndarray]) -> list[np.ndarray]:
    return arrays if sums is None else [a + b for a, b in zip(sums, arrays, strict=True)]


def _mean(values: Sequence[float]) -> float:
    return float(np.mean(values))


def _var_of_mean(values: Sequence[float]) -> float:
    """Variance of the mean of a correlated series: around its linear trend (a trend inside
    the window is not noise), the iid variance of the residuals inflated by the AR(1)
    correlation time ``(1 + rho) / (1 - rho)``, ``rho`` their lag-1 autocorrelation (at most
    0.9)."""
    values = np.asarray(values, dtype=float)
    n = len(values)
    if n < 4:
        return 0.0
    steps = np.arange(n) - (n - 1) / 2
    slope = np.dot(steps, values - values.mean()) / np.dot(steps, steps)
    residuals = values - values.mean() - slope * steps
    denominator = float(np.dot(residuals, residuals))
    if denominator <= 0:
        return 0.0
    rho = min(max(float(np.dot(residuals[1:], residuals[:-1]) / denominator), 0.0), 0.9)
    return float(denominator / (n - 2) / n * (1 + rho) / (1 - rho))
