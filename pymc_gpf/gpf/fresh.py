"""GPF where its particles cannot reach the Gaussian optimum: fresh draws from their Gaussian.

A fixed cloud of ``N`` particles is a quadrature of the free energy, and on a non-Gaussian
posterior its fixed point misses the Gaussian optimum by an error that shrinks only as
``1/sqrt(N)``. Measured against the exact Gaussian-VI optimum (its sds): a GARCH(1,1)
(D = 4) 0.12 at N = 160 and 0.005-0.05 at N = 1280 depending on the cloud; a latent GP
Poisson regression (D = 33) 0.6 at N = 528. Doubling the cloud is no cure there. GF's flow
(:mod:`pymc_gpf.gf`) is the same natural-gradient flow with fresh draws of q every step and
Polyak averaging, whose fixed point is the optimum itself: when the particles' fixed point
fails its test on a fresh cloud and more particles would not pass it (or at the cap), GF
continues from their Gaussian, and the particles then represent its result exactly (an
antithetic cloud with its mean and covariance).
"""

from __future__ import annotations

import numpy as np

from pymc_gpf.gaussian import GaussianQ
from pymc_gpf.gf import GF, fit_inside
from pymc_gpf.options import AUTO, FitOptions

__all__ = ["fresh_draws_fit"]


def _square_factors(q: GaussianQ) -> list[np.ndarray]:
    """Per block, the ``(D_b, min(D_b, N))`` factor of q's covariance (GF's full rank when
    ``N > D_b``); mean field: the scales."""
    out = []
    for f in q.factors:
        if f.ndim == 1:
            out.append(np.abs(f))
            continue
        u, s, _ = np.linalg.svd(f, full_matrices=False)
        out.append(u * s)
    return out


def fresh_draws_fit(
    q: GaussianQ, inference, options: FitOptions, steps: int, seed: int, callbacks=()
) -> GF | None:
    """GF from ``q`` for at most ``steps`` steps (the fit keywords ``options``, no verdict of
    its own, ``callbacks`` on its steps); ``None`` where GF's factors cannot hold q (a rank
    GF would not choose)."""
    # GPF's structure as resolved: "auto" would let GF choose its own (the arrow above
    # D = 64), whose factors cannot hold the particles' q
    structure = inference.config.structure
    gf = GF(structure=inference.structure.kind if structure == AUTO else structure,
            model=inference.model, random_seed=seed)  # fmt: skip
    start = [q.mean, *_square_factors(q)]
    if [p.get_value().shape for p in gf.approx.params] != [a.shape for a in start]:
        return None
    for shared, value in zip(gf.approx.params, start, strict=True):
        shared.set_value(value.astype(shared.dtype))
    fit_inside(gf, steps, options, check_draws=0, callbacks=list(callbacks))
    return gf
