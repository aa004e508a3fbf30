"""Fits with the particles split across 4 JAX host devices.

XLA fixes the number of host devices when JAX starts, so these run in a process started with
``XLA_FLAGS=--xla_force_host_platform_device_count=4``
(``tests/test_jax.py::test_sharded_fits_on_four_host_devices`` starts it); elsewhere they are
skipped. A sharded fit must give the unsharded one's numbers to round-off: only the order of
the sums across devices differs, and JAX draws the same random numbers however an array is
split (``jax_threefry_partitionable``).
"""

from __future__ import annotations

from functools import partial

import numpy as np
import pymc as pm
import pytest

from conftest import regression
from methods import names

jax = pytest.importorskip("jax")

pytestmark = pytest.mark.skipif(
    len(jax.devices()) < 4, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=4"
)

# every method at its defaults. GPF: 20 particles, 5 per device; GF: draws per step; WVGD:
# 5 particles x 50 draws = 250 points, not a multiple of 4 (XLA pads the last device), its
# five cells asked for (at its defaults its Gaussian fit, GF's steps, may be all it takes);
# the Langevin ensemble (its default kind): 20 chains
CASES = [(method, {"n_particles": 5} if method == "wvgd" else {}) for method in names()]


def _fit(data, method, options, devices, n=None, callbacks=()):
    # the fit's numbers are compared, not its verdict: no importance check (check_draws=0)
    with regression(*data):
        return pm.fit(n, method=method, random_seed=3, progressbar=False, backend="jax",
                      inf_kwargs=options | {"devices": devices}, callbacks=callbacks,
                      check_draws=0)  # fmt: skip


def _devices_holding_particles(approx, hist, i, seen: list) -> None:
    """How many devices hold a share of the particles (not a copy of all of them)."""
    particles = approx.shared_particles.get_value(borrow=True)
    if hasattr(particles, "sharding"):  # as the step left them (a controller may reset them)
        shares = {shard.device: shard.data.shape[0] for shard in particles.addressable_shards}
        seen.append(sum(0 < rows < len(particles) for rows in shares.values()))


@pytest.mark.filterwarnings("ignore:ENSEMBLE did not converge")
@pytest.mark.parametrize(("method", "options"), CASES, ids=[c[0] for c in CASES])
def test_a_sharded_fit_equals_the_unsharded_one(regression_data, method, options):
    # the ensemble's burn-in and first draws; WVGD's first 100 steps (its schedule halves
    # the step in them; at its defaults it takes 30 s more here)
    n = {"ensemble": 300, "wvgd": 100}.get(method)
    seen: list[int] = []
    # GF's state is a mean and a factor (its draws are split): nothing to look at
    watch = [] if method == "gf" else [partial(_devices_holding_particles, seen=seen)]
    whole = _fit(regression_data, method, options, None, n)
    split = _fit(regression_data, method, options, 4, n, watch)
    assert split.inference.settings()["devices"] == 4
    # between steps the particles stay split, a share on each device (5 WVGD particles
    # cannot be split in 4: XLA keeps them whole; its 250 draws are split inside the step)
    assert method == "gf" or (seen and set(seen) == ({0} if method == "wvgd" else {4})), seen
    assert (split.outcome.reason, len(split.hist)) == (whole.outcome.reason, len(whole.hist))
    np.testing.assert_allclose(split.hist, whole.hist, rtol=1e-10, atol=1e-10)
    for a, b in zip(split.params, whole.params, strict=True):
        np.testing.assert_allclose(np.asarray(a.get_value()), np.asarray(b.get_value()),
                                   rtol=1e-9, atol=1e-12)  # fmt: skip


def test_sharding_needs_jax_and_as_many_devices(regression_data):
    with pytest.raises(ValueError, match="backend='jax'"):
        with regression(*regression_data):
            pm.fit(5, method="gf", backend="c", inf_kwargs={"devices": 4}, progressbar=False)
    with pytest.raises(ValueError, match="JAX sees 4 device"):
        _fit(regression_data, "gf", {}, 8, 5)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()).reshape(2, 2), ("hosts", "cores"))
    assert _fit(regression_data, "gf", {}, mesh, 5).inference.settings()["devices"] == 4


@pytest.mark.filterwarnings("ignore:GF did not converge")
def test_a_saved_split_fit_continues_on_the_devices_given_to_load(regression_data, tmp_path):
    import pymc_gpf

    whole = _fit(regression_data, "gf", {}, 4, 40)
    part = _fit(regression_data, "gf", {}, 4, 20)
    loaded = pymc_gpf.load(part.save(tmp_path / "fit.nc"), regression(*regression_data), 4)
    assert loaded.inference.settings()["devices"] == 4
    loaded.refine(20, progressbar=False)
    np.testing.assert_array_equal(loaded.hist, whole.hist)
    for a, b in zip(loaded.params, whole.params, strict=True):
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()))
