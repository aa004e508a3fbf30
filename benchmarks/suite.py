"""The benchmark suite: experiments, the context they record into, and the report.

Every experiment is a module in this package with ``NAME``, ``TITLE`` and
``run(ctx: Context) -> str`` (the markdown body of its section). It records every number it
reports with :meth:`Context.record` (one CSV row each) and saves figures with
:meth:`Context.figure`. ``python -m benchmarks run`` runs them and assembles the report.

Each experiment's output is kept as a fragment (``sections/NAME.md`` and ``NAME.csv`` in the
output folder) stamped with the machine, versions and date of the run that produced it, so
``--only NAME`` refreshes one section without retyping the others; the report and the joined
CSV are rebuilt from all fragments present. The full run writes to ``docs/benchmarks.md``
(fragments, figures and ``benchmarks.csv`` under ``docs/benchmarks/``); ``--quick`` writes to
``build/benchmarks-quick/`` so a smoke run never touches the published report.
"""

from __future__ import annotations

import csv
import datetime
import importlib
import io
import os
import platform
import time

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# order of the report; module name in this package -> short name for --only
EXPERIMENTS: dict[str, str] = {
    "gaussian": "exp_gaussian",  # paper Fig. 2
    "partial": "exp_partial",  # paper Fig. 3
    "lowrank": "exp_lowrank",  # paper Fig. 4
    "banana": "exp_banana",  # paper Fig. 5
    "logistic": "exp_logistic",  # paper Fig. 6
    "bnn": "exp_bnn",  # paper Table 1
    "wvgd": "exp_wvgd",  # WVGD paper
    "reference": "exp_reference",  # posteriordb + inference-gym ground truth
    "hard": "exp_hard",  # posteriors the defaults were never tuned on, NUTS references
    "minibatch": "exp_minibatch",  # pm.Minibatch at defaults, closed-form posterior
    "type2": "exp_type2",  # more_obj_params at defaults, closed-form ML-II optimum
    "speed": "exp_speed",  # per-step cost, scaling with D and N
    "startup": "exp_startup",  # time to the first step, cold and warm cache
    "scale": "exp_scale",  # JAX, particles split across devices
}

DOCS_DIR = ROOT / "docs" / "benchmarks"
QUICK_DIR = ROOT / "build" / "benchmarks-quick"

CSV_FIELDS = ["experiment", "case", "method", "metric", "value", "unit", "note"]


@dataclass
class Context:
    """What an experiment gets: the mode, where to write, and the record of numbers."""

    name: str
    quick: bool
    out_dir: Path
    backend: str | None = None  # PyTensor backend of every fit (None: PyMC's default)
    device: str = "cpu"  # JAX platform of the sections that run on JAX
    records: list[dict[str, Any]] = field(default_factory=list)

    @property
    def figures_dir(self) -> Path:
        path = self.out_dir / "figures"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def figure(self, stem: str) -> tuple[Path, str]:
        """Path to save a PNG under, and the markdown that shows it in the report."""
        path = self.figures_dir / f"{self.name}_{stem}.png"
        rel = os.path.relpath(path, self.report_path.parent)
        return path, f"![{stem}]({rel})"

    @property
    def report_path(self) -> Path:
        return report_path(self.out_dir)

    def record(
        self,
        case: str,
        method: str,
        metric: str,
        value: float,
        unit: str = "",
        note: str = "",
    ) -> float:
        """One number of the report (returned, so it can be formatted where it is used)."""
        self.records.append(
            {
                "experiment": self.name,
                "case": case,
                "method": method,
                "metric": metric,
                "value": value,
                "unit": unit,
                "note": note,
            }
        )
        return value

    def record_many(
        self, case: str, method: str, values: list[tuple[str, float, str]], note: str = ""
    ) -> None:
        """Several ``(metric, value, unit)`` numbers of one case and method."""
        for metric, value, unit in values:
            self.record(case, method, metric, value, unit, note)


def fit_cost(steps: float, grads: float, seconds: float, first_call: float) -> list:
    """The cost rows every fit reports: steps, gradient evaluations, stepping and
    first-call (compilation) wall time."""
    return [
        ("steps", steps, "steps"),
        ("grad_evals", grads, "gradients"),
        ("seconds", seconds, "s"),
        ("first_call_seconds", first_call, "s"),
    ]


def report_path(out_dir: Path) -> Path:
    """``docs/benchmarks.md`` for the published run, ``report.md`` inside any other folder."""
    if out_dir.resolve() == DOCS_DIR.resolve():
        return DOCS_DIR.parent / "benchmarks.md"
    return out_dir / "report.md"


def blas_threads() -> str:
    """The thread counts of the loaded BLAS libraries, e.g. ``"1"`` or ``"1, 2"``."""
    from threadpoolctl import threadpool_info

    counts = sorted({i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"})
    return ", ".join(map(str, counts)) or "?"


def machine() -> str:
    """Machine, versions and date: the stamp of every section."""
    import arviz
    import numpy
    import pymc
    import pytensor

    import pymc_gpf

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC on {platform.node()} "
        f"({cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}); "
        f"Python {platform.python_version()}, pymc-gpf {pymc_gpf.__version__}, PyMC "
        f"{pymc.__version__}, PyTensor {pytensor.__version__}, ArviZ {arviz.__version__}, "
        f"NumPy {numpy.__version__}; BLAS threads {blas_threads()}"
    )


def run_experiment(
    name: str, quick: bool, out_dir: Path, backend: str | None = None, device: str = "cpu"
) -> None:
    """Run one experiment and write its fragment (``sections/NAME.md`` and ``NAME.csv``)."""
    from benchmarks import common

    module = importlib.import_module(f"benchmarks.{EXPERIMENTS[name]}")
    ctx = Context(name, quick, out_dir, backend, device)
    common.set_backend(backend)
    print(f"== {name}: {module.TITLE}", flush=True)
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    body = module.run(ctx)
    seconds = time.perf_counter() - start
    load = f"{load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    options = (" --quick" if quick else "") + (f" --backend {backend}" if backend else "")
    stamp = (
        f"*Measured {machine()}; PyTensor backend of the fits: {common.backend_name(backend)}; "
        f"this section of `python -m benchmarks run{options}` took {seconds / 60:.1f} min; "
        f"1-minute load average {load} ({os.cpu_count()} cores; the run itself adds about 1, "
        "the rest is other processes sharing the machine).*"
    )
    sections = out_dir / "sections"
    sections.mkdir(parents=True, exist_ok=True)
    (sections / f"{name}.md").write_text(f"## {module.TITLE}\n\n{stamp}\n\n{body.strip()}\n")
    with open(sections / f"{name}.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, CSV_FIELDS)
        writer.writeheader()
        writer.writerows(ctx.records)
    print(f"== {name}: done in {seconds / 60:.1f} min ({len(ctx.records)} numbers)", flush=True)


INTRO = """\
# Benchmarks

Regenerate with `python -m benchmarks run` (about two hours on 2 cores; `--only NAME` runs one
section: {names}). Every number below comes from a run of that script on the machine named
in its section, and every number is also in [`benchmarks.csv`]({csv}) (one row per number:
experiment, case, method, metric, value, unit). Nothing here is typed in by hand.
"""


def assemble(out_dir: Path) -> Path:
    """Rebuild the report and the joined CSV from the fragments in ``out_dir``."""
    report = report_path(out_dir)
    sections = out_dir / "sections"
    names = [n for n in EXPERIMENTS if (sections / f"{n}.md").exists()]
    joined = io.StringIO()
    writer = csv.DictWriter(joined, CSV_FIELDS)
    writer.writeheader()
    for name in names:
        with open(sections / f"{name}.csv", newline="") as fh:
            writer.writerows(csv.DictReader(fh))
    csv_path = out_dir / "benchmarks.csv"
    csv_path.write_text(joined.getvalue())
    intro = INTRO.format(names=", ".join(EXPERIMENTS), csv=os.path.relpath(csv_path, report.parent))
    parts = [intro] + [(sections / f"{n}.md").read_text() for n in names]
    missing = [n for n in EXPERIMENTS if n not in names]
    if missing:
        parts.append(f"*Not run yet: {', '.join(missing)}.*\n")
    report.write_text("\n".join(parts))
    print(f"report: {report}\nnumbers: {csv_path}")
    return report
