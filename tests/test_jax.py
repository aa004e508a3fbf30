"""``backend="jax"``: every method runs on PyTensor's JAX backend.

The deterministic methods (GPF, the deep ensemble) give the C/numba backends' numbers to
round-off. The others draw their noise inside the step, and PyTensor's JAX backend draws it
with JAX's own generator (seeded from the fit's NumPy one): their numbers differ from the
other backends' for the same seed, so they are checked against the closed-form posterior,
and against themselves for reproducibility.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from pathlib import Path

import numpy as np
import pymc as pm
import pytest

from conftest import log_gamma, regression
from methods import get, names

import pymc_gpf

pytest.importorskip("jax")

X = np.random.default_rng(3).normal(size=(40, 2))
Y = X @ np.array([1.0, -0.5]) + np.random.default_rng(4).normal(size=40)
PRIOR_SD, NOISE_SD = 3.0, 1.0


@pytest.fixture(scope="module")
def conjugate():
    """A linear regression with known noise: the posterior is Gaussian in closed form."""
    with pm.Model() as model:
        w = pm.Normal("w", 0, PRIOR_SD, shape=2)
        pm.Normal("y", X @ w, NOISE_SD, observed=Y)
    precision = X.T @ X / NOISE_SD**2 + np.eye(2) / PRIOR_SD**2
    covariance = np.linalg.inv(precision)
    return model, covariance @ X.T @ Y / NOISE_SD**2, np.sqrt(np.diag(covariance))


@pytest.mark.filterwarnings("ignore:GPF did not converge")
@pytest.mark.parametrize("method", names("noise_free_kwargs"))
def test_deterministic_methods_give_the_default_backends_numbers(conjugate, method):
    """Same seed, same steps: trace and particles equal to round-off (the methods whose step
    draws no noise: GPF, the deep ensemble). GPF on log x, x ~ Gamma(2, 1), grows its
    cloud from 20 to 40 particles, so its JAX step is compiled for two shapes; at tol 0.03,
    where 40 particles reach the Gaussian optimum (at the default 0.02 they do not, and GF's
    flow continues with draws of q, whose numbers are each backend's own)."""
    options = dict(get(method).noise_free_kwargs)
    model = log_gamma(2.0) if get(method).grows else conjugate[0]
    fits = {}
    for backend in (None, "jax"):
        with model:
            fits[backend] = pm.fit(method=method, inf_kwargs=options, random_seed=2,
                                   progressbar=False, backend=backend, tol=0.03)  # fmt: skip
    default, jax = fits[None], fits["jax"]
    assert jax.outcome.reason == default.outcome.reason
    assert len(jax.hist) == len(default.hist) and len(jax.particles) == len(default.particles)
    np.testing.assert_allclose(jax.hist, default.hist, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(jax.particles, default.particles, rtol=1e-7, atol=1e-9)
    if get(method).grows:
        assert len(default.particles) > 20  # the cloud grew: more than one compiled shape


# the methods' own accuracy in the posterior sds on this target, at their defaults
SD_TOLERANCE = {"gf": 0.15, "wvgd": 0.3, "ensemble": 0.15}


@pytest.mark.parametrize(("method", "tolerance"), [(m, SD_TOLERANCE[m]) for m in names("noisy")])
def test_stochastic_methods_on_jax_fit_the_closed_form_posterior(conjugate, method, tolerance):
    """At the defaults on JAX: converged, means within 0.2 posterior sd and sds within
    ``tolerance`` (the methods' own accuracy on this target: GF and the Langevin ensemble
    are unbiased here up to Monte Carlo error, WVGD's truncated local Gaussians are wider)."""
    model, mean, sd = conjugate
    with model:
        approx = pm.fit(method=method, random_seed=1, progressbar=False, backend="jax")
    assert approx.outcome.converged, approx.outcome.message
    draws = approx.sample(4000, random_seed=0, return_inferencedata=False)["w"]
    draws = draws.reshape(-1, 2)
    np.testing.assert_array_less(np.abs(draws.mean(0) - mean) / sd, 0.2)
    np.testing.assert_array_less(np.abs(draws.std(0) / sd - 1), tolerance)


def test_the_same_seed_gives_the_same_numbers_on_jax(conjugate):
    model, _, _ = conjugate
    traces = []
    for _ in range(2):
        with model:
            approx = pm.fit(80, method="ensemble", random_seed=5, progressbar=False,
                            backend="jax")  # fmt: skip
        traces.append(approx.hist)
    np.testing.assert_array_equal(traces[0], traces[1])


def test_gpf_on_jax_gives_its_verdict_where_the_prior_has_no_draws():
    """The verdict's mode search starts half its points around the initial point where the
    prior has nothing to draw (a ``Flat`` variable), written into an array made from q: on
    JAX, GPF's particles are a JAX array in their shared variable, and a fit of the
    benchmarks' flat-prior Gaussian once ended in a TypeError after its last step."""
    sds = np.array([1.0, 2.0])
    with pm.Model() as model:
        x = pm.Flat("x", shape=2)
        pm.Potential("gaussian", -0.5 * pm.math.sum(((x - 1.0) / sds) ** 2))
    approx = pm.fit(method="gpf", model=model, backend="jax", random_seed=1, progressbar=False)
    assert type(approx.particles) is np.ndarray and approx.particles.flags.writeable
    assert approx.outcome.verdict == "trustworthy"
    q = approx.gaussian()
    np.testing.assert_allclose(q.mean, [1.0, 1.0], atol=0.02 * sds.max())
    np.testing.assert_allclose(np.sqrt(q.marginal_variances()), sds, rtol=0.02)


@pytest.mark.filterwarnings("ignore:ENSEMBLE did not converge")
@pytest.mark.parametrize("method", names("noisy"))
def test_a_saved_jax_fit_continues_exactly(conjugate, tmp_path, method):
    """The noise stream continues across compiled functions and a save: PyTensor's JAX
    linker draws from a copy of the fit's generator, which is kept in step with it."""
    model = conjugate[0]
    with model:
        whole = pm.fit(60, method=method, random_seed=4, progressbar=False, backend="jax")
        part = pm.fit(30, method=method, random_seed=4, progressbar=False, backend="jax")
    loaded = pymc_gpf.load(part.save(tmp_path / "fit.nc"), model=model)
    loaded.refine(30, progressbar=False)
    np.testing.assert_array_equal(loaded.hist, whole.hist)
    for a, b in zip(loaded.params, whole.params, strict=True):
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()))


def test_sharded_fits_on_four_host_devices():
    """``tests/sharded`` in a process with 4 host devices (XLA fixes them at start-up)."""
    tests = Path(__file__).parent
    env = os.environ | {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W",
         "ignore::UserWarning", str(tests / "sharded")],
        env=env, cwd=tests.parent, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "skipped" not in run.stdout and "6 passed" in run.stdout, run.stdout[-2000:]


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


# the step caps of tests/sharded/multihost_fit.py
STEPS = {"wvgd": 100}


def test_a_fit_across_two_hosts_equals_the_unsharded_one(regression_data, tmp_path):
    """Two processes joined by ``jax.distributed`` (2 CPU devices each) split the particles
    over all 4 devices: each host reads whole results, which equal a one-device fit's to
    round-off."""
    script = Path(__file__).parent / "sharded" / "multihost_fit.py"
    data = json.dumps({"x": regression_data[0].tolist(), "y": regression_data[1].tolist()})
    port = str(_free_port())
    env = os.environ | {"PYTHONWARNINGS": "ignore"}
    logs = [(tmp_path / f"host{i}.out", tmp_path / f"host{i}.err") for i in range(2)]
    hosts = []
    for i, (out, err) in enumerate(logs):
        with open(out, "w") as stdout, open(err, "w") as stderr:
            command = [sys.executable, str(script), str(i), port, data]
            hosts.append(subprocess.Popen(command, env=env, stdout=stdout, stderr=stderr))
    for host, (_, err) in zip(hosts, logs, strict=True):
        assert host.wait(timeout=900) == 0, err.read_text()[-3000:]
    split = json.loads(logs[0][0].read_text().strip().splitlines()[-1])
    assert sorted(split) == sorted(names("multihost"))
    for method in names("multihost"):
        with regression(*regression_data):
            whole = pm.fit(STEPS.get(method), method=method, random_seed=3,
                           progressbar=False, backend="jax", check_draws=0)  # fmt: skip
        assert split[method]["devices"] == 4
        np.testing.assert_allclose(split[method]["hist"], whole.hist, rtol=1e-10, atol=1e-10)
        for a, b in zip(split[method]["params"], whole.params, strict=True):
            np.testing.assert_allclose(a, np.asarray(b.get_value()), rtol=1e-9, atol=1e-12)


def test_devices_beyond_what_jax_sees_is_a_clear_error(conjugate):
    import jax

    with pytest.raises(ValueError, match="xla_force_host_platform_device_count"):
        with conjugate[0]:
            pm.fit(5, method="gf", inf_kwargs={"devices": len(jax.devices()) + 1})
