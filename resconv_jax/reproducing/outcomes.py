"""One experiment of `reproduce`: run, resumed, reused or replaced by its fallback.

`run_experiment` is what `reproduce` does per experiment, in its own process (`--jobs=1`) or in a
worker (`workers`): it reuses a finished, intact run (`unfinished_reason`: the checks a resume
makes), resumes a damaged or interrupted one, runs a new one, and turns an error that stops it
into a "not run" `Outcome`.
"""

from __future__ import annotations

import dataclasses
import os
import time

import jax

from resconv_jax import experiments
from resconv_jax.errors import TrainingDiverged, WeightsNotFound, WorkdirBusy, WorkdirWriteError
from resconv_jax.experiments.record import Experiment
from resconv_jax.runtime import compile_clock
from resconv_jax.runtime import workdir as wd
from resconv_jax.runtime.workdir import read_saved_config


@dataclasses.dataclass
class Outcome:
    """What happened to one experiment in this invocation."""

    experiment: Experiment
    workdir: str
    status: str  # "ran", "resumed" (found unfinished or damaged), "reused" or "not run"
    seconds: float | None
    tables: list[str]
    reason: str = ""
    missing_weights: bool = False  # stopped because the pretrained weights were not found
    label: str = ""  # prefixed to the notes of its claims
    wall: float = 0.0  # seconds this invocation spent on it (reused: the checks and the report)
    # Of `wall`: the CPU seconds of its process, every thread's (XLA's) included; the seconds
    # making its programs (tracing, lowering, compiling or loading from the compilation cache:
    # `compile_clock`), its reports' included; the seconds writing its report after the run
    # (`experiments.report_tables`: figures and tables). None: unknown (its worker died, and its
    # counts with it).
    cpu: float | None = 0.0
    compiling: float | None = 0.0
    reporting: float | None = 0.0

    def status_line(self) -> str:
        """'   NAME: STATUS, SECONDS s (compiling C s, reports R s)', as printed when it is
        done."""
        line = f"   {self.experiment.name}: {self.status}, {self.wall:.1f} s"
        if self.compiling is None or self.reporting is None:
            return line
        return f"{line} (compiling {self.compiling:.1f} s, reports {self.reporting:.1f} s)"


def unfinished_reason(config, workdir: str) -> str | None:
    """None when `workdir` holds this config's result, finished and intact (its task's
    `why_unfinished`), else why not; "" when it holds nothing (or only a lock)."""
    folder = wd.path(workdir)
    if not folder.exists():
        return ""
    if read_saved_config(workdir) is None:
        held = sorted(p.name for p in folder.iterdir() if p.name not in (".lock", wd.CONFIG_FILE))
        return f"{wd.CONFIG_FILE} is missing (the folder holds {', '.join(held)})" if held else ""
    return experiments.task_module(config.task).why_unfinished(config, workdir)


def _x64(config):
    """The x64 setting that `config`'s run, and the checks of its files, need."""
    return jax.enable_x64(config.model.dtype == "float64" or config.probe.dtype == "float64")


def finished_before(experiment: Experiment, scale: str, root: str) -> bool:
    """Whether `root` holds `experiment`'s finished, intact result at `scale` (its own, or, when
    its own folder holds no run, its fallback's: `run_experiment` then reuses that one unless
    the pretrained weights are found now, and runs the experiment itself). A folder that cannot
    be read (an unreadable config.json) is not finished: `run_experiment` says why."""
    for candidate in (experiment, experiment.fallback):
        if candidate is None:
            return False
        config = candidate.load(scale)
        try:
            with _x64(config):
                problem = unfinished_reason(config, os.path.join(root, candidate.name))
        except ValueError:  # ConfigError: `run_experiment` meets it again and reports it
            return False
        if problem != "":
            return problem is None
    return False


def _run_one(experiment: Experiment, scale: str, root: str, times: dict) -> Outcome:
    config = experiment.load(scale)
    task = experiments.task_module(config.task)
    workdir = os.path.join(root, experiment.name)
    print(f"== {experiment.name}: {experiment.title} ({workdir})", flush=True)
    with _x64(config):
        problem = unfinished_reason(config, workdir)
        if problem is None:
            wd.WorkdirLock(workdir).refuse_if_held()  # a run still writing it: not run, busy
            tables, reporting = _timed_reports(task, workdir)
            seconds = times.get(experiment.name, {}).get("seconds")
            print(f"   finished before: reused ({workdir})", flush=True)
            return Outcome(experiment, workdir, "reused", seconds, tables, reporting=reporting)
        status, reason = "ran", ""
        if problem:
            status, reason = "resumed", f"not reusable: {problem}"
            print(f"   {reason}", flush=True)  # the run then resumes, or says why it cannot
        start = time.perf_counter()
        task.run(config, workdir)
        tables, reporting = _timed_reports(task, workdir)
        for text in tables:
            print(text, flush=True)
        seconds = time.perf_counter() - start
        return Outcome(experiment, workdir, status, seconds, tables, reason, reporting=reporting)


def _timed_reports(task, workdir: str) -> tuple[list[str], float]:
    """`experiments.report_tables` of the task's finished `workdir`, and the seconds it took."""
    start = time.perf_counter()
    tables = experiments.report_tables(task, workdir)
    return tables, time.perf_counter() - start


def _attempt(experiment: Experiment, scale: str, root: str, times: dict) -> Outcome:
    try:
        return _run_one(experiment, scale, root, times)
    except (ValueError, TrainingDiverged, WorkdirBusy, WorkdirWriteError) as error:
        reason = str(error).splitlines()[0]
        print(f"   not run: {reason}", flush=True)
        workdir = os.path.join(root, experiment.name)
        missing = isinstance(error, WeightsNotFound)
        return Outcome(experiment, workdir, "not run", None, [], reason, missing)


def run_experiment(experiment: Experiment, scale: str, root: str, times: dict) -> Outcome:
    """Runs, resumes or reuses `experiment` at `scale` in `root`/its name, or its fallback when
    its weights are not found; an error that stops it (bad input, including data and weights:
    ValueError; divergence; a busy or unwritable workdir) becomes a "not run" outcome.
    Preempted is raised: the whole command stops, and a rerun resumes."""
    start, cpu_start, compile_start = (
        time.perf_counter(),
        time.process_time(),
        compile_clock.seconds(),
    )
    outcome = _attempt(experiment, scale, root, times)
    outcome.label = experiment.label
    fallback = experiment.fallback
    if outcome.missing_weights and fallback is not None:
        print(f"   weights unavailable: running {fallback.name} instead ({fallback.title})",
              flush=True)  # fmt: skip
        substitute = _attempt(fallback, scale, root, times)
        substitute.label = f"{fallback.label} ({outcome.reason})"
        outcome = substitute
    outcome.wall = time.perf_counter() - start
    outcome.cpu = time.process_time() - cpu_start
    outcome.compiling = compile_clock.seconds() - compile_start
    print(outcome.status_line(), flush=True)
    return outcome
