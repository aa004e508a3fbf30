"""While a fit runs, one BLAS pool keeps its threads (:mod:`pymc_gpf.threads`)."""

from __future__ import annotations

import pymc as pm
import pytest
import scipy.linalg  # noqa: F401  (loads SciPy's BLAS, a second pool in wheel installs)

from threadpoolctl import ThreadpoolController

from pymc_gpf.threads import _pool_of, one_blas_pool


def _threads() -> dict[str, int]:
    return {
        c.filepath: c.num_threads
        for c in ThreadpoolController().lib_controllers
        if c.user_api == "blas"
    }


def test_small_data_gets_one_thread_in_every_pool_and_is_restored():
    before = _threads()
    with one_blas_pool("quick_c"):
        inside = _threads()
    assert _threads() == before
    assert all(n == 1 for n in inside.values()), inside


@pytest.mark.parametrize(("backend", "package"), [("quick_c", "numpy"), ("numba", "scipy")])
def test_large_data_keeps_the_backends_pool_alone_and_is_restored(backend, package):
    """The C backends' products run in NumPy's BLAS, numba's in SciPy's."""
    before = _threads()
    with one_blas_pool(backend, large=True):
        inside = _threads()
    assert _threads() == before
    if len(before) < 2:
        assert inside == before  # one pool: nothing to separate
        return
    kept = [path for path in before if _pool_of(package, path)]
    assert len(kept) <= 1
    for path, n in inside.items():
        assert n == (before[path] if path in kept else 1), (path, n)


def test_a_fit_and_its_callbacks_run_inside_it():
    seen = []
    with pm.Model():
        pm.Normal("x", 0.0, 1.0)
        pm.fit(
            3, method="gf", random_seed=1, progressbar=False, check_draws=0,
            callbacks=[lambda approx, hist, i: seen.append(_threads())],
        )  # fmt: skip
    pools = _threads()
    assert len(seen) == 3
    assert all(n == 1 for threads in seen for n in threads.values()), seen  # small data
    assert _threads() == pools


def test_a_nested_block_leaves_the_outer_blocks_setting():
    """A fit inside a fit (GPF's GF continuation, an ensemble's start) keeps the outer
    block's pools until the outer block ends."""
    before = _threads()
    with one_blas_pool("quick_c", large=True):
        outer = _threads()
        with one_blas_pool("numba", large=True):
            assert _threads() == outer
        assert _threads() == outer
    assert _threads() == before
