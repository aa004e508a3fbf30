"""The README's snippet runs as written and prints what the README says it prints: a
converged, trustworthy fit (a newcomer's first fit must not read like a failure)."""

from __future__ import annotations

import contextlib
import io
import re

from pathlib import Path

import matplotlib

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_readme_snippet_prints_what_the_readme_shows():
    matplotlib.use("Agg")
    text = README.read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    shown = re.search(r"It prints.*?```text\n(.*?)```", text, re.S).group(1).splitlines()
    namespace: dict = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), namespace)
    approx = namespace["approx"]
    assert approx.outcome.converged and approx.outcome.verdict == "trustworthy"
    printed = [line for line in out.getvalue().splitlines() if line.strip()]
    assert printed[-3:-1] == shown[-3:-1]  # the outcome's message and the verdict
    assert printed[-1].split()[0] == shown[-1].split()[0]  # the free energy
