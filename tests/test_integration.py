"""pm.fit integration: registration, DataTree layout, callbacks, refine, seeds, backends."""

import importlib
import warnings

import numpy as np
import pymc as pm
import pymc.variational.inference as pm_inference
import pytest
import xarray as xr

from conftest import regression

import pymc_gpf

from pymc_gpf.registry import _original


@pytest.fixture(scope="module")
def fitted(regression_model):
    return pm.fit(
        3000,
        method="gpf",
        model=regression_model,
        random_seed=3,
        inf_kwargs={"n_particles": 6},
        progressbar=False,
    )


def test_importing_again_changes_nothing():
    bindings = (pm.fit, pm.variational.fit, pm_inference.fit)
    methods = dict(pymc_gpf.registry.METHODS)
    importlib.reload(pymc_gpf)
    assert (pm.fit, pm.variational.fit, pm_inference.fit) == bindings
    assert pymc_gpf.registry.METHODS == methods


def test_registration_is_idempotent_and_reversible():
    original = _original()
    wrapper = pm.fit
    assert wrapper is pm.variational.fit is pm_inference.fit
    assert wrapper is not original and wrapper.__wrapped__ is original
    pymc_gpf.register()
    assert pm.fit is wrapper  # registering again changes nothing
    pymc_gpf.unregister()
    try:
        assert pm.fit is original and pm.variational.fit is original
        assert pm_inference.fit is original
        with pytest.raises(KeyError):
            pm.fit(method="gpf", model=pm.Model())
    finally:
        pymc_gpf.register()
    assert pm.fit.__wrapped__ is original


def test_unknown_method_lists_pymc_and_ours(regression_model):
    with pytest.raises(KeyError, match=r"advi.*gpf|gpf.*advi"):
        pm.fit(10, method="nonsense", model=regression_model)


def test_other_methods_pass_through_to_pymc(regression_model):
    approx = pm.fit(20, method="advi", model=regression_model, random_seed=1, progressbar=False)
    assert isinstance(approx, pm.MeanField)
    assert len(approx.hist) == 20


def test_inf_kwargs_and_instance_path(regression_model):
    approx = pm.fit(
        0,
        method="GPF",
        model=regression_model,
        inf_kwargs={"n_particles": 7, "natural_mean": True, "init_scale": 0.5},
        progressbar=False,
    )
    assert approx.inference.resolved.n_particles == 7 and approx.inference.config.natural_mean
    assert approx.particles.shape == (7, 3)
    gpf = pymc_gpf.GPF(5, model=regression_model)
    assert isinstance(gpf, pm.variational.Inference)
    assert pm.fit(0, method=gpf, progressbar=False) is gpf.approx


def test_checks_of_q_use_the_data_it_was_fitted_to(regression_data):
    """``pm.set_data`` for predictions must not change what q is judged and reweighted
    against: diagnose and PSIS-corrected draws evaluated the model's current data (a
    truncated normal whose y moved by 0.3: WVGD's PSIS mean of mu went from -3.27 to
    -0.28, with no warning). They evaluate the data of the fit, and leave the model's."""
    model = regression(*regression_data)
    approx = pm.fit(method="wvgd", model=model, random_seed=1, progressbar=False)

    def judged():
        draws = approx.sample(2000, random_seed=2, psis=True).posterior["slope"].values
        return draws, pymc_gpf.diagnose(approx, random_seed=1).pareto_k

    before = judged()
    x_new = regression_data[0] + 1.0
    pm.set_data({"x": x_new}, model=model)
    after = judged()
    np.testing.assert_array_equal(after[0], before[0])
    assert after[1] == before[1]
    np.testing.assert_array_equal(model["x"].get_value(), x_new)


def test_random_seed_is_honoured_on_both_paths(regression_model):
    def run(method, seed):
        return pm.fit(
            50,
            method=method,
            model=regression_model,
            random_seed=seed,
            progressbar=False,
        )

    a = run("gpf", 11)
    b = run("gpf", 11)
    c = run(pymc_gpf.GPF(model=regression_model, random_seed=0), 11)
    d = run(pymc_gpf.GPF(model=regression_model, random_seed=0), 12)
    np.testing.assert_array_equal(a.particles, b.particles)
    np.testing.assert_array_equal(a.hist, b.hist)
    np.testing.assert_array_equal(a.particles, c.particles)  # PyMC would ignore the seed here
    assert not np.array_equal(c.particles, d.particles)
    draws_a = a.sample(20, random_seed=5).posterior["slope"].values
    draws_b = b.sample(20, random_seed=5).posterior["slope"].values
    np.testing.assert_array_equal(draws_a, draws_b)


def test_datatree_layout(fitted, regression_model, regression_data):
    dt = fitted.sample(400, random_seed=1)
    assert isinstance(dt, xr.DataTree)
    post = dt["posterior"]
    assert post.sizes["chain"] == 1 and post.sizes["draw"] == 400
    assert post["slope"].dims == ("chain", "draw")
    assert set(post.data_vars) == {"intercept", "slope", "sigma", "sigma2"}
    np.testing.assert_allclose(post["sigma2"], post["sigma"] ** 2)
    assert (post["sigma"] > 0).all()
    np.testing.assert_array_equal(dt["observed_data"]["y"], regression_data[1])
    np.testing.assert_array_equal(dt["constant_data"]["x"], regression_data[0])
    assert dt["observed_data"]["y"].dims == ("obs",)
    fit = dt["fit"]["free_energy"]
    assert fit.dims == ("step",) and fit.size == len(fitted.hist) < 3000  # stopped by itself
    np.testing.assert_array_equal(fit.values, fitted.hist)
    np.testing.assert_array_equal(dt["fit"]["step_size"].values, fitted.inference.step_sizes)
    attrs = dt["fit"].attrs
    assert attrs["converged"] == "True" and attrs["stop_reason"] in ("converged", "overfitting")
    assert attrs["stopped_at_step"] == len(fitted.hist) and attrs["learning_rate"] == "auto"
    gpf = dt["gpf"]
    assert gpf["sigma"].dims == ("particle",) and gpf.sizes["particle"] == 6
    unconstrained = gpf["unconstrained"].sel(coordinate="sigma_log__")
    np.testing.assert_allclose(gpf["sigma"], np.exp(unconstrained))
    assert gpf.attrs["n_particles"] == 6 and gpf.attrs["structure"] == "full"
    with_transformed = fitted.sample(10, random_seed=1, include_transformed=True)["posterior"]
    assert "sigma_log__" in with_transformed


def test_mean_std_cov_are_pytensor_expressions_of_the_particles(fitted):
    x = fitted.particles
    m, z = x.mean(0), x - x.mean(0)
    np.testing.assert_allclose(fitted.mean.eval(), m)
    np.testing.assert_allclose(fitted.std.eval(), np.sqrt((z**2).mean(0)))
    np.testing.assert_allclose(fitted.cov.eval(), z.T @ z / len(x))
    assert fitted.params[0] is fitted.shared_particles


def test_sampling_matches_the_fitted_gaussian(fitted):
    draws = fitted.sample(20_000, random_seed=2, include_transformed=True)["posterior"]
    flat = np.column_stack(
        [draws[name].values.ravel() for name in ("intercept", "slope", "sigma_log__")]
    )
    cov = fitted.cov.eval()
    np.testing.assert_allclose(flat.mean(0), fitted.mean.eval(), atol=5 * np.sqrt(cov.max() / 2e4))
    np.testing.assert_allclose(np.cov(flat.T), cov, atol=5 * np.sqrt(2 / 2e4) * cov.max())


@pytest.mark.parametrize("learning_rate", [1e-3, "auto"])
def test_refine_continues_exactly(regression_model, learning_rate):
    """Fixed step: 200 + 300 steps are the 500 steps. Automatic step: a fit cut before it
    stopped by itself and refined ends exactly where the uncut one stopped."""

    def fit(n, inference):
        return pm.fit(n, method=inference, learning_rate=learning_rate, progressbar=False)

    def gpf():
        return pymc_gpf.GPF(4, model=regression_model, random_seed=8)

    whole = fit(500, gpf())
    cut = 200 if learning_rate != "auto" else len(whole.hist) // 2
    inference = gpf()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the cut fit has not converged
        part = fit(cut, inference)
    part.refine(500 - cut, progressbar=False)
    np.testing.assert_array_equal(part.particles, whole.particles)
    np.testing.assert_array_equal(part.hist, whole.hist)
    np.testing.assert_array_equal(part.inference.step_sizes, whole.inference.step_sizes)
    assert inference.state.i == len(whole.hist)
    assert part.outcome.reason == whole.outcome.reason


def test_callbacks_tracker_convergence_stop_and_interrupt(regression_model):
    tracker = pm.variational.callbacks.Tracker(mean=lambda: 0.0)
    seen = []

    def spy(approx, hist, i):
        seen.append((i, len(hist), hist[-1]))

    approx = pm.fit(
        30,
        method="gpf",
        model=regression_model,
        callbacks=[tracker, spy],
        progressbar=False,
    )
    steps = len(approx.hist)
    assert len(tracker["mean"]) == steps
    assert [s[0] for s in seen] == list(range(1, steps + 1)) and seen[-1][2] == approx.hist[-1]

    converge = pm.variational.callbacks.CheckParametersConvergence(
        every=50, tolerance=1e-3, diff="absolute"
    )
    approx = pm.fit(
        20_000,
        method="gpf",
        model=regression_model,
        callbacks=[converge],
        learning_rate=1e-3,  # PyMC's callback stops a fixed-step fit, which runs n otherwise
        progressbar=False,
    )
    assert 100 <= len(approx.hist) < 20_000

    def stop_at_17(approx, hist, i):
        if i == 17:
            raise StopIteration("enough")

    def interrupt_at_9(approx, hist, i):
        if i == 9:
            raise KeyboardInterrupt

    # an automatic fit stopped before its convergence test passed is not converged, and
    # says so like any other such ending (a stopping callback was silent before)
    for callback, expected, why in (
        (stop_at_17, 17, "stopped by a callback. The automatic fit stops by itself"),
        (interrupt_at_9, 9, r"interrupted \(KeyboardInterrupt\)"),
    ):
        with pytest.warns(pymc_gpf.FitWarning, match=f"GPF did not converge: {why}"):
            approx = pm.fit(
                100,
                method="gpf",
                model=regression_model,
                callbacks=[callback],
                progressbar=False,
            )
        assert approx.outcome.verdict == "not converged"
        assert len(approx.hist) == expected and np.isfinite(approx.hist).all()
        assert approx.sample(5, random_seed=1)["posterior"].sizes["draw"] == 5


def test_progressbar_shows_steps_and_the_outcome(regression_model, capsys):
    """An automatic fit's line: the steps done (no percentage of the step cap), the distance
    to tol and how it ended, within 120 columns in a log; a fixed-step fit also has its bar.
    refine() follows the fit's progressbar=False."""
    approx = pm.fit(method="gpf", model=regression_model, random_seed=1)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    last = lines[-1]
    assert f"step {len(approx.hist)}" in last and "%" not in last
    assert f"(tol {pymc_gpf.options.DEFAULT_TOL:g})" in last
    assert last.rstrip().endswith("; converged")
    assert max(len(line) for line in lines) <= 120
    pm.fit(25, method="gpf", model=regression_model, learning_rate=0.01)
    assert "100%" in capsys.readouterr().out
    stochastic = pm.fit(method="wvgd", model=regression_model, random_seed=1,
                        inf_kwargs={"n_particles": 5})  # fmt: skip
    last = [line for line in capsys.readouterr().out.splitlines() if line.strip()][-1]
    assert f"step {len(stochastic.hist)}" in last and "%" not in last
    assert "plateau test on windows" in last or "averaging" in last  # where its test stands
    # at its defaults WVGD starts with its Gaussian fit (GF's line), whose q is its one cell
    one_cell = pm.fit(method="wvgd", model=regression_model, random_seed=1)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert [line.split()[1] for line in lines] == ["GF:", "WVGD:"]
    assert all(f"step {len(one_cell.hist)}" in line for line in lines)
    assert lines[1].rstrip().endswith("one cell, the Gaussian fit's q; converged")
    quiet = pm.fit(method="gpf", model=regression_model, progressbar=False, random_seed=1)
    quiet.inference.refine(5)
    assert capsys.readouterr().out == ""


def test_c_backend_gives_the_same_numbers(regression_model):
    def run(backend):
        return pm.fit(
            300,
            method="gpf",
            model=regression_model,
            random_seed=4,
            backend=backend,
            progressbar=False,
        )

    default, c = run(None), run("c")
    np.testing.assert_allclose(c.particles, default.particles, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(c.hist, default.hist, rtol=1e-9)
    assert c.sample(3, random_seed=0)["posterior"].sizes["draw"] == 3
