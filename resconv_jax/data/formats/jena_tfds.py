"""tensorflow-datasets builder `jena_climate`: the raw records of a Jena Climate CSV.

One example per CSV record, in file order: `timestamp` (int64 seconds since 1970, the naive
`Date Time`), `line` (int64, its line in the CSV) and `values` (float64 vector, the file's
variables; their names are in the dataset's metadata). It is prepared as array_record files without
TensorFlow and read back as numpy through `tfds.data_source` (no tf.data). Windowing and
standardization happen afterwards in `jena.make_splits`, exactly as for the CSV loader.

    prepare(data_dir)  # the bundled sample; or prepare(data_dir, "jena_climate_2009_2016.csv")
    table, metadata = read_table(data_dir)
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow_datasets as tfds

from resconv_jax.data.formats.jena_csv import (
    BUNDLED_NAME,
    JenaTable,
    bundled_csv,
    parse_jena_csv,
    read_csv_bytes,
)
from resconv_jax.errors import JenaDataError

SPLIT = "full"
_MANUAL_SUFFIXES = (".csv", ".csv.gz", ".csv.zip", ".zip")


def _source(csv_path: str | None) -> tuple[bytes, str]:
    """CSV text and name of `csv_path`, or of the bundled sample if None."""
    if csv_path is None:
        return bundled_csv(), f"{BUNDLED_NAME} (bundled)"
    return read_csv_bytes(csv_path)


def manual_dir(data_dir: str | os.PathLike) -> Path:
    """tfds's manual_dir for data_dir: where a user puts the full CSV for `prepare` to find."""
    return Path(data_dir) / "downloads" / "manual"


def _resolve(data_dir: str | os.PathLike, csv_path: str | os.PathLike | None) -> str | None:
    """csv_path, else the one Jena file in manual_dir(data_dir), else None (the bundled sample)."""
    if csv_path is not None:
        return os.fspath(csv_path)
    folder = manual_dir(data_dir)
    if not folder.is_dir():
        return None
    found = sorted(str(p) for p in folder.iterdir() if p.name.endswith(_MANUAL_SUFFIXES))
    if len(found) > 1:
        raise JenaDataError(f"{folder}: more than one CSV/zip file: {found}")
    return found[0] if found else None


class JenaClimate(tfds.core.GeneratorBasedBuilder):
    """Raw records of the MPI-BGC Jena weather station CSV (jena_climate_2009_2016.csv format)."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Raw CSV records: timestamp, line, values."}
    MANUAL_DOWNLOAD_INSTRUCTIONS = (
        "Optional: put one jena_climate_2009_2016.csv (.csv.gz or Keras .zip also work) in "
        "manual_dir. Without it, and without csv_path, the bundled 2009-2010 hourly sample is used."
    )

    def __init__(self, *, csv_path: str | os.PathLike | None = None, **kwargs: Any):
        self._csv_path = None if csv_path is None else os.fspath(csv_path)
        super().__init__(**kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description=(
                "Jena Climate weather record (Max Planck Institute for Biogeochemistry, Jena), "
                "one example per CSV record; variable names in metadata['columns']."
            ),
            features=tfds.features.FeaturesDict(
                {
                    "timestamp": tfds.features.Scalar(dtype=np.int64),
                    "line": tfds.features.Scalar(dtype=np.int64),
                    # BYTES keeps float64 exact (tf.train.Example floats are float32).
                    "values": tfds.features.Tensor(
                        shape=(None,), dtype=np.float64, encoding=tfds.features.Encoding.BYTES
                    ),
                }
            ),
            homepage="https://www.bgc-jena.mpg.de/wetter/",
            metadata=tfds.core.MetadataDict(),
            disable_shuffling=True,
        )

    def _split_generators(self, dl_manager: Any) -> dict[str, Any]:
        content, name = _source(self._csv_path)
        table = parse_jena_csv(content, name)
        self.info.metadata.update(
            columns=list(table.columns),
            source_name=name,
            source_sha256=hashlib.sha256(content).hexdigest(),
        )
        return {SPLIT: self._generate_examples(table)}

    def _generate_examples(self, table: JenaTable):
        for i in range(len(table)):
            yield (
                i,
                {
                    "timestamp": table.timestamps[i],
                    "line": table.lines[i],
                    "values": table.values[i],
                },
            )


def prepare(data_dir: str | os.PathLike, csv_path: str | os.PathLike | None = None) -> JenaClimate:
    """Prepare `jena_climate` in data_dir from csv_path (None: manual_dir, else bundled sample).

    A no-op if data_dir already holds it (whatever CSV it was prepared from).
    """
    return _prepare_from(data_dir, _resolve(data_dir, csv_path))


def _prepare_from(data_dir: str | os.PathLike, source: str | None) -> JenaClimate:
    """`prepare` from `source`, already resolved (None: the bundled sample)."""
    builder = JenaClimate(data_dir=os.fspath(data_dir), csv_path=source, file_format="array_record")
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(
            try_download_gcs=False, compute_stats=tfds.download.ComputeStatsMode.SKIP
        )
    )
    return builder


def read_table(data_dir: str | os.PathLike) -> tuple[JenaTable, dict[str, Any]]:
    """The prepared records read back as numpy, sorted by CSV line, and the metadata."""
    source = tfds.data_source("jena_climate", data_dir=os.fspath(data_dir))[SPLIT]
    meta = dict(source.dataset_info.metadata or {})
    records = source.__getitems__(list(range(len(source))))
    lines = np.array([r["line"] for r in records], np.int64)
    order = np.argsort(lines, kind="stable")
    columns = tuple(meta.get("columns", ()))
    values = np.stack([r["values"] for r in records]) if records else np.zeros((0, len(columns)))
    table = JenaTable(
        name=str(meta.get("source_name", f"{data_dir}/jena_climate")),
        columns=columns,
        timestamps=np.array([r["timestamp"] for r in records], np.int64)[order],
        values=values.astype(np.float64)[order],
        lines=lines[order],
    )
    return table, meta


def load_table(data_dir: str | os.PathLike, csv_path: str | os.PathLike | None = None) -> JenaTable:
    """Prepare (if needed) and read back; data_dir must hold this very CSV (by sha256)."""
    source = _resolve(data_dir, csv_path)  # once: the file hashed is the file prepared from
    content, name = _source(source)
    meta = _prepare_from(data_dir, source).info.metadata or {}
    want, have = hashlib.sha256(content).hexdigest(), meta.get("source_sha256")
    if have != want:
        raise JenaDataError(
            f"{data_dir}: jena_climate there was prepared from {meta.get('source_name')} "
            f"(sha256 {have}), not {name} (sha256 {want}); use another tfds_data_dir or delete it"
        )
    return read_table(data_dir)[0]
