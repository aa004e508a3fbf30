"""The fit loop every method shares: one compiled step, PyMC's conventions around it.

A method describes one step as a :class:`StepGraph` (symbolic free energy and the updates of
its shared state); the engine adds the optimiser state, hyperparameter learning
(``more_obj_params``), a guard that keeps the last finite state, compiles everything into one
PyTensor function (one call per iteration) and runs it with PyMC's progress bar, callbacks
``(approx, hist, i)``, ``StopIteration``/``KeyboardInterrupt`` handling and ``refine``.
"""

from __future__ import annotations

import inspect
import logging
import math
import warnings

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import numpy as np
import pymc as pm
import pytensor
import pytensor.tensor as pt

from pymc.progress_bar import CustomProgress, default_progress_theme
from pymc.variational.inference import Inference, State
from pytensor.compile.sharedvalue import SharedVariable
from pytensor.graph.basic import Variable
from pytensor.graph.traversal import ancestors
from pytensor.tensor.random.type import RandomGeneratorType
from rich.console import Console
from rich.progress import Progress, TextColumn

from pymc_gpf.checks import is_integer, positive, seed_sequence
from pymc_gpf.control import Control, FixedSteps, Outcome, Stochastic
from pymc_gpf.errors import DivergenceError, InitialPointError
from pymc_gpf.optimizers import (
    Optimizer,
    Transform,
    chain,
    clip_by_norm,
    map_state,
    resolve,
    state_leaves,
)
from pymc_gpf.target import (
    BatchedTarget,
    compile_function,
    compile_kwargs_for,
    quick_compile_backend,
)

__all__ = ["CompiledStep", "FitOptions", "FlowInference", "StepGraph", "transform_direction"]

AUTO = "auto"
DEFAULT_TOL = 0.03  # distance to the fixed point, in standard deviations of q
# with pm.Minibatch every step sees a subsample: reaching tol costs ~ (n / batch) / tol^2 steps
MINIBATCH_TOL = 0.05
DEFAULT_MAX_STEPS, MINIBATCH_MAX_STEPS = 10_000, 100_000

logger = logging.getLogger("pymc_gpf")

INITS = ("initial_point", "map")


@dataclass(frozen=True)
class FitOptions:
    """Settings of one ``fit`` call (PyMC fit keywords). ``learning_rate`` is ``None`` for the
    automatic step size (:mod:`pymc_gpf.stepsize`), else the fixed pair ``(eta1, eta2)``."""

    learning_rate: tuple[float, float] | None
    optimizer: Optimizer
    clip_norm: float | None
    more_obj_params: tuple[SharedVariable, ...]
    backend: str | None  # as the user gave it
    compile_kwargs: dict = field(default_factory=dict)
    include_transformed: bool = False
    tol: float | None = None
    compile_backend: str | None = None  # what the fit compiles with (see FlowInference)

    @property
    def auto(self) -> bool:
        """The automatic step size (the default), rather than a fixed ``learning_rate``."""
        return self.learning_rate is None

    def chain(self, particle_axes: Sequence[int] = ()) -> Transform:
        """Clip (optional), then precondition: the optimiser of one array."""
        clip = [clip_by_norm(self.clip_norm)] if self.clip_norm is not None else []
        return chain(*clip, self.optimizer.transform(particle_axes))

    def settings(self) -> dict[str, Any]:
        return {
            "learning_rate": AUTO if self.auto else self.learning_rate,
            "tol": self.tol,
            "optimizer": repr(self.optimizer),
            "clip_norm": self.clip_norm,
            "more_obj_params": [p.name or repr(p) for p in self.more_obj_params],
            "backend": self.backend,
            "compiled_with": self.compile_backend or "PyMC's default",
        }


def parse_learning_rate(learning_rate) -> tuple[float, float] | None:
    """``"auto"`` (``None``), one step size or the pair ``(eta1, eta2)``, as positive floats."""
    if learning_rate is None or (isinstance(learning_rate, str) and learning_rate == AUTO):
        return None
    if isinstance(learning_rate, str):
        raise ValueError(
            f"learning_rate is 'auto' (the default), a positive number or a pair; got "
            f"{learning_rate!r}."
        )
    if isinstance(learning_rate, tuple | list):
        if len(learning_rate) != 2:
            raise ValueError(
                "learning_rate is one number or a pair (eta1 for the mean shift, eta2 for "
                f"the linear part); got {learning_rate!r}."
            )
        return tuple(positive("learning_rate", r) for r in learning_rate)
    return (positive("learning_rate", learning_rate),) * 2


@dataclass
class StepGraph:
    """One iteration of a method, symbolically.

    ``free_energy`` is evaluated at the state *before* the update; ``points`` ``(K, D)`` are
    where the step evaluates the log-density, ``logp``/``grad`` its values and gradients
    there (to name variables when they are not finite); ``positions`` are the points the
    step moves to, last axis ``D``; ``hyper_grads`` are the gradients of the free energy
    with respect to ``more_obj_params``. Random draws in the step use
    :meth:`FlowInference.standard_normal`; their generator advances outside the guard.

    ``info`` are scalars the controller reads after every step (``accepted``,
    ``step_size``, ``decrement``, ...). A step that keeps its state finite itself (the
    automatic step sizes accept or refuse a trial inside the graph) sets ``guarded=False``:
    ``free_energy`` is then the value *after* the step and the engine adds no rollback.
    """

    free_energy: Variable
    points: Variable
    logp: Variable
    grad: Variable
    positions: Variable
    updates: dict[Variable, Variable]
    hyper_grads: list[Variable] = field(default_factory=list)
    info: dict[str, Variable] = field(default_factory=dict)
    guarded: bool = True


@dataclass
class CompiledStep:
    """The compiled step (``() -> (free_energy, ok, *info)``) and the graph it came from."""

    fn: Callable[[], list]
    graph: StepGraph
    options: FitOptions
    info: tuple[str, ...] = ()
    calls: int = 0

    def __call__(self):
        self.calls += 1
        return self.fn()

    def diagnose(self, target: BatchedTarget) -> dict[str, np.ndarray]:
        """Re-evaluate the step without applying it (after a rejection the kept state is
        the one the step started from): per-point logp at the kept state and at the points
        the step would move to, which coordinates have a non-finite gradient or new
        position, and the largest gradient magnitude per coordinate. Compiled only when
        needed, so the hot step stays small."""
        g = self.graph
        grad_axes = tuple(range(g.grad.ndim - 1))
        new_points = g.positions.reshape((-1, g.positions.shape[-1]))
        outputs = {
            "points": g.points,
            "logp": g.logp,
            "bad_grad": pt.any(~pt.isfinite(g.grad), axis=grad_axes),
            "bad_new": pt.any(~pt.isfinite(new_points), axis=0),
            "max_grad": pt.max(pt.abs(g.grad), axis=grad_axes),
            "new_points": new_points,
            "new_logp": target.logp_and_grads(new_points)[0],
        }
        # diagnosing must not advance the step's random stream (reproducibility)
        rngs = [v for v in ancestors(outputs.values()) if isinstance(v.type, RandomGeneratorType)]
        saved = [rng.get_value(borrow=False) for rng in rngs]
        try:
            values = compile_function(
                [],
                list(outputs.values()),
                self.options.compile_backend,
                self.options.compile_kwargs,
                random_seed=False,
            )()
        finally:
            for rng, value in zip(rngs, saved, strict=True):
                rng.set_value(value, borrow=True)
        return {k: np.asarray(v) for k, v in zip(outputs, values, strict=True)}


def transform_direction(
    transform: Transform, direction: Variable, shape: tuple[int, ...], name: str
) -> tuple[Variable, dict[SharedVariable, Variable]]:
    """Run ``direction`` through ``transform`` with its state held in new shared variables.

    The state's static shape follows ``direction``'s: a dimension unknown there (e.g. the
    number of particles, so one compiled graph serves any number) stays unknown, except
    axes the optimiser reduces to length 1, which must be static to broadcast."""
    counter = iter(range(10**6))
    static = direction.type.shape

    def shared(value):
        known = [
            n if i >= len(static) or static[i] is not None or (n == 1 and shape[i] != 1) else None
            for i, n in enumerate(value.shape)
        ]
        return pytensor.shared(value, name=f"{name}_opt{next(counter)}", shape=tuple(known))

    state = map_state(shared, transform.init(tuple(shape)))
    new_direction, new_state = transform.update(direction, state)
    updates = {
        s: new.astype(s.dtype)
        for s, new in zip(state_leaves(state), state_leaves(new_state), strict=True)
    }
    return new_direction, updates


def _add_state(state: dict[str, SharedVariable], key: str | None, var: SharedVariable) -> None:
    """Register one variable of the fit's state (its key names it in a saved checkpoint)."""
    if not key or key in state:
        raise RuntimeError(f"state variable {var!r} needs a unique name, got {key!r}")
    state[key] = var


class FlowInference(Inference):
    """Base class of the pymc-gpf methods; a :class:`pymc.variational.Inference`.

    Subclasses set :attr:`name` and implement :meth:`_initialise` (build the approximation
    from the starting point) and :meth:`_build_step`.
    """

    name: ClassVar[str] = ""
    default_learning_rate: ClassVar[float] = 1e-3
    default_optimizer: ClassVar[str] = "sgd"
    spread_option: ClassVar[str] = "init_scale"  # the option setting the initial spread
    renamed_options: ClassVar[dict[str, str]] = {}  # old constructor keyword -> new
    start_points: ClassVar[str] = "particles"  # what the first step evaluates

    def __init__(self, *, model=None, random_seed=None, start=None):
        self.target = BatchedTarget(model)
        self.hist = np.asarray(())
        self.step_sizes = np.asarray(())
        self.gradient_evaluations = 0  # log-density-and-gradient evaluations, all fits
        self.density_evaluations = 0  # log-density-only evaluations (checks, validation)
        self.outcome: Outcome | None = None
        self.control: Control | None = None
        self.state: State | None = None
        self.fit_options: FitOptions | None = None
        # step sizes live in a shared variable: refine(n, learning_rate=...) needs no compile
        self._learning_rates = pytensor.shared(
            np.zeros(2, dtype=pytensor.config.floatX), name=f"{self.name}_learning_rates"
        )
        self.state_vars: dict[str, SharedVariable] = {}
        self._start = start
        self._seed(random_seed)
        self._approx = self._initialise()

    approx = property(lambda self: self._approx)

    @property
    def learning_rates(self) -> tuple[Variable, Variable]:
        """``(eta1, eta2)`` as symbolic scalars, for the methods' step graphs."""
        return self._learning_rates[0], self._learning_rates[1]

    @property
    def model(self):
        return self.target.model

    # ------------------------------------------------------------------ subclass API
    def _initialise(self):
        raise NotImplementedError

    def constructor_options(self) -> dict[str, Any]:
        """The constructor keywords that rebuild this inference (JSON-able; for saving)."""
        raise NotImplementedError

    @classmethod
    def from_options(cls, model: pm.Model, options: dict[str, Any]) -> FlowInference:
        """An inference rebuilt from :meth:`constructor_options`, skipping its search for a
        starting point (a checkpoint's state replaces it)."""
        options = dict(options)
        for old, new in cls.renamed_options.items():  # saved by an earlier release
            if old in options:
                options[new] = options.pop(old)
        init = options.pop("init", INITS[0])
        inference = cls(model=model, init=INITS[0], **options)
        inference.init = init
        return inference

    def _build_step(self, options: FitOptions) -> StepGraph:
        raise NotImplementedError

    # ------------------------------------------------------------------- seeds, start
    def _seed(self, random_seed) -> None:
        self.random_seed = random_seed
        init_seq, data_seq, noise_seq = seed_sequence(random_seed).spawn(3)
        self.target.seed(data_seq)
        self._init_rng = np.random.default_rng(init_seq)
        noise = np.random.default_rng(noise_seq)
        if hasattr(self, "noise_rng"):
            self.noise_rng.set_value(noise, borrow=True)
        else:
            self.noise_rng = pytensor.shared(noise, name=f"{self.name}_noise_rng")

    def standard_normal(self, shape: tuple[int, ...]) -> Variable:
        """Fresh ``N(0, 1)`` draws in every step, from the fit's own seeded stream (which
        continues across ``fit``/``refine`` calls)."""
        # PyMC's compile collects the generator's update from the graph
        _, draws = pt.random.normal(0.0, 1.0, size=shape, rng=self.noise_rng, return_next_rng=True)
        return draws

    def _start_vector(self) -> np.ndarray:
        return self.target.start_vector(self._start, random_seed=self._init_rng.integers(2**30))

    def _initial_centre(self, init: str) -> np.ndarray:
        """Where the fit starts: the model's initial point (updated by ``start``) or, with
        ``init="map"``, the MAP found from there."""
        if init not in INITS:
            raise ValueError(f"init must be one of {INITS}, got {init!r}.")
        centre = self._start_vector()
        if init == "map":
            centre = self._find_map(centre)
        return centre

    def _find_map(self, centre: np.ndarray) -> np.ndarray:
        """PyMC's ``find_MAP`` started exactly at ``centre`` (PyMC 6.4 and 6.3 spell it
        differently)."""
        seed = int(self._init_rng.integers(2**30))
        if "initvals" in inspect.signature(pm.find_MAP).parameters:
            found = pm.find_MAP(
                initvals=self.target.point(centre),
                model=self.model,
                progressbar=False,
                jitter=False,  # start exactly where `start` / the initial point says
                random_seed=seed,
                return_inferencedata=True,
                idata_kwargs={"include_transformed": True},
            ).posterior
            point = {
                c.value_name: found[c.value_name].values[0, 0] for c in self.target.coordinates
            }
        else:  # PyMC 6.3: start values in constrained space, no jitter
            start = None
            if self._start:
                constrained = self.target.compile_constrained()(centre[None, :])
                start = {c.rv_name: constrained[c.rv_name][0] for c in self.target.coordinates}
            point = pm.find_MAP(
                start=start,
                model=self.model,
                progressbar=False,
                seed=seed,
                include_transformed=True,
            )
        return self.target.flatten(point)

    def configure(self, *, model=None, random_seed=None, start=None) -> None:
        """Apply ``pm.fit``'s ``model``/``random_seed``/``start`` to an existing instance
        (PyMC ignores them for instances; we honour them)."""
        if model is not None and model is not self.model:
            raise ValueError(
                f"This {type(self).__name__} was built for another model; create it inside "
                "the model's context (or pass model=) and call pm.fit on that model."
            )
        if random_seed is None and start is None:
            return
        if self.state is not None:
            if start is not None:
                raise ValueError(
                    "start= cannot move an approximation that has already been fitted; "
                    "create a new instance or use .refine(n) to continue."
                )
            self._seed(random_seed)
            return
        if start is not None:
            self._start = start
        if random_seed is not None:
            self._seed(random_seed)
        self._approx = self._initialise()

    # ------------------------------------------------------------------------ options
    def _options(
        self,
        learning_rate,
        optimizer,
        clip_norm,
        more_obj_params,
        backend,
        compile_kwargs,
        include_transformed,
        tol=None,
    ) -> FitOptions:
        rates = parse_learning_rate(learning_rate)
        if clip_norm is not None:
            clip_norm = positive("clip_norm", clip_norm)
        if tol is not None:
            tol = positive("tol", tol)
        elif rates is None:
            tol = MINIBATCH_TOL if self.target.minibatch else DEFAULT_TOL
        params = tuple(more_obj_params or ())
        for p in params:
            if not isinstance(p, SharedVariable) or p.dtype not in ("float32", "float64"):
                raise TypeError(
                    f"more_obj_params entries must be float pytensor.shared variables used by "
                    f"the model; got {p!r}."
                )
            if p not in ancestors([self.target._logp]):
                raise ValueError(
                    f"more_obj_params: {p.name or p!r} is not used by the model's log-density, "
                    "so the free energy does not depend on it."
                )
        resolved = resolve(self.default_optimizer if optimizer is None else optimizer)
        if rates is None and params:
            raise ValueError(
                "more_obj_params (type-II maximum likelihood) needs a fixed learning_rate for "
                "now, e.g. learning_rate=0.01: the automatic step size adapts the fit's own "
                "step only."
            )
        if rates is None and (optimizer is not None or clip_norm is not None):
            raise ValueError(
                "optimizer= and clip_norm= shape a fixed-step fit; the automatic step size "
                "(the default) uses natural-gradient steps and needs neither. Pass a "
                "learning_rate too to use them (e.g. learning_rate=0.01, optimizer='adam')."
            )
        compile_kwargs_for(backend, compile_kwargs)  # validates backend vs compile_kwargs
        # an automatic fit on full data takes tens to hundreds of steps, so compiling is most
        # of its time to a result: with no backend named, build it where that is quickest
        # (target.quick_compile_backend). Fixed-step and minibatch fits run many more steps
        # and keep PyMC's default, which runs each step fastest.
        long_fit = rates is not None or self.target.minibatch
        return FitOptions(
            learning_rate=rates,
            optimizer=resolved,
            clip_norm=clip_norm,
            more_obj_params=params,
            backend=backend,
            compile_kwargs=dict(compile_kwargs or {}),
            include_transformed=bool(include_transformed),
            tol=tol,
            compile_backend=backend if long_fit else quick_compile_backend(backend, compile_kwargs),
        )

    def _control(self, options: FitOptions) -> Control:
        """The fit's controller: :class:`~pymc_gpf.control.FixedSteps` for a fixed
        ``learning_rate``; automatic fits use :meth:`_stochastic_control` (methods with a
        deterministic objective override this)."""
        if not options.auto:
            return FixedSteps(options.tol)
        return self._stochastic_control(options)

    def _stochastic_control(self, options: FitOptions) -> Stochastic:
        def set_rate(rate: float) -> None:
            self._learning_rates.set_value(np.full(2, rate, dtype=self.target.dtype))

        return Stochastic(
            options.tol,
            location=self._location,
            params=lambda: [p.get_value() for p in self.approx.params],
            set_params=lambda arrays: [
                p.set_value(a.astype(p.dtype))
                for p, a in zip(self.approx.params, arrays, strict=True)
            ],
            set_rate=set_rate,
        )

    def _location(self) -> tuple[np.ndarray, np.ndarray]:
        """What the stochastic stopping test watches, and its unit: q's mean in units of
        its sds and the log of its sds (unit 1: a relative error), ``(values, units)``."""
        q = self.approx.gaussian()
        sd = np.sqrt(np.maximum(q.marginal_variances(), 1e-300))
        return np.concatenate([q.mean, np.log(sd)]), np.concatenate([sd, np.ones_like(sd)])

    # ------------------------------------------------------------------------ compile
    def _compile(self, options: FitOptions) -> CompiledStep:
        rates = options.learning_rate if not options.auto else (1.0, 1.0)
        self._learning_rates.set_value(np.asarray(rates, dtype=self.target.dtype))
        graph = self._build_step(options)
        updates = dict(graph.updates)
        keys = {var: var.name for var in updates}
        # hyperparameters (fixed step sizes only, see _options)
        pairs = zip(options.more_obj_params, graph.hyper_grads, strict=True)
        for i, (theta, grad) in enumerate(pairs):
            shape = np.shape(theta.get_value())
            direction, opt_updates = transform_direction(options.chain(), grad, shape, f"hyper{i}")
            updates[theta] = (theta - self.learning_rates[0] * direction).astype(theta.dtype)
            updates.update(opt_updates)
            keys.update({var: var.name for var in opt_updates})
            keys[theta] = f"hyper{i}"  # the user's variable: its name may be None or clash
        state = {self._learning_rates.name: self._learning_rates}
        if graph.guarded:
            updates, ok = self._guard(graph, updates, keys, state)
        else:
            ok = pt.isfinite(graph.free_energy)
            for var in updates:
                _add_state(state, keys[var], var)
        self.state_vars = state
        info = dict(graph.info)
        fn = compile_function(
            [],
            [graph.free_energy, ok, *info.values()],
            options.compile_backend,
            options.compile_kwargs,
            updates=updates,
            random_seed=False,  # noise_rng is seeded by us and continues across compiles
        )
        fn.trust_input = True
        return CompiledStep(fn, graph, options, tuple(info))

    def _guard(self, graph: StepGraph, updates: dict, keys: dict, state: dict):
        """Accept only a finite step from a state with a finite free energy. A step is
        rejected when the new state is not finite (the state stays) or when the current
        state turns out to have a non-finite free energy (roll back to the previous one),
        so the state kept always has a finite free energy: the last good one."""
        here_ok = pt.isfinite(graph.free_energy)
        next_ok = here_ok
        for value in updates.values():
            next_ok = next_ok & pt.all(pt.isfinite(value))
        guarded = {}
        for var, value in updates.items():
            key = keys[var]
            previous = pytensor.shared(var.get_value(), name=f"{key}_previous")
            guarded[var] = pt.switch(next_ok, value, pt.switch(here_ok, var, previous))
            guarded[previous] = pt.switch(next_ok, var, previous)
            _add_state(state, key, var)
            _add_state(state, previous.name, previous)
        return guarded, next_ok

    # ---------------------------------------------------------------------------- fit
    def fit(
        self,
        n: int | None = None,
        score=None,
        callbacks=None,
        progressbar: bool = True,
        progressbar_theme=default_progress_theme,
        *,
        backend: str | None = None,
        include_transformed: bool = False,
        learning_rate: float | tuple[float, float] | str | None = AUTO,
        tol: float | None = None,
        optimizer: str | Optimizer | None = None,
        clip_norm: float | None = None,
        more_obj_params: Sequence[SharedVariable] | None = None,
        compile_kwargs: dict | None = None,
        **kwargs,
    ):
        """Fit until converged, at most ``n`` steps; returns the approximation (PyMC's
        ``Inference.fit`` contract).

        Parameters
        ----------
        n
            The maximum number of steps (a fit at the automatic step size stops by itself
            when it has converged; a fixed ``learning_rate`` runs ``n`` steps unless
            ``tol`` is given). Default 10 000 as PyMC, 100 000 when the model reads
            ``pm.Minibatch`` data (each step then sees a subsample).
        learning_rate
            ``"auto"`` (default): natural-gradient steps whose size adapts by itself
            (backtracking for GPF on full data, a trust region with a step-halving schedule
            and iterate averaging for stochastic objectives; :mod:`pymc_gpf.stepsize`,
            :mod:`pymc_gpf.control`). A number or a pair ``(eta1, eta2)`` runs the paper's
            fixed-step update instead: the shift and the linear part of eq. 13 (GPF), the
            mean and the factor of eq. 11 (GF), the particles (eq. 20) and the local
            Gaussians (eq. 21) for WVGD.
        tol
            When the fit has converged, in standard deviations of q: the distance to the
            fixed point estimated by the natural-gradient decrement (deterministic
            objectives) or the Monte Carlo error of the averaged iterate once the free
            energy has stopped falling (stochastic ones). Default 0.03 at the automatic step
            size; with a fixed ``learning_rate`` it enables a window test on the trace.
        optimizer
            With a fixed ``learning_rate`` only: a name ("sgd", "momentum", "adam",
            "rmsprop", "adagrad") or a :class:`pymc_gpf.optimizers.Optimizer`; default
            "sgd" for GPF and GF, "adam" for WVGD. The adaptive ones are dimension-wise
            (App. H), so the step stays affine.
        clip_norm
            With a fixed ``learning_rate`` only: bound on the norm of each update array.
        more_obj_params
            ``pytensor.shared`` model hyperparameters learnt jointly by descending the free
            energy (type-II maximum likelihood; the regularised free energy of §3.4.1 for
            GPF).
        compile_kwargs, backend
            As in PyMC (``backend="c"``, ``"numba"``, ``"jax"``).
        callbacks, progressbar, progressbar_theme, include_transformed
            As in PyMC: callbacks are called as ``cb(approx, hist, i)`` and may raise
            ``StopIteration``.
        score
            Accepted for PyMC compatibility; the free energy is always recorded (it costs
            nothing extra).

        Notes
        -----
        How the fit ended is ``approx.outcome`` (also in the DataTree's ``fit`` group); a
        fit that did not converge warns. Calling ``fit`` again continues from the current
        state with a fresh optimiser and step-size schedule (and a new compiled step);
        :meth:`refine` continues with the same ones.
        """
        if kwargs:
            raise TypeError(
                f"{type(self).__name__}.fit() got unexpected keyword(s) {sorted(kwargs)}; "
                "it accepts learning_rate, tol, optimizer, clip_norm, more_obj_params, "
                "compile_kwargs, callbacks, progressbar, backend and include_transformed."
            )
        if n is None:
            n = MINIBATCH_MAX_STEPS if self.target.minibatch else DEFAULT_MAX_STEPS
        if not is_integer(n, 0):
            raise ValueError(f"n (the number of steps) must be a non-negative integer, got {n!r}.")
        options = self._options(
            learning_rate,
            optimizer,
            clip_norm,
            more_obj_params,
            backend,
            compile_kwargs,
            include_transformed,
            tol,
        )
        step = self._compile(options)
        self.fit_options = options
        self.control = self._control(options)
        done = 0 if self.state is None else self.state.i
        self.state = State(done, step=step, callbacks=list(callbacks or []), score=True)
        self._run(int(n), progressbar, progressbar_theme)
        return self.approx

    def refine(
        self,
        n: int,
        progressbar: bool = True,
        progressbar_theme=default_progress_theme,
        *,
        learning_rate: float | tuple[float, float] | None = None,
        tol: float | None = None,
    ):
        """Continue with the last compiled step, optimiser state, callbacks and history (at
        most ``n`` more steps). With a fixed step size, ``learning_rate`` changes it from
        here on (e.g. after a divergence); ``tol`` changes the stopping tolerance."""
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
            self.control.tol = self.fit_options.tol
        self._run(int(n), progressbar, progressbar_theme)
        return self.approx

    def _finish(self, reason: str) -> None:
        """The fit is over for now (any reason but a divergence): last touches."""

    def checkpoint_extra(self) -> dict[str, Any]:
        """Method state kept outside shared variables (JSON-able), for a saved fit."""
        return {}

    def load_checkpoint_extra(self, extra: dict[str, Any]) -> None:
        """Restore :meth:`checkpoint_extra`."""

    def _on_stop(self, reason: str, step: int) -> str | None:
        """The controller asked to stop for ``reason`` after ``step`` steps in all; a method
        may act (e.g. restore a state, restart with more particles) and return ``None`` to
        go on."""
        return reason

    def _evaluations_per_step(self) -> tuple[int, int]:
        """Points at which one step evaluates the log-density with its gradient, and
        without."""
        raise NotImplementedError

    def _step_size_of(self, info: dict[str, float]) -> float:
        if "step_size" in info:
            return float(info["step_size"])
        return float(self._learning_rates.get_value()[0])

    def _run(self, n: int, progressbar: bool, progressbar_theme) -> None:
        start, step, callbacks, _ = self.state
        self.control.resume()
        scores = np.full(n, np.nan)
        sizes = np.full(n, np.nan)
        done = 0
        failure = None
        rolled_back = False
        reason = "max_steps"
        try:
            with CustomProgress(
                *Progress.get_default_columns(),
                TextColumn("{task.fields[loss]}"),
                console=Console(theme=progressbar_theme),
                disable=not progressbar,
            ) as progress:
                # numba compiles at the first call: tens of seconds for a model new to this
                # machine, about a second once its on-disk cache holds the step
                status = "compiling the step (cached on disk for the next run)…"
                task = progress.add_task(
                    f"Fitting {self.name.upper()}:", total=n, loss=status if not step.calls else ""
                )
                for i in range(n):
                    free_energy, ok, *values = step()
                    info = dict(zip(step.info, (float(v) for v in values), strict=True))
                    if not ok:
                        failure = start + i
                        # the state before this step had a non-finite free energy, so the
                        # guard rolled back one more step: its history entry goes too
                        rolled_back = step.graph.guarded and not np.isfinite(free_energy)
                        reason = "divergence"
                        break
                    scores[i] = free_energy
                    sizes[i] = self._step_size_of(info)
                    grads, densities = self._evaluations_per_step()
                    self.gradient_evaluations += grads
                    self.density_evaluations += densities
                    done = i + 1
                    stop = self.control.observe(float(free_energy), info)
                    if stop is not None:
                        stop = self._on_stop(stop, start + done)
                    if done % 10 == 0 or done in (1, n) or stop is not None:
                        progress.update(
                            task, completed=done, loss=self._progress_text(free_energy, info)
                        )
                    for callback in callbacks:
                        callback(self.approx, scores[:done], start + done)
                    if stop is not None:
                        reason = stop
                        progress.update(
                            task,
                            completed=n,
                            loss=self._progress_text(
                                free_energy, info, self.control.describe(stop).split(":")[0]
                            ),
                        )
                        break
        except StopIteration as stop:
            logger.info(str(stop))
            reason = "callback"
        except KeyboardInterrupt:
            logger.info("Interrupted at step %d; returning the fit so far.", start + done)
            reason = "interrupted"
        finally:
            hist = np.concatenate([self.hist, scores[:done]])
            self.step_sizes = np.concatenate([self.step_sizes, sizes[:done]])
            if rolled_back and len(hist):
                hist, self.step_sizes = hist[:-1], self.step_sizes[:-1]
            self.hist = hist
            self.state = self.state._replace(i=len(self.hist))
            self.outcome = self._outcome(reason, n)
            self.control.finish(reason)
            if failure is None:
                self._finish(reason)
        if failure is not None:
            raise self._failure(failure, step.diagnose(self.target))
        if self.outcome.converged is False and reason not in ("callback", "interrupted") and n > 0:
            if self.fit_options.auto or self.fit_options.tol is not None:
                warnings.warn(
                    f"{self.name.upper()} did not converge: {self.outcome.message}",
                    UserWarning,
                    stacklevel=4,
                )

    def _outcome(self, reason: str, n: int) -> Outcome:
        converged: bool | None = reason in ("converged", "overfitting")
        if reason == "max_steps":
            message = (
                f"{self.control.describe(reason)} ({n} steps this call); continue with "
                "approx.refine(n)"
            )
            if not self.fit_options.auto and self.fit_options.tol is None:
                converged = None  # nothing was tested
                message = f"ran the {n} steps asked for (fixed step size, no stopping test)"
        else:
            message = self._describe(reason)
        return Outcome(converged, reason, len(self.hist), message)

    def _describe(self, reason: str) -> str:
        """Why the fit stopped, in words."""
        return self.control.describe(reason)

    def _progress_text(self, free_energy: float, info: dict[str, float], status: str = "") -> str:
        text = f"Free energy = {float(free_energy):,.6g}"
        if "step_size" in info:
            text += f", step {info['step_size']:.2g}"
        if "decrement" in info and self.fit_options.tol:
            distance = math.sqrt(max(info["decrement"], 0.0))
            text += f", distance {distance:.2g} (tol {self.fit_options.tol:g})"
        elif self.fit_options.auto:
            text += f", step {float(self._learning_rates.get_value()[0]):.2g}"
        return f"{text}; {status}" if status else text

    def _nonfinite_terms(self, points: np.ndarray, logp: np.ndarray) -> list[str]:
        bad = points[~np.isfinite(logp)][:3]
        return sorted(
            {t for p in bad if np.isfinite(p).all() for t in self.target.explain_nonfinite(p)}
        )

    def _failure(self, step_index: int, info: dict[str, np.ndarray]) -> Exception:
        bad_logp = ~np.isfinite(info["logp"])
        terms = self._nonfinite_terms(info["points"], info["logp"])
        grads = self.target.variables_at(info["bad_grad"])
        if step_index == 0 and (bad_logp.any() or grads):
            parts = []
            if bad_logp.any():
                parts.append(f"the log-density is not finite for {terms or 'some terms'}")
            if grads:
                parts.append(f"the gradient is not finite for {grads}")
            return InitialPointError(
                f"{self.name.upper()} cannot start: at the initial {self.start_points} "
                f"{'; '.join(parts)}. Check `start` values are inside each variable's support, "
                f"reduce `{self.spread_option}` (points may land where the density is zero), "
                "or use init='map'."
            )
        terms += self._nonfinite_terms(info["new_points"], info["new_logp"])
        bad_grad, bad_new, max_grad = info["bad_grad"], info["bad_new"], info["max_grad"]
        variables = self.target.variables_at(bad_new | bad_grad)
        terms = [t for t in dict.fromkeys(terms) if t not in variables]
        if variables and terms:
            where = f" in {variables} (and the log-density terms {terms})"
        elif variables or terms:
            where = f" in {variables}" if variables else f" in the log-density terms {terms}"
        else:  # only the free energy overflowed: point at the steepest variable
            steepest = self.target.variables_at(np.array([np.nanargmax(max_grad)]))
            where = f" in the free energy (the largest gradients are in {steepest})"
        if self.fit_options.auto:
            advice = (
                "The automatic step size refuses non-finite steps, so this state came from the "
                "start: check the model's log-density there (start values inside each "
                f"variable's support, a smaller {self.spread_option})."
            )
        else:
            advice = (
                f"This fit used the fixed learning_rate {self.fit_options.learning_rate}: "
                f"refit without it (pm.fit(method='{self.name}')) for the automatic step size, "
                "which adapts to the posterior's scales and never takes a non-finite step; "
                "or continue this state with a much smaller one: "
                "err.approx.refine(n, learning_rate=...)."
            )
        return DivergenceError(
            f"{self.name.upper()} diverged at step {step_index}: the update produced non-finite "
            f"values{where}. The approximation keeps the last state with a finite free "
            f"energy, after {len(self.hist)} steps (err.approx, with its history). {advice}",
            self.approx,
        )
