"""Faults a long sweep meets: torn metrics, a second process, corrupt checkpoints, a lost
config.json, a full disk. Each run must either continue exactly or refuse in one line."""

import errno
import glob
import json
import os
import socket
import struct

import numpy as np
import pytest

from resconv_jax import train
from resconv_jax.config_defaults import load_config_file
from resconv_jax.errors import ConfigError, WorkdirBusy, WorkdirWriteError
from resconv_jax.runtime.checkpoint import Checkpointer, checkpoint_losses_finite
from resconv_jax.runtime.metrics import METRICS_FILE, TENSORBOARD_DIR
from resconv_jax.runtime.workdir import CONFIG_FILE, WorkdirLock

ROOT = os.path.join(os.path.dirname(__file__), "..")
TINY = os.path.join(ROOT, "configs", "tiny.py")
CONFIGS = os.path.join(ROOT, "configs")
STEPS = {"train.num_steps": 40, "train.checkpoint_every": 10, "train.async_checkpoints": False}


def tiny(**overrides):
    return load_config_file(TINY, **(STEPS | overrides))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> str:
    """metrics.jsonl of an uninterrupted 40-step run."""
    workdir = tmp_path_factory.mktemp("reference")
    train.run(tiny(), str(workdir))
    return (workdir / METRICS_FILE).read_text()


def partial_run(workdir, steps: int = 30) -> None:
    """The first `steps` steps of the reference run (checkpoints at 10, 20, 30)."""
    train.run(tiny(**{"train.num_steps": steps}), str(workdir))


def metrics_path(workdir) -> str:
    return os.path.join(workdir, METRICS_FILE)


def cut_metrics(workdir, keep_lines: int, torn: bool) -> None:
    """Keeps the first `keep_lines` lines (a kill during a rewrite), optionally half a line more."""
    with open(metrics_path(workdir)) as f:
        lines = f.readlines()
    text = "".join(lines[:keep_lines]) + (lines[keep_lines][:17] if torn else "")
    with open(metrics_path(workdir), "w") as f:
        f.write(text)


@pytest.mark.slow
@pytest.mark.parametrize("keep_lines, torn", [(7, True), (12, False), (0, False)])
def test_cut_metrics_are_recomputed_from_an_earlier_checkpoint(
    tmp_path, reference, capsys, keep_lines, torn
):
    partial_run(tmp_path)
    cut_metrics(tmp_path, keep_lines, torn)
    capsys.readouterr()
    train.run(tiny(), str(tmp_path))
    out = capsys.readouterr().out
    assert "to recompute the missing lines" in out
    assert open(metrics_path(tmp_path)).read() == reference


def test_a_line_missing_in_the_middle_is_recomputed(tmp_path, reference):
    partial_run(tmp_path)
    with open(metrics_path(tmp_path)) as f:
        lines = f.readlines()
    del lines[10]  # step 15, run 1
    with open(metrics_path(tmp_path), "w") as f:
        f.writelines(lines)
    train.run(tiny(), str(tmp_path))
    assert open(metrics_path(tmp_path)).read() == reference


def read_events(workdir) -> list[tuple[int, str]]:
    """(step, tag) of every scalar in the workdir's TensorBoard event files (TFRecord framing)."""
    from tensorboardX.proto.event_pb2 import Event

    found = []
    for path in glob.glob(os.path.join(workdir, TENSORBOARD_DIR, "events*")):
        data = open(path, "rb").read()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            event = Event.FromString(data[offset + 12 : offset + 12 + length])
            offset += 12 + length + 4
            found += [(event.step, value.tag) for value in event.summary.value]
    return found


def test_resume_keeps_one_tensorboard_scalar_per_step_and_tag(tmp_path):
    partial_run(tmp_path, 30)
    cut_metrics(tmp_path, 12, torn=False)  # forces a resume from step 10
    train.run(tiny(), str(tmp_path))
    events = [e for e in read_events(tmp_path) if e[1].startswith("run")]
    assert len(events) == len(set(events))
    assert sorted({step for step, _ in events}) == list(range(0, 41, 5))


def test_a_second_process_on_the_workdir_is_refused(tmp_path):
    os.makedirs(tmp_path / "w")
    holder = WorkdirLock(str(tmp_path / "w"))
    holder.acquire()
    try:
        with pytest.raises(WorkdirBusy) as error:
            train.run(tiny(), str(tmp_path / "w"))
    finally:
        holder.release()
    message = str(error.value)
    assert f"in use by PID {os.getpid()} on host {socket.gethostname()}" in message
    assert not os.path.exists(tmp_path / "w" / METRICS_FILE)
    assert not os.path.exists(tmp_path / "w" / CONFIG_FILE)


def test_a_second_process_on_a_finished_run_still_held_is_refused_before_it_says_finished(
    tmp_path, capsys
):
    """main's rerun of a finished run whose first process still holds the workdir (writing its
    last files): it printed "finished and intact", then exited 0 or 3 (busy) depending on
    whether the report had to be written again. Now it is refused at once, as any second
    process is."""
    from resconv_jax import experiments

    config = tiny(**{"train.num_steps": 10})
    train.run(config, str(tmp_path))
    capsys.readouterr()
    holder = WorkdirLock(str(tmp_path))
    holder.acquire()
    try:
        with pytest.raises(WorkdirBusy, match="in use by PID"):
            experiments.run_task(config, str(tmp_path), reuse_finished=True)
    finally:
        holder.release()
    assert "finished and intact" not in capsys.readouterr().out
    experiments.run_task(config, str(tmp_path), reuse_finished=True)
    assert "finished and intact" in capsys.readouterr().out


def _restore_raw(workdir, step: int):
    import orbax.checkpoint as ocp

    manager = ocp.CheckpointManager(
        os.path.join(os.path.abspath(workdir), "checkpoints"), item_names=("state",)
    )
    args = ocp.args.Composite(state=ocp.args.StandardRestore())
    return manager.restore(step, args=args).state


def flip_one_bit(workdir, step: int) -> None:
    """Flips one bit of checkpoint `step`'s array data such that Orbax still reads it, with other
    values: the silent corruption that only a content hash catches."""
    original = _restore_raw(workdir, step)
    pattern = os.path.join(workdir, "checkpoints", str(step), "state", "**", "d", "*")
    for path in sorted(glob.glob(pattern, recursive=True), key=os.path.getsize, reverse=True):
        data = open(path, "rb").read()
        for offset in range(64, len(data), 97):
            flipped = bytearray(data)
            flipped[offset] ^= 0x10
            open(path, "wb").write(bytes(flipped))
            try:
                changed = _restore_raw(workdir, step)
            except Exception:  # noqa: BLE001 - a flip that Orbax notices: try another byte
                continue
            pairs = zip(leaves(original), leaves(changed), strict=True)
            if not all(np.array_equal(a, b) for a, b in pairs):
                return
        open(path, "wb").write(data)
    raise AssertionError(f"no single-bit flip in checkpoint {step} changes its values silently")


def make_unreadable(workdir, step: int) -> None:
    """Overwrites the index files of checkpoint `step` (Orbax then fails to read it)."""
    for path in glob.glob(os.path.join(workdir, "checkpoints", str(step), "state", "d", "*")):
        open(path, "wb").write(b"garbage")


def leaves(tree) -> list[np.ndarray]:
    import jax

    return [np.asarray(leaf) for leaf in jax.tree.leaves(tree)]


def test_a_flipped_bit_in_a_checkpoint_falls_back_to_the_previous(tmp_path, reference, capsys):
    partial_run(tmp_path)
    flip_one_bit(tmp_path, 30)
    capsys.readouterr()
    train.run(tiny(), str(tmp_path))
    out = capsys.readouterr().out
    assert "checkpoint at step 30 does not match its content hashes" in out
    assert "resuming from step 20" in out
    assert open(metrics_path(tmp_path)).read() == reference


def test_a_finished_run_with_a_corrupt_final_checkpoint_is_made_whole(tmp_path, reference):
    from resconv_jax.finished import why_unfinished

    train.run(tiny(), str(tmp_path))
    assert why_unfinished(tiny(), str(tmp_path)) is None
    flip_one_bit(tmp_path, 40)
    problem = why_unfinished(tiny(), str(tmp_path))  # main's rerun: not reused, resumed
    assert problem == "the checkpoint of step 40 does not match its content hashes"
    train.run(tiny(), str(tmp_path))  # retrains 30 -> 40 and saves step 40 again
    steps = Checkpointer(str(tmp_path), every=10, keep=3, use_async=False).steps()
    assert steps[-1] == 40
    assert open(metrics_path(tmp_path)).read() == reference
    train.run(tiny(), str(tmp_path))  # and the next rerun finds it readable
    assert open(metrics_path(tmp_path)).read() == reference


def test_a_failed_tensorstore_read_that_nobody_awaited_is_not_printed(tmp_path, caplog):
    """Orbax gathers TensorStore futures; when one fails, the others' failures are never
    retrieved and asyncio logs each with a traceback (seen once in 12 runs of
    test_an_unreadable_checkpoint_is_one_line_and_no_traceback). That debris must stay off
    stderr; a never-retrieved exception of anything else must still be printed."""
    import asyncio
    import gc

    import tensorstore

    from resconv_jax.runtime.checkpoint import quiet_failed_io

    quiet_failed_io()
    spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": str(tmp_path / "none")}}

    async def never_retrieved(awaitable) -> None:
        await asyncio.wait([asyncio.ensure_future(awaitable)])

    async def fails() -> None:
        raise ValueError("not TensorStore's")

    asyncio.run(never_retrieved(tensorstore.open(spec)))
    gc.collect()
    assert "never retrieved" not in caplog.text
    asyncio.run(never_retrieved(fails()))
    gc.collect()
    assert "never retrieved" in caplog.text and "not TensorStore's" in caplog.text


def _edit_meta(workdir, step: int, edit) -> None:
    path = workdir / "checkpoints" / str(step) / "meta" / "metadata"
    meta = json.loads(path.read_text())
    edit(meta)
    path.write_text(json.dumps(meta))


@pytest.mark.parametrize(
    "damage",
    [
        lambda meta: meta.update(digest=list(meta["digest"].values())),
        lambda meta: meta.update(step="40"),
        lambda meta: meta.pop("digest"),
    ],
    ids=["digest a list", "step a string", "no digest"],
)
def test_checkpoint_metadata_of_another_shape_is_a_damaged_checkpoint(tmp_path, reference, damage):
    """Metadata that reads as JSON but is not what a save writes: each gave a traceback (exit 1)
    in the finished check or the resume, or (no hashes) was restored unverified while the
    finished check refused it, so that no rerun ever settled. Now the checkpoint is skipped,
    the run is resumed from the one before, and the next check finds it finished."""
    from resconv_jax.finished import why_unfinished

    train.run(tiny(), str(tmp_path))
    _edit_meta(tmp_path, 40, damage)
    assert why_unfinished(tiny(), str(tmp_path)).startswith("the checkpoint of step 40")
    train.run(tiny(), str(tmp_path))
    assert open(metrics_path(tmp_path)).read() == reference
    assert why_unfinished(tiny(), str(tmp_path)) is None


def test_a_runs_file_of_another_shape_is_not_a_finished_run(tmp_path):
    from resconv_jax.finished import RUNS_FILE, why_unfinished

    train.run(tiny(), str(tmp_path))
    (tmp_path / RUNS_FILE).write_text("[1, 2, 3]")  # as many entries as runs, not runs
    assert "runs.json is missing or does not list" in why_unfinished(tiny(), str(tmp_path))


@pytest.mark.parametrize(
    "leftover, expected",
    [
        ("metrics.jsonl", "holds a metrics.jsonl but neither config.json nor a checkpoint"),
        ("REPORT.md", "is a reproduce folder"),
    ],
)
def test_a_folder_of_other_files_is_not_trained_over(tmp_path, leftover, expected):
    """A metrics.jsonl main did not write was overwritten by a fresh start, and main trained
    inside a reproduce folder; both are refused in one line, the folder untouched."""
    (tmp_path / leftover).write_text('{"step": 1, "loss": 2}\n')
    with pytest.raises(ConfigError, match=expected):
        train.run(tiny(), str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != ".lock") == [leftover]
    assert (tmp_path / leftover).read_text() == '{"step": 1, "loss": 2}\n'


def test_a_folder_of_other_files_with_a_config_json_below_is_not_trained_over(tmp_path):
    """Any subfolder holding a config.json (a Hugging Face model's, say) let a start overwrite a
    metrics.jsonl that main did not write."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2}\n')
    (tmp_path / "hf_model").mkdir()
    (tmp_path / "hf_model" / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="holds a metrics.jsonl but neither config.json nor a"):
        train.run(tiny(), str(tmp_path))
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 2}\n'


def test_a_depth_sweep_without_its_config_json_is_not_taken_over_by_one_run(tmp_path):
    """Its config.json lost, a sweep's folder was trained over by any single-run config: the
    merged metrics.jsonl and summary.json overwritten, and the sweep's own command then refused
    as another config. Its command still resumes it."""
    sweep = tiny(**{"sweep.num_layers": (1, 2), "train.num_steps": 10, "optim.lr": 1e-3})
    train.run(sweep, str(tmp_path))
    (tmp_path / "config.json").unlink()

    def files():
        return {
            p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file() and p.name != ".lock"
        }

    before = files()
    with pytest.raises(ConfigError, match=r"holds the runs of a sweep \(layers_1, layers_2\)"):
        train.run(tiny(**{"train.num_steps": 10, "optim.lr": 2e-3}), str(tmp_path))
    assert files() == before
    train.run(sweep, str(tmp_path))
    assert (tmp_path / "config.json").exists()


def test_no_readable_checkpoint_says_the_run_restarts(tmp_path, reference, capsys):
    partial_run(tmp_path)
    for step in (10, 20, 30):
        make_unreadable(tmp_path, step)
    capsys.readouterr()
    train.run(tiny(), str(tmp_path))
    assert "the run restarts from step 0" in capsys.readouterr().out
    assert open(metrics_path(tmp_path)).read() == reference


def test_a_restored_state_with_a_non_finite_loss_is_refused(tmp_path):
    checkpointer = Checkpointer(str(tmp_path), every=10, keep=3, use_async=False)
    good = {"w": np.ones(4, np.float32)}
    checkpointer.save(10, good, {"step": 10})
    checkpointer.save(20, {"w": np.full(4, np.nan, np.float32)}, {"step": 20})
    checkpointer.wait()
    lines = []
    step, state, _ = checkpointer.restore_latest(
        good,
        accept=lambda s, meta: checkpoint_losses_finite(np.asarray(s["w"]).sum(keepdims=True)),
        report=lines.append,
    )
    assert step == 10 and lines == [
        "checkpoint at step 20 holds a non-finite loss (run 0: nan); trying the previous one"
    ]
    assert checkpointer.steps() == [10]
    checkpointer.close()


def test_missing_config_json_is_checked_against_the_checkpoint(tmp_path):
    partial_run(tmp_path)
    os.remove(tmp_path / CONFIG_FILE)
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(
        ConfigError, match=r"optim.lr: 0.004 -> 0.003; per the checkpoint of step 30"
    ):
        train.run(tiny(**{"optim.lr": 0.003}), str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == before


@pytest.mark.parametrize("content", [b"", b'{"model": ', b"\xff\xfe"])
def test_unreadable_config_json_is_refused_in_one_line(tmp_path, content):
    partial_run(tmp_path, 10)
    (tmp_path / CONFIG_FILE).write_bytes(content)
    with pytest.raises(ConfigError) as error:
        train.run(tiny(), str(tmp_path))
    message = str(error.value)
    assert "\n" not in message and f"{tmp_path / CONFIG_FILE} is unreadable" in message
    assert (tmp_path / CONFIG_FILE).read_bytes() == content


def test_summary_json_is_strict_json_with_null_for_nan(tmp_path):
    partial_run(tmp_path, 10)
    text = (tmp_path / "summary.json").read_text()

    def refuse(name):
        raise AssertionError(f"bare {name} in summary.json")

    summaries = json.loads(text, parse_constant=refuse)
    assert [s["run"] for s in summaries] == [0, 1, 2]
    assert not glob.glob(str(tmp_path / "*.tmp-*"))


class _FullDisk:
    """A file whose writes fail with ENOSPC once `budget` writes have gone through."""

    def __init__(self, file, budget: list[int]):
        self._file, self._budget = file, budget

    def writelines(self, lines):
        self._budget[0] -= 1
        if self._budget[0] < 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._file.writelines(lines)

    def __getattr__(self, name):
        return getattr(self._file, name)


def test_a_full_disk_at_a_metrics_write_is_one_line_and_resumable(tmp_path, reference, monkeypatch):
    from resconv_jax.runtime import metrics

    budget = [5]
    real_open = open
    monkeypatch.setattr(
        metrics, "open", lambda *a, **k: _FullDisk(real_open(*a, **k), budget), raising=False
    )
    with pytest.raises(WorkdirWriteError) as error:
        train.run(tiny(), str(tmp_path))
    message = str(error.value)
    assert "\n" not in message and "No space left on device" in message
    assert "last checkpoint: step 20 in" in message and "rerun the same command" in message
    monkeypatch.undo()
    train.run(tiny(), str(tmp_path))
    assert open(metrics_path(tmp_path)).read() == reference


def test_a_full_disk_at_a_checkpoint_is_one_line(tmp_path, monkeypatch):
    import orbax.checkpoint as ocp

    def no_space(*args, **kwargs):
        raise ValueError("Error writing local file: [OS error: No space left on device]")

    monkeypatch.setattr(ocp.CheckpointManager, "save", no_space)
    with pytest.raises(WorkdirWriteError) as error:
        train.run(tiny(), str(tmp_path))
    message = str(error.value)
    assert message.startswith("cannot save the checkpoint of step 5 in")
    assert "No space left on device" in message and "last checkpoint: none" in message


def test_why_unfinished_names_what_a_run_lacks(tmp_path):
    """A finished, intact run is reusable (None); another config or a torn summary.json give
    their reason in a few words."""
    from resconv_jax.finished import why_unfinished

    short = {"train.num_steps": 10, "train.checkpoint_every": 10, "train.print_every": 10,
             "sweep.beta": (0.0, 1.0), "train.async_checkpoints": False}  # fmt: skip
    config = load_config_file(TINY, **short)
    train.run(config, str(tmp_path))
    assert why_unfinished(config, str(tmp_path)) is None
    longer = load_config_file(TINY, **(short | {"train.num_steps": 20}))
    assert why_unfinished(longer, str(tmp_path)) == "metrics.jsonl ends at step 10 of 20"
    other = load_config_file(TINY, **(short | {"seed": 1}))
    assert why_unfinished(other, str(tmp_path)) == "config.json holds another config (seed)"
    (tmp_path / "summary.json").write_text("{garbage")
    assert "summary.json" in why_unfinished(config, str(tmp_path))


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16", "int32", "int64", "uint8"])
def test_the_host_hash_of_a_checkpoint_is_the_device_hash_saved_with_it(dtype):
    """The finished check hashes a checkpoint read back as NumPy arrays, by NumPy (nothing to
    compile); the values are those JAX computed when it was saved."""
    import jax
    import jax.numpy as jnp

    from resconv_jax.runtime.checkpoint import host_state_digest, state_digest

    values = np.random.default_rng(0).normal(size=(3, 5, 7)) * 100
    tree = {"w": values.astype(jnp.dtype(dtype)), "s": {"scalar": values[0, 0, :1].astype(dtype)}}
    with jax.enable_x64(True):
        assert host_state_digest(tree) == state_digest(tree)
    flipped = tree["w"].copy()
    flipped.reshape(-1).view(np.uint8)[11] ^= 1
    assert host_state_digest({**tree, "w": flipped}) != host_state_digest(tree)
