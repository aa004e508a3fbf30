"""GPF's theorems on Gaussian targets, through pm.fit (notes §9 F1-F3, F5, F8, F10)."""

import numpy as np
import pymc as pm
import pytest

from conftest import condition_spectrum, gaussian_target, moments, mvnormal_model

import pymc_gpf


def _fit(model, n, **kwargs):
    inf_kwargs = {
        k: kwargs.pop(k)
        for k in list(kwargs)
        if k not in ("learning_rate", "callbacks", "optimizer")
    }
    return pm.fit(
        n,
        method="gpf",
        model=model,
        random_seed=kwargs.pop("seed", 1),
        inf_kwargs=inf_kwargs,
        progressbar=False,
        **kwargs,
    )


@pytest.mark.parametrize("kappa", [1, 10, 100])
@pytest.mark.parametrize("natural_mean", [False, True])
def test_theorem1_exact_with_d_plus_1_particles(kappa, natural_mean):
    """F1: D + 1 particles recover mean and covariance of a Gaussian exactly."""
    d = 20
    mu, cov = gaussian_target(d, condition_spectrum(d, kappa), seed=kappa)
    approx = _fit(
        mvnormal_model(mu, cov),
        30_000,
        n_particles=d + 1,
        natural_mean=natural_mean,
        learning_rate=0.01,
    )
    m, c = moments(approx.particles)
    assert np.linalg.norm(m - mu) < 1e-8
    assert np.linalg.norm(c - cov) < 1e-8
    # and the free energy is -log Z = 0 for the normalised MvNormal (F3)
    assert abs(approx.hist[-1]) < 1e-8


def test_theorem2_rates():
    """F5 + Thm 2: tr(C_k^-1 - Lambda) decays like exp(-2 eta k); the mean step is exactly
    (I - eta Lambda)^k in discrete time."""
    d, eta = 10, 1e-3
    mu, cov = gaussian_target(d, condition_spectrum(d, 100), seed=5)
    prec = np.linalg.inv(cov)
    model = mvnormal_model(mu, cov)
    gpf = pymc_gpf.GPF(d + 1, model=model, random_seed=3)
    m0, c0 = moments(gpf.approx.particles)
    checkpoints = {500: None, 1000: None, 2000: None, 3000: None}

    def record(approx, hist, i):
        if i in checkpoints:
            checkpoints[i] = approx.particles

    pm.fit(3000, method=gpf, learning_rate=eta, callbacks=[record], progressbar=False)
    excess0 = np.trace(np.linalg.inv(c0) - prec)
    for k, particles in checkpoints.items():
        m, c = moments(particles)
        ratio = np.trace(np.linalg.inv(c) - prec) / excess0
        assert ratio == pytest.approx(np.exp(-2 * eta * k), rel=0.02), k
        expected_mean = np.linalg.matrix_power(np.eye(d) - eta * prec, k) @ (m0 - mu)
        np.testing.assert_allclose(m - mu, expected_mean, atol=1e-10)


@pytest.mark.parametrize("n", [2, 5, 10, 15])
def test_theorem3_low_rank(n):
    """F2 + Thm 3: with N < D + 1 the N - 1 non-zero eigenvalues of C are the largest of
    Sigma, the mean is exact, and F~ settles at its closed-form minimum."""
    d = 20
    spectrum = 10 ** np.linspace(-1, 1, d)
    mu, cov = gaussian_target(d, spectrum, seed=7)
    approx = _fit(mvnormal_model(mu, cov), 40_000, n_particles=n, learning_rate=0.005)
    m, c = moments(approx.particles)
    eig = np.sort(np.linalg.eigvalsh(c))[::-1][: n - 1]
    top = np.sort(spectrum)[::-1][: n - 1]
    np.testing.assert_allclose(eig, top, rtol=1e-8)
    assert np.linalg.norm(m - mu) < 1e-8
    smallest = np.sort(spectrum)[: d - n + 1]
    assert abs(np.trace(c - cov)) == pytest.approx(smallest.sum(), rel=1e-8)
    # F3: F~ never increases; at the optimum F~ = 1/2 sum(log smallest) - (D - N + 1)/2
    assert np.max(np.diff(approx.hist)) <= 1e-12 * np.abs(approx.hist).max()
    assert approx.hist[-1] == pytest.approx(
        0.5 * np.log(smallest).sum() - (d - n + 1) / 2, abs=1e-8
    )


def test_free_energy_with_more_than_d_plus_1_particles():
    """F3, N > D + 1 (log|C| branch): F never increases and ends at -log Z = 0."""
    d = 5
    mu, cov = gaussian_target(d, condition_spectrum(d, 100), seed=11)
    approx = _fit(mvnormal_model(mu, cov), 20_000, n_particles=12, learning_rate=0.005)
    assert np.max(np.diff(approx.hist)) <= 1e-12 * np.abs(approx.hist).max()
    assert abs(approx.hist[-1]) < 1e-10


def test_mean_field_fixed_point():
    """F10: diagonal GPF from a cloud with orthogonal centred columns reaches the MF-VGA
    optimum m = mu, C = diag(1 / Lambda_dd); from a generic cloud each coordinate is only
    rescaled, so the initial correlation matrix is preserved exactly."""
    d, n = 6, 12
    mu, cov = gaussian_target(d, 10 ** np.linspace(-1, 0, d), seed=13)
    prec = np.linalg.inv(cov)
    model = mvnormal_model(mu, cov)
    rng = np.random.default_rng(0)
    raw = rng.normal(size=(n, d))
    q, _ = np.linalg.qr(raw - raw.mean(0))
    orthogonal = 1.0 + np.sqrt(n) * q
    generic = 1.0 + rng.normal(size=(n, d))
    for start, exact in ((orthogonal, True), (generic, False)):
        approx = _fit(
            model, 20_000, structure="diagonal", initial_particles=start, learning_rate=0.01
        )
        m, c = moments(approx.particles)
        np.testing.assert_allclose(m, mu, atol=1e-10)
        if exact:
            np.testing.assert_allclose(c, np.diag(1 / np.diag(prec)), atol=1e-10)
        else:
            np.testing.assert_allclose(
                np.corrcoef(approx.particles.T), np.corrcoef(start.T), atol=1e-10
            )
            assert np.abs(np.diag(c) - 1 / np.diag(prec)).max() > 1e-3


def _banana():
    with pm.Model() as model:
        x = pm.Flat("x", shape=2)
        pm.Potential("banana", -0.5 * (0.01 * x[0] ** 2 + 0.1 * (x[1] + 0.1 * x[0] ** 2 - 10) ** 2))
    return model


def _affine_residual(x0, xt):
    design = np.hstack([x0, np.ones((len(x0), 1))])
    coef, *_ = np.linalg.lstsq(design, xt, rcond=None)
    return np.linalg.norm(design @ coef - xt) / np.linalg.norm(xt)


@pytest.mark.parametrize(
    "optimizer,learning_rate,affine",
    [
        ("sgd", 0.05, True),
        (pymc_gpf.optimizers.RMSProp(decay=0.9), 0.05, True),
        (pymc_gpf.optimizers.Adam(dimension_wise=True), 0.1, True),
        (pymc_gpf.optimizers.Adam(dimension_wise=False), 0.1, False),
    ],
)
def test_affine_invariance_of_the_cloud(optimizer, learning_rate, affine):
    """F8: every step is one affine map, so X_T is an affine image of X_0 with descent and
    dimension-wise optimisers; elementwise Adam breaks it (banana, N = 50)."""
    gpf = pymc_gpf.GPF(50, model=_banana(), random_seed=2)
    x0 = gpf.approx.particles
    pm.fit(2000, method=gpf, learning_rate=learning_rate, optimizer=optimizer, progressbar=False)
    residual = _affine_residual(x0, gpf.approx.particles)
    if affine:
        assert residual < 1e-10
    else:
        assert residual > 0.05
