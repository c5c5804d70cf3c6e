"""Data sets: synthetic theory data, Jena Climate and SST-2, as full-batch arrays.

`load_dataset(config)` returns a `Dataset` for `config.data.name`; the training loop puts its arrays
on device once, sharded over the mesh's 'data' axis.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Dataset:
    """Full-batch training (and optional validation) data.

    x_train: the model's inputs, (P, M, d) windows or {"ids", "mask"} (P, T) tokens; y_train:
    (P, M, d_y) regression targets or (P,) int class labels; x_val, y_val likewise with P_val
    samples, or None.
    """

    x_train: np.ndarray | dict[str, np.ndarray]
    y_train: np.ndarray
    x_val: np.ndarray | dict[str, np.ndarray] | None
    y_val: np.ndarray | None
    description: str

    @property
    def num_train(self) -> int:
        """P, the training samples."""
        return int(self.y_train.shape[0])

    @property
    def num_val(self) -> int:
        """P_val, the validation samples (0 without a validation set)."""
        return 0 if self.y_val is None else int(self.y_val.shape[0])


def load_dataset(config) -> Dataset:
    """Builds the data set named by `config.data.name` ("synthetic", "jena" or "sst2")."""
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
    if name == "sst2":
        from resconv_jax.data.sst2 import load_sst2

        s = load_sst2(config.data)
        return Dataset(
            {"ids": s.ids_train, "mask": s.mask_train},
            s.labels_train,
            {"ids": s.ids_val, "mask": s.mask_val},
            s.labels_val,
            description=s.description,
        )
    raise ValueError(
        f"config.data.name: unknown data set {name!r} (expected synthetic, jena or sst2)"
    )
