"""GPT-2 as Hugging Face computes it, truncated to its first L blocks, with a classification head.

For token ids (P, T) and a mask (P, T) that is 1 on real tokens (padding on the right):

    h    = wte[ids] + wpe[0:T]                                        (P, T, d)
    A    = attn(ln_1(h))      causal multi-head softmax attention,     (P, T, d)
                              keys restricted to real tokens, scale 1/sqrt(d / n_head)
    Z    = β_a h + A
    h    = β_f Z + mlp(ln_2(Z))  with mlp = c_proj ∘ gelu_tanh ∘ c_fc
    logits = ln_f(h)[p, last real token of p] @ W_head                (P, num_classes)

β_a = β_f = 1 is GPT-2; β = 0 removes the skips and keeps every LayerNorm. As in `transformer`, the
β are call arguments, not parameters. Parameter paths are the names of Hugging Face's checkpoint
(`wte.weight`, `h.0.attn.c_attn.weight`, ...); its Conv1D weights are stored (in, out), which is
the layout used here: a checkpoint is copied, never transposed. Dropout is off (there is none).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

INIT_STD = 0.02  # Hugging Face's `initializer_range` for GPT-2


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    """GPT-2's sizes (Hugging Face's config names), the truncation L and the head's width.

    Defaults are GPT-2 small (`openai-community/gpt2`) truncated to all 12 blocks.
    """

    vocab_size: int = 50257
    n_positions: int = 1024  # longest sequence (learned positions)
    n_embd: int = 768  # width d
    n_head: int = 12
    n_layer: int = 12  # blocks of the full model (sets the c_proj init scale)
    layer_norm_epsilon: float = 1e-5
    num_layers: int = 12  # L: the first L blocks are used
    num_classes: int = 2
    dtype: Literal["float32", "float64"] = "float32"  # of the weights (float64 needs x64)

    def __post_init__(self):
        if not 1 <= self.num_layers <= self.n_layer:
            raise ValueError(
                f"GPT-2 truncation num_layers={self.num_layers} must be between 1 and "
                f"n_layer={self.n_layer}"
            )
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPT-2 n_embd={self.n_embd} is not a multiple of n_head={self.n_head}"
            )

    @classmethod
    def from_hf_config(
        cls, hf_config: dict, num_layers: int, num_classes: int, dtype: str = "float32"
    ) -> GPT2Config:
        """The config of a Hugging Face `config.json` (a dict), truncated to `num_layers` blocks.

        Options that change GPT-2's equations are refused rather than silently ignored, and so
        are sizes that are not positive integers (ValueError, one line).
        """
        if not isinstance(hf_config, dict):
            raise ValueError(f"expected a JSON object, got a {type(hf_config).__name__}")
        _check_supported(hf_config)
        names = ("vocab_size", "n_positions", "n_embd", "n_head", "n_layer", "layer_norm_epsilon")
        sizes = {name: hf_config[name] for name in names if name in hf_config}
        _check_sizes(sizes)
        return cls(**sizes, num_layers=num_layers, num_classes=num_classes, dtype=dtype)


def _check_sizes(sizes: dict) -> None:
    """One-line ValueError unless every size is a positive integer and layer_norm_epsilon a
    positive number."""
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            ok = False
        elif name == "layer_norm_epsilon":
            ok = math.isfinite(value) and value > 0
        else:
            ok = isinstance(value, int) and value > 0
        if not ok:
            kind = "number" if name == "layer_norm_epsilon" else "integer"
            raise ValueError(f"{name}={value!r}: expected a positive {kind}")


def _check_supported(hf_config: dict) -> None:
    """One-line ValueError for Hugging Face GPT-2 options this model does not compute."""
    unsupported = []
    if hf_config.get("activation_function", "gelu_new") != "gelu_new":
        unsupported.append(f"activation_function={hf_config['activation_function']!r}")
    n_inner = hf_config.get("n_inner")
    if n_inner is not None and n_inner != 4 * hf_config.get("n_embd", 768):
        unsupported.append(f"n_inner={n_inner}")
    if not hf_config.get("scale_attn_weights", True):
        unsupported.append("scale_attn_weights=false")
    if hf_config.get("scale_attn_by_inverse_layer_idx", False):
        unsupported.append("scale_attn_by_inverse_layer_idx=true")
    if unsupported:
        raise ValueError(f"unsupported GPT-2 config options: {', '.join(unsupported)}")


def make_rngs(seed: int) -> nnx.Rngs:
    """Random streams for `GPT2Classifier`: `params` for the GPT-2 body, `head` for the head.

    The head has its own stream so that a checkpoint's body with `seed` gets the same head as
    `init_params(cfg, seed)`.
    """
    body_key, head_key = jax.random.split(jax.random.key(seed))
    return nnx.Rngs(params=body_key, head=head_key)


def _normal(key: jax.Array, shape: tuple[int, ...], std: float, dtype: str) -> nnx.Param:
    """(shape) N(0, std²) weights, drawn in float32 whatever `dtype` (same seed, same weights)."""
    return nnx.Param((std * jax.random.normal(key, shape, jnp.float32)).astype(dtype))


class Embedding(nnx.Module):
    """A lookup table `weight` (num, d)."""

    def __init__(self, num: int, d: int, *, dtype: str, rngs: nnx.Rngs):
        self.weight = _normal(rngs.params(), (num, d), INIT_STD, dtype)


class LayerNorm(nnx.Module):
    """torch.nn.LayerNorm over the last axis: (..., d) -> (..., d), with ε from the config."""

    def __init__(self, d: int, eps: float, *, dtype: str):
        self.weight = nnx.Param(jnp.ones((d,), dtype))
        self.bias = nnx.Param(jnp.zeros((d,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        mean = x.mean(-1, keepdims=True)
        var = jnp.square(x - mean).mean(-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + self.eps) * self.weight[...] + self.bias[...]


class Conv1D(nnx.Module):
    """Hugging Face's Conv1D, an affine map with `weight` stored (n_in, n_out): (..., n_in) ->
    (..., n_out)."""

    def __init__(self, n_in: int, n_out: int, std: float, *, dtype: str, rngs: nnx.Rngs):
        self.weight = _normal(rngs.params(), (n_in, n_out), std, dtype)
        self.bias = nnx.Param(jnp.zeros((n_out,), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        return x @ self.weight[...] + self.bias[...]


def _proj_std(cfg: GPT2Config) -> float:
    """Init std of the c_proj weights, scaled by the full model's depth as Hugging Face does."""
    return INIT_STD / math.sqrt(2 * cfg.n_layer)


class Attention(nnx.Module):
    """Causal multi-head softmax attention; q|k|v packed along c_attn's output axis."""

    def __init__(self, cfg: GPT2Config, *, rngs: nnx.Rngs):
        d = cfg.n_embd
        self.c_attn = Conv1D(d, 3 * d, INIT_STD, dtype=cfg.dtype, rngs=rngs)
        self.c_proj = Conv1D(d, d, _proj_std(cfg), dtype=cfg.dtype, rngs=rngs)
        self.n_head = cfg.n_head

    def __call__(self, x: jax.Array, allowed: jax.Array) -> jax.Array:
        """(P, T, d) and the (P, T, T) boolean mask of keys each query may see -> (P, T, d)."""
        num, length, d = x.shape
        head_dim = d // self.n_head
        q, k, v = (
            y.reshape(num, length, self.n_head, head_dim)
            for y in jnp.split(self.c_attn(x), 3, axis=-1)
        )
        logits = jnp.einsum("pthe,pshe->phts", q, k) / jnp.sqrt(head_dim).astype(q.dtype)
        # HF's mask value: a finite minimum, so a query without any key stays finite
        logits = jnp.where(allowed[:, None], logits, jnp.finfo(logits.dtype).min)
        out = jnp.einsum("phts,pshe->pthe", jax.nn.softmax(logits, axis=-1), v)
        return self.c_proj(out.reshape(num, length, d))


class MLP(nnx.Module):
    """c_proj(gelu_new(c_fc(x))): (..., d) -> (..., d), hidden width 4d."""

    def __init__(self, cfg: GPT2Config, *, rngs: nnx.Rngs):
        d = cfg.n_embd
        self.c_fc = Conv1D(d, 4 * d, INIT_STD, dtype=cfg.dtype, rngs=rngs)
        self.c_proj = Conv1D(4 * d, d, _proj_std(cfg), dtype=cfg.dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.c_proj(jax.nn.gelu(self.c_fc(x), approximate=True))


class Block(nnx.Module):
    """One pre-LN GPT-2 block with residual coefficients β_a and β_f."""

    def __init__(self, cfg: GPT2Config, *, rngs: nnx.Rngs):
        self.ln_1 = LayerNorm(cfg.n_embd, cfg.layer_norm_epsilon, dtype=cfg.dtype)
        self.attn = Attention(cfg, rngs=rngs)
        self.ln_2 = LayerNorm(cfg.n_embd, cfg.layer_norm_epsilon, dtype=cfg.dtype)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(
        self, h: jax.Array, allowed: jax.Array, beta_attn, beta_ffn
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(P, T, d) and the (P, T, T) key mask -> (h_out, attn, z), each (P, T, d)."""
        attn = self.attn(self.ln_1(h), allowed)
        z = beta_attn * h + attn
        return beta_ffn * z + self.mlp(self.ln_2(z)), attn, z


class ClassifierHead(nnx.Module):
    """A linear head without bias, `weight` (d, num_classes), drawn from the `head` stream."""

    def __init__(self, cfg: GPT2Config, *, rngs: nnx.Rngs):
        self.weight = _normal(rngs.head(), (cfg.n_embd, cfg.num_classes), INIT_STD, cfg.dtype)


class GPT2Classifier(nnx.Module):
    """The first L GPT-2 blocks, ln_f, and a linear head on each sequence's last real token."""

    def __init__(self, cfg: GPT2Config, *, rngs: nnx.Rngs):
        self.wte = Embedding(cfg.vocab_size, cfg.n_embd, dtype=cfg.dtype, rngs=rngs)
        self.wpe = Embedding(cfg.n_positions, cfg.n_embd, dtype=cfg.dtype, rngs=rngs)
        self.h = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.ln_f = LayerNorm(cfg.n_embd, cfg.layer_norm_epsilon, dtype=cfg.dtype)
        self.head = ClassifierHead(cfg, rngs=rngs)

    def __call__(
        self,
        inputs: dict[str, jax.Array],
        beta_attn: jax.Array | float = 1.0,
        beta_ffn: jax.Array | float = 1.0,
        *,
        return_intermediates: bool = False,
    ) -> jax.Array | tuple[jax.Array, dict[str, jax.Array]]:
        """Logits (P, num_classes) of {"ids": int (P, T), "mask": (P, T), 1 on real tokens}.

        Padding must be on the right. With `return_intermediates`, also returns, from the same
        pass, {"attn": attn(ln_1(h)), "z": β_a h + attn}, each (L, P, T, d), and "row_mask":
        the mask (P, T) in the weights' dtype (padding rows of attn and z are finite, not zero).
        """
        ids, mask = inputs["ids"], inputs["mask"]
        h, allowed = self._embed(ids, mask)
        attns, zs = [], []
        for block in self.h:
            h, attn, z = block(h, allowed, beta_attn, beta_ffn)
            attns.append(attn)
            zs.append(z)
        last = mask.astype(jnp.int32).sum(-1) - 1  # (P,) index of the last real token
        pooled = jnp.take_along_axis(self.ln_f(h), last[:, None, None], axis=1)[:, 0]
        logits = pooled @ self.head.weight[...]
        if return_intermediates:
            row_mask = mask.astype(logits.dtype)
            return logits, {"attn": jnp.stack(attns), "z": jnp.stack(zs), "row_mask": row_mask}
        return logits

    def _embed(self, ids: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Token + position embeddings (P, T, d) and the causal ∧ real-key mask (P, T, T)."""
        if ids.ndim != 2 or mask.shape != ids.shape:
            raise ValueError(
                f"GPT-2 inputs: ids {ids.shape} and mask {mask.shape} must both be (P, T)"
            )
        length = ids.shape[1]
        n_positions = self.wpe.weight[...].shape[0]
        if length > n_positions:
            raise ValueError(f"sequence length {length} exceeds GPT-2's n_positions={n_positions}")
        h = jnp.take(self.wte.weight[...], ids, axis=0) + self.wpe.weight[...][:length]
        causal = jnp.tril(jnp.ones((length, length), bool))
        return h, causal[None] & mask.astype(bool)[:, None, :]


def init_head(cfg: GPT2Config, seed: int) -> dict:
    """The classification head of `init_params(cfg, seed)`, {"weight": (d, num_classes)}, drawn
    alone (the head has its own random stream)."""
    return nnx.to_pure_dict(nnx.state(ClassifierHead(cfg, rngs=make_rngs(seed))))


def init_params(cfg: GPT2Config, seed: int) -> tuple[nnx.GraphDef, dict]:
    """The model's graph definition and GPT-2's random init as a plain nested dict, for `seed`.

    N(0, 0.02²) embeddings and weights, N(0, 0.02²/(2 n_layer)) c_proj weights, zero biases, unit
    LayerNorm scales; the paths are Hugging Face's names (params["h"][0]["attn"]["c_attn"]...).
    """
    graphdef, state = nnx.split(GPT2Classifier(cfg, rngs=make_rngs(seed)))
    return graphdef, nnx.to_pure_dict(state)


def apply(graphdef: nnx.GraphDef, params: dict, inputs: dict, beta_attn, beta_ffn, **kwargs):
    """Pure forward pass of `GPT2Classifier.__call__` from a parameter dict."""
    return nnx.merge(graphdef, params)(inputs, beta_attn, beta_ffn, **kwargs)
