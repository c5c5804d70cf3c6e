"""The command line under faults: one line on stderr, the documented exit status, no traceback."""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from signal_ready import wait_until_caught

from resconv_jax.runtime.metrics import METRICS_FILE
from resconv_jax.runtime.workdir import WorkdirLock

ROOT = os.path.join(os.path.dirname(__file__), "..")
TINY = os.path.join(ROOT, "configs", "tiny.py")
THEORY = os.path.join(ROOT, "configs", "theory.py")
NO_SECTION = """from resconv_jax.config_defaults import base_config
def get_config():
    config = base_config()
    del config["train"]
    return config
"""


def main(*args, cwd=ROOT):
    command = [sys.executable, "-m", "resconv_jax.main", *args]
    env = os.environ | {"PYTHONPATH": os.path.abspath(ROOT)}
    return subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def finish(process, timeout: float = 120) -> tuple[int, str, str]:
    out, err = process.communicate(timeout=timeout)
    return process.returncode, out, err


@pytest.mark.slow
@pytest.mark.parametrize(
    "config_file, extra, expected",
    [
        ("missing.py", ["--config.optim.lr=1"], "--config=missing.py: no such file"),
        ("/etc/passwd", [], "not a Python config file (invalid syntax at line 1)"),
        ("raises.py", ["--config.optim.lr=1"], "loading it failed (RuntimeError: boom)"),
        (TINY, ["--config.optim.lr=inf"], "config.optim.lr=inf: must be a finite number"),
        (TINY, ["--config.data.num_samples=100000000"], "the data set alone needs"),
        (f"{THEORY}:bogus", [], "theory.py: unknown variant bogus (its variants: float64,"),
        ("nosection.py", [], "the config has no 'train' field or section"),
        (TINY, ["--config.theory.every=10"], "--config.theory.every is now --config.certificate"),
    ],
)
def test_bad_input_is_one_line_status_2_nothing_written(tmp_path, config_file, extra, expected):
    (tmp_path / "raises.py").write_text("def get_config():\n    raise RuntimeError('boom')\n")
    (tmp_path / "nosection.py").write_text(NO_SECTION)
    workdir = tmp_path / "w"
    process = main(f"--config={config_file}", f"--workdir={workdir}", *extra, cwd=tmp_path)
    status, _, err = finish(process)
    assert status == 2
    assert err.strip().splitlines() == [err.strip()] and expected in err
    assert not workdir.exists()


@pytest.mark.slow
def test_a_locked_workdir_is_status_3_naming_the_holder(tmp_path):
    holder = WorkdirLock(str(tmp_path))
    holder.acquire()
    try:
        status, _, err = finish(main(f"--config={TINY}", f"--workdir={tmp_path}"))
    finally:
        holder.release()
    assert status == 3, err
    assert err.strip().startswith("error: --workdir=") and f"in use by PID {os.getpid()}" in err
    assert not (tmp_path / METRICS_FILE).exists()


def test_sigterm_during_start_up_exits_0_having_trained_nothing(tmp_path):
    workdir = tmp_path / "w"
    process = main(f"--config={TINY}", f"--workdir={workdir}")
    # Once its handler is there (it still imports JAX then); at 0.3 s, the same on a loaded
    # machine could come before it and kill the process.
    wait_until_caught(process, signal.SIGTERM)
    process.send_signal(signal.SIGTERM)
    status, out, err = finish(process)
    assert status == 0, err
    assert "nothing was trained yet" in out
    assert not (workdir / METRICS_FILE).exists()


def _mount_tmpfs(path, size: str) -> bool:
    os.makedirs(path, exist_ok=True)
    try:
        result = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
            capture_output=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return result.returncode == 0


@pytest.mark.slow
def test_a_full_disk_is_status_4_and_the_rerun_completes(tmp_path):
    """A real full disk (a small tmpfs, filled while the run is going), where one can be mounted."""
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "64m"):
        pytest.skip("cannot mount a tmpfs here (needs root); test_faults injects ENOSPC instead")
    try:
        workdir = disk / "w"
        flags = ["--config.train.num_steps=400", "--config.train.async_checkpoints=False"]
        flags += ["--config.train.checkpoint_every=10", "--config.train.keep_checkpoints=2"]
        process = main(f"--config={TINY}", f"--workdir={workdir}", *flags)
        deadline = time.time() + 120
        while not (workdir / "checkpoints" / "20").exists() and time.time() < deadline:
            time.sleep(0.05)
        filler = disk / "filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
        for block in (1 << 20, 4096, 1):  # take every free byte
            try:
                while True:
                    os.write(fd, b"\0" * block)
            except OSError:
                pass
        os.close(fd)
        status, out, err = finish(process)
        assert status == 4, (out, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "No space left on device" in lines[0], err
        assert "Traceback" not in err
        os.remove(filler)
        status, out, err = finish(main(f"--config={TINY}", f"--workdir={workdir}", *flags))
        assert status == 0, err
        reference = tmp_path / "reference"
        status, _, err = finish(main(f"--config={TINY}", f"--workdir={reference}", *flags))
        assert status == 0, err
        assert (workdir / METRICS_FILE).read_text() == (reference / METRICS_FILE).read_text()
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True, timeout=30)
        shutil.rmtree(disk, ignore_errors=True)


@pytest.mark.slow
def test_a_closed_output_pipe_is_status_141_without_a_traceback_and_resumable(tmp_path):
    """`main ... | head -2`: a BrokenPipeError traceback and exit 1 ("a run diverged") before."""
    # The first line comes after compiling, as the steps start; 1000 steps (~5 s here) leave
    # the test time to close the pipe before the run ends.
    flags = ["--config.train.num_steps=1000", "--config.train.async_checkpoints=False"]
    process = main(f"--config={TINY}", f"--workdir={tmp_path}", *flags)
    process.stdout.readline()
    process.stdout.close()  # the reader goes away, as `head` does
    _, err = process.communicate(timeout=120)
    assert process.returncode == 141, err
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 1, err
    status, out, err = finish(main(f"--config={TINY}", f"--workdir={tmp_path}", *flags))
    assert status == 0, err


@pytest.mark.slow
@pytest.mark.parametrize("merged", [False, True], ids=["stdout", "stdout_and_stderr"])
def test_reproduce_with_a_closed_output_pipe_stops_at_a_safe_point_status_141(tmp_path, merged):
    """`reproduce ... | head`: a BrokenPipeError traceback and exit 1 before (and with --jobs,
    workers left to finish on their own). Now it is a stop request, as a SIGTERM is; with
    `2>&1 | head` the one line it then says to stderr meets the closed pipe too."""
    command = [sys.executable, "-m", "resconv_jax.reproduce", f"--workdir={tmp_path}",
               "--scale=tiny", "--only=theory", "--jobs=1"]  # fmt: skip
    env = os.environ | {"PYTHONPATH": os.path.abspath(ROOT)}
    stderr = subprocess.STDOUT if merged else subprocess.PIPE
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=stderr, text=True)  # fmt: skip
    process.stdout.readline()
    process.stdout.close()
    _, err = process.communicate(timeout=180)
    assert process.returncode == 141, err
    if merged:
        return
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "output pipe closed" in err
    rerun = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=300)  # fmt: skip
    assert rerun.returncode == 0, rerun.stderr
    assert "theory" in (tmp_path / "REPORT.md").read_text()


@pytest.mark.slow
def test_a_workdir_given_as_tilde_is_under_home(tmp_path):
    """`--workdir=~/x` (the shell does not expand a ~ after '='): a folder named '~' was made."""
    command = [sys.executable, "-m", "resconv_jax.main", f"--config={TINY}", "--workdir=~/run",
               "--config.train.num_steps=10"]  # fmt: skip
    env = os.environ | {"HOME": str(tmp_path / "home"), "PYTHONPATH": os.path.abspath(ROOT)}
    (tmp_path / "home").mkdir()
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "home" / "run" / "metrics.jsonl").exists()
    assert not (tmp_path / "~").exists()


@pytest.mark.parametrize("module", ["resconv_jax.main", "resconv_jax.reproduce"])
def test_help_is_status_0(module):
    """absl's --help exits 1, which main documents as 'a run diverged' (run_report's is 0)."""
    result = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "--workdir" in result.stdout


@pytest.mark.slow
def test_an_unreadable_checkpoint_is_one_line_and_no_traceback(tmp_path):
    flags = ["--config.train.num_steps=30", "--config.train.async_checkpoints=False"]
    status, _, err = finish(main(f"--config={TINY}", f"--workdir={tmp_path}", *flags))
    assert status == 0, err
    for path in (tmp_path / "checkpoints" / "30" / "state" / "d").iterdir():
        path.write_bytes(b"garbage")
    status, out, err = finish(main(f"--config={TINY}", f"--workdir={tmp_path}", *flags))
    assert status == 0, err
    assert "checkpoint at step 30 is unreadable (ValueError); trying the previous one" in out
    assert "resuming from step 20" in out
    assert "Traceback" not in err and "Exception ignored" not in err, err


@pytest.mark.slow
def test_a_failed_first_checkpoint_save_exits_4_promptly(tmp_path):
    """`checkpoints` is a file: the first (background) save fails; the process must not hang on
    Orbax's threads after its one line."""
    tmp_path.joinpath("checkpoints").write_text("")
    flags = ["--config.train.num_steps=40"]
    process = main(f"--config={TINY}", f"--workdir={tmp_path}", *flags)
    status, _, err = finish(process, timeout=180)  # a hang is forever; a loaded start-up is not
    assert status == 4, err
    assert err.strip().splitlines() == [err.strip()]
    assert "cannot save the checkpoint of step" in err and "Not a directory" in err
