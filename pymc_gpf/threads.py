"""One multi-threaded BLAS pool while a fit runs, not two.

NumPy's and SciPy's wheels each bring their own OpenBLAS, each with a thread per core. A fit's
compiled step alternates between them (NumPy's for the matrix products the quick C backend
leaves to NumPy, SciPy's for triangular solves, Cholesky factors and eigendecompositions), and
each pool's threads spin for a while after every call, so the two pools fight for the cores:
on 2 cores a 53 x 25 by 25 x 1000 product and a 26 x 26 triangular solve took 10.4 ms a pair,
against 0.2 ms with SciPy's pool on one thread, and GF's warm fit of a 26-parameter logistic
regression 1.05 s against 0.33 s. While a fit runs every BLAS pool but NumPy's therefore
gets one thread; NumPy's keeps its threads for large products (a 200 000 x 20 by 20 x 41
product: 12 ms on two threads, 22 ms on one). With one pool (a shared MKL or OpenBLAS, as
conda installs) nothing changes.
"""

from __future__ import annotations

import os

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from threadpoolctl import ThreadpoolController

__all__ = ["one_blas_pool"]

_NUMPY_DIR = os.path.dirname(np.__file__)


def _numpy_pool(filepath: str) -> bool:
    """Whether a BLAS library is the one NumPy links (its wheel's ``numpy.libs`` folder, or
    inside the package)."""
    return filepath.startswith((_NUMPY_DIR + ".libs", _NUMPY_DIR + os.sep))


@contextmanager
def one_blas_pool() -> Iterator[None]:
    """Every loaded BLAS pool but NumPy's on one thread inside the block (each restored
    after it); nothing when only one pool is loaded."""
    pools = [c for c in ThreadpoolController().lib_controllers if c.user_api == "blas"]
    if len(pools) < 2:
        yield
        return
    others = [c for c in pools if not _numpy_pool(c.filepath)]
    if len(others) == len(pools):  # NumPy's not recognised: keep the first loaded
        others = pools[1:]
    threads = [c.num_threads for c in others]
    for pool in others:
        pool.set_num_threads(1)
    try:
        yield
    finally:
        for pool, n in zip(others, threads, strict=True):
            pool.set_num_threads(n)
