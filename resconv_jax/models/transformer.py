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
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from resconv_jax.models.fast_ops import matmul, matmul_nt, plain_matmul_nt, softmax_rows
from resconv_jax.models.interface import Model


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


ACTIVATIONS = {
    "relu": jax.nn.relu,
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "softplus": jax.nn.softplus,
    "identity": lambda u: u,
}


def model_config(model_cfg, *, d: int, d_y: int) -> ModelConfig:
    """`ModelConfig` from the `config.model` section, with widths d and d_y taken from the data."""
    return ModelConfig(
        d=d,
        d_qk=model_cfg.d_qk,
        d_h=model_cfg.d_h,
        d_y=d_y,
        num_layers=model_cfg.num_layers,
        qk_init=model_cfg.qk_init,
        qk_scale=model_cfg.qk_scale,
        v_scale=model_cfg.v_scale,
        mlp_scale=model_cfg.mlp_scale,
        head_scale=model_cfg.head_scale,
        dtype=model_cfg.dtype,
        activation=model_cfg.get("activation", "relu"),
    )


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

    def attention(self, x: jax.Array, *, fast_backward: bool = False) -> jax.Array:
        """Attn(X) for a batch: (P, M, d) -> (P, M, d). See `Transformer` for `fast_backward`."""
        mm, mm_nt = (matmul, matmul_nt) if fast_backward else (jnp.matmul, plain_matmul_nt)
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
        mm = matmul if fast_backward else jnp.matmul
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


def make_model(cfg: ModelConfig) -> Model:
    """The paper's Transformer behind the trainer's `Model` interface."""
    graphdef, _ = init_params(cfg, 0)
    return Model(
        graphdef=graphdef,
        forward=apply,
        init=lambda seed: init_params(cfg, seed)[1],
        description=(
            f"Transformer: {cfg.num_layers} block(s), d={cfg.d}, d_qk={cfg.d_qk}, d_h={cfg.d_h}"
            + ("" if cfg.activation == "relu" else f", {cfg.activation} MLP")
        ),
        fast_backward=True,
    )
