"""SST-2 sentences as GPT-2 token ids for the paper's sentiment experiment.

Pipeline (paper.md, "SST-2"; our protocol where the paper is silent): read GLUE's SST-2 TSVs
(header `sentence<TAB>label`, then one `sentence<TAB>label` row per line, label 0/1, UTF-8, plain
or gzip). The sentence is the field before the tab with surrounding whitespace STRIPPED (GLUE's
train and dev put a space before the tab; kept, GPT-2 would add a lone `Ġ` token to every row).
Tokenize with GPT-2's byte-level BPE (no special tokens added) and keep at most `max_tokens`
tokens per sentence (longer ones are TRUNCATED, their first `max_tokens` kept). Training rows: the
first P of `np.random.default_rng(seed).permutation(N)` over the N train rows, in that order, not
class-balanced (duplicate GLUE phrases are kept as rows). Validation rows: the dev split in file
order (all 872 rows, or the first `num_val`). Arrays have exactly T = `max_tokens` columns, padded
on the right with the tokenizer's <|endoftext|> id (`PAD_ID`, GPT-2's eos, for GPT-2's own
tokenizer); the mask says which tokens are real.

Sources: "bundled" (default: the first 4000 GLUE train rows and all 872 dev rows, packaged, see
bundled/SST2_PROVENANCE.md), "file" (a folder with GLUE's `train.tsv[.gz]` and `dev.tsv[.gz]`),
"tfds" (the `sst2` builder of sst2_tfds.py, prepared from those files). The GPT-2 vocabulary and
merges are bundled too (bundled/GPT2_TOKENIZER_PROVENANCE.md); `tokenizer_dir` overrides them.
Every data error is a one-line `SST2DataError` naming the file and, where it applies, the line.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

import ml_collections
import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

from resconv_jax.data import Dataset
from resconv_jax.data.formats.fields import check_read_by_source, int_field, made_folder
from resconv_jax.data.formats.sst2_tsv import (
    BUNDLED_DEV,
    BUNDLED_FULL_TRAIN,
    BUNDLED_MERGES,
    BUNDLED_SHA256,
    BUNDLED_TRAIN,
    BUNDLED_VOCAB,
    SHOWN,
    SST2Table,
    bundled_bytes,
    bundled_tables,
    decode_text,
    file_tables,
    parse_sst2_tsv,
    read_tsv_bytes,
    split_file,
)
from resconv_jax.errors import SST2DataError, in_file

__all__ = [
    "BUNDLED_SHA256",
    "EOS_ID",
    "PAD_ID",
    "SST2DataError",
    "SST2Splits",
    "SST2Table",
    "bundled_bytes",
    "bundled_tables",
    "default_config",
    "file_tables",
    "gpt2_tokenizer",
    "load_sst2",
    "load_tables",
    "make_splits",
    "parse_sst2_tsv",
    "read_tsv_bytes",
    "select_train_rows",
    "split_file",
    "tokenize",
]

NAME = __name__.rpartition(".")[2]
EOS_ID = 50256  # GPT-2's <|endoftext|>
PAD_ID = EOS_ID  # padding id; the mask, not the id, marks padding
SOURCES = ("bundled", "bundled_full", "file", "tfds")
_READERS = {"path": ("file", "tfds"), "tfds_data_dir": ("tfds",)}  # the sources that read them


_in_file = functools.partial(in_file, SST2DataError)
_int_field = functools.partial(int_field, error=SST2DataError, label="sst2")


@dataclasses.dataclass(frozen=True)
class SST2Splits:
    """Token ids, masks and labels of the chosen train rows (P) and dev rows (P_val).

    ids_train: (P, T) int32 GPT-2 ids, right-padded with `pad_id`; mask_train: (P, T) int32,
    1 on real tokens (a prefix of each row), 0 on padding; labels_train: (P,) int32 in {0, 1};
    train_lines: (P,) int64 line of each row in its TSV. ids_val, mask_val: (P_val, T);
    labels_val, val_lines: (P_val,). T = max_tokens. description: one line (source, counts,
    class balance, truncations).
    """

    ids_train: np.ndarray
    mask_train: np.ndarray
    labels_train: np.ndarray
    ids_val: np.ndarray
    mask_val: np.ndarray
    labels_val: np.ndarray
    train_lines: np.ndarray
    val_lines: np.ndarray
    description: str
    pad_id: int = PAD_ID


def default_config() -> ml_collections.ConfigDict:
    """The `config.data` section of SST-2 (P = 256 train sentences of at most 64 tokens, all dev
    rows); `load_sst2`'s fields."""
    cfg = ml_collections.ConfigDict()
    cfg.name = NAME
    # "bundled" (4000 train + 872 dev GLUE rows, packaged) | "bundled_full" (all 67,349 train
    # rows + dev, packaged) | "file" | "tfds"
    cfg.source = "bundled"
    cfg.path = ""  # folder with train.tsv[.gz] and dev.tsv[.gz]; for tfds "" = the bundled sample
    cfg.tokenizer_dir = ""  # folder: tokenizer.json, or vocab.json + merges.txt; "" = bundled
    cfg.max_tokens = 64  # T: tokens kept per sentence (longer ones truncated); arrays are (P, T)
    cfg.num_train = 256  # P: first P rows of a seeded permutation of the train rows; -1 = all
    cfg.num_val = -1  # dev rows for validation, the first ones in file order; -1 = all (872)
    cfg.seed = 0  # seed of the train-row permutation
    cfg.tfds_data_dir = ""  # tfds data_dir for source=tfds ("" = ~/.cache/resconv_jax/tfds)
    return cfg


def _check_config(cfg: Any) -> dict[str, Any]:
    """The config's fields, validated, with defaults for missing ones."""
    d = default_config()
    c = {k: str(getattr(cfg, k, d[k]) or "") for k in ("source", "path", "tokenizer_dir")}
    c["tfds_data_dir"] = str(getattr(cfg, "tfds_data_dir", "") or "")
    if c["source"] not in SOURCES:
        raise SST2DataError(f"sst2 config: unknown source {c['source']!r}, expected {SOURCES}")
    if c["source"] == "file" and not c["path"]:
        raise SST2DataError("sst2 config: source='file' needs path=<folder: train.tsv, dev.tsv>")
    check_read_by_source(c, _READERS, error=SST2DataError, label="sst2")
    c["max_tokens"] = _int_field(cfg, "max_tokens", d.max_tokens, 1)
    c["seed"] = _int_field(cfg, "seed", d.seed, 0)
    for key in ("num_train", "num_val"):
        c[key] = _int_field(cfg, key, d[key], -1)
        if c[key] == 0:
            raise SST2DataError(f"sst2 config: {key} must be -1 (all) or > 0, got 0")
    return c


def _bpe_tokenizer(
    vocab: dict[str, int], merges: list[tuple[str, str]], name: str
) -> tokenizers.Tokenizer:
    """GPT-2's tokenizer: byte-level BPE, no prefix space, <|endoftext|> special; `name` is
    where vocab and merges were read (for the one-line error when they do not fit together)."""
    try:
        tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges))
    except Exception as e:  # tokenizers raises its own Exception type
        problem = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise _in_file(name, f"not a GPT-2 BPE tokenizer ({problem})") from None
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([tokenizers.AddedToken("<|endoftext|>", special=True)])
    return tok


def _parse_vocab_merges(vocab_text: bytes, merges_text: bytes, name: str):
    """vocab (token -> id) and merges [(left, right)] from vocab.json and merges.txt bytes."""
    try:
        vocab = json.loads(vocab_text)
    except ValueError as e:
        raise _in_file(f"{name}/vocab.json", f"not a JSON vocabulary ({e})") from None
    if not (isinstance(vocab, dict) and vocab) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in vocab.values()
    ):
        raise _in_file(
            f"{name}/vocab.json", "not a JSON vocabulary (expected an object of token: id)"
        )
    merges = []
    for i, row in enumerate(decode_text(merges_text, f"{name}/merges.txt").split("\n"), start=1):
        if not row or (i == 1 and row.startswith("#version")):
            continue
        pair = row.split(" ")
        if len(pair) != 2:
            raise _in_file(f"{name}/merges.txt", f"expected 'left right', got {row[:SHOWN]!r}", i)
        merges.append((pair[0], pair[1]))
    if not merges:  # BPE without merges splits every word into bytes
        raise _in_file(f"{name}/merges.txt", "no merges")
    return vocab, merges


@functools.lru_cache(maxsize=4)
def gpt2_tokenizer(tokenizer_dir: str = "") -> tokenizers.Tokenizer:
    """The GPT-2 tokenizer: bundled, or from `tokenizer_dir` (tokenizer.json, else vocab+merges)."""
    if not tokenizer_dir:
        vocab_merges = (bundled_bytes(BUNDLED_VOCAB), bundled_bytes(BUNDLED_MERGES))
        return _bpe_tokenizer(*_parse_vocab_merges(*vocab_merges, "bundled GPT-2"), "bundled GPT-2")
    folder = Path(tokenizer_dir)
    if (folder / "tokenizer.json").is_file():
        try:
            tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as e:  # tokenizers raises its own Exception type
            problem = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise _in_file(str(folder / "tokenizer.json"), f"not a tokenizer ({problem})") from None
        # Hugging Face saves its last call's padding and truncation in the file; `tokenize`
        # pads, masks and truncates to data.max_tokens itself.
        tok.no_padding()
        tok.no_truncation()
        return tok
    if not ((folder / "vocab.json").is_file() and (folder / "merges.txt").is_file()):
        raise _in_file(tokenizer_dir, "no tokenizer.json, nor vocab.json and merges.txt")
    texts = [read_tsv_bytes(folder / n)[0] for n in ("vocab.json", "merges.txt")]
    return _bpe_tokenizer(*_parse_vocab_merges(*texts, tokenizer_dir), tokenizer_dir)


def pad_id_of(tok: tokenizers.Tokenizer) -> int:
    """The padding id: the tokenizer's own <|endoftext|> (GPT-2's 50256), else 0. Padding is
    masked, so any id of the vocabulary serves; one past it would be NaN in the lookup."""
    found = tok.token_to_id("<|endoftext|>")
    return 0 if found is None else int(found)


def tokenize(tok: tokenizers.Tokenizer, sentences, max_tokens: int, pad_id: int = PAD_ID):
    """Right-padded ids (N, T) int32, mask (N, T) int32 and the (N,) int64 untruncated lengths.

    T = max_tokens; a sentence of more tokens keeps its first max_tokens. No special tokens added.
    """
    encodings = tok.encode_batch(list(sentences), add_special_tokens=False)
    lengths = np.array([len(e.ids) for e in encodings], np.int64)
    ids = np.full((len(encodings), max_tokens), pad_id, np.int32)
    mask = np.zeros((len(encodings), max_tokens), np.int32)
    for i, e in enumerate(encodings):
        n = min(len(e.ids), max_tokens)
        ids[i, :n] = e.ids[:n]
        mask[i, :n] = 1
    return ids, mask, lengths


def select_train_rows(num_rows: int, num_train: int, seed: int, name: str) -> np.ndarray:
    """(P,) row indices: the first P of a seeded permutation of the N rows (-1: all N)."""
    if num_train > num_rows:
        raise _in_file(name, f"num_train={num_train} but the file has only {num_rows} rows")
    perm = np.random.default_rng(seed).permutation(num_rows)
    return perm if num_train == -1 else perm[:num_train]


def load_tables(cfg: Any) -> tuple[SST2Table, SST2Table, str]:
    """Train and dev rows from the configured source, and a label for the description."""
    c = _check_config(cfg)
    if c["source"] in ("bundled", "bundled_full"):
        full = c["source"] == "bundled_full"
        train, dev = bundled_tables(full)
        return (
            train,
            dev,
            f"bundled {BUNDLED_FULL_TRAIN if full else BUNDLED_TRAIN} + {BUNDLED_DEV}",
        )
    if c["source"] == "file":
        train, dev = file_tables(c["path"])
        return train, dev, f"file {train.name} + {dev.name}"
    from resconv_jax.data.formats import sst2_tfds  # tensorflow_datasets is slow to import

    data_dir = c["tfds_data_dir"] or str(Path("~/.cache/resconv_jax/tfds").expanduser())
    made_folder(data_dir, error=SST2DataError, label="sst2", field="tfds_data_dir")
    train, dev = sst2_tfds.load_tables(data_dir, c["path"] or None)
    return train, dev, f"tfds sst2 in {data_dir} (from {train.name} + {dev.name})"


def _summary(split: str, table: SST2Table, available: int, lengths: np.ndarray, t: int) -> str:
    """'train P rows (1: a, 0: b) of N, k truncated'; lengths: (P,) untruncated token counts."""
    ones = int(np.count_nonzero(table.labels))
    return (
        f"{split} {len(table)} rows (1: {ones}, 0: {len(table) - ones}) of {available}, "
        f"{int(np.count_nonzero(lengths > t))} truncated"
    )


def make_splits(train: SST2Table, dev: SST2Table, cfg: Any, source: str = "") -> SST2Splits:
    """Token arrays from raw rows (any source), as described in the module docstring."""
    c = _check_config(cfg)
    t = c["max_tokens"]
    picked = train.take(select_train_rows(len(train), c["num_train"], c["seed"], train.name))
    if c["num_val"] > len(dev):
        raise _in_file(dev.name, f"num_val={c['num_val']} but the file has only {len(dev)} rows")
    val = dev if c["num_val"] == -1 else dev.take(np.arange(c["num_val"]))
    tok = gpt2_tokenizer(c["tokenizer_dir"])
    pad = pad_id_of(tok)
    ids_train, mask_train, len_train = tokenize(tok, picked.sentences, t, pad)
    ids_val, mask_val, len_val = tokenize(tok, val.sentences, t, pad)
    tokenizer = c["tokenizer_dir"] or "bundled GPT-2 BPE"
    description = (
        f"SST-2 (GLUE) {source or train.name + ' + ' + dev.name}: "
        f"{_summary('train', picked, len(train), len_train, t)} (seeded permutation, "
        f"seed {c['seed']}); {_summary('val', val, len(dev), len_val, t)}; tokenizer {tokenizer}, "
        f"T={t}, right-padded with {pad}"
    )
    return SST2Splits(
        ids_train=ids_train,
        mask_train=mask_train,
        labels_train=picked.labels,
        ids_val=ids_val,
        mask_val=mask_val,
        labels_val=val.labels,
        train_lines=picked.lines,
        val_lines=val.lines,
        description=description,
        pad_id=pad,
    )


def load_sst2(cfg: Any) -> SST2Splits:
    """Load SST-2 as configured (fields: see `default_config`).

    Returns ids_train/mask_train (P, T) int32, labels_train (P,) int32, the same for the dev rows
    (P_val = 872 unless num_val is set), T = max_tokens; see `SST2Splits`.
    """
    train, dev, source = load_tables(cfg)
    return make_splits(train, dev, cfg, source)


def describe_sizes(config) -> str:
    """One line for the sizes table: P sentences of at most T tokens."""
    count = "all" if config.data.num_train == -1 else config.data.num_train
    return f"P={count} SST-2 sentences of ≤ {config.data.max_tokens} tokens"


def load(cfg: Any) -> Dataset:
    """The SST-2 data set of `config.data` (`load_sst2`): token ids and masks (P, T) with their
    labels (P,), the dev rows as the validation set."""
    s = load_sst2(cfg)
    return Dataset(
        {"ids": s.ids_train, "mask": s.mask_train},
        s.labels_train,
        {"ids": s.ids_val, "mask": s.mask_val},
        s.labels_val,
        description=s.description,
    )
