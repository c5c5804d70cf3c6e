"""Edges of resuming and refusing: a run extended after it ended off the log grid, a loss that
turns non-finite at the very last step, a refused sweep whose workdir must stay untouched, and a
damaged folder met by `reproduce --jobs`. Each either continues exactly or refuses in one line."""

import json
import os
import shutil

import pytest

from resconv_jax import finished, train
from resconv_jax.config_defaults import load_config_file
from resconv_jax.errors import ConfigError, TrainingDiverged, WorkdirBusy, WorkdirWriteError
from resconv_jax.experiments import experiment_list
from resconv_jax.reproducing.outcomes import finished_before
from resconv_jax.runtime.checkpoint import Checkpointer
from resconv_jax.runtime.metrics import METRICS_FILE
from resconv_jax.runtime.workdir import CONFIG_FILE, WorkdirLock

TINY = os.path.join(os.path.dirname(__file__), "..", "configs", "tiny.py")


def tiny(**overrides):
    settings = {"train.checkpoint_every": 10, "train.print_every": 10,
                "train.async_checkpoints": False, "sweep.beta": (0.0, 1.0)}  # fmt: skip
    return load_config_file(TINY, **(settings | overrides))


def metrics_lines(workdir) -> list[str]:
    with open(os.path.join(workdir, METRICS_FILE)) as f:
        return f.readlines()


def checkpoint_steps(workdir) -> list[int]:
    checkpointer = Checkpointer(workdir, every=1, keep=100, use_async=False)
    try:
        return checkpointer.steps()
    finally:
        checkpointer.close()


def test_a_run_extended_after_an_off_grid_end_goes_back_on_the_log_grid(tmp_path):
    """42 steps (log_every=5), then the same run to 60: the chunks after 42 end on multiples of
    5 again, so the checkpoint at 50 is written and every line from 45 on is the uninterrupted
    run's, bit for bit."""
    straight, extended = str(tmp_path / "straight"), str(tmp_path / "extended")
    train.run(tiny(**{"train.num_steps": 60, "train.keep_checkpoints": 10}), straight)
    train.run(tiny(**{"train.num_steps": 42, "train.keep_checkpoints": 10}), extended)
    train.run(tiny(**{"train.num_steps": 60, "train.keep_checkpoints": 10}), extended)
    steps = [json.loads(line)["step"] for line in metrics_lines(extended)]
    assert steps[-10:] == [42, 42, 45, 45, 50, 50, 55, 55, 60, 60]
    assert 50 in checkpoint_steps(extended)
    on_grid = [line for line in metrics_lines(straight) if json.loads(line)["step"] >= 45]
    assert metrics_lines(extended)[-len(on_grid) :] == on_grid


DIVERGES_AT_THE_END = {"optim.lr": 0.1, "train.num_steps": 3, "train.log_every": 1,
                       "train.print_every": 3, "train.checkpoint_every": 3,
                       "sweep.beta": (1.0,)}  # fmt: skip


def test_a_loss_non_finite_at_the_last_step_is_a_divergence_every_time(tmp_path):
    """lr=0.1 at β=1: the losses before steps 1-3 are finite, the loss after the last update is
    not. The run stops with its one line, and so does each rerun; the folder is unfinished."""
    config, workdir = tiny(**DIVERGES_AT_THE_END), str(tmp_path / "w")
    for _ in range(2):
        with pytest.raises(TrainingDiverged) as error:
            train.run(config, workdir)
        assert "\n" not in str(error.value) and "diverged" in str(error.value)
    assert finished.why_unfinished(config, workdir)


def files(workdir) -> dict[str, bytes]:
    """The bytes of every file in `workdir` (not its subfolders), the lock's record aside."""
    names = [n for n in os.listdir(workdir) if os.path.isfile(os.path.join(workdir, n))]
    return {n: open(os.path.join(workdir, n), "rb").read() for n in names if n != ".lock"}


SWEEP = {"train.num_steps": 10, "sweep.num_layers": (1, 2), "optim.lr": 0.001}


def test_a_refused_depth_sweep_writes_nothing_and_the_run_goes_on(tmp_path):
    """config.json of a depth sweep lost, then a command with another lr: refused by the first
    depth's own copy, with the workdir as it was; the original command still finishes."""
    workdir = str(tmp_path / "w")
    train.run(tiny(**SWEEP), workdir)
    os.remove(os.path.join(workdir, CONFIG_FILE))
    before = files(workdir)
    with pytest.raises(ConfigError, match="optim.lr"):
        train.run(tiny(**(SWEEP | {"optim.lr": 0.002})), workdir)
    assert files(workdir) == before
    train.run(tiny(**SWEEP), workdir)
    assert finished.why_unfinished(tiny(**SWEEP), workdir) is None


def test_a_refused_start_adds_no_checkpoints_folder(tmp_path):
    """A single run pointed at a depth sweep's folder: refused before anything is created."""
    workdir = str(tmp_path / "w")
    train.run(tiny(**SWEEP), workdir)
    with pytest.raises(ConfigError):
        train.run(tiny(**{"train.num_steps": 10}), workdir)
    assert not os.path.exists(os.path.join(workdir, "checkpoints"))


NOT_DIVIDED = "config.mesh.sweep=4 does not divide the 2 runs"


@pytest.mark.parametrize(
    "overrides, refusal",
    [
        ({"mesh.sweep": 4}, NOT_DIVIDED),  # 2 runs
        ({"mesh.sweep": 4, "sweep.num_layers": (1, 2)}, NOT_DIVIDED),  # 2 runs of each depth
        ({"mesh.sweep": 4, "sweep.dim": (4, 8)}, NOT_DIVIDED),  # data drawn per width, later
        ({"train.runs_per_chunk": 1}, "runs_per_chunk=1 needs a 1-device mesh"),
    ],
)
def test_a_mesh_that_cannot_be_built_is_refused_before_the_workdir_is_locked(
    tmp_path, monkeypatch, overrides, refusal
):
    """A mesh that does not divide the runs was refused only after process 0 had created and
    locked the workdir. In a multi-process run the other process, refusing the same mesh a
    moment earlier, could stop process 0 through its watchdog first, and the new workdir was
    left behind; now every process refuses before anything is created."""

    def locked(*_):
        raise AssertionError("the workdir was locked before the mesh was checked")

    monkeypatch.setattr(train, "lock_on_process_0", locked)
    with pytest.raises(ConfigError, match=refusal):
        train.run(tiny(**overrides), str(tmp_path / "w"))
    assert not (tmp_path / "w").exists()


def test_a_corrupt_config_json_is_not_finished_under_jobs(tmp_path):
    """`reproduce --jobs` asks every experiment whether it finished before starting workers:
    an unreadable config.json is "not finished" there (the run then says why, in one line),
    not an error that stops the whole command."""
    theory = next(e for e in experiment_list() if e.name == "theory")
    os.makedirs(tmp_path / "theory")
    (tmp_path / "theory" / CONFIG_FILE).write_text('{"model": ')
    assert finished_before(theory, "tiny", str(tmp_path)) is False


def test_a_refused_new_workdir_is_removed_while_its_lock_is_still_held(tmp_path, monkeypatch):
    """A start refused after it created and locked its workdir deletes that workdir before it
    lets the lock go: a second start in between must find the workdir busy, never have its own
    files deleted under it."""
    workdir = str(tmp_path / "w")
    seen = []

    def refuse(*args):
        raise ConfigError("refused after the lock")

    def removing(path):
        with pytest.raises(WorkdirBusy):
            WorkdirLock(workdir).acquire()
        seen.append(os.fspath(path))
        remove_new_workdir(path)

    remove_new_workdir = train.remove_untrained_workdir
    monkeypatch.setattr(train, "_run_locked", refuse)
    monkeypatch.setattr(train, "remove_untrained_workdir", removing)
    with pytest.raises(ConfigError, match="refused after the lock"):
        train.run(tiny(**{"train.num_steps": 10}), workdir)
    assert seen == [workdir]
    assert not os.path.exists(workdir)


def test_a_finished_run_without_its_last_checkpoint_is_resumed_not_reused(tmp_path):
    """Checkpoints 20 then 10 deleted from a finished 30-step run: no checkpoint vouches for
    the lines after the one left, so the run is unfinished ("latest checkpoint at step ...")
    and the rerun recomputes them, to the same bytes."""
    config = tiny(**{"train.num_steps": 30, "train.keep_checkpoints": 10})
    workdir = str(tmp_path / "w")
    train.run(config, workdir)
    finished_lines = metrics_lines(workdir)
    assert finished.why_unfinished(config, workdir) is None
    for step in (30, 20):
        shutil.rmtree(os.path.join(workdir, "checkpoints", str(step)))
        assert "latest checkpoint is of step" in finished.why_unfinished(config, workdir)
    train.run(config, workdir)
    assert metrics_lines(workdir) == finished_lines
    assert finished.why_unfinished(config, workdir) is None


def test_a_checkpoint_still_being_written_is_not_named_as_saved(tmp_path, monkeypatch):
    """With async saves, Orbax lists a save in flight among its steps: a disk that filled during
    it stopped the run with "last checkpoint: step 60" when only 50 was on disk, and a
    background save of step 50 that failed was reported as the save of step 60."""
    import errno

    import jax.numpy as jnp

    checkpointer = Checkpointer(tmp_path, every=10, keep=5, use_async=True)
    state = {"w": jnp.arange(4.0)}
    try:
        checkpointer.save(10, state, {"step": 10}, force=True)
        checkpointer.wait()
        checkpointer.save(20, state, {"step": 20}, force=True)
        checkpointer.wait()
        manager = checkpointer._manager
        monkeypatch.setattr(manager, "is_saving_in_progress", lambda: True)  # 20 in flight
        assert checkpointer.steps() == [10] and checkpointer.latest_step() == 10

        def disk_full():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(manager, "wait_until_finished", disk_full)
        with pytest.raises(WorkdirWriteError, match=r"checkpoint of step 20 .*No space left"):
            checkpointer.save(30, state, {"step": 30}, force=True)
    finally:
        monkeypatch.undo()
        checkpointer.close()


def test_the_preemption_sync_ids_are_one_sequence_for_the_whole_process(tmp_path, monkeypatch):
    """JAX's preemption sync point is the largest *latest* id any process reported, plus one, and
    a process stops only at a call with exactly that id. Orbax reported step numbers there too
    (in should_save and save), and a sweep's second depth started its ids at 0 again: a SIGTERM
    to a multi-process depth sweep set the sync point to 201 while the loop asked with 0..39, and
    the run trained on to the end and exited 0, its preemption lost."""
    from jax.experimental import multihost_utils

    asked = []
    monkeypatch.setattr(
        multihost_utils, "reached_preemption_sync_point", lambda i: asked.append(i) or False
    )
    steps = {"train.num_steps": 40, "train.log_every": 10}
    train.run(tiny(**{"sweep.num_layers": (1, 2), "optim.lr": 1e-3, **steps}), str(tmp_path))
    first = asked[0]  # the process's sequence goes on from the runs before this one
    assert asked == list(range(first, first + len(asked))) and len(asked) >= 8, asked
