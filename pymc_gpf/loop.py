"""The fit loop: call the compiled step, hand each result to the fit, show progress.

PyMC's conventions: its progress bar, callbacks ``cb(approx, hist, i)`` that may raise
``StopIteration``, and ``KeyboardInterrupt`` returning the fit so far.
"""

from __future__ import annotations

import logging
import math

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from contextvars import ContextVar

import numpy as np

from pymc.progress_bar import CustomProgress
from rich.console import Console
from rich.progress import BarColumn, TaskProgressColumn, TextColumn, TimeElapsedColumn

from pymc_gpf.control import Outcome
from pymc_gpf.options import FitOptions
from pymc_gpf.record import FitRecord
from pymc_gpf.stepgraph import CompiledStep

__all__ = ["fit_outcome", "progress_text", "run_steps", "show_finished"]

logger = logging.getLogger("pymc_gpf")
# numba compiles at the first call: tens of seconds for a model new to this machine, about a
# second once its on-disk cache holds the step
COMPILING = "compiling the step (cached on disk for the next run)…"
# the progress display of the fit whose loop is running: a fit run as a stage inside it
# (GPF continuing with GF's fresh draws) adds its own line there, shown if the outer one is
_LIVE: ContextVar[CustomProgress | None] = ContextVar("pymc_gpf_live_progress", default=None)


def run_steps(
    step: CompiledStep,
    n: int,
    *,
    start: int,
    title: str,
    observe: Callable[[float, dict[str, float]], tuple[float, str | None]],
    describe: Callable[[float, dict[str, float], str], str],
    finish: Callable[[FitRecord], None],
    callbacks: Sequence[Callable],
    approx,
    progressbar: bool,
    theme,
    stops_itself: bool = False,
) -> FitRecord:
    """At most ``n`` steps. ``observe(free_energy, info)`` returns the step size and a stop
    code (or ``None``); ``describe(free_energy, info, stop)`` the progress text;
    ``finish(result)`` records the steps done, whatever ends the loop. ``result`` is a
    fragment of the fit's record (:class:`~pymc_gpf.record.FitRecord`): the free energies
    and step sizes of the steps done, why the run stopped and which step failed."""
    scores, sizes = np.full(n, np.nan), np.full(n, np.nan)
    done = 0
    result = FitRecord(scores, sizes)
    outer = _LIVE.get()
    if outer is not None:
        title = f"  then {title[0].lower()}{title[1:]}"
    if outer is None:
        display = _display(stops_itself, progressbar, theme)
    else:
        display = nullcontext(outer)
    live = None
    try:
        with display as progress:
            live = _LIVE.set(progress)
            task = progress.add_task(title, total=n, loss="" if step.calls else COMPILING)
            for i in range(n):
                free_energy, ok, *values = step()
                info = dict(zip(step.info, (float(v) for v in values), strict=True))
                if not ok:
                    result.failure = start + i
                    # the state before this step had a non-finite free energy, so the guard
                    # rolled back one more step: its history entry goes too
                    result.rolled_back = step.graph.guarded and not np.isfinite(free_energy)
                    result.reason = "divergence"
                    break
                scores[i] = free_energy
                sizes[i], stop = observe(float(free_energy), info)
                done = i + 1
                if done % 10 == 0 or done in (1, n) or stop is not None:
                    progress.update(task, completed=done, loss=describe(free_energy, info, ""))
                for callback in callbacks:
                    callback(approx, scores[:done], start + done)
                if stop is not None:
                    result.reason = stop
                    text = describe(free_energy, info, stop)
                    progress.update(task, completed=done, loss=text)
                    break
    except StopIteration as stop:
        logger.info(str(stop))
        result.reason = "callback"
    except KeyboardInterrupt:
        logger.info("Interrupted at step %d; returning the fit so far.", start + done)
        result.reason = "interrupted"
    finally:
        if live is not None:
            _LIVE.reset(live)
        result.free_energy, result.step_sizes = scores[:done], sizes[:done]
        finish(result)
    return result


def show_finished(title: str, steps: int, text: str, progressbar: bool, theme=None) -> None:
    """The progress display of a run done elsewhere (a stage's steps adopted as the run's):
    one finished line."""
    with _display(True, progressbar, theme) as progress:
        progress.add_task(title, total=steps, completed=steps, loss=text)


def _display(stops_itself: bool, progressbar: bool, theme) -> CustomProgress:
    """A fit's progress display: its columns, then the text of how it stands."""
    columns = (*progress_columns(stops_itself), TextColumn("{task.fields[loss]}"))
    return CustomProgress(*columns, console=_console(theme), disable=not progressbar)


PROGRESS_WIDTH = 120  # columns of the progress line in a log or a notebook (not a terminal)


def _console(theme) -> Console:
    console = Console(theme=theme)
    if not console.is_terminal:  # rich would cut a log's line at 80 columns
        console = Console(theme=theme, width=max(console.width, PROGRESS_WIDTH))
    return console


def progress_columns(stops_itself: bool) -> list:
    """The steps done and the time; a bar and a percentage only for a fit that runs the
    steps asked for (for one that stops by itself, they would be of the step cap)."""
    steps = TextColumn("step {task.completed:,.0f}")
    if stops_itself:
        return [TextColumn("{task.description}"), steps, TimeElapsedColumn()]
    return [TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), steps,
            TimeElapsedColumn()]  # fmt: skip


def fit_outcome(reason: str, n: int, steps: int, options: FitOptions, message: str) -> Outcome:
    """How a call of ``n`` steps ended, after ``steps`` steps in all; ``message`` is the
    controller's description of ``reason``."""
    converged: bool | None = reason == "converged"
    if reason == "max_steps":
        message = f"{message} ({n} steps this call); continue with approx.refine(n)"
        if not options.auto and options.tol is None:
            converged = None  # nothing was tested
            message = f"ran the {n} steps asked for (fixed step size, no stopping test)"
    return Outcome(converged, reason, steps, message)


def progress_text(
    free_energy: float, info: dict[str, float], options: FitOptions, stop: str, rate: float,
    stage: str = "",
) -> str:  # fmt: skip
    """The progress bar's text: free energy, step size, distance to the fixed point (in the
    units of ``tol``) or the controller's ``stage`` of its stop test, and how the fit
    ended."""
    text = f"F = {float(free_energy):,.6g}"
    if "step_size" in info:
        text += f", step size {info['step_size']:.2g}"
    elif options.auto:
        text += f", step size {rate:.2g}"
    if "decrement" in info and options.tol:
        distance = math.sqrt(max(info["decrement"], 0.0))
        text += f", distance {distance:.2g} (tol {options.tol:g})"
    elif stage:
        text += f", {stage}"
    return f"{text}; {stop.split(':')[0]}" if stop else text
