"""GPF's step for a fit: the automatic step's state held in shared variables between
steps (:class:`AutoStep`: the method restores, restarts and reads it), and :func:`build`,
which applies the pure step functions of :mod:`pymc_gpf.gpf.step` to the fit's state."""

from __future__ import annotations

import numpy as np

from pytensor.graph.basic import Variable

from pymc_gpf.gpf.step import (
    AutoState,
    GPFStatic,
    block_ranks,
    fixed_step,
    init_fixed,
    init_natural,
    natural_step,
)
from pymc_gpf.options import FitOptions, resolve_natural_mean
from pymc_gpf.stepgraph import StepGraph, assign, share, share_init
from pymc_gpf.structure import Structure
from pymc_gpf.target import BatchedTarget

__all__ = ["AutoStep", "build"]


class AutoStep:
    """The automatic step's states held in shared variables named ``gpf_<field>`` (the
    number of particles may change between stages: that dimension stays dynamic)."""

    def __init__(self, particles, structure: Structure, rng: np.random.Generator | None):
        self.particles, self.structure, self.rng = particles, structure, rng
        value = particles.get_value()
        # the graph's settings: the directions this cloud spans, fixed for the compiled step
        # (a restarted cloud keeps them, as the step it runs on does)
        ranks = tuple(block_ranks(value, structure))
        self.static = GPFStatic(structure, ranks=ranks)
        init = init_natural(value, self.static, value.dtype, rng)
        d = init.natural.shift.shape[0]

        def shape(name, value):
            if name == "validation_weights":
                return (None, None)
            return ((None, d), (d,), ())[2 - value.ndim]

        self.natural = share(init.natural, "gpf", shape)
        self.search = None if init.search is None else share(init.search, "gpf", shape)

    def graph(self, rates: tuple[Variable, Variable], target: BatchedTarget) -> StepGraph:
        """The step from the current states (see :func:`natural_step`)."""
        state = AutoState(self.particles, self.natural, self.search)
        new, info = natural_step(state, None, target, rates, self.static)
        return StepGraph(state, new, info)

    def finish(self, restore_best: bool) -> float:
        """The free energy of the state the fit ends on; with ``restore_best`` the particles
        go back to where the independent cloud's free energy was lowest."""
        if not restore_best:
            return float(self.natural.free_energy.get_value())
        self.particles.set_value(self.search.best_particles.get_value())
        best = float(self.search.best_free_energy.get_value())
        self.reset()
        return best

    def restart(self, particles: np.ndarray) -> None:
        """Go on from new particles (e.g. more of them, same Gaussian)."""
        self.particles.set_value(particles)
        self.reset()

    def reset(self) -> None:
        """Nothing evaluated at the current particles (after they were set from outside)."""
        value = self.particles.get_value()
        init = init_natural(value, self.static, value.dtype, self.rng)
        assign(self.natural, init.natural)
        if init.search is not None:
            assign(self.search, init.search)


def build(
    particles,
    target: BatchedTarget,
    structure: Structure,
    natural_mean: bool | None,
    options: FitOptions,
    rates: tuple[Variable, Variable],
    rng: np.random.Generator | None,
) -> tuple[StepGraph, AutoStep | None]:
    """The step for the fit keywords ``options``: Algorithm 2 with a fixed ``learning_rate``
    (the mean step natural if ``natural_mean``), else the automatic step, whose states it
    returns too (with ``rng`` the line search's)."""
    if not options.auto:
        natural = resolve_natural_mean(natural_mean, options)
        shape = particles.get_value(borrow=True).shape
        transforms = (options.chain(), options.chain(particle_axes=(0,)))
        static = GPFStatic(
            structure,
            shape=shape,
            natural_mean=natural,
            transforms=transforms,
            more_obj_params=options.more_obj_params,
        )
        init = init_fixed(particles.get_value(borrow=True), static, particles.dtype)
        names = {
            "shift_moments": ("gpf_shift", shape[1:]),
            "linear_moments": ("gpf_linear", shape),
        }
        state = share_init(init, particles, names)
        new, info = fixed_step(state, None, target, rates, static)
        return StepGraph(state, new, info), None
    resolve_natural_mean(natural_mean, options)  # refuses natural_mean=False here
    auto = AutoStep(particles, structure, rng)
    return auto.graph(rates, target), auto
