"""GPT-2 (`config.model.name = "gpt2"`): Hugging Face's GPT-2 truncated to its first L blocks,
with a classification head (`modeling`), from a checkpoint folder, a hub id, or random
(`weights`). Its own fields are `config.model.gpt2.*`; its depth L and dtype are the shared
`config.model.num_layers`, `.dtype`.
"""

from __future__ import annotations

import ml_collections
import numpy as np

from resconv_jax.errors import WeightsError
from resconv_jax.models.gpt2 import modeling, weights
from resconv_jax.models.interface import Model, RunSettings

NAME = __name__.rpartition(".")[2]


def default_config() -> ml_collections.ConfigDict:
    """This model's own fields: `config.model.gpt2.*`."""
    c = ml_collections.ConfigDict()
    # A Hugging Face model folder (config.json + model.safetensors), a hub id such as
    # "openai-community/gpt2" (its local cache first), or "random" (`shape` below).
    c.weights = "random"
    c.shape = ml_collections.ConfigDict(  # GPT-2 small; for weights="random" only
        {"n_embd": 768, "n_head": 12, "n_layer": 12, "n_positions": 1024, "vocab_size": 50257}
    )
    return c


def check_available(model_cfg, num_layers: int) -> None:
    """WeightsError (one line) when the named weights cannot be found, or lack a tensor of the
    first `num_layers` blocks (the sweep's deepest L); for "random", ValueError when the shape
    has fewer blocks than that: before any other work."""
    if model_cfg[NAME].weights == "random":
        weights.check_random_shape(dict(model_cfg[NAME].shape), num_layers)
    else:
        weights.check_fits(model_cfg[NAME].weights, num_layers)


def describe_sizes(model_cfg) -> str:
    """For the sizes table: ", GPT-2 (pretrained)" or ", GPT-2 (random-init)"."""
    kind = "random-init" if model_cfg[NAME].weights == "random" else "pretrained"
    return f", GPT-2 ({kind})"


def distinct_prefixes(ids: np.ndarray, mask: np.ndarray, enough: int) -> int:
    """Distinct token prefixes among the real tokens of ids, mask (P, T) (right-padded), counted
    up to `enough`. A causal model gives two tokens with the same prefix the same row of Z, so
    this bounds the rank of the stacked Z over real tokens."""
    seen: set[bytes] = set()
    for row, length in zip(ids, mask.sum(axis=1), strict=True):
        seen.update(row[: t + 1].tobytes() for t in range(int(length)))
        if len(seen) >= enough:
            break
    return min(len(seen), enough)


def _rank_note(dataset, d: int) -> str:
    """'' or, when the training set's stacked Z cannot have rank d, the note that says so."""
    distinct = distinct_prefixes(
        np.asarray(dataset.x_train["ids"]), np.asarray(dataset.x_train["mask"]), d
    )
    if distinct >= d:
        return ""
    return (
        f"; note: the training set has {distinct} distinct token prefixes < d={d}, so the "
        "stacked Z over its real tokens has σ_min(Z) = 0 by construction and σ_min(Z)/‖Z‖_F "
        "measures rounding, not conditioning (more sentences: data.num_train)"
    )


def _check_token_ids(dataset, vocab_size: int) -> None:
    """WeightsError (one line) when a token id of the data is past the embedding table (its
    lookup would give NaN from the first step): a tokenizer of another vocabulary."""
    inputs = [dataset.x_train] + ([dataset.x_val] if dataset.x_val is not None else [])
    largest = max(int(np.max(x["ids"])) for x in inputs)
    if largest >= vocab_size:
        raise WeightsError(
            f"the data has token ids up to {largest} but GPT-2's vocab_size is {vocab_size}: "
            "use the tokenizer of these weights (data.tokenizer_dir) or a larger "
            "model.gpt2.shape.vocab_size"
        )


def _forward(graphdef, params, inputs, settings: RunSettings, *, return_intermediates=False):
    return modeling.apply(
        graphdef, params, inputs, *settings, return_intermediates=return_intermediates
    )


def build(model_cfg, dataset) -> Model:
    """GPT-2's first `model_cfg.num_layers` blocks, with a (d, classes) head for `dataset`'s
    integer labels (P,); the body from `config.model.gpt2.weights`, the head (and, for random
    weights, everything) drawn from each run's seed."""
    own = model_cfg[NAME]
    labels = [dataset.y_train] + ([dataset.y_val] if dataset.y_val is not None else [])
    num_classes = max(2, *(int(np.max(y)) + 1 for y in labels))  # a class for every label seen
    shape = dict(own.shape) if own.weights == "random" else None
    cfg, graphdef, body = weights.load_gpt2(
        own.weights,
        num_layers=model_cfg.num_layers,
        num_classes=num_classes,
        seed=0,
        shape=shape,
        dtype=model_cfg.dtype,
    )

    _check_token_ids(dataset, cfg.vocab_size)

    def init(seed: int) -> dict:
        if shape:  # a random model: all of it from the run's seed
            return modeling.init_params(cfg, seed)[1]
        return body | {"head": modeling.init_head(cfg, seed)}

    origin = "random init (not the pretrained model)" if shape else own.weights
    return Model(
        graphdef=graphdef,
        forward=_forward,
        init=init,
        description=(
            f"GPT-2 {origin}: first {cfg.num_layers} of {cfg.n_layer} blocks, d={cfg.n_embd}, "
            f"{cfg.n_head} heads, a ({cfg.n_embd}, {num_classes}) head drawn from each run's seed"
            + _rank_note(dataset, cfg.n_embd)
        ),
    )
