"""Synthetic data for the theory regime: seeded Gaussian inputs, Gaussian or teacher targets."""

from __future__ import annotations

import ml_collections
import numpy as np

from resconv_jax.data import Dataset
from resconv_jax.runtime import memory

NAME = __name__.rpartition(".")[2]
TARGETS = ("gaussian", "teacher")


def default_config() -> ml_collections.ConfigDict:
    """The `config.data` section of synthetic data (the base config's)."""
    c = ml_collections.ConfigDict()
    c.name = NAME
    c.num_samples = 8  # P
    c.seq_len = 8  # M
    c.dim = 64  # d (the theory regime wants d >= P*M)
    c.out_dim = 1  # d_y
    c.target = "gaussian"  # "gaussian" targets, or "teacher" (random same-architecture model)
    c.seed = 0  # data seed (shared by every run of a sweep)
    c.teacher_seed = 1  # parameter seed of the teacher
    return c


def shapes(data_cfg, dim: int | None = None) -> dict[str, int]:
    """The data's sizes from the config alone: P, M, d (`dim`, the widest of a width sweep, or
    data.dim) and d_y."""
    d = dim or data_cfg.dim
    return {
        "num_samples": data_cfg.num_samples,
        "seq_len": data_cfg.seq_len,
        "d": d,
        "d_y": data_cfg.out_dim,
    }


def describe_sizes(config) -> str:
    """One line for the sizes table: P, M and d (every width of a width sweep)."""
    data, widths = config.data, config.sweep.dim
    d = "{" + ", ".join(f"{v:g}" for v in widths) + "}" if widths else str(data.dim)
    return f"P={data.num_samples} Gaussian samples of M={data.seq_len}, d={d}"


def check_size(data_cfg, dim: int | None = None) -> None:
    """ConfigError when the data (at width `dim`, the widest of a width sweep, or data.dim)
    cannot fit: from the config alone, before anything is drawn."""
    memory.check_synthetic_data(data_cfg, dim)


def load(data_cfg) -> Dataset:
    """P samples X_p ~ N(0, 1)^{M×d}; targets Y_p (M × d_y) from `data_cfg.target`.

    "gaussian": Y_p ~ N(0, 1). "teacher": Y_p = F_teacher(X_p), a random model of the trained
    architecture (β_a = β_f = 1, seeded by `data_cfg.teacher_seed`), rescaled to unit variance:
    the trainer fills them in (`Dataset.with_teacher_targets`) once the model is built.
    """
    if data_cfg.target not in TARGETS:
        raise ValueError(
            f"config.data.target: unknown target {data_cfg.target!r} (expected gaussian or teacher)"
        )
    rng = np.random.default_rng(data_cfg.seed)
    shape = (data_cfg.num_samples, data_cfg.seq_len)
    x = rng.standard_normal((*shape, data_cfg.dim)).astype(np.float32)
    teacher = data_cfg.target == "teacher"
    if teacher:
        y = np.zeros((*shape, data_cfg.out_dim), np.float32)
    else:
        y = rng.standard_normal((*shape, data_cfg.out_dim)).astype(np.float32)
    description = f"synthetic {data_cfg.target}: P={shape[0]} M={shape[1]} d={data_cfg.dim}"
    return Dataset(x, y, None, None, description, data_cfg.teacher_seed if teacher else None)
