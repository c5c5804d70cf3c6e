"""Training: convergence, sweeps against single runs, sharding invariance, bad input."""

import json
import os
import re
import struct
import subprocess
import sys

import jax
import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from resconv_jax import experiments, runners, train
from resconv_jax.config_defaults import load_config_file
from resconv_jax.errors import ConfigError, WorkdirBusy
from resconv_jax.experiments.run_report import write_run_report
from resconv_jax.models import transformer
from resconv_jax.runtime.metrics import read_metrics
from resconv_jax.runtime.workdir import WorkdirLock

TINY = os.path.join(os.path.dirname(__file__), "..", "configs", "tiny.py")


def tiny(**overrides):
    defaults = {"train.checkpoint_every": 1000, "train.async_checkpoints": False}
    return load_config_file(TINY, **(defaults | overrides))


def tensorboard_scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} from the TFRecord event files under `logdir`."""
    scalars = {}
    for path in sorted(logdir.iterdir()):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
            offset += 16 + length  # length, its CRC, the record, its CRC
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def losses_by_run(workdir) -> dict[int, np.ndarray]:
    records = read_metrics(str(workdir))
    runs = sorted({r["run"] for r in records})
    return {run: np.array([r["loss"] for r in records if r["run"] == run]) for run in runs}


def test_tiny_loss_falls_100x(tmp_path):
    summaries = train.run(tiny(), str(tmp_path))
    for summary in summaries:
        assert summary["final_loss"] < summary["initial_loss"] / 100, summary
        assert summary["rate"] < 1.0


def test_metrics_lines_carry_run_settings_and_outputs_exist(tmp_path):
    train.run(tiny(**{"train.num_steps": 10}), str(tmp_path))
    records = read_metrics(str(tmp_path))
    assert [r["step"] for r in records] == [0, 0, 0, 5, 5, 5, 10, 10, 10]
    assert [r["beta_attn"] for r in records[:3]] == [0.0, 0.5, 1.0]
    assert {"run", "seed", "lr", "beta_ffn", "loss", "grad_norm", "contraction"} <= set(records[0])
    assert json.load(open(tmp_path / "config.json"))["optim"]["lr"] == 0.004
    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    assert [v for s, v in scalars["run1/loss"]] == [r["loss"] for r in records if r["run"] == 1]
    assert [s for s, v in scalars["run2/beta_attn"]] == [0, 5, 10]
    assert len(json.load(open(tmp_path / "summary.json"))) == 3


def test_the_trainer_writes_no_figure_and_the_experiment_report_does(tmp_path):
    workdir = str(tmp_path)
    train.run(tiny(**{"train.num_steps": 10}), workdir)
    assert not (tmp_path / "beta_table.csv").exists() and not (tmp_path / "training.png").exists()
    tables = write_run_report(workdir)
    rows = (tmp_path / "beta_table.csv").read_text().splitlines()
    assert len(rows) == 1 + 3 and len(tables) == 1 and "per-β table" in tables[0]
    assert (tmp_path / "training.png").stat().st_size > 0
    lock = WorkdirLock(workdir)
    lock.acquire()
    try:
        with pytest.raises(WorkdirBusy, match="is in use by PID"):
            write_run_report(workdir)
    finally:
        lock.release()


@pytest.mark.slow
def test_sweep_equals_runs_one_at_a_time(tmp_path):
    steps = {"train.num_steps": 20}
    train.run(tiny(**steps), str(tmp_path / "sweep"))
    swept = losses_by_run(tmp_path / "sweep")
    for run, beta in enumerate((0.0, 0.5, 1.0)):
        workdir = tmp_path / f"single{run}"
        train.run(tiny(**steps, **{"sweep.beta": (beta,)}), str(workdir))
        np.testing.assert_allclose(losses_by_run(workdir)[0], swept[run], rtol=1e-5)


@pytest.mark.slow
def test_eight_devices_equal_one_device(tmp_path):
    common = {"train.num_steps": 20, "sweep.beta": (0.0, 1.0)}
    train.run(tiny(**common, **{"mesh.sweep": 2, "mesh.data": 4}), str(tmp_path / "eight"))
    train.run(tiny(**common, **{"mesh.sweep": 1, "mesh.data": 1}), str(tmp_path / "one"))
    eight, one = losses_by_run(tmp_path / "eight"), losses_by_run(tmp_path / "one")
    for run in (0, 1):
        np.testing.assert_allclose(eight[run], one[run], rtol=1e-5)


def test_runs_stepped_a_chunk_at_a_time_equal_runs_stepped_together(tmp_path):
    one_device = {"train.num_steps": 20, "mesh.sweep": 1, "mesh.data": 1}
    train.run(tiny(**one_device, **{"train.runs_per_chunk": 0}), str(tmp_path / "together"))
    train.run(tiny(**one_device, **{"train.runs_per_chunk": 2}), str(tmp_path / "chunked"))
    together, chunked = losses_by_run(tmp_path / "together"), losses_by_run(tmp_path / "chunked")
    for run in (0, 1, 2):
        np.testing.assert_allclose(chunked[run], together[run], rtol=1e-5)  # float32


@pytest.mark.slow
def test_automatic_chunking_on_one_device_when_the_step_outgrows_the_cache(
    tmp_path, monkeypatch, capsys
):
    one_device = {"train.num_steps": 10, "mesh.sweep": 1, "mesh.data": 1}
    train.run(tiny(**one_device, **{"train.runs_per_chunk": 0}), str(tmp_path / "together"))
    assert "at a time" not in capsys.readouterr().out
    monkeypatch.setattr(runners, "CPU_CHUNK_BYTES", 1)  # every step "outgrows" it: 1 run per chunk
    train.run(tiny(**one_device), str(tmp_path / "auto"))
    assert "1 run at a time" in capsys.readouterr().out
    together, auto = losses_by_run(tmp_path / "together"), losses_by_run(tmp_path / "auto")
    for run in (0, 1, 2):
        np.testing.assert_allclose(auto[run], together[run], rtol=1e-6)


def test_same_seed_gives_same_initialization_whatever_beta():
    config = tiny(**{"sweep.seed": (0, 1)})
    runs = train.expand_runs(config)
    model_cfg = transformer.model_config(config.model, d=32, d_y=1)
    optimizer = train.make_optimizer(config.optim)
    params = train.initial_state(transformer.make_model(model_cfg), runs, optimizer)["params"]
    w_q = np.asarray(params["blocks"][0]["w_q"])
    assert [(r.seed, r.beta_attn) for r in runs[:4]] == [(0, 0.0), (0, 0.5), (0, 1.0), (1, 0.0)]
    np.testing.assert_array_equal(w_q[0], w_q[2])
    assert not np.array_equal(w_q[0], w_q[3])


def test_diverging_run_stops_with_one_line_and_keeps_checkpoint(tmp_path):
    config = tiny(**{"optim.lr": 0.01, "train.num_steps": 100, "train.checkpoint_every": 5})
    with pytest.raises(train.TrainingDiverged) as error:
        train.run(config, str(tmp_path))
    message = str(error.value)
    assert "\n" not in message
    assert "1 of 3 runs diverged (first: run 2" in message
    assert "no good checkpoint (at steps 5 a diverging run's loss was already" in message
    # Half of 2/λ_max(K) of the β = 1 run at initialization (λ_max = 828.85 by the dense kernel).
    assert "2/lambda_max(K) = 0.00241" in message and "--config.optim.lr=0.00121" in message
    steps = [r["step"] for r in read_metrics(str(tmp_path)) if r["run"] == 2]
    assert steps == [0, 5]  # the line of the chunk that diverged is written too


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ({"data.num_samples": -3}, "config.data.num_samples=-3: must be positive"),
        ({"model.transformer.d_h": 0}, "config.model.transformer.d_h=0: must be positive"),
        ({"optim.lr": 0.0}, "step size must be a number > 0"),
        ({"sweep.lr": (0.1, -1.0)}, "config.sweep.lr=-1.0"),
        ({"model.beta_attn": -0.5}, "config.model.beta_attn=-0.5"),
        ({"sweep.beta": (0.0, -1.0)}, "config.sweep.beta=-1.0"),
        ({"optim.name": "lbfgs"}, "config.optim.name='lbfgs'"),
        ({"train.checkpoint_every": 7}, "multiple of train.log_every"),
        ({"mesh.sweep": 2}, "does not divide the 3 runs"),
        ({"train.runs_per_chunk": -2}, "config.train.runs_per_chunk=-2: must be >= -1"),
        ({"train.runs_per_chunk": 1}, "needs a 1-device mesh"),
        ({"probe.every": 7}, "config.probe.every=7: must be a multiple"),
    ],
)
def test_bad_config_raises_one_line_and_writes_nothing(tmp_path, overrides, expected):
    workdir = tmp_path / "run"
    with pytest.raises(ConfigError, match=expected) as error:
        train.run(tiny(**overrides), str(workdir))
    assert "\n" not in str(error.value)
    assert not workdir.exists()


def test_unwritable_workdir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="not a folder"):
        train.run(tiny(), str(blocker))
    with pytest.raises(ConfigError, match="cannot create|not writable"):
        train.run(tiny(), str(blocker / "sub"))


def test_resume_accepts_a_run_from_before_a_new_config_field(tmp_path):
    """A config.json without model.dtype (written before the field existed) is a float32 run."""
    train.run(tiny(**{"train.num_steps": 10}), str(tmp_path))
    path = tmp_path / "config.json"
    saved = json.loads(path.read_text())
    del saved["model"]["dtype"]
    path.write_text(json.dumps(saved))
    train.run(tiny(**{"train.num_steps": 20}), str(tmp_path))
    assert max(r["step"] for r in read_metrics(str(tmp_path))) == 20
    with pytest.raises(ConfigError, match=r"model.dtype: 'float32' -> 'float64'"):
        with jax.enable_x64(True):
            train.run(tiny(**{"train.num_steps": 30, "model.dtype": "float64"}), str(tmp_path))


def test_resume_refuses_a_different_config(tmp_path):
    train.run(tiny(**{"train.num_steps": 10}), str(tmp_path))
    with pytest.raises(ConfigError, match="holds a run with another config"):
        train.run(tiny(**{"train.num_steps": 10, "optim.lr": 0.001}), str(tmp_path))


def test_the_other_config_refusal_names_every_changed_field():
    """It named only the first in key order, which could be a trivial one (a cache path)."""
    from resconv_jax.runtime.workdir import check_same_run

    saved = {"data": {"cache_dir": None}, "optim": {"lr": 0.1}, "train": {"num_steps": 10}}
    current = {"data": {"cache_dir": ""}, "optim": {"lr": 0.2}, "train": {"num_steps": 20}}
    with pytest.raises(ConfigError) as error:
        check_same_run("w", saved, current, "w/config.json", defaults={})
    assert "(data.cache_dir: None -> '', optim.lr: 0.1 -> 0.2; per w/config.json)" in str(error)
    many = {"optim": {f"k{i}": i for i in range(8)}}
    with pytest.raises(ConfigError, match=r"optim.k5: None -> 5 and 2 more; per"):
        check_same_run("w", {}, many, "w/config.json", defaults={})


@pytest.mark.slow
def test_short_jena_run_writes_figures_and_table(tmp_path):
    jena = os.path.join(os.path.dirname(TINY), "jena.py")
    small = {"sweep.seed": (0,), "data.num_train": 32, "train.log_every": 5}
    experiments.run_task(load_config_file(jena, **small, **{"train.num_steps": 20}), str(tmp_path))
    for name in ("loss_by_beta.png", "sigma_by_beta.png", "training.png", "beta_table.csv"):
        assert (tmp_path / name).stat().st_size > 0, name
    rows = (tmp_path / "beta_table.csv").read_text().splitlines()
    assert len(rows) == 1 + 5 and rows[0].startswith("beta_attn,beta_ffn,runs,final_loss")
    assert all("val_loss" in r for r in read_metrics(str(tmp_path)))
    # jena.py deletes fields of the base config (data.dim, ...): resuming must not miss them.
    train.run(load_config_file(jena, **small, **{"train.num_steps": 30}), str(tmp_path))
    assert max(r["step"] for r in read_metrics(str(tmp_path))) == 30


def test_runs_json_records_the_expanded_sweep_with_the_step_sizes_used(tmp_path):
    config = tiny(**{"train.num_steps": 10, "optim.lr_rule": "lambda_max"})
    train.run(config, str(tmp_path))
    runs = json.loads((tmp_path / "runs.json").read_text())
    assert [(r["run"], r["beta_attn"], r["beta_ffn"]) for r in runs] == [
        (0, 0.0, 0.0),
        (1, 0.5, 0.5),
        (2, 1.0, 1.0),
    ]
    first = {r["run"]: r["lr"] for r in read_metrics(str(tmp_path)) if r["step"] == 0}
    assert [r["lr"] for r in runs] == [first[i] for i in range(3)]
    assert len(set(first.values())) == 3  # η = 1/λ_max(K) of each run, not optim.lr


def test_teacher_targets_come_from_a_random_model_of_the_trained_architecture():
    from resconv_jax.data import load_dataset
    from resconv_jax.models import RunSettings, build_model

    config = tiny(**{"data.target": "teacher"})
    dataset = load_dataset(config)
    assert dataset.teacher_seed == config.data.teacher_seed == 1
    model = build_model(config.model, dataset)
    filled = dataset.with_teacher_targets(model, RunSettings())
    teacher = np.asarray(model.apply(model.init(1), dataset.x_train, RunSettings()))
    np.testing.assert_allclose(filled.y_train, teacher / teacher.std(), rtol=1e-6)
    assert filled.teacher_seed is None and abs(float(filled.y_train.std()) - 1) < 1e-6


def test_the_first_chunk_projects_the_programs_wall_time(tmp_path, capsys):
    train.run(tiny(**{"train.num_steps": 20}), str(tmp_path))
    out = capsys.readouterr().out
    assert re.search(r"first 5 steps in \d+\.\d\d s: at that rate the 20 steps of this program "
                     r"take about \d+s", out), out  # fmt: skip


@pytest.mark.slow
def test_a_runs_trajectory_does_not_depend_on_how_often_it_logs_or_probes(tmp_path):
    """Every step is the same compiled loop body, whether it opens a chunk or not, probed or not:
    the same bits at every step that both cadences log. Run as users run it, XLA optimizing
    (the suite compiles at -O0, where the difference below hid): before the probe had a
    forward pass of its own, a chunk's first step ran outside the loop, compiled apart, and 3
    of these 15 float32 runs moved in their last bits with train.log_every."""
    conditioning = os.path.join(os.path.dirname(TINY), "conditioning.py")
    flags = [
        "--config.train.num_steps=40",
        "--config.sweep.dim=(64,)",
        "--config.certificate.every=40",
        "--config.mesh.sweep=1",
        "--config.mesh.data=1",
    ]
    cadences = {
        "log_every_10": ["--config.train.log_every=10", "--config.probe.every=0"],
        "log_every_20": ["--config.train.log_every=20", "--config.probe.every=0"],
        "probe_every_20": ["--config.train.log_every=10", "--config.probe.every=20"],
    }
    env = os.environ | {"XLA_FLAGS": "", "PYTHONPATH": os.path.dirname(os.path.dirname(TINY))}
    logged = {}
    for name, cadence in cadences.items():
        workdir = tmp_path / name
        command = [sys.executable, "-m", "resconv_jax.main", f"--config={conditioning}:small"]
        command += [*flags, *cadence, f"--workdir={workdir}"]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        records = read_metrics(str(workdir))
        logged[name] = {(r["step"], r["run"]): r["loss"] for r in records if r["step"] % 20 == 0}
    assert len(logged["log_every_10"]) == 3 * 15
    assert logged["log_every_10"] == logged["log_every_20"] == logged["probe_every_20"]
