"""Tasks and experiments by name.

A task (`config.task = NAME`) is a module `experiments/NAME.py` with

    run(config, workdir) -> list[dict]          the per-run summaries ([] when nothing trains)
    report(workdir) -> list[str]                its figures and tables, from the files; the tables
    why_unfinished(config, workdir) -> str | None   None when the folder holds this config's
                                                finished, intact result; else why not
    describe_sizes(config) -> str               one line: the sizes it runs at

(`training`: train.run and the training report; `rank_collapse`: spectra at initialization).
An experiment module lists its `EXPERIMENTS` (`record.Experiment`: a config file, its variant per
scale, the claims it backs); `reproduce` walks them all. Adding a task or an experiment is one
new module here (and its config file); no list elsewhere changes. The trainer imports nothing
from here.
"""

from __future__ import annotations

import functools
import json
import math
from types import ModuleType

import jax

from resconv_jax.by_name import import_providing, modules_providing, package_modules
from resconv_jax.errors import ConfigError
from resconv_jax.experiments import results_cache
from resconv_jax.finished import SUMMARY_FILE
from resconv_jax.runtime import workdir as wd
from resconv_jax.validation import check_workdir, validate_config

_TASK_FUNCTIONS = ("run", "report", "why_unfinished", "describe_sizes")


@functools.cache
def task_names() -> tuple[str, ...]:
    """The tasks that exist: the modules here with every function of a task."""
    return modules_providing(__name__, __path__, _TASK_FUNCTIONS)


def task_module(name: str) -> ModuleType:
    """The module of task `name`; ConfigError (one line) naming the tasks for any other."""
    module = import_providing(__name__, __path__, name, _TASK_FUNCTIONS)  # the others unimported
    if module is None:
        raise ConfigError(f"config.task={name!r}: expected one of {', '.join(task_names())}")
    return module


@functools.cache
def experiment_list() -> tuple:
    """Every experiment of every module here (`EXPERIMENTS`), in the order of the claims table:
    each at its first claim's place."""
    modules = package_modules(__name__, __path__)
    records = [record for module in modules for record in getattr(module, "EXPERIMENTS", ())]
    return tuple(sorted(records, key=lambda record: record.rank))


def run_task(config, workdir: str, *, reuse_finished: bool = False) -> list[dict]:
    """Runs `config.task` in `workdir` and prints its report's tables (process 0); returns the
    per-run summaries. Raises what the task raises (`train.run`: see there), with nothing
    reported.

    `reuse_finished` (one process only): when the workdir already holds this config's finished,
    intact result (the task's `why_unfinished`, from the files alone), nothing is built or
    compiled: the summaries are read back and the report is `report_tables`'s.
    """
    task = task_module(config.task)
    if reuse_finished and _holds_finished(task, config, workdir):
        print(
            f"--workdir={workdir} holds this config's run, finished and intact: nothing to "
            "train (a new --workdir trains it again)",
            flush=True,
        )
        summaries = read_summaries(workdir)
    else:
        summaries = task.run(config, workdir)
    if jax.process_index() == 0:
        for table in report_tables(task, workdir):
            print(table, flush=True)
    return summaries


def report_tables(task: ModuleType, workdir: str) -> list[str]:
    """The task's report of `workdir` (its figures and tables written, the tables returned);
    when nothing under `workdir` and nothing in the code changed since it was last written,
    the tables it returned then, with nothing written (`results_cache`)."""
    name = f"report:{task.__name__}:{workdir}"
    return results_cache.cached(workdir, name, lambda: task.report(workdir))


def _holds_finished(task: ModuleType, config, workdir: str) -> bool:
    validate_config(config)
    check_workdir(workdir)  # a store that cannot be reached: its one line, before any read
    if jax.process_count() > 1 or not wd.path(workdir).is_dir():
        return False
    if task.why_unfinished(config, workdir) is not None:
        return False
    # A run still writing its last files: WorkdirBusy, as for any second process, before
    # anything is said.
    wd.WorkdirLock(workdir).refuse_if_held()
    return True


def read_summaries(workdir: str) -> list[dict]:
    """The per-run summaries of a finished workdir (its summary.json, null read back as NaN; []
    when it has none, as a task that trains nothing)."""
    target = wd.path(workdir) / SUMMARY_FILE
    if not target.exists():
        return []
    summaries = json.loads(target.read_text())
    return [{k: math.nan if v is None else v for k, v in s.items()} for s in summaries]
