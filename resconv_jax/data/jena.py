"""Jena Climate windows for the paper's weather experiment.

Pipeline (paper.md, "Jena Climate"; our protocol where the paper is silent): read the original CSV
format (jena_csv.py), drop exact duplicate records, keep the records of a 10-minute file that lie
on the hourly clock of its first record (timestamp = first mod 1 h: every 6th record on a gap-free
file, as in the shared hourly npz/CSV, which were sampled by index and so shift their minute after
a gap of the source; here a missing record shifts nothing), set wind-speed error values (<= -9990)
to 0, split the hourly rows 70/20/10 in time order, standardize every feature with the train rows'
mean and std, and cut each split into windows: X_p is M consecutive rows of the selected features,
Y_p the standardized temperature of the next M rows. A window's inputs and targets lie inside its
split. Gaps are not filled: the summary (`JenaSplits.source`) reports them and the duplicates.
A column (or the target) that is constant or near-constant on the train split is refused, as are
standardized val/test values beyond 1000 train stds. Optionally X is lifted by a fixed random map.
"""

from __future__ import annotations

import dataclasses
import functools
import http.client
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import ml_collections
import numpy as np

from resconv_jax.data import Dataset
from resconv_jax.data.formats.fields import check_read_by_source, int_field, made_folder
from resconv_jax.data.formats.jena_csv import (
    BUNDLED_FULL_NAME,
    BUNDLED_NAME,
    JENA_COLUMNS,
    TARGET_COLUMN,
    WIND_COLUMNS,
    JenaDataError,
    JenaTable,
    bundled_csv,
    check_order,
    check_sha256,
    format_timestamp,
    git_blob_sha1,
    parse_jena_csv,
    read_csv_bytes,
)
from resconv_jax.runtime import memory

__all__ = [
    "JENA_URL",
    "JenaDataError",
    "JenaSplits",
    "default_config",
    "load_jena",
    "load_table",
    "make_splits",
]

NAME = __name__.rpartition(".")[2]
JENA_URL = (
    "https://storage.googleapis.com/tensorflow/tf-keras-datasets/jena_climate_2009_2016.csv.zip"
)
JENA_ZIP_NAME = "jena_climate_2009_2016.csv.zip"
# git blob id of the canonical CSV inside JENA_URL's zip (same in several unrelated repos).
JENA_CSV_GIT_BLOB = "3dc17139ed8afe4f693b3b88cbdd6e3a69e2de0c"
DOWNLOAD_TIMEOUT_S = 15.0
SOURCES = ("bundled", "bundled_full", "file", "download", "tfds")
_READERS = {  # the sources that read them
    "path": ("file", "tfds"),
    "cache_dir": ("download", "tfds"),
    "tfds_data_dir": ("tfds",),
}
BUNDLED = {"bundled": BUNDLED_NAME, "bundled_full": BUNDLED_FULL_NAME}
_WIND_SENTINEL = -9990.0  # wind speeds at or below this are the station's -9999 error code
_FLAT_RTOL = 1e-6  # train std <= _FLAT_RTOL * (|mean| + 1): (near-)constant, not standardized
_MAX_ABS_Z = 1e3  # a standardized val/test value beyond this means the train std is far too small
# A value this many robust stds (1.4826 × the median absolute deviation, at least 0.1 × the std)
# from its column's median, in any split, is an error value: the 2009-2016 record's largest is 10.
_MAX_ROBUST_Z = 100.0
_LISTED = 3  # how many line numbers a summary lists


def default_config() -> ml_collections.ConfigDict:
    """The `config.data` section of Jena (P = 256 windows of M = 24 hours, all features, no
    lift); `load_jena`'s fields."""
    cfg = ml_collections.ConfigDict()
    cfg.name = NAME
    # "bundled" (2009-2010 hourly, packaged) | "bundled_full" (2009-2016 hourly, packaged) | "file"
    # | "download" | "tfds"
    cfg.source = "bundled"
    cfg.path = ""  # CSV/.csv.gz/.zip for source=file; for tfds: CSV to prepare from ("" = bundled)
    cfg.cache_dir = ""  # download cache and default tfds data_dir ("" = ~/.cache/resconv_jax)
    cfg.sha256 = ""  # if set: expected sha256 of the zip / the file (download: else git blob id)
    cfg.tfds_data_dir = ""  # tfds data_dir for source=tfds ("" = <cache_dir>/tfds)
    cfg.seq_len = 24  # M: hours per window (inputs) and per target
    cfg.num_train = 256  # P: the first P train windows in time order; -1 = all
    cfg.num_val = -1  # number of validation windows; -1 = all
    cfg.stride = 0  # rows between window starts; 0 = seq_len (non-overlapping inputs)
    cfg.lift_dim = 0  # > 0: lift X to this width by a fixed Gaussian map; 0 = no lift
    cfg.lift_seed = 0  # seed of the lift map
    cfg.features = ()  # column names to use as input features; () = all in the file
    return cfg


@dataclasses.dataclass(frozen=True)
class JenaSplits:
    """Windowed, standardized splits (float32). d = lift_dim if lifted, else d_feat.

    x_*: (P, M, d) inputs; y_*: (P, M, 1) standardized temperature of the next M hours.
    mean, std: (d_feat,) train statistics of `feature_names`; target_mean, target_std: those of
    `T (degC)` (to undo the targets' scaling). lift: (d_feat, d) map applied to X, or None.
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    feature_names: tuple[str, ...]
    mean: np.ndarray
    std: np.ndarray
    source: str
    target_mean: float = 0.0
    target_std: float = 1.0
    lift: np.ndarray | None = None


_int_field = functools.partial(int_field, error=JenaDataError, label="jena")


def _check_config(cfg: Any) -> dict[str, Any]:
    """The config's fields, validated, with defaults for missing ones."""
    d = default_config()
    c = {k: getattr(cfg, k, d[k]) for k in ("source", "path", "cache_dir", "sha256")}
    c["tfds_data_dir"] = getattr(cfg, "tfds_data_dir", "")
    if c["source"] not in SOURCES:
        raise JenaDataError(
            f"jena config: unknown source {c['source']!r}, expected one of {SOURCES}"
        )
    if c["source"] == "file" and not c["path"]:
        raise JenaDataError("jena config: source='file' needs path=<jena CSV, .csv.gz or .zip>")
    check_read_by_source(c, _READERS, error=JenaDataError, label="jena")
    sha = str(c["sha256"]).lower()
    if sha and (len(sha) != 64 or any(ch not in "0123456789abcdef" for ch in sha)):
        raise JenaDataError(f"jena config: sha256 must be 64 hex digits, got {c['sha256']!r}")
    if sha and c["source"] not in ("file", "download"):
        raise JenaDataError(
            f"jena config: sha256 checks the file of source='file' or 'download' only; "
            f"source={c['source']!r} would not check it (leave sha256 empty)"
        )
    c["sha256"] = sha
    c["seq_len"] = _int_field(cfg, "seq_len", d.seq_len, 1)
    for key in ("num_train", "num_val"):  # 0 windows: an empty mean, a val_loss of 0.0
        c[key] = _int_field(cfg, key, d[key], -1)
        if c[key] == 0:
            raise JenaDataError(f"jena config: {key} must be -1 (all) or > 0, got 0")
    c["stride"] = _int_field(cfg, "stride", d.stride, 0) or c["seq_len"]
    c["lift_dim"] = _int_field(cfg, "lift_dim", d.lift_dim, 0)
    c["lift_seed"] = _int_field(cfg, "lift_seed", d.lift_seed, 0)
    features = getattr(cfg, "features", ()) or ()
    features = (features,) if isinstance(features, str) else tuple(features)
    for f in features:
        if f not in JENA_COLUMNS:
            raise JenaDataError(
                f"jena config: unknown feature {f!r}, expected some of {JENA_COLUMNS}"
            )
    if len(set(features)) != len(features):
        raise JenaDataError(f"jena config: repeated feature in {features}")
    c["features"] = features
    return c


def _cache_dir(c: dict[str, Any]) -> Path:
    return Path(c["cache_dir"] or "~/.cache/resconv_jax").expanduser()


def download_zip(cache_dir: Path) -> Path:
    """`JENA_URL` saved once as `cache_dir/jena_climate_2009_2016.csv.zip`; no retries."""
    zip_path = cache_dir / JENA_ZIP_NAME
    if zip_path.exists():
        return zip_path
    made_folder(cache_dir, error=JenaDataError, label="jena", field="cache_dir")
    part = zip_path.with_name(JENA_ZIP_NAME + ".part")
    try:
        with urllib.request.urlopen(JENA_URL, timeout=DOWNLOAD_TIMEOUT_S) as resp:
            part.write_bytes(resp.read())
    except (OSError, http.client.HTTPException, ValueError) as e:
        part.unlink(missing_ok=True)
        reason = e.reason if isinstance(e, urllib.error.URLError) else e
        raise JenaDataError(
            f"{zip_path}: download of {JENA_URL} failed ({reason}); if offline, use source='file' "
            "with path=<a local jena_climate_2009_2016.csv, .csv.gz or .zip>, or source='bundled'"
        ) from None
    os.replace(part, zip_path)
    return zip_path


def load_table(cfg: Any) -> tuple[JenaTable, str]:
    """Raw records from the configured source, and a label for `JenaSplits.source`."""
    c = _check_config(cfg)
    if c["source"] in BUNDLED:
        name = BUNDLED[c["source"]]
        return parse_jena_csv(bundled_csv(name), f"{name} (bundled)"), f"bundled {name}"
    if c["source"] == "file":
        content, name = read_csv_bytes(c["path"])
        if c["sha256"]:
            check_sha256(c["path"], c["sha256"])
        return parse_jena_csv(content, name), f"file {name}"
    if c["source"] == "download":
        zip_path = download_zip(_cache_dir(c))
        if c["sha256"]:
            check_sha256(zip_path, c["sha256"])
        content, name = read_csv_bytes(zip_path)
        if not c["sha256"] and (got := git_blob_sha1(content)) != JENA_CSV_GIT_BLOB:
            raise JenaDataError(
                f"{name}: git blob sha1 mismatch: expected {JENA_CSV_GIT_BLOB}, got {got} "
                "(delete the file to download it again)"
            )
        return parse_jena_csv(content, name), f"download {zip_path}"
    from resconv_jax.data.formats import jena_tfds  # tensorflow_datasets is slow to import

    data_dir = c["tfds_data_dir"] or str(_cache_dir(c) / "tfds")
    data_dir = str(made_folder(data_dir, error=JenaDataError, label="jena", field="tfds_data_dir"))
    table = jena_tfds.load_table(data_dir, c["path"] or None)
    return table, f"tfds jena_climate in {data_dir} (from {table.name})"


def _first_few(items: list[str]) -> str:
    """The first `_LISTED` items, comma-separated, with "…" if there are more."""
    return ", ".join(items[:_LISTED]) + (", …" if len(items) > _LISTED else "")


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def _line_list(lines: np.ndarray) -> str:
    """'line 7' or 'lines 7, 9, 12, …' for (D,) CSV line numbers."""
    return ("line " if lines.size == 1 else "lines ") + _first_few([str(i) for i in lines])


def _to_hourly(table: JenaTable) -> tuple[JenaTable, str]:
    """Hourly records: an hourly file as it is; of a 10-minute file those on the first's clock."""
    if len(table) < 2:
        raise JenaDataError(f"{table.name}: only {len(table)} record, need many hourly records")
    ts = table.timestamps
    spacing = float(np.median(np.diff(ts)))
    if abs(spacing - 3600) <= 360:
        return table, "hourly records"
    if abs(spacing - 600) > 60:
        raise JenaDataError(
            f"{table.name}: median spacing of records is {spacing / 60:g} min, expected 10 or 60"
        )
    offset = (ts - ts[0]) % 3600
    kind = f"10-minute records, every 6th kept (those at hh:{format_timestamp(ts[0])[-5:]})"
    off_grid = table.lines[offset % 600 != 0]
    if off_grid.size:
        kind += (
            f", {_plural(off_grid.size, 'record')} off the 10-minute grid ({_line_list(off_grid)})"
        )
    return table.take(offset == 0), kind


def _describe_step(seconds: int) -> str:
    if seconds % 3600 == 0:
        return f"{seconds // 3600 - 1} h missing"
    return f"{seconds / 60:g} min step"


def _gap_note(table: JenaTable) -> str:
    """'' if the (N,) hourly timestamps step by 1 h throughout; else a note on the other steps."""
    steps = np.diff(table.timestamps)
    at = np.flatnonzero(steps != 3600)
    if not at.size:
        return ""
    where = [f"after line {table.lines[i]}: {_describe_step(int(steps[i]))}" for i in at]
    return (
        f"; {_plural(at.size, 'gap')} in the hourly grid ({_first_few(where)}): "
        "windows spanning a gap join non-consecutive hours"
    )


def _duplicate_note(dropped: np.ndarray) -> str:
    """'' or the count and first line numbers of the (D,) dropped duplicate records."""
    if not dropped.size:
        return ""
    return f", {_plural(dropped.size, 'exact duplicate record')} dropped ({_line_list(dropped)})"


def _check_spread(name: str, names: list[str], mean, std, later: np.ndarray) -> None:
    """Refuse columns that are (near-)constant on the train split, all in one line.

    mean, std: (k,) train statistics of the columns `names`; later: (N - n_train, k) the
    val/test values, only to say which of the refused columns vary after the train split.
    """
    tol = _FLAT_RTOL * (np.abs(mean) + 1)
    flat = np.flatnonzero(std <= tol)
    if not flat.size:
        return
    varies = (np.abs(later - mean) > tol).any(axis=0)
    items = [
        f"{names[j]!r} (std {std[j]:.2g}" + (", varies on val/test)" if varies[j] else ")")
        for j in flat
    ]
    raise JenaDataError(
        f"{name}: constant or near-constant on the train split (std <= {_FLAT_RTOL:g}*(|mean|+1)), "
        f"cannot standardize: {', '.join(items)}"
    )


def _check_scaled(name: str, names: list[str], z: np.ndarray, lines: np.ndarray, bounds) -> None:
    """Refuse standardized val/test values beyond `_MAX_ABS_Z` (z: (N, k), lines: (N,))."""
    for split in ("val", "test"):
        lo, hi = bounds[split]
        big = np.abs(z[lo:hi]) > _MAX_ABS_Z
        if big.any():
            i, j = np.argwhere(big)[0]
            raise JenaDataError(
                f"{name}: line {lines[lo + i]}: {names[j]!r} is {z[lo + i, j]:.3g} train stds "
                f"from the train mean on the {split} split (the train split is near-constant "
                "there, or this is an error value)"
            )


def _check_values(name: str, table: JenaTable, values: np.ndarray, columns: list[str]) -> None:
    """Refuse, in every split alike, an error value in `columns` of `values` ((N, k), wind
    errors already set to 0): a non-finite value, the station's -9999 error code outside the
    wind columns, or a value beyond `_MAX_ROBUST_Z` robust stds of its column; one line naming
    the file's line and the column."""
    for column in columns:
        j = table.columns.index(column)
        x = values[:, j]
        median = np.median(x) if np.isfinite(x).all() else np.nan
        with np.errstate(over="ignore", invalid="ignore"):
            std = np.std(x)
        # Robust, and not below a tenth of the std: a column that is nearly constant over most
        # rows (MAD ~ 0) is not an error where it varies.
        scale = max(1.4826 * np.median(np.abs(x - median)), 0.1 * std if np.isfinite(std) else 0)
        if not scale > 0:
            scale = np.inf
        checks = (
            (~np.isfinite(x), "is not a finite number"),
            (x <= _WIND_SENTINEL, "is the station's error code -9999 (remove or fill the row)"),
            (np.abs(x - median) > _MAX_ROBUST_Z * scale, None),
        )
        for bad, reason in checks:
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                reason = reason or (
                    f"is {abs(x[i] - median) / scale:.3g} robust stds from the column's median "
                    f"{median:.4g} (more than {_MAX_ROBUST_Z:g}: an error value)"
                )
                raise JenaDataError(
                    f"{name}: line {table.lines[i]}: {column!r} = {x[i]:.6g} {reason}"
                )


def _windows(z: np.ndarray, t: np.ndarray, m: int, stride: int, count: int):
    """X (count, m, d) = z[s : s+m], Y (count, m, 1) = t[s+m : s+2m], s = p * stride."""
    idx = np.arange(count)[:, None] * stride + np.arange(m)[None, :]
    return z[idx].astype(np.float32), t[idx + m][..., None].astype(np.float32)


def _standardize(table: JenaTable, values: np.ndarray, features, bounds):
    """z (N, d_feat) features and t (N,) target scaled by the train rows' mean and std.

    values: (N, k) the table's values with wind errors set to 0. Also returns the statistics
    (mean (d_feat,), std (d_feat,), t_mean, t_std). Refuses (near-)constant train columns and
    absurd val/test values (see `_check_spread`, `_check_scaled`).
    """
    n_train = bounds["train"][1]
    cols = [table.columns.index(f) for f in features]
    ti = table.columns.index(TARGET_COLUMN)
    train = values[:n_train]
    mean, std = train[:, cols].mean(axis=0), train[:, cols].std(axis=0)
    t_mean, t_std = float(train[:, ti].mean()), float(train[:, ti].std())
    names, checked, c_mean, c_std = list(features), cols, mean, std
    if TARGET_COLUMN not in features:
        names, checked = [*names, TARGET_COLUMN], [*cols, ti]
        c_mean, c_std = np.append(mean, t_mean), np.append(std, t_std)
    _check_spread(table.name, names, c_mean, c_std, values[n_train:, checked])
    z = (values[:, cols] - mean) / std
    t = (values[:, ti] - t_mean) / t_std
    scaled = z if TARGET_COLUMN in features else np.column_stack([z, t])
    _check_scaled(table.name, names, scaled, table.lines, bounds)
    return z, t, (mean, std, t_mean, t_std)


def _check_lift_fits(lift_dim: int, rows: int, num_features: int) -> None:
    """JenaDataError (one line) when the lifted record, (rows, lift_dim) float64, and its map,
    (num_features, lift_dim), cannot fit the host's available memory: before either is drawn."""
    need = 8 * lift_dim * (rows + num_features)
    have = memory.host_available_bytes()
    if have is not None and need > have:
        raise JenaDataError(
            f"jena config: lift_dim={lift_dim}: the lifted record alone needs "
            f"{memory.format_bytes(need)} ({rows} hourly rows × lift_dim float64), more than the "
            f"{memory.format_bytes(have)} of memory available; use a smaller lift_dim"
        )


def make_splits(table: JenaTable, cfg: Any, source: str = "") -> JenaSplits:
    """Windows from raw records (any source), as described in the module docstring."""
    c = _check_config(cfg)
    name, m, stride = table.name, c["seq_len"], c["stride"]
    table, dropped = check_order(table)
    table, kind = _to_hourly(table)
    features = c["features"] or table.columns
    missing = [f for f in features if f not in table.columns]
    if missing:
        raise JenaDataError(f"{name}: line 1: feature(s) {missing} not in the file's columns")
    values = table.values.copy()
    for col in WIND_COLUMNS:
        if col in table.columns:
            j = table.columns.index(col)
            values[values[:, j] <= _WIND_SENTINEL, j] = 0.0
    _check_values(name, table, values, list(dict.fromkeys([*features, TARGET_COLUMN])))
    n = len(table)
    n_train, n_val = n * 7 // 10, n * 2 // 10
    bounds = {
        "train": (0, n_train),
        "val": (n_train, n_train + n_val),
        "test": (n_train + n_val, n),
    }
    z, t, (mean, std, t_mean, t_std) = _standardize(table, values, features, bounds)
    lift = None
    if c["lift_dim"]:
        _check_lift_fits(c["lift_dim"], n, len(features))
        rng = np.random.default_rng(c["lift_seed"])
        lift = rng.standard_normal((len(features), c["lift_dim"])) / np.sqrt(len(features))
        z = z @ lift
    wanted = {"train": c["num_train"], "val": c["num_val"], "test": -1}
    out: dict[str, np.ndarray] = {}
    for split, (lo, hi) in bounds.items():
        rows = hi - lo
        available = (rows - 2 * m) // stride + 1 if rows >= 2 * m else 0
        count = available if wanted[split] == -1 else wanted[split]
        if count > available or (wanted[split] == -1 and available == 0):
            need = (max(count, 1) - 1) * stride + 2 * m
            raise JenaDataError(
                f"{name}: not enough rows for {max(count, 1)} {split} window(s) of seq_len={m}, "
                f"stride={stride}: need {need} hourly rows, the {split} split has {rows} "
                f"(of {n} hourly rows)"
            )
        out[f"x_{split}"], out[f"y_{split}"] = _windows(z[lo:hi], t[lo:hi], m, stride, count)
    span = f"{format_timestamp(table.timestamps[0])} .. {format_timestamp(table.timestamps[-1])}"
    label = (
        f"{source or name}: {kind}{_duplicate_note(dropped)}; {n} hourly rows {span}"
        f"{_gap_note(table)}; split rows {n_train}/{n_val}/{n - n_train - n_val}"
    )
    return JenaSplits(
        **out,
        feature_names=tuple(features),
        mean=mean.astype(np.float32),
        std=std.astype(np.float32),
        source=label,
        target_mean=t_mean,
        target_std=t_std,
        lift=None if lift is None else lift.astype(np.float32),
    )


def load_jena(cfg: Any) -> JenaSplits:
    """Load Jena Climate windows as configured (fields: see `default_config`).

    Returns x_train (P, M, d), y_train (P, M, 1), the same for val and test (all their
    windows unless num_val is set), float32; see `JenaSplits`.
    """
    table, source = load_table(cfg)
    return make_splits(table, cfg, source)


def describe_sizes(config) -> str:
    """One line for the sizes table: P windows of M hours, of width d."""
    data = config.data
    d = data.lift_dim or len(data.features) or ("6" if data.source in BUNDLED else "all")
    count = "all" if data.num_train == -1 else data.num_train
    where = " of 2009–2016" if data.source == "bundled_full" else ""
    return f"P={count} Jena windows{where} of M={data.seq_len} h, d={d}"


def load(cfg: Any) -> Dataset:
    """The Jena data set of `config.data` (`load_jena`): its train windows, its validation
    windows as the validation set."""
    splits = load_jena(cfg)
    return Dataset(
        splits.x_train, splits.y_train, splits.x_val, splits.y_val, description=splits.source
    )
