"""The paper's Transformer: single-head softmax attention and an MLP, with scaled residuals.

For one sample X (M tokens × width d), block l computes (no biases, no LayerNorm, no mask):

    S    = softmax_rows(X W_Q W_Kᵀ Xᵀ / sqrt(d_QK))       (M × M)
    A    = S X W_V                                        Attn(X), (M × d)
    Z    = A + β_a X                                      attention output matrix
    H    = σ(Z W_1) W_2 + β_f Z

with σ = `ModelConfig.activation`: relu (the paper's), or a smooth one, gelu (exact, erf) or
softplus, as the paper's Assumption 1 (a Lipschitz derivative) asks, or the identity (a linear
control). A stack of L blocks is read out by one head, F = H^{(L)} W_U (M × d_y).

The residual coefficients β_a, β_f are call arguments, not parameters: a sweep over β runs one
program whose runs share the parameter structure, and the same seed gives the same weights for
every β.

`config.model.name = "transformer"`; its own fields are `config.model.transformer.*`
(`default_config`), its depth and dtype the shared `config.model.num_layers`, `.dtype`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from resconv_jax.errors import ConfigError
from resconv_jax.models.fast_ops import plain_matmul_nt, products, softmax_rows
from resconv_jax.models.interface import Model, RunSettings
from resconv_jax.runtime import memory

NAME = __name__.rpartition(".")[2]  # this model's name and its config section
QK_INITS = ("1/d", "1/d_qk")


def default_config() -> ml_collections.ConfigDict:
    """This model's own fields: `config.model.transformer.*`."""
    c = ml_collections.ConfigDict()
    c.d_qk = 8  # query/key width d_QK
    c.d_h = 32  # MLP hidden width d_h
    c.qk_init = "1/d"  # W_Q, W_K entry variance: "1/d" or "1/d_qk" (times qk_scale²)
    c.qk_scale = 1.0  # init scale of W_Q, W_K
    c.v_scale = 1.0  # init scale of W_V (variance scale²/d)
    c.mlp_scale = 1.0  # init scale of W_1 (scale²/d), W_2 (scale²/d_h)
    c.head_scale = 1.0  # init scale of W_U (scale²/d)
    # σ of the MLP: relu (the paper's), gelu, softplus (smooth: Assumption 1), identity (a linear
    # control)
    c.activation = "relu"
    # Gradients through custom-VJP products (`fast_ops`: canonical backward dots, the same
    # gradients, faster on XLA:CPU); False: plain autodiff, for comparisons.
    c.fast_backward = True
    # With fast_backward: the narrow batched products (S·V, ∂logits·K when d < M) computed
    # transposed, (bᵀaᵀ)ᵀ: faster on some CPUs, equal within rounding, bitwise only on some
    # (`fast_ops`); False: every product as written.
    c.transpose_narrow_products = False
    return c


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Sizes and initialization of the Transformer.

    Each weight has Gaussian entries of variance `scale² / fan_in`, with one scale per group;
    W_Q and W_K use fan_in = d (`qk_init="1/d"`) or d_QK (`qk_init="1/d_qk"`).
    """

    d: int  # embedding width
    d_qk: int  # query/key width
    d_h: int  # MLP hidden width
    d_y: int  # output width
    num_layers: int = 1
    qk_init: Literal["1/d", "1/d_qk"] = "1/d"
    qk_scale: float = 1.0
    v_scale: float = 1.0
    mlp_scale: float = 1.0
    head_scale: float = 1.0
    dtype: Literal["float32", "float64"] = "float32"  # of the weights (float64 needs x64)
    activation: Literal["relu", "gelu", "softplus", "identity"] = "relu"  # σ of the MLP
    transpose_narrow_products: bool = False  # `fast_ops.products(transpose_narrow=...)`


ACTIVATIONS = {
    "relu": jax.nn.relu,
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "softplus": jax.nn.softplus,
    "identity": lambda u: u,
}


def model_config(model_cfg, *, d: int, d_y: int) -> ModelConfig:
    """`ModelConfig` from the `config.model` section, with widths d and d_y taken from the data."""
    own = model_cfg[NAME]
    return ModelConfig(
        d=d,
        d_qk=own.d_qk,
        d_h=own.d_h,
        d_y=d_y,
        num_layers=model_cfg.num_layers,
        qk_init=own.qk_init,
        qk_scale=own.qk_scale,
        v_scale=own.v_scale,
        mlp_scale=own.mlp_scale,
        head_scale=own.head_scale,
        dtype=model_cfg.dtype,
        activation=own.activation,
        transpose_narrow_products=own.transpose_narrow_products,
    )


def validate(model_cfg) -> None:
    """ConfigError (one line) for the first field of `config.model.transformer` it cannot run."""
    own = model_cfg[NAME]
    for field, allowed in (("qk_init", QK_INITS), ("activation", tuple(ACTIVATIONS))):
        if own[field] not in allowed:
            raise ConfigError(
                f"config.model.{NAME}.{field}={own[field]!r}: expected one of {', '.join(allowed)}"
            )
    if not isinstance(own.transpose_narrow_products, bool):
        raise ConfigError(
            f"config.model.{NAME}.transpose_narrow_products={own.transpose_narrow_products!r}: "
            "expected True or False"
        )
    for field in ("d_qk", "d_h"):
        value = own[field]
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"config.model.{NAME}.{field}={value!r}: expected an integer >= 1")
        if value < 1:
            raise ConfigError(f"config.model.{NAME}.{field}={value}: must be positive")


def _gaussian(
    key: jax.Array, shape: tuple[int, int], scale: float, fan_in: int, dtype: str
) -> nnx.Param:
    """(shape) weights of variance scale²/fan_in, drawn in float32 whatever `dtype`, so that a
    seed gives the same weights in float32 and in float64."""
    weights = scale * jax.random.normal(key, shape, jnp.float32) / jnp.sqrt(jnp.float32(fan_in))
    return nnx.Param(weights.astype(dtype))


class Block(nnx.Module):
    """One attention + MLP block with residual coefficients β_a and β_f."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        qk_fan_in = cfg.d if cfg.qk_init == "1/d" else cfg.d_qk
        gaussian = functools.partial(_gaussian, dtype=cfg.dtype)
        self.w_q = gaussian(rngs.params(), (cfg.d, cfg.d_qk), cfg.qk_scale, qk_fan_in)
        self.w_k = gaussian(rngs.params(), (cfg.d, cfg.d_qk), cfg.qk_scale, qk_fan_in)
        self.w_v = gaussian(rngs.params(), (cfg.d, cfg.d), cfg.v_scale, cfg.d)
        self.w_1 = gaussian(rngs.params(), (cfg.d, cfg.d_h), cfg.mlp_scale, cfg.d)
        self.w_2 = gaussian(rngs.params(), (cfg.d_h, cfg.d), cfg.mlp_scale, cfg.d_h)
        self.activation = cfg.activation
        self.transpose_narrow_products = cfg.transpose_narrow_products

    def attention(self, x: jax.Array, *, fast_backward: bool = False) -> jax.Array:
        """Attn(X) for a batch: (P, M, d) -> (P, M, d). See `Transformer` for `fast_backward`."""
        mm, mm_nt = (jnp.matmul, plain_matmul_nt)
        if fast_backward:
            mm, mm_nt = products(self.transpose_narrow_products)
        w_q, w_k, w_v = self.w_q[...], self.w_k[...], self.w_v[...]
        d_qk = w_q.shape[1]
        qkv = mm(x, jnp.concatenate([w_q, w_k, w_v], axis=1))  # one pass over x for Q, K, V
        q, k, v = qkv[..., :d_qk], qkv[..., d_qk : 2 * d_qk], qkv[..., 2 * d_qk :]
        logits = mm_nt(q, k) / jnp.sqrt(d_qk).astype(q.dtype)
        return mm(softmax_rows(logits), v)

    def __call__(
        self,
        x: jax.Array,
        beta_attn: jax.Array,
        beta_ffn: jax.Array,
        *,
        fast_backward: bool = False,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(P, M, d) -> (H, Attn(X), Z), each (P, M, d)."""
        mm = products(self.transpose_narrow_products)[0] if fast_backward else jnp.matmul
        attn = self.attention(x, fast_backward=fast_backward)
        z = attn + beta_attn * x
        sigma = ACTIVATIONS[self.activation]
        h = mm(sigma(mm(z, self.w_1[...])), self.w_2[...]) + beta_ffn * z
        return h, attn, z


class Transformer(nnx.Module):
    """L blocks under one linear head W_U (d × d_y)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.w_u = _gaussian(rngs.params(), (cfg.d, cfg.d_y), cfg.head_scale, cfg.d, cfg.dtype)

    def __call__(
        self,
        x: jax.Array,
        beta_attn: jax.Array | float = 1.0,
        beta_ffn: jax.Array | float = 1.0,
        *,
        return_intermediates: bool = False,
        fast_backward: bool = False,
    ) -> jax.Array | tuple[jax.Array, dict[str, jax.Array]]:
        """F(X) for a batch: (P, M, d) -> (P, M, d_y).

        With `return_intermediates`, also returns {"attn": Attn(X), "z": Z}, each stacked over
        layers as (L, P, M, d), from the same forward pass. With `fast_backward`, the products
        use `fast_ops`, whose backward pass is canonical dots (faster on XLA:CPU, above all under
        vmap over runs); reverse mode only: jax.jvp / jax.jacfwd through it raise.
        """
        attns, zs = [], []
        h = x
        for block in self.blocks:
            h, attn, z = block(h, beta_attn, beta_ffn, fast_backward=fast_backward)
            attns.append(attn)
            zs.append(z)
        out = h @ self.w_u[...]
        if return_intermediates:
            return out, {"attn": jnp.stack(attns), "z": jnp.stack(zs)}
        return out


def init_params(cfg: ModelConfig, seed: int) -> tuple[nnx.GraphDef, dict]:
    """The model's graph definition and its parameters as a plain nested dict, for `seed`."""
    graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(params=seed)))
    return graphdef, nnx.to_pure_dict(state)


def apply(graphdef: nnx.GraphDef, params: dict, x: jax.Array, beta_attn, beta_ffn, **kwargs):
    """Pure forward pass of `Transformer.__call__` from a parameter dict."""
    return nnx.merge(graphdef, params)(x, beta_attn, beta_ffn, **kwargs)


def _forward(graphdef, params, x, settings: RunSettings, **kwargs):
    """`apply` with the run's settings as the interface passes them (`Model.forward`)."""
    return apply(graphdef, params, x, *settings, **kwargs)


def make_model(cfg: ModelConfig, *, fast_backward: bool = True) -> Model:
    """The paper's Transformer behind the trainer's `Model` interface; `fast_backward`: its
    gradients through `fast_ops` (`Model.forward_for_grad`)."""
    graphdef, _ = init_params(cfg, 0)
    return Model(
        graphdef=graphdef,
        forward=_forward,
        forward_for_grad=functools.partial(_forward, fast_backward=True) if fast_backward else None,
        init=lambda seed: init_params(cfg, seed)[1],
        description=(
            f"Transformer: {cfg.num_layers} block(s), d={cfg.d}, d_qk={cfg.d_qk}, d_h={cfg.d_h}"
            + ("" if cfg.activation == "relu" else f", {cfg.activation} MLP")
        ),
    )


def build(model_cfg, dataset) -> Model:
    """The Transformer of `config.model` for `dataset`'s widths: d of its inputs (P, M, d), d_y of
    its targets (P, M, d_y)."""
    d, d_y = dataset.x_train.shape[-1], dataset.y_train.shape[-1]
    cfg = model_config(model_cfg, d=d, d_y=d_y)
    return make_model(cfg, fast_backward=model_cfg[NAME].fast_backward)


def parameter_and_activation_bytes(
    model_cfg, *, num_samples: int, seq_len: int, d: int, d_y: int, num_layers: int, runs: int
) -> tuple[int, int]:
    """(parameter bytes of every run, activation bytes of one run's step), from the shapes:
    L·(2·d·d_QK + d² + 2·d·d_h) + d·d_y weights per run, and per sample and layer the
    M·(4d + 2d_QK + 2M + 2d_h) values its backward keeps. Lower bounds."""
    itemsize = 8 if model_cfg.dtype == "float64" else 4
    d_qk, d_h = model_cfg[NAME].d_qk, model_cfg[NAME].d_h
    weights = num_layers * (2 * d * d_qk + d * d + 2 * d * d_h) + d * d_y
    kept = num_samples * seq_len * num_layers * (4 * d + 2 * d_qk + 2 * seq_len + 2 * d_h)
    return itemsize * weights * runs, itemsize * kept


def check_size(model_cfg, **shapes) -> None:
    """ConfigError, from the shapes alone (`parameter_and_activation_bytes`), when the weights
    and gradients with one run's activations cannot fit (`memory.check_fits`)."""
    own = model_cfg[NAME]
    sizes = ", ".join(f"{k}={v}" for k, v in shapes.items())
    memory.check_fits(
        f"the Transformer ({sizes}, d_qk={own.d_qk}, d_h={own.d_h})",
        *parameter_and_activation_bytes(model_cfg, **shapes),
    )
