"""The suite: its sections, the context they record into, and the report.

A section is a function ``run(ctx) -> markdown`` registered in its module's ``SECTIONS``
(name -> title, function). Every number it reports goes through :meth:`Context.record` (one
CSV row each), every figure through :meth:`Context.figure`, and its prose is a template in
``benchmarks/prose.md`` (:meth:`Context.text`). Each section's output is a fragment
(``sections/NAME.md`` and ``NAME.csv``) stamped with the machine, versions and date of its run,
so ``--only NAME`` refreshes one section; the report and the joined CSV are rebuilt from all
fragments present. The full run writes ``docs/benchmarks.md`` (fragments, figures and
``benchmarks.csv`` under ``docs/benchmarks/``), ``--quick`` ``build/benchmarks-quick/``.
"""

from __future__ import annotations

import csv
import datetime
import importlib
import io
import os
import platform
import re
import time

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOCS_DIR = ROOT / "docs" / "benchmarks"
QUICK_DIR = ROOT / "build" / "benchmarks-quick"
CSV_FIELDS = ["experiment", "case", "method", "metric", "value", "unit", "note"]
# the report's order: section -> module of this package
EXPERIMENTS = {
    "logistic": "papers",  # paper Fig. 6
    "bnn": "papers",  # paper Table 1
    "wvgd": "papers",  # WVGD paper
    "reference": "accuracy",  # posteriordb + inference-gym ground truth
    "hard": "accuracy",  # posteriors the defaults were never tuned on, NUTS references
    "minibatch": "accuracy",  # pm.Minibatch at defaults, closed-form posterior
    "type2": "accuracy",  # more_obj_params at defaults, closed-form ML-II optimum
    "speed": "speed",  # per-step cost, scaling with D and N
    "startup": "speed",  # time to the first step, cold and warm cache
    "scale": "speed",  # JAX, particles split across devices
}
_PROSE = Path(__file__).with_name("prose.md")


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
        """A setting's value in this mode."""
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
        """The prose template ``@@ key`` of ``prose.md``, its paragraphs joined, formatted."""
        blocks = re.split(r"^@@ (\S+)( verbatim)?\n", _PROSE.read_text(), flags=re.M)[1:]
        found = {k: (v, raw) for k, raw, v in zip(*[iter(blocks)] * 3, strict=True)}
        text, raw = found[key]
        text = text.strip() if raw else re.sub(r"(?<!\n)\n(?!\n)", " ", text.strip())
        return text.format(**values)


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


def run_experiment(name: str, quick: bool, out_dir: Path, backend: str | None = None,
                   device: str = "cpu") -> None:  # fmt: skip
    """Run one section and write its fragment (``sections/NAME.md`` and ``NAME.csv``)."""
    from benchmarks import harness

    title, run = importlib.import_module(f"benchmarks.{EXPERIMENTS[name]}").SECTIONS[name]
    ctx = Context(name, quick, out_dir, backend, device)
    harness.set_backend(backend)
    print(f"== {name}: {title}", flush=True)
    load_before, start = os.getloadavg()[0], time.perf_counter()
    body = run(ctx)
    seconds = time.perf_counter() - start
    options = (" --quick" if quick else "") + (f" --backend {backend}" if backend else "")
    stamp = (
        f"*Measured {machine()}; PyTensor backend of the fits: {harness.backend_name(backend)}; "
        f"this section of `python -m benchmarks run{options}` took {seconds / 60:.1f} min; "
        f"1-minute load average {load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the "
        f"end ({os.cpu_count()} cores; the run itself adds about 1, the rest is other processes "
        "sharing the machine).*"
    )
    (out_dir / "sections").mkdir(parents=True, exist_ok=True)
    (out_dir / "sections" / f"{name}.md").write_text(f"## {title}\n\n{stamp}\n\n{body.strip()}\n")
    with open(out_dir / "sections" / f"{name}.csv", "w", newline="") as fh:
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
    report, sections = report_path(out_dir), out_dir / "sections"
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
