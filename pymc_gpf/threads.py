"""BLAS threads while a fit runs: one pool with threads, and only for large data.

NumPy's and SciPy's wheels each bring their own OpenBLAS, each with a thread per core. A fit's
compiled step can alternate between them (with the quick C backend, NumPy's for the matrix
products it leaves to NumPy, SciPy's for triangular solves, Cholesky factors and
eigendecompositions), and each pool's threads spin for a while after every call, so the two
pools fight for the cores: on 2 idle cores a 53 x 25 by 25 x 1000 product and a 26 x 26
triangular solve took 10.4 ms a pair with both pools on two threads, 0.2 ms with SciPy's on
one, 0.08 ms with both on one; GF's warm fit of a 26-coefficient logistic regression took
1.05 s against 0.33 s. Beside one other busy process the pair took 18.3, 0.42 and 0.08 ms.
Small products gain nothing from threads, so while a fit of a model with fewer than
:data:`~pymc_gpf.target.LARGE_DATA` observed scalars runs every BLAS pool has one thread.
With more data the pool the backend's products use keeps its threads (SciPy's for numba,
whose ``np.dot`` calls SciPy's BLAS: a 200 000 x 20 by 20 x 41 product took 24 ms on two idle
threads, 38 ms on one; NumPy's for the C backends) and the others get one. With one pool (a
shared MKL or OpenBLAS, as conda installs) only the thread count changes.
"""

from __future__ import annotations

import os

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import scipy

from threadpoolctl import ThreadpoolController

__all__ = ["one_blas_pool"]

_inside = False  # a block of one_blas_pool is running (threadpoolctl's scan costs ~2 ms)

_DIRS = {"numpy": os.path.dirname(np.__file__), "scipy": os.path.dirname(scipy.__file__)}


def _pool_of(package: str, filepath: str) -> bool:
    """Whether a BLAS library is the one ``package`` links (its wheel's ``<package>.libs``
    folder, or inside the package)."""
    folder = _DIRS[package]
    return filepath.startswith((folder + ".libs", folder + os.sep))


def _package(backend: str | None) -> str:
    """The package whose BLAS a backend's matrix products run in."""
    return "scipy" if backend in (None, "numba") else "numpy"


@contextmanager
def one_blas_pool(backend: str | None = "quick_c", large: bool = False) -> Iterator[None]:
    """Every loaded BLAS pool on one thread inside the block, each restored after it; with
    ``large`` data all but the one ``backend``'s matrix products use (``None``: PyMC's
    default, numba)."""
    global _inside
    if _inside:  # nested (a fit's verdict, a GF fit inside an ensemble's): already set
        yield
        return
    pools = [c for c in ThreadpoolController().lib_controllers if c.user_api == "blas"]
    others = pools
    if large:
        package = _package(backend)
        others = [c for c in pools if not _pool_of(package, c.filepath)]
        if len(others) == len(pools):  # that package's pool not recognised: keep the first
            others = pools[1:]
    threads = [c.num_threads for c in others]
    for pool in others:
        pool.set_num_threads(1)
    _inside = True
    try:
        yield
    finally:
        _inside = False
        for pool, n in zip(others, threads, strict=True):
            pool.set_num_threads(n)
