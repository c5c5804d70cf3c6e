"""SST-2 loader: GPT-2 ids, bundled sample, row choice, padding, sources and bad-data errors."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
import tokenizers

from resconv_jax.data import sst2
from resconv_jax.data.sst2 import (
    BUNDLED_DEV,
    BUNDLED_SHA256,
    BUNDLED_TRAIN,
    PAD_ID,
    SST2DataError,
    bundled_bytes,
    bundled_tables,
    gpt2_tokenizer,
    load_sst2,
    parse_sst2_tsv,
    select_train_rows,
)

# Ids looked up by hand in GPT-2's vocab.json: hello 31373, Ġworld 995, Ġhello 23748, it 270,
# Ġ' 705, s 82, Ġa 257, Ġcharming 23332, Ġand 290, Ġoften 1690, Ġaffecting 13891, Ġjourney 7002,
# Ġ. 764, The 464, Ġmovie 3807, Ġ... 2644, c 66, af 1878, Ã© 2634 (é's bytes), a 64, Ġ 220, Ġb 275.
REFERENCE_IDS = [
    ("hello world", [31373, 995]),
    (" hello", [23748]),
    (
        "it 's a charming and often affecting journey .",
        [270, 705, 82, 257, 23332, 290, 1690, 13891, 7002, 764],
    ),
    ("The movie ...", [464, 3807, 2644]),
    ("café", [66, 1878, 2634]),
    ("a  b", [64, 220, 275]),  # GPT-2's regex: the space before the last one goes alone
]


def tsv(rows, header: str = "sentence\tlabel") -> bytes:
    """GLUE-style TSV bytes (trailing space before the tab, as in GLUE) for (sentence, label)."""
    return "".join(f"{line}\n" for line in [header, *(f"{s} \t{y}" for s, y in rows)]).encode()


def write_folder(folder: Path, train: bytes, dev: bytes, gz=(False, True)) -> Path:
    """folder/train.tsv[.gz] and folder/dev.tsv[.gz]; gz[i] says which are gzipped."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, content, zipped in (("train.tsv", train, gz[0]), ("dev.tsv", dev, gz[1])):
        path = folder / (name + ".gz" if zipped else name)
        path.write_bytes(gzip.compress(content) if zipped else content)
    return folder


def cfg_for(**overrides):
    cfg = sst2.default_config()
    cfg.update(overrides)
    return cfg


@pytest.fixture(scope="module")
def bundled():
    return bundled_tables()


@pytest.fixture
def small_folder(tmp_path: Path) -> Path:
    """The bundled sample's first 300 train rows and first 100 dev rows, as GLUE files."""
    train = b"".join(bundled_bytes(BUNDLED_TRAIN).splitlines(keepends=True)[:301])
    dev = b"".join(bundled_bytes(BUNDLED_DEV).splitlines(keepends=True)[:101])
    return write_folder(tmp_path / "glue", train, dev)


@pytest.mark.parametrize(("text", "expected"), REFERENCE_IDS)
def test_bundled_tokenizer_gives_gpt2_ids(text, expected):
    tok = gpt2_tokenizer()
    assert tok.encode(text, add_special_tokens=False).ids == expected
    assert tok.decode(expected) == text
    assert tok.get_vocab_size() == 50257 and tok.token_to_id("<|endoftext|>") == PAD_ID


def test_tokenizer_dir_takes_precedence(tmp_path: Path):
    vocab = json.loads(bundled_bytes(sst2.BUNDLED_VOCAB))
    vocab["hello"], vocab["Ġworld"] = 995, 31373  # a swapped vocabulary, to tell them apart
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_bytes(bundled_bytes(sst2.BUNDLED_MERGES))
    swapped = gpt2_tokenizer(str(tmp_path))
    assert swapped.encode("hello world").ids == [995, 31373]
    saved = tmp_path / "json_dir"
    saved.mkdir()
    swapped.save(str(saved / "tokenizer.json"))
    (saved / "vocab.json").write_text("{}")  # tokenizer.json wins over vocab/merges
    assert gpt2_tokenizer(str(saved)).encode("hello world").ids == [995, 31373]
    bundled_ids = load_sst2(cfg_for(num_train=8)).ids_train
    via_dir = load_sst2(cfg_for(num_train=8, tokenizer_dir=str(tmp_path))).ids_train
    hello_world = (bundled_ids == 995) | (bundled_ids == 31373)
    assert np.array_equal(bundled_ids[~hello_world], via_dir[~hello_world])
    with pytest.raises(SST2DataError, match="no tokenizer.json, nor vocab.json"):
        gpt2_tokenizer(str(tmp_path / "nowhere"))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "tokenizer.json").write_text("{not json")
    with pytest.raises(SST2DataError, match=r"tokenizer.json: not a tokenizer") as err:
        gpt2_tokenizer(str(tmp_path / "bad"))
    assert "\n" not in str(err.value)


def test_padding_and_truncation_saved_in_a_tokenizer_json_are_not_applied(tmp_path: Path):
    """Hugging Face's fast tokenizers save their last call's padding and truncation in
    tokenizer.json. Applied, they marked padding as real tokens (the mask all ones, the head
    reading a pad token) and cut sentences short while the description said "0 truncated"."""
    saved = tokenizers.Tokenizer.from_str(gpt2_tokenizer().to_str())
    saved.enable_padding(pad_id=PAD_ID, pad_token="<|endoftext|>", length=32)
    saved.enable_truncation(max_length=3)
    saved.save(str(tmp_path / "tokenizer.json"))
    bundled = load_sst2(cfg_for(num_train=16, max_tokens=64))
    via_json = load_sst2(cfg_for(num_train=16, max_tokens=64, tokenizer_dir=str(tmp_path)))
    for name in ("ids_train", "mask_train", "ids_val", "mask_val"):
        np.testing.assert_array_equal(getattr(via_json, name), getattr(bundled, name))
    truncated = [s.description.split("; tokenizer")[0] for s in (via_json, bundled)]
    assert truncated[0] == truncated[1]  # "train 16 rows ... 0 truncated ..."
    assert bundled.mask_train.sum(axis=1).max() > 3


def test_padding_uses_the_tokenizers_own_end_of_text_id(tmp_path: Path):
    """Padding was GPT-2's id 50256 whatever tokenizer_dir gave: with a smaller vocabulary every
    padded sentence had an id past the embedding table, and the run was refused."""
    byte_chars = [c for c in json.loads(bundled_bytes(sst2.BUNDLED_VOCAB)) if len(c) == 1]
    vocab = {c: i for i, c in enumerate(byte_chars)}  # the 256 byte-level characters
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he")]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("".join(f"{a} {b}\n" for a, b in merges))
    small = load_sst2(cfg_for(num_train=16, max_tokens=64, tokenizer_dir=str(tmp_path)))
    assert small.pad_id == vocab["<|endoftext|>"] == 259
    assert small.ids_train.max() == 259 and np.all(small.ids_train[small.mask_train == 0] == 259)
    assert small.description.endswith("right-padded with 259")
    assert load_sst2(cfg_for(num_train=16)).pad_id == PAD_ID  # GPT-2's own: as before


@pytest.mark.parametrize(
    "vocab, merges, match",
    [
        ("[1, 2]", None, "vocab.json: not a JSON vocabulary (expected an object of token: id)"),
        (None, "#version: 0.2\n", "merges.txt: no merges"),
        ('{"a": 0, "b": 1}', "a c\n", "not a GPT-2 BPE tokenizer"),
    ],
    ids=["vocab a list", "no merges", "a merge outside the vocabulary"],
)
def test_a_damaged_tokenizer_folder_is_one_line(tmp_path: Path, vocab, merges, match):
    """A list for vocab.json and a merge outside the vocabulary gave tracebacks (exit 1); an
    empty merges.txt tokenized byte by byte without a word."""
    (tmp_path / "vocab.json").write_text(
        vocab if vocab is not None else bundled_bytes(sst2.BUNDLED_VOCAB).decode()
    )
    (tmp_path / "merges.txt").write_bytes(
        merges.encode() if merges is not None else bundled_bytes(sst2.BUNDLED_MERGES)
    )
    with pytest.raises(SST2DataError, match=re.escape(match)) as error:
        gpt2_tokenizer(str(tmp_path))
    assert "\n" not in str(error.value)


def test_bundled_sample_parses(bundled):
    train, dev = bundled
    assert len(train) == 4000 and len(dev) == 872
    assert np.bincount(train.labels).tolist() == [1807, 2193]
    assert np.bincount(dev.labels).tolist() == [428, 444]
    assert train.sentences[0] == "hide new secretions from the parental units"  # stripped
    assert dev.sentences[0] == "it 's a charming and often affecting journey ."
    assert train.lines.tolist()[:3] == [2, 3, 4] and dev.lines[-1] == 873


def test_bundled_files_match_their_provenance():
    folder = resources.files("resconv_jax.data") / "bundled"
    notes = (folder / "SST2_PROVENANCE.md").read_text() + (
        folder / "GPT2_TOKENIZER_PROVENANCE.md"
    ).read_text()
    for name, sha in BUNDLED_SHA256.items():
        assert hashlib.sha256(bundled_bytes(name)).hexdigest() == sha, name
        assert sha in notes and name in notes, name
        stored = hashlib.sha256((folder / name).read_bytes()).hexdigest()
        assert stored in notes, name


def _damaged_bundle(tmp_path, monkeypatch, module, name: str, content: bytes) -> None:
    """The package's bundled folder, copied to tmp_path with `name` replaced by `content` (gz),
    and seen by `module` (its `resources`) in its place."""
    import shutil
    import types

    folder = tmp_path / "bundled"
    shutil.copytree(resources.files("resconv_jax.data") / "bundled", folder)
    (folder / name).write_bytes(gzip.compress(content))
    fake = types.SimpleNamespace(files=lambda package: tmp_path)
    monkeypatch.setattr(module, "resources", fake)


@pytest.mark.parametrize("name", [BUNDLED_DEV, sst2.BUNDLED_MERGES])
def test_a_damaged_bundled_file_is_one_line_naming_the_reinstall(tmp_path, monkeypatch, name):
    """A dev split cut to 100 rows loaded as 'val 100 rows of 100', a merges file cut to its
    header tokenized byte by byte: the bundled files are checked against their sha256."""
    from resconv_jax.data.formats import sst2_tsv

    cut = b"\n".join(bundled_bytes(name).split(b"\n")[:101]) + b"\n"
    _damaged_bundle(tmp_path, monkeypatch, sst2_tsv, name, cut)
    gpt2_tokenizer.cache_clear()
    try:
        with pytest.raises(SST2DataError, match=f"{name} \\(bundled\\): sha256 .* reinstall"):
            load_sst2(cfg_for(num_train=8))
    finally:
        gpt2_tokenizer.cache_clear()


def test_the_jena_tfds_source_checks_the_bundled_sample(tmp_path, monkeypatch):
    from resconv_jax.data.formats import jena_csv, jena_tfds
    from resconv_jax.errors import JenaDataError

    sample = gzip.decompress(jena_csv.bundled_csv_bytes())
    _damaged_bundle(tmp_path, monkeypatch, jena_csv, jena_csv.BUNDLED_NAME, sample[:-5000])
    with pytest.raises(JenaDataError, match="sha256 .* reinstall"):
        jena_tfds._source(None)


def test_the_full_bundled_train_split_is_every_glue_row():
    from resconv_jax.data.formats.sst2_tsv import BUNDLED_FULL_TRAIN, bundled_tables

    train, dev = bundled_tables(full=True)
    assert (len(train), len(dev)) == (67349, 872) and train.name.startswith(BUNDLED_FULL_TRAIN)
    assert np.bincount(train.labels).tolist() == [29780, 37569]
    head, _ = bundled_tables()
    assert train.sentences[:4000] == head.sentences  # the default sample is its head


def test_seeded_choice_is_deterministic_and_differs_across_seeds(bundled):
    a, b = select_train_rows(4000, 200, 3, "x"), select_train_rows(4000, 200, 3, "x")
    assert np.array_equal(a, b) and len(set(a.tolist())) == 200
    assert np.array_equal(select_train_rows(4000, 100, 3, "x"), a[:100])  # nested in P
    assert not np.array_equal(select_train_rows(4000, 200, 4, "x"), a)
    assert np.array_equal(a, np.random.default_rng(3).permutation(4000)[:200])
    s = load_sst2(cfg_for(num_train=200, seed=3))
    assert np.array_equal(s.train_lines, bundled[0].lines[a])
    assert np.array_equal(s.labels_train, bundled[0].labels[a])
    assert not np.array_equal(load_sst2(cfg_for(num_train=200, seed=4)).ids_train, s.ids_train)


def test_padding_mask_shapes_and_token_counts(bundled):
    s = load_sst2(cfg_for(num_train=64, max_tokens=40))
    assert s.ids_train.shape == s.mask_train.shape == (64, 40) and s.labels_train.shape == (64,)
    assert s.ids_val.shape == s.mask_val.shape == (872, 40) and s.labels_val.shape == (872,)
    assert {s.ids_train.dtype, s.mask_train.dtype, s.labels_train.dtype} == {np.dtype(np.int32)}
    tok = gpt2_tokenizer()
    sentences = bundled[0].take(select_train_rows(4000, 64, 0, "x")).sentences
    counts = [min(len(tok.encode(t).ids), 40) for t in sentences]
    assert s.mask_train.sum(axis=1).tolist() == counts
    assert np.all(np.diff(s.mask_train, axis=1) <= 0)  # real tokens first, then padding
    assert np.all(s.ids_train[s.mask_train == 0] == PAD_ID)
    assert s.ids_train[0, : counts[0]].tolist() == tok.encode(sentences[0]).ids[:40]
    assert s.mask_val.sum() == sum(min(len(tok.encode(t).ids), 40) for t in bundled[1].sentences)


def test_truncation_at_max_tokens(bundled):
    tok = gpt2_tokenizer()
    s = load_sst2(cfg_for(num_train=-1, max_tokens=5))
    full = [tok.encode(t).ids for t in bundled[1].sentences]
    assert s.ids_val.shape == (872, 5)
    for row, ids in zip(s.ids_val, full, strict=True):
        assert row[: min(len(ids), 5)].tolist() == ids[:5]
    val_truncated = sum(len(ids) > 5 for ids in full)
    assert val_truncated > 0 and f"of 872, {val_truncated} truncated" in s.description
    assert "train 4000 rows (1: 2193, 0: 1807) of 4000" in s.description


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"", "empty file"),
        (b"\n\n", "empty file"),
        (tsv([("good", 1)], header="index\tsentence"), "line 1: missing header"),
        (b"sentence\tlabel\n", "line 1: no data rows"),
        (tsv([("good", 1)]) + b"no tab here\n", "line 3: no tab"),
        (tsv([("good", 1)]) + b"a\tb\t1\n", "line 3: 3 tab-separated fields"),
        (tsv([("good", 1), ("bad", 2)]), "line 3: label '2', expected 0 or 1"),
        (tsv([("good", 1), ("bad", "")]), "line 3: label '', expected 0 or 1"),
        (tsv([("good", 1), ("  ", 0)]), "line 3: empty sentence"),
        (tsv([("good", 1)]) + b"caf\xe9 \t1\n", "line 3: not UTF-8"),
    ],
    ids=["empty", "blank", "header", "header-only", "no-tab", "fields", "label", "no-label",
         "no-sentence", "utf8"],
)  # fmt: skip
def test_bad_tsv_gives_one_line_error(tmp_path: Path, content: bytes, match: str):
    folder = write_folder(tmp_path / "glue", content, tsv([("fine", 0)]), gz=(True, False))
    with pytest.raises(SST2DataError, match=match) as err:
        load_sst2(cfg_for(source="file", path=str(folder), num_train=1))
    assert str(err.value).startswith(f"{folder / 'train.tsv.gz'}: ") and "\n" not in str(err.value)
    with pytest.raises(SST2DataError, match=match):
        parse_sst2_tsv(content, "x.tsv")


def test_file_source_reads_plain_and_gzip(tmp_path: Path, small_folder: Path):
    s = load_sst2(cfg_for(source="file", path=str(small_folder), num_train=50))
    assert s.ids_train.shape == (50, 64) and s.ids_val.shape == (100, 64)
    swapped = write_folder(
        tmp_path / "swapped",
        gzip.decompress((small_folder / "dev.tsv.gz").read_bytes()),
        (small_folder / "train.tsv").read_bytes(),
        gz=(True, False),
    )  # train and dev swapped: the arrays must change
    t = load_sst2(cfg_for(source="file", path=str(swapped), num_train=50))
    assert t.ids_val.shape == (300, 64) and not np.array_equal(t.ids_train, s.ids_train)
    (small_folder / "train.tsv.gz").write_bytes(b"")
    with pytest.raises(SST2DataError, match="both of train.tsv and train.tsv.gz"):
        load_sst2(cfg_for(source="file", path=str(small_folder)))
    with pytest.raises(SST2DataError, match="neither of train.tsv and train.tsv.gz"):
        load_sst2(cfg_for(source="file", path=str(tmp_path / "missing")))
    (swapped / "train.tsv.gz").write_bytes(b"\x1f\x8b not gzip")
    with pytest.raises(SST2DataError, match=r"train.tsv.gz: corrupt gzip"):
        load_sst2(cfg_for(source="file", path=str(swapped)))


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"num_train": 301}, r"train.tsv: num_train=301 but the file has only 300 rows"),
        ({"num_val": 101}, r"dev.tsv.gz: num_val=101 but the file has only 100 rows"),
        ({"num_train": 0}, "num_train must be -1"),
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
        ({"seed": -1}, "seed must be an integer >= 0"),
        ({"source": "web"}, "unknown source 'web'"),
        ({"path": ""}, "source='file' needs path"),
        # the next two trained on the packaged sample, the folder never read
        ({"source": "bundled"}, r"path is read by source='file' or 'tfds' only; source='bundl"),
        ({"tfds_data_dir": "/tmp/x"}, r"tfds_data_dir is read by source='tfds' only"),
    ],
)
def test_bad_config_gives_one_line_error(small_folder: Path, overrides, match):
    cfg = cfg_for(source="file", path=str(small_folder))
    cfg.update(overrides)
    with pytest.raises(SST2DataError, match=match) as err:
        load_sst2(cfg)
    assert "\n" not in str(err.value)


def test_num_val_takes_the_first_dev_rows(bundled):
    s = load_sst2(cfg_for(num_train=4, num_val=10))
    assert s.val_lines.tolist() == list(range(2, 12))
    assert np.array_equal(s.labels_val, bundled[1].labels[:10])


def test_tfds_builder_gives_the_same_arrays(tmp_path: Path, small_folder: Path):
    from resconv_jax.data.formats import sst2_tfds

    data_dir = tmp_path / "tfds"
    cfg = cfg_for(source="file", path=str(small_folder), num_train=120, seed=5, max_tokens=16)
    via_tsv = load_sst2(cfg)
    via_tfds = load_sst2(cfg_for(**{**cfg, "source": "tfds", "tfds_data_dir": str(data_dir)}))
    for k in ("ids_train", "mask_train", "labels_train", "ids_val", "mask_val", "labels_val"):
        assert np.array_equal(getattr(via_tfds, k), getattr(via_tsv, k)), k
    assert np.array_equal(via_tfds.train_lines, via_tsv.train_lines)
    assert "tfds sst2" in via_tfds.description
    assert (data_dir / "sst2" / "1.0.0").is_dir()
    train, dev, meta = sst2_tfds.read_tables(data_dir)
    assert len(train) == 300 and len(dev) == 100 and meta["train_name"].endswith("train.tsv")
    with pytest.raises(SST2DataError, match="was prepared from"):
        sst2_tfds.load_tables(data_dir)  # the bundled sample is other data


def test_a_tfds_folder_that_cannot_be_created_is_one_line(tmp_path: Path):
    """It was a NotADirectoryError traceback (exit 1)."""
    (tmp_path / "file").write_text("")
    cfg = cfg_for(source="tfds", tfds_data_dir=str(tmp_path / "file" / "x"))
    with pytest.raises(SST2DataError, match="tfds_data_dir=.*cannot be created"):
        load_sst2(cfg)


def test_tfds_bad_data_writes_nothing(tmp_path: Path):
    from resconv_jax.data.formats import sst2_tfds

    folder = write_folder(tmp_path / "glue", tsv([("ok", 1)]) + b"x\t7\n", tsv([("ok", 0)]))
    data_dir = tmp_path / "tfds"
    with pytest.raises(SST2DataError, match="line 3: label '7'"):
        sst2_tfds.prepare(data_dir, folder)
    assert not data_dir.exists()


def test_a_one_element_depth_sweep_beyond_the_checkpoint_is_refused(tmp_path):
    """sweep.num_layers=(6,) on a 3-block GPT-2: one line naming both depths, no workdir."""
    from resconv_jax import train
    from resconv_jax.config_defaults import load_config_file

    config = load_config_file(
        os.path.join(os.path.dirname(__file__), "..", "configs", "sst2.py"),
        **{"model.gpt2.weights": "random", "sweep.num_layers": (6,), "data.num_train": 8},
    )
    with config.unlocked():
        config.model.gpt2.shape.update(n_embd=16, n_head=2, n_layer=3, n_positions=64)
    with pytest.raises(ValueError, match="num_layers=6 must be between 1 and n_layer=3"):
        train.run(config, str(tmp_path / "w"))
    assert not (tmp_path / "w").exists()


def _small_random_gpt2(**overrides):
    from resconv_jax.config_defaults import load_config_file

    config = load_config_file(
        os.path.join(os.path.dirname(__file__), "..", "configs", "sst2.py"),
        **{"model.gpt2.weights": "random", "sweep.num_layers": (1,), "sweep.beta": (1.0,),
           "data.num_train": 8, "data.max_tokens": 8, "data.num_val": 16,
           "train.num_steps": 2, **overrides},
    )  # fmt: skip
    with config.unlocked():
        config.model.gpt2.shape.update(n_embd=16, n_head=2, n_layer=2, n_positions=64)
    return config


def test_token_ids_beyond_the_vocabulary_are_refused_before_anything_is_written(tmp_path):
    """They trained NaN from step 0 (an embedding lookup past the table) and stopped as
    'diverged', exit 1, leaving the workdir."""
    from resconv_jax import train

    config = _small_random_gpt2()
    with config.unlocked():
        config.model.gpt2.shape.vocab_size = 1000
    with pytest.raises(ValueError, match=r"token ids up to \d+ but GPT-2's vocab_size is 1000"):
        train.run(config, str(tmp_path / "w"))
    assert not (tmp_path / "w").exists()


def test_the_classifier_has_a_class_for_every_label_of_train_and_validation(tmp_path):
    """One training sentence (label 0) gave a one-class head, and its 'validation accuracy' was
    the share of label 0 in dev."""
    from resconv_jax.data import load_dataset
    from resconv_jax.models import build_model

    config = _small_random_gpt2(**{"data.num_train": 1, "data.seed": 1})
    dataset = load_dataset(config)
    assert np.asarray(dataset.y_train).tolist() == [0]
    assert "a (16, 2) head" in build_model(config.model, dataset).description


def test_the_sst2_claims_refuse_runs_that_differ_in_lr(tmp_path):
    """An lr sweep's tables carry an lr column: 5b and 5b″ compare β within one lr, so on such
    a folder they are not run and say why (they used to keep one lr's error per cell, silently)."""
    from resconv_jax.experiments import classification, sst2_seeds
    from resconv_jax.experiments.claims import NOT_RUN
    from resconv_jax.runtime.workdir import write_csv

    cells = [(L, lr, b) for L in (2, 6) for lr in (1e-4, 2e-4) for b in (0.0, 1.0)]
    write_csv(tmp_path / classification.ACCURACY_FILE, [
        {"num_layers": L, "lr": lr, "beta_attn": b, "beta_ffn": b, "runs": 1,
         "final_error": 0.3 - 0.1 * b, "final_val_accuracy": 0.6} for L, lr, b in cells
    ])  # fmt: skip
    write_csv(tmp_path / sst2_seeds.RUNS_FILE, [
        {"num_layers": L, "beta": b, "seed": 0, "final_error": 0.3 - 0.1 * b, "lr": lr}
        for L, lr, b in cells
    ])  # fmt: skip
    for claim in (classification.sst2_ordering(tmp_path),
                  sst2_seeds.sst2_ordering_with_seeds(tmp_path)):  # fmt: skip
        assert claim.verdict == NOT_RUN and "differ in lr (0.0001, 0.0002)" in claim.note


def test_a_depth_sweep_checks_the_deepest_blocks_before_training_the_first(tmp_path):
    """A checkpoint missing a tensor of block 2, swept at L ∈ {1, 3}: one line before anything
    is trained or written (it used to train L = 1, write layers_1/, then stop at L = 3)."""
    from safetensors.numpy import save_file

    from resconv_jax import train
    from resconv_jax.config_defaults import load_config_file
    from resconv_jax.errors import WeightsError
    from resconv_jax.models.gpt2 import weights

    shape = {"n_embd": 16, "n_head": 2, "n_layer": 3, "n_positions": 64, "vocab_size": 50257}
    _, _, params = weights.load_gpt2("random", num_layers=3, num_classes=2, seed=0, shape=shape)
    tensors = {
        f"transformer.{key}": np.asarray(value)
        for key, value in weights._flatten(params).items()
        if not key.startswith("head.") and key != "h.2.mlp.c_fc.weight"
    }
    folder = tmp_path / "gpt2"
    folder.mkdir()
    save_file(tensors, str(folder / weights.WEIGHTS_FILE))
    (folder / weights.CONFIG_FILE).write_text(json.dumps(shape))
    config = load_config_file(
        os.path.join(os.path.dirname(__file__), "..", "configs", "sst2.py"),
        **{"model.gpt2.weights": str(folder), "sweep.num_layers": (1, 3), "data.num_train": 8,
           "data.max_tokens": 8, "data.num_val": 8, "train.num_steps": 2},
    )  # fmt: skip
    with pytest.raises(WeightsError, match=r"missing: h\.2\.mlp\.c_fc\.weight"):
        train.run(config, str(tmp_path / "w"))
    assert not (tmp_path / "w").exists()
