"""Jena Climate loader: parsing, windows, splits, sources and bad-data errors (offline)."""

from __future__ import annotations

import gzip
import time
import zipfile
from importlib import resources
from pathlib import Path

import numpy as np
import pytest

from resconv_jax.data import jena
from resconv_jax.data.formats.jena_csv import (
    BUNDLED_FULL_NAME,
    BUNDLED_SHA256,
    JENA_COLUMNS,
    file_sha256,
    format_timestamp,
    git_blob_sha1,
    parse_jena_csv,
    read_csv_bytes,
)
from resconv_jax.data.jena import load_jena
from resconv_jax.errors import JenaDataError

# The first two records of jena_climate_2009_2016.csv (all 14 variables).
ORIGINAL_HEAD = (
    '"Date Time","p (mbar)","T (degC)","Tpot (K)","Tdew (degC)","rh (%)","VPmax (mbar)",'
    '"VPact (mbar)","VPdef (mbar)","sh (g/kg)","H2OC (mmol/mol)","rho (g/m**3)","wv (m/s)",'
    '"max. wv (m/s)","wd (deg)"\n'
    "01.01.2009 00:10:00,996.52,-8.02,265.40,-8.90,93.30,3.33,3.11,0.22,1.94,3.12,1307.75,1.03,"
    "1.75,152.30\n"
    "01.01.2009 00:20:00,996.57,-8.41,265.01,-9.28,93.40,3.23,3.02,0.21,1.89,3.03,1309.80,0.72,"
    "1.50,136.10\n"
)
COLS = ("p (mbar)", "T (degC)", "wv (m/s)")
START = np.datetime64("2009-01-01T00:10", "s")


def csv_text(values: np.ndarray, columns=COLS, step_min: int = 60, times=None) -> str:
    """CSV text in the original format; values (N, k) should lie on the 0.01 grid."""
    if times is None:
        times = START + np.arange(len(values)) * np.timedelta64(step_min * 60, "s")
    lines = [",".join(f'"{c}"' for c in ("Date Time", *columns))]
    for t, row in zip(times, values, strict=True):
        date = format_timestamp(np.datetime64(t, "s").astype(np.int64))
        lines.append(date + "," + ",".join(f"{v:.2f}" for v in row))
    return "\n".join(lines) + "\n"


def sample_values(n: int, seed: int = 0) -> np.ndarray:
    """(n, 3): p = row index (so rows can be traced), T and wv random on the 0.01 grid."""
    rng = np.random.default_rng(seed)
    t = np.round(rng.normal(5.0, 8.0, n) * 100) / 100
    wv = np.round(rng.uniform(0.0, 5.0, n) * 100) / 100
    return np.stack([np.arange(n, dtype=np.float64), t, wv], axis=1)


def write(path: Path, text: str) -> Path:
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


def file_cfg(path: Path, /, **overrides):
    cfg = jena.default_config()
    cfg.source, cfg.path, cfg.seq_len, cfg.num_train = "file", str(path), 4, -1
    cfg.update(overrides)
    return cfg


@pytest.fixture
def hourly(tmp_path: Path) -> tuple[Path, np.ndarray]:
    values = sample_values(200)
    return write(tmp_path / "hourly.csv", csv_text(values)), values


def test_parse_original_header_dates_and_compression(tmp_path: Path):
    path = write(tmp_path / "head.csv", ORIGINAL_HEAD)
    table = parse_jena_csv(*read_csv_bytes(path))
    assert table.columns == JENA_COLUMNS
    assert table.timestamps.tolist() == [
        int(np.datetime64("2009-01-01T00:10:00", "s").astype(np.int64)),
        int(np.datetime64("2009-01-01T00:20:00", "s").astype(np.int64)),
    ]
    assert table.values[0, :2].tolist() == [996.52, -8.02] and table.values[1, -1] == 136.10
    assert table.lines.tolist() == [2, 3]
    gz = write(tmp_path / "head.csv.gz", ORIGINAL_HEAD)
    zpath = tmp_path / "head.zip"
    with zipfile.ZipFile(zpath, "w") as zf:
        zf.writestr("__MACOSX/._head.csv", b"junk")
        zf.writestr("head.csv", ORIGINAL_HEAD)
    for other in (gz, zpath):
        assert np.array_equal(parse_jena_csv(*read_csv_bytes(other)).values, table.values)
    six = parse_jena_csv(b'"Date Time","T (degC)"\n31.12.2016 23:50:00,-4.23\n', "six")
    assert format_timestamp(six.timestamps[0]) == "31.12.2016 23:50:00"


def test_ten_minute_records_keep_every_sixth(tmp_path: Path):
    values = sample_values(1200)
    ten = write(tmp_path / "ten.csv.gz", csv_text(values, step_min=10))
    times = START + 600 * np.arange(1200)
    hour = write(tmp_path / "hour.csv", csv_text(values[::6], times=times[::6]))
    a, b = load_jena(file_cfg(ten)), load_jena(file_cfg(hour))
    assert "every 6th kept" in a.source and "hourly records" in b.source
    for k in ("x_train", "y_train", "x_val", "y_val", "x_test", "y_test", "mean", "std"):
        assert np.array_equal(getattr(a, k), getattr(b, k)), k
    assert a.x_train.shape == (34, 4, 3)


def test_wind_error_values_become_zero(tmp_path: Path):
    values = sample_values(200)
    values[[3, 50, 150], 2] = -9999.0
    cols = ("p (mbar)", "T (degC)", "wv (m/s)", "max. wv (m/s)")
    values = np.concatenate([values, values[:, 2:]], axis=1)
    s = load_jena(file_cfg(write(tmp_path / "w.csv", csv_text(values, columns=cols))))
    fixed = np.where(values <= -9990, 0.0, values)[:140]
    np.testing.assert_allclose(s.mean, fixed.mean(0), rtol=1e-6)
    np.testing.assert_allclose(s.std, fixed.std(0), rtol=1e-6)
    assert np.allclose(s.x_train[0, 3, 2:] * s.std[2:] + s.mean[2:], 0.0, atol=1e-4)


def test_split_is_chronological_and_leak_free(hourly):
    path, _ = hourly
    s = load_jena(file_cfg(path, stride=2))
    row = lambda x: np.rint(x[..., 0] * s.std[0] + s.mean[0]).astype(int)  # noqa: E731
    train_rows, val_rows, test_rows = row(s.x_train), row(s.x_val), row(s.x_test)
    assert train_rows.max() + 4 < 140  # train targets end inside the train split (rows 0..139)
    assert val_rows.min() >= 140 and val_rows.max() + 4 < 180
    assert test_rows.min() >= 180 and test_rows.max() + 4 < 200
    assert (np.diff(train_rows[:, 0]) == 2).all()


def test_standardization_uses_train_statistics(hourly):
    path, values = hourly
    s = load_jena(file_cfg(path))
    np.testing.assert_allclose(s.mean, values[:140].mean(0), rtol=1e-6)
    np.testing.assert_allclose(s.std, values[:140].std(0), rtol=1e-6)
    assert s.target_mean == pytest.approx(values[:140, 1].mean())
    assert not np.allclose(values[140:180].mean(0), s.mean, rtol=1e-3)
    assert abs(float(s.x_val[..., 0].mean())) > 1.0  # val is not centred by its own statistics


def test_windows_and_targets_line_up_with_rows(hourly):
    path, values = hourly
    m, stride = 4, 3
    s = load_jena(file_cfg(path, seq_len=m, stride=stride, num_train=10))
    z = (values - values[:140].mean(0)) / values[:140].std(0)
    assert s.x_train.shape == (10, m, 3) and s.y_train.shape == (10, m, 1)
    assert s.x_train.dtype == np.float32 and s.y_val.dtype == np.float32
    for p in (0, 1, 7, 9):
        for i in (0, 2, m - 1):
            np.testing.assert_allclose(s.x_train[p, i], z[p * stride + i], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(s.y_train[p, i, 0], z[p * stride + m + i, 1], rtol=1e-5)
    p = 5  # val rows start at 140
    np.testing.assert_allclose(s.x_val[p, 1], z[140 + p * stride + 1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(s.y_val[p, 3, 0], z[140 + p * stride + m + 3, 1], rtol=1e-5)
    assert s.x_val.shape[0] == (40 - 2 * m) // stride + 1


def test_features_subset_and_num_val(hourly):
    path, values = hourly
    s = load_jena(file_cfg(path, features=("wv (m/s)", "T (degC)"), num_val=3))
    assert s.feature_names == ("wv (m/s)", "T (degC)") and s.x_train.shape[-1] == 2
    assert s.x_val.shape == (3, 4, 2)
    np.testing.assert_allclose(s.mean, values[:140][:, [2, 1]].mean(0), rtol=1e-6)


def test_exact_duplicate_records_are_dropped(tmp_path: Path, hourly):
    path, values = hourly
    text = path.read_text().splitlines(keepends=True)
    duplicated = write(tmp_path / "dup.csv", "".join(text[:31] + text[21:31] + text[31:]))
    a, b = load_jena(file_cfg(path)), load_jena(file_cfg(duplicated))
    assert "10 exact duplicate records dropped" in b.source
    assert np.array_equal(a.x_train, b.x_train) and np.array_equal(a.y_test, b.y_test)


def _bad_cases(values: np.ndarray) -> dict[str, tuple[str, str, int | None]]:
    good = csv_text(values[:40]).splitlines()
    body = "\n".join(good[1:])
    header = good[0]

    def edit(line: int, new: str) -> str:
        lines = list(good)
        lines[line - 1] = new
        return "\n".join(lines) + "\n"

    swapped = list(good)
    swapped[9], swapped[10] = swapped[10], swapped[9]
    return {
        "fields": (edit(4, good[3] + ",1.00"), "malformed row: 5 fields, expected 4", 4),
        "number": (edit(6, good[5].replace(",", ",abc", 1)), "unparsable number", 6),
        "date": (edit(3, "32.01.2009 02:10:00,1,2,3"), "unparsable date", 3),
        "date_format": (edit(5, "2009-01-01 04:10:00,1,2,3"), "unparsable date", 5),
        "no_date": ('"p (mbar)","T (degC)","wv (m/s)"\n' + body, "'Date Time'", 1),
        "no_T": ('"Date Time","p (mbar)","wv (m/s)"\n1', "'T (degC)'", 1),
        "unknown_col": (header.replace("wv (m/s)", "wind") + "\n" + body, "unknown column", 1),
        "nan": (edit(7, good[6].rsplit(",", 1)[0] + ",nan"), "non-finite value nan", 7),
        "order": ("\n".join(swapped) + "\n", "out of order", 11),
        "dup": (edit(12, good[10].rsplit(",", 1)[0] + ",9.99"), "duplicated timestamp", 12),
        "empty": ("", "empty file", None),
        "header_only": (header + "\n", "header only", 1),
        "too_few": (csv_text(values[:15]), "not enough rows", None),
    }


@pytest.mark.parametrize("case", list(_bad_cases(sample_values(40))))
def test_bad_data_errors_name_file_and_line(tmp_path: Path, case: str):
    text, problem, line = _bad_cases(sample_values(40))[case]
    path = write(tmp_path / f"bad_{case}.csv", text)
    with pytest.raises(JenaDataError) as info:
        load_jena(file_cfg(path))
    msg = str(info.value)
    assert f"bad_{case}.csv" in msg and problem in msg and "\n" not in msg
    if line is not None:
        assert f"line {line}:" in msg


def test_missing_file_too_few_rows_and_file_hash(tmp_path: Path, hourly):
    with pytest.raises(JenaDataError, match=r"nope\.csv: file not found"):
        load_jena(file_cfg(tmp_path / "nope.csv"))
    with pytest.raises(JenaDataError, match=r"need 164 hourly rows, the train split has 140"):
        load_jena(file_cfg(hourly[0], num_train=40))
    with pytest.raises(JenaDataError, match=r"hourly\.csv: sha256 mismatch: expected f+, got"):
        load_jena(file_cfg(hourly[0], sha256="f" * 64))
    assert load_jena(file_cfg(hourly[0], sha256=file_sha256(hourly[0]))).x_test.shape[0] == 4


@pytest.mark.parametrize(
    "overrides, problem",
    [
        ({"seq_len": 0}, "seq_len must be an integer >= 1"),
        ({"source": "ftp"}, "unknown source 'ftp'"),
        ({"features": ("T (degC)", "temp")}, "unknown feature 'temp'"),
        ({"features": ("Tpot (K)",)}, "not in the file's columns"),
        ({"path": ""}, "needs path"),
        ({"sha256": "abc"}, "64 hex digits"),
        ({"num_train": 0}, "num_train must be -1"),
        ({"num_val": 0}, "num_val must be -1"),  # gave a val_loss of 0.0
        ({"source": "tfds", "sha256": "a" * 64}, "sha256 checks the file of source"),  # ignored
        # the next four trained on the packaged record (or the file), the path or folder unread
        ({"source": "bundled"}, r"path is read by source='file' or 'tfds' only; source='bundl"),
        ({"source": "download"}, r"path is read by source='file' or 'tfds' only"),
        ({"tfds_data_dir": "/tmp/x"}, r"tfds_data_dir is read by source='tfds' only"),
        ({"cache_dir": "/tmp/x"}, r"cache_dir is read by source='download' or 'tfds' only"),
    ],
)
def test_config_errors(hourly, overrides, problem):
    with pytest.raises(JenaDataError, match=problem):
        load_jena(file_cfg(hourly[0], **overrides))


@pytest.mark.parametrize("source, field", [("download", "cache_dir"), ("tfds", "tfds_data_dir")])
def test_a_folder_that_cannot_be_created_is_one_line(tmp_path, source, field):
    """They were NotADirectoryError tracebacks (exit 1)."""
    (tmp_path / "file").write_text("")
    cfg = jena.default_config()
    cfg.update({"source": source, field: str(tmp_path / "file" / "x")})
    with pytest.raises(JenaDataError, match=f"{field}=.*cannot be created"):
        load_jena(cfg)


def test_bundled_sample_default_config_and_lift():
    cfg = jena.default_config()
    s = load_jena(cfg)
    assert s.x_train.shape == (256, 24, 6) and s.y_train.shape == (256, 24, 1)
    assert s.x_val.shape == (145, 24, 6) and s.x_test.shape == (72, 24, 6)
    assert s.feature_names[1] == "T (degC)" and s.mean.shape == s.std.shape == (6,)
    assert "bundled" in s.source and "01.01.2009 00:10:00" in s.source
    cfg.lift_dim, cfg.lift_seed = 64, 3
    a, b = load_jena(cfg), load_jena(cfg)
    assert a.x_train.shape == (256, 24, 64) and a.x_val.shape == (145, 24, 64)
    assert np.array_equal(a.x_train, b.x_train) and a.lift.shape == (6, 64)
    np.testing.assert_allclose(a.x_val, s.x_val @ a.lift, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(a.y_train, s.y_train)
    cfg.lift_seed = 4
    assert not np.allclose(load_jena(cfg).x_train, a.x_train)


@pytest.mark.parametrize("lift_dim", [10**6, 10**10])
def test_a_lift_that_cannot_fit_is_one_line_before_it_is_drawn(lift_dim):
    """Before, numpy's MemoryError: a traceback and exit 1 (at 10**10 drawing the map itself)."""
    cfg = jena.default_config()
    cfg.lift_dim = lift_dim
    with pytest.raises(JenaDataError, match=rf"lift_dim={lift_dim}: the lifted .* needs") as err:
        load_jena(cfg)
    assert "\n" not in str(err.value)


def test_tfds_builder_gives_the_same_arrays(tmp_path: Path, hourly):
    path, _ = hourly
    data_dir = tmp_path / "tfds"
    via_tfds = load_jena(file_cfg(path, source="tfds", tfds_data_dir=str(data_dir), stride=3))
    via_csv = load_jena(file_cfg(path, stride=3))
    for k in ("x_train", "y_train", "x_val", "y_val", "x_test", "y_test", "mean", "std"):
        assert np.array_equal(getattr(via_tfds, k), getattr(via_csv, k)), k
    assert "tfds" in via_tfds.source
    assert (data_dir / "jena_climate" / "1.0.0").is_dir()
    other = write(tmp_path / "other.csv", csv_text(sample_values(200, seed=1)))
    with pytest.raises(JenaDataError, match="was prepared from"):
        load_jena(file_cfg(other, source="tfds", tfds_data_dir=str(data_dir)))


def test_tfds_reads_a_csv_put_in_its_manual_folder(tmp_path: Path, hourly):
    """The builder's MANUAL_DOWNLOAD_INSTRUCTIONS: a CSV in <tfds_data_dir>/downloads/manual/ is
    the source when no path is given (it used to be prepared, then refused as not the sample)."""
    path, _ = hourly
    data_dir = tmp_path / "tfds"
    manual = data_dir / "downloads" / "manual"
    manual.mkdir(parents=True)
    (manual / "jena_climate_2009_2016.csv").write_bytes(path.read_bytes())
    via_tfds = load_jena(file_cfg("", source="tfds", tfds_data_dir=str(data_dir), stride=3))
    via_csv = load_jena(file_cfg(path, stride=3))
    assert np.array_equal(via_tfds.x_train, via_csv.x_train)
    assert "jena_climate_2009_2016.csv" in via_tfds.source


def test_tfds_finds_the_manual_csv_under_a_tilde_data_dir(tmp_path: Path, hourly, monkeypatch):
    """tfds_data_dir="~/tfds": the folder was made under $HOME, but the manual folder was looked
    for under a literal "~", so the bundled sample was prepared instead of the user's CSV."""
    path, _ = hourly
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)  # where the old code made its literal "~" folder
    manual = tmp_path / "tfds" / "downloads" / "manual"
    manual.mkdir(parents=True)
    (manual / "jena_climate_2009_2016.csv").write_bytes(path.read_bytes())
    via_tfds = load_jena(file_cfg("", source="tfds", tfds_data_dir="~/tfds", stride=3))
    assert "jena_climate_2009_2016.csv" in via_tfds.source


def test_download_fails_fast_offline(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(jena, "JENA_URL", "http://127.0.0.1:9/jena_climate_2009_2016.csv.zip")
    cfg = jena.default_config()
    cfg.source, cfg.cache_dir = "download", str(tmp_path)
    start = time.monotonic()
    with pytest.raises(JenaDataError, match="download of .* failed .*source='file'") as info:
        load_jena(cfg)
    assert time.monotonic() - start < 10 and "\n" not in str(info.value)
    assert not list(tmp_path.iterdir())


def test_download_cache_hash_verification(tmp_path: Path, monkeypatch, hourly):
    content = hourly[0].read_bytes()
    zpath = tmp_path / jena.JENA_ZIP_NAME
    with zipfile.ZipFile(zpath, "w") as zf:
        zf.writestr("jena_climate_2009_2016.csv", content)
    monkeypatch.setattr(jena, "JENA_URL", "http://127.0.0.1:9/unused.zip")
    cfg = jena.default_config()
    cfg.source, cfg.cache_dir, cfg.seq_len, cfg.num_train = "download", str(tmp_path), 4, 5
    blob_error = f"git blob sha1 mismatch: expected {jena.JENA_CSV_GIT_BLOB}, got"
    with pytest.raises(JenaDataError, match=blob_error):
        load_jena(cfg)
    cfg.sha256 = "0" * 64
    sha_error = rf"{zpath.name}: sha256 mismatch: expected 0+, got [0-9a-f]{{64}}$"
    with pytest.raises(JenaDataError, match=sha_error):
        load_jena(cfg)
    cfg.sha256 = file_sha256(zpath)
    assert load_jena(cfg).x_train.shape == (5, 4, 3)
    cfg.sha256 = ""
    monkeypatch.setattr(jena, "JENA_CSV_GIT_BLOB", git_blob_sha1(content))
    assert load_jena(cfg).x_train.shape == (5, 4, 3)


def test_the_full_bundled_record_gives_every_window_and_is_checked():
    cfg = jena.default_config()
    cfg.update(source="bundled_full", num_train=-1)
    s = load_jena(cfg)
    assert (s.x_train.shape, s.x_val.shape, s.x_test.shape) == ((2041, 24, 6), (582, 24, 6),
                                                                (290, 24, 6))  # fmt: skip
    assert "jena_hourly_2009_2016.csv.gz: hourly records; 70038 hourly rows" in s.source
    notes = (resources.files("resconv_jax.data") / "bundled" / "JENA_PROVENANCE.md").read_text()
    for name, sha in BUNDLED_SHA256.items():
        assert name in notes and sha in notes, name


def test_a_damaged_bundled_record_is_refused_in_one_line(monkeypatch):
    from resconv_jax.data.formats import jena_csv

    good = jena_csv.bundled_csv_bytes(BUNDLED_FULL_NAME)
    damaged = gzip.compress(gzip.decompress(good).replace(b"996.52", b"996.53", 1))
    monkeypatch.setattr(jena_csv, "bundled_csv_bytes", lambda name=BUNDLED_FULL_NAME: damaged)
    cfg = jena.default_config()
    cfg.source = "bundled_full"
    with pytest.raises(JenaDataError, match=r"^jena_hourly_2009_2016\.csv\.gz \(bundled\): sha256"):
        load_jena(cfg)


def test_the_replication_config_is_the_protocols_rule():
    """Row 5a′'s rule (docs/protocol.md, section 5), written before any replication run: every
    window of 2009–2016 standardized as for 5a, seeds 3–12, 5 β on both residuals, η = 8e-7,
    300 steps with every step's loss, the model and loss of 5a. Its probe skips the per-sample
    σ_min, which its measure does not read (the losses are the same bits either way)."""
    from resconv_jax.config_defaults import load_config_file

    row_5a = load_config_file("configs/jena.py", "small").to_dict()
    rule = load_config_file("configs/jena.py", "full,replication").to_dict()
    assert rule["data"] == row_5a["data"] | {"source": "bundled_full", "num_train": -1}
    assert rule["sweep"] == row_5a["sweep"] | {"seed": tuple(range(3, 13))}
    assert rule["sweep"]["beta"] == (0.0, 0.25, 0.5, 0.75, 1.0)
    assert rule["optim"] == row_5a["optim"] | {"lr": 8e-7}
    assert rule["model"] == row_5a["model"] and rule["certificate"] == row_5a["certificate"]
    assert rule["train"]["num_steps"] == rule["train"]["step_losses_until"] == 300
    assert rule["probe"] == row_5a["probe"] | {"per_sample": False}
