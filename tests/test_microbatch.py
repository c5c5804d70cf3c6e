"""train.microbatch_size: full-batch GD in microbatches is the same GD as the whole batch at once
(metrics, probe and certificate), in one microbatch's memory, with sizes that do not fit refused
in one line naming one that does."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hlo_collectives import collectives_in_loops, largest_collective_elements

from resconv_jax import experiments, sharding, train
from resconv_jax.config_defaults import load_config_file
from resconv_jax.data import load_dataset
from resconv_jax.errors import ConfigError
from resconv_jax.microbatch import Microbatches
from resconv_jax.models import build_model
from resconv_jax.runtime import memory
from resconv_jax.runtime.metrics import read_metrics
from resconv_jax.step import make_optimizer, make_step_functions
from resconv_jax.sweep import expand_runs, run_settings

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "configs")


def config_of(name: str, **overrides):
    defaults = {"train.async_checkpoints": False, "train.checkpoint_every": 1000}
    return load_config_file(os.path.join(CONFIGS, name), **(defaults | overrides))


def metrics_of(config, workdir) -> list[dict]:
    experiments.run_task(config, str(workdir))
    return sorted(read_metrics(str(workdir)), key=lambda r: (r["step"], r["run"]))


def assert_same_metrics(whole: list[dict], parts: list[dict], rtol: float) -> int:
    """Every float of every line equal to `rtol` relative; returns how many were compared.

    Error rates (k/P) to float32's rounding (the whole batch's mean of booleans is float32);
    λ_min and Lanczos residuals relative to λ_max (an eigenvalue is accurate to eps·‖K‖ at best);
    the probe's σ_min in units of the layer's σ_max, κ as 1/κ and σ_min/‖Z‖_F absolutely
    (forwards of different batch shapes round differently, which moves σ_min by ~eps·σ_max: its
    relative error is ~eps·κ however it is computed, 8e-11 in float64 at GPT-2's κ = 3.6e5).
    """
    assert [(r["step"], r["run"]) for r in whole] == [(r["step"], r["run"]) for r in parts]
    compared = 0
    for a, b in zip(whole, parts, strict=True):
        assert a.keys() == b.keys()
        for key, value in a.items():
            if not isinstance(value, float) or not np.isfinite(value):
                continue
            got, scale, tol = b[key], max(abs(value), 1e-300), rtol
            if key.endswith("error"):
                tol = max(rtol, 1e-7)
            if key.startswith(("ntk/residual", "ntk/lambda_min")):
                scale = a["ntk/lambda_max"]
            if key.endswith(("sigma_min", "sample_sigma_min")):
                scale = a[key.rsplit("/", 1)[0] + "/sigma_max"]
            if key.endswith("kappa"):
                value, got, scale = 1 / value, 1 / got, 1.0
            if key.endswith("sigma_min_over_fro"):
                scale = 1.0
            assert abs(got - value) <= tol * scale, (a["step"], a["run"], key, value, got)
            compared += 1
    return compared


@pytest.mark.parametrize("size", [1, 2, 3])
def test_microbatches_count_every_sample_once(size):
    batches = Microbatches(num_samples=10, num_shards=2, requested=size)
    x = jnp.arange(10.0)
    total, seen = 0.0, []
    for k in range(batches.count):
        part, weights = batches.take(x, k), batches.weights(k, jnp.float32)
        total += float(jnp.sum(part * weights))
        seen += [int(v) for v, w in zip(part, weights, strict=True) if w]
    assert total == float(jnp.sum(x)) and sorted(seen) == list(range(10))
    out = jnp.zeros(10)
    for k in range(batches.count):
        out = batches.put(out, k, batches.take(x, k))
    np.testing.assert_array_equal(out, x)


def test_scores_are_the_validation_loss_and_error_of_one_forward_pass():
    """`scores` (what a log step reads the validation loss and error from) gives, from one
    forward pass, the same bits as `evaluate` and `error`, each a forward pass of its own; in
    microbatches of 4, the same errors and losses to rounding."""
    config = config_of(
        "sst2.py",
        **{
            "model.gpt2.weights": "random",
            "sweep.num_layers": (),
            "model.num_layers": 1,
            "sweep.beta": (0.0, 1.0),
            "data.num_train": 8,
            "data.num_val": 5,  # microbatch 2 of 4 re-takes 3 samples, at weight 0
            "data.max_tokens": 8,
        },
    )
    with config.unlocked():
        config.model.gpt2.shape.update(n_embd=16, n_head=2, n_layer=1, n_positions=8)
    dataset = load_dataset(config)
    model = build_model(config.model, dataset)
    runs = expand_runs(config)
    args = (model.init_runs([r.seed for r in runs]), run_settings(runs), dataset.x_val,
            dataset.y_val)  # fmt: skip

    def functions(microbatch_size: int):
        optim = config.optim
        fns = make_step_functions(
            model, make_optimizer(optim), optim.reduction, 1, loss_kind=optim.loss,
            microbatch_size=microbatch_size,
        )  # fmt: skip
        return [jax.jit(f) for f in (fns.scores, fns.evaluate, fns.error)]

    scores, evaluate, error = functions(0)
    loss, wrong = scores(*args)
    assert loss.shape == wrong.shape == (2,) and 0 < float(wrong.max()) < 1
    np.testing.assert_array_equal(loss, evaluate(*args))
    np.testing.assert_array_equal(wrong, error(*args))
    scores, _, error = functions(4)
    parts_loss, parts_wrong = scores(*args)
    np.testing.assert_allclose(parts_loss, loss, rtol=1e-6)
    np.testing.assert_array_equal(parts_wrong, wrong)
    np.testing.assert_array_equal(error(*args), wrong)


@pytest.mark.slow
def test_float64_theory_run_equals_the_whole_batch(tmp_path):
    """P = 10 over 2 'data' shards in microbatches of 3 (5 = 3 + 2: the last one overlaps): every
    metric, the probe's σ and the certificate's λ, to 1e-12 relative."""
    overrides = {
        "model.dtype": "float64",
        "probe.dtype": "float64",
        "data.num_samples": 10,
        "data.dim": 16,
        "train.num_steps": 20,
        "certificate.every": 10,
        "mesh.data": 2,
    }
    with jax.enable_x64(True):
        whole = metrics_of(config_of("tiny.py", **overrides), tmp_path / "whole")
        parts = metrics_of(
            config_of("tiny.py", **overrides, **{"train.microbatch_size": 3}), tmp_path / "parts"
        )
    assert "ntk/lambda_min" in whole[0] and "layer0/z/sigma_min" in whole[0]
    assert assert_same_metrics(whole, parts, 1e-12) > 100


@pytest.mark.slow
def test_float64_random_gpt2_equals_the_whole_batch(tmp_path):
    """The random GPT-2 on 12 SST-2 sentences (2 shards of 6, microbatches of 4): the mean loss,
    errors, the probe over padded tokens, and Lanczos λ of the certificate, to 1e-12."""
    overrides = {
        "model.gpt2.weights": "random",
        "model.dtype": "float64",
        "probe.dtype": "float64",
        "sweep.num_layers": (),
        "model.num_layers": 2,
        "train.num_steps": 4,
        "train.log_every": 2,
        "train.print_every": 2,
        "certificate.every": 2,
        "certificate.max_jacobian_entries": 0,
        "certificate.lanczos_iterations": 24,  # = n: Lanczos gives K's λ exactly
        "data.num_train": 12,
        "data.num_val": 6,
        "data.max_tokens": 8,
        "mesh.data": 2,
    }

    def config(**more):
        config = config_of("sst2.py", **overrides, **more)
        with config.unlocked():
            config.model.gpt2.shape.update(n_embd=16, n_head=2, n_layer=2, n_positions=8)
        return config

    with jax.enable_x64(True):
        whole = metrics_of(config(), tmp_path / "whole")
        parts = metrics_of(config(**{"train.microbatch_size": 4}), tmp_path / "parts")
    assert {"error", "val_error", "ntk/lambda_max", "layer1/z/sigma_min"} <= whole[0].keys()
    assert assert_same_metrics(whole, parts, 1e-12) > 30


@pytest.mark.slow
def test_float32_run_equals_the_whole_batch_to_1e_5(tmp_path):
    """float32, 20 steps (before the β = 0 run's edge-of-stability wobble amplifies rounding)."""
    overrides = {"train.num_steps": 20, "mesh.data": 4}
    whole = metrics_of(config_of("tiny.py", **overrides), tmp_path / "whole")
    parts = metrics_of(
        config_of("tiny.py", **overrides, **{"train.microbatch_size": 1}), tmp_path / "parts"
    )
    assert assert_same_metrics(whole, parts, 1e-5) > 100


def test_the_microbatched_step_moves_no_samples_between_devices():
    """On a 1 x 8 mesh, the largest collective of the microbatched chunk is the gradient's
    all-reduce (the parameters' size), never a microbatch of activations."""
    config = config_of(
        "tiny.py",
        **{"data.num_samples": 64, "train.microbatch_size": 2, "sweep.beta": (), "mesh.data": 8},
    )
    program = train.build_program(config)
    hlo = program.runners.compiled.as_text()
    params = sum(np.size(leaf) for leaf in jax.tree.leaves(program.state["params"]))
    activations = 2 * 8 * 4 * 32  # one microbatch of Z: (S·n, M, d)
    assert largest_collective_elements(hlo) <= max(params, 32 * 32)
    assert params < activations * 8  # the bound above would catch a gathered batch


def test_the_gradient_is_all_reduced_once_per_step_not_once_per_microbatch():
    """On a 1 x 8 mesh, 4 microbatches per shard: each device sums its shard's gradient over the
    microbatches, and the one all-reduce follows the loop (a pod pays one per step)."""
    config = config_of(
        "tiny.py",
        **{"data.num_samples": 64, "train.microbatch_size": 2, "sweep.beta": (), "mesh.data": 8,
           "probe.enabled": False},
    )  # fmt: skip
    program = train.build_program(config)
    assert "(4 per step)" in program.runners.memory_description(program.y.sharding.mesh)
    hlo = program.runners.compiled.as_text()
    assert '"known_trip_count":{"n":"4"}' in hlo  # the microbatch loops are there
    assert collectives_in_loops(hlo, 4) == []
    assert " all-reduce" in hlo


@pytest.mark.slow
def test_a_step_that_does_not_fit_names_a_microbatch_size_that_does(monkeypatch):
    config = config_of("tiny.py", **{"data.num_samples": 64, "sweep.beta": ()})
    whole = train.build_program(config).runners.compiled
    _, need, _ = memory.compiled_need(whole, sharding.make_mesh(1, 64, config.mesh))
    monkeypatch.setattr(memory, "host_available_bytes", lambda: need - 1)
    with pytest.raises(ConfigError, match=r"train\.microbatch_size=\d+ .*would fit") as error:
        train.build_program(config)
    size = int(str(error.value).split("train.microbatch_size=")[1].split()[0])
    assert 1 <= size < 64
    with config.unlocked():
        config.train.microbatch_size = "auto"
    program = train.build_program(config)
    assert 1 <= program.runners.microbatch_size < 64
    assert "microbatches of" in program.runners.memory_description(program.y.sharding.mesh)


@pytest.mark.parametrize("value", [-1, "big", 1.5, True])
def test_a_bad_microbatch_size_is_refused(value):
    with pytest.raises(ConfigError, match="microbatch_size"):
        train.run(config_of("tiny.py", **{"train.microbatch_size": value}), "/tmp/unused")
