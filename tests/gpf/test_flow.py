"""The GPF equations against their explicit D x D definitions and App. D (notes §9 F4, F12)."""

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

from pymc_gpf.gpf import flow
from pymc_gpf.structure import Structure


def _full(d):
    return Structure("full", d, (np.arange(d),))


def _blocks(d, blocks):
    return Structure("blocks", d, tuple(np.asarray(b) for b in blocks))


STRUCTURES = {
    "full": lambda d: _full(d),
    "diagonal": lambda d: Structure("diagonal", d),
    "contiguous": lambda d: _blocks(d, [range(0, 3), range(3, d)]),
    "interleaved": lambda d: _blocks(d, [range(0, d, 2), range(1, d, 2)]),
}


def _evaluate(fn, *arrays):
    """Compile a small graph in Python mode (cheap) and evaluate it on arrays."""
    inputs = [pt.tensor(shape=a.shape, dtype=a.dtype) for a in arrays]
    f = pytensor.function(inputs, fn(*inputs), mode="FAST_COMPILE", on_unused_input="ignore")
    return f(*arrays)


def _cloud(n, d, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)) @ rng.normal(size=(d, d))
    return x, rng.normal(size=(n, d))


@pytest.mark.parametrize("kind", STRUCTURES)
@pytest.mark.parametrize("n", [4, 7, 12])  # N < D, N = D + 1, N > D + 1 (D = 6)
def test_linear_flow_is_psi_minus_identity(kind, n):
    d = 6
    structure = STRUCTURES[kind](d)
    x, g = _cloud(n, d)
    z = x - x.mean(0)
    psi = g.T @ z / n * structure.mask()  # paper: psi = 1/N sum_i g_i (x_i - m)^T, masked
    expected = z @ (psi - np.eye(d)).T
    got = _evaluate(lambda zz, gg: flow.linear_flow(zz, gg, structure), z, g)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", STRUCTURES)
@pytest.mark.parametrize("natural", [False, True])
def test_mean_shift(kind, natural):
    n, d = 5, 6
    structure = STRUCTURES[kind](d)
    x, g = _cloud(n, d, seed=1)
    z = x - x.mean(0)
    cov = z.T @ z / n * structure.mask()
    expected = cov @ g.mean(0) if natural else g.mean(0)
    got = _evaluate(lambda zz, gg: flow.mean_shift(zz, gg, structure, natural), z, g)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "n,d,kind",
    [
        (n, d, kind)
        for n, d in [(4, 10), (6, 5), (11, 10), (12, 5), (9, 3)]
        for kind in STRUCTURES
        if d >= 4 or kind not in ("contiguous", "interleaved")  # two blocks need d >= 4
    ],
)
def test_log_pseudo_det_is_sum_of_log_positive_eigenvalues(n, d, kind):
    """App. D / F4: log|Z Z^T/N + J/N| for N <= D + 1, log|C| beyond (switch on N vs D+1)."""
    structure = STRUCTURES[kind](d)
    x, _ = _cloud(n, d, seed=2)
    z = x - x.mean(0)
    expected = 0.0
    blocks = [[i] for i in range(d)] if structure.diagonal else structure.blocks
    for b in blocks:
        zb = z[:, b]
        eig = np.linalg.eigvalsh(zb.T @ zb / n)
        rank = min(n - 1, len(b))
        expected += np.sum(np.log(np.sort(eig)[::-1][:rank]))
    got = _evaluate(lambda zz: flow.log_pseudo_det(zz, structure), z)
    np.testing.assert_allclose(got, expected, rtol=1e-10)


def test_gram_identity_fails_beyond_d_plus_1():
    """F4's warning: for N > D + 1 the N x N identity is singular, hence the switch."""
    x, _ = _cloud(9, 3, seed=3)
    z = x - x.mean(0)
    r = z @ z.T / 9 + 1 / 9
    assert np.linalg.matrix_rank(r) < 9


@pytest.mark.parametrize("kind", ["full", "diagonal", "interleaved"])
@pytest.mark.parametrize("n", [4, 12])
def test_sampling_covariance_is_c(kind, n):
    """F12: draws m + Z^T xi / sqrt(N) have covariance C (block-diagonal per structure);
    with N <= D they lie in the particles' affine span."""
    d = 6
    structure = STRUCTURES[kind](d)
    x, _ = _cloud(n, d, seed=4)
    m = x.mean(0)
    z = x - m
    draws = flow.gaussian_q(x, structure).sample(400_000, np.random.default_rng(5))
    cov = flow.covariance(z, structure)
    emp = np.cov(draws.T)
    scale = np.sqrt(np.outer(np.diag(cov), np.diag(cov)))
    # sd of an empirical covariance entry is <= sqrt(2/S) * scale; allow 5 of them
    np.testing.assert_array_less(np.abs(emp - cov), 5 * np.sqrt(2 / 400_000) * scale + 1e-12)
    np.testing.assert_allclose(draws.mean(0), m, atol=5 * np.sqrt(np.diag(cov).max() / 400_000))
    if kind == "full" and n <= d:
        coef, *_ = np.linalg.lstsq(z.T, (draws - m).T, rcond=None)
        assert np.abs(z.T @ coef - (draws - m).T).max() < 1e-9
