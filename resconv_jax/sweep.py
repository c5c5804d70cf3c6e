"""A sweep: its runs, each a setting of (seed, lr, β_a, β_f), and their groups by depth.

Runs that share parameter shapes are one compiled, vmapped program; `sweep.num_layers` (the one
shape-changing sweep field) makes one group per depth L, trained one after another.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One run of a sweep."""

    index: int
    seed: int
    lr: float
    beta_attn: float
    beta_ffn: float
    num_layers: int | None = None  # set when the sweep varies the depth L

    def settings(self) -> dict:
        """The run's index and settings, as written on every metrics line."""
        settings = dataclasses.asdict(self)
        if settings["num_layers"] is None:
            del settings["num_layers"]
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
    combos = itertools.product(depths, seeds, lrs, betas)
    return [
        RunSpec(i, int(seed), float(lr), float(b_attn), float(b_ffn), layers)
        for i, (layers, seed, lr, (b_attn, b_ffn)) in enumerate(combos)
    ]


def group_runs(runs: list[RunSpec]) -> list[tuple[int | None, list[RunSpec]]]:
    """(L, its runs) per depth, in sweep order; one (None, runs) group without a depth sweep."""
    groups: dict[int | None, list[RunSpec]] = {}
    for run in runs:
        groups.setdefault(run.num_layers, []).append(run)
    return list(groups.items())


def run_hparams(runs: list[RunSpec]) -> dict[str, np.ndarray]:
    """Per-run residual coefficients as float32 arrays of shape (R,)."""
    return {
        "beta_attn": np.array([r.beta_attn for r in runs], np.float32),
        "beta_ffn": np.array([r.beta_ffn for r in runs], np.float32),
    }
