"""GLUE SST-2's TSV files: `sentence<TAB>label` rows under a header, plain or gzip, read into an
`SST2Table`; the bundled sample's files. Every problem is one line naming the file and line."""

from __future__ import annotations

import dataclasses
import functools
import gzip
import hashlib
import zlib
from importlib import resources
from pathlib import Path

import numpy as np

from resconv_jax.errors import SST2DataError, in_file

HEADER = "sentence\tlabel"
SPLIT_FILES = {"train": "train.tsv", "dev": "dev.tsv"}
BUNDLED_TRAIN = "sst2_train_head4000.tsv.gz"
BUNDLED_DEV = "sst2_dev.tsv.gz"
BUNDLED_FULL_TRAIN = "sst2_train.tsv.gz"  # all 67,349 rows of GLUE's train.tsv
BUNDLED_VOCAB = "gpt2_vocab.json.gz"
BUNDLED_MERGES = "gpt2_merges.txt.gz"
# sha256 of the decompressed bundled files (see the provenance files beside them).
BUNDLED_SHA256 = {
    BUNDLED_TRAIN: "ff2a277b0ea2b260df5842ab0c027c2b82fdc1dffacb8da0ca3f30781eb90564",
    BUNDLED_DEV: "54a9c12c77e402fc14d6a66a506f24d999f596b0176eb777c972cccc2f9cc4b0",
    BUNDLED_FULL_TRAIN: "48eac26399f8456935f81dd9e3a745c1430adb6c62e233ccfe22db4a0d15d1d1",
    BUNDLED_VOCAB: "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    BUNDLED_MERGES: "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
}
SHOWN = 40  # characters of a bad field quoted in a message

_in_file = functools.partial(in_file, SST2DataError)


@dataclasses.dataclass(frozen=True)
class SST2Table:
    """The labelled rows of one SST-2 TSV, in file order.

    Attributes:
      name: the file, for messages.
      sentences: N sentences, surrounding whitespace stripped.
      labels: (N,) int32, 0 = negative, 1 = positive.
      lines: (N,) int64 line number of each row in the file (the header is line 1).
    """

    name: str
    sentences: tuple[str, ...]
    labels: np.ndarray
    lines: np.ndarray

    def __len__(self) -> int:
        return len(self.sentences)

    def take(self, index: np.ndarray) -> SST2Table:
        """The rows at the (K,) integer `index`, in that order."""
        return dataclasses.replace(
            self,
            sentences=tuple(self.sentences[int(i)] for i in index),
            labels=self.labels[index],
            lines=self.lines[index],
        )


def read_tsv_bytes(path: str | Path) -> tuple[bytes, str]:
    """The bytes of a plain or gzip file (by content, not by suffix), and its name."""
    name = str(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise _in_file(name, f"cannot read ({e.strerror or e})") from None
    if raw[:2] != b"\x1f\x8b":
        return raw, name
    try:
        return gzip.decompress(raw), name
    except (OSError, EOFError, zlib.error) as e:
        raise _in_file(name, f"corrupt gzip data ({e})") from None


def decode_text(content: bytes, name: str) -> str:
    """`content` as UTF-8 text; SST2DataError naming the line of the first bad byte."""
    try:
        return content.decode("utf-8")
    except UnicodeDecodeError as e:
        line = content.count(b"\n", 0, e.start) + 1
        raise _in_file(name, f"not UTF-8 text ({e.reason} at byte {e.start})", line) from None


def _parse_row(row: str, name: str, line: int) -> tuple[str, int]:
    """(sentence stripped, label) of one `sentence<TAB>label` row."""
    fields = row.split("\t")
    if len(fields) != 2:
        problem = "no tab" if len(fields) == 1 else f"{len(fields)} tab-separated fields"
        raise _in_file(name, f"{problem}, expected 'sentence<TAB>label': {row[:SHOWN]!r}", line)
    sentence, label = fields[0].strip(), fields[1].strip()
    if label not in ("0", "1"):
        raise _in_file(name, f"label {label[:SHOWN]!r}, expected 0 or 1", line)
    if not sentence:
        raise _in_file(name, "empty sentence", line)
    return sentence, int(label)


def parse_sst2_tsv(content: bytes, name: str) -> SST2Table:
    """Parse GLUE SST-2 TSV text (train or dev format); `name` is used in error messages."""
    lines = decode_text(content, name).split("\n")
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines:
        raise _in_file(name, "empty file (no header, no data rows)")
    if lines[0].rstrip("\r") != HEADER:
        raise _in_file(name, f"missing header {HEADER!r}, got {lines[0][:SHOWN]!r}", 1)
    if len(lines) == 1:
        raise _in_file(name, "no data rows (header only)", 1)
    rows = [_parse_row(row, name, i) for i, row in enumerate(lines[1:], start=2)]
    return SST2Table(
        name=name,
        sentences=tuple(s for s, _ in rows),
        labels=np.array([y for _, y in rows], np.int32),
        lines=np.arange(2, len(rows) + 2, dtype=np.int64),
    )


def split_file(folder: str | Path, split: str) -> Path:
    """`folder/train.tsv` or `folder/train.tsv.gz` (split "train"; "dev" likewise)."""
    base = Path(folder) / SPLIT_FILES[split]
    found = [p for p in (base, base.with_name(base.name + ".gz")) if p.is_file()]
    if len(found) != 1:
        problem = "both" if found else "neither"
        raise _in_file(str(folder), f"{problem} of {base.name} and {base.name}.gz found (need one)")
    return found[0]


def bundled_bytes(name: str) -> bytes:
    """The decompressed content of a bundled file (see the provenance files in bundled/),
    checked against its sha256 (SST2DataError for a damaged install)."""
    try:
        raw = (resources.files("resconv_jax.data") / "bundled" / name).read_bytes()
        content = gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as e:
        raise SST2DataError(f"{name} (bundled): unreadable ({e}); reinstall resconv_jax") from None
    if (got := hashlib.sha256(content).hexdigest()) != BUNDLED_SHA256[name]:
        raise SST2DataError(
            f"{name} (bundled): sha256 {got} is not the packaged file's {BUNDLED_SHA256[name]}; "
            "reinstall resconv_jax"
        )
    return content


def bundled_tables(full: bool = False) -> tuple[SST2Table, SST2Table]:
    """The bundled train sample (4000 rows; `full`: all 67,349) and dev split (872 rows)."""
    train = BUNDLED_FULL_TRAIN if full else BUNDLED_TRAIN
    return tuple(parse_sst2_tsv(bundled_bytes(n), f"{n} (bundled)") for n in (train, BUNDLED_DEV))


def file_tables(folder: str | Path) -> tuple[SST2Table, SST2Table]:
    """The train and dev tables of a folder holding GLUE's `train.tsv[.gz]`, `dev.tsv[.gz]`."""
    return tuple(parse_sst2_tsv(*read_tsv_bytes(split_file(folder, s))) for s in SPLIT_FILES)
