"""How many particles, where they start, and when the automatic ``n_particles`` doubles
(NumPy, between steps).

The automatic start is ``2 max(D, 10)`` particles in an antithetic, exactly whitened cloud
(:mod:`pymc_gpf.clouds`). When the fit would stop, a fresh cloud of the same Gaussian must
find it at a fixed point too, and an independent Monte Carlo ``-ELBO`` checks the particles'
free energy for finite-N bias; a failure restarts the fit from the same Gaussian with twice
the particles (at most 8 times the start) while the cap can be expected to pass
(:func:`cap_would_converge`), else GF's flow finishes it (:mod:`pymc_gpf.gpf.fresh`).
"""

from __future__ import annotations

import numbers
import warnings

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from pymc_gpf.checks import is_integer
from pymc_gpf.clouds import antithetic_cloud
from pymc_gpf.diagnostics import free_energy_gap
from pymc_gpf.options import AUTO
from pymc_gpf.protocols import FittedApproximation

__all__ = [
    "ParticleStages",
    "check_init_scale",
    "cloud_of",
    "default_n_particles",
    "restart_cloud",
    "start_cloud",
]

CLOUDS = ("auto", "antithetic", "random")
MAX_DEFAULT_PARTICLES = 1000
MIN_DEFAULT_PAIRS = 10
MAX_DOUBLINGS = 3  # the automatic N grows at most to 8 times its start
BIAS_DRAWS = 1000  # the most draws of the independent -ELBO estimate that checks the bias
# its first batch: on a near-Gaussian posterior it settles the answer (the pairs' log-ratios
# hardly vary), and each draw is a log-density of the whole data set
FIRST_BIAS_DRAWS = 256
BIAS_FLOOR = 0.01  # nats: a smaller significant gap is not worth more particles


def default_n_particles(ndim: int) -> int:
    """``2 max(D, 10)``: antithetic pairs spanning every direction (a cubature rule exact to
    degree 3 for every Gaussian the particles represent), at least 20 and at most 1000."""
    n = 2 * max(ndim, MIN_DEFAULT_PAIRS)
    if n > MAX_DEFAULT_PARTICLES:
        warnings.warn(
            f"The model has D = {ndim} unconstrained dimensions; the default uses "
            f"{MAX_DEFAULT_PARTICLES} particles in {MAX_DEFAULT_PARTICLES // 2} antithetic "
            f"pairs, so the fitted Gaussian has rank {MAX_DEFAULT_PARTICLES // 2} < D. Pass "
            f"inf_kwargs={{'n_particles': N}} to choose (N = {ndim + 1} with cloud='random' "
            "gives a full-rank fit).",
            UserWarning,
            stacklevel=3,
        )
        n = MAX_DEFAULT_PARTICLES
    return n


def check_init_scale(scale) -> float:
    """The spread of the starting cloud: positive, since identical particles never
    separate."""
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not scale > 0:
        raise ValueError(
            f"init_scale must be a positive number (identical particles never separate), "
            f"got {scale!r}."
        )
    if not np.isfinite(scale):
        raise ValueError(f"init_scale must be finite, got {scale!r}.")
    return float(scale)


def resolve_cloud(cloud: str, n_particles) -> str:
    """``"auto"`` is antithetic with the automatic ``n_particles``, random with a number."""
    if cloud not in CLOUDS:
        raise ValueError(f"cloud must be one of {CLOUDS}, got {cloud!r}.")
    if cloud != "auto":
        return cloud
    return "antithetic" if isinstance(n_particles, str) and n_particles == AUTO else "random"


def start_cloud(
    n_particles, cloud: str, init_scale, ndim: int, centre: Callable[[], np.ndarray],
    rng: np.random.Generator, dtype: str,
) -> np.ndarray:  # fmt: skip
    """The starting particles around ``centre()``, with spread ``init_scale``: antithetic
    pairs whose sample covariance is exactly ``init_scale^2 I`` (on a random subspace when
    ``N < 2 D``), or ``N`` independent Gaussian draws (``cloud="random"``, as the paper).
    ``n_particles="auto"`` is :func:`default_n_particles`."""
    cloud = resolve_cloud(cloud, n_particles)
    auto = isinstance(n_particles, str) and n_particles == AUTO
    n = default_n_particles(ndim) if auto else n_particles
    if not is_integer(n, 2):
        raise ValueError(
            f"n_particles must be 'auto' or an integer >= 2 (particles define a covariance "
            f"through their spread), got {n!r}. N = D + 1 = {ndim + 1} gives a full-rank fit."
        )
    scale = check_init_scale(init_scale)
    point = centre()
    if cloud == "antithetic":
        noise = antithetic_cloud(int(n), ndim, rng)
    else:
        noise = rng.standard_normal((int(n), ndim))
    return (point + scale * noise).astype(dtype)


def restart_cloud(particles: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` antithetic particles with exactly the mean and covariance of ``particles``."""
    mean = particles.mean(axis=0)
    _, s, vt = np.linalg.svd(particles - mean, full_matrices=False)
    rank = int(np.sum(s > s[0] * max(particles.shape) * np.finfo(particles.dtype).eps))
    factor = vt[:rank].T * (s[:rank] / np.sqrt(len(particles)))
    return cloud_of(mean, factor, n, rng).astype(particles.dtype)


def cloud_of(mean: np.ndarray, factor: np.ndarray, n: int, rng: np.random.Generator):
    """``n`` antithetic particles with exactly the mean ``mean`` and covariance
    ``factor @ factor.T`` (``factor`` ``(D, K)``, ``n >= 2 K``)."""
    return mean + antithetic_cloud(n, factor.shape[1], rng) @ factor.T


def is_biased(gap: float, mcse: float) -> bool:
    """The particles' free energy is significantly (about 2 %, one-sided) below the
    independent estimate, by more than :data:`BIAS_FLOOR`."""
    return abs(gap) - 2.0 * mcse > BIAS_FLOOR


def bias_settled(gap: float, mcse: float) -> bool:
    """Whether fewer than :data:`BIAS_DRAWS` draws settle the bias check: the gap and the
    pairs' spread are so small (q nearly the posterior) that no tail the draws missed could
    bring it to :data:`BIAS_FLOOR`. A gap that looks significant is not settled early: on
    a quartic target 256 draws put it 6 standard errors from the truth (the left tail of
    the log-ratios, missed by a small batch, also shrinks their spread)."""
    return abs(gap) + 3.0 * mcse <= BIAS_FLOOR / 2


def particle_cap(ndim: int) -> int:
    """The most particles the automatic ``n_particles`` grows to: 8 times its start (without
    :func:`default_n_particles`' warning, which the start gave once)."""
    start = min(2 * max(ndim, MIN_DEFAULT_PAIRS), MAX_DEFAULT_PARTICLES)
    return start * 2**MAX_DOUBLINGS


def can_double(n: int, ndim: int) -> bool:
    """Whether the automatic ``n_particles`` may still double from ``n``."""
    return n < particle_cap(ndim)


def cap_would_converge(decrement: float, n: int, ndim: int, tol: float) -> bool:
    """Whether the cap of the automatic ``n_particles`` can be expected to pass the fresh
    cloud's test that ``n`` particles failed with ``decrement``: a quadrature's error has a
    variance proportional to ``1/N``, and so has the decrement it leaves."""
    return decrement * n / particle_cap(ndim) < tol**2


def biased_message(last_stage: dict) -> str:
    """Why a fit at the cap of the automatic ``n_particles`` is not trusted."""
    if "gap" not in last_stage:
        return (
            f"finite-N bias: with {last_stage['n_particles']} particles a fresh cloud of the "
            "same Gaussian is not at a fixed point (natural-gradient decrement "
            f"{last_stage['decrement_fresh_cloud']:.3g}), so q is not the best Gaussian; fit "
            "with method='gf' (fresh draws every step, no such bias) or use NUTS"
        )
    return (
        f"finite-N bias: with {last_stage['n_particles']} particles (the cap of the automatic "
        f"n_particles) the free energy is still {last_stage['gap']:.3g} ± "
        f"{last_stage['gap_mcse']:.2g} nats below an independent Monte Carlo -ELBO of the same "
        "Gaussian, so q is not the best Gaussian; fit with method='gf' (fresh draws every "
        "step, no such bias) or use NUTS"
    )


@dataclass
class ParticleStages:
    """The automatic ``n_particles``: one stage per number of particles (the step it
    started at, its bias check), and the free energy of the state the fit ended on."""

    stages: list[dict] = field(default_factory=list)
    final_free_energy: float | None = None
    stall_restarts: int = 0  # fresh clouds drawn after a stall (at most one)
    cloud_checked: bool = False  # this stage's fixed point was tested on a fresh cloud

    def begin(self, n: int) -> None:
        """Record the first stage (``n`` particles from step 0) if nothing has yet."""
        if not self.stages:
            self.stages.append({"step": 0, "n_particles": n})

    def check(self, approx: FittedApproximation, rng: np.random.Generator) -> tuple[str, int]:
        """Compare the final free energy with an independent Monte Carlo ``-ELBO`` of the
        same Gaussian (from :data:`FIRST_BIAS_DRAWS` up to :data:`BIAS_DRAWS` draws from
        ``rng``, until :func:`bias_settled`): ``"unbiased"``, ``"double"`` (restart with
        twice the particles) or ``"biased"`` (at the cap), and the draws it took."""
        gap, mcse, draws = free_energy_gap(
            approx, self.final_free_energy, BIAS_DRAWS, rng, bias_settled, FIRST_BIAS_DRAWS
        )
        n = len(approx.particles)
        self.begin(n)
        self.stages[-1] |= {"gap": gap, "gap_mcse": mcse, "gap_draws": draws}
        if not is_biased(gap, mcse):
            return "unbiased", draws
        return ("double" if can_double(n, approx.target.ndim) else "biased"), draws

    def checkpoint(self, rng: np.random.Generator) -> dict:
        """JSON-able, with the state of the checks' random stream ``rng``."""
        extra = {"stages": self.stages, "final_free_energy": self.final_free_energy}
        return extra | {
            "cloud_rng": rng.bit_generator.state,
            "stall_restarts": self.stall_restarts,
            "cloud_checked": self.cloud_checked,
        }

    @classmethod
    def load(cls, extra: dict, rng: np.random.Generator) -> ParticleStages:
        """What :meth:`checkpoint` wrote; restores ``rng``'s state too."""
        rng.bit_generator.state = extra["cloud_rng"]
        return cls(
            extra["stages"], extra["final_free_energy"], extra.get("stall_restarts", 0),
            extra.get("cloud_checked", False),
        )  # fmt: skip

    def restart(self, step: int, n_particles: int) -> None:
        self.final_free_energy = None
        self.cloud_checked = False
        self.stages.append({"step": step, "n_particles": n_particles})

    def settings(self) -> dict:
        """The stages, for the DataTree's ``gpf`` group."""
        if not self.stages:
            return {}
        out = {
            "stage_steps": [int(st["step"]) for st in self.stages],
            "stage_particles": [int(st["n_particles"]) for st in self.stages],
        }
        checks = [st for st in self.stages if "gap" in st]
        if checks:
            out["bias_gap"] = float(checks[-1]["gap"])
            out["bias_gap_mcse"] = float(checks[-1]["gap_mcse"])
        return out
