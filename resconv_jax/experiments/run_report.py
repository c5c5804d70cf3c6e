"""What a training task reports from its run directory, once `train.run` has finished.

In WORKDIR (and, for a depth or width sweep, in each WORKDIR/layers_<L> or dim_<d>):
training.png, loss_by_beta.png, sigma_by_beta.png and beta_table.csv from `figures`; when the
runs log a classification error, errors.png, accuracy_table.csv and layers_table.csv from
`classification`. Everything is read back from metrics.jsonl and config.json, so
`python -m resconv_jax.experiments.run_report WORKDIR` rewrites the same files for any finished (or
partly finished) run.
"""

from __future__ import annotations

import os
import sys

from etils import epath

from resconv_jax.analysis.summary import fit_floor
from resconv_jax.errors import ConfigError, WorkdirBusy, WorkdirWriteError
from resconv_jax.experiments import classification, conditioning, depth, descent, figures
from resconv_jax.runtime import workdir as wd
from resconv_jax.runtime.metrics import METRICS_FILE, read_metrics
from resconv_jax.runtime.workdir import CONFIG_FILE, WorkdirLock, read_saved_config
from resconv_jax.sweep import group_shape


def group_dirs(workdir: epath.Path) -> list[epath.Path]:
    """A depth or width sweep's per-shape run directories (layers_<L>, dim_<d>, layers_<L>_dim_<d>;
    in order of L, then d), else []."""
    found = []
    for folder in workdir.iterdir():
        if (shape := group_shape(folder.name)) is not None:
            found.append((tuple(v or 0 for v in shape), folder))
    return [folder for _, folder in sorted(found)]


def _write_one(workdir: epath.Path, config: dict, threshold: float, floor: float) -> list[str]:
    """The figures and tables of one run directory; returns the tables as printed."""
    history = read_metrics(workdir)
    if not history:
        return []
    rows = figures.write_reports(workdir, history, threshold, floor)
    summed = config.get("optim", {}).get("reduction", "sum") == "sum"
    tables = [figures.format_beta_table(rows, summed)] if len(rows) > 1 else []
    if any("step_losses" in line for line in history):
        tables.append(descent.write_descent_report(workdir, history))
    if len({line.get("dim") for line in history}) > 1:
        tables.append(conditioning.write_conditioning_report(workdir, history, config, floor))
    if len({line.get("num_layers") for line in history}) > 1:
        probe_dtype = config.get("probe", {}).get("dtype", "float32")
        tables.append(depth.write_depth_report(workdir, history, floor, probe_dtype))
    if any("error" in line for line in history):
        accuracy = classification.write_classification_report(workdir, history)
        tables.append(classification.format_accuracy_table(accuracy))
    return tables


def write_run_report(workdir) -> list[str]:
    """Every figure and table of the run in `workdir` (and its depth groups), from its files.

    Returns the tables of `workdir` itself, formatted for printing. Raises WorkdirBusy while a
    run holds the workdir, ConfigError (one line) if its config.json is unreadable.
    """
    workdir = wd.path(workdir)
    config = read_saved_config(workdir) or {}
    for name in ("optim", "report", "model", "probe"):
        if not isinstance(config.get(name, {}), dict):
            raise ConfigError(f"{workdir / CONFIG_FILE}: {name} is not a section; restore it")
    threshold = float(config.get("report", {}).get("loss_threshold", 0.0))
    floor = fit_floor(config.get("model", {}).get("dtype", "float32"))
    lock = WorkdirLock(workdir)
    lock.acquire()
    try:
        for group_dir in group_dirs(workdir):
            _write_one(group_dir, config, threshold, floor)
        return _write_one(workdir, config, threshold, floor)
    finally:
        lock.release()


RUN_LINE_KEYS = ("run", "seed", "lr", "beta_attn", "beta_ffn", "loss")  # besides "step"
USAGE = "usage: python -m resconv_jax.experiments.run_report WORKDIR (a run's folder, from main)"


def _not_a_run(workdir: epath.Path) -> str | None:
    """Why `workdir` is not a run folder that a report can be written for, or None."""
    if not workdir.exists():
        return f"{workdir}: no such folder"
    if not workdir.is_dir():
        return f"{workdir}: is a file, not a run's folder"
    if wd.is_reproduce_folder(workdir):
        names = sorted(p.name for p in workdir.iterdir() if (p / CONFIG_FILE).exists())
        return (
            f"{workdir}: is a reproduce folder (its REPORT.md is written by reproduce); "
            f"report one of its runs: {', '.join(names) or 'none yet'}"
        )
    if not (workdir / METRICS_FILE).exists():
        return f"{workdir}: not a run's folder (no {METRICS_FILE}; main writes one)"
    lines = read_metrics(workdir)
    if not lines:
        return f"{workdir / METRICS_FILE}: holds no valid metrics line"
    for number, line in enumerate(lines, 1):
        lacking = [key for key in RUN_LINE_KEYS if key not in line]
        if lacking:
            return (
                f"{workdir}: cannot report this run ({METRICS_FILE} line {number} has no "
                f"{', '.join(lacking)}: not a line of main's)"
            )
        not_numbers = [key for key in RUN_LINE_KEYS if not _is_number(line[key])]
        if not_numbers:
            return (
                f"{workdir}: cannot report this run ({METRICS_FILE} line {number}: "
                f"{', '.join(f'{k}={line[k]!r}' for k in not_numbers)} is not a number)"
            )
    return None


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def main(argv: list[str]) -> int:
    """The command line: one line and exit status 2 for bad input, 3 for a busy workdir, 4 for
    a write that failed (as main's); 0 with the tables printed."""
    if len(argv) == 2 and argv[1] in ("-h", "--help"):
        print(USAGE)
        return 0
    if len(argv) != 2:
        print(f"error: {USAGE}", file=sys.stderr)
        return 2
    workdir = wd.path(os.path.expanduser(argv[1]))
    problem = _not_a_run(workdir)
    try:
        if problem is None:
            for table in write_run_report(workdir):
                print(table)
            return 0
    except WorkdirBusy as error:
        print(f"error: {error}", file=sys.stderr)
        return 3
    except WorkdirWriteError as error:  # a figure or table that cannot be written
        print(f"error: {error}", file=sys.stderr)
        return 4
    except (ValueError, KeyError, TypeError) as error:  # ConfigError, or lines of another kind
        problem = f"{workdir}: cannot report this run ({type(error).__name__}: {error})"
    print(f"error: {problem}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
