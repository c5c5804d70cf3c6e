"""Models behind one interface (`interface.Model`): the paper's Transformer and GPT-2.

`build_model(config.model, dataset)` builds the one named by `config.model.name` for the data's
shapes; the trainer imports no concrete model.
"""

from __future__ import annotations

import numpy as np

from resconv_jax.models.interface import Model

__all__ = ["Model", "build_model"]


def build_model(model_cfg, dataset) -> Model:
    """`model_cfg.name`: "transformer" (the paper's, sized by the data's d and d_y) or "gpt2"
    (`model_cfg.weights`: a Hugging Face folder, a hub id, or "random" of `model_cfg.gpt2_shape`;
    truncated to `model_cfg.num_layers` blocks, a head with one output per class)."""
    name = model_cfg.get("name", "transformer")
    if name == "transformer":
        from resconv_jax.models import transformer

        d, d_y = dataset.x_train.shape[-1], dataset.y_train.shape[-1]
        return transformer.make_model(transformer.model_config(model_cfg, d=d, d_y=d_y))
    from resconv_jax.models import gpt2, weights

    num_classes = int(np.max(dataset.y_train)) + 1
    shape = dict(model_cfg.gpt2_shape) if model_cfg.weights == "random" else None
    cfg, graphdef, body = weights.load_gpt2(
        model_cfg.weights,
        num_layers=model_cfg.num_layers,
        num_classes=num_classes,
        seed=0,
        shape=shape,
        dtype=model_cfg.dtype,
    )

    def init(seed: int) -> dict:
        if shape:  # a random model: all of it from the run's seed
            return gpt2.init_params(cfg, seed)[1]
        return body | {"head": gpt2.init_head(cfg, seed)}

    origin = "random init (not the pretrained model)" if shape else model_cfg.weights
    return Model(
        graphdef=graphdef,
        forward=gpt2.apply,
        init=init,
        description=(
            f"GPT-2 {origin}: first {cfg.num_layers} of {cfg.n_layer} blocks, d={cfg.n_embd}, "
            f"{cfg.n_head} heads, a ({cfg.n_embd}, {num_classes}) head drawn from each run's seed"
        ),
    )
