"""Data sets: synthetic theory data and Jena Climate, as full-batch arrays.

`load_dataset(config)` returns a `Dataset` for `config.data.name`; the training loop puts its arrays
on device once, sharded over the mesh's 'data' axis.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Dataset:
    """Full-batch training (and optional validation) data.

    x_train: (P, M, d), y_train: (P, M, d_y); x_val, y_val likewise with P_val samples, or None.
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray | None
    y_val: np.ndarray | None
    description: str


def load_dataset(config) -> Dataset:
    """Builds the data set named by `config.data.name` ("synthetic" or "jena")."""
    name = config.data.name
    if name == "synthetic":
        from resconv_jax.data.synthetic import make_synthetic

        return make_synthetic(config.data, config.model)
    if name == "jena":
        from resconv_jax.data.jena import load_jena

        splits = load_jena(config.data)
        return Dataset(
            splits.x_train, splits.y_train, splits.x_val, splits.y_val, description=splits.source
        )
    raise ValueError(f"config.data.name: unknown data set {name!r} (expected synthetic or jena)")
