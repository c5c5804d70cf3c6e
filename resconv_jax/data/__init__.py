"""Data sets by name: `config.data.name = NAME` is the module `resconv_jax.data.NAME`, which
provides

    default_config() -> ConfigDict   the whole `config.data` section (with name = NAME)
    load(data_cfg) -> Dataset        full-batch arrays; the trainer shards them over 'data'

and may provide `shapes(data_cfg, dim)` and `check_size(data_cfg, dim)` (its sizes, and a size
that cannot fit, from the config alone, before anything is drawn; `dim` the widest of a width
sweep, or 0). The file formats behind them are in `formats/`. Adding a data set is one new module
here; no list elsewhere changes.
"""

from __future__ import annotations

import dataclasses
import functools
from types import ModuleType

import jax
import numpy as np

from resconv_jax.by_name import import_named, modules_providing
from resconv_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Dataset:
    """Full-batch training (and optional validation) data.

    x_train: the model's inputs, (P, M, d) windows or {"ids", "mask"} (P, T) tokens; y_train:
    (P, M, d_y) regression targets or (P,) int class labels; x_val, y_val likewise with P_val
    samples, or None. teacher_seed: when set, y_train is a placeholder of the right shape, to be
    replaced by the outputs of a random model of the trained architecture
    (`with_teacher_targets`).
    """

    x_train: np.ndarray | dict[str, np.ndarray]
    y_train: np.ndarray
    x_val: np.ndarray | dict[str, np.ndarray] | None
    y_val: np.ndarray | None
    description: str
    teacher_seed: int | None = None

    @property
    def num_train(self) -> int:
        """P, the training samples."""
        return int(self.y_train.shape[0])

    @property
    def num_val(self) -> int:
        """P_val, the validation samples (0 without a validation set)."""
        return 0 if self.y_val is None else int(self.y_val.shape[0])

    def with_teacher_targets(self, model, settings) -> Dataset:
        """Targets Y_p = F_teacher(X_p) of `model` (a `models.Model`) at parameters drawn from
        `teacher_seed` and its `settings` (`models.RunSettings`), rescaled to unit variance.
        ConfigError when they cannot be: all equal (a readout initialized at zero) or not
        finite."""
        params = model.init(self.teacher_seed)
        y = np.asarray(jax.jit(lambda p, x: model.apply(p, x, settings))(params, self.x_train))
        spread = float(y.std())
        if not (np.isfinite(spread) and spread > 0):
            problem = "all equal" if spread == 0 else f"not finite (std {spread})"
            raise ConfigError(
                f"config.data.target='teacher': the teacher's outputs are {problem}, so they "
                "cannot be scaled to unit variance (a readout initialized at zero gives all "
                "zeros); use data.target='gaussian' or a model whose readout is not zero at init"
            )
        return dataclasses.replace(self, y_train=y / spread, teacher_seed=None)


@functools.cache
def data_names() -> tuple[str, ...]:
    """The data sets that exist: the modules of this package with `default_config` and `load`."""
    return modules_providing(__name__, __path__, ("default_config", "load"))


def data_module(name: str) -> ModuleType:
    """The module of data set `name` (one of `data_names()`)."""
    refusal = ValueError(f"no data set {name!r} (the data sets: {', '.join(data_names())})")
    return import_named(__name__, name, data_names(), refusal)


def load_dataset(config) -> Dataset:
    """The data set named by `config.data.name`, loaded from `config.data`."""
    return data_module(config.data.name).load(config.data)
