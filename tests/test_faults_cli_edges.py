"""Bad input and interruptions met by the command lines: an empty --workdir, a report that cannot
be written, Ctrl-C, and a divergence whose λ_max(K) is itself not finite; each one line and a
documented exit status."""

import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from signal_ready import wait_until_caught

from resconv_jax import main as main_module
from resconv_jax.errors import ConfigError, WorkdirWriteError
from resconv_jax.experiments import run_report
from resconv_jax.validation import check_workdir


@pytest.mark.parametrize("workdir", ["", "  "])
def test_an_empty_workdir_is_refused_not_taken_as_this_folder(workdir):
    with pytest.raises(ConfigError, match="--workdir is empty"):
        check_workdir(workdir)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_a_workdir_that_cannot_be_made_is_bad_input_even_for_root():
    """os.access says /proc is writable to root, so this was let through and failed at the
    first write (exit status 4, "a write failed", where bad input is 2)."""
    workdir = "/proc/resconv_x"
    with pytest.raises(ConfigError, match=r"cannot be created there \(|is not writable"):
        check_workdir(workdir)
    assert not os.path.exists(workdir)


def test_the_workdir_probe_is_a_folder_that_readers_of_the_workdir_skip(tmp_path, monkeypatch):
    """check_workdir makes and removes a folder in an existing workdir; another process hashing
    that workdir's files at the same moment (results_cache) must not list it, or it lists a
    folder that is gone when it descends into it (FileNotFoundError)."""
    from resconv_jax.experiments import results_cache

    (tmp_path / "metrics.jsonl").write_text("{}\n")
    before = results_cache.files_digest(tmp_path)
    probes = []
    real_rmdir = os.rmdir

    def rmdir_later(path):
        probes.append(path)  # left in place while the digest is taken

    monkeypatch.setattr(os, "rmdir", rmdir_later)
    check_workdir(str(tmp_path))
    (probe,) = probes
    assert os.path.dirname(probe) == str(tmp_path) and os.path.isdir(probe)
    assert results_cache.skipped(os.path.basename(probe))
    assert results_cache.files_digest(tmp_path) == before
    real_rmdir(probe)


def test_a_report_that_cannot_be_written_is_one_line_status_4(tmp_path, capsys, monkeypatch):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "metrics.jsonl").write_text(
        '{"step": 0, "run": 0, "seed": 0, "lr": 0.1, "beta_attn": 1.0, "beta_ffn": 1.0, '
        '"loss": 1.0}\n'
    )

    def full_disk(workdir):
        raise WorkdirWriteError(f"cannot write {workdir}/training.png (No space left on device)")

    monkeypatch.setattr(run_report, "write_run_report", full_disk)
    assert run_report.main(["run_report", str(folder)]) == 4
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "No space left on device" in err


def test_ctrl_c_is_one_line_and_status_130(capsys, monkeypatch):
    def interrupted(argv):
        raise KeyboardInterrupt

    statuses = []
    monkeypatch.setattr(main_module, "_main", interrupted)
    monkeypatch.setattr(main_module, "_exit_now", statuses.append)
    main_module.main(["main"])
    err = capsys.readouterr().err
    assert statuses == [130] and err.count("\n") == 1 and "interrupted (Ctrl-C)" in err


def test_ctrl_c_during_the_imports_is_one_line_and_status_130(tmp_path):
    """Python's KeyboardInterrupt traceback before `main` ran; nothing may be written."""
    process = subprocess.Popen(
        [sys.executable, "-m", "resconv_jax.main", "--config=configs/theory.py",
         f"--workdir={tmp_path / 'w'}"],
        cwd=os.path.join(os.path.dirname(__file__), ".."), stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    # During the imports (they take seconds), once main's handlers are there: SIGTERM's is put
    # in after Ctrl-C's. A fixed 0.5 s could be before them on a loaded machine.
    wait_until_caught(process, signal.SIGTERM)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130 and err.count("\n") == 1, err
    assert err.startswith("error: interrupted (Ctrl-C) while starting; nothing was written")
    assert not (tmp_path / "w").exists()


def test_a_divergence_with_no_finite_lambda_max_suggests_no_lr():
    from resconv_jax.runtime.divergence import diverged_message
    from resconv_jax.sweep import RunSpec

    runs = [RunSpec(r, 0, 0.01, b, b) for r, b in enumerate((0.0, 1.0))]
    losses = np.array([[np.nan, np.nan]])
    message = diverged_message(
        losses, 0, runs, [], [], "/ckpt", lambda: (np.array([np.nan, np.nan]), "t"), False
    )
    assert "lr=nan" not in message and "2/lambda_max(K) is not finite" in message


def test_an_ignored_sigint_stays_ignored_through_start_up():
    """A background job of a script (or nohup) ignores SIGINT; start-up must not undo that."""
    from resconv_jax.runtime import signals

    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        signals.exit_on_interrupt()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        signals.interrupts_raise()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)
