"""The model against an independent NumPy implementation of the paper's equations; one GD step."""

import dataclasses
import math
import os
import subprocess
import sys

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from resconv_jax.config_defaults import base_config
from resconv_jax.models import RunSettings, fast_ops, transformer
from resconv_jax.step import init_opt_state, make_optimizer, make_step_functions

NUMPY_ACTIVATIONS = {
    "relu": lambda u: np.maximum(u, 0),
    "gelu": lambda u: 0.5 * u * (1 + np.vectorize(math.erf)(u / math.sqrt(2))),
    "softplus": lambda u: np.log1p(np.exp(-np.abs(u))) + np.maximum(u, 0),
    "identity": lambda u: u,
}


def numpy_forward(
    params: dict, x: np.ndarray, beta_a: float, beta_f: float, activation: str = "relu"
) -> np.ndarray:
    """F(X) per sample, written from paper.md with loops over samples, in float64."""
    sigma = NUMPY_ACTIVATIONS[activation]
    outputs = []
    for x_p in x.astype(np.float64):
        h = x_p
        for i in range(len(params["blocks"])):
            w = {k: np.asarray(v, np.float64) for k, v in params["blocks"][i].items()}
            logits = h @ w["w_q"] @ w["w_k"].T @ h.T / np.sqrt(w["w_q"].shape[1])
            s = np.exp(logits - logits.max(axis=1, keepdims=True))
            s /= s.sum(axis=1, keepdims=True)
            z = s @ h @ w["w_v"] + beta_a * h
            h = sigma(z @ w["w_1"]) @ w["w_2"] + beta_f * z
        outputs.append(h @ np.asarray(params["w_u"], np.float64))
    return np.stack(outputs)


@pytest.mark.parametrize("num_layers", [1, 2])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_forward_matches_numpy(num_layers, beta):
    cfg = transformer.ModelConfig(d=6, d_qk=3, d_h=10, d_y=2, num_layers=num_layers)
    graphdef, params = transformer.init_params(cfg, seed=3)
    x = np.random.default_rng(0).standard_normal((4, 5, 6)).astype(np.float32)
    out = transformer.apply(graphdef, params, jnp.asarray(x), beta, 0.7 * beta)
    expected = numpy_forward(jax.tree.map(np.asarray, params), x, beta, 0.7 * beta)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("activation", ["gelu", "softplus", "identity"])
def test_smooth_and_linear_activations_match_numpy(activation):
    cfg = transformer.ModelConfig(d=6, d_qk=3, d_h=10, d_y=2, num_layers=2, activation=activation)
    graphdef, params = transformer.init_params(cfg, seed=3)
    x = np.random.default_rng(0).standard_normal((4, 5, 6)).astype(np.float32)
    out = transformer.apply(graphdef, params, jnp.asarray(x), 0.5, 1.0)
    expected = numpy_forward(jax.tree.map(np.asarray, params), x, 0.5, 1.0, activation)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=2e-5, atol=2e-5)
    relu = transformer.apply(
        *transformer.init_params(dataclasses.replace(cfg, activation="relu"), 3), x, 0.5, 1.0
    )
    assert not np.allclose(np.asarray(out), np.asarray(relu))  # the activation is really used


@pytest.mark.slow
@pytest.mark.parametrize("activation", ["gelu", "softplus"])
def test_smooth_activation_gradients_match_finite_differences(activation):
    with jax.enable_x64(True):
        cfg = transformer.ModelConfig(
            d=3, d_qk=2, d_h=4, d_y=1, num_layers=2, activation=activation, dtype="float64"
        )
        model = transformer.make_model(cfg)
        params = model.init(1)
        rng = np.random.default_rng(0)
        x, y = jnp.asarray(rng.standard_normal((2, 3, 3))), rng.standard_normal((2, 3, 1))
        flat, unravel = jax.flatten_util.ravel_pytree(params)

        def loss(v, fast=False):
            out = transformer.apply(model.graphdef, unravel(v), x, 0.5, 1.0, fast_backward=fast)
            return 0.5 * jnp.sum((out - y) ** 2)

        eps, basis = 1e-6, np.eye(flat.size)
        grad_fd = np.array([(loss(flat + eps * e) - loss(flat - eps * e)) / 2 / eps for e in basis])
        np.testing.assert_allclose(jax.grad(loss)(flat), grad_fd, rtol=1e-6, atol=1e-8)
        fast = jax.grad(lambda v: loss(v, fast=True))(flat)  # the trainer's backward pass
        np.testing.assert_allclose(fast, grad_fd, rtol=1e-6, atol=1e-8)


def test_intermediates_are_attn_and_z_from_the_same_pass():
    cfg = transformer.ModelConfig(d=4, d_qk=2, d_h=8, d_y=1, num_layers=2)
    graphdef, params = transformer.init_params(cfg, seed=0)
    x = jax.random.normal(jax.random.key(1), (3, 5, 4))
    out, inter = transformer.apply(graphdef, params, x, 0.5, 1.0, return_intermediates=True)
    assert inter["attn"].shape == inter["z"].shape == (2, 3, 5, 4)
    np.testing.assert_allclose(inter["z"][0], inter["attn"][0] + 0.5 * x, rtol=1e-6)
    np.testing.assert_array_equal(out, transformer.apply(graphdef, params, x, 0.5, 1.0))


def test_same_seed_same_weights_and_qk_init_variance():
    cfg = transformer.ModelConfig(d=64, d_qk=1024, d_h=8, d_y=1, qk_init="1/d_qk")
    _, a = transformer.init_params(cfg, seed=7)
    _, b = transformer.init_params(cfg, seed=7)
    jax.tree.map(np.testing.assert_array_equal, a, b)
    assert np.var(a["blocks"][0]["w_q"]) == pytest.approx(1 / 1024, rel=0.05)
    cfg_d = transformer.ModelConfig(d=64, d_qk=1024, d_h=8, d_y=1, qk_init="1/d")
    _, c = transformer.init_params(cfg_d, seed=7)
    assert np.var(c["blocks"][0]["w_q"]) == pytest.approx(1 / 64, rel=0.05)


@pytest.mark.slow
def test_gd_step_is_params_minus_lr_grad_with_finite_difference_gradient():
    with jax.enable_x64(True):
        cfg = transformer.ModelConfig(d=3, d_qk=2, d_h=4, d_y=1, num_layers=2)
        graphdef, params = transformer.init_params(cfg, seed=1)
        params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), params)
        rng = np.random.default_rng(0)
        x = jnp.asarray(rng.standard_normal((2, 3, 3)))
        y = jnp.asarray(rng.standard_normal((2, 3, 1)))
        optim = base_config().optim
        optim.lr = 0.05
        optimizer = make_optimizer(optim)
        fns = make_step_functions(transformer.make_model(cfg), optimizer, "sum", steps_per_call=1)
        hp = RunSettings(jnp.asarray([0.5]), jnp.asarray([1.0]))
        stacked = jax.tree.map(lambda a: a[None], params)
        state = {
            "params": stacked,
            "opt_state": init_opt_state(optimizer, stacked, jnp.asarray([0.05])),
        }
        new_state, metrics, _ = fns.step(state, hp, x, y)

        flat, unravel = jax.flatten_util.ravel_pytree(params)
        hp_one = jax.tree.map(lambda v: v[0], hp)
        loss = jax.jit(lambda v: fns.loss(unravel(v), hp_one, x, y))
        eps = 1e-6
        basis = np.eye(flat.size)
        grad_fd = np.array(
            [(loss(flat + eps * e) - loss(flat - eps * e)) / (2 * eps) for e in basis]
        )
        grad = jax.flatten_util.ravel_pytree(jax.grad(fns.loss)(params, hp_one, x, y))[0]
        np.testing.assert_allclose(grad, grad_fd, rtol=1e-6, atol=1e-8)
        new_flat = jax.flatten_util.ravel_pytree(jax.tree.map(lambda a: a[0], new_state["params"]))
        np.testing.assert_allclose(new_flat[0], flat - 0.05 * grad, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(metrics["loss"][0], loss(flat), rtol=1e-12)
        np.testing.assert_allclose(metrics["grad_norm"][0], optax.tree.norm(grad), rtol=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("num_layers", [1, 2])
def test_fast_backward_gives_the_plain_gradients_vmapped_or_not(num_layers):
    cfg = transformer.ModelConfig(d=6, d_qk=4, d_h=12, d_y=2, num_layers=num_layers)
    seeds = (0, 1, 2)
    params = [transformer.init_params(cfg, seed)[1] for seed in seeds]
    graphdef = transformer.init_params(cfg, 0)[0]
    stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *params)
    betas = jnp.asarray([0.0, 0.5, 1.0])
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((5, 7, 6)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((5, 7, 2)), jnp.float32)

    def loss(p, beta, fast):
        out = transformer.apply(graphdef, p, x, beta, beta, fast_backward=fast)
        return 0.5 * jnp.sum((out - y) ** 2)

    for fast_grad, plain_grad in (
        (jax.grad(loss)(params[1], 0.5, True), jax.grad(loss)(params[1], 0.5, False)),
        (
            jax.vmap(jax.grad(loss), in_axes=(0, 0, None))(stacked, betas, True),
            jax.vmap(jax.grad(loss), in_axes=(0, 0, None))(stacked, betas, False),
        ),
    ):
        fast_flat = jax.flatten_util.ravel_pytree(fast_grad)[0]
        plain_flat = jax.flatten_util.ravel_pytree(plain_grad)[0]
        scale = float(jnp.max(jnp.abs(plain_flat)))
        np.testing.assert_allclose(fast_flat, plain_flat, rtol=1e-5, atol=1e-6 * scale)


@pytest.mark.slow
def test_fast_backward_is_reverse_mode_only_and_softmax_matches():
    cfg = transformer.ModelConfig(d=4, d_qk=2, d_h=8, d_y=1)
    graphdef, params = transformer.init_params(cfg, seed=0)
    x = jax.random.normal(jax.random.key(1), (3, 5, 4))
    fast = transformer.apply(graphdef, params, x, 1.0, 1.0, fast_backward=True)
    np.testing.assert_allclose(fast, transformer.apply(graphdef, params, x, 1.0, 1.0), rtol=1e-6)
    with pytest.raises(TypeError, match="custom_vjp"):
        jax.jacfwd(lambda p: transformer.apply(graphdef, p, x, 1.0, 1.0, fast_backward=True))(
            params
        )
    logits = 10 * jax.random.normal(jax.random.key(2), (4, 6, 6))
    np.testing.assert_allclose(
        fast_ops.softmax_rows(logits), jax.nn.softmax(logits, axis=-1), rtol=1e-6, atol=1e-7
    )
    tangent = jax.random.normal(jax.random.key(3), logits.shape)
    jvp_fast = jax.jvp(fast_ops.softmax_rows, (logits,), (tangent,))[1]
    jvp_plain = jax.jvp(lambda a: jax.nn.softmax(a, axis=-1), (logits,), (tangent,))[1]
    np.testing.assert_allclose(jvp_fast, jvp_plain, rtol=1e-5, atol=1e-6)


NARROW_PRODUCTS = [
    ((2, 16, 24, 24), (2, 16, 24, 6)),
    ((16, 24, 24), (16, 24, 6)),
    ((5, 7, 7), (5, 7, 4)),
]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shape_a, shape_b", NARROW_PRODUCTS)
def test_a_narrow_batched_product_is_transposed_only_when_asked_and_is_the_same_product(
    dtype, shape_a, shape_b
):
    """(..., m, k)(..., k, n) with n < m: as written by default; through (bᵀ aᵀ)ᵀ with
    `products(transpose_narrow=True)`, the same sums within rounding (bitwise on some CPUs only:
    an AVX-512 Intel Xeon adds the 24 terms in another order)."""
    rng = np.random.default_rng(0)
    with jax.enable_x64(dtype == "float64"):
        a, b = (jnp.asarray(rng.standard_normal(s), dtype) for s in (shape_a, shape_b))
        as_written, transposing = fast_ops.products()[0], fast_ops.products(True)[0]
        assert "optimization_barrier" not in str(jax.make_jaxpr(as_written)(a, b))
        assert "optimization_barrier" in str(jax.make_jaxpr(transposing)(a, b))
        wide = jnp.swapaxes(b, -1, -2)  # (..., n, k)(..., k, m): not transposed
        assert "optimization_barrier" not in str(jax.make_jaxpr(transposing)(wide, a))
        direct = jax.jit(jnp.matmul)(a, b)
        np.testing.assert_array_equal(jax.jit(as_written)(a, b), direct)
        # a k-term sum in another order: |error| <= k·eps·(|a| |b|), entry by entry
        bound = shape_a[-1] * jnp.finfo(dtype).eps * (jnp.abs(a) @ jnp.abs(b))
        assert np.all(np.abs(jax.jit(transposing)(a, b) - direct) <= bound)


def _three_jena_width_steps(transpose_narrow: bool) -> list[jax.Array]:
    """Two runs' parameters after three vmapped GD steps at M = 24, d = d_QK = 6 (configs/jena.py's
    widths) through `fast_ops`, its narrow products transposed or not."""
    cfg = transformer.ModelConfig(
        d=6, d_qk=6, d_h=32, d_y=1, transpose_narrow_products=transpose_narrow
    )
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((16, 24, 6)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((16, 24, 1)), jnp.float32)
    graphdef = transformer.init_params(cfg, 0)[0]
    stacked = jax.tree.map(
        lambda *leaves: jnp.stack(leaves), *(transformer.init_params(cfg, s)[1] for s in (0, 1))
    )

    def three_steps(params):
        def loss(p):
            out = transformer.apply(graphdef, p, x, 0.5, 0.5, fast_backward=True)
            return 0.5 * jnp.sum((out - y) ** 2)

        for _ in range(3):
            params = jax.tree.map(lambda w, g: w - 1e-3 * g, params, jax.grad(loss)(params))
        return params

    return jax.tree.leaves(jax.jit(jax.vmap(three_steps))(stacked))


def test_the_transposed_products_change_a_jena_size_gd_step_only_within_rounding():
    """The same three GD steps with the narrow products transposed and as written (the default):
    equal to float32 rounding (a 1e-4 error in the transposed product fails this)."""
    as_written = _three_jena_width_steps(False)
    for got, expected in zip(_three_jena_width_steps(True), as_written, strict=True):
        scale = float(np.max(np.abs(expected)))
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6 * scale)


def test_the_config_switch_transposes_the_gradient_products_of_the_built_model():
    """config.model.transformer.transpose_narrow_products reaches the model's training loss:
    its gradient has more transposed copies (optimization barriers) than the default's."""
    x = jnp.zeros((4, 24, 6))

    def barriers(switch: bool) -> int:
        model_cfg = base_config().model
        model_cfg.transformer.transpose_narrow_products = switch
        model = transformer.make_model(transformer.model_config(model_cfg, d=6, d_y=1))
        params = model.init(0)

        def loss(p):
            return jnp.sum(model.apply_for_grad(p, x, RunSettings(1.0, 1.0)))

        return str(jax.make_jaxpr(jax.grad(loss))(params)).count("optimization_barrier")

    assert barriers(True) > barriers(False) > 0


EVALUATION_AGAINST_THE_PLAIN_FORWARD = """
import jax, jax.numpy as jnp, numpy as np
from resconv_jax.config_defaults import base_config
from resconv_jax.models import RunSettings, transformer
from resconv_jax.step import make_optimizer, make_step_functions

# the narrow products transposed: a gradient formulation that evaluate must not run
model = transformer.make_model(
    transformer.ModelConfig(d=6, d_qk=6, d_h=32, d_y=1, transpose_narrow_products=True)
)
fns = make_step_functions(model, make_optimizer(base_config().optim), "sum", 1)
rng = np.random.default_rng(1)
x = jnp.asarray(rng.standard_normal((100, 24, 6)), jnp.float32)
y = jnp.asarray(rng.standard_normal((100, 24, 1)), jnp.float32)
params = model.init_runs(range(15))
betas = jnp.tile(jnp.asarray([0.0, 0.25, 0.5, 0.75, 1.0]), 3)
hp = RunSettings(betas, betas)
plain = jax.jit(jax.vmap(lambda p, h: 0.5 * jnp.sum((model.apply(p, x, h) - y) ** 2)))(params, hp)
print(int(np.sum(np.asarray(jax.jit(fns.evaluate)(params, hp, x, y)) != np.asarray(plain))))
"""


@pytest.mark.slow
def test_evaluation_is_the_model_as_written_not_its_gradient_formulation():
    """`evaluate` (the validation loss, a run's final loss) takes no gradient: it runs the plain
    forward pass, so no formulation of `fast_ops` (`transpose_narrow_products`) changes its bits.
    At XLA's default optimization (a subprocess: the tests compile at -O0), 15 runs at P = 100
    (configs/jena.py's widths) gave one differing loss through the transposed forward pass."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    result = subprocess.run([sys.executable, "-c", EVALUATION_AGAINST_THE_PLAIN_FORWARD],
                            capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["0"]  # losses that differ from the plain forward's
