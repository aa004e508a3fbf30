"""Every registered method's step keeps the contract the engine relies on
(:class:`pymc_gpf.stepgraph.StepGraph`): its state in, the same state out.

``_build_step(options)`` gives the state (shared variables, their names the checkpoint's
keys), the next state (the same ``NamedTuple`` type, each leaf of the same dtype, rank and a
compatible static shape) and the step's :class:`~pymc_gpf.stepgraph.Info`; a few compiled
steps keep every array's shape (GPF changes its number of particles only between stages of
an automatic fit) and finite values finite; and the step functions themselves are pure, each
``step(state, noise, target, rates, static) -> (State, Info)`` (issue 28: one signature),
each paired with its ``init_<kind>(q, static, dtype) -> State`` (``inits``), which gives the
state the method holds: the same fields, shapes and dtypes.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import typing

import numpy as np
import pytest

from conftest import regression
from methods import names, small_fits
from pytensor.compile.sharedvalue import SharedVariable

from pymc_gpf.options import parse_fit_options
from pymc_gpf.registry import METHODS
from pymc_gpf.stepgraph import Info, StepGraph, is_generator, leaves

STEPS = 4


def _assert_same_structure(state, new, path: str) -> None:
    """The same (nested) ``NamedTuple`` types, ``None`` where the state has ``None``."""
    if not isinstance(state, tuple) and state is not None:  # a leaf
        assert new is not None and not isinstance(new, tuple), path
        return
    assert type(new) is type(state), f"{path}: {type(new).__name__} for {type(state).__name__}"
    if state is not None:
        assert len(new) == len(state), path
        fields = getattr(state, "_fields", range(len(state)))
        for field, a, b in zip(fields, state, new, strict=True):
            _assert_same_structure(a, b, f"{path}.{field}")


def _compatible(a: tuple, b: tuple) -> bool:
    """Static shapes that can hold the same array (``None``: not known statically)."""
    if len(a) != len(b):
        return False
    return all(x is None or y is None or x == y for x, y in zip(a, b, strict=True))


def _record_inits(cls, monkeypatch) -> list:
    """Every state the method's ``inits`` return from now on (each is replaced, wherever the
    method's package holds it, by a wrapper keeping what it returns)."""
    package, made = cls.__module__.rpartition(".")[0], []

    def recorder(fn):
        def init(*args, **kwargs):
            made.append(fn(*args, **kwargs))
            return made[-1]

        return init

    for fn in cls.inits:
        wrapped = recorder(fn)
        for name, module in list(sys.modules.items()):
            if name == package or name.startswith(f"{package}."):
                for attr, value in list(vars(module).items()):
                    if value is fn:
                        monkeypatch.setattr(module, attr, wrapped)
    return made


@pytest.mark.parametrize(("method", "inf_kwargs", "fit_kwargs"), small_fits())
def test_the_step_maps_its_state_to_the_same_state(regression_data, method, inf_kwargs,
                                                   fit_kwargs, monkeypatch):  # fmt: skip
    made = _record_inits(METHODS[method], monkeypatch)
    inference = METHODS[method](model=regression(*regression_data), random_seed=1, **inf_kwargs)
    # the fit keywords as fit() parses them, so the steps compiled here are the fits' own
    # (tests/test_persistence.py fits the same small_fits on the same model: a cache hit)
    options = parse_fit_options(inference.target, inference.default_optimizer, **fit_kwargs)
    inference.prepare(options)  # compiles inference._build_step(options)
    graph = inference.step.graph
    assert isinstance(graph, StepGraph)
    state, new, info = graph.state, graph.new, graph.info
    _assert_same_structure(state, new, type(state).__name__)
    pairs = list(zip(leaves(state), leaves(new), strict=True))
    assert pairs
    # a step that draws holds the fit's generator as its state's rng, and advances it
    generators = [(var, value) for var, value in pairs if is_generator(var)]
    if generators:
        assert state.rng is inference.noise_rng and [var for var, _ in generators] == [state.rng]
        assert is_generator(new.rng) and new.rng is not state.rng
    pairs = [(var, value) for var, value in pairs if not is_generator(var)]
    for var, value in pairs:
        assert isinstance(var, SharedVariable) and var.name, var
        assert (value.dtype, value.ndim) == (var.dtype, var.ndim), var.name
        assert _compatible(var.type.shape, value.type.shape), (
            var.name,
            var.type.shape,
            value.type.shape,
        )
    state_names = [var.name for var, _ in pairs]
    assert len(set(state_names)) == len(state_names), state_names

    assert isinstance(info, Info)
    assert info.free_energy.ndim == 0
    for key in ("accepted", "step_size", "decrement"):
        value = getattr(info, key)
        assert value is None or value.ndim == 0, key
    for key, value in info.scalars().items():
        assert value.ndim == 0, key
    assert info.points.ndim == 2 and info.hyper_grads == ()
    d = inference.target.ndim
    for key in ("points", "positions"):
        assert getattr(info, key).type.shape[-1] in (None, d), key

    # the state is what the step's init gave: the same fields, shapes and dtypes (its rng
    # the fit's generator, which the init leaves to the method)
    inits = [init for init in made if type(init) is type(state)]
    assert inits, f"{method}: no init of the method returned its {type(state).__name__}"
    init = inits[-1]
    if generators:
        assert init.rng is None
        init = init._replace(rng=state.rng)
    _assert_same_structure(state, init, type(state).__name__)
    for var, value in zip(leaves(state), leaves(init), strict=True):
        if is_generator(var):
            continue
        held = var.get_value(borrow=True)
        assert (np.shape(value), np.asarray(value).dtype) == (held.shape, held.dtype), var.name

    # the checkpoint holds every leaf of the state, by its name
    for var, _ in [*pairs, *generators]:
        assert inference.state_vars.get(var.name) is var, var.name
    shared = [var for var, _ in pairs]
    drawn = [var.get_value().bit_generator.state for var, _ in generators]
    before = [np.array(var.get_value()) for var in shared]
    # compiled: (free_energy, ok, *the scalars the controller reads), every array keeping
    # its shape and finite values finite
    scalars = inference.step.info
    assert scalars == tuple(info.scalars())
    for _ in range(STEPS):
        out = inference.step()
        assert len(out) == 2 + len(scalars) and all(np.ndim(v) == 0 for v in out)
    after = [np.asarray(var.get_value()) for var in shared]
    for var, old, value in zip(shared, before, after, strict=True):
        assert (value.shape, value.dtype) == (old.shape, old.dtype), var.name
        assert np.isfinite(value[np.isfinite(old)]).all(), var.name
    assert any(not np.array_equal(a, b) for a, b in zip(before, after, strict=True))
    for (var, _), old in zip(generators, drawn, strict=True):
        assert var.get_value().bit_generator.state != old, var.name


@pytest.mark.parametrize("method", names())
def test_the_step_functions_are_pure(method):
    """A method's ``step`` module builds graphs from the state it is given: it reads, writes
    or creates no shared variable (the method and the engine hold the state)."""
    package = METHODS[method].__module__.rpartition(".")[0]
    source = inspect.getsource(importlib.import_module(f"{package}.step"))
    for impure in (".get_value(", ".set_value(", "shared(", "share(", "share_transform("):
        assert impure not in source, f"{package}.step: {impure}"


SIGNATURE = ("state", "noise", "target", "rates", "static")


@pytest.mark.parametrize("method", names())
def test_every_step_function_has_the_one_signature(method):
    """Every step a method declares (``steps``) is ``step(state, noise, target, rates,
    static) -> tuple[State, Info]``: the state, its random input (``None`` where it has
    none), the ``BatchedTarget``, the step sizes (``FlowInference.learning_rates``) and a
    ``NamedTuple`` of the settings fixed for the graph, all positional, none defaulted."""
    cls = METHODS[method]
    package = cls.__module__.rpartition(".")[0]
    assert cls.steps, f"{cls.__name__} declares no step functions"
    for fn in cls.steps:
        assert fn.__module__ == f"{package}.step", fn
        signature = inspect.signature(fn, eval_str=True)
        params = list(signature.parameters.values())
        assert tuple(p.name for p in params) == SIGNATURE, (fn.__qualname__, signature)
        for p in params:
            assert p.kind is p.POSITIONAL_OR_KEYWORD and p.default is p.empty, (fn, p)
        returned = signature.return_annotation
        assert typing.get_origin(returned) is tuple, (fn.__qualname__, returned)
        state, info = typing.get_args(returned)
        assert info is Info and issubclass(state, tuple) and hasattr(state, "_fields"), fn
        static = signature.parameters["static"].annotation
        assert issubclass(static, tuple) and hasattr(static, "_fields"), (fn, static)


INIT_SIGNATURE = ("static", "dtype")  # after q's arrays


@pytest.mark.parametrize("method", names())
def test_every_step_function_has_an_init(method):
    """Every step a method declares is paired (``inits``, in the order of ``steps``) with a
    pure NumPy ``init_<kind>(q, static, dtype) -> State`` in the same module: from q's
    current arrays (GF: its ``GFState``; WVGD: its ``WVGDState``; GPF and the ensembles:
    the particles), the step's ``static`` and the dtype, the step's whole initial state."""
    cls = METHODS[method]
    assert len(cls.inits) == len(cls.steps), f"{cls.__name__}: inits {cls.inits}"
    for fn, init in zip(cls.steps, cls.inits, strict=True):
        assert init.__module__ == fn.__module__ and init.__name__.startswith("init_"), init
        signature = inspect.signature(init, eval_str=True)
        assert tuple(signature.parameters)[1:3] == INIT_SIGNATURE, (init.__qualname__, signature)
        state = typing.get_args(inspect.signature(fn, eval_str=True).return_annotation)[0]
        assert signature.return_annotation is state, (init.__qualname__, state)
        static = signature.parameters["static"].annotation
        assert static is inspect.signature(fn, eval_str=True).parameters["static"].annotation
