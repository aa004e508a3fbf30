"""When a fit stops, and the step-size schedule of stochastic fits: plain Python between steps.

Each fit has one controller: its settings, a frozen dataclass (:class:`Control`), and its
state, an immutable ``NamedTuple`` the engine keeps (:meth:`Control.init`). After every step
the engine hands ``observe`` that state, the free energy and the step's ``info`` (with the
fields of q the controller ``reads``), and it answers with the next state and a
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
from dataclasses import KW_ONLY, asdict, dataclass, field, fields, replace
from typing import Any, ClassVar, NamedTuple

import numpy as np

__all__ = [
    "REASONS", "Control", "Decision", "Deterministic", "DeterministicState", "FixedSteps",
    "FixedStepsState", "Outcome", "RunningAverage", "Saved", "Series", "Stochastic",
    "StochasticState", "control_checkpoint", "restore_control",
]  # fmt: skip

REASONS = {
    "converged": "converged",
    "overfitting": "finite-N bias: the particles had begun to fit their own positions",
    "stalled": "stalled: no step size lowered the free energy",
    "floor": "the step size reached its floor before the iterates settled",
    "crawling": "crawling: the trust region cut every step short, far from the posterior",
    "max_steps": "reached the maximum number of steps before converging",
    "callback": "stopped by a callback",
    "interrupted": (
        "interrupted (KeyboardInterrupt): the fit so far is kept; approx.refine(n) continues it"
    ),
    "divergence": "diverged",
}
Z_ONE_SIDED_5 = 1.645
# the early stop on an independent cloud applies within about one sd of the fixed point
# (natural-gradient decrement < 1): farther out the flow's own progress usually dwarfs
# finite-N bias (Deterministic.far_patience covers the exceptions)
NEAR = 1.0
# while averaging, the average restarts only on a drop significant at 0.05 %: it is tested
# after every window, and a 5 % test would restart a long average by chance
Z_ONE_SIDED_005 = 3.29
# a backtracking step that moves q by less than this fraction of tol (in its sds) crawls:
# GPF on a Laplace prior's kinks accepted ever smaller steps, 2e-4 to 1e-12 over 1000 steps,
# while its free energy stayed within 1e-3 nats
CRAWL = 0.01
# the largest lag-one autocorrelation the error estimate believes (a correlation time of 399)
MAX_LAG_ONE = 0.995
# longer lags whose autocorrelation the error estimate reads too: a slow mode under a fast one
# hardly shows at lag one (GF's iterates on a latent GP at rate 1/4: the AR(1) time of lag
# one 18, of lag 16 45, batch means over 400 steps 52; its averages ended 0.05 sds off with an
# estimated error of 0.014). A lag counts once the average holds LAG_SPAN times it, and its
# autocorrelation less one standard error (so that noise does not read as a slow mode)
LONG_LAGS = (2, 4, 8, 16, 32)
LAG_SPAN = 20
# an average's error is believed once it reads the lags up to this many correlation times of
# the step (GF on a GARCH(1,1) posterior, rate 1/4: its lag-one time 6 where batch means over
# 400 steps read 24; averages over 80 steps ended 0.055 sds off with an estimated error of
# 0.015, over 320 steps 0.004-0.019 over three seeds)
LAG_REACH = 4
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
# an average at the smaller step keeps about its difference from the one at twice the step
# as bias, less this many sds of that difference (a wide margin keeps a wide bias): GF on a
# non-centred eight-schools posterior biased by 0.52 times the step, its averages at 1/8 and
# 1/16 0.062 and 0.032 sds off, stopped there with margin 1 (within tol 0.02 plus 0.016)
Z_BIAS = 0.0
# a step cut by its trust region to below this fraction of the schedule's step size: q's mean
# is more than a hundred trust radii from where its natural gradient points (Stochastic.crawl)
CRAWL_CUT = 0.01
# StochasticState.restarted: what made the fit start again, and from where
RESTARTS = {
    1: ("draws of q reached where the log-density is not finite", "its initial mean"),
    2: ("its natural steps crawled or stalled", "the MAP"),
}
_ARRAY = "__ndarray__"  # the key marking an array in a saved state


class Decision(NamedTuple):
    """A controller's answer to a step, which the engine carries out: ``stop``, a reason
    code (:data:`REASONS`) or ``None`` to go on; ``params``, q's parameters to set (the
    average a stochastic fit ends on); ``preconditioner``, an ensemble's ``(diagonal,
    factor)`` to set; ``restart``, ``(particles, sources)`` index arrays: an ensemble's
    particles that take the state of others; ``rescue``, an ensemble's particles to start
    again at draws of the Gaussian fit it began with. The step size is in the controller's state
    (:meth:`Control.rate`), which the engine writes into the compiled step after every
    decision."""

    stop: str | None = None
    params: list[np.ndarray] | None = None
    preconditioner: tuple[np.ndarray, np.ndarray] | None = None
    restart: tuple[np.ndarray, np.ndarray] | None = None
    rescue: np.ndarray | None = None


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
    """An object whose attributes are its state, so that a saved fit continues exactly
    (θ's search, :class:`pymc_gpf.hyper.HyperSearch`; a controller's state is a value
    instead, :func:`control_checkpoint`): :meth:`state` writes them as JSON
    (:func:`_to_json`); :meth:`load` restores them, with equal values and dtypes, loading
    nested saved objects in place."""

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


class Stateless(NamedTuple):
    """The state of a controller that keeps none (:class:`Control`)."""


@dataclass(frozen=True)
class Control:
    """A controller's settings; the base never stops by itself. What changes during a fit is
    its state, an immutable ``NamedTuple``: :meth:`init` makes the first, and
    :meth:`observe`, :meth:`conclude`, :meth:`finish` and :meth:`resume` each return the
    next one with their answer; the engine keeps the current one and replaces it with what
    they return. A controller that sets the step size holds it in its state, the one place
    it lives: :meth:`rate` reads it, and the engine writes it into the compiled step after
    every decision (``None``: the step size is not the controller's). :meth:`reads` names
    the fields of q it needs in ``info`` beyond the step's own (e.g. ``"params"``), which
    the engine adds (:meth:`pymc_gpf.engine.FlowInference.observation`)."""

    tol: float | None = None

    kind: ClassVar[str] = "fixed"

    def init(self) -> NamedTuple:
        """The state before the first step."""
        return Stateless()

    def observe(
        self, state: NamedTuple, free_energy: float, info: dict[str, Any]
    ) -> tuple[NamedTuple, Decision]:
        """The next state and the decision on a step that gave ``free_energy`` and ``info``."""
        return state, GO_ON

    def rate(self, state: NamedTuple) -> float | None:
        """The step size the controller sets (``None``: not the controller's)."""
        return None

    def reads(self, state: NamedTuple) -> tuple[str, ...]:
        """The fields of q the next decision reads in ``info`` beyond the step's own."""
        return ()

    def describe(self, state: NamedTuple, reason: str) -> str:
        return REASONS.get(reason, reason)

    def progress(self, state: NamedTuple) -> str:
        """Where the stop test stands, for the progress line (``""``: nothing to add)."""
        return ""

    def conclude(self, state: NamedTuple, reason: str) -> tuple[NamedTuple, str]:
        """The reason the fit ends with, given the loop's (e.g. a last test at the step
        limit)."""
        return state, reason

    def finish(
        self, state: NamedTuple, reason: str, info: dict[str, Any]
    ) -> tuple[NamedTuple, Decision]:
        """The fit stops for ``reason`` (e.g. the step limit), ``info`` the fields it
        ``reads``: a last decision."""
        return state, GO_ON

    def resume(self, state: NamedTuple) -> tuple[NamedTuple, Decision]:
        """The fit continues (``refine``): undo what :meth:`finish` decided."""
        return state, GO_ON

    def restored(self, saved: dict[str, Any]) -> NamedTuple:
        """The state from a checkpoint's fields (:func:`restore_control`), over
        :meth:`init`'s: a controller with nested state types rebuilds them here."""
        return self.init()._replace(**saved)


def control_checkpoint(control: Control, state: NamedTuple) -> dict[str, Any]:
    """What a checkpoint holds of a controller: its settings and its state's fields, by name,
    as JSON-able data (:func:`_to_json`)."""
    saved = asdict(control) | state._asdict()
    return {key: _to_json(value) for key, value in sorted(saved.items())}


def restore_control(control: Control, saved: dict[str, Any]) -> tuple[Control, NamedTuple]:
    """The controller and its state from what :func:`control_checkpoint` wrote (settings it
    does not hold keep ``control``'s). An earlier version's checkpoint loads too: it saved
    the controller's attributes under the same names, the private ones with a leading
    underscore."""
    saved = {key.lstrip("_"): _from_json(value) for key, value in saved.items()}
    settings = {f.name: saved.pop(f.name) for f in fields(control) if f.name in saved}
    control = replace(control, **settings)
    return control, control.restored(saved)


class FixedStepsState(NamedTuple):
    """:class:`FixedSteps`' free energies of the current window and the previous window's
    mean and the variance of that mean."""

    values: tuple[float, ...] = ()
    previous: tuple[float, float] | None = None


@dataclass(frozen=True)
class FixedSteps(Control):
    """A fixed step size: ``n`` steps, or the trace test of :class:`Stochastic` with ``tol``."""

    window: int = 100

    def init(self) -> FixedStepsState:
        return FixedStepsState()

    def observe(self, state, free_energy, info):
        if self.tol is None:
            return state, GO_ON
        values = (*state.values, float(free_energy))
        if len(values) < self.window:
            return state._replace(values=values), GO_ON
        previous, current = state.previous, (_mean(values), _var_of_mean(values))
        state = FixedStepsState((), current)
        if previous is None:
            return state, GO_ON
        drop = previous[0] - current[0]
        noise = math.sqrt(previous[1] + current[1])
        if drop <= Z_ONE_SIDED_5 * noise and drop < self.tol**2:
            return state, Decision("converged")
        return state, GO_ON

    def describe(self, state, reason):
        if reason == "converged":
            return (
                f"converged: over the last {self.window} steps the free energy fell by less "
                f"than tol^2 = {self.tol**2:.3g} nats"
            )
        return super().describe(state, reason)


class DeterministicState(NamedTuple):
    """:class:`Deterministic`'s decrements of the last accepted steps (at most ``window``),
    the last one, and whether the method restored a state the next accepted evaluation
    tests (:meth:`Deterministic.verify`)."""

    decrements: tuple[float, ...] = ()
    last_decrement: float = float("inf")
    verifying: bool = False
    crawling: int = 0  # accepted steps in a row that moved q by less than CRAWL * tol


@dataclass(frozen=True)
class Deterministic(Control):
    """Backtracking fits: the decrement test, and early stopping that must pass it too.

    * **converged**: the natural-gradient decrement stayed below ``tol**2`` for ``window``
      accepted steps.
    * The free energy of an independent cloud (``info["since_best"]``) has not improved for
      ``patience`` accepted steps while the fit is near its fixed point (decrement below
      :data:`NEAR`, the best independent value finite), or for ``far_patience`` anywhere (an
      IRT model's 168 particles fitted their own positions for 2350 steps, their free energy
      falling by 14 nats, the independent one's not at all, at decrements of 1-14):
      **overfitting** (finite-N bias), a
      request to the method to restore its best state. The next accepted step re-evaluates
      that state; it ends the fit as **converged** only if its decrement is below
      ``tol**2``, else as **unverified**: the method then grows its cloud, or stops there
      as **overfitting**, not converged.
    * **stalled**: backtracking shrank the step below ``min_step`` without a decrease
      (converged instead if the last decrement was already below ``tol**2``), or, with
      ``crawl`` (GPF's natural steps, :data:`CRAWL`), ``patience`` accepted steps in a row
      each moved q by less than ``crawl * tol`` of its sds (step size times the square root
      of the decrement) while the decrement stayed above ``tol**2``: a crawl that would take
      thousands of steps to go anywhere. (A deep ensemble's gradient steps have no such
      scale: on the ensembles tutorial's network every step was that small, and the test
      stalled it at step 10 with test accuracy 0.11 where 300 steps reach 0.98.)
    """

    window: int = 3
    patience: int = 10
    far_patience: int = 50
    min_step: float = 1e-12
    crawl: float = 0.0  # the crawl test's fraction of tol (0: off); GPF's is CRAWL

    kind: ClassVar[str] = "deterministic"

    def init(self) -> DeterministicState:
        return DeterministicState()

    def observe(self, state, free_energy, info):
        decrements, last = state.decrements, state.last_decrement
        if info["accepted"]:
            last = float(info["decrement"])
            if state.verifying:
                state = state._replace(last_decrement=last, verifying=False)
                return state, Decision("converged" if last < self.tol**2 else "unverified")
            decrements = (*decrements[-(self.window - 1) :], last)
        state = state._replace(decrements=decrements, last_decrement=last)
        if info["accepted"] and len(decrements) == self.window and max(decrements) < self.tol**2:
            return state, Decision("converged")
        if self.crawl and info["accepted"]:
            moved = float(info["step_size"]) * math.sqrt(max(last, 0.0))
            crawling = state.crawling + 1 if moved < self.crawl * self.tol else 0
            state = state._replace(crawling=crawling)
            if crawling >= self.patience:
                return state._replace(crawling=0), Decision("stalled")
        independent = math.isfinite(info.get("best_validation", 0.0))
        since_best = info.get("since_best", 0)
        near = last < NEAR and independent
        far = independent and since_best >= self.far_patience
        if (near and since_best >= self.patience) or far:
            return state, Decision("overfitting")
        if not info["accepted"] and info["step_size"] < self.min_step:
            return state, Decision("converged" if last < self.tol**2 else "stalled")
        return state, GO_ON

    @staticmethod
    def verify(state: DeterministicState) -> DeterministicState:
        """The method restored a state: the next accepted evaluation decides."""
        return state._replace(decrements=(), verifying=True)

    @staticmethod
    def restart(state: DeterministicState) -> DeterministicState:
        """The method restarted its cloud: nothing it evaluated before counts."""
        return DeterministicState()

    def describe(self, state, reason):
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
                f"point (natural-gradient decrement {state.last_decrement:.2g} > tol^2 = "
                f"{self.tol**2:.3g}); q is that state, nearer the Gaussian optimum than the "
                "particles' own fixed point. More particles shrink the bias; method='gf' (fresh "
                "draws every step) has none"
            )
        if reason == "stalled":
            return (
                f"stalled: no step size down to {self.min_step:g} lowered the free energy"
                + (
                    f", or {self.patience} steps in a row moved q by less than "
                    f"{self.crawl * self.tol:.2g} of its sds"
                    if self.crawl
                    else ""
                )
                + f" (natural-gradient decrement {state.last_decrement:.2g} > tol^2); the "
                "log-density may be non-smooth or not finite near q"
            )
        return super().describe(state, reason)


@dataclass(frozen=True)
class Series:
    """An append-only sequence as an immutable value: the first ``length`` items of a list
    that later values may extend but never change. :meth:`add` copies nothing unless this
    value was added to before (then it copies its items first), so a log that grows by an
    item every step (a stochastic fit's window, up to 40 000 steps at the smallest step
    size; an ensemble's draws and trace) costs O(1) per step, where a tuple's copy would
    cost O(steps): 0.5 ms a step at 100 000 steps."""

    buffer: list = field(default_factory=list)
    length: int = 0

    @classmethod
    def of(cls, items: Sequence) -> Series:
        return cls(list(items), len(items))

    def add(self, item: Any) -> Series:
        """This sequence and ``item``."""
        buffer = self.buffer if len(self.buffer) == self.length else self.buffer[: self.length]
        buffer.append(item)
        return Series(buffer, self.length + 1)

    def items(self) -> list:
        """The items, as a new list."""
        return self.buffer[: self.length]

    def __len__(self) -> int:
        return self.length


class RunningAverage(NamedTuple):
    """The running (Polyak-Ruppert) average of a stochastic fit's parameters while it
    averages, and the moments of q's location over its whole windows, for the average's
    Monte Carlo error: their mean, variance and autocorrelations at lag one and
    :data:`LONG_LAGS`."""

    sums: tuple[np.ndarray, ...] | None = None
    count: int = 0
    windows: int = 0
    location_sum: float | np.ndarray = 0.0
    location_squares: float | np.ndarray = 0.0
    lagged: float | np.ndarray = 0.0
    last: np.ndarray | None = None  # the last location added, for the lag products
    # the first location: the moments are of the differences from it (no cancellation)
    origin: np.ndarray | None = None
    located: int = 0
    # the lag products at LONG_LAGS, (len(LONG_LAGS), ...), and the last max(LONG_LAGS)
    # locations they pair with the next window's (an earlier version's checkpoint has
    # neither: its average reads lag one only)
    long_lagged: float | np.ndarray = 0.0
    tail: np.ndarray | None = None

    def add(self, params: list[np.ndarray]) -> RunningAverage:
        return self._replace(sums=_add(self.sums, params), count=self.count + 1)

    def add_window(self, locations: np.ndarray) -> RunningAverage:
        """A window of q's locations ``(steps, ...)`` that passed the plateau test (the
        windows of one average are consecutive)."""
        origin = np.array(locations[0]) if self.origin is None else self.origin
        locations = locations - origin
        chain = locations if self.last is None else np.concatenate([self.last[None], locations])
        before = self.tail if self.tail is not None else locations[:0]
        long_chain, start = np.concatenate([before, locations]), len(before)
        products = [
            np.sum(long_chain[max(start, k) :] * long_chain[max(start, k) - k : -k], axis=0)
            for k in LONG_LAGS
        ]
        return self._replace(
            windows=self.windows + 1,
            origin=origin,
            lagged=self.lagged + np.sum(chain[1:] * chain[:-1], axis=0),
            long_lagged=self.long_lagged + np.stack(products),
            tail=long_chain[-max(LONG_LAGS) :],
            last=np.array(locations[-1]),
            location_sum=self.location_sum + locations.sum(axis=0),
            location_squares=self.location_squares + np.square(locations).sum(axis=0),
            located=self.located + len(locations),
        )

    def _reach(self, correlation_time: float, reach: float) -> int:
        """The longest of :data:`LONG_LAGS` within ``reach`` correlation times of the step
        (0 for an earlier version's average): the error is believed once it is read."""
        if np.ndim(self.long_lagged) == 0 and self.windows:
            return 0
        return max([k for k in LONG_LAGS if k <= reach * correlation_time], default=0)

    def location(self) -> np.ndarray:
        """q's average location over the whole windows."""
        return self.origin + self._centred_mean()

    def _centred_mean(self) -> np.ndarray:
        return self.location_sum / self.located

    def _variances(self) -> np.ndarray:
        return np.maximum(self.location_squares / self.located - self._centred_mean() ** 2, 0.0)

    def correlation_times(self, correlation_time: float, measured: bool = True) -> np.ndarray:
        """Per coordinate, the larger of ``correlation_time`` (what the step implies) and,
        if ``measured``, the ones measured from the iterates' autocorrelations: the AR(1)
        time of the lag-one autocorrelation ``rho``, ``(1 + rho) / (1 - rho)``, and the
        integrated time ``1 + 2 sum_k rho_k`` over lags one and :data:`LONG_LAGS` (those the
        average holds :data:`LAG_SPAN` times; each less its standard error, so that noise
        does not read as a slow mode; linear between them, geometric beyond the last). A
        mode that the step contracts more slowly than it implies (two WVGD particles
        drifting together, seen in their cells' weights) shows in its own iterates; one
        slower than a faster one shows at the longer lags."""
        if not measured:
            return np.full(np.shape(self.location_sum), float(correlation_time))
        mean, n = self._centred_mean(), self.located
        variance = self._variances()
        rho = _autocorrelation(self.lagged, mean, variance, n, 1)
        taus = np.maximum(correlation_time, (1.0 + rho) / (1.0 - rho))
        lags = [k for k in LONG_LAGS if n >= LAG_SPAN * k]
        if np.ndim(self.long_lagged) == 0 or not lags:  # an earlier version's average
            return taus
        error = np.sqrt(taus / n)  # of an autocorrelation, at most (Bartlett)
        rhos = [rho] + [
            np.maximum(_autocorrelation(products, mean, variance, n, k) - error, 0.0)
            for k, products in zip(lags, self.long_lagged, strict=False)
        ]
        return np.maximum(taus, _integrated_time([1, *lags], rhos))

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
        reach: float = LAG_REACH,
    ) -> float:
        """The largest of :meth:`errors`; ``inf`` until the period spans ``span``
        correlation times of the step, and ``span`` of each coordinate's own unless even the
        longest correlation time believed (``MAX_LAG_ONE``) would keep its error below ``tol``
        (a pooled variance over fewer correlation times is too small)."""
        n = self.located
        if n < max(2.0, span * correlation_time, LAG_SPAN * self._reach(correlation_time, reach)):
            return float("inf")
        taus, variances = self.correlation_times(correlation_time, measured), self._variances()
        longest = (1.0 + MAX_LAG_ONE) / (1.0 - MAX_LAG_ONE)
        if np.any((n < span * taus) & (np.sqrt(variances * longest / n) / scale >= tol)):
            return float("inf")
        return float(np.max(np.sqrt(variances * taus / n) / scale))


class StochasticState(NamedTuple):
    """:class:`Stochastic`'s state: the step size and the schedule's phase, the current
    window's free energies, q's locations and the sum of its parameters, and what the tests
    remember of earlier windows."""

    rate: float  # the step size
    values: Series  # the window's free energies
    locations: Series  # the window's locations of q
    rejections: int = 0  # non-finite steps in a row
    averaging: bool = False
    previous: tuple[float, float] | None = None  # the last window's mean and its variance
    scale: np.ndarray = np.ones(1)  # q's sds at the last step: the unit of the errors
    last_iterate: tuple[np.ndarray, ...] | None = None  # what finish replaced, for resume
    average: RunningAverage = RunningAverage()
    # the settled average at twice the step: q's location and its Monte Carlo errors
    coarse: tuple[np.ndarray, np.ndarray] | None = None
    # q's mean location in the last windows and its noise, (2, ...) each
    window_means: tuple[np.ndarray, ...] = ()
    window_sums: tuple[np.ndarray, ...] | None = None  # of q's parameters
    # the fit started again at the curvature's scales: 1 from its initial mean (a stall),
    # 2 from the MAP (a crawl, or a second stall)
    restarted: int = 0
    cut_steps: int = 0  # accepted steps in a row cut below CRAWL_CUT of the step size


@dataclass(frozen=True)
class Stochastic(Control):
    """Noisy objectives: windowed plateau test, step halving, Polyak-Ruppert averaging.

    It reads q's ``location`` and ``scale`` now (e.g. its mean and sds) and the ``params``
    to average; the average the fit ends on is its decision's ``params``; the step size is
    its state's ``rate`` (``initial_rate`` at first).

    Two phases. *Adapting*: at each plateau of the trace the step is halved, until it is at
    most ``max_average_rate`` and the iterates' step-to-step spread is below ``max_spread``
    of q's sds (a window spread by more than ``unstable_spread`` while averaging halves the
    step and adapts again). *Averaging*: the step stays fixed and every iterate enters a
    running average (:class:`RunningAverage`); its Monte Carlo error is the iterates'
    pooled variance times their correlation time over their number (after at least four
    windows, ``span`` correlation times and :data:`LAG_SPAN` times the longest lag read): per
    coordinate the larger of what the step implies, ``(2 - rate) / rate``, and the ones
    measured from the iterates' autocorrelations (``measured``;
    :meth:`RunningAverage.correlation_times`).
    Once that error is below ``tol`` the average is compared with the one at twice the step:
    the fit ends when its bias (their difference, less ``margin`` sds of its noise) and its
    error are within ``tol`` in quadrature in every coordinate (:meth:`_agree`), else the
    step halves and the fit averages afresh. A
    trace that starts falling again restarts the average. A window (at a step of at most
    ``max_average_rate``) whose iterates all lie within about ``tol`` of their average ends
    the fit at once, on that average, unless the windows' averages are still on the move
    (:meth:`_drifting`). With ``crawl``, ``crawl`` accepted steps in a row whose trust region
    cut them below :data:`CRAWL_CUT` of the step size (``info["step_size"]``) stop the fit as
    "crawling": q is far from the posterior and so narrow there that it would take thousands
    of steps to arrive (GF on a regression with flat priors and a response in the tens of
    thousands crawled 0.2 of 7.8 in its noise scale's log over 10 000 steps).

    The average of constant-step iterates is biased by O(step) (Dieuleveut, Durmus & Bach,
    2020), by an amount no fixed step bounds on every target: GF's average at rate 1/2 sat
    0.01 of q's sds from the exact Gaussian optimum on a latent GP posterior and 0.09 on a
    log-Gamma(1/2) one (0.01 at rate 1/8). With bias ``c * rate``, the gap between the
    averages at ``2 rate`` and ``rate`` is ``c * rate``, the bias that remains: so the
    comparison ends a fit only once that is within ``tol``. There is no average and no stop
    above ``max_average_rate`` (a full natural step is where the bias is largest), nor on one
    window's average, whose error estimate from a few correlated steps is too rough to end a
    fit on (unless the iterates themselves hardly move). Without ``stop_beside_largest_step``
    the averages at ``max_average_rate`` and half of it are not compared either: at the
    largest step the bias need not be linear in it yet (GF on a GARCH(1,1) posterior ended
    0.021-0.030 of q's sds from the Gaussian optimum on 4 of 16 seeds, each on that
    comparison; none beyond 0.02 without it).
    """

    _: KW_ONLY
    initial_rate: float = 1.0
    min_window: int = 20
    min_rate: float = 1e-4
    max_spread: float = 0.5
    unstable_spread: float = 1.0
    max_average_rate: float = 0.5
    min_windows: int = 4
    max_rejections: int = 30
    measured: bool = True
    span: float = SPAN
    reach: float = LAG_REACH
    margin: float = Z_BIAS
    crawl: int | None = None
    stop_beside_largest_step: bool = False

    kind: ClassVar[str] = "stochastic"

    def init(self) -> StochasticState:
        return StochasticState(self.initial_rate, Series(), Series())

    def rate(self, state):
        return state.rate

    def reads(self, state):
        return ("location", "scale", "params")

    def window_length(self, state: StochasticState) -> int:
        return max(self.min_window, math.ceil(4.0 / state.rate))

    @staticmethod
    def correlation_time(state: StochasticState) -> float:
        """Integrated autocorrelation time of the iterates: a natural step of size ``rate``
        contracts the distance to the fixed point by ``1 - rate``, an AR(1) process (a
        lower bound: slower modes show in :meth:`RunningAverage.correlation_times`)."""
        return (2.0 - min(state.rate, 1.0)) / state.rate

    def observe(self, state, free_energy, info):
        if not info["accepted"]:
            # a non-finite step was refused by the method (state kept): smaller steps
            state = self._new_rate(state, state.rate / 4)
            state = state._replace(rejections=state.rejections + 1)
            stalled = state.rejections >= self.max_rejections or state.rate < self.min_rate
            return state, Decision("stalled" if stalled else None)
        params = [np.asarray(p, dtype=float) for p in info["params"]]
        cut = self.crawl is not None and info["step_size"] < CRAWL_CUT * state.rate
        state = state._replace(
            cut_steps=state.cut_steps + 1 if cut else 0,
            rejections=0,
            scale=np.maximum(np.asarray(info["scale"], dtype=float), 1e-300),
            values=state.values.add(float(free_energy)),
            locations=state.locations.add(np.array(info["location"], dtype=float)),
            window_sums=_add(state.window_sums, params),
            average=state.average.add(params) if state.averaging else state.average,
        )
        if self.crawl is not None and state.cut_steps >= self.crawl:
            return state, Decision("crawling")
        if len(state.values) < self.window_length(state):
            return state, GO_ON
        return self._end_of_window(state)

    def _end_of_window(self, state: StochasticState) -> tuple[StochasticState, Decision]:
        values = state.values.items()
        stats = (_mean(values), _var_of_mean(values))
        previous = state.previous
        z = Z_ONE_SIDED_005 if state.averaging else Z_ONE_SIDED_5
        falling = previous is None or previous[0] - stats[0] > z * math.sqrt(previous[1] + stats[1])
        locations = np.asarray(state.locations.items())
        sds = np.std(locations, axis=0, ddof=1)
        noise = sds * math.sqrt(self.correlation_time(state) / len(locations))  # the mean's sd
        window_means, drifting = self._drifting(state, locations.mean(axis=0), noise)
        state = state._replace(previous=stats, window_means=window_means)
        spread = float(np.max(sds / state.scale))
        if state.averaging and spread > self.unstable_spread:
            # the iterates wander by more than a sd of q within a window: the step is too
            # large to average at (GF continuing GPF's fit of a non-centred eight-schools
            # posterior entered averaging at 1/2 after a quiet window, then its windows
            # spread by 0.8-2.1 sds for 10 000 steps and it ended 1.4 sds off the optimum)
            state = state._replace(averaging=False, average=RunningAverage(), coarse=None)
            return self._halve(state, len(locations))
        if state.averaging:
            if falling:  # not stationary after all: average afresh from here, and
                # compare with no average of an earlier q
                state = state._replace(average=RunningAverage(), coarse=None)
            else:
                state = state._replace(average=state.average.add_window(locations))
                if (
                    state.average.windows >= self.min_windows
                    and self._average_error(state) < self.tol
                ):
                    return self._settled(state)
        elif not falling:
            small_step = state.rate <= self.max_average_rate
            quiet = small_step and spread < self.tol
            if quiet and drifting is False:
                # every iterate of the window within about tol of its average, and the
                # windows' averages no longer moving: the average is that precise whatever
                # their correlation (e.g. GF on a Gaussian target)
                return self._stop(state, state.window_sums, len(locations), "converged")
            if quiet and drifting is None:
                pass  # quiet, but its drift at this step size is not known yet: one more window
            elif small_step and spread < self.max_spread:
                state = state._replace(averaging=True, average=RunningAverage())
            else:
                return self._halve(state, len(locations))
        return _cleared(state), GO_ON

    def _halve(self, state: StochasticState, count: int) -> tuple[StochasticState, Decision]:
        """Halve the step (a new window starts), or stop on the window's average at the
        floor."""
        sums = state.window_sums  # the new rate clears the window
        state = self._new_rate(state, state.rate / 2)
        if state.rate < self.min_rate:
            return self._stop(state, sums, count, "floor")
        return state, GO_ON

    def _drifting(
        self, state: StochasticState, mean: np.ndarray, noise: np.ndarray | None = None
    ) -> tuple[tuple[np.ndarray, ...], bool | None]:
        """Whether the windows' mean locations are still on the move, with the windows'
        means to keep (the state's and this one's, the last two): the last window's
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
        history = state.window_means
        means = (*history[-1:], np.stack([mean, noise]))
        if not history:
            return means, None
        d1 = float(np.max(np.abs(mean - history[-1][0]) / state.scale))
        if d1 <= AT_REST * self.tol:  # round-off (GF on a Gaussian target moves by 1e-13)
            return means, False
        if d1 >= self.tol:
            return means, True
        if len(history) < 2:
            return means, None
        if not (_moved(means[-1], history[-1]) or _moved(*history)):
            return means, False
        d0 = float(np.max(np.abs(history[-1][0] - history[-2][0]) / state.scale))
        r = d1 / d0 if d0 > 0 else math.inf
        return means, r >= 1 or d1 * r / (1 - r) >= self.tol

    def _settled(self, state: StochasticState) -> tuple[StochasticState, Decision]:
        """The average is precise to ``tol``: stop on it if it agrees with the settled average
        at twice the step, else halve the step and average afresh."""
        average = state.average
        location = average.location()
        errors = average.errors(self.correlation_time(state), state.scale, self.measured)
        coarse = state.coarse
        state = state._replace(coarse=(location, errors))
        if coarse is not None and (
            self.stop_beside_largest_step or 2 * state.rate < self.max_average_rate
        ):
            gap = np.abs(location - coarse[0]) / state.scale
            if self._agree(gap, errors, coarse[1]):
                return self._stop(state, average.sums, average.count, "converged")
        if state.rate / 2 < self.min_rate:
            return self._stop(state, average.sums, average.count, "floor")
        state = state._replace(averaging=False, average=RunningAverage())
        return self._new_rate(state, state.rate / 2), GO_ON

    def _agree(self, gap: np.ndarray, errors: np.ndarray, coarse_errors: np.ndarray) -> bool:
        """Whether the average is within ``tol`` of the fixed point: its bias, about ``gap``
        (the averages at twice the step and this one differ by the bias at this one, less
        ``margin`` sds of that difference's noise), and its Monte Carlo error ``errors``,
        in quadrature, every coordinate (in q's sds)."""
        bias = np.maximum(gap - self.margin * np.hypot(errors, coarse_errors), 0.0)
        return bool(np.all(np.hypot(bias, errors) <= self.tol))

    @staticmethod
    def _stop(
        state: StochasticState, sums: Sequence[np.ndarray], count: int, reason: str
    ) -> tuple[StochasticState, Decision]:
        """Stop for ``reason`` with q set to the average ``sums / count``
        (Polyak-Ruppert). The average's tail of locations goes (a saved fit need not hold
        32 copies of q's location): a refined fit's first window then pairs with none."""
        state = state._replace(average=state.average._replace(tail=None))
        return _cleared(state), Decision(reason, params=[s / count for s in sums])

    def _average_error(self, state: StochasticState) -> float:
        return state.average.error(
            self.correlation_time(state),
            state.scale,
            self.tol,
            self.measured,
            self.span,
            self.reach,
        )

    def progress(self, state):
        if self.tol is None:
            return ""
        if not state.averaging:
            return f"plateau test on windows of {self.window_length(state)} steps"
        error = self._average_error(state)
        if not math.isfinite(error):
            return "averaging"
        return f"averaging, error {error:.2g} (tol {self.tol:g})"

    @staticmethod
    def _new_rate(state: StochasticState, rate: float) -> StochasticState:
        # a drift measured at another step size says nothing of the drift at this one
        return _cleared(state._replace(rate=rate, window_means=()))

    def finish(self, state, reason, info):
        average = state.average
        if reason == "max_steps" and state.averaging and average.count:
            # the running average is the better estimate; refine resumes from the iterate
            state = state._replace(last_iterate=tuple(np.array(p) for p in info["params"]))
            return state, Decision(params=[s / average.count for s in average.sums])
        return state, GO_ON

    def resume(self, state):
        iterate = state.last_iterate
        state = state._replace(last_iterate=None)
        return state, GO_ON if iterate is None else Decision(params=list(iterate))

    def describe(self, state, reason):
        message = _stochastic_message(self, state, reason) or super().describe(state, reason)
        if state.restarted:
            why, where = RESTARTS[state.restarted]
            message += (
                f" (after {why}, the fit started again from {where} with sds from the "
                "curvature there)"
            )
        return message

    def restored(self, saved):
        average = RunningAverage(**saved.pop("average"))
        values, locations = Series.of(saved.pop("values")), Series.of(saved.pop("locations"))
        state = super().restored(saved)
        return state._replace(average=average, values=values, locations=locations)


def _autocorrelation(
    products: np.ndarray, mean: np.ndarray, variance: np.ndarray, n: int, lag: int
) -> np.ndarray:
    """The lag-``lag`` autocorrelation from the sum of lag products over ``n - lag`` pairs,
    in ``[0, MAX_LAG_ONE ** lag]``."""
    covariance = products / (n - lag) - np.square(mean)
    with np.errstate(divide="ignore", invalid="ignore"):
        rho = np.where(variance > 0, covariance / variance, 0.0)
    return np.clip(rho, 0.0, MAX_LAG_ONE**lag)


def _integrated_time(lags: list[int], rhos: list[np.ndarray]) -> np.ndarray:
    """``1 + 2 sum_{k >= 1} rho_k`` from the autocorrelations at ``lags`` (1 first): the
    trapezoid rule between them (over an exponential decay, a little above its sum) and,
    beyond the last lag ``K``, the geometric tail of the AR(1) decay ``rho_K ** (1 / K)``
    (the ratio of the last two is too noisy to extrapolate: it made 100 of a time of 35)."""
    total = 0.5 * rhos[0]
    for a, b, ra, rb in zip(lags, lags[1:], rhos, rhos[1:], strict=False):
        total = total + 0.5 * (b - a) * (ra + rb)
    decay = rhos[-1] ** (1.0 / lags[-1])
    return 1.0 + 2.0 * (total + rhos[-1] * (0.5 + decay / (1.0 - decay)))


def _cleared(state: StochasticState) -> StochasticState:
    """``state`` with its window cleared (a new window starts)."""
    return state._replace(values=Series(), locations=Series(), window_sums=None)


def _stochastic_message(control: Stochastic, state: StochasticState, reason: str) -> str | None:
    """:meth:`Stochastic.describe` for the reasons whose explanation needs its numbers."""
    if reason == "converged":
        how = (
            f"the Monte Carlo error of the averaged q, with its iterates' correlation time "
            f"(measured, at least the step's), is below tol = {control.tol:g} of its sds; q is "
            f"the average of the "
            f"iterates over the last {state.average.count} steps"
            if state.averaging
            else f"the iterates moved by less than tol = {control.tol:g} of q's sds over the "
            "last window; q is their average"
        )
        return (
            "converged: the free energy stopped decreasing (one-sided test at 5 % between "
            f"windows of {control.window_length(state)} steps) and {how}"
        )
    if reason == "floor":
        return (
            f"the step size fell to {state.rate:.2g} (its floor) before the iterates "
            "settled within tol; q is the average of the last window"
        )
    if reason == "crawling":
        return (
            f"crawling: for {state.cut_steps} steps in a row the trust region cut the natural "
            f"step below {CRAWL_CUT:g} of its size, q's mean being more than a hundred of its "
            "sds from where the gradient points: far from the posterior, and narrow there"
        )
    if reason == "stalled":
        return (
            f"stalled: {state.rejections} consecutive steps produced non-finite values even "
            f"at step size {state.rate:.2g}"
        )
    if reason == "max_steps" and state.averaging and state.average.windows >= 2:
        error = control._average_error(state)
        if not math.isfinite(error):
            return (
                f"reached the maximum number of steps while averaging, over "
                f"{state.average.located} steps, too few for {control.span:g} correlation "
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
    saved objects as their :meth:`Saved.state`, states (``NamedTuple``) as dicts of their
    fields, a :class:`Series` as a list, lists, tuples and dicts element-wise."""
    if isinstance(value, Saved):
        return value.state()
    if isinstance(value, tuple) and hasattr(value, "_asdict"):
        return {k: _to_json(v) for k, v in value._asdict().items()}
    if isinstance(value, Series):
        value = value.items()
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
    """The inverse of :func:`_to_json`, lists as tuples (saved objects are loaded in place
    by :meth:`Saved.load`; states and series by :func:`restore_control`)."""
    if isinstance(value, dict) and _ARRAY in value:
        return np.array(value[_ARRAY], dtype=value["dtype"]).reshape(value["shape"])
    if isinstance(value, list):
        return tuple(_from_json(v) for v in value)
    if isinstance(value, dict):
        return {k: _from_json(v) for k, v in value.items()}
    return value


def _add(sums: Sequence[np.ndarray] | None, arrays: Sequence[np.ndarray]) -> tuple:
    if sums is None:
        return tuple(arrays)
    return tuple(a + b for a, b in zip(sums, arrays, strict=True))


def _mean(values: Sequence[float]) -> float:
    with np.errstate(over="ignore"):  # free energies near 1e308 far out: the mean is inf
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
    with np.errstate(over="ignore", invalid="ignore"):  # far out: inf or nan, not a warning
        steps = np.arange(n) - (n - 1) / 2
        slope = np.dot(steps, values - values.mean()) / np.dot(steps, steps)
        residuals = values - values.mean() - slope * steps
        denominator = float(np.dot(residuals, residuals))
        if denominator <= 0:
            return 0.0
        rho = min(max(float(np.dot(residuals[1:], residuals[:-1]) / denominator), 0.0), 0.9)
        return float(denominator / (n - 2) / n * (1 + rho) / (1 - rho))
