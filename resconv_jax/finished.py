"""Whether a workdir holds a config's training run, finished and intact, from its files alone.

`reproduce` reuses a run only when `why_unfinished` finds nothing wrong: the checks a resume makes
(config.json is this config's, metrics.jsonl holds every run's line at every logged step up to
train.num_steps and nothing else, the latest checkpoint's record of the lines before it matches
them, its arrays read and match the content hashes saved with them), and summary.json is what
those lines give. No model is built and nothing is written.
"""

from __future__ import annotations

import json
import os
from collections import Counter

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from resconv_jax.analysis.summary import fit_floor, run_summaries
from resconv_jax.config_defaults import base_config_json
from resconv_jax.errors import ConfigError
from resconv_jax.runtime import workdir as wd
from resconv_jax.runtime.checkpoint import host_state_digest, is_saved_meta, quiet_failed_io
from resconv_jax.runtime.metrics import METRICS_FILE, lines_digest, read_metrics_lines, valid_prefix
from resconv_jax.runtime.workdir import CONFIG_FILE, json_safe, read_saved_config, run_changes
from resconv_jax.sweep import expand_runs, group_config, group_folder, group_runs

SUMMARY_FILE = "summary.json"
# The expanded sweep, one entry per run with the settings it trains with (config.json holds the
# config as given: its model.beta_attn is not what a β sweep's runs use; lr_rule=lambda_max's η).
RUNS_FILE = "runs.json"
CHECKPOINTS = "checkpoints"


def why_unfinished(config, workdir) -> str | None:
    """None when `workdir` holds `config`'s training run, finished and intact; else the first
    problem found, in a few words ("metrics.jsonl ends at step 120 of 300"). ConfigError when
    config.json is unreadable."""
    folder = wd.path(workdir)
    groups = group_runs(expand_runs(config))
    if len(groups) == 1:
        shape, runs = groups[0]
        return _why_group_unfinished(group_config(config, shape), folder, len(runs))[0]
    problem = why_config_differs(config, folder)
    if problem:
        return problem
    lines, summaries = [], []
    for shape, runs in groups:
        group_dir = folder / group_folder(shape)
        problem, prefix, summary = _why_group_unfinished(
            group_config(config, shape), group_dir, len(runs)
        )
        if problem:
            return f"{group_folder(shape)}: {problem}"
        lines += prefix
        summaries += summary
    if _text(folder / METRICS_FILE) != "".join(text for text, _ in lines):
        return f"{METRICS_FILE} is not the merge of its groups' files"
    if _json(folder / SUMMARY_FILE) != summaries:
        return f"{SUMMARY_FILE} is not the merge of its groups' files"
    return None


def checkpoint_steps(folder) -> list[int]:
    """The steps of the checkpoint folders in FOLDER/checkpoints, ascending ([] if none)."""
    directory = wd.path(folder) / CHECKPOINTS
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def trained_to(folder, log_every: int) -> int:
    """The furthest step that FOLDER's checkpoints or metrics lines reach (0 for none). A step
    of the metrics counts when every logged step up to it holds as many lines as step 0 (one
    per run) and the steps rise by at most `log_every`: a damaged line's step is not a step the
    run reached."""
    counts = Counter(record["step"] for _, record in read_metrics_lines(folder))
    reached, runs = 0, counts.get(0, 0)
    for step in sorted(counts):
        if step - reached > log_every or counts[step] != runs:
            break
        reached = step
    return max([reached, *checkpoint_steps(folder)])


def refuse_fewer_steps(config, folders) -> None:
    """Raises ConfigError when a run in one of `folders` is past train.num_steps: a run is never
    cut back (its later lines and checkpoints would be deleted)."""
    total = config.train.num_steps
    for folder in folders:
        reached = trained_to(folder, config.train.log_every)
        if reached > total:
            raise ConfigError(
                f"--workdir={folder} holds a run trained to step {reached}, beyond "
                f"train.num_steps={total}: a run is not cut back; read step {total} in its "
                f"{METRICS_FILE}, or use a new --workdir to train {total} steps"
            )


def why_config_differs(config, folder) -> str | None:
    """None when FOLDER/config.json is `config`'s run (`workdir.run_changes`: a change that a
    resume accepts, such as train.print_every, is the same run), else why not."""
    saved = read_saved_config(folder)
    if saved is None:
        return f"no {CONFIG_FILE}"
    current = json.loads(config.to_json_best_effort())
    if changed := run_changes(saved, current, base_config_json()):
        fields = ", ".join(name for name, _, _ in changed[:3])
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        return f"{CONFIG_FILE} holds another config ({fields}{more})"
    return None


def _why_group_unfinished(config, folder, num_runs: int) -> tuple[str | None, list, list]:
    """The checks of one program's run directory (R = `num_runs` runs): (the first problem or
    None, its metrics lines as (text, record), its summary.json)."""
    problem = why_config_differs(config, folder)
    if problem:
        return problem, [], []
    settings = _json(folder / RUNS_FILE)
    if not (isinstance(settings, list) and len(settings) == num_runs) or not all(
        isinstance(run, dict) for run in settings
    ):
        return f"{RUNS_FILE} is missing or does not list the sweep's {num_runs} runs", [], []
    lines = read_metrics_lines(folder)
    total, log_every = config.train.num_steps, config.train.log_every
    prefix, _ = valid_prefix(lines, settings, log_every)
    last = prefix[-1][1]["step"] if prefix else None
    if last != total:
        where = f"ends at step {last}" if prefix else "has no valid line"
        return f"{METRICS_FILE} {where} of {total}", [], []
    if _text(folder / METRICS_FILE) != "".join(text for text, _ in prefix):
        return f"{METRICS_FILE} holds more than its valid lines (a torn or foreign line)", [], []
    problem = _why_checkpoint_disagrees(folder, prefix, total)
    if problem:
        return problem, [], []
    history = [record for _, record in prefix]
    expected = json_safe(run_summaries(history, settings, fit_floor(config.model.dtype)))
    summary = _json(folder / SUMMARY_FILE)
    if summary != json.loads(json.dumps(expected)):
        return f"{SUMMARY_FILE} is missing or disagrees with {METRICS_FILE}", [], []
    return None, prefix, summary


def _why_checkpoint_disagrees(folder, prefix, total: int) -> str | None:
    """The latest checkpoint, which a finished run saves at its last step `total`, and its
    record of the metrics lines before its step, against the file."""
    directory = folder / CHECKPOINTS
    steps = checkpoint_steps(folder)
    if not steps:
        return f"no checkpoint in {CHECKPOINTS}/"
    if steps[-1] != total:
        return f"the latest checkpoint is of step {steps[-1]}, not of the last step {total}"
    meta_dir = directory / str(steps[-1]) / "meta"
    try:  # read only: a CheckpointManager would want to own (and create) the folder
        meta = ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(meta_dir)
    except Exception:  # noqa: BLE001 - any failure to read means the resume decides
        return f"the metadata in {meta_dir} cannot be read"
    saved = meta.get("metrics_sha256") if isinstance(meta, dict) else None
    before = [text for text, record in prefix if record["step"] < steps[-1]]
    if saved is not None and saved != lines_digest(before):
        return f"{METRICS_FILE} was changed after the checkpoint of step {steps[-1]}"
    if not is_saved_meta(meta, steps[-1]):
        return f"the checkpoint of step {steps[-1]} has damaged metadata"
    state_dir = directory / str(steps[-1]) / "state"
    if wd.is_local(state_dir):  # Orbax finds no metadata under a relative path
        state_dir = wd.path(os.path.abspath(state_dir))
    quiet_failed_io()  # a damaged file's debris goes to the log, not to stderr
    verbosity = logging.get_verbosity()
    logging.set_verbosity(logging.ERROR)  # Orbax warns that the state has no metadata file
    try:  # as saved (NumPy, no target): its leaves' content hashes, compared as a multiset
        reader = ocp.PyTreeCheckpointer()
        as_numpy = jax.tree.map(
            lambda _: ocp.RestoreArgs(restore_type=np.ndarray),
            reader.metadata(state_dir).item_metadata.tree,
            is_leaf=lambda node: not isinstance(node, dict | list | tuple),
        )
        state = reader.restore(state_dir, restore_args=as_numpy)
        hashes = sorted(host_state_digest(state).values())
    except Exception:  # noqa: BLE001 - any failure to read means the resume decides
        return f"the checkpoint of step {steps[-1]} cannot be read"
    finally:
        logging.set_verbosity(verbosity)
    if hashes != sorted(meta["digest"].values()):
        return f"the checkpoint of step {steps[-1]} does not match its content hashes"
    return None


def _text(target) -> str | None:
    try:
        return target.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _json(target):
    text = _text(target)
    try:
        return None if text is None else json.loads(text)
    except json.JSONDecodeError:
        return None
