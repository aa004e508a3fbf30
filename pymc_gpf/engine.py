"""The fit every method shares: one compiled step, PyMC's conventions around it.

A method describes one step as a :class:`~pymc_gpf.stepgraph.StepGraph`; the engine parses
the fit keywords (:mod:`pymc_gpf.options`), compiles the step with its guard and
hyperparameter learning (:mod:`pymc_gpf.stepgraph`), runs it (:mod:`pymc_gpf.loop`) under the
method's controller (:mod:`pymc_gpf.control`) and explains a failure
(:mod:`pymc_gpf.failure`). What a method provides is :class:`pymc_gpf.protocols.Method`.
"""

from __future__ import annotations

import math
import warnings

from collections.abc import Callable
from dataclasses import replace
from typing import Any, ClassVar

import numpy as np
import pymc as pm
import pytensor

from pymc.progress_bar import default_progress_theme
from pymc.variational.inference import Inference, State
from pytensor.compile.sharedvalue import SharedVariable

from pymc_gpf.checks import is_integer, positive, seed_sequence
from pymc_gpf.config import MethodConfig
from pymc_gpf.control import (
    LAG_REACH,
    SPAN,
    Z_BIAS,
    Control,
    Decision,
    FixedSteps,
    Stochastic,
    restore_control,
)
from pymc_gpf.diagnostics import nuts
from pymc_gpf.errors import FitWarning
from pymc_gpf.failure import FailedStep, explain_failure
from pymc_gpf.hyper import HyperSearch, compile_hyper_moments, flat_values, set_flat_values
from pymc_gpf.jaxlink import row_sharding
from pymc_gpf.loop import fit_outcome, progress_text, run_steps
from pymc_gpf.options import (
    DEFAULT_MAX_STEPS,
    FIT_DOC,
    INITS,
    MINIBATCH_MAX_STEPS,
    FitOptions,
    check_fit_keywords,
    parse_fit_options,
    parse_learning_rate,
)
from pymc_gpf.protocols import Initialised
from pymc_gpf.record import FitRecord
from pymc_gpf.stepgraph import compile_step
from pymc_gpf.target import LARGE_DATA, batched_target
from pymc_gpf.threads import one_blas_pool
from pymc_gpf.verdict import (
    FAMILY_LIMITED,
    NOT_CONVERGED,
    UNCONVERGED_REMEDIES,
    Verdict,
    fit_warning,
)

__all__ = ["FlowInference", "configure"]

# spawn keys of the fit's streams under its seed (0-3: start, data, noise, the method's own)
END_STREAM = 4  # a method's draws at the end of a fit (WVGD's cell weights on minibatches)
CHECK_STREAM = 5  # the verdict's draws, per step count
HYPER_STREAM = 6  # the hyperparameters' draws of q, per step
# 7 and 9: GPF's own (pymc_gpf.gpf.method.FRESH_STREAM, VIEW_STREAM)
WHITEN_STREAM = 8  # WVGD's Gaussian fit whose coordinates it runs in
# a first step whose points reach where log p is not finite, around a finite centre, is
# retried from a start this many times narrower (or otherwise changed: _retry_start), at most
# MAX_START_RETRIES times
NARROWING, MAX_START_RETRIES = 0.1, 3
# minibatch control variates: a new anchor once q's centre moved this many of its sds from it,
# if the steps since the last evaluated this many times what a new one costs (a quarter more)
ANCHOR_DRIFT, ANCHOR_SHARE = 2.0, 4
# learnt hyperparameters are trusted only where q's bound is within this many nats (plus
# BOUND_GAP_Z Monte Carlo errors of the ELBO) of the importance-sampling log evidence
BOUND_GAP_LIMIT, BOUND_GAP_Z = 0.05, 3.0
HYPER_DRAWS, HYPER_MAX_DRAWS, HYPER_BATCH = 4096, 32768, 512  # q's draws for θ's step
# an unconverged fit names a sd of q that changed by more than this factor in it: GF's
# starts at 0.1, and its fits on the reference and hard posteriors end at sds from 1e-3 to
# 1.3e4 (an unscaled predictor), a factor 1.3e5 at most; where a Flat variable has no data
# its sd reached 1.5e21 before the fit stalled
RUNAWAY = 1e10
# q's mean moved this many of its sds in one call: still on its way to a far posterior
TRAVELLING = 100.0


def rebuild(cls: type[FlowInference], model: pm.Model, options: dict[str, Any]) -> FlowInference:
    """An inference rebuilt from :meth:`~FlowInference.constructor_options`, skipping its
    search for a starting point (a checkpoint's state replaces it)."""
    options = dict(options)
    for old, new in cls.renamed_options.items():  # saved by an earlier release
        if old in options:
            options[new] = options.pop(old)
    init = options.pop("init", INITS[0])
    inference = cls(model=model, init=INITS[0], **options)
    inference.adjusted["init"] = init
    return inference


class FlowInference(Inference):
    """Base class of the pymc-gpf methods; a :class:`pymc.variational.Inference`.

    Subclasses set :attr:`name` and implement the hooks of
    :class:`pymc_gpf.protocols.Method` (build the approximation, build the step).

    Every method takes ``model``, ``random_seed`` and ``start`` as ``pm.fit`` does, and
    ``devices``: the JAX devices to split the particles or draws across
    (``backend="jax"``; a number, a list of devices or a ``jax.sharding.Mesh``; docs:
    "Scaling up").
    """

    name: ClassVar[str] = ""
    # the pure step functions ``_build_step`` applies, each
    # ``step(state, noise, target, rates, static) -> (State, Info)`` (pymc_gpf.stepgraph)
    steps: ClassVar[tuple[Callable, ...]] = ()
    # each step's initial state, in the order of ``steps``: a pure NumPy
    # ``init_<kind>(q, static, dtype) -> State`` next to it in the method's step module
    inits: ClassVar[tuple[Callable, ...]] = ()
    default_learning_rate: ClassVar[float] = 1e-3
    default_optimizer: ClassVar[str] = "sgd"
    spread_option: ClassVar[str] = "init_scale"  # the option setting the initial spread
    renamed_options: ClassVar[dict[str, str]] = {}  # old constructor keyword -> new
    start_points: ClassVar[str] = "particles"  # what the first step evaluates
    narrowing: ClassVar[float] = NARROWING  # the spread's factor each time it is narrowed
    # the free energy recorded is the particles' own (GPF: a quadrature finite N can bias low)
    particle_free_energy: ClassVar[bool] = False
    # the stochastic schedule's correlation times per average, the step's correlation times
    # its lags must reach (pymc_gpf.control.LAG_REACH) and agreement margin (in sds)
    average_span: ClassVar[float] = SPAN
    lag_reach: ClassVar[float] = LAG_REACH
    agreement_margin: ClassVar[float] = Z_BIAS
    # whether the averages at the largest averaging step and half of it may end a fit
    stop_beside_largest_step: ClassVar[bool] = Stochastic.stop_beside_largest_step
    # a method without a constructor of its own: its keywords are this config's fields
    Config: ClassVar[type[MethodConfig] | None] = None

    @property
    def crawl_steps(self) -> int | None:
        """The stochastic schedule's crawl test (:class:`pymc_gpf.control.Stochastic`'s
        ``crawl``): off unless the method can act on it (:meth:`_on_stop`)."""
        return None

    @property
    def measured_correlation(self) -> bool:
        """Whether the stochastic schedule measures its iterates' correlation time
        (:meth:`pymc_gpf.control.RunningAverage.correlation_times`) or only takes the step's."""
        return True

    def __init__(
        self, *, model=None, random_seed=None, start=None, devices=None,
        config: MethodConfig | None = None, initial_particles: np.ndarray | None = None,
        **options,
    ):  # fmt: skip
        # a method's __init__ hands over its config (and its initial particles); one
        # without a constructor of its own has its keywords made into its ``Config``
        if config is None and self.Config is not None:
            config = self.Config(**options)
        elif options:
            raise TypeError(f"{type(self).__name__} got unexpected keywords {sorted(options)}")
        self.config = config  # the constructor's options, frozen; never replaced
        # explicit starting points (GPF's, WVGD's initial_particles), as given; or None
        self.initial_particles = initial_particles
        self.target = batched_target(model)
        self.target.row_sharding = row_sharding(devices)
        self.record = FitRecord()  # the trace, step sizes, outcome and cost of all fits
        # the controller's settings and its state, which every answer of it replaces
        self.control: Control | None = None
        self.control_state: tuple | None = None
        self.state: State | None = None  # PyMC's (i, step, callbacks, score)
        self._start_sds: np.ndarray | None = None  # q's sds when this call of fit began
        self._start_mean: np.ndarray | None = None  # and its mean
        self.fit_options: FitOptions | None = None
        # the step sizes the compiled step reads, a shared variable (refine(n,
        # learning_rate=...) needs no compile): a fixed one from the fit keywords, the
        # controller's from its state (_write_rate)
        self._learning_rates = pytensor.shared(
            np.zeros(2, dtype=pytensor.config.floatX), name=f"{self.name}_learning_rates"
        )
        self.state_vars: dict[str, SharedVariable] = {}
        # more_obj_params at the automatic step size: θ's search (pymc_gpf.hyper)
        self.hyper: HyperSearch | None = None
        self._hyper_fn = None
        self._progressbar = True  # as the last fit: refine() follows it
        self._start = start
        self._start_note = ""  # how the start was changed, if it was (_retry_start)
        self.fitted_data = None  # the data the last run fitted (None: not run, or loaded)
        self._seed(random_seed)
        # options changed after construction, over ``resolved`` (which stays as built): the
        # start narrowed mid-fit, a loaded fit's init (:attr:`options_in_effect`)
        self.adjusted: dict[str, Any] = {}
        self._start_from(self._initialise())

    def _start_from(self, initialised: Initialised) -> None:
        """Keep what the method's ``_initialise`` decided
        (:class:`~pymc_gpf.protocols.Initialised`): q at the start; the options as this fit
        resolved them (a particle count for initial_particles, GF's rank; ``config`` stays
        as given); q's structure (GF, GPF); the method's own state."""
        self._approx = initialised.approx
        self.resolved = initialised.resolved if initialised.resolved is not None else self.config
        self.structure = initialised.structure
        # what the method keeps over its fits besides the record: one object, created by
        # _initialise, whose fields the method updates (None: nothing of its own)
        self.own = initialised.own

    approx = property(lambda self: self._approx)
    model = property(lambda self: self.target.model)
    # the record, read-only (pymc_gpf.record.FitRecord)
    hist = property(lambda self: self.record.free_energy, doc="free energy per accepted step")
    step_sizes = property(lambda self: self.record.step_sizes, doc="step size per step")
    outcome = property(lambda self: self.record.outcome, doc="how the last call ended")
    gradient_evaluations = property(lambda self: self.record.gradient_evaluations)
    density_evaluations = property(lambda self: self.record.density_evaluations)
    hyper_trace = property(lambda self: self.record.hyper_trace)
    # the root of the verdict's and the hyperparameters' draws (seeded per step; saved)
    check_root = property(lambda self: self._check_root)

    # (eta1, eta2) as symbolic scalars, for the methods' step graphs
    learning_rates = property(lambda self: (self._learning_rates[0], self._learning_rates[1]))

    # ---------------------- optional hooks (the required ones: pymc_gpf.protocols.Method)
    @property
    def final_free_energy(self) -> float | None:
        """The free energy of the state the fit ended on, where the method knows it
        exactly (GPF); ``None``: read it from the trace."""
        return None

    def checkpoint_extra(self) -> dict[str, Any]:
        return {}

    def load_checkpoint_extra(self, extra: dict[str, Any]) -> None:
        """Restore :meth:`checkpoint_extra`."""

    @property
    def continuation(self) -> FlowInference | None:
        """The inner fit that a ``refine`` of this one continues (GPF's with fresh draws),
        saved with it; ``None``: refine continues this fit's own steps."""
        return None

    def load_continuation(self, inner: FlowInference) -> None:
        """Restore :attr:`continuation` (a loaded inner fit)."""

    def run_elsewhere(self, n: int, progressbar: bool) -> str | None:
        """Run this call's ``n`` steps some other way than the engine's loop (GPF: GF's flow
        fitting a structure particles cannot hold, or continuing a fit it took over), put
        them on record (:meth:`merge_run`, :meth:`conclude_run`) and return how they ended;
        ``None`` (the default): the engine's loop runs them, or those left after a stage
        put on record (WVGD's Gaussian fit). The verdict follows either way."""
        return None

    def run_ended(self, run: FitRecord) -> None:
        """A run of the loop is over (``run``: its fragment of the record, before it is
        merged): a method may append steps taken inside it (GPF: GF's continuation)."""

    def observed_fields(self) -> dict[str, Any]:
        """Fields of the method's own the controller reads for its next decision (the
        ensembles': particles, drift, log p, preconditioner); none by default."""
        return {}

    def apply_decision(self, decision: Decision) -> None:
        """Carry out the parts of the controller's ``decision`` beyond q's parameters and
        step size (the ensembles' preconditioner, restarted particles); none by default."""

    def hyperparameters_moved(self) -> bool:
        """θ moved: ``True`` if the method restarted q's convergence itself (GPF's line
        search); ``False`` (the default): a fresh schedule of the engine's."""
        return False

    def _finish(self, reason: str) -> None:
        """The fit is over for now (any reason but a divergence): last touches."""

    def _on_stop(self, reason: str, step: int) -> str | None:
        return reason

    def _before_first_fit(self, options: FitOptions) -> None:
        """The first ``fit`` is about to start (not a continued or loaded one)."""

    def _retry_start(self, attempt: int) -> tuple[str, str] | None:
        """The automatic fit's first step failed (``attempt`` earlier retries): change the
        start and say how, as ``(kind, note)`` for the outcome's message, or ``None`` if
        there is nothing left to try. Here: narrow the initial spread by :attr:`narrowing`
        (:meth:`_narrow_start`). A centre where log p is finite
        (:func:`pymc_gpf.start.check_start`) with initial points around it where it is not
        (e.g. a censored likelihood underflowing far from the data): the automatic default
        starts closer to the centre rather than fail."""
        if not self._narrow_start(self.narrowing):
            return None
        option = self.spread_option
        narrower = getattr(self.options_in_effect, option) * self.narrowing
        self.adjusted[option] = narrower
        return "narrowed", (
            f"the initial {self.start_points} reached where the log-density is not "
            f"finite, so the fit started from a narrower q ({option} {narrower:.3g})"
        )

    def _narrow_start(self, factor: float) -> bool:
        """Shrink the initial spread around its centre by ``factor`` (the first step found
        the log-density not finite at some of the initial points); ``False`` if this
        method's start cannot be narrowed (e.g. points the user gave)."""
        return False

    def _describe(self, reason: str) -> str:
        return self.control.describe(self.control_state, reason)

    from_options = classmethod(rebuild)

    @property
    def options_in_effect(self) -> MethodConfig:
        """The options as this fit resolved them (:attr:`resolved`) with what changed after
        construction (:attr:`adjusted`)."""
        return replace(self.resolved, **self.adjusted) if self.adjusted else self.resolved

    def constructor_options(self) -> dict[str, Any]:
        """The constructor keywords that rebuild this inference (JSON-able; for saving), as
        this fit resolved them (:attr:`options_in_effect`)."""
        return self.options_in_effect.options()

    def settings(self) -> dict[str, Any]:
        """The options of this fit, as stored in the method's DataTree group."""
        fit = self.fit_options.settings() if self.fit_options is not None else {}
        sharding = self.target.row_sharding
        devices = 1 if sharding is None else len(sharding.device_set)
        common = {"random_seed": self.random_seed, "n_steps": len(self.hist), "devices": devices}
        return self.constructor_options() | common | self._fitted_settings() | fit

    def _fitted_settings(self) -> dict[str, Any]:
        return {}

    def _seed(self, random_seed) -> None:
        self.random_seed = random_seed
        root = seed_sequence(random_seed)
        # the verdict's draws: a stream of their own, from the seed and the step count
        self._check_root = (root.entropy, tuple(root.spawn_key))
        init_seq, data_seq, noise_seq, method_seq = root.spawn(4)
        self.target.seed(data_seq)
        self._init_rng = np.random.default_rng(init_seq)
        # a stream of the method's own (GPF: restarts, independent clouds; saved with the fit)
        self._method_rng = np.random.default_rng(method_seq)
        noise = np.random.default_rng(noise_seq)
        if hasattr(self, "noise_rng"):
            self.noise_rng.set_value(noise, borrow=True)
        else:
            # a drawing step's state holds it as ``rng``; its name is the checkpoint's key
            self.noise_rng = pytensor.shared(noise, name="noise_rng")

    def fit(self, n=None, score=None, callbacks=None, progressbar=True,
            progressbar_theme=default_progress_theme, **keywords):  # fmt: skip
        if n is None:
            n = MINIBATCH_MAX_STEPS if self.target.minibatch else DEFAULT_MAX_STEPS
        if not is_integer(n, 0):
            raise ValueError(f"n (the number of steps) must be a non-negative integer, got {n!r}.")
        check_fit_keywords(type(self).__name__, keywords)
        self.prepare(parse_fit_options(self.target, self.default_optimizer, **keywords))
        if self.state is None:
            self._before_first_fit(self.fit_options)
        done = 0 if self.state is None else self.state.i
        self.state = State(done, step=self.step, callbacks=list(callbacks or []), score=True)
        self._progressbar = bool(progressbar)  # refine() shows a bar only if the fit did
        self._run(int(n), progressbar, progressbar_theme)
        return self.approx

    fit.__doc__ = FIT_DOC

    def stream(self, *key: int) -> np.random.SeedSequence:
        """The seed of one of the fit's streams (``END_STREAM``, ``CHECK_STREAM``, ...), a
        child of its ``random_seed`` (saved with the fit, so a loaded fit draws the same)."""
        entropy, root = self._check_root
        return np.random.SeedSequence(entropy, spawn_key=(*root, *key))

    def verdict_rng(self) -> np.random.Generator:
        """The generator of the verdict's draws on the fit as it stands (a stream of its own,
        per step count: a loaded fit judges, and resamples, the same draws)."""
        return np.random.default_rng(self.stream(CHECK_STREAM, len(self.hist)))

    def _write_rate(self) -> None:
        """The controller's step size (if it sets one) into the compiled step, as both
        ``eta1`` and ``eta2``: after every decision of the controller. The step size lives
        in the controller's state; the shared variable is only the compiled step's input."""
        rate, rates = self.control.rate(self.control_state), self._learning_rates
        if rate is not None and rates.get_value()[0] != np.asarray(rate, dtype=rates.dtype):
            rates.set_value(np.full(2, rate, dtype=rates.dtype))

    def observation(self) -> dict[str, Any]:
        """The fields of q the controller ``reads``, for its next decision: q's
        ``location`` and ``scale`` (:meth:`location`), its ``params``' values and the
        method's own (:meth:`observed_fields`)."""
        reads, out = self.control.reads(self.control_state), {}
        if "location" in reads or "scale" in reads:
            out["location"], out["scale"] = self.approx.location()
        if "params" in reads:
            out["params"] = [p.get_value() for p in self.approx.params]
        return out | self.observed_fields()

    def _decide(self, answer: tuple[tuple, Decision]) -> str | None:
        """The controller's ``answer``, its next state and a decision: keep the one, carry
        out the other; its stop code."""
        self.control_state, decision = answer
        self._apply(decision)
        return decision.stop

    def revise_control(self, revise: Callable[[tuple], tuple]) -> None:
        """A method's own change to its controller's state between decisions: GPF restored
        or restarted its cloud (:meth:`pymc_gpf.control.Deterministic.verify`, ``restart``), a
        Langevin ensemble starts from a Gaussian fit's covariance
        (:meth:`pymc_gpf.ensemble.control.SamplingControl.keep_preconditioner`)."""
        self.control_state = revise(self.control_state)

    def load_control(self, saved: dict[str, Any]) -> None:
        """Restore the controller and its state a checkpoint holds
        (:func:`pymc_gpf.control.restore_control`)."""
        self.control, self.control_state = restore_control(self.control, saved)

    def _new_control(self, options: FitOptions) -> None:
        """The method's controller for ``options``, in its initial state."""
        self.control = self._control(options)
        self.control_state = self.control.init()

    def _apply(self, decision: Decision) -> None:
        """Carry out the controller's ``decision`` (its step size: :meth:`_write_rate`)."""
        if decision.params is not None:
            for shared, value in zip(self.approx.params, decision.params, strict=True):
                shared.set_value(value.astype(shared.dtype))
        self.apply_decision(decision)

    def restore(self, record: FitRecord, step: int, random_seed, check_root: tuple) -> None:
        """Continue a saved fit (:func:`pymc_gpf.load`, after :meth:`prepare` and its state
        variables, the generator of its draws among them): its record, step count, seed and
        verdict stream."""
        self.record = record
        self.state = State(step, step=self.step, callbacks=[], score=True)
        self.random_seed = random_seed
        self._check_root = check_root
        self._write_rate()

    def prepare(self, options: FitOptions) -> None:
        """Compile the step for ``options`` (the fit keywords) and set up its controller:
        what ``fit`` does before its first step (and :func:`pymc_gpf.load` before it
        restores a saved state)."""
        rates = options.learning_rate if not options.auto else (1.0, 1.0)
        self._learning_rates.set_value(np.asarray(rates, dtype=self.target.dtype))
        graph = self._build_step(options)
        if graph is None:  # no step of its own: the method runs its fits elsewhere
            self.fit_options, self.step, self.state_vars = options, None, {}
            self.hyper, self._hyper_fn = None, None
            self._new_control(options)
            return
        self.step, self.state_vars = compile_step(graph, options, self._learning_rates)
        self.fit_options = options
        self._new_control(options)
        self._write_rate()
        self.hyper = HyperSearch(options.tol) if options.auto and options.more_obj_params else None
        self._hyper_fn = None

    def refine(self, n: int, progressbar: bool | None = None,
               progressbar_theme=default_progress_theme, *, learning_rate=None,
               tol: float | None = None):  # fmt: skip
        """Continue with the last compiled step, optimiser state, callbacks and history (at
        most ``n`` more steps); ``progressbar`` defaults to the fit's. With a fixed step
        size, ``learning_rate`` changes it from here on (e.g. after a divergence); ``tol``
        changes the stopping tolerance."""
        if self.state is None:
            raise TypeError("Need to call `.fit` first")
        if not is_integer(n, 0):
            raise ValueError(f"n (the number of steps) must be a non-negative integer, got {n!r}.")
        if learning_rate is not None:
            rates = parse_learning_rate(learning_rate)
            if rates is None or self.fit_options.auto:
                raise ValueError(
                    "refine(learning_rate=...) changes a fixed step size; this fit "
                    f"{'uses' if self.fit_options.auto else 'cannot switch to'} the automatic "
                    "one. Start a new fit with the step size you want instead."
                )
            self._learning_rates.set_value(np.asarray(rates, dtype=self.target.dtype))
            self.fit_options = replace(self.fit_options, learning_rate=rates)
        if tol is not None:
            self.fit_options = replace(self.fit_options, tol=positive("tol", tol))
            self.control = replace(self.control, tol=self.fit_options.tol)
            if self.hyper is not None:
                self.hyper.tol = self.fit_options.tol
        if progressbar is None:
            progressbar = self._progressbar
        self._run(int(n), progressbar, progressbar_theme)
        return self.approx

    def judge(self) -> Verdict | None:
        """The verdict on the fit as it stands (:mod:`pymc_gpf.verdict`): "not converged"
        from the outcome alone, else the approximation's own check (``None`` when it needs
        importance sampling and ``check_draws=0``)."""
        outcome = self.outcome
        if outcome.converged is False:
            return Verdict(NOT_CONVERGED, outcome.message, self._remedy(outcome.reason))
        verdict = self.approx.check_fit(self.verdict_rng(), self.fit_options.check_draws)
        params = self.fit_options.more_obj_params
        if verdict is None or not params:
            return verdict
        names = ", ".join(p.name or repr(p) for p in params)
        if verdict.trustworthy:
            # q can pass the moment checks while its bound is loose: then θ maximises the
            # bound, not the evidence (WVGD's five cells on a GP: 0.68 nats, θ 39 % off)
            numbers = verdict.numbers
            gap = numbers.get("log_evidence", np.nan) - numbers.get("elbo", np.nan)
            noise = BOUND_GAP_Z * numbers.get("elbo_mcse", 0.0)
            if not gap > BOUND_GAP_LIMIT + noise:
                return verdict
            cause = (
                f"the evidence bound is {gap:.2g} nats below importance sampling's estimate "
                f"of log p(y | θ) (k̂ = {numbers.get('pareto_k', np.nan):.2f}), so the learnt "
                f"hyperparameters ({names}) maximise a loose bound, not the evidence: they "
                "can be far from type-II maximum likelihood"
            )
            remedy = "method='gpf' or 'gf' (a Gaussian q whose bound is tight here)"
            return replace(verdict, word=FAMILY_LIMITED, cause=cause, remedy=remedy)
        cause = (
            f"{verdict.cause}; the learnt hyperparameters ({names}) minimise q's free "
            "energy, which is not -log p(y | θ) where q is off: they can be far from type-II "
            "maximum likelihood (a loose bound favours simpler priors)"
        )
        return replace(verdict, cause=cause)

    # --------------------------------------- more_obj_params at the automatic step size
    def hyper_stop(self, stop: str | None, step: int) -> str | None:
        """A converged q with hyperparameters to learn: one step of θ (``None``: the fit
        goes on) unless θ has converged too (:mod:`pymc_gpf.hyper`)."""
        if stop != "converged" or self.hyper is None:
            return stop
        params = self.fit_options.more_obj_params
        gradient, curvature, noise = self._hyper_moments(step)
        if not (np.all(np.isfinite(gradient)) and np.all(np.isfinite(curvature))):
            # log p is not finite at some of q's points: θ has no gradient there
            self.hyper.stuck = True
            return "stalled"
        move = self.hyper.propose(gradient, curvature, noise)
        if move is None:
            return "converged"
        before = flat_values(params)
        set_flat_values(params, before + move)
        self.hyper.step_taken = flat_values(params) - before  # as applied (e.g. float32)
        if not self.hyperparameters_moved():
            self._fresh_schedule()
        return None

    def _hyper_moments(self, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """The envelope gradient of the free energy in θ, its fixed-q Hessian, and the
        gradient's Monte Carlo covariance (``None`` for a deterministic quadrature). Draws
        of q (in batches of ``HYPER_BATCH``, whose means give the covariance) double from
        ``HYPER_DRAWS`` to ``HYPER_MAX_DRAWS`` while the noise leaves θ's test open."""
        options = self.fit_options
        if self._hyper_fn is None:
            self._hyper_fn = compile_hyper_moments(
                self.target, options.more_obj_params, options.compile_backend,
                options.compile_kwargs,
            )  # fmt: skip
        seed = self.stream(HYPER_STREAM, step)
        rng = np.random.default_rng(seed)
        grads, hessian, total, draws = [], 0.0, 0, HYPER_DRAWS
        while True:
            points, exact = self._hyper_points(rng, draws)
            batches = [points] if exact else np.split(points, len(points) // HYPER_BATCH)
            for batch in batches:
                gradient_sum, hessian_sum = self._hyper_fn(batch)
                grads.append(np.asarray(gradient_sum) / len(batch))
                hessian = hessian + np.asarray(hessian_sum)
            self.record.count(gradients=len(points))  # θ-gradients of log p at q's points
            total += len(points)
            gradient = np.mean(grads, axis=0)
            if exact:
                return gradient, hessian / total, None
            noise = np.atleast_2d(np.cov(np.array(grads), rowvar=False)) / len(grads)
            if total >= HYPER_MAX_DRAWS or not self.hyper.unclear(gradient, hessian / total, noise):
                return gradient, hessian / total, noise
            draws = total

    def _hyper_points(self, rng: np.random.Generator, draws: int) -> tuple[np.ndarray, bool]:
        """Points of q over which the hyperparameters' gradient is averaged, and whether
        that average is the method's own (deterministic) quadrature: by default ``draws``
        fresh draws of q."""
        return self.approx.draw(draws, rng), False

    def _fresh_schedule(self) -> None:
        """θ moved: q converges again, from where it is, with a fresh schedule (and the
        minibatch control variates' anchor is evaluated again at the new θ)."""
        self._new_control(self.fit_options)
        self._write_rate()
        self._anchor(force=True)

    def end_message(self, reason: str) -> str:
        """How the fit ended, in words (the hyperparameters' test included)."""
        if self.hyper is not None and self.hyper.stuck and reason == "stalled":
            return (
                "stalled: the hyperparameters' gradient is not finite at q's points (log p is "
                "not finite at some of them), so they stay where they are; q had converged"
            )
        message = self._describe(reason)
        if reason == "converged" and self.hyper is not None:
            message += f"; {self.hyper.describe()}"
        if self._start_note:
            message += f" ({self._start_note})"
        return message

    def _mean_and_sds(self) -> tuple[np.ndarray, np.ndarray] | None:
        """q's mean and marginal sds in the flat coordinates, where q says (``None``
        elsewhere)."""
        try:
            values, _ = self.approx.location()
        except (AttributeError, NotImplementedError):
            return None
        d = self.target.ndim
        if len(values) < 2 * d:
            return None
        values = np.asarray(values, dtype=float)
        return values[:d], np.exp(values[d : 2 * d])

    def _sds(self) -> np.ndarray | None:
        """q's marginal sds in the flat coordinates, where q says (``None`` elsewhere)."""
        both = self._mean_and_sds()
        return None if both is None else both[1]

    def _mean(self) -> np.ndarray | None:
        """q's mean in the flat coordinates, where q says (``None`` elsewhere)."""
        both = self._mean_and_sds()
        return None if both is None else both[0]

    def _travelling(self) -> str:
        """Where q's mean moved more than :data:`TRAVELLING` of its sds in this call of
        ``fit``/``refine``: the posterior lies far from the start (an initial point deep in a
        prior's tail), which the automatic step, a bounded move per step, crosses slowly."""
        before, after, sds, start_sds = self._start_mean, self._mean(), self._sds(), self._start_sds
        if after is None or any(
            v is None or v.shape != after.shape for v in (before, sds, start_sds)
        ):
            return ""
        with np.errstate(all="ignore"):
            moved = np.abs(after - before) / sds
            # not a scale shrinking towards 0 (no optimum): that is _runaway's
            steady = np.abs(np.log(sds / start_sds)) < np.log(TRAVELLING)
        moved = np.where(np.isfinite(moved) & steady, moved, 0.0)
        j = int(np.argmax(moved))
        if not moved[j] > TRAVELLING:
            return ""
        return (
            f"q's mean of {self.target.labels[j]} was still travelling: it moved "
            f"{moved[j]:,.0f} of its sds in this fit, so the posterior lies far from the start. "
            "init='map' (inf_kwargs={'init': 'map'}) starts from the posterior's mode. "
        )

    def _runaway(self) -> str:
        """The sd of q that changed most in this call of ``fit``/``refine``, named if it
        changed by more than :data:`RUNAWAY` times: where the posterior is improper (a
        Flat prior the data do not inform) q's sd grows without bound and the fit ends
        stalled or out of steps, for reasons that do not name the variable."""
        before, after = self._start_sds, self._sds()
        if before is None or after is None or before.shape != after.shape:
            return ""
        with np.errstate(all="ignore"):
            change = np.abs(np.log(after) - np.log(before))
        change = np.where(np.isfinite(change), change, np.inf)
        j = int(np.argmax(change))
        if not change[j] > np.log(RUNAWAY):
            return ""
        return (
            f"q's sd of {self.target.labels[j]} went from {before[j]:.3g} to {after[j]:.3g} "
            "in this fit: if its posterior is improper (a Flat or very wide prior the data "
            "do not inform), give it a proper prior. "
        )

    def _remedy(self, reason: str) -> str:
        """What to do about a fit that ended for ``reason`` without converging."""
        return self._travelling() + self._runaway() + self._reason_remedy(reason)

    def _reason_remedy(self, reason: str) -> str:
        if reason == "stalled" and not self.fit_options.auto:
            # refused non-finite moves under a fixed step: the step, not the model, is suspect
            return (
                f"This fit used the fixed learning_rate {self.fit_options.learning_rate}, too "
                "large for the posterior's curvature if the moves diverged: refit without it "
                f"(pm.fit(method='{self.name}')) for the automatic step size, or with a much "
                "smaller one; else check the model near q"
            )
        if reason == "max_steps" and self.fit_options.auto:
            # measured: a stochastic-volatility model whose log-scale GF, GPF and WVGD drove
            # towards -inf for 10 000 steps, where NUTS and the ensemble were accurate
            return (
                "If q is still moving (a scale drifting towards 0 or infinity), the family "
                f"may have no optimum on this posterior: {self.approx.alternative_clause}"
            )
        return UNCONVERGED_REMEDIES.get(reason, "").format(nuts=nuts(self.target.minibatch))

    def _control(self, options: FitOptions) -> Control:
        """:class:`~pymc_gpf.control.FixedSteps` for a fixed ``learning_rate``, else
        :class:`~pymc_gpf.control.Stochastic` (a deterministic objective overrides this)."""
        if not options.auto:
            return FixedSteps(options.tol)
        return stochastic_control(self, options.tol)

    def _run(self, n: int, progressbar: bool, progressbar_theme) -> None:
        """At most ``n`` steps of the compiled step under the controller: extends the
        record, raises on a failed step, judges the fit and warns when it is not
        trustworthy. One BLAS pool keeps its threads meanwhile (:mod:`pymc_gpf.threads`). A
        method may run them elsewhere (:meth:`run_elsewhere`)."""
        self.step_limit = self.state.i + n  # the step count this call may reach
        self._start_sds, self._start_mean = self._sds(), self._mean()
        # the data this run fits: what later checks of q against the model evaluate it on,
        # whatever pm.set_data put in the model since (PSIS-corrected draws, diagnose)
        self.fitted_data = self.target.data_values()
        reason = self.run_elsewhere(n, progressbar)
        if reason is not None:
            self._give_verdict(reason)
            return
        with self.blas_threads():  # the steps a stage run elsewhere left
            self._steps_and_verdict(self.step_limit - self.state.i, progressbar, progressbar_theme)

    @property
    def compile_backend(self) -> str | None:
        """What the fit compiles with (``None`` before a fit: PyMC's default)."""
        return self.fit_options.compile_backend if self.fit_options is not None else None

    def blas_threads(self):
        """The BLAS threads of this fit's evaluations (:func:`pymc_gpf.threads.one_blas_pool`:
        one per pool, unless the data are large)."""
        return one_blas_pool(self.compile_backend, self.target.data_size >= LARGE_DATA)

    def _steps_and_verdict(self, n: int, progressbar: bool, progressbar_theme) -> None:
        self._decide(self.control.resume(self.control_state))
        start = self.state.i
        done = 0
        self._anchor(force=start == 0)
        self.run_trace: list[float] = []  # this run's free energies so far, as callbacks see
        # the last step the callbacks saw: a continuation inside a step (GPF's GF) shows
        # them its own steps, after which the step it continued is not shown again
        self.callbacks_saw = start

        def observe(free_energy: float, info: dict[str, float]) -> tuple[float, str | None]:
            nonlocal done
            self.run_trace.append(free_energy)
            size = info.get("step_size", float(self._learning_rates.get_value()[0]))
            self.record.count(info["gradient_evaluations"], info["density_evaluations"])
            observed = info | self.observation()
            stop = self._decide(self.control.observe(self.control_state, free_energy, observed))
            self._write_rate()
            done += 1
            self._anchor()
            if self.fit_options.more_obj_params:
                self.record.hyper_trace.append(flat_values(self.fit_options.more_obj_params))
            if stop is not None:
                stop = self.hyper_stop(self._on_stop(stop, start + done), start + done)
            return float(size), stop

        def describe(free_energy: float, info: dict[str, float], stop: str) -> str:
            why = self.control.describe(self.control_state, stop) if stop else ""
            return progress_text(
                free_energy, info, self.fit_options, why,
                float(self._learning_rates.get_value()[0]),
                self.control.progress(self.control_state),
            )  # fmt: skip

        notes: dict[str, str] = {}
        for attempt in range(MAX_START_RETRIES + 1):
            result = run_steps(
                self.state.step,
                n,
                start=start,
                title=f"Fitting {self.name.upper()}:",
                observe=observe,
                describe=describe,
                finish=lambda result: self._record_run(result, n),
                callbacks=[self._unseen(self.state.callbacks)] if self.state.callbacks else [],
                approx=self.approx,
                progressbar=progressbar,
                theme=progressbar_theme,
                stops_itself=self.fit_options.tol is not None,
            )
            first_step_failed = result.failure == 0 and start == 0 and self.fit_options.auto
            if not first_step_failed or attempt == MAX_START_RETRIES:
                break
            retried = self._retry_start(attempt)
            if retried is None:
                break
            notes[retried[0]] = retried[1]  # the last change of each kind
            self._start_note = "; ".join(notes.values())
        if result.failure is not None:
            failed = FailedStep(
                self.name, result.failure, self.state.step.diagnose(self.target),
                self.fit_options, self.start_points, self.spread_option, len(self.hist),
            )  # fmt: skip
            raise explain_failure(failed, self.target, self.approx)
        if n:
            self._give_verdict(result.reason)

    def _anchor(self, force: bool = False) -> None:
        """Minibatch control variates (:meth:`pymc_gpf.target.BatchedTarget.logp_and_grads`):
        their anchor is q's centre, where the whole data set is evaluated once (counted as
        the minibatch gradients it costs, ``1 / fraction``): before the first step, after
        the hyperparameters moved (``force``: the anchor's values depend on them), and once
        q's centre is more than :data:`ANCHOR_DRIFT` of q's sds away, the estimates' noise
        growing with the distance between the rows evaluated and the anchor, provided the
        steps since the last one evaluated :data:`ANCHOR_SHARE` times as much as it costs;
        until then the plain minibatch estimates are used (``active`` 0): a stale anchor is
        no bias, only noise. Hyperparameters learnt at a fixed step move every step: no
        control variates there."""
        anchor, target, options = self.target.anchor, self.target, self.fit_options
        if anchor is None:
            return
        off = np.zeros((), dtype=anchor.active.dtype)
        if options.more_obj_params and not options.auto:
            anchor.active.set_value(off)
            return
        centre, scale = self.approx.centre()
        moved = np.max(np.abs(centre - anchor.point.get_value()) / scale)
        if not force and anchor.active.get_value() and not moved > ANCHOR_DRIFT:
            return
        cost = math.ceil(1.0 / target.minibatch_fraction)
        spent = self.record.gradient_evaluations - target.anchor_evaluations
        if not force and spent < ANCHOR_SHARE * cost:
            anchor.active.set_value(off)
            return
        [logp], [grad] = self.approx.full_log_densities_and_gradients(centre[None])
        self.record.count(gradients=cost)
        target.anchor_evaluations = self.record.gradient_evaluations
        finite = bool(np.isfinite(logp) and np.all(np.isfinite(grad)))
        if not finite:  # plain minibatch estimates until the next anchor
            logp, grad = 0.0, np.zeros_like(grad)
        for var, value in zip(anchor, (centre, logp, grad, float(finite)), strict=True):
            var.set_value(np.asarray(value, dtype=var.dtype))

    def _unseen(self, callbacks: list[Callable]) -> Callable:
        """``callbacks`` in turn, on the steps they have not seen yet."""

        def call(approx, hist: np.ndarray, i: int) -> None:
            if i > self.callbacks_saw:
                self.callbacks_saw = i
                for callback in callbacks:
                    callback(approx, hist, i)

        return call

    def _record_run(self, result: FitRecord, n: int) -> None:
        """The run is over, whatever ended it: its steps and how it ended go on record."""
        self.run_ended(result)
        self.merge_run(result)
        if result.failure is None:
            self.control_state, result.reason = self.control.conclude(
                self.control_state, result.reason
            )
        self.conclude_run(result.reason, n)
        self._decide(self.control.finish(self.control_state, result.reason, self.observation()))
        if result.failure is None:
            self._finish(result.reason)

    def merge_run(self, run: FitRecord) -> None:
        """Add a run (the loop's, or one :meth:`run_elsewhere` did) to the record; the step
        count follows."""
        self.record.merge(run)
        self.state = self.state._replace(i=len(self.hist))

    def conclude_run(self, reason: str, n: int, message: str | None = None) -> None:
        """A call of ``n`` steps ended for ``reason`` (``message``: how, where a method says
        so itself; else the controller's): its outcome goes on record."""
        message = self.end_message(reason) if message is None else message
        self.record.conclude(fit_outcome(reason, n, len(self.hist), self.fit_options, message))

    def replace_callbacks(self, callbacks: list[Callable]) -> None:
        """The callbacks the next ``refine`` calls (a fit continuing inside another: GPF's
        GF shows the outer fit's callbacks its steps)."""
        self.state = self.state._replace(callbacks=callbacks)

    def callbacks_seen(self, step: int) -> None:
        """The fit's callbacks have seen its steps up to ``step`` (a continuation showed
        them its own)."""
        self.callbacks_saw = step

    def _give_verdict(self, reason: str) -> None:
        verdict = self.judge()
        if verdict is None:
            return
        checks = verdict.numbers | {
            "density_evaluations": verdict.density_evaluations,
            "gradient_evaluations": verdict.gradient_evaluations,
            "seconds": round(verdict.seconds, 4),
        }
        self.record.judged(verdict.word, verdict.message, checks)
        if verdict.trustworthy:
            return
        # stacklevel: here, _run, fit (or refine), pm.fit's wrapper, the user's code
        warnings.warn(fit_warning(self.name, self.outcome, verdict), FitWarning, stacklevel=5)


def stochastic_control(inference: FlowInference, tol: float) -> Stochastic:
    """The schedule of a stochastic objective, deciding the fit's parameters and step
    size."""
    return Stochastic(
        tol,
        measured=inference.measured_correlation,
        span=inference.average_span,
        reach=inference.lag_reach,
        margin=inference.agreement_margin,
        stop_beside_largest_step=inference.stop_beside_largest_step,
        crawl=inference.crawl_steps,
    )


def configure(inference: FlowInference, *, model=None, random_seed=None, start=None) -> None:
    """Apply ``pm.fit``'s ``model``/``random_seed``/``start`` to an existing instance
    (PyMC ignores them for instances; we honour them)."""
    if model is not None and model is not inference.model:
        raise ValueError(
            f"This {type(inference).__name__} was built for another model; create it inside "
            "the model's context (or pass model=) and call pm.fit on that model."
        )
    if random_seed is None and start is None:
        return
    if inference.state is not None:
        if start is not None:
            raise ValueError(
                "start= cannot move an approximation that has already been fitted; "
                "create a new instance or use .refine(n) to continue."
            )
        inference._seed(random_seed)
        return
    if start is not None:
        inference._start = start
    if random_seed is not None:
        inference._seed(random_seed)
    inference._start_from(inference._initialise())
