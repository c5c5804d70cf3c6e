"""A `gs://` workdir, on an in-memory GCS (tests/fakes/fake_gcs.py), against a local one.

The fake is reached exactly as a real bucket is: `etils.epath` sends `gs://` paths to its fsspec
backend (here the fake file system instead of gcsfs), and Orbax writes its arrays with
TensorStore's `gcs` driver (here over HTTP to the fake's server instead of Google's). The one
thing patched in Orbax is its hierarchical-namespace query, which needs Google's own client:
the fake bucket answers "no hierarchical namespace", as most buckets do.
"""

import importlib.util
import json
import os
import socket
import struct
import subprocess
import sys

import pytest
from etils.epath import backend as epath_backend
from fakes import fake_gcs
from orbax.checkpoint._src.path import gcs_utils
from tensorboardX.proto import event_pb2

from resconv_jax import experiments, train
from resconv_jax.config_defaults import load_config_file
from resconv_jax.errors import ConfigError, WorkdirBusy, WorkdirWriteError
from resconv_jax.experiments import rank_collapse
from resconv_jax.runtime.metrics import MetricsWriter
from resconv_jax.runtime.workdir import WorkdirLock
from resconv_jax.validation import check_workdir

ROOT = os.path.join(os.path.dirname(__file__), "..")
TINY = os.path.join(ROOT, "configs", "tiny.py")
BUCKET = "fake-bucket"
STEPS = {"train.num_steps": 20, "train.checkpoint_every": 10, "train.async_checkpoints": False}
REPORT_FILES = ("beta_table.csv", "training.png", "loss_by_beta.png", "sigma_by_beta.png")

_STORE = fake_gcs.Store()
_SERVER = None


def tiny(**overrides):
    return load_config_file(TINY, **(STEPS | overrides))


@pytest.fixture
def gcs(monkeypatch):
    """The fake store, empty, wired in for `gs://` as described in the module docstring."""
    global _SERVER
    if _SERVER is None:  # one per process: TensorStore may keep the endpoint it first saw
        _SERVER = fake_gcs.serve(_STORE)
    _STORE.clear()
    monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", f"http://127.0.0.1:{_SERVER.server_port}")
    monkeypatch.setenv("GOOGLE_AUTH_TOKEN_FOR_TESTING", "fake-token")
    filesystem = fake_gcs.FakeGCSFileSystem(_STORE)
    original = epath_backend._FileSystemSpecBackend._get_filesystem

    def get_filesystem(self, name):
        return filesystem if name in ("gs", "gcs") else original(self, name)

    monkeypatch.setattr(epath_backend._FileSystemSpecBackend, "_get_filesystem", get_filesystem)
    monkeypatch.setattr(gcs_utils, "is_hierarchical_namespace_enabled", lambda path: False)
    yield _STORE
    _STORE.clear()


def remote(store, name: str) -> bytes:
    return store.objects[BUCKET, name][0]


def scalars(event_files: list[bytes]) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} from TFRecord event files' bytes."""
    found = {}
    for data in event_files:
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
            offset += 16 + length
            for value in event.summary.value:
                if value.tag.startswith("run"):  # not the timings, which differ
                    found.setdefault(value.tag, []).append((event.step, value.simple_value))
    return found


def local_events(folder) -> list[bytes]:
    return [p.read_bytes() for p in sorted((folder / "tensorboard").iterdir())]


def remote_events(store, prefix: str) -> list[bytes]:
    return [remote(store, n) for n in store.names(BUCKET, f"{prefix}/tensorboard/")]


@pytest.mark.slow
def test_a_run_and_its_report_write_the_same_files_locally_and_on_gcs(tmp_path, gcs, capsys):
    local = tmp_path / "local"
    experiments.run_task(tiny(), str(local))
    experiments.run_task(tiny(), f"gs://{BUCKET}/run")
    names = gcs.names(BUCKET, "run/")
    top = {n.split("/")[1] for n in names}
    assert top == {p.name for p in local.iterdir()} - {".lock"}  # the remote lock is deleted
    for name in ("metrics.jsonl", "config.json", "summary.json", "beta_table.csv"):
        assert remote(gcs, f"run/{name}") == (local / name).read_bytes(), name
    for name in REPORT_FILES[1:]:
        assert remote(gcs, f"run/{name}").startswith(b"\x89PNG"), name
    assert scalars(remote_events(gcs, "run")) == scalars(local_events(local))
    assert len(scalars(local_events(local))["run0/loss"]) == 5  # steps 0, 5, 10, 15, 20
    # Orbax wrote both checkpoints there (GCS-style commit files, no renames), and nothing of
    # the local-only machinery (temporary files) went to the bucket.
    for step in (10, 20):
        assert f"run/checkpoints/{step}/commit_success.txt" in names
        assert any(n.startswith(f"run/checkpoints/{step}/state/") for n in names)
    assert not [n for n in names if ".tmp-" in n]
    assert not os.path.exists(os.path.join(ROOT, "gs:")) and not os.path.exists("gs:")
    assert "per-β table" in capsys.readouterr().out


@pytest.mark.slow
def test_a_resume_on_gcs_continues_exactly(gcs, capsys):
    experiments.run_task(tiny(**{"train.num_steps": 40}), f"gs://{BUCKET}/straight")
    reference = remote(gcs, "straight/metrics.jsonl")
    train.run(tiny(), f"gs://{BUCKET}/resumed")  # 20 steps, then extended to 40
    experiments.run_task(tiny(**{"train.num_steps": 40}), f"gs://{BUCKET}/resumed")
    assert "resuming from step 20" in capsys.readouterr().out
    assert remote(gcs, "resumed/metrics.jsonl") == reference
    assert remote(gcs, "resumed/beta_table.csv") == remote(gcs, "straight/beta_table.csv")
    assert remote(gcs, "resumed/summary.json") == remote(gcs, "straight/summary.json")
    events = scalars(remote_events(gcs, "resumed"))
    assert events == scalars(remote_events(gcs, "straight"))


@pytest.mark.slow
def test_a_run_killed_between_checkpoints_has_the_lines_before_the_last_and_resumes(gcs, capsys):
    train.run(tiny(**{"train.num_steps": 40}), f"gs://{BUCKET}/straight")
    reference = remote(gcs, "straight/metrics.jsonl").decode().splitlines(keepends=True)
    real_write = MetricsWriter.write

    def killed_at_25(self, step, records):
        if step == 25:
            raise KeyboardInterrupt  # as a SIGKILL: nothing after this is written
        real_write(self, step, records)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(MetricsWriter, "write", killed_at_25)
        patch.setattr(MetricsWriter, "close", lambda self: None)  # no last sync either
        with pytest.raises(KeyboardInterrupt):
            train.run(tiny(**{"train.num_steps": 40}), f"gs://{BUCKET}/killed")
    # Durable up to the newest checkpoint (step 20): its sync wrote every line before it.
    kept = remote(gcs, "killed/metrics.jsonl").decode()
    assert kept == "".join(line for line in reference if json.loads(line)["step"] < 20)
    capsys.readouterr()
    train.run(tiny(**{"train.num_steps": 40}), f"gs://{BUCKET}/killed")
    assert "resuming from step 20" in capsys.readouterr().out
    assert remote(gcs, "killed/metrics.jsonl") == "".join(reference).encode()


@pytest.mark.slow
def test_a_failed_metrics_write_on_gcs_is_one_line_and_resumable(gcs):
    train.run(tiny(**{"train.num_steps": 40}), f"gs://{BUCKET}/straight")
    reference = remote(gcs, "straight/metrics.jsonl")
    real_sync = MetricsWriter.sync
    syncs = []

    def sync_failing_from_the_third(self, step=None):
        syncs.append(step)
        if len(syncs) == 4:  # the start's, the checkpoints of steps 5 and 10, then step 20's
            gcs.fail_writes("killed/metrics.jsonl")
        real_sync(self, step)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(MetricsWriter, "sync", sync_failing_from_the_third)
        with pytest.raises(WorkdirWriteError) as error:
            train.run(tiny(**{"train.num_steps": 40}), f"gs://{BUCKET}/killed")
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"cannot write gs://{BUCKET}/killed/")
    assert "quota exceeded" in message and "last checkpoint: step 10 in" in message
    gcs.failing.clear()
    train.run(tiny(**{"train.num_steps": 40}), f"gs://{BUCKET}/killed")
    assert remote(gcs, "killed/metrics.jsonl") == reference


def test_a_second_start_on_a_locked_gcs_workdir_is_refused(gcs):
    holder = WorkdirLock(f"gs://{BUCKET}/w")
    holder.acquire()
    try:
        assert remote(gcs, "w/.lock").decode().startswith(f"{os.getpid()} {socket.gethostname()}")
        with pytest.raises(WorkdirBusy) as error:
            train.run(tiny(), f"gs://{BUCKET}/w")
    finally:
        holder.release()
    message = str(error.value)
    assert f"in use by PID {os.getpid()} on host {socket.gethostname()}" in message
    assert "delete that object" in message and f"gs://{BUCKET}/w/.lock" in message
    assert gcs.names(BUCKET, "w/") == []  # nothing written, and the lock object is gone


def _dead_pid() -> int:
    pid = 2**22 - 1
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except OSError:
            pass
        pid -= 1


def test_a_gcs_lock_of_an_ended_process_of_this_host_is_taken_over(gcs, capsys):
    stale = f"{_dead_pid()} {socket.gethostname()} 2026-01-01T00:00:00\n"
    gcs.put(BUCKET, "w/.lock", stale.encode())
    train.run(tiny(**{"train.num_steps": 10}), f"gs://{BUCKET}/w")
    assert "taking over the lock of PID" in capsys.readouterr().out
    assert ("w/.lock" not in gcs.names(BUCKET, "w/")) and "w/metrics.jsonl" in gcs.names(BUCKET)


def test_a_finished_gcs_run_is_reused_without_writing_a_lock_object(gcs, capsys):
    """main's rerun of a finished gs:// run reads and says; it wrote (and deleted) a lock
    object to check that no other process holds the run, so a reader without write access to
    the bucket got exit status 4 instead of the run's tables. A live holder is still refused."""
    config = tiny(**{"train.num_steps": 10})
    experiments.run_task(config, f"gs://{BUCKET}/w")
    capsys.readouterr()
    gcs.fail_writes(".lock")  # as a reader of the bucket who may not write
    experiments.run_task(config, f"gs://{BUCKET}/w", reuse_finished=True)
    assert "finished and intact" in capsys.readouterr().out
    gcs.failing.clear()
    gcs.put(BUCKET, "w/.lock", b"123 other-host 2026-01-01T00:00:00\n")
    with pytest.raises(WorkdirBusy, match="in use by PID 123 on host other-host"):
        experiments.run_task(config, f"gs://{BUCKET}/w", reuse_finished=True)
    assert "w/.lock" in gcs.names(BUCKET, "w/")  # another's lock object is left alone


def test_a_gcs_lock_of_another_host_is_refused(gcs):
    gcs.put(BUCKET, "w/.lock", b"123 other-host 2026-01-01T00:00:00\n")
    with pytest.raises(WorkdirBusy, match="in use by PID 123 on host other-host since 2026"):
        train.run(tiny(), f"gs://{BUCKET}/w")
    assert gcs.names(BUCKET, "w/") == ["w/.lock"]


@pytest.mark.slow
def test_a_depth_sweep_on_gcs_writes_what_a_local_one_does(tmp_path, gcs):
    overrides = {"sweep.num_layers": (1, 2), "train.num_steps": 10, "optim.lr": 1e-3}
    experiments.run_task(tiny(**overrides), str(tmp_path))
    experiments.run_task(tiny(**overrides), f"gs://{BUCKET}/sweep")
    names = ("metrics.jsonl", "summary.json", "layers_2/metrics.jsonl", "layers_2/beta_table.csv")
    for name in names:
        assert remote(gcs, f"sweep/{name}") == (tmp_path / name).read_bytes(), name


def test_rank_collapse_on_gcs_writes_what_a_local_run_does(tmp_path, gcs):
    config = load_config_file(
        os.path.join(ROOT, "configs", "rank_collapse.py"),
        **{
            "data.num_samples": 4,
            "data.seq_len": 8,
            "data.dim": 4,
            "rank_collapse.d_qk_values": (1, 16),
            "rank_collapse.seeds": (0,),
        },
    )
    rank_collapse.run(config, str(tmp_path))
    rank_collapse.run(config, f"gs://{BUCKET}/rc")
    assert set(gcs.names(BUCKET, "rc/")) == {
        f"rc/{p.name}" for p in tmp_path.iterdir() if p.name != ".lock"
    }
    for name in (rank_collapse.CSV_FILE, rank_collapse.SEEDS_CSV_FILE, "config.json"):
        assert remote(gcs, f"rc/{name}") == (tmp_path / name).read_bytes()


def test_an_s3_workdir_is_refused_for_training_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"s3://b/run: checkpoints can be written to a local"):
        train.run(tiny(), "s3://b/run")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("gcsfs") is not None, reason="gcsfs is installed")
def test_a_gcs_workdir_without_gcsfs_is_one_line_status_2():
    with pytest.raises(ConfigError, match="cannot reach it .*gcsfs"):
        check_workdir("gs://some-bucket/run")
    command = [sys.executable, "-m", "resconv_jax.main", f"--config={TINY}", "--workdir=gs://b/r"]
    env = os.environ | {"PYTHONPATH": os.path.abspath(ROOT)}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "error: --workdir=gs://b/r: cannot reach it (Please install gcsfs to access Google Storage)"
    ]


def test_a_refused_new_gcs_workdir_is_emptied_before_its_lock_object_goes(gcs, monkeypatch):
    """A start refused after it created and locked its gcs workdir deletes what it wrote while
    the lock object still stands (another start is refused meanwhile), then the lock object."""
    at_release = []

    def refuse(*args):
        gcs.put(BUCKET, "w/config.json", b"{}")
        raise ConfigError("refused after the lock")

    def release(self):
        at_release.append(gcs.names(BUCKET, "w/"))
        release_lock(self)

    release_lock = WorkdirLock.release
    monkeypatch.setattr(train, "_run_locked", refuse)
    monkeypatch.setattr(WorkdirLock, "release", release)
    with pytest.raises(ConfigError, match="refused after the lock"):
        train.run(tiny(**{"train.num_steps": 10}), f"gs://{BUCKET}/w")
    assert at_release[0] == ["w/.lock"]
    assert gcs.names(BUCKET, "w/") == []
