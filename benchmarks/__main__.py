"""``python -m benchmarks run [--quick] [--only NAME ...] [--out DIR] [--backend B] [--device D]
[--blas-threads N]``; ``list``. How the pieces fit: ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import functools
import importlib
import importlib.util
import logging
import os
import platform
import re
import sys
import time
import traceback

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOCS_DIR, QUICK_DIR = ROOT / "docs" / "benchmarks", ROOT / "build" / "benchmarks-quick"
PROSE = ROOT / "benchmarks" / "prose.md"
CSV_FIELDS = ["experiment", "case", "method", "metric", "value", "unit", "note"]
PAPERS = "examples/paper_real_data.py"  # the papers' figures: the tests run them quick
SECTION_MODULES = {"logistic": PAPERS, "bnn": PAPERS, "wvgd": PAPERS,
                   "reference": "benchmarks/accuracy.py", "hard": "benchmarks/accuracy.py",
                   "multimodal": "benchmarks/accuracy.py",
                   "minibatch": "benchmarks/accuracy.py", "type2": "benchmarks/accuracy.py",
                   "speed": "benchmarks/speed.py", "startup": "benchmarks/speed.py",
                   "scale": "benchmarks/speed.py", "large": "benchmarks/large.py",
                   "low_rank": "benchmarks/large.py",
                   "big_data": "benchmarks/large.py"}  # fmt: skip


@dataclass
class Context:
    """What a section gets: the mode, where to write, and the record of numbers."""

    name: str
    quick: bool
    out_dir: Path
    backend: str | None = None  # PyTensor backend of every fit (None: PyMC's default)
    device: str = "cpu"  # JAX platform of the sections that run on JAX
    records: list[dict[str, Any]] = field(default_factory=list)

    def pick(self, quick: Any, full: Any) -> Any:
        return quick if self.quick else full

    def figure(self, stem: str) -> tuple[Path, str]:
        """Path to save a PNG under, and the markdown that shows it in the report."""
        path = self.out_dir / "figures" / f"{self.name}_{stem}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        return path, f"![{stem}]({os.path.relpath(path, report_path(self.out_dir).parent)})"

    def record(self, case: str, method: str, metric: str, value: float, unit: str = "",
               note: str = "") -> float:  # fmt: skip
        """One number of the report (returned, to be formatted where it is used)."""
        values = (self.name, case, method, metric, value, unit, note)
        self.records.append(dict(zip(CSV_FIELDS, values, strict=True)))
        return value

    def record_many(self, case: str, method: str, values, note: str = "") -> None:
        """``(metric, value, unit)`` numbers of one case and method."""
        for metric, value, unit in values:
            self.record(case, method, metric, value, unit, note)

    def text(self, key: str, **values: Any) -> str:
        return prose(key, **values)


def prose(key: str, **values: Any) -> str:
    """The template ``@@ key`` of ``prose.md``, its lines joined into paragraphs, filled in."""
    blocks = re.split(r"^@@ (\S+)\n", PROSE.read_text(), flags=re.MULTILINE)[1:]
    text = dict(zip(blocks[::2], blocks[1::2], strict=True))[key].strip()
    return re.sub(r"(?<!\n)\n(?!\n)", " ", text).format(**values)


def report_path(out_dir: Path) -> Path:
    """``docs/benchmarks.md`` for the published run, ``report.md`` inside any other folder."""
    published = out_dir.resolve() == DOCS_DIR.resolve()
    return DOCS_DIR.parent / "benchmarks.md" if published else out_dir / "report.md"


def machine() -> str:
    """Machine, versions and date: the stamp of every section."""
    import arviz
    import numpy
    import pymc
    import pytensor

    from threadpoolctl import threadpool_info

    import pymc_gpf

    cpu = platform.processor() or platform.machine()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next((x.split(":", 1)[1].strip() for x in lines if x.startswith("model name")), cpu)
    except OSError:
        pass
    threads = sorted({i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"})
    return (
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC on {platform.node()} "
        f"({cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}); "
        f"Python {platform.python_version()}, pymc-gpf {pymc_gpf.__version__}, PyMC "
        f"{pymc.__version__}, PyTensor {pytensor.__version__}, ArviZ {arviz.__version__}, "
        f"NumPy {numpy.__version__}; BLAS threads {', '.join(map(str, threads)) or '?'}"
    )


@functools.cache
def sections_of(path: str) -> dict:
    """The ``SECTIONS`` of a module of ``benchmarks/`` or of a script of ``examples/``."""
    if path.startswith("benchmarks/"):
        return importlib.import_module(path.removesuffix(".py").replace("/", ".")).SECTIONS
    spec = importlib.util.spec_from_file_location(Path(path).stem, ROOT / path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # for dataclasses
    spec.loader.exec_module(module)
    return module.SECTIONS


def run_section(name: str, quick: bool, out_dir: Path, backend: str | None, device: str) -> None:
    """Run one section and write its fragment (``sections/NAME.md`` and ``NAME.csv``)."""
    from benchmarks import harness

    title, run = sections_of(SECTION_MODULES[name])[name]
    ctx = Context(name, quick, out_dir, backend, device)
    harness.BACKEND = backend
    print(f"== {name}: {title}", flush=True)
    load_before, start = os.getloadavg()[0], time.perf_counter()
    body = run(ctx)
    seconds = time.perf_counter() - start
    options = (" --quick" if quick else "") + (f" --backend {backend}" if backend else "")
    stamp = prose("stamp", machine=machine(), backend=harness.backend_name(backend),
                  options=options, minutes=f"{seconds / 60:.1f}", before=f"{load_before:.1f}",
                  after=f"{os.getloadavg()[0]:.1f}", cores=os.cpu_count())  # fmt: skip
    (out_dir / "sections").mkdir(parents=True, exist_ok=True)
    (out_dir / "sections" / f"{name}.md").write_text(f"## {title}\n\n{stamp}\n\n{body.strip()}\n")
    write_csv(out_dir / "sections" / f"{name}.csv", ctx.records)
    print(f"== {name}: done in {seconds / 60:.1f} min ({len(ctx.records)} numbers)", flush=True)


def write_csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, CSV_FIELDS)
        writer.writeheader()
        writer.writerows(rows)


def assemble(out_dir: Path) -> None:
    """Rebuild the report and the joined CSV from the fragments in ``out_dir``."""
    report, sections = report_path(out_dir), out_dir / "sections"
    names = [n for n in SECTION_MODULES if (sections / f"{n}.md").exists()]
    rows = []
    for name in names:
        with open(sections / f"{name}.csv", newline="") as fh:
            rows += csv.DictReader(fh)
    write_csv(out_dir / "benchmarks.csv", rows)
    csv_link = os.path.relpath(out_dir / "benchmarks.csv", report.parent)
    parts = [prose("intro", names=", ".join(SECTION_MODULES), csv=csv_link) + "\n"]
    parts += [(sections / f"{n}.md").read_text() for n in names]
    if missing := [n for n in SECTION_MODULES if n not in names]:
        parts.append(f"*Not run yet: {', '.join(missing)}.*\n")
    report.write_text("\n".join(parts))
    print(f"report: {report}\nnumbers: {out_dir / 'benchmarks.csv'}")


def pin_blas_threads(threads: int) -> None:
    """Limit every BLAS library to ``threads``: through the environment for those loaded
    later (numba-compiled functions call SciPy's OpenBLAS, which NumPy does not load), and
    through threadpoolctl for those already loaded."""
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(threads)
    import pymc  # noqa: F401
    import scipy.linalg  # noqa: F401  (loads SciPy's OpenBLAS)

    from threadpoolctl import threadpool_limits  # a PyMC dependency

    threadpool_limits(threads, user_api="blas")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run sections and write the report")
    run.add_argument("--quick", action="store_true", help="small settings: a smoke run")
    run.add_argument("--only", nargs="+", choices=list(SECTION_MODULES), metavar="NAME")
    run.add_argument("--out", type=Path, help="output folder (default: see above)")
    run.add_argument("--backend", help="PyTensor backend of the fits: c, numba, or 'default' for "
                     "PyMC's (default: 'c' with --quick, PyMC's otherwise)")  # fmt: skip
    run.add_argument("--device", default="cpu", help="JAX platform of scale: cpu, gpu, tpu")
    run.add_argument("--blas-threads", type=int, default=1, help="BLAS threads (default 1)")
    sub.add_parser("list", help="list the sections")
    args = parser.parse_args(argv)
    if args.command == "list":
        for name, module in SECTION_MODULES.items():
            print(f"{name:10s} {module}")
        return 0
    pin_blas_threads(args.blas_threads)
    # PyMC logs at INFO on every fit; the benchmarks print their own progress
    for name in ("pymc", "pymc_gpf", "pymc.sampling.mcmc", "pymc.stats.convergence"):
        logging.getLogger(name).setLevel(logging.ERROR)
    backend = args.backend or ("c" if args.quick else None)
    backend = None if backend == "default" else backend
    out = args.out or (QUICK_DIR if args.quick else DOCS_DIR)
    start, failed = time.perf_counter(), []
    # a quick run leaves the papers' sections to tests/test_examples.py, which runs them quick
    default = [n for n, path in SECTION_MODULES.items() if not (args.quick and path == PAPERS)]
    for name in args.only or default:
        try:
            run_section(name, args.quick, out, backend, args.device)
        except Exception:  # report it, run the others, fail at the end
            traceback.print_exc()
            print(f"== {name}: FAILED (its previous fragment, if any, is kept)", flush=True)
            failed.append(name)
    assemble(out)
    print(f"total {(time.perf_counter() - start) / 60:.1f} min")
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
