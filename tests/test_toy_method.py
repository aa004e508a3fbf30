"""A new method plugs in with one module: this file. A toy "MAP ensemble" (particles
climbing the log-density by plain gradient steps, q the Gaussian of their spread) gets
``pm.fit(method="toy")``, the fit loop, the ArviZ DataTree and save/load from the engine,
the registry and the persistence layer, with nothing else to write."""

from __future__ import annotations

import inspect

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import pymc as pm
import pytensor.tensor as pt
import pytest

import pymc_gpf

from pymc_gpf.approximation import ParticleCloud
from pymc_gpf.config import MethodConfig
from pymc_gpf.engine import FlowInference
from pymc_gpf.protocols import Initialised
from pymc_gpf.start import initial_cloud
from pymc_gpf.stepgraph import Info, StepGraph


@dataclass(frozen=True)
class ToyConfig(MethodConfig):
    n_particles: int = 4
    init_scale: float = 0.5
    init: str = "initial_point"


class ToyState(NamedTuple):
    particles: pt.TensorVariable


class Toy(FlowInference):
    """Gradient ascent of ``log p`` by every particle: ``x <- x + eta grad log p(x)``."""

    name, Config = "toy", ToyConfig

    def _initialise(self) -> Initialised:
        options = self.config.options()
        cloud = initial_cloud(self.target, self._start, self._init_rng, **options)
        return Initialised(ParticleCloud(self, cloud))

    def _build_step(self, options) -> StepGraph:
        state = ToyState(self.approx.shared_particles)
        logp, grad, _ = self.target.logp_and_grads(state.particles)
        new = ToyState(state.particles + self.learning_rates[0] * grad)
        return StepGraph(
            state, new, Info(-pt.mean(logp), state.particles, logp, grad, new.particles)
        )


@pytest.fixture(scope="module")
def toy_registered():
    pymc_gpf.register_method("toy", Toy)
    yield
    pymc_gpf.registry.METHODS.pop("toy")


def test_a_toy_method_in_one_module_fits_samples_saves_and_continues(toy_registered, tmp_path):
    lines = sum(len(inspect.getsourcelines(c)[0]) for c in (ToyConfig, ToyState, Toy))
    assert lines <= 26  # with the four blank lines between them: at most 30
    mu, sd = np.array([1.0, -2.0]), np.array([0.5, 2.0])
    with pm.Model():
        pm.Normal("x", mu, sd)
        approx = pm.fit(
            60, method="toy", learning_rate=0.2, random_seed=3, progressbar=False,
            backend="quick_c",
        )  # fmt: skip
        # eta = 0.2 contracts the distance to the mode by 1 - 0.2 / sd^2 per step: 60 steps
        # take the slow coordinate (sd 2, factor 0.95) from ~1 to ~0.05
        particles = approx.shared_particles.get_value()
        np.testing.assert_allclose(particles[:, 0], mu[0], atol=1e-10)
        assert np.abs(particles[:, 1] - mu[1]).max() < 0.1
        # the free energy is -mean log p: it ends within 0.01 of -log p at the mode
        log_mode = -np.sum(np.log(sd * np.sqrt(2 * np.pi)))
        assert np.all(np.diff(approx.hist) <= 0) and abs(approx.hist[-1] + log_mode) < 0.01
        tree = approx.sample(20, random_seed=1)
        assert tree.posterior["x"].shape == (1, 20, 2) and "toy" in tree.children
        approx.save(tmp_path / "toy.nc")
        loaded = pymc_gpf.load(tmp_path / "toy.nc")
        approx.refine(5, progressbar=False)
        loaded.refine(5, progressbar=False)
    np.testing.assert_array_equal(loaded.hist, approx.hist)
    with pm.Model(), pytest.raises(TypeError, match=r"'n_particle'\. Did you mean 'n_particles'"):
        pm.Normal("x")
        pm.fit(method="toy", inf_kwargs={"n_particle": 3})
