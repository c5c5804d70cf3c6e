"""Preemption and resumption: SIGKILL, SIGTERM, a corrupt latest checkpoint."""

import os
import signal
import subprocess
import sys
import time

import pytest

from resconv_jax import train
from resconv_jax.config_defaults import load_config_file
from resconv_jax.runtime.checkpoint import Checkpointer
from resconv_jax.runtime.metrics import METRICS_FILE

ROOT = os.path.join(os.path.dirname(__file__), "..")
TINY = os.path.join(ROOT, "configs", "tiny.py")
# Frequent synchronous checkpoints make the run slow enough to interrupt half way.
LONG = {
    "train.num_steps": 600,
    "train.checkpoint_every": 10,
    "train.keep_checkpoints": 2,
    "train.async_checkpoints": False,
}


def command(workdir) -> list[str]:
    flags = [f"--config.{k}={v}" for k, v in LONG.items()]
    return [
        sys.executable,
        "-m",
        "resconv_jax.main",
        f"--config={TINY}",
        f"--workdir={workdir}",
    ] + flags


def start(workdir) -> subprocess.Popen:
    return subprocess.Popen(
        command(workdir), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def wait_for_checkpoint(workdir, min_step: int, process: subprocess.Popen) -> None:
    directory = os.path.join(workdir, "checkpoints")
    deadline = time.time() + 120
    while time.time() < deadline and process.poll() is None:
        steps = (
            [int(s) for s in os.listdir(directory) if s.isdigit()]
            if os.path.isdir(directory)
            else []
        )
        if steps and max(steps) >= min_step:
            return
        time.sleep(0.05)
    raise AssertionError(f"no checkpoint at step >= {min_step}: {process.communicate()[0]}")


def reference_metrics(tmp_path) -> str:
    """An uninterrupted run's metrics. Checkpoints do not change a metrics line, so it saves
    once, in the background (9 s to 2 s here)."""
    workdir = tmp_path / "reference"
    uninterrupted = LONG | {"train.checkpoint_every": LONG["train.num_steps"]}
    uninterrupted["train.async_checkpoints"] = True
    train.run(load_config_file(TINY, **uninterrupted), str(workdir))
    return (workdir / METRICS_FILE).read_text()


@pytest.mark.slow
def test_sigkill_then_resume_gives_identical_metrics(tmp_path):
    workdir = tmp_path / "killed"
    process = start(workdir)
    wait_for_checkpoint(workdir, 100, process)
    process.send_signal(signal.SIGKILL)
    process.wait()
    result = subprocess.run(command(workdir), cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "resuming from step" in result.stdout
    resumed_from = int(result.stdout.split("resuming from step ")[1].split()[0])
    assert 100 <= resumed_from < 600
    assert (workdir / METRICS_FILE).read_text() == reference_metrics(tmp_path)


@pytest.mark.slow
def test_sigterm_saves_and_resume_continues(tmp_path):
    workdir = tmp_path / "terminated"
    process = start(workdir)
    wait_for_checkpoint(workdir, 50, process)
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 0, output
    assert "preempted at step" in output
    saved = int(output.split("preempted at step ")[1].split(":")[0])
    assert saved in Checkpointer(workdir, every=10, keep=2, use_async=False).steps()
    result = subprocess.run(command(workdir), cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert f"resuming from step {saved}" in result.stdout
    assert (workdir / METRICS_FILE).read_text() == reference_metrics(tmp_path)


def test_corrupt_latest_checkpoint_falls_back_to_previous(tmp_path, capsys):
    steps = {"train.num_steps": 40, "train.checkpoint_every": 10, "train.async_checkpoints": False}
    reference = tmp_path / "reference"
    train.run(load_config_file(TINY, **steps), str(reference))
    workdir = tmp_path / "corrupt"
    train.run(load_config_file(TINY, **(steps | {"train.num_steps": 30})), str(workdir))
    latest = workdir / "checkpoints" / "30" / "state"
    for root, _, files in os.walk(latest):
        for name in files:
            with open(os.path.join(root, name), "wb") as f:
                f.write(b"garbage")
    train.run(load_config_file(TINY, **steps), str(workdir))
    assert "checkpoint at step 30 is unreadable" in capsys.readouterr().out
    assert (workdir / METRICS_FILE).read_text() == (reference / METRICS_FILE).read_text()


def _files(folder) -> dict[str, bytes]:
    return {
        os.path.relpath(os.path.join(root, name), folder): open(
            os.path.join(root, name), "rb"
        ).read()
        for root, _, names in os.walk(folder)
        for name in names
        if name != ".lock"
    }


@pytest.mark.parametrize("sweep", [{}, {"sweep.num_layers": (1, 2)}])
def test_fewer_steps_than_a_run_has_is_refused_touching_nothing(tmp_path, sweep):
    short = {"train.num_steps": 20, "train.checkpoint_every": 10, "optim.lr": 1e-3}
    short |= {"train.async_checkpoints": False}
    train.run(load_config_file(TINY, **short, **sweep), str(tmp_path))
    before = _files(tmp_path)
    fewer = load_config_file(TINY, **short | {"train.num_steps": 10}, **sweep)
    with pytest.raises(ValueError, match="trained to step 20, beyond train.num_steps=10"):
        train.run(fewer, str(tmp_path))
    assert _files(tmp_path) == before


def test_a_damaged_line_with_a_step_beyond_the_run_is_recomputed_not_refused(tmp_path):
    """One line whose step was damaged to 95 in a 40-step run is not a run trained to step 95
    (it used to be refused as one, "use a new --workdir"): the rerun recomputes the lines from
    a checkpoint before it, and the file is the uninterrupted run's again."""
    steps = {"train.num_steps": 40, "train.checkpoint_every": 10}
    steps |= {"train.async_checkpoints": False}
    train.run(load_config_file(TINY, **steps), str(tmp_path))
    metrics = tmp_path / METRICS_FILE
    good = metrics.read_text()
    lines = good.splitlines(keepends=True)
    middle = len(lines) // 2
    assert '"step": 20' in lines[middle], lines[middle]
    lines[middle] = lines[middle].replace('"step": 20', '"step": 95')
    metrics.write_text("".join(lines))
    train.run(load_config_file(TINY, **steps), str(tmp_path))
    assert metrics.read_text() == good


def test_a_finished_run_rerun_with_a_resumable_change_is_finished_and_left_alone(tmp_path):
    """main's rerun with only a field that a resume may change (print_every, microbatch_size),
    or of a run whose config.json lacks a field at its default value, is the same finished run:
    it used to fail the finished check, resume at the last step and rewrite that step's lines
    (with another microbatch size, other float bits) and config.json."""
    import json

    from resconv_jax import experiments
    from resconv_jax.finished import why_unfinished

    steps = {"train.num_steps": 20, "train.async_checkpoints": False}
    experiments.run_task(load_config_file(TINY, **steps), str(tmp_path))
    before = _files(tmp_path)
    for change in ({"train.print_every": 15}, {"train.microbatch_size": 4}):
        config = load_config_file(TINY, **steps, **change)
        assert why_unfinished(config, str(tmp_path)) is None, change
        experiments.run_task(config, str(tmp_path), reuse_finished=True)  # main's rerun
        assert _files(tmp_path) == before, change
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["probe"].pop("dtype") == "float32"  # a field added after a run started
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert why_unfinished(load_config_file(TINY, **steps), str(tmp_path)) is None
    other = load_config_file(TINY, **steps, **{"optim.lr": 1e-3})
    assert why_unfinished(other, str(tmp_path)) == "config.json holds another config (optim.lr)"


def test_a_finished_run_is_reported_again_without_building_anything(tmp_path, capsys, monkeypatch):
    """main's rerun of a finished, intact run (experiments.run_task with reuse_finished) reads
    its files: train.run is not called, the summaries are those of the run, the tables printed
    are the first run's and its figures are not drawn again; a damaged record (summary.json
    gone) goes through train.run, which resumes and rewrites it."""
    from resconv_jax import experiments

    config = load_config_file(TINY, **{"train.num_steps": 20, "train.async_checkpoints": False})
    monkeypatch.chdir(tmp_path)  # a relative --workdir, as users type it
    first = experiments.run_task(config, "run")
    printed = capsys.readouterr().out  # its progress lines, then its report's tables
    figures = {png.name: png.stat().st_mtime_ns for png in (tmp_path / "run").glob("*.png")}
    assert figures
    calls = []
    real_run = train.run
    monkeypatch.setattr(train, "run", lambda *args: calls.append(args) or real_run(*args))
    capsys.readouterr()
    again = experiments.run_task(config, "run", reuse_finished=True)
    out = capsys.readouterr().out
    assert not calls and "finished and intact: nothing to train" in out
    tables = out.split("\n", 1)[1]
    assert "β" in tables and printed.endswith(tables)
    assert {png.name: png.stat().st_mtime_ns for png in (tmp_path / "run").glob("*.png")} == figures
    assert [s["final_loss"] for s in again] == pytest.approx([s["final_loss"] for s in first])
    (tmp_path / "run" / "summary.json").unlink()
    experiments.run_task(config, "run", reuse_finished=True)
    assert len(calls) == 1 and (tmp_path / "run" / "summary.json").exists()


def test_a_lambda_max_run_resumes_with_the_step_sizes_it_started_with(
    tmp_path, capsys, monkeypatch
):
    """lr_rule=lambda_max computed each run's η again at every start; with another microbatch
    size (a resumable change) or device count its last bits moved (0.0023103998973965645 against
    0.002310400130227208), every metrics line looked foreign, and the resume deleted every
    checkpoint and trained again from step 0. The last bits are moved here by hand: the suite's
    -O0 happens to compute the same η."""
    import dataclasses
    import json

    import numpy as np

    first = {
        "optim.lr_rule": "lambda_max",
        "optim.lr_factor": 0.5,
        "train.num_steps": 20,
        "train.checkpoint_every": 10,
        "train.async_checkpoints": False,
    }
    train.run(load_config_file(TINY, **first), str(tmp_path))
    lrs = [run["lr"] for run in json.loads((tmp_path / "runs.json").read_text())]
    before = [line for line in (tmp_path / METRICS_FILE).read_text().splitlines()
              if json.loads(line)["step"] < 20]  # fmt: skip
    capsys.readouterr()
    recompute = train.with_kernel_lrs

    def last_bits_moved(*args):
        return [dataclasses.replace(run, lr=float(np.nextafter(run.lr, 1.0)))
                for run in recompute(*args)]  # fmt: skip

    monkeypatch.setattr(train, "with_kernel_lrs", last_bits_moved)
    train.run(load_config_file(TINY, **(first | {"train.num_steps": 40})), str(tmp_path))
    printed = capsys.readouterr().out
    assert "resuming from step 20" in printed and "restarts from step 0" not in printed, printed
    assert [run["lr"] for run in json.loads((tmp_path / "runs.json").read_text())] == lrs
    assert (tmp_path / METRICS_FILE).read_text().splitlines()[: len(before)] == before
    assert Checkpointer(tmp_path, every=10, keep=3, use_async=False).steps() == [20, 30, 40]
