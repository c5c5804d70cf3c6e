"""Jena Climate windows for the paper's weather experiment.

Pipeline (paper.md, "Jena Climate"; our protocol where the paper is silent): read the original CSV
format (jena_csv.py), drop exact duplicate records, keep every 6th record of a 10-minute file
(starting at the first, which reproduces the shared hourly npz/CSV), set wind-speed error values
(<= -9990) to 0, split the hourly rows 70/20/10 in time order, standardize every feature with the
train rows' mean and std, and cut each split into windows: X_p is M consecutive hours of the
selected features, Y_p the standardized temperature of the next M hours. A window's inputs and
targets lie inside its split. Optionally X is lifted to a wider width by a fixed random map.
"""

from __future__ import annotations

import dataclasses
import gzip
import http.client
import os
import urllib.error
import urllib.request
from importlib import resources
from pathlib import Path
from typing import Any

import ml_collections
import numpy as np

from resconv_jax.data.jena_csv import (
    JENA_COLUMNS,
    TARGET_COLUMN,
    WIND_COLUMNS,
    JenaDataError,
    JenaTable,
    check_order,
    check_sha256,
    format_timestamp,
    git_blob_sha1,
    parse_jena_csv,
    read_csv_bytes,
)

__all__ = [
    "JENA_URL",
    "JenaDataError",
    "JenaSplits",
    "default_jena_config",
    "load_jena",
    "load_table",
    "make_splits",
]

JENA_URL = (
    "https://storage.googleapis.com/tensorflow/tf-keras-datasets/jena_climate_2009_2016.csv.zip"
)
JENA_ZIP_NAME = "jena_climate_2009_2016.csv.zip"
# git blob id of the canonical CSV inside JENA_URL's zip (same in several unrelated repos).
JENA_CSV_GIT_BLOB = "3dc17139ed8afe4f693b3b88cbdd6e3a69e2de0c"
DOWNLOAD_TIMEOUT_S = 15.0
BUNDLED_NAME = "jena_hourly_sample.csv.gz"
SOURCES = ("bundled", "file", "download", "tfds")
_WIND_SENTINEL = -9990.0  # wind speeds at or below this are the station's -9999 error code


def default_jena_config() -> ml_collections.ConfigDict:
    """Defaults for `load_jena` (P = 256 windows of M = 24 hours, all features, no lift)."""
    cfg = ml_collections.ConfigDict()
    cfg.source = "bundled"  # "bundled" (2009-2010 sample, packaged) | "file" | "download" | "tfds"
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


def _int_field(cfg: Any, name: str, default: int, minimum: int) -> int:
    value = getattr(cfg, name, default)
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise JenaDataError(f"jena config: {name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _check_config(cfg: Any) -> dict[str, Any]:
    """The config's fields, validated, with defaults for missing ones."""
    d = default_jena_config()
    c = {k: getattr(cfg, k, d[k]) for k in ("source", "path", "cache_dir", "sha256")}
    c["tfds_data_dir"] = getattr(cfg, "tfds_data_dir", "")
    if c["source"] not in SOURCES:
        raise JenaDataError(
            f"jena config: unknown source {c['source']!r}, expected one of {SOURCES}"
        )
    if c["source"] == "file" and not c["path"]:
        raise JenaDataError("jena config: source='file' needs path=<jena CSV, .csv.gz or .zip>")
    sha = str(c["sha256"]).lower()
    if sha and (len(sha) != 64 or any(ch not in "0123456789abcdef" for ch in sha)):
        raise JenaDataError(f"jena config: sha256 must be 64 hex digits, got {c['sha256']!r}")
    c["sha256"] = sha
    c["seq_len"] = _int_field(cfg, "seq_len", d.seq_len, 1)
    c["num_train"] = _int_field(cfg, "num_train", d.num_train, -1)
    if c["num_train"] == 0:
        raise JenaDataError("jena config: num_train must be -1 (all) or > 0, got 0")
    c["num_val"] = _int_field(cfg, "num_val", d.num_val, -1)
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


def bundled_csv_bytes() -> bytes:
    """The gzip bytes of the bundled hourly sample (see bundled/JENA_PROVENANCE.md)."""
    return (resources.files("resconv_jax.data") / "bundled" / BUNDLED_NAME).read_bytes()


def download_zip(cache_dir: Path) -> Path:
    """`JENA_URL` saved once as `cache_dir/jena_climate_2009_2016.csv.zip`; no retries."""
    zip_path = cache_dir / JENA_ZIP_NAME
    if zip_path.exists():
        return zip_path
    cache_dir.mkdir(parents=True, exist_ok=True)
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
    if c["source"] == "bundled":
        content = gzip.decompress(bundled_csv_bytes())
        return parse_jena_csv(content, f"{BUNDLED_NAME} (bundled)"), f"bundled {BUNDLED_NAME}"
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
    from resconv_jax.data import jena_tfds  # tensorflow_datasets is slow to import

    data_dir = c["tfds_data_dir"] or str(_cache_dir(c) / "tfds")
    table = jena_tfds.load_table(data_dir, c["path"] or None)
    return table, f"tfds jena_climate in {data_dir} (from {table.name})"


def _to_hourly(table: JenaTable) -> tuple[JenaTable, str]:
    if len(table) < 2:
        raise JenaDataError(f"{table.name}: only {len(table)} record, need many hourly records")
    spacing = float(np.median(np.diff(table.timestamps)))
    if abs(spacing - 600) <= 60:
        return table.take(slice(None, None, 6)), "10-minute records, every 6th kept"
    if abs(spacing - 3600) <= 360:
        return table, "hourly records"
    raise JenaDataError(
        f"{table.name}: median spacing of records is {spacing / 60:g} min, expected 10 or 60"
    )


def _windows(z: np.ndarray, t: np.ndarray, m: int, stride: int, count: int):
    """X (count, m, d) = z[s : s+m], Y (count, m, 1) = t[s+m : s+2m], s = p * stride."""
    idx = np.arange(count)[:, None] * stride + np.arange(m)[None, :]
    return z[idx].astype(np.float32), t[idx + m][..., None].astype(np.float32)


def make_splits(table: JenaTable, cfg: Any, source: str = "") -> JenaSplits:
    """Windows from raw records (any source), as described in the module docstring."""
    c = _check_config(cfg)
    name, m, stride = table.name, c["seq_len"], c["stride"]
    table, n_dup = check_order(table)
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
    n = len(table)
    n_train, n_val = n * 7 // 10, n * 2 // 10
    bounds = {
        "train": (0, n_train),
        "val": (n_train, n_train + n_val),
        "test": (n_train + n_val, n),
    }
    cols = [table.columns.index(f) for f in features]
    ti = table.columns.index(TARGET_COLUMN)
    train = values[:n_train]
    mean, std = train[:, cols].mean(axis=0), train[:, cols].std(axis=0)
    t_mean, t_std = float(train[:, ti].mean()), float(train[:, ti].std())
    flat = [features[j] for j in range(len(cols)) if not std[j] > 0]
    if flat or not t_std > 0:
        flat = flat or [TARGET_COLUMN]
        raise JenaDataError(f"{name}: constant on the train split, cannot standardize: {flat}")
    z = (values[:, cols] - mean) / std
    t = (values[:, ti] - t_mean) / t_std
    lift = None
    if c["lift_dim"]:
        rng = np.random.default_rng(c["lift_seed"])
        lift = rng.standard_normal((len(cols), c["lift_dim"])) / np.sqrt(len(cols))
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
    dropped = f", {n_dup} exact duplicate records dropped" if n_dup else ""
    label = (
        f"{source or name}: {kind}{dropped}; {n} hourly rows {span}; "
        f"split rows {n_train}/{n_val}/{n - n_train - n_val}"
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
    """Load Jena Climate windows as configured (fields: see `default_jena_config`).

    Returns x_train (P, M, d), y_train (P, M, 1), the same for val and test (all their
    windows unless num_val is set), float32; see `JenaSplits`.
    """
    table, source = load_table(cfg)
    return make_splits(table, cfg, source)
