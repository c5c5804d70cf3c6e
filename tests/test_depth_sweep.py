"""Sweeps over depth: one program per L, run one after another, resumable across groups."""

import os

import pytest

from resconv_jax import experiments, train
from resconv_jax.config_defaults import load_config_file
from resconv_jax.runtime.metrics import METRICS_FILE, read_metrics

TINY = os.path.join(os.path.dirname(__file__), "..", "configs", "tiny.py")
STEPS = {
    "train.num_steps": 20,
    "train.checkpoint_every": 10,
    "train.async_checkpoints": False,
    "optim.lr": 1e-3,  # stable at L = 2 too
}


def tiny(**overrides):
    return load_config_file(TINY, **(STEPS | overrides))


def without(records: list[dict], *keys: str) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in keys} for r in records]


@pytest.mark.slow
def test_a_depth_sweep_equals_the_depths_run_one_at_a_time(tmp_path, capsys):
    summaries = experiments.run_task(tiny(**{"sweep.num_layers": (1, 2)}), str(tmp_path / "sweep"))
    assert [(s["run"], s["num_layers"]) for s in summaries] == [(r, 1 + r // 3) for r in range(6)]
    merged = read_metrics(str(tmp_path / "sweep"))
    assert {r["num_layers"] for r in merged} == {1, 2}
    for layers in (1, 2):
        alone = tmp_path / f"alone{layers}"
        train.run(tiny(**{"model.num_layers": layers}), str(alone))
        group = [r for r in merged if r["num_layers"] == layers]
        assert without(group, "run", "num_layers") == without(read_metrics(str(alone)), "run")
    table = capsys.readouterr().out
    assert "   L beta_a beta_f" in table and "\n   2      1      1    1 " in table


@pytest.mark.slow
def test_a_depth_sweep_resumes_across_groups(tmp_path):
    depths = {"sweep.num_layers": (2, 1)}
    train.run(tiny(**depths, **{"train.num_steps": 40}), str(tmp_path / "straight"))
    train.run(tiny(**depths), str(tmp_path / "resumed"))  # 20 steps, then extended to 40
    train.run(tiny(**depths, **{"train.num_steps": 40}), str(tmp_path / "resumed"))
    straight = (tmp_path / "straight" / METRICS_FILE).read_text()
    assert (tmp_path / "resumed" / METRICS_FILE).read_text() == straight
    assert sorted(os.listdir(tmp_path / "resumed")) == sorted(os.listdir(tmp_path / "straight"))


def test_a_depth_sweep_refused_in_its_first_group_leaves_no_workdir(tmp_path, monkeypatch):
    from resconv_jax.errors import ConfigError
    from resconv_jax.runtime import memory

    monkeypatch.setattr(memory, "device_available_bytes", lambda device: 1 << 10)
    with pytest.raises(ConfigError, match="XLA's memory analysis"):
        train.run(tiny(**{"sweep.num_layers": (1, 2)}), str(tmp_path / "w"))
    assert not (tmp_path / "w").exists()


@pytest.mark.slow
def test_a_width_sweep_equals_the_widths_run_one_at_a_time(tmp_path):
    sweep = tiny(**{"sweep.dim": (16, 32), "sweep.beta": (0.0, 1.0)})
    summaries = experiments.run_task(sweep, str(tmp_path / "sweep"))
    assert [(s["run"], s["dim"]) for s in summaries] == [(0, 16), (1, 16), (2, 32), (3, 32)]
    assert sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.name.startswith("dim_")) == [
        "dim_16",
        "dim_32",
    ]
    merged = read_metrics(str(tmp_path / "sweep"))
    train.run(tiny(**{"data.dim": 32, "sweep.beta": (0.0, 1.0)}), str(tmp_path / "alone"))
    group = [r for r in merged if r["dim"] == 32]  # the second width: its own data, not the first's
    assert without(group, "run", "dim") == without(read_metrics(str(tmp_path / "alone")), "run")


def test_a_width_sweep_of_real_data_is_refused():
    from resconv_jax.errors import ConfigError
    from resconv_jax.validation import validate_config

    jena = os.path.join(os.path.dirname(__file__), "..", "configs", "jena.py")
    config = load_config_file(jena, "tiny", **{"sweep.dim": (16,)})
    with pytest.raises(ConfigError, match="sweep.dim sweeps the width of synthetic data"):
        validate_config(config)


@pytest.mark.slow
@pytest.mark.parametrize(
    "sweep, direct, label",
    [
        ({"sweep.num_layers": (2,)}, {"model.num_layers": 2}, "num_layers"),
        ({"sweep.dim": (16,)}, {"data.dim": 16}, "dim"),
    ],
)
def test_a_one_element_sweep_equals_that_setting_given_directly(tmp_path, sweep, direct, label):
    steps = {"train.num_steps": 10, "sweep.beta": (1.0,)}
    summaries = train.run(tiny(**steps, **sweep), str(tmp_path / "sweep"))
    train.run(tiny(**steps, **direct), str(tmp_path / "direct"))
    assert [s[label] for s in summaries] == list(list(sweep.values())[0])
    swept, alone = read_metrics(str(tmp_path / "sweep")), read_metrics(str(tmp_path / "direct"))
    assert without(swept, label) == alone
