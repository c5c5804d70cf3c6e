"""A sweep: its runs, each a setting of (seed, lr, β_a, β_f), and their groups by shape.

Runs that share parameter shapes are one compiled, vmapped program; the shape-changing sweep
fields, `sweep.num_layers` (depth L) and `sweep.dim` (embedding width d of synthetic data), make
one group per (L, d), trained one after another.
"""

from __future__ import annotations

import dataclasses
import itertools
import re

import numpy as np

from resconv_jax.models.interface import RunSettings


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One run of a sweep."""

    index: int
    seed: int
    lr: float
    beta_attn: float
    beta_ffn: float
    num_layers: int | None = None  # set when the sweep varies the depth L
    dim: int | None = None  # set when the sweep varies the width d

    @property
    def shape(self) -> tuple[int | None, int | None]:
        """(L, d) where swept, else None: runs of one shape are one program."""
        return self.num_layers, self.dim

    def settings(self) -> dict:
        """The run's index and settings, as written on every metrics line."""
        settings = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        return {"run": settings.pop("index"), **settings}


def expand_runs(config) -> list[RunSpec]:
    """The product of the sweep lists (depth outermost, then seed, lr, β innermost); empty lists
    use the single values of the config."""
    seeds = config.sweep.seed or (config.seed,)
    lrs = config.sweep.lr or (config.optim.lr,)
    if config.sweep.beta:
        betas = [(b, b) for b in config.sweep.beta]
    else:
        betas = list(
            itertools.product(
                config.sweep.beta_attn or (config.model.beta_attn,),
                config.sweep.beta_ffn or (config.model.beta_ffn,),
            )
        )
    depths = config.sweep.get("num_layers", ()) or (None,)
    dims = config.sweep.get("dim", ()) or (None,)
    combos = itertools.product(depths, dims, seeds, lrs, betas)
    return [
        RunSpec(i, int(seed), float(lr), float(b_attn), float(b_ffn), layers, dim)
        for i, (layers, dim, seed, lr, (b_attn, b_ffn)) in enumerate(combos)
    ]


def group_runs(runs: list[RunSpec]) -> list[tuple[tuple, list[RunSpec]]]:
    """((L, d), its runs) per shape, in sweep order; one ((None, None), runs) group when neither
    is swept."""
    groups: dict[tuple, list[RunSpec]] = {}
    for run in runs:
        groups.setdefault(run.shape, []).append(run)
    return list(groups.items())


def group_folder(shape: tuple[int | None, int | None]) -> str:
    """The run directory of one shape group under WORKDIR: layers_<L>, dim_<d> or both."""
    layers, dim = shape
    parts = ([f"layers_{layers}"] if layers is not None else []) + (
        [f"dim_{dim}"] if dim is not None else []
    )
    return "_".join(parts)


_GROUP_NAME = re.compile(r"(?:layers_(\d+))?_?(?:dim_(\d+))?")


def group_shape(name: str) -> tuple[int | None, int | None] | None:
    """The shape whose `group_folder` is `name`, or None for any other name."""
    match = _GROUP_NAME.fullmatch(name)
    if not match or not name:
        return None
    shape = tuple(None if v is None else int(v) for v in match.groups())
    return shape if group_folder(shape) == name else None


def group_config(config, shape: tuple[int | None, int | None]):
    """`config` with one shape of its depth or width sweep set (model.num_layers, data.dim) and
    those sweep lists emptied; `config` itself when neither is swept."""
    layers, dim = shape
    if layers is None and dim is None:
        return config
    with config.unlocked():
        resolved = config.copy_and_resolve_references()
    with resolved.unlocked():
        if layers is not None:
            resolved.model.num_layers = layers
        if dim is not None:
            resolved.data.dim = dim
        resolved.sweep.num_layers = ()
        resolved.sweep.dim = ()
    return resolved


def run_settings(runs: list[RunSpec]) -> RunSettings:
    """The runs' model settings, stacked: each field a float32 array of shape (R,)."""
    return RunSettings(
        beta_attn=np.array([r.beta_attn for r in runs], np.float32),
        beta_ffn=np.array([r.beta_ffn for r in runs], np.float32),
    )
