"""Models by name: `config.model.name = NAME` is the module `resconv_jax.models.NAME` (a file or a
folder), which provides

    default_config() -> ConfigDict   its own section, config.model.NAME
    build(model_cfg, dataset) -> Model   (`interface.Model`), for the data's shapes

and may provide `validate(model_cfg)` (ConfigError for a value it cannot run), `check_available(
model_cfg, num_layers)` (weights it needs for the sweep's deepest L, checked before anything
else) and `check_size(model_cfg, **shapes)`
(a size that cannot fit, refused from the shapes). `model_cfg` is the whole `config.model`
section: the shared fields (name, num_layers, dtype, beta_attn, beta_ffn) and every model's own
section. Adding a model is one new module here; no list elsewhere changes.
"""

from __future__ import annotations

import functools
from types import ModuleType

from resconv_jax.by_name import import_named, modules_providing
from resconv_jax.models.interface import Model, RunSettings

__all__ = ["Model", "RunSettings", "build_model", "model_module", "model_names"]


@functools.cache
def model_names() -> tuple[str, ...]:
    """The models that exist: the modules of this package with `default_config` and `build`."""
    return modules_providing(__name__, __path__, ("default_config", "build"))


def model_module(name: str) -> ModuleType:
    """The module of model `name` (one of `model_names()`)."""
    refusal = ValueError(f"no model {name!r} (the models: {', '.join(model_names())})")
    return import_named(__name__, name, model_names(), refusal)


def build_model(model_cfg, dataset) -> Model:
    """The model named by `model_cfg.name`, built for `dataset`'s shapes."""
    return model_module(model_cfg.name).build(model_cfg, dataset)
