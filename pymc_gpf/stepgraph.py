"""One step of a method as a graph, and that graph compiled into one call per iteration.

A method writes its step as pure functions of an explicit state (a ``NamedTuple`` of
symbolic arrays, its fields named after the paper's quantities). :func:`share` holds a state
in shared variables named after those fields, :func:`updates` pairs them with the next
state, and :func:`compile_step` adds the optimiser of hyperparameters, the guard that keeps
the last finite state, and compiles it all into one PyTensor function.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import numpy as np
import pytensor
import pytensor.tensor as pt

from pytensor.compile.sharedvalue import SharedVariable
from pytensor.graph.basic import Variable
from pytensor.graph.replace import graph_replace
from pytensor.graph.traversal import ancestors
from pytensor.tensor.random.type import RandomGeneratorType

from pymc_gpf.optimizers import Transform, map_state, named_leaves, state_leaves
from pymc_gpf.options import FitOptions
from pymc_gpf.target import BatchedTarget, compile_function

__all__ = [
    "CompiledStep",
    "Info",
    "StepGraph",
    "compile_step",
    "dynamic_rows",
    "is_generator",
    "keep_if",
    "leaves",
    "share",
    "share_init",
    "share_moments",
    "share_transform",
    "standard_normal",
    "updates",
    "values",
]

S = TypeVar("S", bound=NamedTuple)


def standard_normal(rng: Variable, shape: tuple[int, ...]) -> tuple[Variable, Variable]:
    """``N(0, 1)`` draws of ``shape`` from the generator ``rng`` (a state's ``rng``: the
    fit's own seeded generator, which continues across ``fit``/``refine`` calls), and the
    generator after them: the next draw, or the next state's ``rng``, takes that one."""
    next_rng, draws = pt.random.normal(0.0, 1.0, size=shape, rng=rng, return_next_rng=True)
    return next_rng, draws


def is_generator(var: Variable) -> bool:
    """Whether ``var`` is a random generator (a state's ``rng``), not an array."""
    return isinstance(var.type, RandomGeneratorType)


def keep_if(accepted: Variable, new: Variable, old: Variable) -> Variable:
    """``new`` where the step is ``accepted``, else ``old`` (a refused trial keeps the state)."""
    return pt.switch(accepted, new, old).astype(old.dtype)


def dynamic_rows(name: str, value: np.ndarray) -> tuple:
    """A :func:`share` shape keeping the first axis (the number of particles) dynamic, so one
    compiled graph serves any number."""
    return (None, *value.shape[1:]) if value.ndim else ()


def share[S: NamedTuple](
    state: S, prefix: str, shape: Callable[[str, np.ndarray], tuple] | None = None
) -> S:
    """``state`` (NumPy arrays) held in shared variables named ``f"{prefix}_{field}"``; a
    field holding a tuple of arrays (one per block) gets ``f"{prefix}_{field}{i}"``.
    ``shape(field, value)`` gives a static shape (``None`` for a dimension that may change,
    e.g. the number of particles)."""

    def one(name: str, value: np.ndarray) -> SharedVariable:
        static = value.shape if shape is None else shape(name, value)
        return pytensor.shared(value, name=f"{prefix}_{name}", shape=static)

    return type(state)(
        *(
            tuple(one(f"{name}{i}", v) for i, v in enumerate(value))
            if isinstance(value, tuple)
            else None
            if value is None  # a part held elsewhere (a step's ``rng``: the fit's generator)
            else one(name, value)
            for name, value in zip(state._fields, state, strict=True)
        )
    )


def leaves(state: NamedTuple) -> list:
    """The arrays of a state in field order, a tuple (or nested state) field's in turn; a
    field that is ``None`` (a part the step does not use) has none."""
    return [
        v
        for value in state
        if value is not None
        for v in (leaves(value) if isinstance(value, tuple) else (value,))
    ]


def updates[S: NamedTuple](shared: S, new: S) -> dict[SharedVariable, Variable]:
    """The shared variables of a state paired with their next (symbolic) values."""
    pairs = zip(leaves(shared), leaves(new), strict=True)
    return {var: value if is_generator(var) else value.astype(var.dtype) for var, value in pairs}


def values[S: NamedTuple](shared: S) -> S:
    """The current values of a shared state (copies)."""
    return type(shared)(
        *(
            tuple(v.get_value() for v in var) if isinstance(var, tuple) else var.get_value()
            for var in shared
        )
    )


def assign[S: NamedTuple](shared: S, state: S) -> None:
    """Set a shared state to ``state``'s arrays."""
    for var, value in zip(leaves(shared), leaves(state), strict=True):
        var.set_value(np.asarray(value, dtype=var.dtype))


class Info(NamedTuple):
    """What one step reports (symbolic): every method's ``step`` returns ``(State, Info)``.

    ``free_energy`` is evaluated at the state *before* the update when the engine guards the
    step (``accepted`` is ``None``: it keeps the last finite state itself); a step that
    accepts or refuses its own trial (the automatic step sizes) sets ``accepted`` and
    reports the free energy *after* it. ``points`` ``(K, D)`` are where the step evaluates
    the log-density, ``logp``/``grad`` its values and gradients there (to name variables
    when they are not finite), ``positions`` the points it moves to (last axis ``D``).
    ``step_size`` and ``decrement`` are read by the controller after every step, as are
    ``extra`` (``(name, scalar)`` pairs of a method's own controller); ``hyper_grads`` are
    the gradients of the free energy in ``more_obj_params`` (fixed step sizes);
    ``densities`` counts the points where the step evaluates the log-density without its
    gradient (the rows of ``points`` are those with it).
    """

    free_energy: Variable
    points: Variable
    logp: Variable
    grad: Variable
    positions: Variable
    accepted: Variable | None = None
    step_size: Variable | None = None
    decrement: Variable | None = None
    hyper_grads: tuple[Variable, ...] = ()
    extra: tuple[tuple[str, Variable], ...] = ()
    densities: Variable | int = 0

    def scalars(self) -> dict[str, Variable]:
        """The scalars read after every step, by name: the controller's, and what the step
        cost (the points where it evaluated the log-density with its gradient, and
        ``densities`` more without)."""
        named = {k: getattr(self, k) for k in ("accepted", "step_size", "decrement")}
        cost = {
            "gradient_evaluations": self.points.shape[0],
            "density_evaluations": pt.as_tensor(self.densities),
        }
        return {k: v for k, v in named.items() if v is not None} | dict(self.extra) | cost


@dataclass(frozen=True)
class StepGraph:
    """One iteration of a method: its state (shared variables), the next state and the
    step's :class:`Info`, i.e. ``step(state, ...) -> (new, info)`` applied to the fit's
    state. Everything that changes from step to step is a leaf of ``state`` (the saved
    checkpoint is its leaves, by name). A step that draws holds the fit's generator as its
    state's ``rng``: :func:`standard_normal` from it, the last generator is the next
    state's, and it advances whether or not the guard keeps the step."""

    state: NamedTuple
    new: NamedTuple
    info: Info

    @property
    def guarded(self) -> bool:
        """Whether the engine keeps the last finite state (the step does not itself)."""
        return self.info.accepted is None


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
        # a trial step may overflow (a far start, unscaled parameters): the step itself
        # refuses non-finite values, so NumPy's warnings about them are noise
        with np.errstate(all="ignore"):
            return self.fn()

    def diagnose(self, target: BatchedTarget) -> dict[str, np.ndarray]:
        """Re-evaluate the step without applying it (after a rejection the kept state is
        the one the step started from): per-point logp at the kept state and at the points
        the step would move to, which coordinates have a non-finite gradient or new
        position, and the largest gradient magnitude per coordinate. Compiled only when
        needed, so the hot step stays small."""
        g = self.graph.info
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


def share_transform(
    transform: Transform, shape: tuple[int, ...], name: str, static: tuple | None = None
):
    """The initial state of the optimiser ``transform`` for a direction of ``shape``, held
    in shared variables named after its fields (``f"{name}_adam_mu"``, ...): see
    :func:`share_moments`."""
    return share_moments(transform.init(tuple(shape)), name, shape, static)


def share_moments(moments, name: str, shape: tuple[int, ...], static: tuple | None = None):
    """An optimiser's state ``moments`` (NumPy arrays, as its ``init`` gives them) for a
    direction of ``shape``, held in shared variables named after its fields
    (``f"{name}_adam_mu"``, ...).

    ``static`` is the direction's static shape (default ``shape``): a dimension unknown
    there (e.g. the number of particles, so one compiled graph serves any number) stays
    unknown, except axes the optimiser reduces to length 1, which must be static to
    broadcast."""
    static = tuple(shape) if static is None else static
    names = iter([leaf_name for leaf_name, _ in named_leaves(moments, name)])

    def shared(value):
        known = [
            n if i >= len(static) or static[i] is not None or (n == 1 and shape[i] != 1) else None
            for i, n in enumerate(value.shape)
        ]
        return pytensor.shared(value, name=next(names), shape=tuple(known))

    return map_state(shared, moments)


def share_init[S: NamedTuple](
    init: S, held: NamedTuple, shared: dict, rng: SharedVariable | None = None
) -> S:
    """A step's initial state ``init`` (NumPy, its method's ``init_<kind>``) in shared
    variables: ``init.q`` (or ``init.particles``), which the fitted approximation holds
    already, is ``held``, and ``init.rng`` the fit's generator ``rng`` (it continues across
    compiles); every other field ``f`` is named by ``shared[f]``: a name (an array), or
    ``(name, shape, static)`` of the direction an optimiser's state belongs to
    (:func:`share_moments`), or a tuple of those (one optimiser state per block)."""

    def one(value, how):
        if isinstance(how, str):
            return pytensor.shared(value, name=how, shape=np.shape(value))
        if isinstance(how[0], str):
            return share_moments(value, *how)
        return tuple(one(v, h) for v, h in zip(value, how, strict=True))

    first = init._fields[0]
    fields = {first: held} | {f: one(getattr(init, f), how) for f, how in shared.items()}
    return type(init)(**fields, **({"rng": rng} if "rng" in init._fields else {}))


def _add_state(state: dict[str, SharedVariable], key: str | None, var: SharedVariable) -> None:
    """Register one variable of the fit's state (its key names it in a saved checkpoint)."""
    if not key or key in state:
        raise RuntimeError(f"state variable {var!r} needs a unique name, got {key!r}")
    state[key] = var


def _learn_hyperparameters(
    graph: StepGraph, options: FitOptions, rate: Variable, updates: dict, keys: dict
) -> None:
    """Descend the free energy in ``more_obj_params`` (fixed step sizes only)."""
    pairs = zip(options.more_obj_params, graph.info.hyper_grads, strict=True)
    for i, (theta, grad) in enumerate(pairs):
        transform = options.chain()
        moments = share_transform(transform, np.shape(theta.get_value()), f"hyper{i}")
        direction, new_moments = transform.update(grad, moments)
        updates[theta] = (theta - rate * direction).astype(theta.dtype)
        for var, value in zip(state_leaves(moments), state_leaves(new_moments), strict=True):
            updates[var] = value.astype(var.dtype)
            keys[var] = var.name
        keys[theta] = f"hyper{i}"  # the user's variable: its name may be None or clash


def _guard(graph: StepGraph, updates: dict, keys: dict, state: dict):
    """Accept only a finite step from a state with a finite free energy. A step is
    rejected when the new state is not finite (the state stays) or when the current
    state turns out to have a non-finite free energy (roll back to the previous one),
    so the state kept always has a finite free energy: the last good one."""
    # a generator advances whatever the step: a retried step draws afresh
    guarded = {var: value for var, value in updates.items() if is_generator(var)}
    for var in guarded:
        _add_state(state, keys[var], var)
    arrays = {var: value for var, value in updates.items() if var not in guarded}
    here_ok = pt.isfinite(graph.info.free_energy)
    next_ok = here_ok
    for value in arrays.values():
        next_ok = next_ok & pt.all(pt.isfinite(value))
    for var, value in arrays.items():
        key = keys[var]
        previous = pytensor.shared(var.get_value(), name=f"{key}_previous")
        guarded[var] = pt.switch(next_ok, value, pt.switch(here_ok, var, previous))
        guarded[previous] = pt.switch(next_ok, var, previous)
        _add_state(state, key, var)
        _add_state(state, previous.name, previous)
    return guarded, next_ok


def compile_step(
    graph: StepGraph, options: FitOptions, learning_rates: SharedVariable
) -> tuple[CompiledStep, dict[str, SharedVariable]]:
    """The step as one compiled call, and every shared variable of the fit's state by the
    name a saved checkpoint gives it."""
    step_updates = updates(graph.state, graph.new)
    keys = {var: var.name for var in step_updates}
    if not options.auto:  # the automatic step learns them between fits of q (pymc_gpf.hyper)
        _learn_hyperparameters(graph, options, learning_rates[0], step_updates, keys)
    state = {learning_rates.name: learning_rates}
    if graph.guarded:
        step_updates, ok = _guard(graph, step_updates, keys, state)
    else:
        ok = pt.isfinite(graph.info.free_energy)
        for var in step_updates:
            _add_state(state, keys[var], var)
    if options.auto:  # θ, set between fits of q, is state all the same
        for i, theta in enumerate(options.more_obj_params):
            _add_state(state, f"hyper{i}", theta)
    info = graph.info.scalars()
    outputs = [graph.info.free_energy, ok, *info.values()]
    if options.compile_backend == "jax":
        fn = _per_shape(outputs, step_updates, options)
    else:
        fn = _compile(outputs, step_updates, options)
    return CompiledStep(fn, graph, options, tuple(info)), state


def _compile(outputs: list, step_updates: dict, options: FitOptions) -> Callable[[], list]:
    fn = compile_function(
        [],
        outputs,
        options.compile_backend,
        options.compile_kwargs,
        updates=step_updates,
        random_seed=False,  # the state's rng is seeded by us and continues across compiles
    )
    fn.trust_input = True
    return fn


def _per_shape(outputs: list, step_updates: dict, options: FitOptions) -> Callable[[], list]:
    """The step compiled once per shape of the state: JAX traces shapes as constants, so a
    number of particles left dynamic (:func:`dynamic_rows`) is fixed before it compiles, and
    a new number (GPF's growing cloud) compiles anew."""
    state = [var for var in step_updates if not is_generator(var) and var.type.ndim]
    compiled: dict[tuple, Callable[[], list]] = {}

    def step() -> list:
        shapes = tuple(var.get_value(borrow=True).shape for var in state)
        if shapes not in compiled:
            fixed = {v: pt.specify_shape(v, shape) for v, shape in zip(state, shapes, strict=True)}
            graphs = graph_replace([*outputs, *step_updates.values()], fixed, strict=False)
            updates = dict(zip(step_updates, graphs[len(outputs) :], strict=True))
            compiled[shapes] = _compile(graphs[: len(outputs)], updates, options)
        return compiled[shapes]()

    return step
