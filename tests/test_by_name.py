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


def test_every_experiment_record_loads_at_every_scale_and_claims_have_their_own_place():
    from resconv_jax.experiments.record import SCALES

    records = experiments.experiment_list()
    assert [r.name for r in records][:3] == ["theory", "conditioning", "rank_collapse"]
    ranks = [claim.rank for record in records for claim in record.claims]
    # One row each: 1, 1″, 2, 2″, 3, 3″, cert., 4, 4b, 5a, 5a″, 5a′, 5a′″, 5b, 5b″.
    assert len(ranks) == len(set(ranks)) == 15
    for record in records:
        for scale in SCALES:
            for each in (record, record.fallback):
                if each is not None:
                    config = each.load(scale)
                    assert config.task in experiments.task_names(), (each.name, scale)


def test_a_new_data_set_is_one_file_loaded_by_name(tmp_path, monkeypatch):
    """data/synthetic.py copied under another name into the package's path: loaded by name, the
    same arrays."""
    folder = tmp_path / "more_data"
    folder.mkdir()
    shutil.copy(data.data_module("synthetic").__file__, folder / "gaussian_copy.py")
    monkeypatch.setattr(data, "__path__", [*data.__path__, str(folder)])
    data.data_names.cache_clear()
    try:
        assert "gaussian_copy" in data.data_names()
        config = base_config()
        with config.unlocked():
            config.data = data.data_module("gaussian_copy").default_config()
        assert config.data.name == "gaussian_copy"
        validate_config(config)
        copy, original = data.load_dataset(config), data.load_dataset(base_config())
        assert (copy.x_train == original.x_train).all() and (copy.y_train == original.y_train).all()
    finally:
        data.data_names.cache_clear()
        sys.modules.pop("resconv_jax.data.gaussian_copy", None)


NEW_EXPERIMENT = """
from resconv_jax.experiments.claims import Claim
from resconv_jax.experiments.record import ClaimCheck, Experiment, scale_variants


def my_claim(workdir):
    return Claim("6. my claim", "the folder", "exists", value=str(workdir), verdict="holds")


EXPERIMENTS = (
    Experiment("mine", "My experiment", "tiny.py", scale_variants("", "", ""),
               claims=(ClaimCheck(6, my_claim),)),
)
"""


def test_a_new_claim_is_one_file_in_the_table(tmp_path, monkeypatch):
    """An experiment module with one record and its claim, added to the package's path: reproduce
    lists it after the others and its row comes from its folder."""
    from resconv_jax.reproducing.outcomes import Outcome
    from resconv_jax.reproducing.report import claims_table

    folder = tmp_path / "more_experiments"
    folder.mkdir()
    (folder / "my_experiment.py").write_text(NEW_EXPERIMENT)
    monkeypatch.setattr(experiments, "__path__", [*experiments.__path__, str(folder)])
    experiments.experiment_list.cache_clear()
    try:
        mine = experiments.experiment_list()[-1]
        assert mine.name == "mine" and mine.load("small").train.num_steps == 200
        (row,) = claims_table([Outcome(mine, str(tmp_path / "mine"), "ran", 1.0, [])])
        assert (row.claim, row.verdict, row.value) == (
            "6. my claim",
            "holds",
            str(tmp_path / "mine"),
        )
    finally:
        experiments.experiment_list.cache_clear()
        sys.modules.pop("resconv_jax.experiments.my_experiment", None)
