"""tensorflow-datasets builder `sst2`: the labelled rows of GLUE SST-2's train and dev TSVs.

Splits `train` and `validation`, one example per TSV row in file order: `sentence` (text, stripped
as in sst2.py), `label` (int64, 0/1) and `line` (int64, its line in the TSV). It is prepared from
local files only (no download) as array_record files without TensorFlow and read back as numpy
through `tfds.data_source`. Row choice and tokenization happen afterwards in `sst2.make_splits`,
exactly as for the TSV loader. The TSVs are parsed before anything is written, so bad data leaves
data_dir untouched.

    prepare(data_dir)  # the bundled sample; or prepare(data_dir, "<folder with train/dev.tsv>")
    train, dev = read_tables(data_dir)
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import numpy as np
import tensorflow_datasets as tfds

from resconv_jax.data.formats.sst2_tsv import (
    BUNDLED_DEV,
    BUNDLED_TRAIN,
    SST2Table,
    bundled_bytes,
    parse_sst2_tsv,
    read_tsv_bytes,
    split_file,
)
from resconv_jax.errors import SST2DataError

SPLITS = {"train": "train", "dev": "validation"}  # sst2.py's split -> tfds split


def _sources(folder: str | None) -> dict[str, tuple[bytes, str]]:
    """TSV text and name of train and dev in `folder`, or of the bundled sample if None."""
    if folder is None:
        return {
            "train": (bundled_bytes(BUNDLED_TRAIN), f"{BUNDLED_TRAIN} (bundled)"),
            "dev": (bundled_bytes(BUNDLED_DEV), f"{BUNDLED_DEV} (bundled)"),
        }
    return {s: read_tsv_bytes(split_file(folder, s)) for s in SPLITS}


def _metadata(sources: dict[str, tuple[bytes, str]]) -> dict[str, str]:
    """Names and sha256 of the (uncompressed) source TSVs."""
    meta = {}
    for split, (content, name) in sources.items():
        meta[f"{split}_name"] = name
        meta[f"{split}_sha256"] = hashlib.sha256(content).hexdigest()
    return meta


class Sst2(tfds.core.GeneratorBasedBuilder):
    """GLUE SST-2 (Stanford Sentiment Treebank, binary) train and dev rows, from local TSVs."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Raw TSV rows: sentence (stripped), label, line."}

    def __init__(self, *, tables: dict[str, SST2Table] | None = None, meta=None, **kwargs: Any):
        self._tables, self._meta = tables, meta or {}
        super().__init__(**kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description=(
                "GLUE SST-2 sentences with binary sentiment labels (Socher et al. 2013; Wang et "
                "al. 2018), one example per TSV row; source names and sha256 in metadata."
            ),
            features=tfds.features.FeaturesDict(
                {
                    "sentence": tfds.features.Text(),
                    "label": tfds.features.Scalar(dtype=np.int64),
                    "line": tfds.features.Scalar(dtype=np.int64),
                }
            ),
            homepage="https://gluebenchmark.com/",
            metadata=tfds.core.MetadataDict(),
            disable_shuffling=True,
        )

    def _split_generators(self, dl_manager: Any) -> dict[str, Any]:
        if self._tables is None:
            raise SST2DataError("sst2 tfds: prepare with sst2_tfds.prepare(data_dir, folder)")
        self.info.metadata.update(self._meta)
        return {SPLITS[s]: self._generate_examples(t) for s, t in self._tables.items()}

    def _generate_examples(self, table: SST2Table):
        for i in range(len(table)):
            yield (
                i,
                {
                    "sentence": table.sentences[i],
                    "label": int(table.labels[i]),
                    "line": int(table.lines[i]),
                },
            )


def prepare(data_dir: str | os.PathLike, folder: str | os.PathLike | None = None) -> Sst2:
    """Prepare `sst2` in data_dir from folder's train/dev TSVs (None: the bundled sample).

    The TSVs are parsed first (bad data raises before anything is written). A no-op if data_dir
    already holds `sst2` (whatever TSVs it was prepared from).
    """
    sources = _sources(None if folder is None else os.fspath(folder))
    tables = {s: parse_sst2_tsv(content, name) for s, (content, name) in sources.items()}
    builder = Sst2(
        data_dir=os.fspath(data_dir),
        tables=tables,
        meta=_metadata(sources),
        file_format="array_record",
    )
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(
            try_download_gcs=False, compute_stats=tfds.download.ComputeStatsMode.SKIP
        )
    )
    return builder


def _read_split(data_dir: str, split: str) -> tuple[SST2Table, dict[str, Any]]:
    """One prepared split as an `SST2Table`, sorted by TSV line, and the dataset's metadata."""
    source = tfds.data_source("sst2", data_dir=data_dir)[SPLITS[split]]
    meta = dict(source.dataset_info.metadata or {})
    records = source.__getitems__(list(range(len(source))))
    lines = np.array([r["line"] for r in records], np.int64)
    order = np.argsort(lines, kind="stable")
    table = SST2Table(
        name=str(meta.get(f"{split}_name", f"{data_dir}/sst2 {split}")),
        sentences=tuple(records[i]["sentence"].decode("utf-8") for i in order),
        labels=np.array([r["label"] for r in records], np.int32)[order],
        lines=lines[order],
    )
    return table, meta


def read_tables(data_dir: str | os.PathLike) -> tuple[SST2Table, SST2Table, dict[str, Any]]:
    """The prepared train and dev rows read back as numpy, and the metadata."""
    (train, meta), (dev, _) = (_read_split(os.fspath(data_dir), s) for s in SPLITS)
    return train, dev, meta


def load_tables(
    data_dir: str | os.PathLike, folder: str | os.PathLike | None = None
) -> tuple[SST2Table, SST2Table]:
    """Prepare (if needed) and read back; data_dir must hold these very TSVs (by sha256)."""
    want = _metadata(_sources(None if folder is None else os.fspath(folder)))
    prepare(data_dir, folder)
    train, dev, have = read_tables(data_dir)
    for split in SPLITS:
        key = f"{split}_sha256"
        if have.get(key) != want[key]:
            raise SST2DataError(
                f"{data_dir}: sst2 there was prepared from {have.get(f'{split}_name')} "
                f"(sha256 {have.get(key)}), not {want[f'{split}_name']} (sha256 {want[key]}); "
                "use another tfds_data_dir or delete it"
            )
    return train, dev
