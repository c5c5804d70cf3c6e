"""Models and data sets by name: what exists is what the config may name, a new model is one new
module, and a moved config field is refused under its old name."""

import json
import shutil
import signal
import sys
from pathlib import Path

import pytest

from resconv_jax import data, experiments, models
from resconv_jax.config_defaults import RENAMED, base_config, load_config_file
from resconv_jax.errors import ConfigError
from resconv_jax.validation import renamed_flag, validate_config

COPY = "paper_copy"  # the new model's name: a copy of the paper's Transformer
TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.py")


def test_the_choices_are_the_modules_that_exist():
    assert models.model_names() == ("gpt2", "transformer")
    assert data.data_names() == ("jena", "sst2", "synthetic")
    config = base_config()
    assert set(config.model) >= {"name", "num_layers", "dtype", *models.model_names()}
    config.model.name = "gpt3"
    with pytest.raises(ConfigError, match=r"model.name='gpt3': expected one of gpt2, transformer"):
        validate_config(config)
    config = base_config()
    config.data.name = "mnist"
    with pytest.raises(ConfigError, match=r"data.name='mnist': expected one of jena, sst2, synth"):
        validate_config(config)


def test_a_model_validates_its_own_section_only():
    config = base_config()
    config.model.transformer.activation = "tanh"
    with pytest.raises(ConfigError, match=r"config.model.transformer.activation='tanh'"):
        validate_config(config)
    config.model.name = "gpt2"  # GPT-2 does not read the Transformer's section
    validate_config(config)


@pytest.mark.parametrize(
    "flag, new",
    [
        ("--config.model.d_qk=4", "--config.model.transformer.d_qk"),
        ("--config.model.weights=/x", "--config.model.gpt2.weights"),
        ("--config.model.gpt2_shape.n_embd=64", "--config.model.gpt2.shape.n_embd"),
        ("--config.theory.every=10", "--config.certificate.every"),
    ],
)
def test_a_moved_field_is_refused_under_its_old_name(flag, new):
    message = renamed_flag(["main", f"--config={TINY}", flag])
    assert message.startswith(f"{flag.split('=')[0]} is now {new}")
    assert renamed_flag(["main", f"{new}=1"]) is None
    assert all(old not in base_config() for old in RENAMED if "." not in old)


@pytest.fixture
def paper_copy(tmp_path, monkeypatch):
    """resconv_jax.models.paper_copy: models/transformer.py copied, under another name, into a
    folder added to the models package's path; removed again afterwards."""
    folder = tmp_path / "more_models"
    folder.mkdir()
    shutil.copy(models.model_module("transformer").__file__, folder / f"{COPY}.py")
    monkeypatch.setattr(models, "__path__", [*models.__path__, str(folder)])
    models.model_names.cache_clear()
    yield
    models.model_names.cache_clear()
    sys.modules.pop(f"resconv_jax.models.{COPY}", None)


def _train_through_main(argv: list[str], monkeypatch) -> None:
    """`python -m resconv_jax.main ARGV...`, in this process (which has the new module)."""
    previous = signal.getsignal(signal.SIGTERM)  # main installs its own at import
    from resconv_jax import main

    monkeypatch.setattr(sys, "argv", argv)  # where config_flags finds the --config.* overrides
    try:
        main.parse_flags(argv)
        main.main(["main"])
    finally:
        signal.signal(signal.SIGTERM, previous)


def _losses(workdir) -> list[tuple]:
    lines = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [(line["step"], line["run"], line["loss"], line.get("grad_norm")) for line in lines]


def test_a_new_model_is_one_file_trained_by_name_through_main(
    paper_copy, tmp_path, capsys, monkeypatch
):
    assert COPY in models.model_names()
    tiny = load_config_file(TINY)
    own = {f"--config.model.{COPY}.{k}={v}" for k, v in tiny.model.transformer.items()}
    common = [f"--config={TINY}", "--config.train.num_steps=20"]
    copy_args = [f"--config.model.name={COPY}", *own, f"--workdir={tmp_path / 'copy'}"]
    _train_through_main(["main", *common, *copy_args], monkeypatch)
    reference = load_config_file(TINY, **{"train.num_steps": 20})  # the paper's model
    experiments.run_task(reference, str(tmp_path / "paper"))
    copy, paper = _losses(tmp_path / "copy"), _losses(tmp_path / "paper")
    assert len(copy) == 3 * 5 and copy == paper  # 3 runs, steps 0, 5, ..., 20: the same numbers
    saved = json.loads((tmp_path / "copy" / "config.json").read_text())
    assert saved["model"]["name"] == COPY and saved["model"][COPY]["d_qk"] == 4
    assert "Transformer: 1 block(s), d=32, d_qk=4, d_h=16" in capsys.readouterr().out
