"""Jena Climate data checks: near-constant columns, hourly clock, duplicates and gaps reported."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_jena import COLS, START, csv_text, file_cfg, sample_values, write

from resconv_jax.data.jena import load_jena
from resconv_jax.errors import JenaDataError

SPLIT_KEYS = ("x_train", "y_train", "x_val", "y_val", "x_test", "y_test", "mean", "std")
FOUR = ("p (mbar)", "T (degC)", "rh (%)", "wv (m/s)")


def ten_minute_lines(n: int, seed: int = 0) -> list[str]:
    """Header + n gap-free 10-minute records; p = the record's index (so rows can be traced)."""
    return csv_text(sample_values(n, seed), step_min=10).splitlines(keepends=True)


def record_rows(s) -> np.ndarray:
    """The 10-minute record index (the p column) of every input hour of every split."""
    x = np.concatenate([s.x_train[..., 0], s.x_val[..., 0], s.x_test[..., 0]], axis=None)
    return np.rint(x * s.std[0] + s.mean[0]).astype(int)


def test_near_constant_columns_are_all_refused_at_once(tmp_path: Path):
    values = np.empty((200, 4))
    values[:, :3] = 996.52, 3.33, 93.30  # constant; their float std is ~1e-13, not 0
    values[:, 3] = sample_values(200)[:, 2]
    path = write(tmp_path / "flat.csv", csv_text(values, columns=FOUR))
    with pytest.raises(JenaDataError) as info:
        load_jena(file_cfg(path))
    msg = str(info.value)
    assert msg.startswith(f"{path}: ") and "\n" not in msg and "constant" in msg
    assert "'p (mbar)'" in msg and "'T (degC)'" in msg and "'rh (%)'" in msg
    assert "'wv (m/s)'" not in msg and "varies" not in msg
    with pytest.raises(JenaDataError, match=r"flat\.csv: .*constant.*'T \(degC\)'") as info:
        load_jena(file_cfg(path, features=("wv (m/s)",)))  # the target is checked too
    assert "'p (mbar)'" not in str(info.value)


def test_column_constant_on_train_only_is_refused(tmp_path: Path):
    values = sample_values(200)
    values[:140, 2] = 0.10  # the train rows; val/test vary
    path = write(tmp_path / "train_flat.csv", csv_text(values))
    with pytest.raises(JenaDataError) as info:
        load_jena(file_cfg(path))
    msg = str(info.value)
    assert "train_flat.csv: " in msg and "\n" not in msg
    assert "constant on the train split" in msg and "'wv (m/s)'" in msg and "varies" in msg
    assert "'T (degC)'" not in msg and "'p (mbar)'" not in msg


def test_absurd_standardized_values_after_train_are_refused(tmp_path: Path):
    values = sample_values(200)
    values[:140, 2] = np.arange(140) % 2 * 0.01  # std 0.005: not near-constant by the rule
    values[170, 2] = 80.0  # a val row 16000 train stds away
    path = write(tmp_path / "tiny_std.csv", csv_text(values))
    with pytest.raises(JenaDataError) as info:
        load_jena(file_cfg(path))
    msg = str(info.value)
    assert "tiny_std.csv: line 172: " in msg and "\n" not in msg
    assert "'wv (m/s)' = 80 is" in msg and "an error value" in msg


@pytest.mark.parametrize(
    "row, column, value, expected",
    [
        (10, 1, -9999.0, "'T (degC)' = -9999 is the station's error code -9999"),
        (10, 1, 1e300, "'T (degC)' = 1e+300 is"),
        (150, 0, 5e6, "'p (mbar)' = 5e+06 is"),
        (20, 1, float("inf"), "non-finite value inf in 'T (degC)'"),
    ],
)
def test_error_values_are_refused_in_every_split(tmp_path: Path, row, column, value, expected):
    """The train split too (its statistics would absorb the value), naming the line."""
    values = sample_values(200)
    values[row, column] = value
    path = write(tmp_path / "error.csv", csv_text(values))
    with pytest.raises(JenaDataError) as info:
        load_jena(file_cfg(path))
    msg = str(info.value)
    assert msg.startswith(f"{path}: line {row + 2}: ") and "\n" not in msg
    assert expected in msg, msg


def test_the_wind_error_code_is_read_as_calm(tmp_path: Path):
    values = sample_values(200)
    values[10, 2] = -9999.0
    path = write(tmp_path / "wind.csv", csv_text(values))
    splits = load_jena(file_cfg(path))
    assert np.isfinite(splits.x_train).all() and np.abs(splits.x_train).max() < 10


def test_duplicate_ten_minute_record_is_reported_and_hours_stay_on_clock(tmp_path: Path):
    lines = ten_minute_lines(1200)
    dup = lines[:102] + [lines[101]] + lines[102:700] + [lines[699]] + lines[700:]
    a = load_jena(file_cfg(write(tmp_path / "ten.csv", "".join(lines))))
    b = load_jena(file_cfg(write(tmp_path / "dup.csv", "".join(dup))))
    assert "2 exact duplicate records dropped (lines 103, 702)" in b.source
    for k in SPLIT_KEYS:
        assert np.array_equal(getattr(a, k), getattr(b, k)), k
    assert (record_rows(b) % 6 == 0).all()


def test_missing_ten_minute_record_keeps_hours_on_clock(tmp_path: Path):
    lines = ten_minute_lines(1200)
    full = load_jena(file_cfg(write(tmp_path / "ten.csv", "".join(lines))))
    off_hour = lines[:101] + lines[102:]  # record 100 (16:50) is not on the hourly clock
    a = load_jena(file_cfg(write(tmp_path / "miss.csv", "".join(off_hour))))
    for k in SPLIT_KEYS:
        assert np.array_equal(getattr(full, k), getattr(a, k)), k
    assert "gap" not in a.source
    on_hour = off_hour[:300] + off_hour[301:]  # and record 300 (the 50th hour)
    b = load_jena(file_cfg(write(tmp_path / "miss2.csv", "".join(on_hour))))
    assert (record_rows(b) % 6 == 0).all()
    assert "1 gap in the hourly grid (after line 295: 1 h missing" in b.source
    assert "non-consecutive hours" in b.source


def test_gaps_in_an_hourly_file_are_reported_with_lines(tmp_path: Path):
    values = sample_values(200)
    times = START + np.arange(200) * np.timedelta64(3600, "s")
    keep = np.setdiff1d(np.arange(200), [50, 51, 52, 80, 120, 160])
    path = write(tmp_path / "gaps.csv", csv_text(values[keep], columns=COLS, times=times[keep]))
    s = load_jena(file_cfg(path))
    assert (
        "4 gaps in the hourly grid (after line 51: 3 h missing, after line 78: 1 h missing, "
        "after line 117: 1 h missing, …" in s.source
    )
    assert "windows spanning a gap join non-consecutive hours" in s.source
    shifted = times.copy()
    shifted[100:] += np.timedelta64(600, "s")  # a 70-minute step, then hourly again
    path = write(tmp_path / "step.csv", csv_text(values, columns=COLS, times=shifted))
    assert (
        "1 gap in the hourly grid (after line 101: 70 min step" in load_jena(file_cfg(path)).source
    )


def test_records_off_the_ten_minute_grid_are_reported(tmp_path: Path):
    lines = ten_minute_lines(1200)
    lines[51] = lines[51].replace(":00,", ":30,", 1)  # record 50 at 08:30:30, line 52
    s = load_jena(file_cfg(write(tmp_path / "off.csv", "".join(lines))))
    assert "1 record off the 10-minute grid (line 52)" in s.source
    assert (record_rows(s) % 6 == 0).all()
