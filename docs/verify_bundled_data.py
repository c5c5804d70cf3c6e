"""Checks the bundled data against the full public files it was cut from: the SST-2 files are
GLUE's train.tsv (whole, and its head) and dev.tsv, the Jena files the 2009-2016 hourly record
(whole, and its first two years), the tokenizer files GPT-2's, byte for byte (see
resconv_jax/data/bundled/*_PROVENANCE.md).

    python docs/verify_bundled_data.py --shared=DIR

DIR holds `sst2/glue/{train,dev}.tsv.gz`, `jena/jena_hourly_6vars.csv.gz` and
`gpt2_tokenizer/{vocab.json,merges.txt}` (this project's CI copy, laid out as in its README).
Prints one line per check; exit status 1 when one fails, 2 when a file is missing. The tests
never read outside the repository, so this is a separate command.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import sys
from importlib import resources
from pathlib import Path

from resconv_jax.data import sst2
from resconv_jax.data.formats.jena_csv import BUNDLED_FULL_NAME, BUNDLED_NAME
from resconv_jax.data.formats.sst2_tsv import (
    BUNDLED_DEV,
    BUNDLED_FULL_TRAIN,
    BUNDLED_TRAIN,
    bundled_bytes,
)


def _stored(name: str) -> bytes:
    return (resources.files("resconv_jax.data") / "bundled" / name).read_bytes()


def checks(shared: Path) -> list[tuple[str, bool]]:
    """(what, whether it holds) for each fact the provenance files state."""
    glue = shared / "sst2" / "glue"
    train = gzip.decompress((glue / "train.tsv.gz").read_bytes())
    dev = gzip.decompress((glue / "dev.tsv.gz").read_bytes())
    notes = (resources.files("resconv_jax.data") / "bundled" / "SST2_PROVENANCE.md").read_text()
    results = [
        ("GLUE train.tsv's sha256 is the one SST2_PROVENANCE.md states",
         hashlib.sha256(train).hexdigest() in notes),
        (f"{BUNDLED_TRAIN} is lines 1-4,001 of train.tsv",
         bundled_bytes(BUNDLED_TRAIN) == b"".join(train.splitlines(keepends=True)[:4001])),
        (f"{BUNDLED_DEV} is dev.tsv", bundled_bytes(BUNDLED_DEV) == dev),
    ]  # fmt: skip
    results.append(
        (
            f"{BUNDLED_FULL_TRAIN} is GLUE's train.tsv.gz, byte for byte",
            _stored(BUNDLED_FULL_TRAIN) == (glue / "train.tsv.gz").read_bytes(),
        )
    )
    jena = (shared / "jena" / "jena_hourly_6vars.csv.gz").read_bytes()
    results.append((f"{BUNDLED_FULL_NAME} is jena_hourly_6vars.csv.gz, byte for byte",
                    _stored(BUNDLED_FULL_NAME) == jena))  # fmt: skip
    results.append(
        (
            f"{BUNDLED_NAME} is the first 17,521 lines of it",
            gzip.decompress(_stored(BUNDLED_NAME))
            == b"".join(gzip.decompress(jena).splitlines(keepends=True)[:17521]),
        )
    )
    for name in ("vocab.json", "merges.txt"):
        same = bundled_bytes(f"gpt2_{name}.gz") == (shared / "gpt2_tokenizer" / name).read_bytes()
        results.append((f"gpt2_{name}.gz is GPT-2's {name}", same))
    cfg = sst2.default_config()
    cfg.update(source="file", path=str(glue), num_train=-1, max_tokens=64)
    full = sst2.load_sst2(cfg)
    counts = (full.ids_train.shape, full.ids_val.shape, full.labels_train.sum())
    results.append(("the full folder loads: 67,349 train rows (37,569 positive), 872 dev rows",
                    counts == ((67349, 64), (872, 64), 37569)))  # fmt: skip
    return results


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shared", required=True, help="folder of the full public files")
    args = parser.parse_args(argv)
    try:
        results = checks(Path(args.shared))
    except OSError as error:
        print(f"error: {error.filename}: {error.strerror}", file=sys.stderr)
        return 2
    for what, holds in results:
        print(f"{'ok    ' if holds else 'FAILED'} {what}")
    return 0 if all(holds for _, holds in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
