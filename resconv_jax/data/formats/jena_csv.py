"""Reader for the original Jena Climate CSV format (`jena_climate_2009_2016.csv`).

The format: a quoted header `"Date Time","p (mbar)",...`, then one record per line,
`dd.mm.yyyy HH:MM:SS,v1,v2,...`. Any subset of the 14 variables may be present, but `Date Time`
must be the first column and `T (degC)` must be present. Plain, gzip and zip files are accepted.
Every error is a one-line `JenaDataError` naming the file and, where it applies, the line.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import gzip
import hashlib
import io
import os
import zipfile
import zlib
from importlib import resources

import numpy as np

from resconv_jax.errors import JenaDataError, in_file

JENA_COLUMNS: tuple[str, ...] = (
    "p (mbar)",
    "T (degC)",
    "Tpot (K)",
    "Tdew (degC)",
    "rh (%)",
    "VPmax (mbar)",
    "VPact (mbar)",
    "VPdef (mbar)",
    "sh (g/kg)",
    "H2OC (mmol/mol)",
    "rho (g/m**3)",
    "wv (m/s)",
    "max. wv (m/s)",
    "wd (deg)",
)
DATE_COLUMN = "Date Time"
TARGET_COLUMN = "T (degC)"
WIND_COLUMNS: tuple[str, ...] = ("wv (m/s)", "max. wv (m/s)")

_DATE_LEN = 19  # len("01.01.2009 00:10:00")
_DIGIT_POS = np.array([0, 1, 3, 4, 6, 7, 8, 9, 11, 12, 14, 15, 17, 18])
_SEPARATORS = {2: ".", 5: ".", 10: " ", 13: ":", 16: ":", 19: ","}
_in_file = functools.partial(in_file, JenaDataError)


@dataclasses.dataclass(frozen=True)
class JenaTable:
    """Raw records of one CSV, in file order.

    Attributes:
      name: the file, for messages.
      columns: the k variable columns, in file order (`Date Time` excluded).
      timestamps: (N,) int64 seconds since 1970-01-01, the `Date Time` read as naive (UTC) time.
      values: (N, k) float64, as written in the file (sentinels included).
      lines: (N,) int64 line number of each record in the CSV (the header is line 1).
    """

    name: str
    columns: tuple[str, ...]
    timestamps: np.ndarray
    values: np.ndarray
    lines: np.ndarray

    def __len__(self) -> int:
        return int(self.timestamps.shape[0])

    def take(self, index: np.ndarray) -> JenaTable:
        """The records selected by an index or boolean mask over N."""
        return dataclasses.replace(
            self,
            timestamps=self.timestamps[index],
            values=self.values[index],
            lines=self.lines[index],
        )


def git_blob_sha1(content: bytes) -> str:
    """The git blob id of `content` (what `git hash-object` prints)."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_sha256(path: str | os.PathLike, expected: str) -> None:
    """Raise unless the file's sha256 is `expected` (lower-case hex)."""
    got = file_sha256(path)
    if got != expected:
        raise _in_file(os.fspath(path), f"sha256 mismatch: expected {expected}, got {got}")


def zip_csv_member(zf: zipfile.ZipFile, name: str) -> str:
    """The one `.csv` member of a zip (macOS `__MACOSX/` resource entries are ignored)."""
    members = [
        m
        for m in zf.namelist()
        if m.lower().endswith(".csv") and not m.startswith("__MACOSX/") and "/._" not in m
    ]
    if len(members) != 1:
        raise _in_file(name, f"expected one .csv file in the zip, found {members}")
    return members[0]


def read_csv_bytes(path: str | os.PathLike) -> tuple[bytes, str]:
    """The CSV text of a .csv, .csv.gz or .zip file (by content, not by suffix), and its name."""
    name = os.fspath(path)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise _in_file(name, "file not found") from None
    except OSError as e:
        raise _in_file(name, f"cannot read file ({e.strerror or e})") from None
    try:
        if raw[:2] == b"\x1f\x8b":
            return gzip.decompress(raw), name
        if raw[:4] == b"PK\x03\x04":
            with zipfile.ZipFile(io.BytesIO(raw)) as zf:
                member = zip_csv_member(zf, name)
                return zf.read(member), f"{name}[{member}]"
    except (OSError, EOFError, zlib.error, zipfile.BadZipFile) as e:
        raise _in_file(name, f"corrupt compressed file ({e})") from None
    return raw, name


def _parse_header(line: str, name: str) -> tuple[str, ...]:
    fields = tuple(f.strip() for f in next(csv.reader([line])))
    if DATE_COLUMN not in fields:
        raise _in_file(name, f"missing required column {DATE_COLUMN!r}", 1)
    if fields[0] != DATE_COLUMN:
        raise _in_file(name, f"{DATE_COLUMN!r} must be the first column, found {fields[0]!r}", 1)
    columns = fields[1:]
    for col in columns:
        if col not in JENA_COLUMNS:
            raise _in_file(name, f"unknown column {col!r} (expected a subset of {JENA_COLUMNS})", 1)
    if len(set(columns)) != len(columns) or DATE_COLUMN in columns:
        raise _in_file(name, f"duplicated column in header {fields}", 1)
    if TARGET_COLUMN not in columns:
        raise _in_file(name, f"missing required column {TARGET_COLUMN!r}", 1)
    return columns


def _parse_dates(rows: list[str], name: str) -> np.ndarray:
    """(N,) int64 seconds from the leading `dd.mm.yyyy HH:MM:SS,` of each row."""
    # Casting to a fixed-width unicode dtype truncates each row to its first 20 code points.
    b = np.array(rows, dtype=f"U{_DATE_LEN + 1}").view(np.uint32).reshape(len(rows), -1)
    b = b.astype(np.int64)
    digits = b[:, _DIGIT_POS] - ord("0")
    ok = np.all((digits >= 0) & (digits <= 9), axis=1)
    for pos, sep in _SEPARATORS.items():
        ok &= b[:, pos] == ord(sep)
    d = np.where(ok[:, None], digits, 0)
    day, month = d[:, 0] * 10 + d[:, 1], d[:, 2] * 10 + d[:, 3]
    year = d[:, 4] * 1000 + d[:, 5] * 100 + d[:, 6] * 10 + d[:, 7]
    hour, minute, sec = d[:, 8] * 10 + d[:, 9], d[:, 10] * 10 + d[:, 11], d[:, 12] * 10 + d[:, 13]
    ok &= (month >= 1) & (month <= 12) & (day >= 1) & (hour < 24) & (minute < 60) & (sec < 60)
    months = np.where(ok, (year - 1970) * 12 + month - 1, 0).astype("datetime64[M]")
    days = months.astype("datetime64[D]") + np.where(ok, day - 1, 0)
    ok &= days.astype("datetime64[M]") == months  # e.g. 31.02. rolls into March
    if not ok.all():
        i = int(np.argmin(ok))
        field = rows[i].split(",", 1)[0][:40]
        raise _in_file(name, f"unparsable date {field!r} (expected dd.mm.yyyy HH:MM:SS)", i + 2)
    return days.astype(np.int64) * 86400 + hour * 3600 + minute * 60 + sec


def _parse_values(rows: list[str], columns: tuple[str, ...], name: str) -> np.ndarray:
    """(N, k) float64 from the fields after the date."""
    k = len(columns)
    try:
        values = np.loadtxt(
            rows, delimiter=",", usecols=range(1, k + 1), dtype=np.float64, comments=None, ndmin=2
        )
    except ValueError as e:
        for i, row in enumerate(rows):
            for col, field in zip(columns, row.split(",")[1:], strict=True):
                try:
                    float(field)
                except ValueError:
                    raise _in_file(
                        name, f"unparsable number {field[:40]!r} in {col!r}", i + 2
                    ) from None
        raise _in_file(name, f"unparsable numbers ({e})") from None
    finite = np.isfinite(values)
    if not finite.all():
        i, j = np.argwhere(~finite)[0]
        raise _in_file(name, f"non-finite value {values[i, j]} in {columns[j]!r}", int(i) + 2)
    return values


def parse_jena_csv(content: bytes, name: str) -> JenaTable:
    """Parse CSV text in the original format; `name` is used in error messages."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _in_file(name, f"not UTF-8 text ({e.reason} at byte {e.start})") from None
    lines = text.replace("\r\n", "\n").split("\n")
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines:
        raise _in_file(name, "empty file (no header, no data rows)")
    columns = _parse_header(lines[0], name)
    rows = lines[1:]
    if not rows:
        raise _in_file(name, "no data rows (header only)", 1)
    commas = np.fromiter((r.count(",") for r in rows), np.int64, len(rows))
    if (commas != len(columns)).any():
        i = int(np.argmax(commas != len(columns)))
        raise _in_file(
            name, f"malformed row: {commas[i] + 1} fields, expected {len(columns) + 1}", i + 2
        )
    return JenaTable(
        name=name,
        columns=columns,
        timestamps=_parse_dates(rows, name),
        values=_parse_values(rows, columns, name),
        lines=np.arange(2, len(rows) + 2, dtype=np.int64),
    )


def check_order(table: JenaTable) -> tuple[JenaTable, np.ndarray]:
    """Drop exact duplicate records; then timestamps must increase strictly.

    A record whose timestamp AND values repeat an earlier record is dropped (the canonical
    10-minute file repeats some records; its hourly derivative dropped them the same way).
    A repeated timestamp with other values, or a timestamp earlier than a previous one, is an
    error. Returns the kept records and the (D,) int64 CSV line numbers of the D dropped ones.
    """
    ts = table.timestamps
    late = np.zeros(len(ts), bool)
    late[1:] = ts[1:] <= np.maximum.accumulate(ts)[:-1]
    if not late.any():
        return table, table.lines[late]
    uniq, first = np.unique(ts, return_index=True)
    for i in np.flatnonzero(late):
        j = int(first[np.searchsorted(uniq, ts[i])])
        if j == i:
            prev = int(np.argmax(ts[:i] > ts[i]))
            raise _in_file(
                table.name,
                f"timestamps out of order: {format_timestamp(ts[i])} comes after "
                f"{format_timestamp(ts[prev])} (line {table.lines[prev]})",
                int(table.lines[i]),
            )
        if not np.array_equal(table.values[i], table.values[j]):
            raise _in_file(
                table.name,
                f"duplicated timestamp {format_timestamp(ts[i])} with other values than "
                f"line {table.lines[j]}",
                int(table.lines[i]),
            )
    return table.take(~late), table.lines[late]


def format_timestamp(seconds: int | np.integer) -> str:
    """Seconds since 1970 as the CSV's `dd.mm.yyyy HH:MM:SS`."""
    iso = str(np.datetime64(int(seconds), "s"))
    return f"{iso[8:10]}.{iso[5:7]}.{iso[0:4]} {iso[11:19]}"


BUNDLED_NAME = "jena_hourly_sample.csv.gz"  # 2009-2010, the default
BUNDLED_FULL_NAME = "jena_hourly_2009_2016.csv.gz"  # every hourly record of 2009-2016
# sha256 of the decompressed bundled files (see bundled/JENA_PROVENANCE.md).
BUNDLED_SHA256 = {
    BUNDLED_NAME: "0bf207bb2ba829eb67732bf6b3920606723ddd73d22d861b4d387ad57118cbef",
    BUNDLED_FULL_NAME: "b3f13e48694038492e2a8294e7a53a3afe096b5ed292b058b7ab7053e13534c4",
}


def bundled_csv_bytes(name: str = BUNDLED_NAME) -> bytes:
    """The gzip bytes of a bundled hourly record (see bundled/JENA_PROVENANCE.md)."""
    return (resources.files("resconv_jax.data") / "bundled" / name).read_bytes()


def bundled_csv(name: str = BUNDLED_NAME) -> bytes:
    """The CSV text of a bundled hourly record, checked against its sha256 (JenaDataError for a
    damaged install)."""
    content = gzip.decompress(bundled_csv_bytes(name))
    if (got := hashlib.sha256(content).hexdigest()) != BUNDLED_SHA256[name]:
        raise JenaDataError(
            f"{name} (bundled): sha256 {got} is not the packaged file's {BUNDLED_SHA256[name]}; "
            "reinstall resconv_jax"
        )
    return content
