"""The keywords of ``fit``: parsed and checked once into a frozen :class:`FitOptions`.

Every method takes the same fit keywords (PyMC's, plus the step size and the stopping
tolerance); their documentation (:data:`FIT_DOC`) is the docstring of ``fit``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pytensor.compile.sharedvalue import SharedVariable
from pytensor.graph.traversal import ancestors

from pymc_gpf.checks import is_integer, positive
from pymc_gpf.optimizers import Optimizer, Transform, chain, clip_by_norm, resolve
from pymc_gpf.target import BatchedTarget, compile_kwargs_for, quick_compile_backend

__all__ = [
    "AUTO",
    "FIT_DOC",
    "FitOptions",
    "check_fit_keywords",
    "parse_fit_options",
    "parse_learning_rate",
    "resolve_natural_mean",
]

AUTO = "auto"
DEFAULT_TOL = 0.02  # distance to the fixed point, in standard deviations of q
# with pm.Minibatch every step sees a subsample: reaching tol costs ~ (n / batch) / tol^2 steps
MINIBATCH_TOL = 0.05
DEFAULT_MAX_STEPS, MINIBATCH_MAX_STEPS = 10_000, 100_000
INITS = ("initial_point", "map")
FIT_KEYWORDS = (
    "learning_rate",
    "tol",
    "optimizer",
    "clip_norm",
    "more_obj_params",
    "compile_kwargs",
    "callbacks",
    "progressbar",
    "backend",
    "include_transformed",
    "check_draws",
)
CHECK_DRAWS = 16384  # the most draws of q the end-of-fit importance check evaluates


@dataclass(frozen=True)
class FitOptions:
    """Settings of one ``fit`` call (PyMC fit keywords). ``learning_rate`` is ``None`` for the
    automatic step size (:mod:`pymc_gpf.stepsize`), else the fixed pair ``(eta1, eta2)``."""

    learning_rate: tuple[float, float] | None
    optimizer: Optimizer
    clip_norm: float | None
    more_obj_params: tuple[SharedVariable, ...]
    backend: str | None  # as the user gave it
    compile_kwargs: dict = field(default_factory=dict)
    include_transformed: bool = False
    tol: float | None = None
    compile_backend: str | None = None  # what the fit compiles with (parse_fit_options)
    check_draws: int = CHECK_DRAWS  # the verdict's largest importance check (0: none)

    @property
    def auto(self) -> bool:
        """The automatic step size (the default), rather than a fixed ``learning_rate``."""
        return self.learning_rate is None

    def chain(self, particle_axes: Sequence[int] = ()) -> Transform:
        """Clip (optional), then precondition: the optimiser of one array."""
        clip = [clip_by_norm(self.clip_norm)] if self.clip_norm is not None else []
        return chain(*clip, self.optimizer.transform(particle_axes))

    def settings(self) -> dict[str, Any]:
        return {
            "learning_rate": AUTO if self.auto else self.learning_rate,
            "tol": self.tol,
            "optimizer": repr(self.optimizer),
            "clip_norm": self.clip_norm,
            "more_obj_params": [p.name or repr(p) for p in self.more_obj_params],
            "backend": self.backend,
            "compiled_with": self.compile_backend or "PyMC's default",
            "check_draws": self.check_draws,
        }


def parse_learning_rate(learning_rate) -> tuple[float, float] | None:
    """``"auto"`` (``None``), one step size or the pair ``(eta1, eta2)``, as positive floats."""
    if learning_rate is None or (isinstance(learning_rate, str) and learning_rate == AUTO):
        return None
    if isinstance(learning_rate, str):
        raise ValueError(
            f"learning_rate is 'auto' (the default), a positive number or a pair; got "
            f"{learning_rate!r}."
        )
    if isinstance(learning_rate, tuple | list):
        if len(learning_rate) != 2:
            raise ValueError(
                "learning_rate is one number or a pair (eta1 for the mean shift, eta2 for "
                f"the linear part); got {learning_rate!r}."
            )
        return tuple(positive("learning_rate", r) for r in learning_rate)
    return (positive("learning_rate", learning_rate),) * 2


def resolve_natural_mean(option: bool | None, options: FitOptions | None) -> bool:
    """Whether GPF and GF precondition the mean step: as the user said, else on with the
    automatic step size (where both steps are natural) and off with a fixed one (the
    papers' updates as printed). ``False`` with the automatic step size is an error: its
    steps are natural-gradient steps, whose mean step is ``C g_bar``."""
    if option is False and options is not None and options.auto:
        raise ValueError(
            "natural_mean=False needs a fixed learning_rate: the automatic step size uses "
            "natural-gradient steps, whose mean step is C g_bar. Drop natural_mean or pass "
            "e.g. learning_rate=1e-3."
        )
    if option is not None:
        return option
    return options is not None and options.auto


def _hyperparameters(target: BatchedTarget, more_obj_params) -> tuple[SharedVariable, ...]:
    params = tuple(more_obj_params or ())
    for p in params:
        if not isinstance(p, SharedVariable) or p.dtype not in ("float32", "float64"):
            raise TypeError(
                f"more_obj_params entries must be float pytensor.shared variables used by "
                f"the model; got {p!r}."
            )
        if p not in ancestors([target._logp]):
            raise ValueError(
                f"more_obj_params: {p.name or p!r} is not used by the model's log-density, "
                "so the free energy does not depend on it."
            )
    return params


def check_fit_keywords(owner: str, keywords: dict[str, Any]) -> None:
    """A clear error for a keyword ``fit`` does not take."""
    unknown = sorted(set(keywords) - set(FIT_KEYWORDS))
    if unknown:
        raise TypeError(
            f"{owner}.fit() got unexpected keyword(s) {unknown}; it accepts "
            f"{', '.join(FIT_KEYWORDS)}."
        )


def parse_fit_options(
    target: BatchedTarget,
    default_optimizer: str,
    *,
    learning_rate=AUTO,
    optimizer=None,
    clip_norm=None,
    more_obj_params=None,
    backend=None,
    compile_kwargs=None,
    include_transformed=False,
    tol=None,
    check_draws=CHECK_DRAWS,
) -> FitOptions:
    """The fit keywords, checked, with their defaults for ``target``."""
    rates = parse_learning_rate(learning_rate)
    if clip_norm is not None:
        clip_norm = positive("clip_norm", clip_norm)
    if not is_integer(check_draws, 0):
        raise ValueError(
            "check_draws (the most draws of q the verdict's importance check evaluates "
            f"log p at) must be a non-negative integer, 0 to skip the check; got {check_draws!r}."
        )
    if tol is not None:
        tol = positive("tol", tol)
    elif rates is None:
        tol = MINIBATCH_TOL if target.minibatch else DEFAULT_TOL
    params = _hyperparameters(target, more_obj_params)
    resolved = resolve(default_optimizer if optimizer is None else optimizer)
    if rates is None and (optimizer is not None or clip_norm is not None):
        raise ValueError(
            "optimizer= and clip_norm= shape a fixed-step fit; the automatic step size "
            "(the default) uses natural-gradient steps and needs neither. Pass a "
            "learning_rate too to use them (e.g. learning_rate=0.01, optimizer='adam')."
        )
    backend = _sharded_backend(target, backend, compile_kwargs)
    compile_kwargs_for(backend, compile_kwargs)  # validates backend vs compile_kwargs
    # an automatic fit on full data takes tens to hundreds of steps, so compiling is most
    # of its time to a result: with no backend named, build it where that is quickest
    # (target.quick_compile_backend), unless the data make each evaluation the cost.
    # Fixed-step and minibatch fits run many more steps and keep PyMC's default, which runs
    # each step fastest.
    long_fit = rates is not None or target.minibatch
    return FitOptions(
        learning_rate=rates,
        optimizer=resolved,
        clip_norm=clip_norm,
        more_obj_params=params,
        backend=backend,
        compile_kwargs=dict(compile_kwargs or {}),
        include_transformed=bool(include_transformed),
        tol=tol,
        compile_backend=(
            backend
            if long_fit
            else quick_compile_backend(backend, compile_kwargs, target.data_size)
        ),
        check_draws=int(check_draws),
    )


def _sharded_backend(target: BatchedTarget, backend: str | None, compile_kwargs) -> str | None:
    """Particles split across JAX devices run on JAX: ``backend="jax"`` unless another one
    was asked for (an error)."""
    if target.row_sharding is None:
        return backend
    if backend is None and not (compile_kwargs or {}).get("mode"):
        return "jax"
    if backend != "jax":
        raise ValueError(
            f"devices= splits the particles across JAX devices, so the fit runs on JAX; "
            f"got backend={backend!r}. Pass backend='jax' (or nothing), or drop devices."
        )
    return backend


FIT_DOC = """Fit until converged, at most ``n`` steps; returns the approximation (PyMC's
``Inference.fit`` contract).

Parameters
----------
n
    The maximum number of steps (a fit at the automatic step size stops by itself when it
    has converged; a fixed ``learning_rate`` runs ``n`` steps unless ``tol`` is given).
    Default 10 000 as PyMC, 100 000 when the model reads ``pm.Minibatch`` data (each step
    then sees a subsample).
learning_rate
    ``"auto"`` (default): natural-gradient steps whose size adapts by itself (backtracking
    for GPF on full data, a trust region with a step-halving schedule and iterate averaging
    for stochastic objectives; :mod:`pymc_gpf.stepsize`, :mod:`pymc_gpf.control`). A number
    or a pair ``(eta1, eta2)`` runs the paper's fixed-step update instead: the shift and the
    linear part of eq. 13 (GPF), the mean and the factor of eq. 11 (GF), the particles
    (eq. 20) and the local Gaussians (eq. 21) for WVGD.
tol
    When the fit has converged, in standard deviations of q: the distance to the fixed
    point estimated by the natural-gradient decrement (deterministic objectives) or the
    Monte Carlo error of the averaged iterate once the free energy has stopped falling
    (stochastic ones). Default 0.02 at the automatic step size; with a fixed
    ``learning_rate`` it enables a window test on the trace.
optimizer
    With a fixed ``learning_rate`` only: a name ("sgd", "momentum", "adam", "rmsprop",
    "adagrad") or a :class:`pymc_gpf.optimizers.Optimizer`; default "sgd" for GPF and GF,
    "adam" for WVGD. The adaptive ones are dimension-wise (App. H), so the step stays
    affine.
clip_norm
    With a fixed ``learning_rate`` only: bound on the norm of each update array.
more_obj_params
    ``pytensor.shared`` model hyperparameters learnt jointly by descending the free energy
    (type-II maximum likelihood; the regularised free energy of §3.4.1 for GPF).
compile_kwargs, backend
    As in PyMC (``backend="c"``, ``"numba"``, ``"jax"``).
check_draws
    The verdict at the end of the fit (``approx.outcome.verdict``) checks q by importance
    sampling against the model, drawing from q in batches until its answer is clear, at
    most this many draws (default 16 384; log-density evaluations without gradient);
    ``0`` skips the check (the verdict is then ``None`` unless the fit did not converge).
callbacks, progressbar, progressbar_theme, include_transformed
    As in PyMC: callbacks are called as ``cb(approx, hist, i)`` and may raise
    ``StopIteration``.
score
    Accepted for PyMC compatibility; the free energy is always recorded (it costs nothing
    extra).

Notes
-----
How the fit ended is ``approx.outcome`` (also in the DataTree's ``fit`` group), with its
verdict (``"trustworthy"``, ``"family-limited"`` or ``"not converged"``, see
:mod:`pymc_gpf.verdict`); any verdict but "trustworthy" warns with
:class:`pymc_gpf.FitWarning`. Calling ``fit`` again continues from the current state with a fresh
optimiser and step-size schedule (and a new compiled step); ``refine`` continues with the
same ones.
"""
