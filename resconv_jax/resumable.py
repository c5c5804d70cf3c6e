"""What a workdir already holds, checked before `train.run` starts or resumes there: the config
its run started with (config.json, else a checkpoint's copy) against the one given, a folder that
holds what is not a run of main's, and the step sizes that lr_rule=lambda_max chose at the first
start. Reads only."""

from __future__ import annotations

import dataclasses
import json

from etils import epath

from resconv_jax.config_defaults import base_config_json
from resconv_jax.errors import ConfigError
from resconv_jax.finished import RUNS_FILE, checkpoint_steps, refuse_fewer_steps
from resconv_jax.runtime import workdir as wd
from resconv_jax.runtime.checkpoint import Checkpointer
from resconv_jax.runtime.metrics import METRICS_FILE
from resconv_jax.runtime.workdir import CONFIG_FILE, check_same_run, read_saved_config
from resconv_jax.sweep import group_shape


def saved_config(workdir: epath.Path) -> tuple[dict | None, str]:
    """The config the workdir's run started with: config.json, else the newest checkpoint's copy.

    Raises ConfigError if checkpoints exist but none of them (and no config.json) says which
    config they belong to. Creates nothing.
    """
    saved = read_saved_config(workdir)
    if saved is not None:
        return saved, CONFIG_FILE
    if not checkpoint_steps(workdir):
        return None, ""
    checkpointer = Checkpointer(workdir, every=1, keep=1, use_async=False)  # reads only
    try:
        steps = checkpointer.steps()
        for step in reversed(steps):
            meta = checkpointer.read_meta(step) or {}
            if isinstance(meta.get("config"), dict):
                return meta["config"], f"the checkpoint of step {step} ({CONFIG_FILE} is missing)"
    finally:
        checkpointer.close()
    raise ConfigError(
        f"{workdir / CONFIG_FILE} is missing and no checkpoint in {checkpointer.directory} holds "
        "a copy of the config: cannot check that this config is the run's; restore config.json, "
        "or use a new --workdir"
    )


def check_resumable(config, workdir: epath.Path, *, sweep: bool = False) -> dict:
    """`config` as JSON, once checked against the run that `workdir` holds, if any: ConfigError
    for another config or a run past train.num_steps. `sweep`: `workdir` is the top folder of a
    depth or width sweep, whose groups check their own config.json. Writes nothing."""
    config_json = json.loads(config.to_json_best_effort())
    saved, where = saved_config(workdir)
    if saved is not None:
        check_same_run(workdir, saved, config_json, where, base_config_json())
    else:
        _refuse_other_files(workdir, sweep)
    refuse_fewer_steps(config, [workdir])
    return config_json


def _refuse_other_files(workdir: epath.Path, sweep: bool) -> None:
    """ConfigError for a folder without a run of main's (no config.json, no checkpoint) that
    holds what a start would overwrite or mix with: a metrics.jsonl (unless, for a `sweep`,
    beside the groups of a sweep, each with its config.json), a reproduce folder, or, for one
    run, the groups of a sweep."""
    if wd.is_reproduce_folder(workdir):
        raise ConfigError(
            f"--workdir={workdir} is a reproduce folder (REPORT.md): give main a folder of its own"
        )
    folders = [p for p in workdir.iterdir() if p.is_dir()] if workdir.exists() else []
    groups = sorted(
        p.name for p in folders if group_shape(p.name) is not None and (p / CONFIG_FILE).exists()
    )
    if groups and not sweep:
        raise ConfigError(
            f"--workdir={workdir} holds the runs of a sweep ({', '.join(groups)}) without its "
            f"{CONFIG_FILE}: rerun that sweep's command (each group's {CONFIG_FILE} is checked) "
            "or use a new --workdir"
        )
    if (workdir / METRICS_FILE).exists() and not groups:
        raise ConfigError(
            f"--workdir={workdir} holds a {METRICS_FILE} but neither {CONFIG_FILE} nor a "
            "checkpoint, so no run this can resume; use a new --workdir, or remove the file"
        )


def recorded_kernel_lrs(config, workdir: epath.Path, runs) -> tuple[list, bool]:
    """(runs, True) with the step sizes that lr_rule=lambda_max chose at the run's first start,
    read from its runs.json, so that a resume keeps them: computed again, on another device count
    or microbatch size, λ_max differs in its last bits, and every metrics line and checkpoint of
    the run would look like another run's. (runs, False) when there is no such record."""
    if config.optim.lr_rule != "lambda_max":
        return runs, False

    def without_lr(settings: dict) -> dict:
        return {k: v for k, v in settings.items() if k != "lr"}

    try:
        recorded = json.loads((workdir / RUNS_FILE).read_text())
        same = [without_lr(r) for r in recorded] == [without_lr(run.settings()) for run in runs]
    except (OSError, ValueError, TypeError, AttributeError):  # none, torn, or not a list of runs
        return runs, False
    if not same:
        return runs, False
    return [
        dataclasses.replace(run, lr=r["lr"]) for run, r in zip(runs, recorded, strict=True)
    ], True
