"""Write the persistence test's cut fits (``small_fits()`` on the regression fixture's data) as
netCDF checkpoints, with whichever pymc-gpf is importable: ``PYTHONPATH=<checkout>
python make_checkpoints.py <that checkout's tests dir> <out dir>``."""

import sys
import warnings

import numpy as np
import pymc as pm

import pymc_gpf


def main(tests_dir: str, out: str) -> None:
    sys.path.insert(0, tests_dir)
    from conftest import regression
    from methods import small_fits

    print(pymc_gpf.__file__)
    rng = np.random.default_rng(42)  # the regression_data fixture's
    x = rng.normal(size=60)
    y = 1.0 + 2.0 * x + rng.normal(scale=0.7, size=60)
    for case in small_fits():
        method, inf_kwargs, fit_kwargs = case.values

        def fit(n, method=method, inf_kwargs=inf_kwargs, fit_kwargs=fit_kwargs):
            return pm.fit(n, method=method, model=regression(x, y), inf_kwargs=inf_kwargs,
                          random_seed=11, progressbar=False, **fit_kwargs)  # fmt: skip

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # automatic fits cut short
            whole = fit(60)
            cut = min(30, len(whole.hist) // 2)
            path = fit(cut).save(f"{out}/{case.id}.nc")
        print(case.id, cut, len(whole.hist), path)


if __name__ == "__main__":
    main(*sys.argv[1:3])
