"""Paper Fig. 5: GPF on a 2-D banana with N ∈ {3, 5, 10, 20, 50} particles; descent against
elementwise and dimension-wise Adam; particle clouds plotted against the exact Gaussian VI
optimum."""

from __future__ import annotations

import functools

from dataclasses import dataclass

import numpy as np

from benchmarks import common
from benchmarks.common import FitRun, MethodSpec, fmt, md_table, quick_full

NAME = "banana"
TITLE = "Banana: particles and optimisers (paper Fig. 5)"

LOG_2PI = float(np.log(2 * np.pi))


@dataclass(frozen=True)
class Settings(common.Settings):
    particles: tuple[int, ...] = quick_full((50,), (3, 5, 10, 20, 50))
    steps: int = quick_full(500, 2000)
    references: bool = quick_full(False, True)  # also fit PyMC's FullRankADVI and SVGD


# --------------------------------------------------------------------- target, truth
def banana_logp(x: np.ndarray) -> np.ndarray:
    """log p(x) = −½ (0.01 x₁² + 0.1 (x₂ + 0.1 x₁² − 10)²) (unnormalised, paper §4.4)."""
    x1, x2 = x[..., 0], x[..., 1]
    return -0.5 * (0.01 * x1**2 + 0.1 * (x2 + 0.1 * x1**2 - 10) ** 2)


def banana_model():
    import pymc as pm

    with pm.Model() as model:
        x = pm.Flat("x", shape=2)
        pm.Potential("banana", -0.5 * (0.01 * x[0] ** 2 + 0.1 * (x[1] + 0.1 * x[0] ** 2 - 10) ** 2))
    return model


def _quadrature() -> tuple[np.ndarray, np.ndarray]:
    """Gauss–Hermite nodes and weights for E over N(0, I₂): exact for polynomials of degree
    ≤ 15 per coordinate, and log p is a polynomial of degree 4."""
    z, w = np.polynomial.hermite_e.hermegauss(8)
    nodes = np.stack(np.meshgrid(z, z, indexing="ij"), axis=-1).reshape(-1, 2)
    return nodes, np.outer(w, w).ravel() / w.sum() ** 2


def free_energy(mean: np.ndarray, cov: np.ndarray) -> float:
    """F(q) = −E_q log p − H(q) for q = N(mean, cov), exact (quadrature); pymc-gpf's
    convention, so F = −ELBO and F is smallest at the Gaussian VI optimum."""
    nodes, weights = _quadrature()
    factor = np.linalg.cholesky(cov)
    expected = float(weights @ banana_logp(mean + nodes @ factor.T))
    entropy = 0.5 * np.linalg.slogdet(cov)[1] + (1 + LOG_2PI)
    return -expected - entropy


@functools.cache
def gaussian_vi_optimum() -> tuple[np.ndarray, np.ndarray, float]:
    """The exact Gaussian VI optimum (m*, C*, F*): F minimised over (m, Cholesky factor)."""
    from scipy import optimize

    def objective(p):
        factor = np.array([[np.exp(p[2]), 0.0], [p[3], np.exp(p[4])]])
        return free_energy(p[:2], factor @ factor.T)

    res = optimize.minimize(objective, np.zeros(5), method="BFGS", options={"gtol": 1e-10})
    factor = np.array([[np.exp(res.x[2]), 0.0], [res.x[3], np.exp(res.x[4])]])
    return res.x[:2], factor @ factor.T, float(res.fun)


def affine_residual(before: np.ndarray, after: np.ndarray) -> float:
    """Relative least-squares residual of ``after`` ≈ [before, 1] B: 0 when the particles
    moved by one affine map (what GPF's flow and dimension-wise optimisers guarantee)."""
    design = np.hstack([before, np.ones((len(before), 1))])
    coef, *_ = np.linalg.lstsq(design, after, rcond=None)
    centred = after - after.mean(axis=0)
    return float(np.linalg.norm(design @ coef - after) / np.linalg.norm(centred))


# ------------------------------------------------------------------------- methods
def optimisers() -> dict[str, dict]:
    """The three ways to step GPF: the paper's descent (momentum 0.1 after clipping each
    update to norm 10, affine), elementwise Adam 0.1 (the paper's "twisted" run) and
    dimension-wise Adam 0.1 (App. H)."""
    from pymc_gpf.optimizers import Adam

    return {
        "descent (momentum 0.1, clip 10)": {
            "learning_rate": 0.1,
            "optimizer": "momentum",
            "clip_norm": 10.0,
        },
        "elementwise Adam 0.1": {
            "learning_rate": 0.1,
            "optimizer": Adam(dimension_wise=False),
        },
        "dimension-wise Adam 0.1": {"learning_rate": 0.1, "optimizer": "adam"},
    }


def initial_particles(n: int) -> np.ndarray:
    """N(0, I₂), the paper's; the same cloud for every optimiser at one N."""
    return np.random.default_rng(n).normal(size=(n, 2))


def fit_gpf(model, n: int, label: str, fit_kwargs: dict, steps: int) -> FitRun:
    spec = MethodSpec(label, "gpf", {"initial_particles": initial_particles(n)}, fit_kwargs)
    return common.fit_method(spec, model, steps, seed=1)


def reference_specs() -> list[MethodSpec]:
    """PyMC's FullRankADVI and SVGD (50 particles): defaults, and 10× the default rate."""
    methods = ("fullrank_advi", "svgd")
    faster = (", adagrad_window 0.01", common.pymc_optimizer("adagrad_window", 0.01))
    return common.pymc_specs(50, dict.fromkeys(methods, faster), methods)


def points(run: FitRun) -> np.ndarray:
    """GPF's final particles, SVGD's particles, 300 draws of FullRankADVI's q."""
    if run.spec.method == "gpf":
        return run.approx.particles
    if run.spec.method == "svgd":
        return run.approx.histogram.get_value()
    return common.flat_draws(run.approx, 300, 0)


# -------------------------------------------------------------------------- figures
def _ellipse(ax, mean, cov, **kwargs) -> None:
    """The 2σ ellipse of N(mean, cov)."""
    values, vectors = np.linalg.eigh(cov)
    angle = np.linspace(0, 2 * np.pi, 200)
    circle = np.stack([np.cos(angle), np.sin(angle)], axis=1) * 2 * np.sqrt(np.maximum(values, 0))
    path = mean + circle @ vectors.T
    ax.plot(path[:, 0], path[:, 1], **kwargs)


def _background(ax, optimum) -> None:
    g1, g2 = np.meshgrid(np.linspace(-25, 25, 200), np.linspace(-25, 20, 200))
    density = np.exp(banana_logp(np.stack([g1, g2], axis=-1)))
    ax.contourf(g1, g2, density, levels=12, cmap="Greys", alpha=0.6)
    _ellipse(ax, optimum[0], optimum[1], color="k", ls="--", lw=1)
    ax.set_xlim(-25, 25)
    ax.set_ylim(-25, 20)
    ax.set_aspect("equal")
    ax.grid(False)


def plot_clouds(ctx, s: Settings, fits: dict, optimum) -> str:
    plt = common.pyplot()
    names = list(optimisers())
    fig, axes = plt.subplots(
        len(names),
        len(s.particles),
        figsize=(2.6 * len(s.particles) + 0.4, 2.5 * len(names)),
        squeeze=False,
    )
    for row, name in enumerate(names):
        for col, n in enumerate(s.particles):
            ax = axes[row, col]
            _background(ax, optimum)
            fit = fits[name, n]
            if fit.failure is None:
                cloud = points(fit)
                ax.plot(cloud[:, 0], cloud[:, 1], ".", color="C0", ms=4)
                _ellipse(ax, *common.flat_moments(fit.approx), color="C3", lw=1.2)
            ax.set_title(f"N = {n}" + (" (diverged)" if fit.failure else ""), fontsize=8)
            if col == 0:
                ax.set_ylabel(name, fontsize=8)
    fig.suptitle(
        "GPF particles (dots), their N(m, C) (red, 2σ),\nexact Gaussian VI optimum (dashed)",
        fontsize=9,
    )
    path, markdown = ctx.figure("clouds")
    common.save_figure(fig, path)
    return markdown


def plot_references(ctx, references: list[FitRun], optimum) -> str:
    plt = common.pyplot()
    fig, axes = plt.subplots(1, len(references), figsize=(2.9 * len(references), 2.9))
    for ax, fit in zip(np.atleast_1d(axes), references, strict=True):
        _background(ax, optimum)
        size = 3 if fit.spec.method == "svgd" else 1.5
        cloud = points(fit)
        ax.plot(cloud[:, 0], cloud[:, 1], ".", color="C4", ms=size)
        _ellipse(ax, *common.flat_moments(fit.approx), color="C3", lw=1.2)
        ax.set_title(fit.label, fontsize=7.5)
    fig.suptitle(
        "PyMC: particles (SVGD) or 300 draws (FullRankADVI), N(m, C) (red, 2σ), "
        "Gaussian VI optimum (dashed)",
        fontsize=8,
    )
    path, markdown = ctx.figure("references")
    common.save_figure(fig, path)
    return markdown


# -------------------------------------------------------------------------- the run
def run(ctx) -> str:
    s = Settings.of(ctx.quick)
    model = banana_model()
    m_star, c_star, f_star = gaussian_vi_optimum()
    ctx.record("optimum", "exact Gaussian VI", "free_energy", f_star)
    c_norm = float(np.linalg.norm(c_star))
    fits: dict[tuple[str, int], FitRun] = {}
    rows = []
    for name, fit_kwargs in optimisers().items():
        for n in s.particles:
            fit = fit_gpf(model, n, name, fit_kwargs, s.steps)
            fits[name, n] = fit
            rows.append(record_fit(ctx, f"N={n}", name, fit, m_star, c_star, f_star, c_norm))
        print(f"  {name}: done", flush=True)
    references = []
    if s.references:
        specs = reference_specs()
        references = [common.fit_method(spec, model, 5 * s.steps, seed=1) for spec in specs]
        for fit in references:
            n = len(points(fit)) if fit.spec.method == "svgd" else "—"
            rows.append(record_fit(ctx, f"N={n}", fit.label, fit, m_star, c_star, f_star, c_norm))
    table = md_table(
        [
            "method",
            "N",
            "‖m − m*‖",
            "‖C − C*‖_F / ‖C*‖_F",
            "F(N(m, C)) − F*",
            "affine residual of the particles",
        ],
        rows,
    )
    figures = [plot_clouds(ctx, s, fits, (m_star, c_star))]
    if references:
        figures.append(plot_references(ctx, references, (m_star, c_star)))
    setup = (
        "Target p(x) ∝ exp(−½(0.01 x₁² + 0.1(x₂ + 0.1 x₁² − 10)²)) (paper §4.4), a flat prior "
        "plus a potential. The reference is the exact Gaussian VI optimum N(m*, C*) "
        f"(m* = ({fmt(m_star[0])}, {fmt(m_star[1])}), diag C* = ({fmt(c_star[0, 0])}, "
        f"{fmt(c_star[1, 1])}); the free energy F = −ELBO is computed exactly by Gauss–Hermite "
        "quadrature, log p being a polynomial, and minimised with BFGS). GPF with N ∈ "
        f"{{{', '.join(map(str, s.particles))}}} particles drawn from N(0, I₂) (the same "
        f"cloud for every optimiser), {s.steps} steps (the paper's 2000), no natural mean, "
        "with three optimisers: the paper's descent (momentum 0.1 after clipping each update "
        "to norm 10: one affine map per step), elementwise Adam 0.1 (the paper's Adam run) "
        "and dimension-wise Adam 0.1 (App. H, one scale per coordinate shared by all "
        'particles). "Affine residual": the relative least-squares residual of the final '
        "particles regressed on [initial particles, 1], 0 when the cloud moved by one affine "
        "map. F(N(m, C)) − F* ≥ 0 is how much worse the particles' Gaussian is than the "
        "optimum, as a KL divergence."
    )
    if references:
        setup += (
            f" For comparison, PyMC's FullRankADVI and SVGD (50 particles, defaults) run "
            f"{5 * s.steps} steps."
        )
    caption = "Each row: the final particles' (PyMC: q's) N(m, C) against the optimum N(m*, C*)."
    return "\n\n".join([setup, caption, table, *figures])


def record_fit(ctx, case, label, fit: FitRun, m_star, c_star, f_star, c_norm) -> list:
    if fit.failure is not None:
        ctx.record(case, label, "failure", 1.0, note=fit.failure)
        return [label + f" ({fit.failure})", case.removeprefix("N="), "—", "—", "—", "—"]
    mean, cov = common.flat_moments(fit.approx)
    affine = float("nan")
    if fit.spec.method == "gpf":
        affine = affine_residual(fit.spec.inf_kwargs["initial_particles"], fit.approx.particles)
    values = {
        "mean_error": float(np.linalg.norm(mean - m_star)),
        "relative_cov_error": float(np.linalg.norm(cov - c_star)) / c_norm,
        "excess_free_energy": free_energy(mean, cov) - f_star,
        "affine_residual": affine,
    }
    for metric, value in values.items():
        ctx.record(case, label, metric, value)
    return [label, case.removeprefix("N="), *(fmt(v) for v in values.values())]
