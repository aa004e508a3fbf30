"""``pm.fit(method="gpf")``: string dispatch for PyMC's ``fit``.

PyMC resolves method names from a dict local to ``pymc.variational.inference.fit``, so new
names need that function wrapped. The wrapper is installed on the three bindings of ``fit``
(``pymc.fit``, ``pymc.variational.fit``, ``pymc.variational.inference.fit``), idempotently;
every other method goes to PyMC unchanged, and :func:`unregister` restores the original.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect

import pymc
import pymc.variational
import pymc.variational.inference as pm_inference

from pymc_gpf.engine import FlowInference, configure

__all__ = ["METHODS", "register", "register_method", "unregister"]

METHODS: dict[str, type[FlowInference]] = {}
_MARK = "_pymc_gpf_wrapper"


def register_method(name: str, cls: type[FlowInference]) -> None:
    """Make ``pm.fit(method=name)`` build ``cls`` (names are case-insensitive)."""
    METHODS[name.lower()] = cls


def _original():
    fit = pm_inference.fit
    return fit.__wrapped__ if getattr(fit, _MARK, False) else fit


def _build(name: str, model, random_seed, start, start_sigma, inf_kwargs) -> FlowInference:
    """The inference ``pm.fit(method=name, ...)`` asks for, built from ``pm.fit``'s
    arguments."""
    if start_sigma is not None:
        raise NotImplementedError(
            f"start_sigma is only available for method 'advi'; for {name!r} set the "
            "initial spread with inf_kwargs={'init_scale': ...}."
        )
    model = pymc.modelcontext(model)
    options = dict(inf_kwargs or {})  # as PyMC: explicit arguments override inf_kwargs
    if random_seed is not None:
        options["random_seed"] = random_seed
    if start is not None:
        options["start"] = start
    _check_keys(name, METHODS[name], options)
    return METHODS[name](model=model, **options)


def _check_keys(name: str, cls: type[FlowInference], options: dict) -> None:
    """An unknown ``inf_kwargs`` key: name the valid ones and the closest."""
    params = inspect.signature(cls.__init__).parameters
    names = {k for k, p in params.items() if p.kind is not p.VAR_KEYWORD}
    if cls.Config is not None:  # the engine's constructor: the config's fields are its keywords
        names |= {f.name for f in dataclasses.fields(cls.Config)}
    elif len(names) < len(params):
        return
    valid = sorted(names - {"self", "model"})
    for key in options:
        if key not in names:
            close = difflib.get_close_matches(str(key), valid, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise TypeError(
                f"inf_kwargs: {name!r} has no option {key!r}.{hint} Its options are: "
                f"{', '.join(valid)} (see help(pymc_gpf.{cls.__name__}))."
            )


def _wrap(original):
    @functools.wraps(original)
    def fit(
        n=None,
        method="advi",
        model=None,
        random_seed=None,
        start=None,
        start_sigma=None,
        inf_kwargs=None,
        *,
        backend=None,
        include_transformed=False,
        **kwargs,
    ):
        name = method.lower() if isinstance(method, str) else None
        if name in METHODS:
            inference = _build(name, model, random_seed, start, start_sigma, inf_kwargs)
        elif isinstance(method, FlowInference):
            if inf_kwargs:
                raise ValueError(
                    "inf_kwargs are constructor arguments; pass them to the instance "
                    f"({type(method).__name__}(...)) instead."
                )
            inference = method
            configure(inference, model=model, random_seed=random_seed, start=start)
        else:
            try:
                return original(
                    10000 if n is None else n,
                    method,
                    model,
                    random_seed,
                    start,
                    start_sigma,
                    inf_kwargs,
                    backend=backend,
                    include_transformed=include_transformed,
                    **kwargs,
                )
            except KeyError as err:
                message = str(err.args[0]) if err.args else ""
                if name is None or not message.startswith("method should be one of"):
                    raise
                raise KeyError(
                    f"{message}; pymc-gpf adds {sorted(METHODS)}. Got method={method!r}."
                ) from None
        return inference.fit(n, backend=backend, include_transformed=include_transformed, **kwargs)

    setattr(fit, _MARK, True)
    return fit


def register() -> None:
    """Install the wrapper on ``pymc.fit`` and its aliases (idempotent)."""
    wrapper = _wrap(_original())
    for module in (pymc, pymc.variational, pm_inference):
        if not getattr(module.fit, _MARK, False):
            module.fit = wrapper


def unregister() -> None:
    """Restore PyMC's own ``fit`` on every binding."""
    original = _original()
    for module in (pymc, pymc.variational, pm_inference):
        if getattr(module.fit, _MARK, False):
            module.fit = original
