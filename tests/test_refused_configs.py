"""Configs refused before anything is built or written: non-finite values, bad seeds, sizes that
cannot fit, unknown variants; and the divergence message's advice."""

import os
import re

import numpy as np
import pytest
from test_faults import CONFIGS, tiny

from resconv_jax import train
from resconv_jax.config_defaults import load_config_file
from resconv_jax.errors import ConfigError


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ({"optim.lr": float("inf")}, "config.optim.lr=inf: must be a finite number"),
        (
            {"model.transformer.qk_scale": float("nan")},
            "config.model.transformer.qk_scale=nan: must be a finite number",
        ),
        ({"sweep.lr": (1e-3, float("inf"))}, "config.sweep.lr=(0.001, inf): must be finite"),
        ({"data.num_samples": 100_000_000}, "the data set alone needs"),
        # They passed, then failed in jax.random.key or NumPy with a traceback (exit 1), or
        # trained seed 1 for 1.5, without a word.
        ({"seed": 10**20}, "config.seed=100000000000000000000: a seed is an integer in [0, 2**32)"),
        (
            {"sweep.seed": (0, 1.5)},
            "config.sweep.seed=(0, 1.5): a seed is an integer in [0, 2**32)",
        ),
        (
            {"data.teacher_seed": -1},
            "config.data.teacher_seed=-1: a seed is an integer in [0, 2**32)",
        ),
        # Accepted before 2026-12-08: momentum -7 trained and "diverged" with step-size advice;
        # a repeated value trained the same run twice, counted twice by every table and test;
        # under lr_rule=lambda_max sweep.lr only repeated every run.
        ({"optim.momentum": -7.0}, "config.optim.momentum=-7.0: must be in [0, 1)"),
        ({"optim.momentum": 1.0}, "config.optim.momentum=1.0: must be in [0, 1)"),
        ({"sweep.seed": (0, 0)}, "config.sweep.seed=(0, 0): a value is repeated"),
        ({"sweep.beta": (0.0, 1.0, 1.0)}, "config.sweep.beta=(0.0, 1.0, 1.0): a value is repeat"),
        (
            {"optim.lr_rule": "lambda_max", "sweep.lr": (1e-3, 2e-3)},
            "config.sweep.lr=(0.001, 0.002): optim.lr_rule=lambda_max sets every run's step size",
        ),
    ],
)
def test_bad_values_are_refused_before_anything_is_written(tmp_path, overrides, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        train.run(tiny(**overrides), str(tmp_path / "w"))
    assert not os.path.exists(tmp_path / "w")


@pytest.mark.parametrize(
    "field", ["optim.learning_rate", "train.num_step", "sweep.betas", "data.lift_dim"]
)
def test_a_field_that_no_code_reads_is_refused_before_anything_is_written(tmp_path, field):
    """A config file can add keys (the command line cannot): a misspelt field trained with the
    default in its place, and config.json recorded the typo as if it had been used."""
    config = tiny()
    section, key = field.split(".")
    with config.unlocked():
        config[section][key] = 1  # as a config file's get_config() can
    expected = "not a field of data set 'synthetic'" if section == "data" else "no such field"
    with pytest.raises(ConfigError, match=re.escape(f"config.{field}: {expected}")):
        train.run(config, str(tmp_path / "w"))
    assert not os.path.exists(tmp_path / "w")


def test_constant_teacher_targets_are_refused_before_anything_is_written(tmp_path):
    """A zero readout makes every teacher output 0: y / y.std() was NaN, reported as a divergence
    with step-size advice (exit 1), with the workdir and its checkpoints left behind."""
    config = tiny(**{"data.target": "teacher", "model.transformer.head_scale": 0.0})
    with pytest.raises(ConfigError, match=r"data.target='teacher': the teacher's outputs are all"):
        train.run(config, str(tmp_path / "w"))
    assert not os.path.exists(tmp_path / "w")


def test_a_step_that_cannot_fit_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    from resconv_jax.runtime import memory

    monkeypatch.setattr(memory, "device_available_bytes", lambda device: 1 << 10)
    with pytest.raises(ConfigError, match="XLA's memory analysis") as error:
        train.run(tiny(), str(tmp_path / "w"))
    assert "more than the 1.0 KiB free on cpu" in str(error.value)
    assert not os.path.exists(tmp_path / "w")


def test_divergence_names_the_last_finite_checkpoint_and_the_most_restrictive_run():
    from resconv_jax.runtime.divergence import diverged_message, last_good_checkpoint
    from resconv_jax.sweep import RunSpec

    runs = [RunSpec(r, 0, 0.01, b, b) for r, b in enumerate((0.0, 0.5, 1.0))]
    history = [
        {"step": step, "run": r, "loss": loss}
        for step, losses in ((0, (5.0, 6.0, 7.0)), (10, (4.0, 5.0, 9.0)), (20, (3.0, "nan", 8.0)))
        for r, loss in enumerate(losses)
    ]
    # Step 20 holds run 1's NaN; step 10 has run 2 above its start: only step 0 is good for both.
    assert last_good_checkpoint(history, [0, 10, 20], np.array([1, 2])) == 0
    assert last_good_checkpoint(history, [0, 10, 20], np.array([1])) == 10
    losses = np.array([[1.0, np.nan, 2.0], [1.0, np.nan, np.inf]])

    def message_for(runs, lr_factor=None):
        stable = lambda: (2.0 / np.array([1.0, 100.0, 40.0]), "t")  # noqa: E731 - 2/λ_max(K)
        return diverged_message(
            losses, 20, runs, history, [0, 10, 20], "/ckpt", stable, False, lr_factor
        )

    message = message_for(runs)
    assert "2 of 3 runs diverged (first: run 1" in message and "step 0 in /ckpt" in message
    assert "run 1, has 2/lambda_max(K) = 0.02" in message and "--config.optim.lr=0.01" in message
    # optim.lr_rule=lambda_max ignores optim.lr (it said to set it): η = lr_factor/λ_max(K) at
    # initialization, here 0.04 from lr_factor = 2; half of run 1's 2/λ_max(K) = 0.02 needs 0.5.
    message = message_for([RunSpec(r, 0, 0.04, b, b) for r, b in enumerate((0.0, 0.5, 1.0))], 2.0)
    assert "--config.optim.lr=" not in message and "--config.optim.lr_factor=0.5" in message


@pytest.mark.parametrize(
    "config_file, overrides, expected",
    [
        ("theory.py", {"data.dim": 10_000_000}, "(num_samples=8, seq_len=8, d=10000000,"),
        (
            "theory.py",
            {"model.transformer.d_h": 1_000_000_000},
            "d_h=1000000000) needs at least 3.3 TiB",
        ),
        ("theory.py", {"model.num_layers": 100_000}, "num_layers=100000, runs=3,"),
        ("tiny.py", {"sweep.dim": (16, 100_000_000)}, "d=100000000: the data set alone needs"),
    ],
)
def test_sizes_that_cannot_fit_are_refused_from_the_shapes(
    tmp_path, config_file, overrides, expected
):
    """Before anything is built or drawn (these hung for minutes or crashed XLA)."""
    config = load_config_file(os.path.join(CONFIGS, config_file), **overrides)
    with pytest.raises(ConfigError) as error:
        train.run(config, str(tmp_path / "w"))
    assert expected in str(error.value) and "\n" not in str(error.value)
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("sst2.py:bogus", "sst2.py: unknown variant 'bogus' (its variants: random_small, small,"),
        ("depth.py:small,bogus", "unknown variant 'bogus' (its variants: small, branches, tiny)"),
        ("jena.py:whole", "jena.py: unknown variant 'whole' (its variants: small, tiny, full,"),
        ("rank_collapse.py:x", "rank_collapse.py: unknown variant 'x' (its variants: tiny)"),
        ("conditioning.py:smal", "unknown variant 'smal' (its variants: small, tiny)"),
        ("tiny.py:small", "tiny.py: unknown variant 'small' (it has no variants)"),
    ],
)
def test_every_config_file_refuses_an_unknown_variant(spec, expected):
    path, arg = spec.split(":")
    with pytest.raises(ValueError, match=re.escape(expected)):
        load_config_file(os.path.join(CONFIGS, path), arg)
