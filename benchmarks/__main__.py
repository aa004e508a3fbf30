"""``python -m benchmarks run [--quick] [--only NAME ...] [--out DIR] [--backend B] [--device D]``;
``list``.

The full run rewrites ``docs/benchmarks.md`` (figures and ``benchmarks.csv`` in
``docs/benchmarks/``); ``--quick`` (small settings: a smoke run) writes to
``build/benchmarks-quick/`` unless ``--out`` says otherwise. The fits use PyMC's default
backend (numba) in the full run and ``c``, which compiles a new graph faster, in ``--quick``;
``--backend`` overrides either (benchmarks/README.md has the measured compile times).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import traceback

from pathlib import Path

from benchmarks.suite import DOCS_DIR, EXPERIMENTS, QUICK_DIR, assemble, run_experiment


def pin_blas_threads(threads: int) -> None:
    """Limit every BLAS library to ``threads``: through the environment for those loaded
    later (numba-compiled functions call SciPy's OpenBLAS, which NumPy does not load: left at
    2 threads next to a busy process it oversubscribes the cores), and through threadpoolctl
    for those already loaded."""
    import os

    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(threads)
    import pymc  # noqa: F401
    import scipy.linalg  # noqa: F401  (loads SciPy's OpenBLAS)

    from threadpoolctl import threadpool_limits  # a PyMC dependency

    threadpool_limits(threads, user_api="blas")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run experiments and write the report")
    run.add_argument("--quick", action="store_true", help="small settings: a smoke run")
    run.add_argument("--only", nargs="+", choices=list(EXPERIMENTS), metavar="NAME")
    run.add_argument("--out", type=Path, help="output folder (default: see above)")
    run.add_argument(
        "--backend",
        help="PyTensor backend of the fits: c, numba, or 'default' for PyMC's "
        "(default: 'c' with --quick, PyMC's otherwise)",
    )
    run.add_argument("--device", default="cpu", help="JAX platform of scale: cpu, gpu, tpu")
    run.add_argument("--blas-threads", type=int, default=1, help="BLAS threads (default 1)")
    sub.add_parser("list", help="list the experiments")
    args = parser.parse_args(argv)
    if args.command == "list":
        for name, module in EXPERIMENTS.items():
            print(f"{name:10s} benchmarks/{module}.py")
        return 0

    pin_blas_threads(args.blas_threads)
    # PyMC logs at INFO on every fit; the benchmarks print their own progress
    for name in ("pymc", "pymc_gpf", "pymc.sampling.mcmc", "pymc.stats.convergence"):
        logging.getLogger(name).setLevel(logging.ERROR)

    backend = args.backend or ("c" if args.quick else None)
    backend = None if backend == "default" else backend
    out = args.out or (QUICK_DIR if args.quick else DOCS_DIR)
    start = time.perf_counter()
    failed = []
    for name in args.only or list(EXPERIMENTS):
        try:
            run_experiment(name, args.quick, out, backend, args.device)
        except Exception:  # report it, run the others, fail at the end
            traceback.print_exc()
            print(f"== {name}: FAILED (its previous fragment, if any, is kept)", flush=True)
            failed.append(name)
    assemble(out)
    print(f"total {(time.perf_counter() - start) / 60:.1f} min")
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
