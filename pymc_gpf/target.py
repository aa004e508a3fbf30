"""The shared adapter: a PyMC model as a *batched target* on flat unconstrained coordinates.

Every method in this package moves points of ``R^D``, the model's free variables raveled in
PyMC's unconstrained space (transforms applied, log-Jacobian in the density). A set of
points is one matrix ``(N, D)``; the log-density of all of them and its gradient come from
one PyTensor graph, built by vectorising the model's logp graph over the leading axis with
:func:`pytensor.graph.replace.vectorize_graph`. Nothing loops over points in Python.
"""

from __future__ import annotations

import copy
import hashlib
import warnings

from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from typing import Any, NamedTuple

import numpy as np
import pymc as pm
import pytensor
import pytensor.tensor as pt

from pymc.data import MinibatchOp
from pymc.initial_point import make_initial_point_fn
from pymc.model.fgraph import fgraph_from_model, model_from_fgraph
from pymc.pytensorf import (
    collect_default_updates,
    join_nonshared_inputs,
    resolve_backend_compile_kwargs,
)
from pymc.pytensorf import compile as compile_pymc
from pymc.util import get_default_varnames, get_untransformed_name, is_transformed_name
from pymc.variational.minibatch_rv import MinibatchRandomVariable
from pytensor.compile.ops import ViewOp
from pytensor.compile.sharedvalue import SharedVariable
from pytensor.graph.basic import Constant, Variable
from pytensor.graph.fg import FunctionGraph
from pytensor.graph.replace import clone_replace, graph_replace
from pytensor.graph.traversal import ancestors, graph_inputs
from pytensor.link.numba.linker import NumbaLinker
from pytensor.tensor.blockwise import Blockwise
from pytensor.tensor.random.type import RandomGeneratorType
from pytensor.tensor.shape import SpecifyShape
from pytensor.tensor.type import discrete_dtypes

from pymc_gpf.errors import InitialPointError, ModelNotSupportedError
from pymc_gpf.jaxlink import shard_rows, sync_generators, whole_on_every_host
from pymc_gpf.linker import quick_c_mode
from pymc_gpf.reuse import reuse_or_compile
from pymc_gpf.rewrites import batched_graph, python_mode, with_rewrites

__all__ = [
    "LARGE_DATA",
    "QUICK_C",
    "Anchor",
    "BatchedTarget",
    "Coordinates",
    "batched_target",
    "compile_function",
    "compile_kwargs_for",
    "configured_backend",
    "quick_compile_backend",
    "vectorize_rows",
]

QUICK_C = "quick_c"  # C, with the nodes NumPy runs as fast left to NumPy (pymc_gpf.linker)
_WARNED: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


@dataclass(frozen=True)
class Coordinates:
    """Where one free variable lives in the flat unconstrained vector."""

    value_name: str
    rv_name: str
    shape: tuple[int, ...]
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    @property
    def slice(self) -> slice:
        return slice(self.start, self.stop)

    def labels(self) -> list[str]:
        """One label per flat coordinate, e.g. ``"beta[2]"`` or ``"sigma_log__"``."""
        if self.shape == ():
            return [self.value_name]
        return [f"{self.value_name}[{', '.join(map(str, i))}]" for i in np.ndindex(self.shape)]


def compile_kwargs_for(backend: str | None, compile_kwargs: dict | None = None) -> dict:
    """PyMC's ``backend=`` convention ("c", "numba", "jax"; None is PyTensor's default), and
    ``"quick_c"``: C with the small nodes in NumPy (:mod:`pymc_gpf.linker`)."""
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend must be a string such as 'c', 'numba' or 'jax', got {backend!r}")
    if backend == QUICK_C:
        kwargs = resolve_backend_compile_kwargs(None, compile_kwargs)
        if "mode" in kwargs:
            raise ValueError("Can only define one of `backend` or `compile_kwargs['mode']`")
        kwargs["mode"] = quick_c_mode()
    else:
        kwargs = resolve_backend_compile_kwargs(backend, compile_kwargs)
    kwargs["mode"] = with_rewrites(kwargs.get("mode"))
    return kwargs


def configured_backend(backend: str | None, compile_kwargs: dict | None = None) -> bool:
    """Whether the user chose how to compile: ``backend=``, a ``compile_kwargs`` mode, or
    PyTensor's ``mode``/``linker`` flags set away from their defaults."""
    if backend is not None or (compile_kwargs or {}).get("mode") is not None:
        return True
    params = type(pytensor.config).__dict__
    return not (params["mode"].is_default and params["linker"].is_default)


# observed scalars from which an automatic fit compiles with PyMC's default (numba): there
# every evaluation reads so much data that numba's fused loops repay its longer build
LARGE_DATA = 10**5


def quick_compile_backend(
    backend: str | None, compile_kwargs: dict | None = None, data_size: int = 0
) -> str | None:
    """The backend for a fit that takes few steps: the user's choice if they made one, else
    :data:`QUICK_C` when a C compiler is available (on an empty cache a step builds in
    seconds where numba takes about half a minute, and loads faster from a warm one, for more
    time per step; see the benchmarks' startup section) and the model reads fewer than
    :data:`LARGE_DATA` observed scalars, else PyMC's default. With much data each evaluation
    dominates: NumPy runs a fused elementwise kernel as one pass over the data per
    operation, numba as one loop (GF on a hierarchical normal with 2 * 10^5 observations:
    130 ms a step with quick_c, 6 ms with numba; to a result 95 s and 21 s)."""
    if configured_backend(backend, compile_kwargs) or not pytensor.config.cxx:
        return backend
    return backend if data_size >= LARGE_DATA else QUICK_C


def compile_function(
    inputs: list[Variable],
    outputs,
    backend: str | None = None,
    compile_kwargs: dict | None = None,
    **kwargs,
):
    """``pymc.pytensorf.compile`` with the backend convention of :func:`compile_kwargs_for`,
    and numba's fast-math flags off.

    With them (PyTensor's default), numba may reassociate and contract floating-point
    arithmetic differently when it compiles a node inside the step in this process than
    when it links the same node loaded from its on-disk cache: one seed gave different bits
    on a cold and on a warm cache. IEEE arithmetic makes them identical, at no measurable
    cost per step (its cache keys carry the flag, so no fast-math entry is reused).

    On JAX the function's generators are kept in step with the shared ones
    (:func:`pymc_gpf.jaxlink.sync_generators`), and across several hosts its results are
    whole on each (:func:`pymc_gpf.jaxlink.whole_on_every_host`).
    """
    if backend == "jax":
        single = not isinstance(outputs, list | tuple)
        outputs, updates = whole_on_every_host([outputs] if single else list(outputs),
                                               dict(kwargs.pop("updates", None) or {}))  # fmt: skip
        outputs, kwargs["updates"] = (outputs[0] if single else outputs), updates

    options: dict = {}

    def compile():
        return compile_pymc(inputs, outputs, **options, **kwargs)

    # a kept function copied onto new shared variables is linked again: under the same flags
    with pytensor.config.change_flags(numba__fastmath=False), warnings.catch_warnings():
        # the JAX linker's copies of the generators are kept in step (sync_generators)
        warnings.filterwarnings("ignore", "The RandomType SharedVariables", UserWarning)
        # pip installs: PyTensor's C code then calls BLAS through NumPy's C API (NumPy's own
        # BLAS); the quick_c and numba backends do not need the link it warns about
        warnings.filterwarnings("ignore", "PyTensor could not link to a BLAS", UserWarning)
        options.update(compile_kwargs_for(backend, compile_kwargs))
        numba = isinstance(options["mode"].linker, NumbaLinker)
        key = None if numba else _reuse_key(inputs, outputs, backend, compile_kwargs, kwargs)
        if key is None:
            fn = compile()
        else:
            fn = reuse_or_compile(key, inputs, outputs, kwargs.get("updates"), compile)
    _warn_looped(fn)
    return sync_generators(fn)


def _reuse_key(inputs, outputs, backend, compile_kwargs, kwargs) -> tuple | None:
    """What besides the graph decides how :func:`compile_function` compiles it, for
    :func:`pymc_gpf.reuse.reuse_or_compile`; ``None`` where a kept function may not be
    reused: on JAX (compiled per shape, generators synchronised), with the user's
    ``compile_kwargs``, or where compiling reseeds the graph's generators. (Nor on numba,
    decided by the caller: a copy is compiled by numba afresh, which its on-disk cache then
    serves, where a new compile of the same graph is served from that cache at once: a
    second GF fit of a hierarchical normal with 27 000 observations took 9.2 s as a copy and
    0.9 s compiled anew.)"""
    if backend == "jax" or compile_kwargs:
        return None
    extra = {k: v for k, v in kwargs.items() if k != "updates"}
    if extra.get("random_seed") is not False and collect_default_updates(
        inputs=inputs, outputs=outputs if isinstance(outputs, list | tuple) else [outputs]
    ):
        return None
    try:
        check_bounds = pm.modelcontext(None).check_bounds
    except TypeError:
        check_bounds = True
    flags = pytensor.config
    return (
        backend, check_bounds, flags.floatX, str(flags.mode), flags.linker, flags.optimizer,
        flags.cxx, repr(sorted(extra.items())),
    )  # fmt: skip


def _warn_looped(fn) -> None:
    """Warn once if the compiled graph still loops an Op over particles.

    ``vectorize_graph`` wraps an Op it has no batched rule for in a ``Blockwise``, but
    PyTensor's rewrites turn many of those back into one batched call (``IncSubtensor``,
    ``AllocEmpty`` and ``Alloc`` of the ordered transform, basic ``Subtensor``): only what is
    left after compilation loops. (A core Op with a ``gufunc_signature``, such as a
    Cholesky, is a batched kernel of its own.)"""
    looped = sorted(
        {
            str(node.op.core_op)
            for node in fn.maker.fgraph.apply_nodes
            if isinstance(node.op, Blockwise) and not hasattr(node.op.core_op, "gufunc_signature")
        }
    )
    if looped:
        _warn_once(
            f"blockwise:{looped}",
            f"pymc-gpf: the Ops {looped} have no batched implementation, so PyTensor runs "
            "them once per particle or draw, one after another: the results are exact, but "
            "these Ops cost N times their single-point cost each step (N particles or draws) "
            "instead of one batched call.",
        )


def _map_rows(outputs: list[Variable], flat: Variable, rows: Variable) -> list[Variable]:
    mapped = pytensor.map(
        lambda row: clone_replace(outputs, replace={flat: row}),
        sequences=[rows],
        return_updates=False,
    )
    return list(mapped) if isinstance(mapped, list | tuple) else [mapped]


def _try_vectorize(outputs: list[Variable], flat: Variable, rows: Variable, what: str):
    """``vectorize_graph`` over rows, or None (after one warning) if it cannot be done.

    Ops without a batched rule are wrapped in a ``Blockwise`` loop (correct, slower); those
    the compiler's rewrites do not remove are reported once when the graph is compiled
    (:func:`_warn_looped`).
    """
    try:
        batched = batched_graph(_without_view_ops(outputs), replace={flat: rows})
    except NotImplementedError as err:
        _warn_once(
            f"scan:{what}",
            f"pymc-gpf could not vectorise the {what} graph over particles ({err}); "
            "falling back to a slower per-particle loop inside the compiled function.",
        )
        return None
    return list(batched)


def vectorize_rows(
    outputs: list[Variable], flat: Variable, rows: Variable, *, what: str
) -> list[Variable]:
    """Evaluate ``outputs(flat)`` for every row of ``rows`` in one graph (a per-row loop
    inside the graph only if the graph cannot be vectorised)."""
    batched = _try_vectorize(outputs, flat, rows, what)
    return batched if batched is not None else _map_rows(outputs, flat, rows)


def _without_view_ops(outputs: list[Variable]) -> list[Variable]:
    """Drop the identity ``ViewOp`` PyMC wraps deterministics in (it has no vectorise rule,
    so it would otherwise become a per-particle loop)."""
    views = {
        var: var.owner.inputs[0]
        for var in ancestors(outputs)
        if var.owner is not None and isinstance(var.owner.op, ViewOp)
    }
    return graph_replace(outputs, views, strict=False) if views else list(outputs)


def _check_model(model: pm.Model) -> None:
    if not model.free_RVs:
        raise ModelNotSupportedError(
            "The model has no free variables: there is nothing to infer. Add an unobserved "
            "random variable, or check that every variable was not given `observed=`."
        )
    discrete = [rv.name for rv in model.free_RVs if rv.type.dtype in discrete_dtypes]
    if discrete:
        raise ModelNotSupportedError(
            f"Free variable(s) {discrete} are discrete; particle and Gaussian flows need "
            "continuous variables. Marginalise them out (e.g. pymc_extras.marginalize) or "
            "use pm.sample, which assigns a discrete step method to them."
        )
    for rv in model.observed_RVs:
        _check_observed(rv.name, rv, model.rvs_to_values[rv])


def _check_observed(name: str, rv: Variable, data: Variable) -> None:
    """Observed data the log-density would silently get wrong: NaN (PyMC imputes missing
    values only in NumPy/pandas data) and pm.Minibatch without ``total_size``."""
    sources = [
        v for v in ancestors([data]) if v.owner is None or isinstance(v.owner.op, MinibatchOp)
    ]
    if any(v.owner is not None for v in sources) and not isinstance(
        rv.owner.op, MinibatchRandomVariable
    ):
        raise ModelNotSupportedError(
            f"Observed variable {name!r} uses pm.Minibatch data but has no total_size, so "
            "its log-likelihood, and the free energy, would be on the minibatch scale. Pass "
            f"total_size=<number of rows of the full data> to {name!r}."
        )
    for var in sources:
        value = var.data if isinstance(var, pt.TensorConstant) else None
        if isinstance(var, SharedVariable) and not isinstance(var.type, RandomGeneratorType):
            value = var.get_value(borrow=True)
        if value is not None and np.issubdtype(np.asarray(value).dtype, np.floating):
            if np.isnan(value).any():
                where = f" (in {var.name!r})" if var.name else ""
                raise ModelNotSupportedError(
                    f"The observed data of {name!r} contain NaN{where}. PyMC imputes missing "
                    "values only in NumPy or pandas data passed as observed=; drop or impute "
                    "the rows of pm.Minibatch or shared data."
                )


def _coordinates(model: pm.Model, point: dict[str, np.ndarray]) -> tuple[Coordinates, ...]:
    """Where each free variable lives in the flat vector: the value variables in the model's
    order, each raveled, with the shapes of ``point`` (the initial point)."""
    rv_of = {model.rvs_to_values[rv].name: rv.name for rv in model.free_RVs}
    coords, start = [], 0
    for var in model.value_vars:
        shape = tuple(int(s) for s in np.shape(point[var.name]))
        size = int(np.prod(shape, dtype=int))
        coords.append(Coordinates(var.name, rv_of[var.name], shape, start, start + size))
        start += size
    return tuple(coords)


def _own_generators(logp: Variable) -> dict[Variable, SharedVariable]:
    """New shared generators for those the log-density draws from (pm.Minibatch's row
    sampler), to replace them by: the fit seeds its own, so the model's stay as they were
    and the same random_seed gives the same minibatches."""
    return {
        var: pytensor.shared(np.random.default_rng(0), name=f"{var.name or 'data'}_rng")
        for var in ancestors([logp])
        if isinstance(var, SharedVariable) and isinstance(var.type, RandomGeneratorType)
    }


def _is_minibatch(var: Variable) -> bool:
    """Whether ``var`` is ``pm.Minibatch`` data (an output of its Op)."""
    return var.owner is not None and isinstance(var.owner.op, MinibatchOp)


def _full_data_logp(
    model: pm.Model,
    point: dict[str, np.ndarray],
    value_vars: list[Variable],
    rows: Variable | None = None,
) -> tuple[Variable, Variable]:
    """The log-density of ``model`` with ``pm.Minibatch`` data replaced by the whole data set
    (``total_size`` scaling then 1), as a graph of a new flat input: ``(logp, flat)``. With
    ``rows`` (an integer vector) the data are those rows instead, scaled by ``total_size``
    over their number as a minibatch is (:meth:`BatchedTarget.subsample_rows`)."""
    fgraph, _ = fgraph_from_model(model)  # a copy: the user's model is not touched
    if rows is None:
        for node in list(fgraph.apply_nodes):
            if isinstance(node.op, MinibatchRandomVariable):
                # total_size scaling is 1 on the whole data set; and PyMC's make_node cannot
                # rebuild a node whose total_size has a None entry, so it goes first, in place
                fgraph.replace(node.outputs[0], node.inputs[0], import_missing=True)
    replace = {}
    for node in fgraph.apply_nodes:
        if isinstance(node.op, MinibatchOp):
            # the Op's last input and output are its random generator and its update
            data = node.inputs[:-1] if rows is None else [v[rows] for v in node.inputs[:-1]]
            replace.update(zip(node.outputs[:-1], data, strict=True))
    # the minibatch's static length is in the types downstream: rebuild them
    outputs = clone_replace(fgraph.outputs, replace, rebuild_strict=False)
    full_graph = FunctionGraph(outputs=outputs, clone=False)
    full_graph._coords, full_graph._dim_lengths = fgraph._coords, fgraph._dim_lengths
    full = model_from_fgraph(full_graph, mutate_fgraph=True)
    values = {v.name: v for v in full.value_vars}
    [logp], flat = join_nonshared_inputs(point, [full.logp()], [values[v.name] for v in value_vars])
    # a shape check may still state the minibatch's length (pm.Categorical's logp): it only
    # asserts, so drop it
    checks = {
        var: var.owner.inputs[0]
        for var in ancestors([logp])
        if var.owner is not None and isinstance(var.owner.op, SpecifyShape)
    }
    if checks:
        [logp] = graph_replace([logp], checks, strict=False)
    return logp, flat


def _start_overrides(
    model: pm.Model, coordinates: tuple[Coordinates, ...], start: Any, dtype: str
) -> dict[str, np.ndarray]:
    """``start`` checked (keys: RV names in constrained space, or value-variable names;
    values of the variable's shape, or scalars broadcast to it, finite) as overrides of the
    model's initial point."""
    if not isinstance(start, dict):
        raise TypeError(f"start must be a dict of variable name -> value, got {type(start)}")
    shapes = model.eval_rv_shapes()
    overrides = {}
    for key, value in start.items():
        name = key if isinstance(key, str) else getattr(key, "name", str(key))
        if name not in shapes:
            free = [c.rv_name for c in coordinates]
            raise KeyError(
                f"start has an entry {name!r} that is not a free variable of the model; "
                f"free variables are {free} (or their transformed names)."
            )
        expected = tuple(int(s) for s in shapes[name])
        value = np.asarray(value, dtype=dtype)
        if value.shape != expected:
            if value.ndim != 0:
                raise ValueError(
                    f"start[{name!r}] has shape {value.shape}, but {name} has shape "
                    f"{expected}. Pass an array of shape {expected} (or a scalar)."
                )
            value = np.broadcast_to(value, expected).copy()
        if not np.all(np.isfinite(value)):
            raise InitialPointError(f"start[{name!r}] contains non-finite values: {value}.")
        overrides[name] = value
    return overrides


def _constrained_function(
    model: pm.Model,
    point: dict[str, np.ndarray],
    value_vars: list[Variable],
    dtype: str,
    include_transformed: bool,
    backend: str | None,
    compile_kwargs: dict | None,
) -> Callable[[np.ndarray], dict[str, np.ndarray]]:
    """:meth:`BatchedTarget.compile_constrained`: the free variables and deterministics of
    ``model`` as one batched function of flat unconstrained draws (rows of ``value_vars``
    raveled)."""
    outputs = [v for v in model.unobserved_value_vars if not isinstance(v, pt.TensorConstant)]
    keep = set(get_default_varnames([v.name for v in outputs], include_transformed))
    outputs = [v for v in outputs if v.name in keep]
    names = [v.name for v in outputs]
    joined, flat = join_nonshared_inputs(point, outputs, value_vars)
    draws = pt.matrix("draws", dtype=dtype)
    batched = vectorize_rows(joined, flat, draws, what="deterministics")
    fn = compile_function([draws], batched, backend, compile_kwargs)
    core_ndims = {v.name: v.ndim for v in outputs}

    def constrained(samples: np.ndarray) -> dict[str, np.ndarray]:
        samples = np.asarray(samples, dtype=dtype)
        values = fn(samples)
        out = {}
        for name, value in zip(names, values, strict=True):
            value = np.asarray(value)
            if value.ndim == core_ndims[name]:  # does not depend on the free variables
                value = np.broadcast_to(value, (len(samples), *value.shape))
            out[name] = value
        return out

    return constrained


class _FlatLayout:
    """The flat unconstrained vector's layout: where each free variable lives
    (:class:`Coordinates`), and the conversions between flat vectors and PyMC's point
    dicts."""

    def __init__(self, coordinates: tuple[Coordinates, ...], dtype: str):
        self.coordinates = coordinates
        self.ndim = coordinates[-1].stop
        self.dtype = dtype

    @cached_property
    def labels(self) -> list[str]:
        """One label per flat coordinate, e.g. ``"beta[2]"`` or ``"sigma_log__"``."""
        return [label for c in self.coordinates for label in c.labels()]

    def variables_at(self, dims: np.ndarray) -> list[str]:
        """Names of the free variables owning the flat coordinates flagged in ``dims``."""
        dims = np.asarray(dims)
        idx = np.flatnonzero(dims) if dims.dtype == bool else dims
        return [c.rv_name for c in self.coordinates if np.any((idx >= c.start) & (idx < c.stop))]

    def point(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """A flat vector as PyMC's point dict (value-variable names, unconstrained)."""
        flat = np.asarray(flat)
        return {c.value_name: flat[c.slice].reshape(c.shape) for c in self.coordinates}

    def flatten(self, point: dict[str, Any]) -> np.ndarray:
        """PyMC's point dict (value-variable names, unconstrained) as one flat vector."""
        return np.concatenate(
            [np.asarray(point[c.value_name], dtype=self.dtype).ravel() for c in self.coordinates]
        )

    def find(self, name: str) -> Coordinates:
        """Coordinates of a free variable given its RV name or value-variable name."""
        for c in self.coordinates:
            if name in (c.rv_name, c.value_name):
                return c
        raise KeyError(name)


class Anchor(NamedTuple):
    """The control variates' anchor (shared variables): a point, the full data's
    log-density and gradient there, and whether it is set (1) or not yet (0)."""

    point: Variable
    logp: Variable
    grad: Variable
    active: Variable


class BatchedTarget(_FlatLayout):
    """A PyMC model seen as ``log p(x)`` on flat unconstrained coordinates ``x`` in ``R^D``:
    the papers' ``phi(x) = -log p(x, y)`` (Galy-Fajou et al. 2021, eq. 2; the log joint
    ``log p(z, x)`` of Ambrogioni et al. 2018, eq. 24), evaluated for many points at once.

    The model is only read, never modified. The logp graph is the model's own
    (``model.logp()``: log-Jacobians included, ``total_size`` scaling of ``pm.Minibatch``
    observations included, so every value is on the full-data scale).
    """

    row_sharding = None  # split the rows of points across JAX devices (jaxlink.row_sharding)

    def __init__(self, model: pm.Model | None = None):
        model = pm.modelcontext(model)
        _check_model(model)
        self.model = model
        self.value_vars = list(model.value_vars)
        self._point = model.initial_point()
        super().__init__(_coordinates(model, self._point), pytensor.config.floatX)
        [logp], self._flat = join_nonshared_inputs(self._point, [model.logp()], self.value_vars)
        self._rngs = _own_generators(logp)
        self._logp = graph_replace([logp], self._rngs, strict=False)[0] if self._rngs else logp
        # graphs and functions built once for this state of the model, shared by the
        # targets of later fits (:func:`batched_target`)
        self._memo: dict = {}

    @property
    def reusable(self) -> bool:
        """Whether a later fit of the same model may share this target's graphs: not with
        minibatches, whose generators are each fit's own (their states are saved with it)."""
        return not self._rngs

    def data_fingerprint(self, exclude: Sequence[Variable] = ()) -> str:
        """A digest of the data the log-density reads: every constant and shared array (not a
        generator, nor the learnt hyperparameters ``exclude``) it depends on, as the model
        holds them now (the full arrays where ``pm.Minibatch`` slices them). A saved fit keeps
        it, to tell a model with other data."""
        digest = hashlib.blake2b(digest_size=16)
        skip = {id(self._flat), *map(id, exclude)}
        inputs = [v for v in graph_inputs([self._full_data_logp]) if id(v) not in skip]
        for var in inputs:
            if isinstance(var, SharedVariable):
                if isinstance(var.type, RandomGeneratorType):
                    continue
                value = var.get_value(borrow=True)
            elif isinstance(var, Constant):
                value = var.data
            else:
                continue
            value = np.ascontiguousarray(value)
            digest.update(f"{var.name}:{value.dtype.str}:{value.shape}\n".encode())
            digest.update(value.tobytes())
        return digest.hexdigest()

    def data_values(self) -> tuple[np.ndarray, ...]:
        """The current values of the model's data containers (``pm.Data``), by reference:
        ``pm.set_data`` replaces them rather than writing into them."""
        return tuple(v.get_value(borrow=True) for v in self.model.data_vars)

    @contextmanager
    def with_data(self, values: tuple[np.ndarray, ...] | None) -> Iterator[None]:
        """The model's data containers hold ``values`` (:meth:`data_values`; ``None``: as
        they are) inside the block, and what they held before after it."""
        containers = self.model.data_vars
        if values is None or len(values) != len(containers):
            yield
            return
        current = self.data_values()
        changed = [i for i, (a, b) in enumerate(zip(values, current, strict=True)) if a is not b]
        for i in changed:
            containers[i].set_value(values[i], borrow=True)
        try:
            yield
        finally:
            for i in changed:
                containers[i].set_value(current[i], borrow=True)

    def remember(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """``build()``, once per state of the model: kept with this target's graphs and
        shared by the targets of later fits (:func:`batched_target`)."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def check_logp(self) -> Callable:
        """PyMC's own log-density of a point, compiled without C code (for
        :func:`pymc_gpf.start.check_start`)."""
        return self.remember("check_logp", lambda: self.model.compile_logp(mode=python_mode()))

    def quick_gradient(self) -> Callable[[np.ndarray], np.ndarray]:
        """The batched gradient ``X (N, D) -> (N, D)``, compiled without C code: for a few
        probing calls (:func:`pymc_gpf.structure.find_locals`), not for a fit."""

        def build():
            rows = pt.matrix("rows", dtype=self.dtype)
            return pytensor.function([rows], self.logp_and_grads(rows)[1], mode=python_mode())

        return self.remember("quick_gradient", build)

    def _batched(self, rows: Variable, what: str, gradient: bool) -> list[Variable]:
        """The log-density (and gradient) of every row of ``rows``, vectorised once per type
        of ``rows`` and then copied onto it (vectorising is most of a fit's graph
        building)."""
        key = (rows.type, what, gradient)
        if key not in self._memo:
            placeholder = rows.type()
            batched = _try_vectorize([self._logp], self._flat, placeholder, what)
            if batched is not None and gradient:
                batched = [batched[0], pytensor.grad(batched[0].sum(), placeholder)]
            self._memo[key] = placeholder, batched
        placeholder, batched = self._memo[key]
        if batched is None:
            return None
        return graph_replace(batched, {placeholder: rows}, strict=True)

    def seed(self, seed: np.random.SeedSequence) -> None:
        """Seed the generators the log-density draws from (minibatch rows)."""
        for rng, child in zip(self._rngs.values(), seed.spawn(len(self._rngs)), strict=True):
            rng.set_value(np.random.default_rng(child), borrow=True)

    def data_rng_states(self) -> list[dict]:
        """The states of those generators (to save a fit and continue it exactly)."""
        return [rng.get_value().bit_generator.state for rng in self._rngs.values()]

    def set_data_rng_states(self, states: list[dict]) -> None:
        for rng, state in zip(self._rngs.values(), states, strict=True):
            generator = np.random.default_rng()
            generator.bit_generator.state = state
            rng.set_value(generator, borrow=True)

    @cached_property
    def anchor(self) -> Anchor | None:
        """With ``pm.Minibatch`` data, the anchor of the log-density's control variates
        (:meth:`logp_and_grads`); ``None`` on full data."""
        if not self._rngs:
            return None
        zeros = np.zeros(self.ndim, dtype=self.dtype)
        return Anchor(*(
            pytensor.shared(np.asarray(value, dtype=self.dtype), name=f"anchor_{name}")
            for name, value in zip(Anchor._fields, (zeros, 0.0, zeros, 0.0), strict=True)
        ))  # fmt: skip

    anchor_evaluations = 0  # the fit's gradient evaluations when the anchor was last set

    def anchor_state(self) -> dict | None:
        """The anchor's values and when it was set (to save a fit and continue it exactly)."""
        if self.anchor is None:
            return None
        values = {k: np.asarray(v.get_value()).tolist() for k, v in self.anchor._asdict().items()}
        return values | {"evaluations": self.anchor_evaluations}

    def set_anchor_state(self, state: dict | None) -> None:
        if self.anchor is None or state is None:
            return
        for name, var in self.anchor._asdict().items():
            var.set_value(np.asarray(state[name], dtype=self.dtype))
        self.anchor_evaluations = int(state["evaluations"])

    # ----------------------------------------------------------------- symbolic graphs
    def logp_and_grads(
        self, particles: Variable, wrt: list[Variable] | tuple = ()
    ) -> tuple[Variable, Variable, list[Variable]]:
        """Per-row log-density ``(N,)``, its gradient ``(N, D)``, and ``d sum(logp)/d wrt``;
        each row evaluated on the device holding it when :attr:`row_sharding` is set.

        With ``pm.Minibatch`` data, once the :attr:`anchor` is set (``active``), both are
        control-variate estimates (SVRG, Johnson & Zhang 2013; for stochastic-gradient
        sampling, Baker et al. 2019): ``f_B(x) - f_B(a) + f(a)`` for the minibatch estimate
        ``f_B`` (log-density or gradient) at the row and at the anchor ``a`` on the same
        rows, and the full-data ``f(a)``. Unbiased for any ``a``; with ``a`` near q's
        centre the minibatch noise is that of ``f_B(x) - f_B(a)``, which vanishes as
        ``x -> a`` rather than staying of the order of the full-data value."""
        anchor = self.anchor
        if anchor is None or wrt:
            return self._logp_and_grads(particles, wrt)
        rows = pt.concatenate([particles, anchor.point[None, :]], axis=0)
        logp, grad, _ = self._logp_and_grads(rows, ())
        # the anchor's row shares the rows of data the batch drew
        shift = anchor.active * (anchor.logp - logp[-1])
        return logp[:-1] + shift, grad[:-1] + anchor.active * (anchor.grad - grad[-1]), []

    def _logp_and_grads(
        self, particles: Variable, wrt: list[Variable] | tuple = ()
    ) -> tuple[Variable, Variable, list[Variable]]:
        rows = shard_rows(particles, self.row_sharding)
        if rows is particles and not wrt:
            batched = self._batched(particles, "log-density", gradient=True)
            if batched is not None:
                return batched[0], batched[1], []
        batched = _try_vectorize([self._logp], self._flat, rows, "log-density")
        if batched is not None:
            grads = pytensor.grad(batched[0].sum(), [particles, *wrt])
            return batched[0], grads[0], list(grads[1:])
        # fallback: differentiate the single-point graph, then loop (no gradient through it)
        single = [self._logp, *pytensor.grad(self._logp, [self._flat, *wrt])]
        logp, grad, *per_row = _map_rows(single, self._flat, rows)
        return logp, grad, [g.sum(axis=0) for g in per_row]

    def rows(self, name: str) -> Variable:
        """A symbolic ``(N, D)`` input of points, ``D`` static: JAX cannot trace a gradient
        whose shape depends on a column count it only learns at run time."""
        return pt.tensor(name, dtype=self.dtype, shape=(None, self.ndim))

    def compile_logp_dlogp(self, backend: str | None = None, compile_kwargs: dict | None = None):
        """The bare batched function ``X (N, D) -> (logp (N,), dlogp (N, D))``."""
        particles = self.rows("particles")
        logp, grad, _ = self.logp_and_grads(particles)
        return compile_function([particles], [logp, grad], backend, compile_kwargs)

    def compile_full_logp_dlogp(self, backend: str | None = None):
        """``X (N, D) -> (logp, dlogp)`` of the whole data set (``pm.Minibatch`` data replaced
        by the full arrays): the anchor's values for the control variates."""
        points = self.rows("points")
        [logp] = vectorize_rows([self._full_data_logp], self._flat, points, what="log-density")
        return compile_function([points], [logp, pytensor.grad(logp.sum(), points)], backend)

    def compile_subsample_logp(self, backend: str | None = None, gradient: bool = False):
        """``(X (S, D), rows) -> logp (S,)`` (and ``dlogp (S, D)`` with ``gradient``) with
        ``pm.Minibatch`` data replaced by the given ``rows`` of the whole data set, scaled as
        a minibatch of them (:attr:`subsample_rows`)."""
        points, rows = self.rows("points"), pt.lvector("data_rows")
        graph, flat = _full_data_logp(self.model, self._point, self.value_vars, rows)
        graph = graph_replace([graph], {flat: self._flat}, strict=False)[0]
        [logp] = vectorize_rows([graph], self._flat, points, what="log-density")
        outputs = [logp, pytensor.grad(logp.sum(), points)] if gradient else logp
        return compile_function([points, rows], outputs, backend)

    @cached_property
    def subsample_rows(self) -> int | None:
        """The rows ``n`` of the data every ``pm.Minibatch`` slices, where one index of
        rows can stand for a minibatch of all of them (the same length, and ``total_size``
        ``n`` on every minibatched observation); ``None`` otherwise."""
        lengths = {
            int(var.owner.inputs[0].shape[0].eval())
            for var in ancestors([self._logp])
            if _is_minibatch(var)
        }
        if len(lengths) != 1:
            return None
        [n] = lengths
        for rv in self.model.observed_RVs:
            data = [rv, self.model.rvs_to_values[rv]]
            if not any(_is_minibatch(var) for var in ancestors(data)):
                continue  # data of its own, read whole by the subsample too
            scaled = isinstance(rv.owner.op, MinibatchRandomVariable)
            size = rv.owner.inputs[1] if scaled and len(rv.owner.inputs) > 1 else None
            if not isinstance(size, Constant) or size.data.item() != n:
                return None  # total_size not n: a subsample would not be scaled to the data
        return n

    def logp(self, points: Variable, full_data: bool = False) -> Variable:
        """Per-row log-density ``(K,)`` of ``points`` ``(K, D)``, without the gradient;
        ``full_data`` replaces ``pm.Minibatch`` data by the whole data set (the ``total_size``
        scaling then becomes 1)."""
        graph = self._full_data_logp if full_data else self._logp
        rows = shard_rows(points, self.row_sharding)
        if graph is self._logp and rows is points:
            batched = self._batched(points, "log-density", gradient=False)
            if batched is not None:
                return batched[0]
        [logp] = vectorize_rows([graph], self._flat, rows, what="log-density")
        return logp

    @cached_property
    def _full_data_logp(self) -> Variable:
        if not self.minibatch:
            return self._logp
        logp, flat = _full_data_logp(self.model, self._point, self.value_vars)
        return graph_replace([logp], {flat: self._flat}, strict=False)[0]

    def compile_logp(
        self,
        backend: str | None = None,
        compile_kwargs: dict | None = None,
        full_data: bool = False,
    ):
        """The batched log-density ``X (S, D) -> logp (S,)``, without the gradient (of the
        whole data set with ``full_data``, see :meth:`logp`)."""
        points = pt.matrix("points", dtype=self.dtype)
        logp = self.logp(points, full_data)
        return compile_function([points], logp, backend, compile_kwargs)

    @cached_property
    def minibatch(self) -> bool:
        """Whether the log-density reads ``pm.Minibatch`` data (then it is a stochastic,
        unbiased estimate of the full-data one)."""
        return any(
            var.owner is not None and isinstance(var.owner.op, MinibatchOp)
            for var in ancestors([self._logp])
        )

    @cached_property
    def data_size(self) -> int:
        """Observed scalars in the whole data set (what one log-density evaluation reads;
        ``pm.Minibatch`` data counted in full)."""
        total = 0
        for rv in self.model.observed_RVs:
            try:
                total += int(np.prod(self.model.rvs_to_values[rv].shape.eval()))
            except Exception:  # a shape only known when evaluated
                total += 1
        return max(int(total / self.minibatch_fraction), 1)

    @cached_property
    def minibatch_fraction(self) -> float:
        """The smallest fraction of its data's rows a ``pm.Minibatch`` reads in one
        evaluation (1 without minibatches)."""
        fractions = [
            var.owner.outputs[0].shape[0].eval() / var.owner.inputs[0].shape[0].eval()
            for var in ancestors([self._logp])
            if var.owner is not None and isinstance(var.owner.op, MinibatchOp)
        ]
        return float(min(fractions, default=1.0))

    # ----------------------------------------------------------------- starting point
    def start_vector(self, start: dict | None = None, random_seed=None) -> np.ndarray:
        """The flat unconstrained starting point: the model's initial point updated by
        ``start`` (keys: RV names in constrained space, or value-variable names)."""
        if not start:
            return self.flatten(self._point)
        point = make_initial_point_fn(
            model=self.model,
            overrides=_start_overrides(self.model, self.coordinates, start, self.dtype),
            jitter_rvs=set(),
            return_transformed=True,
        )(random_seed)
        return self.flatten(point)

    def prior_draws(self, seeds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One flat unconstrained point drawn from the prior per integer of ``seeds``, the
        model's own initial values ignored, ``(S, D)``; and which coordinates were drawn
        (``False`` for a variable with no prior to draw from, ``Flat`` or ``HalfFlat``,
        and where the transform cannot map the draw: an unordered draw of an ordered
        variable; none where some variable has no way to draw at all, a ``CustomDist``
        without a ``random`` function)."""
        flat = {rv for rv in self.model.free_RVs if "Flat" in type(rv.owner.op).__name__}
        strategies = {rv: "support_point" if rv in flat else "prior" for rv in self.model.free_RVs}
        draw = self.remember(
            "prior_draws",
            lambda: make_initial_point_fn(
                model=self.model, overrides=strategies, return_transformed=True
            ),
        )
        try:
            draws = np.stack([self.flatten(draw(int(seed))) for seed in seeds])
        except NotImplementedError:  # a CustomDist without a random function: no prior draws
            draws = np.repeat(self.start_vector()[None], len(seeds), axis=0)
            return draws, np.zeros(draws.shape, dtype=bool)
        drawn = np.isfinite(draws)
        for c in self.coordinates:
            if any(rv.name == c.rv_name for rv in flat):
                drawn[:, c.slice] = False
        return draws, drawn

    def explain_nonfinite(self, flat: np.ndarray) -> list[str]:
        """Names of the terms whose log-density is not finite at ``flat`` (slow; errors only)."""
        logps = self.model.point_logps(self.point(flat), round_vals=16)
        return [name for name, value in logps.items() if not np.isfinite(value)]

    # -------------------------------------------------------------- constrained draws
    def compile_constrained(
        self,
        include_transformed: bool = False,
        backend: str | None = None,
        compile_kwargs: dict | None = None,
    ):
        """A function mapping flat unconstrained draws ``(S, D)`` to a dict of constrained
        free variables and deterministics, each with a leading draw axis ``S``."""
        return _constrained_function(
            self.model,
            self._point,
            self.value_vars,
            self.dtype,
            include_transformed,
            backend,
            compile_kwargs,
        )


# the models whose targets are kept (the most recently fitted), each held by its target (so
# its id is not reused while it is kept)
MAX_TARGETS = 8
_TARGETS: dict[int, tuple[tuple, BatchedTarget]] = {}


def batched_target(model: pm.Model | None = None) -> BatchedTarget:
    """The model's :class:`BatchedTarget`, its graphs and functions built once while the
    model stays as it is (its variables, transforms, initial values, ``check_bounds``): a
    later fit gets a copy of its own (e.g. its ``row_sharding``) sharing them. With
    minibatches each fit builds its own (:attr:`BatchedTarget.reusable`)."""
    model = pm.modelcontext(model)
    signature = _model_signature(model)
    kept = _TARGETS.pop(id(model), None)
    if kept is None or kept[0] != signature:
        kept = signature, BatchedTarget(model)
        if not kept[1].reusable:
            return kept[1]
    _TARGETS[id(model)] = kept  # the most recent last
    for stale in list(_TARGETS)[:-MAX_TARGETS]:
        del _TARGETS[stale]
    return copy.copy(kept[1])


def _model_signature(model: pm.Model) -> tuple:
    """What a model's batched target is built from, that a user may change between fits
    (the shapes of its data and dimensions: a free variable's shape may follow them)."""
    initial = tuple(
        (id(rv), value.shape, value.tobytes()) if isinstance(value, np.ndarray) else
        (id(rv), repr(value))
        for rv, value in model.rvs_to_initial_values.items()
    )  # fmt: skip
    return (
        tuple((name, id(var)) for name, var in model.named_vars.items()),
        tuple(id(v) for v in model.value_vars),
        tuple((id(rv), id(t)) for rv, t in model.rvs_to_transforms.items()),
        tuple(id(p) for p in model.potentials),
        tuple(np.shape(v.get_value(borrow=True)) for v in model.data_vars),
        tuple(
            np.asarray(v.get_value(borrow=True)).tolist()
            for v in model.dim_lengths.values()
            if isinstance(v, SharedVariable)
        ),
        initial,
        model.check_bounds,
        pytensor.config.floatX,
    )


def untransformed_name(name: str) -> str:
    return get_untransformed_name(name) if is_transformed_name(name) else name
