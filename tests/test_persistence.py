"""Save and load: a fit written to netCDF or zarr and loaded on a freshly built model
continues with ``refine`` exactly as an uninterrupted run with the same seed."""

import warnings

from pathlib import Path

import numpy as np
import pymc as pm
import pytensor
import pytensor.tensor as pt
import pytest
import xarray as xr

from conftest import regression
from methods import get, small_fits

import pymc_gpf

from pymc_gpf.optimizers import Adam


class SettingsDiffer(AssertionError):
    """A loaded fit's ``settings()`` differ from the saved fit's."""


# every method at a fixed step (its optimiser's state, its random stream), then at the
# automatic one (line-search state, independent cloud, step-size schedule, controller)
CASES = [pytest.param(*case.values, id=case.id) for case in small_fits()]
GPF_FIXED = ("gpf", dict(get("gpf").fixed_inf_kwargs), dict(get("gpf").fixed_fit_kwargs))


def _fit(model, n, method, inf_kwargs, fit_kwargs):
    return pm.fit(
        n,
        method=method,
        model=model,
        inf_kwargs=inf_kwargs,
        random_seed=11,
        progressbar=False,
        **fit_kwargs,
    )


def _assert_same_fit(a, b):
    for x, y in zip(a.params, b.params, strict=True):
        np.testing.assert_array_equal(x.get_value(), y.get_value())
    np.testing.assert_array_equal(a.hist, b.hist)
    assert a.inference.state.i == b.inference.state.i == len(a.hist)


def _assert_same_settings(a: dict, b: dict) -> None:
    """Equal settings, NaN equal to NaN (an ensemble's ESS and R-hat before its draws)."""
    if a.keys() != b.keys():
        raise SettingsDiffer(f"keys only in one: {sorted(a.keys() ^ b.keys())}")
    for key, value in a.items():
        nan = isinstance(value, float) and isinstance(b[key], float)
        if not (nan and np.isnan(value) and np.isnan(b[key])) and value != b[key]:
            raise SettingsDiffer(f"{key}: {value!r} != {b[key]!r}")


@pytest.mark.parametrize("method,inf_kwargs,fit_kwargs", CASES)
def test_a_loaded_fit_continues_exactly(tmp_path, regression_data, method, inf_kwargs, fit_kwargs):
    """Saved half way (before an automatic fit stopped by itself), loaded and refined: the
    same particles or parameters, trace, step sizes and outcome as the uncut fit."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # automatic fits cut short
        whole = _fit(regression(*regression_data), 60, method, inf_kwargs, fit_kwargs)
        cut = min(30, len(whole.hist) // 2)
        part = _fit(regression(*regression_data), cut, method, inf_kwargs, fit_kwargs)
    path = part.save(tmp_path / "fit.nc", draws=25, random_seed=1)
    loaded = pymc_gpf.load(path, model=regression(*regression_data))
    assert type(loaded) is type(part)
    settings = loaded.inference.settings()  # compared last (a known difference: the ensemble)
    loaded.refine(60 - cut)
    _assert_same_fit(loaded, whole)
    np.testing.assert_array_equal(loaded.inference.step_sizes, whole.inference.step_sizes)
    assert (loaded.outcome.reason, loaded.outcome.converged) == (
        whole.outcome.reason,
        whole.outcome.converged,
    )
    draws = [a.sample(10, random_seed=4)["posterior"]["slope"].values for a in (loaded, whole)]
    np.testing.assert_array_equal(*draws)
    saved = xr.open_datatree(path, engine="h5netcdf")
    chains = len(part.particles) if get(method).chains else 1
    assert saved["posterior"]["sigma"].shape == (chains, -(-25 // chains))
    np.testing.assert_array_equal(saved["fit"]["free_energy"].values, part.hist)
    np.testing.assert_array_equal(saved["fit"]["step_size"].values, part.inference.step_sizes)
    saved.close()
    _assert_same_settings(settings, part.inference.settings())


# the same cut fits, saved by an earlier version (tests/data/checkpoints/README.md)
EARLIER = Path(__file__).parent / "data" / "checkpoints"


@pytest.mark.parametrize("method,inf_kwargs,fit_kwargs", CASES)
def test_a_fit_saved_by_an_earlier_version_continues_as_one_made_now(
    request, regression_data, method, inf_kwargs, fit_kwargs
):
    """A checkpoint written before the steps got one signature and their inits loads (its
    keys, the state's shared variables' names, are unchanged) and continues as the uncut fit
    made by this version: the same trace, parameters and outcome (to rounding: the file was
    written on another machine, maybe)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # automatic fits cut short
        whole = _fit(regression(*regression_data), 60, method, inf_kwargs, fit_kwargs)
    loaded = pymc_gpf.load(EARLIER / f"{request.node.callspec.id}.nc",
                           model=regression(*regression_data))  # fmt: skip
    cut = len(loaded.hist)
    assert cut == min(30, len(whole.hist) // 2)
    loaded.refine(60 - cut)
    np.testing.assert_allclose(loaded.hist, whole.hist, rtol=1e-9)
    for x, y in zip(loaded.params, whole.params, strict=True):
        np.testing.assert_allclose(x.get_value(), y.get_value(), rtol=1e-9, atol=1e-12)
    assert loaded.outcome.reason == whole.outcome.reason


def test_a_fit_loaded_on_other_data_says_so(tmp_path, regression_data):
    """A saved fit describes the posterior of its data. Loaded on a model built by the same
    code with other data (other values, or more rows), it kept its verdict ("trustworthy")
    and its draws without a word, 11 posterior sds off; it now warns. On the same data (the
    model rebuilt) it does not."""
    x, y = regression_data
    approx = pm.fit(method="gf", model=regression(x, y), random_seed=1, progressbar=False)
    path = approx.save(tmp_path / "fit.nc")
    with warnings.catch_warnings():
        warnings.simplefilter("error", pymc_gpf.FitWarning)
        pymc_gpf.load(path, model=regression(x, y))
    others = (regression(x, y + 1.0), regression(np.r_[x, x[:5]], np.r_[y, y[:5]]))
    for model in others:
        with pytest.warns(pymc_gpf.FitWarning, match="data differ from those this fit was made"):
            loaded = pymc_gpf.load(path, model=model)
        assert loaded.outcome.verdict == approx.outcome.verdict  # the saved fit's, as said


def test_zarr_and_in_memory_round_trips(tmp_path, regression_data):
    method, inf_kwargs, fit_kwargs = GPF_FIXED
    whole = _fit(regression(*regression_data), 40, method, inf_kwargs, fit_kwargs)
    part = _fit(regression(*regression_data), 20, method, inf_kwargs, fit_kwargs)
    tree = part.to_datatree()
    assert "posterior" not in tree.children and "checkpoint" in tree.children
    for source in (part.save(tmp_path / "fit.zarr"), tree):
        loaded = pymc_gpf.load(source, model=regression(*regression_data))
        loaded.refine(20)
        _assert_same_fit(loaded, whole)


def _hierarchy(y):
    log_sigma = pytensor.shared(0.0, name="log_sigma")
    with pm.Model() as model:
        w = pm.Normal("w", 0, pt.exp(log_sigma), shape=len(y))
        pm.Normal("y", w, 1.0, observed=y)
    return model, log_sigma


@pytest.mark.parametrize(
    "method,learning_rate,steps",
    [("gpf", 0.01, (40, 20)), ("gpf", "auto", (30, 15)), ("gf", "auto", (200, 100))],
)
def test_learnt_hyperparameters_are_restored(tmp_path, method, learning_rate, steps):
    """more_obj_params (type-II ML of log_sigma, as tests/test_contract.py): the loaded fit
    writes the learnt value into the new model's shared variable and continues exactly, at a
    fixed step and at the automatic one (whose θ search, pymc_gpf.hyper, is saved too, and
    for GF the random stream of the draws θ's gradient averages over)."""
    y = np.random.default_rng(4).normal(0, np.sqrt(5.0), 20)
    fits = []
    for n in steps:
        model, log_sigma = _hierarchy(y)
        fits.append(
            pm.fit(
                n,
                method=method,
                model=model,
                random_seed=6,
                inf_kwargs={"natural_mean": True},
                learning_rate=learning_rate,
                more_obj_params=[log_sigma],
                progressbar=False,
            )
        )
        fits[-1].log_sigma = log_sigma
    whole, part = fits
    path = part.save(tmp_path / "fit.nc")
    model, log_sigma = _hierarchy(y)
    loaded = pymc_gpf.load(path, model=model)
    assert log_sigma.get_value() == part.log_sigma.get_value() != 0.0
    loaded.refine(steps[0] - steps[1])
    _assert_same_fit(loaded, whole)
    assert log_sigma.get_value() == whole.log_sigma.get_value()
    trace = loaded.fit_group()["hyper_log_sigma"].values  # θ on `step`, as the fit's
    np.testing.assert_array_equal(trace, whole.fit_group()["hyper_log_sigma"].values)
    model, _ = _hierarchy(y)
    with pm.Model() as other:
        pm.Normal("w", 0, 1, shape=len(y))
    with pytest.raises(ValueError, match=r"no named shared variable\(s\) \['log_sigma'\]"):
        pymc_gpf.load(path, model=other)


def test_damaged_or_foreign_files_raise_one_error_and_never_load_a_wrong_state(
    tmp_path, regression_data
):
    """Byte flips anywhere in a saved file, a truncated file and files that are not
    checkpoints: each load raises CheckpointError or restores exactly the saved state (a
    flip in bytes the file does not use); a changed value is caught by the checksum."""
    approx = _fit(regression(*regression_data), 5, *GPF_FIXED)
    path = approx.save(tmp_path / "fit.nc")
    saved = {k: np.array(v.get_value()) for k, v in approx.inference.state_vars.items()}
    data = path.read_bytes()
    rng = np.random.default_rng(0)
    outcomes = {"error": 0, "same": 0}
    for i, position in enumerate(rng.integers(0, len(data), 60)):
        damaged = bytearray(data)
        damaged[position] ^= 1 << int(rng.integers(8))
        bad = tmp_path / f"flip{i}.nc"
        bad.write_bytes(bytes(damaged))
        try:
            loaded = pymc_gpf.load(bad, model=regression(*regression_data))
        except pymc_gpf.CheckpointError:
            outcomes["error"] += 1
            continue
        for key, var in loaded.inference.state_vars.items():
            np.testing.assert_array_equal(var.get_value(), saved[key])
        np.testing.assert_array_equal(loaded.hist, approx.hist)
        outcomes["same"] += 1
    assert outcomes["error"] > 0
    (tmp_path / "short.nc").write_bytes(data[: len(data) // 2])
    (tmp_path / "text.nc").write_text("not a checkpoint")
    approx.sample(5).to_netcdf(tmp_path / "draws.nc", engine="h5netcdf")
    changed = approx.to_datatree()
    node = changed["checkpoint"]
    node["gpf_particles"] = node["gpf_particles"] + 1e-12  # one state array changed
    for source in ["short.nc", "text.nc", "draws.nc", changed]:
        source = tmp_path / source if isinstance(source, str) else source
        with pytest.raises(pymc_gpf.CheckpointError, match=r"not a pymc-gpf checkpoint|corrupted"):
            pymc_gpf.load(source, model=regression(*regression_data))


def test_clear_errors(tmp_path, regression_model, regression_data):
    approx = _fit(regression(*regression_data), 5, *GPF_FIXED)
    path = approx.save(tmp_path / "fit.nc")
    with pm.Model() as other:
        pm.Normal("intercept", 0, 5)
        pm.Normal("slope", 0, 5)
    with pytest.raises(ValueError, match=r"coordinates \['intercept', 'slope', 'sigma_log__'\]"):
        pymc_gpf.load(path, model=other)
    with pytest.raises(pymc_gpf.CheckpointError, match=r"no .checkpoint. group.*approx\.save"):
        pymc_gpf.load(approx.sample(5), model=regression_model)
    old = approx.to_datatree()
    old["checkpoint"].attrs["format"] = 1  # written by pymc-gpf 0.1
    reads = "format 1; this version of pymc-gpf reads formats 3 and 4"
    with pytest.raises(pymc_gpf.CheckpointError, match=reads):
        pymc_gpf.load(old, model=regression_model)
    with pytest.raises(ValueError, match="Nothing to save yet: fit first"):
        pymc_gpf.GPF(4, model=regression_model).approx.save(tmp_path / "empty.nc")

    class Custom(Adam):
        pass

    custom = pymc_gpf.GPF(4, model=regression_model, random_seed=1)
    custom.fit(2, optimizer=Custom(), learning_rate=1e-3, progressbar=False)
    with pytest.raises(ValueError, match="custom optimizer"):
        custom.approx.save(tmp_path / "custom.nc")


def test_a_controller_attribute_must_be_declared_to_be_saved():
    """A checkpoint holds a controller's declared attributes only: an undeclared one is
    refused when saving, so it cannot change the format unnoticed."""
    from pymc_gpf.control import Saved

    class Counter(Saved):
        saved = ("count",)

        def __init__(self):
            self.count = 3

    counter = Counter()
    assert counter.state() == {"count": 3}
    counter.stray = 1.0
    with pytest.raises(RuntimeError, match=r"\['stray'\].*not saved"):
        counter.state()
