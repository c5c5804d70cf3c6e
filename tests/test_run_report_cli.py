"""python -m resconv_jax.experiments.run_report WORKDIR: one line and main's exit statuses for every
input that is not a finished or running run's folder."""

import json

import pytest

from resconv_jax.experiments import run_report as cli
from resconv_jax.runtime.workdir import WorkdirLock


def run_report(capsys, *args) -> tuple[int, str, str]:
    status = cli.main(["run_report", *map(str, args)])
    out, err = capsys.readouterr()
    return status, out, err


def _run_folder(folder, **changed):
    folder.mkdir()
    lines = [{"step": s, "run": 0, "seed": 0, "lr": 0.1, "beta_attn": 1.0, "beta_ffn": 1.0,
              "loss": 2.0 ** -s} | changed for s in range(0, 30, 10)]  # fmt: skip
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (folder / "config.json").write_text("{}")
    return folder


def _config(folder, config: dict):
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    "make, status, expected",
    [
        (lambda p: p / "missing", 2, "no such folder"),
        (lambda p: (p / "f").write_text("x") and p / "f", 2, "is a file, not a run's folder"),
        (lambda p: p, 2, "not a run's folder (no metrics.jsonl"),
        (lambda p: (p / "REPORT.md").write_text("#") and p, 2, "is a reproduce folder"),
        (lambda p: (p / "metrics.jsonl").write_text("garbage\n") and p, 2, "no valid metrics"),
        (lambda p: (p / "metrics.jsonl").write_text('{"step": 0}\n') and p, 2, "cannot report"),
        (lambda p: _run_folder(p / "r", loss="x"), 2, "line 1: loss='x' is not a number"),
        # config.json sections of another type: AttributeError tracebacks before
        (lambda p: _config(_run_folder(p / "r"), {"optim": None}), 2, "optim is not a section"),
        (lambda p: _config(_run_folder(p / "r"), {"report": []}), 2, "report is not a section"),
    ],
)
def test_bad_input_is_one_line_status_2(tmp_path, capsys, make, status, expected):
    """...and leaves the folder as it was (lines of another kind used to leave a new .lock)."""
    folder = make(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    code, out, err = run_report(capsys, folder)
    assert code == status and out == ""
    assert err.strip().splitlines() == [err.strip()] and expected in err
    assert sorted(tmp_path.rglob("*")) == before


def test_no_argument_is_status_2_and_help_is_0(capsys):
    assert run_report(capsys)[0] == 2
    code, out, _ = run_report(capsys, "--help")
    assert code == 0 and out.startswith("usage: python -m resconv_jax.experiments.run_report")


def test_a_running_workdir_is_status_3_naming_the_holder(tmp_path, capsys):
    folder = _run_folder(tmp_path / "run")
    holder = WorkdirLock(str(folder))
    holder.acquire()
    try:
        code, _, err = run_report(capsys, folder)
    finally:
        holder.release()
    assert code == 3 and "is in use by PID" in err and err.count("\n") == 1


def test_a_run_folder_is_reported(tmp_path, capsys):
    folder = _run_folder(tmp_path / "run")
    code, _, err = run_report(capsys, folder)
    assert code == 0, err
    assert (folder / "beta_table.csv").exists()
