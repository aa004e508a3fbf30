"""``structure=`` parsing: blocks of flat coordinates from variable names, and the errors a
user sees for a wrong one."""

from __future__ import annotations

import numpy as np
import pymc as pm
import pytest

from pymc_gpf.structure import Structure, parse_structure
from pymc_gpf.target import BatchedTarget


@pytest.fixture(scope="module")
def target():
    with pm.Model() as model:
        pm.Normal("a", shape=2)
        pm.HalfNormal("b")
        pm.Normal("c", shape=3)
    return BatchedTarget(model)


def _coords(target, name):
    c = target.find(name)
    return list(range(c.start, c.stop))


def test_named_strings(target):
    full = parse_structure("full", target)
    assert full.kind == "full" and [list(b) for b in full.blocks] == [list(range(6))]
    assert parse_structure("mean_field", target) == Structure("diagonal", 6)
    per_variable = parse_structure("variables", target)
    assert per_variable.block_sizes() == [2, 1, 3]


def test_groups_of_names_and_the_rest_as_singletons(target):
    s = parse_structure([["c", "a"]], target)
    assert s.kind == "blocks"
    assert [list(b) for b in s.blocks] == [
        sorted(_coords(target, "a") + _coords(target, "c")),
        _coords(target, "b"),
    ]
    mask = s.mask()
    assert mask.sum() == 5**2 + 1 and np.array_equal(mask, mask.T)


@pytest.mark.parametrize(
    ("structure", "error", "match"),
    [
        ("banded", ValueError, "Unknown structure 'banded'"),
        ([["a"], ["zz"]], ValueError, "'zz', which is not a free variable"),
        ([["a", "b"], ["a"]], ValueError, "'a' in more than one block"),
        ([[]], ValueError, "empty block"),
        (["a", "b"], TypeError, "list of lists"),
    ],
)
def test_wrong_structures_say_what_to_do(target, structure, error, match):
    with pytest.raises(error, match=match):
        parse_structure(structure, target)
