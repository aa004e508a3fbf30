"""A method's state held in shared variables named after its fields (``pymc_gpf.stepgraph``)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from pymc_gpf.stepgraph import assign, share, updates, values


class Toy(NamedTuple):
    particles: np.ndarray
    step_size: np.ndarray


def test_a_state_is_shared_by_field_and_updated_from_the_next_state():
    state = Toy(np.zeros((4, 2)), np.ones(()))
    shared = share(state, "toy", lambda name, v: (None, *v.shape[1:]) if v.ndim else ())
    assert [v.name for v in shared] == ["toy_particles", "toy_step_size"]
    assert shared.particles.type.shape == (None, 2)  # the number of particles may change
    new = Toy(shared.particles + 1.0, shared.step_size * 2.0)
    pairs = updates(shared, new)
    assert list(pairs) == list(shared)
    assign(shared, Toy(np.full((3, 2), 5.0), np.asarray(0.5)))
    got = values(shared)
    np.testing.assert_array_equal(got.particles, np.full((3, 2), 5.0))
    assert got.step_size == 0.5
