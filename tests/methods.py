"""The methods under test: one entry per name ``pm.fit(method=...)`` accepts, with what the
tests need to know about it (small settings, and which promises it makes).

Test modules parametrise over :func:`names` (all methods, or those with a capability)
instead of keeping their own lists; ``tests/test_contract.py`` checks that every registered
method (``pymc_gpf.registry.METHODS``) has an entry here, so a new method is not silently
left out of the suite.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any

import pytest

__all__ = ["METHODS_UNDER_TEST", "MethodUnderTest", "get", "names", "small_fits"]


def _frozen(mapping: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    return None if mapping is None else MappingProxyType(dict(mapping))


@dataclass(frozen=True, eq=False)
class MethodUnderTest:
    """One registered method and its capabilities (a capability is present when its value is
    neither ``None`` nor ``False``: see :func:`names`)."""

    name: str
    # a small fit at a fixed step: constructor and fit keywords (save/load, step contract)
    fixed_inf_kwargs: Mapping[str, Any]
    fixed_fit_kwargs: Mapping[str, Any]
    # a small fit at the automatic step (the default fit keywords): constructor keywords
    auto_inf_kwargs: Mapping[str, Any]
    # more_obj_params: the relative error in sigma^2 its type-II ML reaches at the defaults
    # (tests/test_contract.py), or None when it refuses them with ``type_ii_refusal``
    type_ii: float | None = None
    type_ii_refusal: str | None = None
    # runs on pm.Minibatch data at its defaults and stops by itself
    minibatch: bool = False
    # the same seed gives bit-identical states, traces and draws (every backend)
    reproducible: bool = False
    # a fixed step that overflows stops the fit with DivergenceError, keeping the last
    # finite state (the engine's guard); ``refine`` continues it with a smaller step
    divergence_error: bool = False
    # constructor keywords under which its step draws no noise, so that JAX gives the other
    # backends' numbers to round-off (None: it always draws noise inside the step)
    noise_free_kwargs: Mapping[str, Any] | None = None
    # at its defaults its step draws noise (on JAX with JAX's own generator)
    noisy: bool = False
    # q contains a Gaussian posterior: draws of a converged fit match it to Monte Carlo error
    gaussian_exact: bool = False
    # changes its number of particles during an automatic fit (between stages, not steps)
    grows: bool = False
    # its draws come in chains, one per particle: sample(draws) gives ceil(draws / N) each
    # (the others: one chain of ``draws``)
    chains: bool = False
    # tested across two hosts (jax.distributed; tests/sharded/multihost_fit.py)
    multihost: bool = False

    def __post_init__(self):
        for f in fields(self):
            if isinstance(getattr(self, f.name), Mapping):
                object.__setattr__(self, f.name, _frozen(getattr(self, f.name)))
        if (self.type_ii is None) == (self.type_ii_refusal is None):
            raise ValueError(f"{self.name}: give exactly one of type_ii and type_ii_refusal")


METHODS_UNDER_TEST: dict[str, MethodUnderTest] = {
    m.name: m
    for m in [
        MethodUnderTest(
            "gpf",
            # dimension-wise Adam: its moments are part of the state that must survive
            fixed_inf_kwargs={"n_particles": 5},
            fixed_fit_kwargs={"optimizer": "adam", "learning_rate": 0.01},
            # the line-search state, the independent cloud, the growing cloud
            auto_inf_kwargs={},
            type_ii=1e-3,  # its objective is deterministic
            minibatch=True,
            reproducible=True,
            divergence_error=True,
            noise_free_kwargs={},
            gaussian_exact=True,
            grows=True,
            multihost=True,
        ),
        MethodUnderTest(
            "gf",
            fixed_inf_kwargs={"draws_per_step": 5},  # draws: the random stream too
            fixed_fit_kwargs={"learning_rate": 1e-3},
            auto_inf_kwargs={},  # the step-size schedule, iterate averaging
            type_ii=0.03,  # stops within its Monte Carlo noise
            minibatch=True,
            reproducible=True,
            divergence_error=True,
            noisy=True,
            gaussian_exact=True,
            multihost=True,
        ),
        MethodUnderTest(
            "wvgd",
            fixed_inf_kwargs={"n_particles": 3},  # running cell weights, Adam (its default)
            fixed_fit_kwargs={"learning_rate": 0.01},
            auto_inf_kwargs={"n_particles": 3},
            type_ii=0.03,
            minibatch=True,
            reproducible=True,
            divergence_error=True,
            noisy=True,
            # a mixture of truncated local Gaussians: wider than a Gaussian posterior
            multihost=True,
        ),
        MethodUnderTest(
            "ensemble",
            # the plain Langevin scheme at a fixed eta (at 0.01 the regression's chains
            # blow up: tests/conftest.py's regression, F ~ 1e23 within 20 steps)
            fixed_inf_kwargs={"n_particles": 5},
            fixed_fit_kwargs={"learning_rate": 1e-3},
            # burn-in, eta and the preconditioner (a Gaussian fit's) set by the controller
            auto_inf_kwargs={},
            # its objective has no entropy term to descend jointly with hyperparameters
            type_ii_refusal="not available for ensembles",
            minibatch=True,  # the Langevin kinds, as SGLD
            reproducible=True,
            # its Langevin steps refuse a non-finite move themselves: no divergence to stop at
            divergence_error=False,
            noise_free_kwargs={"kind": "deep"},
            noisy=True,  # the Langevin kinds (the default)
            # unadjusted Langevin: an O(eta) bias in the covariance
            gaussian_exact=False,
            chains=True,
            multihost=False,  # not run across hosts yet (docs: "Scaling up")
        ),
    ]
}


def get(name: str) -> MethodUnderTest:
    return METHODS_UNDER_TEST[name]


def names(capability: str | None = None) -> list[str]:
    """The methods' names (in the order ``pymc_gpf`` registers them), or those having
    ``capability`` (a field of :class:`MethodUnderTest` whose value is neither ``None`` nor
    ``False``)."""
    if capability is not None and capability not in {f.name for f in fields(MethodUnderTest)}:
        raise AttributeError(f"MethodUnderTest has no capability {capability!r}")
    return [
        name
        for name, m in METHODS_UNDER_TEST.items()
        if capability is None or getattr(m, capability) not in (None, False)
    ]


def small_fits() -> list:
    """``pytest.param(name, inf_kwargs, fit_kwargs)`` of every method's small fits: at its
    fixed step (id ``name-fixed``), then at the automatic one (``name-auto``)."""
    out = []
    for kind in ("fixed", "auto"):
        for name in names():
            m = get(name)
            inf = m.fixed_inf_kwargs if kind == "fixed" else m.auto_inf_kwargs
            fit = m.fixed_fit_kwargs if kind == "fixed" else {}
            out.append(pytest.param(name, dict(inf), dict(fit), id=f"{name}-{kind}"))
    return out
