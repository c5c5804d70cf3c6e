"""Synthetic data for the theory regime: seeded Gaussian inputs, Gaussian or teacher targets."""

from __future__ import annotations

import jax
import numpy as np

from resconv_jax.data import Dataset
from resconv_jax.models import transformer


def make_synthetic(data_cfg, model_cfg) -> Dataset:
    """P samples X_p ~ N(0, 1)^{M×d}; targets Y_p (M × d_y) from `data_cfg.target`.

    "gaussian": Y_p ~ N(0, 1). "teacher": Y_p = F_teacher(X_p), a random Transformer of the same
    architecture (β_a = β_f = 1, seeded by `data_cfg.teacher_seed`), rescaled to unit variance.
    """
    rng = np.random.default_rng(data_cfg.seed)
    shape = (data_cfg.num_samples, data_cfg.seq_len)
    x = rng.standard_normal((*shape, data_cfg.dim)).astype(np.float32)
    if data_cfg.target == "gaussian":
        y = rng.standard_normal((*shape, data_cfg.out_dim)).astype(np.float32)
    elif data_cfg.target == "teacher":
        cfg = transformer.model_config(model_cfg, d=data_cfg.dim, d_y=data_cfg.out_dim)
        graphdef, params = transformer.init_params(cfg, data_cfg.teacher_seed)
        y = np.asarray(jax.jit(transformer.apply, static_argnums=0)(graphdef, params, x, 1.0, 1.0))
        y = y / y.std()
    else:
        raise ValueError(
            f"config.data.target: unknown target {data_cfg.target!r} (expected gaussian or teacher)"
        )
    description = f"synthetic {data_cfg.target}: P={shape[0]} M={shape[1]} d={data_cfg.dim}"
    return Dataset(x, y, None, None, description)
