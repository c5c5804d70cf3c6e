"""The probe's forward pass: the same Attn(X) and Z, bit for bit, as the step's loss computes."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from resconv_jax import train
from resconv_jax.config_defaults import load_config_file
from resconv_jax.data import load_dataset
from resconv_jax.models import build_model
from resconv_jax.step import _masked, make_optimizer, make_step_functions
from resconv_jax.sweep import expand_runs, run_settings

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "configs")
SMALL_GPT2 = {
    "model.gpt2.weights": "random",
    "sweep.num_layers": (),
    "model.num_layers": 2,
    "sweep.beta": (0.0, 1.0),
    "data.num_train": 8,
    "data.max_tokens": 8,
}


def bit_fingerprint(attn, z):
    """{name: (R, L)}: the wrapping int32 sum of each layer's (P, M, d) float32 bit patterns, as
    its low and high 16 bits (floats that hold them exactly). Any changed bit changes the sum
    (but for collisions), whatever the order of summation."""

    def halves(name, a):
        bits = jax.lax.bitcast_convert_type(a, jnp.int32).sum(axis=(2, 3, 4), dtype=jnp.int32)
        return {f"{name}/bits_low": bits & 0xFFFF, f"{name}/bits_high": (bits >> 16) & 0xFFFF}

    return halves("attn", attn) | halves("z", z)


def problem(name: str, overrides: dict):
    config = load_config_file(os.path.join(CONFIGS, name), **overrides)
    if name == "sst2.py":
        with config.unlocked():
            config.model.gpt2.shape.update(n_embd=16, n_head=2, n_layer=2, n_positions=8)
    dataset = load_dataset(config)
    model = build_model(config.model, dataset)
    runs = expand_runs(config)
    optimizer = make_optimizer(config.optim)
    state = train.initial_state(model, runs, optimizer)
    fns = make_step_functions(
        model, optimizer, config.optim.reduction, 3, probe=bit_fingerprint,
        loss_kind=config.optim.loss,
    )  # fmt: skip
    return fns, state, run_settings(runs), dataset.x_train, dataset.y_train


@pytest.mark.parametrize(
    "name, overrides",
    [
        pytest.param("tiny.py", {}, id="transformer"),
        pytest.param("sst2.py", SMALL_GPT2, id="gpt2", marks=pytest.mark.slow),
    ],
)
def test_the_probed_forward_pass_is_the_steps_own_bit_for_bit(name, overrides):
    fns, state, hp, x, y = problem(name, overrides)
    _, _, inter = jax.jit(fns.step)(state, hp, x, y)
    want = bit_fingerprint(*_masked(inter))
    run_steps = jax.jit(fns.run_steps)
    probed_state, probed = run_steps(state, hp, x, y, jnp.int32(3), jnp.bool_(True))
    plain_state, plain = run_steps(state, hp, x, y, jnp.int32(3), jnp.bool_(False))
    for key, values in want.items():
        np.testing.assert_array_equal(probed[key][0], values, err_msg=key)
        assert np.isnan(plain[key]).all(), key
    assert np.asarray(want["z/bits_low"]).any()  # the fingerprint is not trivially zero
    np.testing.assert_array_equal(probed["loss"], plain["loss"])
    jax.tree.map(np.testing.assert_array_equal, probed_state, plain_state)
