"""Save a fit to a netCDF or zarr DataTree and load it back to continue, without pickle.

The saved tree is an ordinary ArviZ DataTree (``posterior`` draws if asked for, ``fit`` with
the free-energy trace on ``step``, the method's group) plus a ``checkpoint`` group holding
every array of the fit's state — particles or parameters, optimiser moments, the divergence
guard's last good state, the step sizes, learnt hyperparameters — and, as JSON attributes,
the constructor options, the fit keywords, the step count and the state of the random
stream. :func:`load` rebuilds the same inference on the user's model (the model itself is
code and is not saved), compiles the same step and restores that state, so ``refine(n)``
continues exactly as an uninterrupted run with the same seed would.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import warnings

from pathlib import Path
from typing import Any

import numpy as np
import pymc as pm
import xarray as xr

from pytensor.compile.sharedvalue import SharedVariable
from pytensor.graph.traversal import ancestors

from pymc_gpf import record
from pymc_gpf.control import control_checkpoint
from pymc_gpf.datatree import build_datatree
from pymc_gpf.engine import FlowInference
from pymc_gpf.errors import CheckpointError, FitWarning
from pymc_gpf.optimizers import OPTIMIZERS, Optimizer
from pymc_gpf.options import CHECK_DRAWS, FitOptions, parse_fit_options
from pymc_gpf.protocols import FittedApproximation
from pymc_gpf.registry import METHODS
from pymc_gpf.stepgraph import is_generator

__all__ = ["load", "save", "to_datatree"]

GROUP = "checkpoint"
# a child of the checkpoint: the inner fit a refine continues (GPF's GF with fresh draws),
# a checkpoint of its own with its free-energy trace, its dimensions prefixed
CONTINUATION = "continuation"
# 2: optimiser and controller state named from their fields; 3: a checksum; 4: the
# controller's settings and state under its state type's field names (no leading underscore;
# an earlier version cannot read them, so it refuses format 4 by its number); 5: the
# generator of a step's draws is a state variable like the arrays (its state an attribute
# under its key, ``noise_rng``, written only where the step draws)
FORMAT = 5
READS = ("3", "4", "5")  # format 3 loads with its controller's names translated
NETCDF = {"engine": "h5netcdf"}
ZARR = {"consolidated": False}  # consolidated metadata is not part of zarr format 3
_OPTIMIZER_CLASSES = {cls.__name__: cls for cls in OPTIMIZERS.values()}


# --------------------------------------------------------------------------- saving
def _optimizer_json(optimizer: Optimizer) -> dict:
    if _OPTIMIZER_CLASSES.get(type(optimizer).__name__) is not type(optimizer):
        raise ValueError(
            f"Cannot save a fit using the custom optimizer {optimizer!r}: only "
            f"pymc_gpf.optimizers' {sorted(_OPTIMIZER_CLASSES)} can be restored."
        )
    return {"class": type(optimizer).__name__, "fields": dataclasses.asdict(optimizer)}


def _json(value: Any, what: str) -> str:
    try:
        return json.dumps(value)
    except TypeError:
        raise ValueError(f"Cannot save {what} {value!r}: it is not JSON-serialisable.") from None


def _checkpoint(inference: FlowInference) -> xr.Dataset:
    if inference.state is None:
        raise ValueError("Nothing to save yet: fit first (pm.fit(...) or inference.fit(n)).")
    options = inference.fit_options
    fit = {
        "learning_rate": "auto" if options.auto else list(options.learning_rate),
        "tol": options.tol,
        "optimizer": _optimizer_json(options.optimizer),
        "clip_norm": options.clip_norm,
        "backend": options.backend,
        "compile_kwargs": options.compile_kwargs,
        "include_transformed": options.include_transformed,
        "check_draws": options.check_draws,
    }
    seed = inference.random_seed
    arrays = {
        key: xr.DataArray(
            np.asarray(var.get_value()), dims=[f"{key}_dim{i}" for i in range(var.ndim)]
        )
        for key, var in inference.state_vars.items()
        if not is_generator(var)
    }
    generators = {
        key: _json(var.get_value().bit_generator.state, "rng state")
        for key, var in inference.state_vars.items()
        if is_generator(var)
    }
    attrs = {
        "format": FORMAT,
        "method": inference.name,
        "options": _json(inference.constructor_options(), "the constructor options"),
        "fit": _json(fit, "the fit keywords"),
        "hyperparameters": _json([p.name for p in options.more_obj_params], "names"),
        "step": int(inference.state.i),
        "random_seed": _json(seed if isinstance(seed, int | list | None) else None, "seed"),
        # the root of the verdict's and the hyperparameters' draws (seeded per step)
        "check_root": _json([inference.check_root[0], list(inference.check_root[1])], "seed"),
        "flat_coordinates": _json(inference.target.labels, "labels"),
        # the data it was fitted to, told apart from a model's other data when it is loaded
        "data": inference.target.data_fingerprint(options.more_obj_params),
        "data_rngs": _json(inference.target.data_rng_states(), "minibatch rng state"),
        "anchor": _json(inference.target.anchor_state(), "the control variates' anchor"),
        "control": _json(
            control_checkpoint(inference.control, inference.control_state),
            "the step-size controller's state",
        ),
        "hyper": _json(
            None if inference.hyper is None else inference.hyper.state(), "the hyperparameters"
        ),
        "extra": _json(inference.checkpoint_extra(), "the method's extra state"),
    } | generators
    record_arrays, record_attrs = inference.record.checkpoint()
    arrays |= record_arrays
    attrs |= {key: _json(value, f"the fit's {key}") for key, value in record_attrs.items()}
    checkpoint = xr.Dataset(arrays, attrs=attrs)
    checkpoint.attrs["checksum"] = _checksum(checkpoint, inference.hist)
    return checkpoint


def _checksum(checkpoint: xr.Dataset, hist: np.ndarray) -> str:
    """SHA-256 of every array and attribute of the checkpoint and of the free-energy trace:
    a flipped byte anywhere in the state is found before anything is loaded."""
    digest = hashlib.sha256()
    for key in sorted(checkpoint.attrs):
        if key != "checksum":
            digest.update(f"{key}={checkpoint.attrs[key]}\n".encode())
    arrays = [(key, checkpoint[key].values) for key in sorted(checkpoint.data_vars)]
    for key, value in [*arrays, ("hist", np.asarray(hist, dtype=float))]:
        value = np.ascontiguousarray(value)
        digest.update(f"{key}:{value.dtype.str}:{value.shape}\n".encode())
        digest.update(value.tobytes())
    return digest.hexdigest()


def to_datatree(approx: FittedApproximation, draws: int = 0, random_seed=None) -> xr.DataTree:
    """The fit as a DataTree: ``approx.sample(draws)``'s groups (no ``posterior`` when
    ``draws=0``) plus the ``checkpoint`` group :func:`load` needs."""
    checkpoint = _checkpoint(approx.inference)
    if draws:
        tree = approx.sample(draws, random_seed=random_seed)
    else:
        tree = build_datatree(
            approx.model,
            None,
            fit=approx.fit_group(),
            method=approx.inference.name,
            method_group=approx.method_group(),
        )
    tree[GROUP] = xr.DataTree(checkpoint)
    inner = approx.inference.continuation
    if inner is not None:
        nested = _checkpoint(inner).assign(free_energy=("step", np.asarray(inner.hist)))
        nested = nested.rename_dims({dim: f"{CONTINUATION}_{dim}" for dim in nested.dims})
        tree[GROUP][CONTINUATION] = xr.DataTree(nested)
    return tree


def save(approx: FittedApproximation, path: str | Path, draws: int = 0, random_seed=None) -> Path:
    """Write the fit to ``path``: zarr if it ends in ``.zarr``, netCDF (HDF5) otherwise."""
    path = Path(path)
    tree = to_datatree(approx, draws, random_seed)
    if path.suffix == ".zarr":
        _require_zarr()
        tree.to_zarr(path, mode="w", **ZARR)
    else:
        tree.to_netcdf(path, **NETCDF)
    return path


def _require_zarr() -> None:
    try:
        import zarr  # noqa: F401
    except ImportError:
        raise ImportError(
            "A .zarr store needs the zarr package: pip install 'pymc-gpf[zarr]' (or save to "
            "a netCDF file, e.g. 'fit.nc')."
        ) from None


# -------------------------------------------------------------------------- loading
def _read(source: str | Path | xr.DataTree) -> tuple[xr.DataTree, xr.Dataset]:
    """The tree and its checkpoint, whole and as saved, or :class:`CheckpointError`."""
    where = "This DataTree" if isinstance(source, xr.DataTree) else f"{str(source)!r}"
    try:
        tree = _open(source)
    except FileNotFoundError:
        raise
    except Exception as err:  # h5py, zarr and netCDF report a damaged file in many ways
        raise CheckpointError(
            f"{where} is not a pymc-gpf checkpoint or is corrupted (it cannot be read: "
            f"{type(err).__name__}: {err}). Save fits with approx.save(path)."
        ) from err
    if GROUP not in tree.children:
        raise CheckpointError(
            f"{where} has no {GROUP!r} group, so it cannot be continued: it is not a pymc-gpf "
            "checkpoint (save fits with approx.save(path); approx.sample() keeps draws only)."
        )
    checkpoint = tree[GROUP].to_dataset()
    try:
        hist = tree["fit"]["free_energy"].values
    except Exception as err:
        raise _truncated(where, err) from err
    _verify(checkpoint, hist, where)
    return tree, checkpoint


def _truncated(where: str, err: Exception) -> CheckpointError:
    return CheckpointError(
        f"{where} is a truncated or corrupted pymc-gpf checkpoint ({type(err).__name__}: "
        f"{err}); nothing was loaded. Fit again, or load an intact copy."
    )


def _verify(checkpoint: xr.Dataset, hist: np.ndarray, where: str) -> None:
    """:class:`CheckpointError` unless ``checkpoint`` has a format this version reads and its
    checksum matches it and the trace ``hist``."""
    saved = checkpoint.attrs.get("format")
    if saved is None or str(saved) not in READS:
        raise CheckpointError(
            f"{where} has checkpoint format {saved}; this version of pymc-gpf reads formats "
            f"{' and '.join(READS)}. Load it with the version that saved it, or fit again."
        )
    try:
        matches = checkpoint.attrs.get("checksum") == _checksum(checkpoint, hist)
    except Exception as err:
        raise _truncated(where, err) from err
    if not matches:
        raise CheckpointError(
            f"{where} is a corrupted pymc-gpf checkpoint: its checksum does not match its "
            "contents, so its state cannot be trusted; nothing was loaded. Fit again, or load "
            "an intact copy."
        )


def _open(source: str | Path | xr.DataTree) -> xr.DataTree:
    if isinstance(source, xr.DataTree):
        return source
    path = Path(source)
    if path.suffix == ".zarr":
        _require_zarr()
    options = {"engine": "zarr", **ZARR} if path.suffix == ".zarr" else NETCDF
    with xr.open_datatree(path, **options) as tree:
        return tree.load().copy()


def _hyperparameters(model: pm.Model, names: list[str | None]) -> list[SharedVariable]:
    """The model's shared variables learnt by ``more_obj_params``, found by name."""
    if not names:
        return []
    shared = {var.name: var for var in ancestors([model.logp()]) if isinstance(var, SharedVariable)}
    missing = [name for name in names if name not in shared]
    if missing:
        raise ValueError(
            f"The fit learnt the hyperparameters {names} (more_obj_params), but the model has "
            f"no named shared variable(s) {missing} in its log-density. Build the model with "
            "the same pytensor.shared(..., name=...) variables to continue the fit."
        )
    return [shared[name] for name in names]


def _fit_options(inference: FlowInference, attrs: dict) -> FitOptions:
    """The fit keywords the saved fit was compiled with."""
    fit = json.loads(attrs["fit"])
    optimizer = fit["optimizer"]
    auto = fit["learning_rate"] == "auto"
    return parse_fit_options(
        inference.target,
        inference.default_optimizer,
        learning_rate="auto" if auto else tuple(fit["learning_rate"]),
        tol=fit.get("tol"),
        optimizer=None if auto else _OPTIMIZER_CLASSES[optimizer["class"]](**optimizer["fields"]),
        clip_norm=fit["clip_norm"],
        more_obj_params=_hyperparameters(inference.model, json.loads(attrs["hyperparameters"])),
        backend=fit["backend"],
        compile_kwargs=fit["compile_kwargs"],
        include_transformed=fit["include_transformed"],
        check_draws=fit.get("check_draws", CHECK_DRAWS),
    )


def load(
    source: str | Path | xr.DataTree, model: pm.Model | None = None, devices=None
) -> FittedApproximation:
    """Rebuild a saved fit on ``model`` (the model it was fitted to, rebuilt by the same
    code; default: the model in context) and return its approximation, ready for
    ``refine(n)``, ``sample()`` and :func:`pymc_gpf.diagnose`. Learnt hyperparameters
    (``more_obj_params``) are written back into the model's shared variables of the same
    names, as the fit had left them. ``devices`` (as the methods' option; a fit does not
    save the machine's devices) splits the particles across JAX devices from here on."""
    tree, checkpoint = _read(source)
    model = pm.modelcontext(model)
    inference = _rebuild(checkpoint, tree["fit"]["free_energy"].values, model, devices)
    saved = checkpoint.attrs.get("data")  # (a checkpoint older than the fingerprint: none)
    learnt = inference.fit_options.more_obj_params
    if saved is not None and saved != inference.target.data_fingerprint(learnt):
        verdict = inference.outcome.verdict if inference.outcome is not None else None
        warnings.warn(
            "The model's data differ from those this fit was made on: its q, its verdict "
            f"({verdict!r}) and its draws describe the posterior of the saved data, not of "
            "these. approx.refine(n) continues the fit on these data (or fit afresh).",
            FitWarning,
            stacklevel=2,
        )
    if CONTINUATION in tree[GROUP].children:
        where = "The continuation in this checkpoint"
        nested = tree[GROUP][CONTINUATION].to_dataset()
        prefix = f"{CONTINUATION}_"
        try:
            nested = nested.rename_dims({dim: dim.removeprefix(prefix) for dim in nested.dims})
            hist = nested["free_energy"].values
        except Exception as err:  # a damaged group: the same error as a damaged checkpoint
            raise _truncated(where, err) from err
        nested = nested.drop_vars("free_energy")
        _verify(nested, hist, where)
        inference.load_continuation(_rebuild(nested, hist, model, devices))
    return inference.approx


def _rebuild(checkpoint: xr.Dataset, hist: np.ndarray, model: pm.Model, devices) -> FlowInference:
    """The inference a verified ``checkpoint`` (with its free-energy trace ``hist``) saved,
    on ``model``, in the state it was saved in."""
    attrs = checkpoint.attrs
    options = json.loads(attrs["options"]) | ({"devices": devices} if devices else {})
    inference = METHODS[attrs["method"]].from_options(model, options)
    labels = json.loads(attrs["flat_coordinates"])
    if inference.target.labels != labels:
        raise ValueError(
            f"The saved fit is for a model with coordinates {labels}, but this model has "
            f"{inference.target.labels}. Load it with the model it was fitted to."
        )
    inference.prepare(_fit_options(inference, attrs))
    generators = {k for k, var in inference.state_vars.items() if is_generator(var)}
    expected = set(inference.state_vars) - generators
    saved = set(checkpoint.data_vars) - set(record.ARRAYS)
    if expected != saved:
        raise ValueError(
            f"The checkpoint does not match this version of pymc-gpf's {attrs['method']} "
            f"state: missing {sorted(expected - saved)}, unexpected {sorted(saved - expected)}."
        )
    for key, var in inference.state_vars.items():
        if key in generators:
            generator = np.random.default_rng()
            generator.bit_generator.state = json.loads(attrs[key])
            var.set_value(generator, borrow=True)
        else:
            var.set_value(checkpoint[key].values.astype(var.dtype))
    inference.target.set_data_rng_states(json.loads(attrs["data_rngs"]))
    inference.target.set_anchor_state(json.loads(attrs.get("anchor", "null")))
    inference.load_control(json.loads(attrs["control"]))
    hyper = json.loads(attrs.get("hyper", "null"))
    if hyper is not None and inference.hyper is not None:
        inference.hyper.load(hyper)
    inference.load_checkpoint_extra(json.loads(attrs["extra"]))
    entropy, key = json.loads(attrs["check_root"])
    inference.restore(
        record.FitRecord.load(hist, checkpoint),
        int(attrs["step"]),
        json.loads(attrs["random_seed"]),
        (entropy, tuple(key)),
    )
    return inference
